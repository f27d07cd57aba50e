// dgr::Engine: one process's share of a GGUF model, layers [layer_start, layer_end).
//
// All Cython sees of llama.cpp is this header: the llama types stay behind a pimpl.
// Every method reports failure as a dgr::Status; none aborts on bad input, and none lets a
// C++ exception out (one thrown inside llama.cpp comes back as kEngineError).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dgr/status.h"

namespace dgr {

struct EngineConfig {
    std::string model_path;
    int32_t  layer_start = 0;
    int32_t  layer_end   = -1;   // -1: n_layer
    // Settings that decide numerics: explicit, never "auto", identical on every stage of a route.
    // Context tokens per slot; 0: the model's trained context (n_ctx_train), capped by what
    // kv_budget holds (EngineInfo::n_ctx is the one chosen, n_ctx_source says why). The tokens a
    // slot holds do not change a row's bits (llama.cpp attends over the used cells, padded to
    // 256, whatever the cache's size), but they are spelled in the identity as asked.
    uint32_t n_ctx       = 1024;
    uint32_t n_slots     = 1;    // concurrent sequences (one KV stream each)
    int32_t  n_threads   = 1;    // n_threads == n_threads_batch
    uint32_t n_ubatch    = 64;   // n_batch == n_ubatch
    bool     flash_attn  = true;
    std::string type_k   = "f16";
    std::string type_v   = "f16";
    // Batch-invariant kernels: ggml's CPU reference kernels (ggml_backend_cpu_set_use_ref),
    // whose rows do not depend on what else the forward holds. A row then has the same bits
    // alone, in a chunk of any length (a whole n_ubatch chunk too), batched with other
    // sessions' rows or verified with drafts, at any KV length: without it ggml's CPU flash
    // attention takes a tiled path for chunks of 64 rows or more and splits the KV of a lone
    // single-row step of 512 cells or more over the threads. Slower prefill; CPU device only.
    bool     batch_invariant = false;
    // The compute device: "cpu", or a ggml device name ("Vulkan0", "CUDA0", ...; see
    // ListDevices). Every owned layer, its KV cache (DeepSeek V4's compressed and indexer
    // state and the MTP cache too) and, on the last stage, the output head go there; the
    // token embeddings stay in host memory (llama.cpp keeps its input layer on the CPU).
    // Decides numerics: another device computes other kernels.
    std::string device   = "cpu";
    // Settings that do not change numerics.
    bool     use_mmap    = true;
    // The most bytes this engine may place on its device (weights, KV cache, compute buffers);
    // 0: the device's free memory is the only bound. Refused with kDeviceOutOfMemory.
    uint64_t device_memory_limit = 0;
    // n_ctx 0 only: the most bytes the KV cache (and recurrent state) of all slots may take.
    // 0: half the memory free once the weights are loaded (on the cpu device, the system's
    // MemAvailable; elsewhere the device's free memory), within device_memory_limit.
    uint64_t kv_budget = 0;
    // Multi-token prediction: load the model's NextN (MTP) block and draft with it (MtpDraft).
    // Only on the last stage (layer_end == n_layer) of a deepseek4 model with one NextN block;
    // it leaves the trunk's logits and boundary bit-identical to mtp=false.
    bool     mtp         = false;
    // A recurrent or hybrid memory (Mamba, Qwen3.5, Nemotron-H, ...) keeps one state per
    // sequence, not a history: per slot, the engine keeps a snapshot of that state (the
    // recurrent rows, and an iswa hybrid's SWA cells) at the end of each whole n_ubatch chunk
    // computed from position 0, the last `state_snapshots` of them, and Truncate to one of
    // those positions restores it (llama-server's context checkpoints). 0: none (a partial
    // Truncate is refused). Ignored by other memories. Host memory: StateSnapshotBytes.
    uint32_t state_snapshots = 4;
};

struct EngineInfo {
    std::string arch;
    std::string desc;
    int32_t  n_layer = 0;
    int32_t  layer_start = 0;
    int32_t  layer_end = 0;
    int32_t  n_embd = 0;
    int32_t  n_embd_boundary = 0;
    int32_t  n_vocab = 0;
    int32_t  n_ctx_train = 0;
    uint32_t n_ctx = 0;          // per slot: as configured, or chosen for n_ctx 0
    std::string n_ctx_source;    // how n_ctx was chosen ("set", or the trained context and budget)
    uint32_t n_ctx_alloc = 0;    // per slot, as allocated by llama.cpp (may be padded up)
    uint32_t n_slots = 0;
    uint32_t n_ubatch = 0;
    int32_t  n_threads = 0;
    bool     flash_attn = false;
    bool     batch_invariant = false;
    std::string type_k;
    std::string type_v;
    int32_t  hash_layer_count = 0; // layers that route experts by token id (DeepSeek V4)
    bool     needs_token_ids = false;
    uint64_t n_params = 0;
    uint64_t weight_bytes = 0;
    uint64_t kv_bytes = 0;
    uint64_t compute_bytes = 0;
    // The compute device (llama.cpp's, through ggml's backend registry) and what this engine
    // holds on it. For "cpu" every byte above is the device's.
    std::string device;              // ggml device name: "CPU", "Vulkan0", "CUDA0"
    std::string device_desc;         // its description: "llvmpipe (LLVM 15.0.6, 256 bits)"
    std::string device_type;         // "cpu", "gpu", "igpu" or "accel"
    std::string backend;             // its backend's registry name: "CPU", "Vulkan", "CUDA"
    std::string device_driver;       // the driver, where the backend tells it ("" if not)
    uint64_t device_memory_free = 0; // as the device reports it, at the last RefreshMemory
    uint64_t device_memory_total = 0;
    uint64_t device_weight_bytes = 0;   // in the device's buffers
    uint64_t device_kv_bytes = 0;
    uint64_t device_compute_bytes = 0;
    int32_t  token_bos = -1;
    int32_t  token_eos = -1;
    bool     add_bos = false;
    bool     mtp = false;            // the engine drafts with the NextN block (MtpDraft)
    int32_t  n_layer_nextn = 0;      // NextN (MTP) blocks in the file, after the n_layer layers
    // The most positions Truncate may drop, counted back from NextPos and within the slot's
    // last forward (DeepSeek V4: the trunk cache's n_rs_seq rollback snapshots); -1: dgr sets
    // no window (the cache decides: kRollbackUnsupported when it cannot drop the tail).
    int32_t  rollback_window = -1;
    // A recurrent or hybrid memory: its state bytes per slot (every owned recurrent layer's
    // rows, rollback groups included; counted in kv_bytes too, which holds all of the
    // context's memory), and how many snapshots a slot keeps (EngineConfig::state_snapshots;
    // 0 for any other memory).
    uint64_t state_bytes = 0;
    uint32_t state_snapshots = 0;
    // An embedding row's width on the first stage (llama_model_n_embd_inp: n_embd, or more
    // where an encoder's rows carry extra features), and how many positions a row of an
    // embedding step has (4 on an M-RoPE model, whose image rows have (t, y, x, z); else 1).
    int32_t  n_embd_inp = 0;
    int32_t  n_pos_per_embd = 1;
};

// A step of media rows (an image or audio chunk that libmtmd encoded: dgr::Media) of one slot.
struct MediaStep {
    // The first stage: n_tokens * n_embd_inp embedding rows (the encoder's output), which
    // enter where token embeddings would. Any other stage: the boundary, as for Forward.
    const float * rows = nullptr;
    // n_sections * n_tokens positions, section-major (pos[j * n_tokens + i]): n_sections 1
    // (consecutive positions, as Forward's), or info().n_pos_per_embd on an M-RoPE model
    // (mtmd's decoder positions: t, y, x, z), whose rows' first sections need only not go
    // back and whose text after them continues at the highest position + 1.
    const int32_t * pos = nullptr;
    int32_t n_sections = 1;
    // false: the rows attend to each other both ways within the step
    // (mtmd_decode_use_non_causal: the whole step must fit in one n_ubatch chunk)
    bool causal = true;
};

// One engine is used by one thread at a time: it keeps no lock of its own. The Python binding
// (dgr._core.Engine) serializes every call with its one lock, ``Engine.lock``, which callers
// that must make a sequence of calls atomic (the worker's slot bookkeeping) hold too.
class Engine {
public:
    ~Engine();
    Engine(const Engine &) = delete;
    Engine & operator=(const Engine &) = delete;

