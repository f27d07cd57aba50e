// dgr::Engine's internals, shared by cpp/src/engine.cpp (the public methods) and the files of
// this folder, split by concern as llama.cpp splits llama-context / llama-memory / llama-graph:
//   support.cpp  llama.cpp's log capture, exceptions stopped at the boundary, backend start
//   devices.cpp  ggml's device registry: find, describe, list
//   load.cpp     the GGUF header check, the range load, the memory figures
//   memory.cpp   a slot's caches: release, copy, truncate
//   forward.cpp  the stage's forward: inputs checked, batches decoded, rows out
//   mtp.cpp      MTP (NextN) drafting on the last stage
// Not installed, not seen by Cython: the llama types stay behind Engine's pimpl.
#pragma once

#include <atomic>
#include <deque>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dgr/engine.h"
#include "ggml.h"
#include "ggml-backend.h"
#include "llama.h"
#include "llama-ext.h"

class llama_memory_recurrent;  // llama.cpp's (src/llama-memory-recurrent.h)

// Patch 0001 adds llama_model_params::layer_start/layer_end; setup.py defines this when the
// pinned tree carries it.
#ifndef DGR_LAYER_RANGE
#define DGR_LAYER_RANGE 0
#endif

// setup.py defines DGR_WITH_VULKAN when the build carries ggml's Vulkan backend: the Vulkan
// loader then tells the driver of a device (ggml's registry names only the device).
#ifndef DGR_WITH_VULKAN
#define DGR_WITH_VULKAN 0
#endif

namespace dgr {
namespace detail {

// ---- support.cpp ------------------------------------------------------------------------
// llama_log_set is process-global: the last warning and error lines are kept so a failure
// can say why (DGR_LLAMA_LOG echoes the log: 1 warnings and errors, 2 all).
void log_cb(ggml_log_level level, const char * text, void * user_data);  // llama.cpp's and mtmd's
// a KV cache type's name ("f16", "q8_0", ...) as a ggml_type; false for an unknown one
bool parse_type(const std::string & name, ggml_type * out);
void log_clear();
std::string log_last_error();       // the last line that says error/failed ("" if none)
std::string log_out_of_memory();    // the first line since log_clear that says an allocation failed

// llama.cpp's C API throws on some paths (llama_decode's batch conversion and graph
// allocation, std::bad_alloc from any of its containers or ours). Every public method runs
// its body through guarded(), so such a failure reaches Python as a Status (kEngineError),
// never as an exception through Cython (whose `except +` is only a backstop) nor as
// std::terminate.
std::string current_exception_text();  // call only inside a catch block

template <class F>
Status guarded(const char * what, F && body) {
    try {
        return body();
    } catch (...) {
        return Status(kEngineError, std::string(what) + " failed: " + current_exception_text());
    }
}

std::string lowered(std::string t);
// A C++ exception or log line of a backend that says the device itself failed / memory ran out.
bool says_device_lost(const std::string & t);
bool says_out_of_memory(const std::string & t);

// llama.cpp's and ggml's process-wide start (once), with dgr's Vulkan settings.
void backend_init();

// The most positions a Truncate drops on a rollback-limited cache (DeepSeek V4's n_rs_seq):
// a verifying step of a token and up to 32 drafts.
constexpr int32_t kRollbackWindow = 32;

// ---- devices.cpp ------------------------------------------------------------------------
DeviceInfo describe_device(ggml_backend_dev_t dev);
// The device an engine computes on: "cpu" (any case) is the CPU device, anything else a
// device name of the registry (case-insensitive).
Status find_device(const std::string & name, ggml_backend_dev_t * out);

}  // namespace detail

// ---- MTP (NextN) drafting on the last stage (mtp.cpp) -------------------------------------
// A second llama context of type MTP on the same model runs the NextN block. After every
// trunk chunk, the catch-up decode feeds it the pairs (x_q, h_{q-1}): the token at position q
// with the trunk's hidden row (t_h_nextn, n_embd_boundary wide) at q-1 (zeros at q = 0), as
// llama.cpp's draft-mtp driver does (common/speculative.cpp). Per slot the trunk rows of the
// last kRows positions are kept: the last one is the pending h a draft or the next step
// pairs with, the others are what a truncate restores. The engine calls it at four points:
// after each trunk decode (CatchUp), when a slot is cleared or truncated, and to draft.
class MtpDrafter {
public:
    static constexpr int32_t kRows = detail::kRollbackWindow + 1;

