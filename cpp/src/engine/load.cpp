// Loading a stage: the GGUF header checked, the layer range loaded, the context made, the
// memory figures read.

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sys/stat.h>

#include "gguf.h"
#include "impl.h"
#include "llama-context.h"  // llama_context::get_sched: its backends (UseReferenceKernels)
// the recurrent memory's state tensors (recurrent_state_bytes): llama.cpp has no public call
#include "llama-memory-hybrid-iswa.h"
#include "llama-memory-hybrid.h"
#include "llama-memory-recurrent.h"

namespace dgr {
using namespace detail;

namespace detail {

bool parse_type(const std::string & name, ggml_type * out) {
    static const struct { const char * n; ggml_type t; } kTypes[] = {
        {"f32", GGML_TYPE_F32}, {"f16", GGML_TYPE_F16}, {"bf16", GGML_TYPE_BF16},
        {"q8_0", GGML_TYPE_Q8_0}, {"q4_0", GGML_TYPE_Q4_0}, {"q4_1", GGML_TYPE_Q4_1},
        {"q5_0", GGML_TYPE_Q5_0}, {"q5_1", GGML_TYPE_Q5_1},
    };
    for (const auto & e : kTypes) {
        if (name == e.n) { *out = e.t; return true; }
    }
    return false;
}

}  // namespace detail

namespace {

int64_t gguf_int(const gguf_context * g, const std::string & key, int64_t dflt) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return dflt;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8:  return gguf_get_val_u8(g, id);
        case GGUF_TYPE_INT8:   return gguf_get_val_i8(g, id);
        case GGUF_TYPE_UINT16: return gguf_get_val_u16(g, id);
        case GGUF_TYPE_INT16:  return gguf_get_val_i16(g, id);
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g, id);
        case GGUF_TYPE_INT32:  return gguf_get_val_i32(g, id);
        case GGUF_TYPE_UINT64: return (int64_t) gguf_get_val_u64(g, id);
        case GGUF_TYPE_INT64:  return gguf_get_val_i64(g, id);
        default:               return dflt;
    }
}

struct GgufFacts {
    std::string arch;
    int64_t n_layer = 0;           // transformer layers, without NextN (MTP) blocks
    int64_t n_layer_nextn = 0;     // NextN (MTP) blocks after them, counted in block_count
    int64_t hash_layer_count = 0;
    int64_t num_loops = 1;              // nanbeige: logical passes over the physical layers
    std::vector<uint64_t> layer_bytes;  // tensor bytes of each block (blk.N.*), NextN included
    uint64_t head_bytes = 0;            // output*, the head's tensors (the last stage's)
    uint64_t embd_bytes = 0;            // token_embd: the head too when output.weight is absent
    bool tied = false;                  // no output.weight: the head is token_embd

    // A lower bound of the weight bytes a range puts on its device: its blocks and, on the
    // last stage, the head (token_embd again when tied) and, with mtp, the NextN blocks; the
    // input embeddings stay in host memory. Tensors of other splits of a split GGUF and of
    // blocks not named blk.N are not counted (llama.cpp's own allocation is the last word).
    uint64_t DeviceWeightBytes(int64_t start, int64_t end, bool last, bool mtp) const {
        uint64_t b = last ? head_bytes + (tied ? embd_bytes : 0) : 0;
        for (int64_t i = start; i < end && i < (int64_t) layer_bytes.size(); ++i) b += layer_bytes[i];
        if (last && mtp) {
            for (size_t i = (size_t) n_layer; i < layer_bytes.size(); ++i) b += layer_bytes[i];
        }
        return b;
    }
};

std::string mib(uint64_t b) {
    char buf[64];
    if (b < 1024 * 1024) {
        std::snprintf(buf, sizeof buf, "%.1f KiB", (double) b / 1024.0);
    } else {
        std::snprintf(buf, sizeof buf, "%.1f MiB", (double) b / (1024.0 * 1024.0));
    }
    return buf;
}