    // Load a model range. On success *out owns a new engine.
    static Status Load(const EngineConfig & cfg, std::unique_ptr<Engine> * out);

    const EngineInfo & info() const noexcept;
    bool is_first() const noexcept;
    bool is_last() const noexcept;

    Status Tokenize(const std::string & text, bool add_special, bool parse_special,
                    std::vector<int32_t> * out) const;
    Status Detokenize(const int32_t * tokens, size_t n, bool remove_special, bool unparse_special,
                      std::string * out) const;
    // Each token id of [first, first + count) as the bytes llama.cpp renders it alone
    // (llama_token_to_piece: no leading space removed; control tokens empty unless `special`),
    // concatenated into `bytes`, with `ends[i]` the end offset of id first + i. The ids past
    // the vocabulary are left out. Reads the vocabulary only: safe beside a forward.
    Status TokenPieces(int32_t first, int32_t count, bool special, std::string * bytes,
                       std::vector<int32_t> * ends) const;
    bool IsEog(int32_t token) const;

    // Number of output floats per row: n_vocab on the last stage, n_embd_boundary otherwise.
    int32_t OutputWidth() const noexcept;

    // Run n_tokens at positions pos[] of a slot through the owned layers. The arrays are read
    // through raw pointers: the caller guarantees their lengths (dgr/_core checks them).
    //   tokens:   required on the first stage and when needs_token_ids; else may be null
    //   boundary: required on non-first stages (n_tokens * n_embd_boundary floats), refused on
    //             the first
    //   want:     last stage only: per-token 0/1, which rows return logits (null: last row)
    //   out:      receives n_out_rows * OutputWidth() floats (all rows on non-last stages)
    // Positions must continue the slot (pos[0] == NextPos(slot)) and be contiguous.
    // Longer inputs are computed in chunks of n_ubatch tokens.
    Status Forward(int32_t slot, const int32_t * pos, const int32_t * tokens, const float * boundary,
                   int32_t n_tokens, const uint8_t * want, float * out, size_t out_capacity,
                   int32_t * n_out_rows);