    MtpDrafter() = default;
    MtpDrafter(const MtpDrafter &) = delete;
    MtpDrafter & operator=(const MtpDrafter &) = delete;
    ~MtpDrafter();

    // The MTP context beside the trunk context `trunk` (created with `cp`), which it reads
    // as its ctx_other.
    Status Init(llama_model * model, llama_context * trunk, const llama_context_params & cp,
                uint32_t n_slots, uint32_t n_ubatch);
    // The buffers, once the widths are known (after the model's facts are read).
    void Size(int32_t width, int32_t n_vocab);
    llama_context * ctx() const noexcept { return ctx_; }
    void Clear(int32_t slot);
    // Why the slot cannot be truncated to `pos` ("" when it can): the pending h after the
    // cut (the trunk's row at pos-1) must be one of the rows kept.
    std::string CannotTruncate(int32_t slot, int32_t pos) const;
    // Drop positions from `pos` on; false when the MTP cache refuses.
    bool Truncate(int32_t slot, int32_t pos);
    // Row k of the trunk chunk just decoded: its slot and token (batch order).
    void SetRow(int32_t k, int32_t slot, int32_t token) {
        seq_[k] = slot;
        tok_[k] = token;
    }
    // The catch-up decode of the n rows of the trunk's last llama_decode (row k: SetRow's
    // token and slot at position pos[k], its trunk hidden row h + k*W); a slot's rows are
    // consecutive and in position order. Returns llama_decode's code (0: done).
    int32_t CatchUp(const llama_pos * pos, const float * h, int32_t n);
    // A greedy chain of n drafts from `token` at pos0 (the slot's next position); the MTP
    // memory is left as before. *stuck: the MTP cache could not drop the draft (the caller
    // clears the slot).
    Status Draft(int32_t slot, int32_t pos0, int32_t token, int32_t n, std::vector<int32_t> * out,
                 bool * stuck);

private:
    struct Slot {
        int32_t pos0 = 0;              // position of the first row kept
        int32_t n = 0;                 // rows kept: positions [pos0, pos0 + n)
        std::vector<float> rows;       // kRows * W
    };

    // The h a token at `pos` of `slot` pairs with: the trunk row at pos-1 (zeros at 0).
    const float * PrevH(int32_t slot, int32_t pos) const;
    // Keep the trunk rows h[0..n) of positions [pos, pos+n) as the slot's last rows.
    void KeepRows(int32_t slot, int32_t pos, const float * h, int32_t n);

    llama_context * ctx_ = nullptr;
    uint32_t n_slots_ = 0;
    uint32_t n_ubatch_ = 0;
    size_t W_ = 0;
    int32_t n_vocab_ = 0;
    llama_batch batch_{};
    llama_token * batch_token_ = nullptr;  // llama_batch_init's own token array
    std::vector<float> embd_;              // n_ubatch rows: the h column of batch_
    std::vector<Slot> slots_;
    std::vector<float> zeros_;             // the h paired with a token at position 0
    std::vector<llama_seq_id> seq_;        // n_ubatch: a chunk's slot per row, batch order
    std::vector<int32_t> tok_;             // n_ubatch: a chunk's tokens, batch order
};

struct Engine::Impl {
    EngineConfig cfg;
    EngineInfo info;
    ggml_backend_dev_t dev = nullptr;     // the compute device (the CPU device for "cpu")
    bool on_cpu = true;
    bool lost = false;                    // the device failed: every compute call refuses
    std::string throw_in_decode;          // InjectFault: the next decode throws this
    llama_model * model = nullptr;
    llama_context * ctx = nullptr;
    const llama_vocab * vocab = nullptr;
    llama_batch batch{};
    llama_token * batch_token = nullptr;  // llama_batch_init's own token array, restored before free
    // M-RoPE (llama_model_rope_type MROPE/IMROPE): llama.cpp reads an embedding batch's
    // positions section-major, n_pos_sections per row (pos[j*n_tokens + i]), where a token
    // batch has one; a non-first stage's boundary rows get the text layout the token path
    // builds (sections 0-2 the position, section 3 zero), in this buffer of n_ubatch rows
    int32_t n_pos_sections = 1;
    std::vector<llama_pos> pos_sections;
    bool first = true;
    bool last = true;
    // the trunk decode reads token ids: the first stage, and one owning hash-routed layers
    // (info.needs_token_ids also asks them of an MTP stage, whose NextN block embeds them)
    bool trunk_tokens = true;