// Read what the range check needs from the GGUF header, and catch the files llama.cpp would
// reject (or, for some, crash on) before handing them to it.
Status inspect_gguf(const std::string & path, GgufFacts * facts) {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
        return Status(kModelNotFound, "model file not found: " + path + " (" + std::strerror(errno) +
                      "); give the path of a .gguf file, or fetch the default model with "
                      "`python -m dgr models fetch`");
    }
    if (!S_ISREG(st.st_mode)) {
        return Status(kModelNotFound, "model path is not a regular file: " + path);
    }
    FILE * f = std::fopen(path.c_str(), "rb");
    if (!f) {
        return Status(kModelNotFound, "cannot open model file " + path + ": " + std::strerror(errno));
    }
    char magic[4] = {0, 0, 0, 0};
    const size_t got = std::fread(magic, 1, 4, f);
    std::fclose(f);
    if (got != 4 || std::memcmp(magic, "GGUF", 4) != 0) {
        return Status(kInvalidModel, path + " is not a GGUF file (bad magic); dgr loads GGUF models only");
    }
    gguf_init_params gp = { /*no_alloc =*/ true, /*ctx =*/ nullptr };
    gguf_context * g = gguf_init_from_file(path.c_str(), gp);
    if (!g) {
        std::string why = log_last_error();
        return Status(kInvalidModel, path + " is not a readable GGUF file (truncated or corrupt header)" +
                      (why.empty() ? std::string() : ": " + why));
    }
    Status s;
    const int64_t arch_id = gguf_find_key(g, "general.architecture");
    if (arch_id < 0 || gguf_get_kv_type(g, arch_id) != GGUF_TYPE_STRING) {
        s = Status(kInvalidModel, path + " has no general.architecture key");
    } else {
        facts->arch = gguf_get_val_str(g, arch_id);
        facts->n_layer = gguf_int(g, facts->arch + ".block_count", -1);
        facts->hash_layer_count = gguf_int(g, facts->arch + ".hash_layer_count", 0);
        facts->num_loops = gguf_int(g, facts->arch + ".num_loops", 1);
        if (facts->n_layer <= 0) {
            s = Status(kInvalidModel, path + " has no " + facts->arch + ".block_count");
        }
        // block_count counts the NextN (MTP) blocks that follow the last layer; llama.cpp's
        // n_layer (llama_hparams::n_layer(), and so every layer range) does not. deepseek4
        // counts them only when the first one is really in the file
        // (llama_model_deepseek4::load_arch_hparams).
        const int64_t nextn = gguf_int(g, facts->arch + ".nextn_predict_layers", 0);
        if (s.ok() && nextn > 0 && nextn < facts->n_layer) {
            const std::string probe = "blk." + std::to_string(facts->n_layer - nextn) + ".nextn.eh_proj.weight";
            if (facts->arch != "deepseek4" || gguf_find_tensor(g, probe.c_str()) >= 0) {
                facts->n_layer -= nextn;
                facts->n_layer_nextn = nextn;
            }
        }
        // Per block, the bytes of its tensors; the head's (output*) apart.
        const int64_t n_t = gguf_get_n_tensors(g);
        if (s.ok()) {
            facts->layer_bytes.assign((size_t) (facts->n_layer + facts->n_layer_nextn), 0);
            for (int64_t i = 0; i < n_t; ++i) {
                const char * name = gguf_get_tensor_name(g, i);
                const uint64_t sz = gguf_get_tensor_size(g, i);
                if (std::strncmp(name, "blk.", 4) == 0) {
                    const long il = std::strtol(name + 4, nullptr, 10);
                    if (il >= 0 && (size_t) il < facts->layer_bytes.size()) facts->layer_bytes[il] += sz;
                } else if (std::strncmp(name, "output", 6) == 0) {
                    facts->head_bytes += sz;
                } else if (std::strcmp(name, "token_embd.weight") == 0) {
                    facts->embd_bytes += sz;
                }
            }
            facts->tied = gguf_find_tensor(g, "output.weight") < 0;
        }
        // A file cut short: a tensor whose data ends past the end of this file.
        const size_t data_off = gguf_get_data_offset(g);
        const bool split = gguf_find_key(g, "split.count") >= 0 && gguf_int(g, "split.count", 1) > 1;
        for (int64_t i = 0; s.ok() && !split && i < n_t; ++i) {
            const size_t end = data_off + gguf_get_tensor_offset(g, i) + gguf_get_tensor_size(g, i);
            if (end > (size_t) st.st_size) {
                s = Status(kInvalidModel, path + " is truncated: tensor " + gguf_get_tensor_name(g, i) +
                           " ends at byte " + std::to_string(end) + " but the file has " +
                           std::to_string((long long) st.st_size) + " bytes");
            }
        }
    }
    gguf_free(g);
    return s;
}

// ggml's CPU reference kernels on every CPU backend of `ctx` (EngineConfig::batch_invariant):
// rows computed the same whatever else the forward holds. llama.cpp has no setting for it; its
// scheduler's backends are the context's own, and the CPU backend's setter is reached by name.
bool UseReferenceKernels(llama_context * ctx) {
    ggml_backend_sched_t sched = ctx->get_sched();
    bool any = false;
    for (int i = 0; sched && i < ggml_backend_sched_get_n_backends(sched); ++i) {
        ggml_backend_t b = ggml_backend_sched_get_backend(sched, i);
        ggml_backend_dev_t dev = ggml_backend_get_device(b);
        if (!dev || ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) continue;
        using set_use_ref_t = void (*)(ggml_backend_t, bool);
        auto set = (set_use_ref_t) ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev),
                                                                     "ggml_backend_cpu_set_use_ref");
        if (!set) return false;
        set(b, true);
        any = true;
    }
    return any;
}