    // Run n_tokens of several slots in one forward: token i belongs to slot slots[i] at
    // position pos[i]. The arrays are as for Forward (tokens/boundary row i is token i's), and
    //   want:     last stage only: per-token 0/1, which rows return logits (null: the last
    //             token of each slot in the batch)
    //   out:      receives the output rows in input order: the wanted rows on the last stage,
    //             every row on the others
    // Each slot's tokens, taken in input order, must continue that slot (its first one at
    // NextPos(slot)) with consecutive positions; slots may interleave. Nothing is computed
    // unless every token passes. The tokens go to llama_decode in one llama_batch (sorted by
    // slot, a slot's tokens kept in order; chunks of n_ubatch tokens), whose equal split
    // (kv_unified=false: one KV stream per slot) computes the decode rows of slots with
    // consecutive ids in one ubatch, a run of ids at a time, with as many tokens of each
    // slot as the one with fewest left. A decode failure clears every slot of the batch.
    Status ForwardBatch(const int32_t * slots, const int32_t * pos, const int32_t * tokens,
                        const float * boundary, int32_t n_tokens, const uint8_t * want, float * out,
                        size_t out_capacity, int32_t * n_out_rows);

    // Forward of one slot's media rows (MediaStep), on any stage: every stage of a route runs
    // the same step (the same positions and causality). want/out as for Forward.
    Status ForwardMedia(int32_t slot, const MediaStep & step, int32_t n_tokens, const uint8_t * want,
                        float * out, size_t out_capacity, int32_t * n_out_rows);

    // Forward on the last stage that returns every row's final normed hidden state (llama.cpp's
    // embeddings, t_embd: n_embd floats a row, never pooled) instead of logits; the slot's
    // cache grows as with Forward. out receives n_tokens * n_embd floats.
    Status Embed(int32_t slot, const int32_t * pos, const int32_t * tokens, const float * boundary,
                 int32_t n_tokens, float * out, size_t out_capacity, int32_t * n_out_rows);

    // Drop a slot's state; the next Forward on it must start at position 0.
    Status Release(int32_t slot);

    // Make slot dst a copy of slot src (its caches, bit for bit, and its next position): a
    // session forked after its prefill continues in dst as src would. Refused with MTP and on
    // deepseek4.
    Status CopySlot(int32_t src, int32_t dst);

    // Drop a slot's positions from `pos` on (rejected speculative drafts), in every cache
    // the stage keeps (the MTP context's too, whose pending hidden state becomes the trunk's
    // row at pos-1); the next Forward on it starts at `pos`. pos >= NextPos is a no-op.
    // kRollbackUnsupported when a cache cannot drop that tail: DeepSeek V4's compressed
    // state outside its rollback window (more than info().rollback_window positions, or more
    // than the slot's last forward computed), or, with mtp, pos-1 older than the hidden rows
    // kept (the last rollback_window+1 positions), or a recurrent or hybrid memory at a
    // position where the slot keeps no state snapshot (EngineConfig::state_snapshots;
    // StateSnapshots lists them). The slot is then cleared and must re-prefill.
    Status Truncate(int32_t slot, int32_t pos);