    // A rollback-limited trunk cache (DeepSeek V4: n_rs_seq snapshots of the compressor
    // state, taken over the last ubatch of each sequence): the most positions a Truncate may
    // drop (-1: no window of dgr's), and per slot how many the last llama_decode computed.
    int32_t rs_window = -1;
    std::vector<int32_t> rs_tail;

    // A recurrent or hybrid memory's state snapshots (EngineConfig::state_snapshots), per
    // slot: `aligned` is the end of the run of whole n_ubatch chunks the slot computed from
    // position 0, one decode each (-1 once another step broke it: no more snapshots until the
    // slot is cleared or restored); `snaps` the state (llama_state_seq_get_data_ext,
    // LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) at the last n_snapshots of those ends, oldest first.
    // memory.cpp keeps them.
    struct Snapshot {
        int32_t pos = 0;
        std::vector<uint8_t> data;
    };
    struct SlotState {
        int32_t aligned = 0;
        std::deque<Snapshot> snaps;
    };
    uint32_t n_snapshots = 0;
    std::vector<SlotState> slot_state;
    // An iswa hybrid's (LFM2 with sliding-window layers) recurrent rows, which its snapshots
    // hold alone (memory.cpp); null for any other memory, whose snapshots are llama.cpp's
    // PARTIAL_ONLY state. llama.cpp's would hold the sequence's sliding-window cells too, and
    // restored they land in other cells than a fresh prefill's: the CPU flash attention's
    // tiled rows depend on where a sequence's cells are, so a next turn's bits would not be a
    // fresh prefill's. With swa_full those cells are all still there; a truncate drops their
    // tail as for any attention cache.
    ::llama_memory_recurrent * snap_recr = nullptr;
    // After a decode in which `slot` computed `count` positions from `first`: a snapshot
    // when they were its next whole chunk.
    void AfterDecode(int32_t slot, int32_t first, int32_t count);
    // Restore the slot's snapshot at `pos` and drop its positions from there; false (the slot
    // untouched) when it keeps none there or llama.cpp refuses the restore.
    bool RestoreSnapshot(int32_t slot, int32_t pos);
    // One snapshot of `slot`'s state into `data`, and back (snap_recr's rows alone, or
    // llama.cpp's PARTIAL_ONLY state); false where it failed.
    bool WriteSnapshot(int32_t slot, std::vector<uint8_t> & data);
    bool ReadSnapshot(int32_t slot, const std::vector<uint8_t> & data);

    // MTP (NextN) drafting on the last stage (MtpDrafter); null without mtp
    std::unique_ptr<MtpDrafter> mtp;

    // the trunk's forward counters (Engine::GetCounters): written by the forward (under the
    // caller's lock), read by any thread at any time (a metrics scrape must not wait for
    // the lock a long forward holds)
    struct {
        std::atomic<int64_t> forwards{0}, decodes{0}, ubatches{0}, forward_ns{0}, decode_ns{0}, graphs_reused{0};
    } counters;

    ~Impl() {
        try {
            if (batch.pos) {
                batch.token = batch_token;
                batch.embd = nullptr;
                llama_batch_free(batch);
            }
            mtp.reset();  // its context reads the trunk's (ctx_other): freed first
            if (ctx) llama_free(ctx);
            if (model) llama_model_free(model);
        } catch (...) {
            // a destructor must not throw (std::terminate): what was not freed is leaked
        }
    }