// The state bytes per sequence of a recurrent memory, or of a hybrid one's recurrent part (0
// for any other): every owned layer's conv/SSM rows (r_l, s_l, p_l; a stage allocates its own
// layers' only, patch 0014), rollback groups included, over the cells (one per sequence).
uint64_t recurrent_state_bytes(llama_memory_t mem) {
    const llama_memory_recurrent * r = dynamic_cast<const llama_memory_recurrent *>(mem);
    if (!r) {
        if (auto * h = dynamic_cast<const llama_memory_hybrid *>(mem)) r = h->get_mem_recr();
    }
    if (!r) {
        if (auto * h = dynamic_cast<const llama_memory_hybrid_iswa *>(mem)) r = h->get_mem_recr();
    }
    if (!r || r->size == 0) return 0;
    uint64_t b = 0;
    for (const auto * v : {&r->r_l, &r->s_l, &r->p_l}) {
        for (const ggml_tensor * x : *v) {
            if (x) b += ggml_nbytes(x);
        }
    }
    return b / r->size;
}

// The system's MemAvailable (Linux), or 0: ggml's CPU device reports all physical memory as
// free (ggml_backend_cpu_device_get_memory), which no budget should trust.
uint64_t host_available_bytes() {
    std::ifstream f("/proc/meminfo");
    std::string key;
    uint64_t kib = 0;
    while (f >> key >> kib) {
        if (key == "MemAvailable:") return kib << 10;
        f.ignore(1 << 10, '\n');
    }
    return 0;
}

constexpr uint32_t kContextProbe = 256;  // tokens of the probe context (llama.cpp pads n_ctx to 256)

// n_ctx 0: the model's trained context per slot, capped by the KV budget. The bytes a token
// takes in this stage's caches (its own layers only) are measured on a probe context of
// kContextProbe cells and one sequence, less its recurrent state, which does not grow.
Status choose_context(llama_model * model, llama_context_params cp, const EngineConfig & cfg,
                      ggml_backend_dev_t dev, bool on_cpu, uint32_t * n_ctx, std::string * source) {
    const int64_t train = llama_model_n_ctx_train(model);
    const uint32_t want = (uint32_t) std::max<int64_t>(kContextProbe, train > 0 ? train : 4096);
    cp.n_ctx = kContextProbe;
    cp.n_seq_max = 1;
    cp.n_rs_seq = std::min<uint32_t>(cp.n_rs_seq, kContextProbe / 4);
    llama_context * probe = llama_init_from_model(model, cp);
    if (!probe) {
        const std::string why = log_last_error();
        return Status(kEngineError, "llama.cpp could not create a " + std::to_string(kContextProbe) +
                      "-token probe context to size n_ctx 0 for " + cfg.model_path +
                      (why.empty() ? std::string() : ": " + why) + "; give n_ctx (--ctx N)");
    }
    uint64_t kv = 0;
    for (const auto & kvp : llama_get_memory_breakdown(probe)) kv += kvp.second.context;
    const uint64_t state = recurrent_state_bytes(llama_get_memory(probe));
    llama_free(probe);
    const uint64_t per_token = kv > state ? (kv - state + kContextProbe - 1) / kContextProbe : 0;
    const uint64_t slots = cfg.n_slots;

    uint64_t budget = cfg.kv_budget;
    std::string whence = "as given";
    if (!budget) {
        size_t f = 0, t = 0;
        ggml_backend_dev_memory(dev, &f, &t);
        uint64_t free_now = on_cpu ? host_available_bytes() : (uint64_t) f;
        if (on_cpu && !free_now) free_now = t;
        if (!on_cpu && cfg.device_memory_limit) {
            // what the limit leaves once the weights are in
            const uint64_t w = llama_model_size(model);
            free_now = std::min<uint64_t>(free_now, cfg.device_memory_limit > w ? cfg.device_memory_limit - w : 0);
        }
        budget = free_now / 2;
        whence = "half of the " + mib(free_now) + (on_cpu ? " of memory available" : " free on the device");
    }
    uint32_t chosen = want;
    if (per_token > 0) {
        const uint64_t fixed = state * slots;
        const uint64_t room = budget > fixed ? budget - fixed : 0;
        const uint64_t fit = room / (per_token * slots) / kContextProbe * kContextProbe;
        if (fit < kContextProbe) {
            return Status(kDeviceOutOfMemory, "n_ctx 0: " + std::to_string(cfg.n_slots) + " slot(s) of " +
                          std::to_string(kContextProbe) + " tokens need " +
                          mib(fixed + per_token * slots * kContextProbe) + " of KV cache (" +
                          std::to_string(per_token) + " bytes a token on this stage), more than the " +
                          mib(budget) + " budget (" + whence + "): lower --slots, give --kv-budget, "
                          "or --ctx N");
        }
        chosen = (uint32_t) std::min<uint64_t>(want, fit);
    }
    *n_ctx = chosen;
    *source = chosen == want
        ? "the model's trained context (n_ctx_train " + std::to_string(train) + "), " +
          mib(per_token * slots * chosen + state * slots) + " of KV for " + std::to_string(cfg.n_slots) +
          " slot(s) within " + mib(budget) + " (" + whence + ")"
        : "the KV budget: " + mib(budget) + " (" + whence + ") holds " + std::to_string(chosen) +
          " tokens per slot for " + std::to_string(cfg.n_slots) + " slot(s) at " + std::to_string(per_token) +
          " bytes a token (n_ctx_train " + std::to_string(train) + ")";
    return Status();
}

}  // namespace