    // The positions at which the slot keeps a state snapshot (oldest first; empty but for a
    // recurrent or hybrid memory), and the host bytes all slots' snapshots hold.
    std::vector<int32_t> StateSnapshots(int32_t slot) const;
    uint64_t StateSnapshotBytes() const;

    // Greedy MTP draft (engines loaded with mtp): `token` is the token at NextPos(slot) (the
    // one sampled from the last logits); the NextN block decodes (token, the trunk's hidden
    // row at NextPos-1) there, its argmax (lowest id on ties) is the first draft d1, then
    // (d1, the NextN block's own hidden row) at the next position, and so on: up to n_max
    // tokens in *out, fewer only where the slot's context ends (a step of token + drafts must
    // fit in n_ctx). The MTP memory is left as before the call; the trunk is not touched.
    // Deterministic: the same slot state and arguments give the same drafts.
    //   kMtpNotSupported  the engine was loaded without mtp
    //   kInvalidPosition  the slot holds no positions yet (forward the prompt first)
    Status MtpDraft(int32_t slot, int32_t token, int32_t n_max, std::vector<int32_t> * out);

    // Next position the slot expects (0 when empty), or -1 for an unknown slot.
    int32_t NextPos(int32_t slot) const;

    // Trunk forwards that reused llama.cpp's previous graph (the same ubatch shape, sequences
    // and inputs: no graph build, no scheduling) since load. The MTP drafter's are not counted.
    int64_t GraphsReused() const;

    // What the trunk's forwards cost since load (a stage's profile: docs/performance.md).
    struct Counters {
        int64_t forwards = 0;      // ForwardBatch calls that completed (one-slot ones too)
        int64_t decodes = 0;       // llama_decode calls (a forward of more than n_ubatch tokens: several)
        int64_t ubatches = 0;      // llama.cpp ubatches those decodes made: its equal split takes one
                                   // run of consecutive slot ids with as many tokens each per ubatch
        int64_t forward_ns = 0;    // wall time in ForwardBatch (checks, gathers, output copies)
        int64_t decode_ns = 0;     // of which in llama_decode (graph build or reuse, compute)
        int64_t graphs_reused = 0; // as GraphsReused(), as of the last decode
    };
    Counters GetCounters() const;

    // Refresh memory figures (KV/compute bytes, the device's free memory) in info().
    Status RefreshMemory();

    // Fault injection for tests: "device_lost" makes the engine behave as after a lost device
    // (every slot gone, every later compute call kDeviceLost); "device_lost_in_decode" makes
    // the next decode throw what a Vulkan backend throws on a lost device, which the engine
    // must recognise as one.
    Status InjectFault(const std::string & what);

private:
    friend class Media;  // opens libmtmd on the engine's model (media.cpp)
    Engine();
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// A compute device of ggml's backend registry (what EngineConfig::device names).
struct DeviceInfo {
    std::string name;          // "CPU", "Vulkan0", "CUDA0"
    std::string description;
    std::string type;          // "cpu", "gpu", "igpu", "accel"
    std::string backend;       // "CPU", "Vulkan", "CUDA", "RPC"
    std::string device_id;     // PCI bus id where known, else ""
    std::string driver;        // the driver, where the backend tells it, else ""
    uint64_t memory_free = 0;
    uint64_t memory_total = 0;
};

// Every device this binary's backends see (the CPU first), and the backends it was built with.
Status ListDevices(std::vector<DeviceInfo> * out);
std::vector<std::string> BuiltBackends();
// What the CPU backend's code was compiled for (ggml's feature list: "AVX2", "F16C", "OPENMP", ...).
std::vector<std::string> CpuFeatures();

// Build facts: whether the patched llama.cpp supports layer ranges.
bool HasLayerRanges() noexcept;

// Whether a model of architecture `arch` (its GGUF general.architecture) may load a partial
// layer range: asked of the patched llama.cpp (llama_arch_supports_layer_range), whose stage-
// graph patches define the list; false without layer ranges. The whole model loads for any arch.
bool ArchSupportsLayerRange(const std::string & arch) noexcept;

}  // namespace dgr