    int32_t OutputWidth() const noexcept {
        return embed_rows ? info.n_embd : last ? info.n_vocab : info.n_embd_boundary;
    }
    // Embed() runs: the last stage returns each row's final normed hidden state (llama.cpp's
    // t_embd, n_embd wide) instead of logits
    bool embed_rows = false;
    Status Embed(int32_t slot, const int32_t * pos, const int32_t * tokens, const float * boundary,
                 int32_t n_tokens, float * out, size_t out_capacity, int32_t * n_out_rows);

    // The bodies of Engine's methods, which run them through guarded().
    static Status Load(const EngineConfig & cfg, std::unique_ptr<Engine> * out);
    Status RefreshMemory();
    Status Tokenize(const std::string & text, bool add_special, bool parse_special,
                    std::vector<int32_t> * out) const;
    Status Detokenize(const int32_t * tokens, size_t n, bool remove_special, bool unparse_special,
                      std::string * out) const;
    Status Forward(int32_t slot, const int32_t * pos, const int32_t * tokens, const float * boundary,
                   int32_t n_tokens, const uint8_t * want, float * out, size_t out_capacity,
                   int32_t * n_out_rows);
    Status ForwardBatch(const int32_t * slots, const int32_t * pos, const int32_t * tokens,
                        const float * boundary, int32_t n_tokens, const uint8_t * want, float * out,
                        size_t out_capacity, int32_t * n_out_rows);
    Status ForwardMedia(int32_t slot, const MediaStep & step, int32_t n_tokens, const uint8_t * want,
                        float * out, size_t out_capacity, int32_t * n_out_rows);
    Status CheckStageInputs(const int32_t * tokens, const float * boundary, int32_t n_tokens) const;
    // ForwardMedia's step while it runs (ForwardBatch and Decode read it; null otherwise), and
    // the row of it where the chunk being decoded starts
    const MediaStep * media = nullptr;
    int32_t media_row = 0;
    int32_t media_total = 0;  // its rows
    // per slot: where it continues after an M-RoPE media step whose positions ran past its
    // cells' (mtmd's n_pos: an image's rows share t, their y and x go further), else -1
    std::vector<int32_t> media_next;
    // the position a slot's next step starts at: its cells', or media_next past them
    int32_t SlotNext(int32_t slot) const;
    // llama_decode of the first n rows of `batch` (its token/embd pointers set by the caller,
    // cleared after); on an M-RoPE model an embedding batch gets the sectioned positions.
    int32_t Decode(int32_t n);
    Status Release(int32_t slot);
    Status CopySlot(int32_t src, int32_t dst);
    Status Truncate(int32_t slot, int32_t pos);
    Status MtpDraft(int32_t slot, int32_t token, int32_t n_max, std::vector<int32_t> * out);
    // Clear a slot in every cache (trunk, MTP) and its bookkeeping; never fails.
    void ClearSlot(int32_t slot);
    // boundary rows gathered into slot order when the caller's are not (n_ubatch rows)
    std::vector<float> embd_gather;
    // Forward's slot of every token: a one-slot step runs through ForwardBatch
    std::vector<int32_t> one_slot;
    // Embed()'s want mask: every row
    std::vector<uint8_t> embed_want;

    // Every compute call's status passes here: a failure that says the device itself failed
    // (a lost Vulkan device, a reset) becomes kDeviceLost, and the engine refuses from then on.
    Status Checked(Status st) {
        if (st.ok() || st.code == kDeviceLost || !detail::says_device_lost(st.message)) return st;
        MarkLost();
        return Status(kDeviceLost, "the device " + info.device + " (" + info.device_desc + ") failed: " +
                      st.message + "; this engine's slots are gone: replace the stage");
    }
    Status Refuse() const {
        return Status(kDeviceLost, "the device " + info.device + " (" + info.device_desc + ") of this engine was "
                      "lost; it computes nothing more: replace the stage");
    }
    void MarkLost() {
        lost = true;
        for (uint32_t s = 0; s < cfg.n_slots; ++s) {
            try { ClearSlot((int32_t) s); } catch (...) {}
        }
    }
};

}  // namespace dgr