bool HasLayerRanges() noexcept { return DGR_LAYER_RANGE != 0; }

// The list is the patched llama.cpp's (the cases the stage-graph patches add: llama 0005,
// deepseek4 0006, qwen2 and qwen3 0008, 76 more 0011, 26 more 0016 and 0017;
// docs/architectures.md); its loader refuses the other archs itself, this lets a load refuse
// them with a typed error before reading any weight.
bool ArchSupportsLayerRange(const std::string & arch) noexcept {
#if DGR_LAYER_RANGE
    try {
        return llama_arch_supports_layer_range(arch.c_str());
    } catch (...) {
        return false;  // llama_arch_supports_layer_range builds std::strings (bad_alloc)
    }
#else
    (void) arch;
    return false;
#endif
}

Status Engine::Impl::Load(const EngineConfig & cfg, std::unique_ptr<Engine> * out) {
    backend_init();
    log_clear();

    if (cfg.n_slots < 1 || cfg.n_slots > 256) {
        return Status(kInvalidArgument, "n_slots must be in [1, 256], got " + std::to_string(cfg.n_slots));
    }
    if (cfg.n_ubatch < 1) return Status(kInvalidArgument, "n_ubatch must be >= 1");
    if (cfg.batch_invariant && cfg.device != "cpu") {
        return Status(kInvalidArgument, "batch_invariant runs ggml's CPU reference kernels: it needs the "
                      "cpu device, not " + cfg.device);
    }
    if (cfg.n_slots > cfg.n_ubatch) {
        // llama.cpp sizes its output buffer for one output per sequence but at most n_ubatch
        // (n_outputs_max) and aborts the process on the first decode past it
        return Status(kInvalidArgument, "n_slots (" + std::to_string(cfg.n_slots) +
                      ") must not exceed n_ubatch (" + std::to_string(cfg.n_ubatch) +
                      "): raise --ubatch or lower --slots");
    }
    if (cfg.n_threads < 1) return Status(kInvalidArgument, "n_threads must be >= 1");
    ggml_type tk, tv;
    if (!parse_type(cfg.type_k, &tk)) return Status(kInvalidArgument, "unknown KV type_k: " + cfg.type_k);
    if (!parse_type(cfg.type_v, &tv)) return Status(kInvalidArgument, "unknown KV type_v: " + cfg.type_v);

    GgufFacts facts;
    Status s = inspect_gguf(cfg.model_path, &facts);
    if (!s.ok()) return s;

    const int64_t n_layer = facts.n_layer;
    const int64_t start = cfg.layer_start;
    const int64_t end = cfg.layer_end < 0 ? n_layer : cfg.layer_end;
    if (start < 0 || end > n_layer || start >= end) {
        return Status(kInvalidLayerRange, "layer range [" + std::to_string(start) + ", " +
                      std::to_string(end) + ") is not a non-empty part of [0, " +
                      std::to_string(n_layer) + ") of " + cfg.model_path);
    }
    const bool partial = start != 0 || end != n_layer;
    if (partial && !ArchSupportsLayerRange(facts.arch)) {
        return Status(kUnsupportedArch, "layer ranges are not supported for architecture '" + facts.arch +
                      "' (its stage graph is not adapted by dgr's patch stack); load the whole model "
                      "(layers=None) or use a supported architecture");
    }
    if (partial && facts.num_loops > 1) {
        return Status(kUnsupportedArch, "layer ranges are not supported for a looped " + facts.arch + " model (" +
                      facts.arch + ".num_loops = " + std::to_string(facts.num_loops) + "): its logical layers share the "
                      "weights of its physical ones, which a stage of logical layers does not own; load it whole");
    }
    if (cfg.mtp) {
        // MTP drafts from the hidden state after the last layer, with the head: the last stage
        if (end != n_layer) {
            return Status(kMtpNotSupported, "MTP drafts on the last stage only: layers [" + std::to_string(start) +
                          ", " + std::to_string(end) + ") end before n_layer=" + std::to_string(n_layer) +
                          " of " + cfg.model_path + "; load this stage without mtp");
        }
        if (facts.n_layer_nextn <= 0) {
            return Status(kMtpNotSupported, cfg.model_path + " has no NextN (MTP) block (" + facts.arch +
                          ".nextn_predict_layers and blk." + std::to_string(n_layer) +
                          ".nextn.* are absent); load it without mtp");
        }
        if (facts.arch != "deepseek4") {
            return Status(kMtpNotSupported, "MTP is implemented for architecture 'deepseek4' only (its NextN "
                          "graph, one block, pairs each token with the trunk's last hidden row); '" +
                          facts.arch + "' has NextN blocks but dgr does not drive them: load without mtp");
        }
        if (facts.n_layer_nextn != 1 || facts.hash_layer_count > n_layer) {
            return Status(kMtpNotSupported, "llama.cpp's deepseek4 MTP graph runs one NextN block that is not "
                          "hash-routed; " + cfg.model_path + " has " + std::to_string(facts.n_layer_nextn) +
                          " (hash_layer_count " + std::to_string(facts.hash_layer_count) + "): load without mtp");
        }
    }

    ggml_backend_dev_t dev = nullptr;
    s = find_device(cfg.device, &dev);
    if (!s.ok()) return s;
    const bool on_cpu = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
    const std::string dev_name = ggml_backend_dev_name(dev);
    size_t dev_free = 0, dev_total = 0;
    ggml_backend_dev_memory(dev, &dev_free, &dev_total);
    if (!on_cpu) {
        // The owned blocks (and the head) alone must fit: refuse before reading any weight
        // (a lower bound: llama.cpp's allocation below is the last word).
        const uint64_t need = facts.DeviceWeightBytes(start, end, end == n_layer, cfg.mtp);
        const uint64_t cap = cfg.device_memory_limit;
        if (need > dev_free || (cap && need > cap)) {
            return Status(kDeviceOutOfMemory, "layers [" + std::to_string(start) + ", " + std::to_string(end) +
                          ") of " + cfg.model_path + " need " + mib(need) + " of weights on " + dev_name +
                          ", which has " + mib(dev_free) + " free of " + mib(dev_total) +
                          (cap ? " (this engine may use " + mib(cap) + ")" : std::string()) +
                          ", before the KV cache and compute buffers: take a smaller layer range");
        }
    }

    std::unique_ptr<Engine> e(new Engine());
    Impl & m = *e->impl_;
    m.cfg = cfg;
    m.first = start == 0;
    m.last = end == n_layer;
    m.dev = dev;
    m.on_cpu = on_cpu;

    llama_model_params mp = llama_model_default_params();
    // Only the named device: never one that llama.cpp would pick by itself. On the CPU the
    // list is empty (nothing offloaded, whatever GPUs the machine has); on a device it holds
    // every owned layer and the output head (n_gpu_layers -1: all of them).
    ggml_backend_dev_t devs[2] = {on_cpu ? nullptr : dev, nullptr};
    mp.devices = devs;
    mp.split_mode = LLAMA_SPLIT_MODE_NONE;
    mp.main_gpu = 0;
    mp.n_gpu_layers = on_cpu ? 0 : -1;
    mp.load_mode = cfg.use_mmap ? LLAMA_LOAD_MODE_AUTO : LLAMA_LOAD_MODE_NONE;
    // the NextN block (and, on a partial last stage, token_embd: patch 0001) only with mtp
    mp.load_mtp = cfg.mtp;
#if DGR_LAYER_RANGE
    // the whole model keeps llama.cpp's default range (0, -1): upstream behaviour, whatever
    // n_layer llama.cpp derives
    mp.layer_start = partial ? (int32_t) start : 0;
    mp.layer_end = partial ? (int32_t) end : -1;
#endif
    m.model = llama_model_load_from_file(cfg.model_path.c_str(), mp);
    if (!m.model) {
        const std::string oom = on_cpu ? std::string() : log_out_of_memory();
        std::string why = oom.empty() ? log_last_error() : oom;
        if (!oom.empty()) {
            return Status(kDeviceOutOfMemory, "layers [" + std::to_string(start) + ", " + std::to_string(end) +
                          ") of " + cfg.model_path + " do not fit on " + dev_name + " (" + mib(dev_free) +
                          " free of " + mib(dev_total) + "): " + why);
        }
        return Status(kInvalidModel, "llama.cpp could not load " + cfg.model_path +
                      (why.empty() ? std::string() : ": " + why));
    }

    llama_context_params cp = llama_context_default_params();
    cp.n_batch = cfg.n_ubatch;
    cp.n_ubatch = cfg.n_ubatch;
    cp.n_seq_max = cfg.n_slots;
    cp.n_threads = cfg.n_threads;
    cp.n_threads_batch = cfg.n_threads;
    cp.flash_attn_type = cfg.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = tk;
    cp.type_v = tv;
    cp.kv_unified = false;  // one KV stream per slot: cell layout independent of other sessions
    cp.swa_full = true;
    // Never true: dgr reads logits or the boundary, not pooled/normed embeddings, and on
    // deepseek4 embeddings=true aborts in llama.cpp (t_embd is n_embd wide, its output rows
    // n_embd_out = hc*n_embd: "tensor read out of bounds", ggml-backend.cpp).
    cp.embeddings = false;
    // Embed() turns embeddings on for its call: rows, never llama.cpp's pooling (a stage's
    // ubatch is not a whole prompt; the driver pools: dgr.protocol.embeddings)
    cp.pooling_type = LLAMA_POOLING_TYPE_NONE;
    cp.no_perf = true;
    // DeepSeek V4's trunk cache drops a tail (Truncate) only from its rollback snapshots of
    // the compressor state: n_rs_seq of them per sequence, as llama.cpp's server sets it for
    // speculative drafts (common_params_speculative::need_n_rs_seq, the draft length). Its
    // equal split keeps a sequence's last n_rs_seq+1 tokens in one ubatch and asserts
    // n_ubatch > n_rs_seq+1, hence the cap.
    if (facts.arch == "deepseek4") {
        cp.n_rs_seq = (uint32_t) std::max<int64_t>(0, std::min<int64_t>(kRollbackWindow, (int64_t) cfg.n_ubatch - 2));
    }
    // op_offload moves an op on host weights to the device for large batches: on the CPU
    // there is no device to move it to
    cp.op_offload = !on_cpu;
    uint32_t n_ctx = cfg.n_ctx;
    std::string n_ctx_source = "set";
    if (n_ctx == 0) {
        s = choose_context(m.model, cp, cfg, dev, on_cpu, &n_ctx, &n_ctx_source);
        if (!s.ok()) return s;
        m.cfg.n_ctx = n_ctx;
    }
    cp.n_ctx = n_ctx * cfg.n_slots;
    m.ctx = llama_init_from_model(m.model, cp);
    if (!m.ctx) {
        const std::string oom = on_cpu ? std::string() : log_out_of_memory();
        std::string why = oom.empty() ? log_last_error() : oom;
        if (!oom.empty()) {
            return Status(kDeviceOutOfMemory, "the KV cache and compute buffers of layers [" + std::to_string(start) +
                          ", " + std::to_string(end) + ") do not fit on " + dev_name + " (" + mib(dev_free) +
                          " free of " + mib(dev_total) + " before the weights): lower n_ctx or n_slots; " + why);
        }
        return Status(kEngineError, "llama.cpp could not create a context for " + cfg.model_path +
                      (why.empty() ? std::string() : ": " + why));
    }
    if (cfg.batch_invariant && !UseReferenceKernels(m.ctx)) {
        return Status(kEngineError, "this build's CPU backend has no reference kernels "
                      "(ggml_backend_cpu_set_use_ref): batch_invariant is not available");
    }
    // Recurrent and hybrid memories (Mamba, Qwen3.5, Nemotron-H, ...) keep one state per
    // sequence, not a history of it: a tail drops only from rollback snapshots, and this
    // engine keeps none (n_rs_seq 0: each snapshot is a whole state per sequence, and
    // llama-server widens it only for speculative drafts). So a partial Truncate is refused
    // and the slot re-prefilled, no prefix entry is kept, and the stage drafts nothing.
    if (facts.arch == "deepseek4" || llama_model_is_recurrent(m.model) || llama_model_is_hybrid(m.model)) {
        m.rs_window = (int32_t) llama_n_rs_seq(m.ctx);
    }
    m.rs_tail.assign(cfg.n_slots, 0);
    // ... except back to a state snapshot: at the ends of whole chunks (memory.cpp)
    if (m.rs_window == 0 && (llama_model_is_recurrent(m.model) || llama_model_is_hybrid(m.model))) {
        m.n_snapshots = cfg.state_snapshots;
        m.slot_state.assign(cfg.n_slots, Impl::SlotState());
        if (auto * h = dynamic_cast<llama_memory_hybrid_iswa *>(llama_get_memory(m.ctx))) {
            m.snap_recr = h->get_mem_recr();
        }
    }
    if (cfg.mtp) {
        // every row's hidden state after the last layer (not only the logits rows): the pairs
        // of the catch-up decode. t_h_nextn is the residual the head reads; the logits do not
        // change (checked by tests/integration/test_mtp_engine.py).
        llama_set_embeddings_nextn(m.ctx, true, /*masked*/ false);
        // ... and plan the graph's memory again: llama_set_embeddings_nextn does not ask for
        // it (llama_context::set_embeddings_nextn leaves sched_need_reserve alone), so the
        // plan reserved at context creation, made while the residual after the last layer
        // was no output, would stay in use and let later nodes (the head) overwrite the rows
        // before they are read (measured: wrong h rows on a [3, 6) stage, logits right).
        // Re-setting a layer-input tap to its value (off) is the public call that requests
        // the new plan (llama_context::set_embeddings_layer_inp: sched_need_reserve = true).
        llama_set_embeddings_layer_inp(m.ctx, 0, false);
        m.mtp.reset(new MtpDrafter());
        Status ms = m.mtp->Init(m.model, m.ctx, cp, cfg.n_slots, cfg.n_ubatch);
        if (!ms.ok()) {
            return Status(ms.code, ms.message + " for " + cfg.model_path);
        }
    }
    m.vocab = llama_model_get_vocab(m.model);

    EngineInfo & in = m.info;
    char buf[256];
    in.arch = facts.arch;
    if (llama_model_desc(m.model, buf, sizeof buf) > 0) in.desc = buf;
    in.n_layer = llama_model_n_layer(m.model);
    if (partial && in.n_layer != n_layer) {
        return Status(kInvalidModel, "llama.cpp counts " + std::to_string(in.n_layer) + " layers in " +
                      cfg.model_path + " but its header says " + std::to_string(n_layer) +
                      "; the layer range would be misread");
    }
    in.layer_start = (int32_t) start;
    in.layer_end = (int32_t) end;
    in.n_embd = llama_model_n_embd(m.model);
#if DGR_LAYER_RANGE
    in.n_embd_boundary = llama_model_n_embd_boundary(m.model);
#else
    in.n_embd_boundary = llama_model_n_embd_out(m.model);
#endif
    in.n_vocab = llama_vocab_n_tokens(m.vocab);
    in.n_ctx_train = llama_model_n_ctx_train(m.model);
    in.n_ctx = n_ctx;
    in.n_ctx_source = n_ctx_source;
    in.n_ctx_alloc = llama_n_ctx_seq(m.ctx);
    in.n_slots = cfg.n_slots;
    in.n_ubatch = cfg.n_ubatch;
    in.n_threads = cfg.n_threads;
    in.flash_attn = cfg.flash_attn;
    in.batch_invariant = cfg.batch_invariant;
    in.type_k = cfg.type_k;
    in.type_v = cfg.type_v;
    in.hash_layer_count = (int32_t) facts.hash_layer_count;
    // ... and a stage that reads them itself: DeepSeek V4's hash-routed layers, talkie's token-embedding skip,
    // cogvlm's text rows, qwen4exp's per-layer embeddings (llama_model_stage_needs_token_ids)
#if DGR_LAYER_RANGE
    m.trunk_tokens = m.first || start < facts.hash_layer_count || llama_model_stage_needs_token_ids(m.model);
#else
    m.trunk_tokens = m.first || start < facts.hash_layer_count;
#endif
    in.needs_token_ids = m.trunk_tokens || m.mtp != nullptr;  // the NextN block embeds the tokens
    in.mtp = m.mtp != nullptr;
    in.n_layer_nextn = (int32_t) facts.n_layer_nextn;
    in.rollback_window = m.rs_window;
    in.state_bytes = recurrent_state_bytes(llama_get_memory(m.ctx));
    in.state_snapshots = m.n_snapshots;
    in.n_params = llama_model_n_params(m.model);
    in.token_bos = llama_vocab_bos(m.vocab);
    in.token_eos = llama_vocab_eos(m.vocab);
    in.add_bos = llama_vocab_get_add_bos(m.vocab);
    if (in.n_ctx_alloc < n_ctx) {
        return Status(kInvalidArgument, "llama.cpp allocated " + std::to_string(in.n_ctx_alloc) +
                      " context tokens per slot, fewer than the n_ctx=" + std::to_string(n_ctx) + " asked");
    }
    {
        const DeviceInfo d = describe_device(dev);
        in.device = d.name;
        in.device_desc = d.description;
        in.device_type = d.type;
        in.backend = d.backend;
        in.device_driver = d.driver;
    }
    s = m.RefreshMemory();
    if (!s.ok()) return s;
    if (!on_cpu && cfg.device_memory_limit) {
        const uint64_t held = in.device_weight_bytes + in.device_kv_bytes + in.device_compute_bytes;
        if (held > cfg.device_memory_limit) {
            return Status(kDeviceOutOfMemory, "layers [" + std::to_string(start) + ", " + std::to_string(end) +
                          ") of " + cfg.model_path + " need " + mib(held) + " on " + dev_name + " (weights " +
                          mib(in.device_weight_bytes) + ", KV cache " + mib(in.device_kv_bytes) + ", compute " +
                          mib(in.device_compute_bytes) + "), more than the " + mib(cfg.device_memory_limit) +
                          " this engine may use: lower n_ctx or n_slots, or take a smaller range");
        }
    }

    // One reusable batch of n_ubatch rows: token and boundary arrays are pointed at the
    // caller's buffers per chunk, so only pos/seq/logits are written here.
    m.batch = llama_batch_init((int32_t) cfg.n_ubatch, 0, 1);
    m.batch_token = m.batch.token;
    m.batch.token = nullptr;
    const llama_rope_type rope = llama_model_rope_type(m.model);
    if (rope == LLAMA_ROPE_TYPE_MROPE || rope == LLAMA_ROPE_TYPE_IMROPE) {
        m.n_pos_sections = 4;  // GGML_MROPE_SECTIONS
        m.pos_sections.assign((size_t) cfg.n_ubatch * m.n_pos_sections, 0);
    }
    in.n_pos_per_embd = m.n_pos_sections;
    in.n_embd_inp = llama_model_n_embd_inp(m.model);
    m.media_next.assign(cfg.n_slots, -1);
    for (uint32_t i = 0; i < cfg.n_ubatch; ++i) m.batch.n_seq_id[i] = 1;
    if (m.mtp) m.mtp->Size(in.n_embd_boundary, in.n_vocab);
    *out = std::move(e);
    return Status();
}

Status Engine::Impl::RefreshMemory() {
    Impl & m = *this;
    uint64_t w = 0, kv = 0, comp = 0;
    for (const auto & kvp : llama_get_memory_breakdown(m.ctx)) {
        w += kvp.second.model;
        kv += kvp.second.context;
        comp += kvp.second.compute;
    }
    if (m.mtp) {
        // the MTP context shares the model's weights; its KV and compute buffers are its own
        for (const auto & kvp : llama_get_memory_breakdown(m.mtp->ctx())) {
            kv += kvp.second.context;
            comp += kvp.second.compute;
        }
    }
    m.info.weight_bytes = w ? w : llama_model_size(m.model);
    m.info.kv_bytes = kv;
    m.info.compute_bytes = comp;
    if (m.on_cpu) {
        m.info.device_weight_bytes = m.info.weight_bytes;
        m.info.device_kv_bytes = kv;
        m.info.device_compute_bytes = comp;
    } else {
        // the device's own buffers (not the host-visible staging ones of its backend)
        uint64_t dw = 0, dkv = 0, dc = 0;
        auto add = [&](const llama_memory_breakdown & mb, bool weights) {
            for (const auto & kvp : mb) {
                ggml_backend_buffer_type_t buft = kvp.first;
                if (ggml_backend_buft_is_host(buft) || ggml_backend_buft_get_device(buft) != m.dev) continue;
                if (weights) dw += kvp.second.model;
                dkv += kvp.second.context;
                dc += kvp.second.compute;
            }
        };
        add(llama_get_memory_breakdown(m.ctx), true);
        if (m.mtp) add(llama_get_memory_breakdown(m.mtp->ctx()), false);
        m.info.device_weight_bytes = dw;
        m.info.device_kv_bytes = dkv;
        m.info.device_compute_bytes = dc;
    }
    size_t f = 0, t = 0;
    ggml_backend_dev_memory(m.dev, &f, &t);
    m.info.device_memory_free = f;
    m.info.device_memory_total = t;
    return Status();
}

}  // namespace dgr
