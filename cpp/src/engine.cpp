// dgr::Engine over the patched llama.cpp: range load, slot-keyed forward, typed status.

#include "dgr/engine.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <deque>
#include <exception>
#include <mutex>
#include <new>
#include <stdexcept>
#include <sys/stat.h>

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"
#include "llama.h"
#include "llama-ext.h"
#include "llama-context.h"  // llama_context::get_sched: its backends (UseReferenceKernels)

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
#if DGR_WITH_VULKAN
#include <vulkan/vulkan.h>
#endif

namespace dgr {

namespace {

// ---- llama.cpp log capture -------------------------------------------------------------
// llama_log_set is process-global. Keep the last error lines so a failed load can say why,
// and echo llama.cpp's log only when DGR_LLAMA_LOG is set (1: warnings and errors, 2: all).

std::mutex g_log_mu;
std::deque<std::string> g_log_tail;

// DGR_LLAMA_LOG, read once: a function-local static is initialised once, thread-safely
// (llama.cpp may log from several threads at once)
int log_echo() {
    static const int echo = [] {
        const char * env = std::getenv("DGR_LLAMA_LOG");
        return env ? std::atoi(env) : 0;
    }();
    return echo;
}

void log_cb(ggml_log_level level, const char * text, void *) {
    const int echo = log_echo();
    if (echo >= 2 || (echo == 1 && level >= GGML_LOG_LEVEL_WARN)) {
        std::fputs(text, stderr);
    }
    if (level >= GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_CONT) {
        std::lock_guard<std::mutex> lk(g_log_mu);
        if (level == GGML_LOG_LEVEL_CONT && !g_log_tail.empty()) {
            g_log_tail.back() += text;
        } else {
            g_log_tail.emplace_back(text);
        }
        while (g_log_tail.size() > 8) g_log_tail.pop_front();
    }
}

void log_clear() {
    std::lock_guard<std::mutex> lk(g_log_mu);
    g_log_tail.clear();
}

bool says_out_of_memory(const std::string & t);

// The first line logged since log_clear that says an allocation failed ("" if none): a failed
// weight allocation is logged before llama.cpp's last, generic "failed to load model".
std::string log_out_of_memory() {
    std::lock_guard<std::mutex> lk(g_log_mu);
    for (const auto & s : g_log_tail) {
        if (says_out_of_memory(s)) {
            std::string out = s;
            while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
            return out;
        }
    }
    return "";
}

std::string log_last_error() {
    std::lock_guard<std::mutex> lk(g_log_mu);
    std::string out;
    for (const auto & s : g_log_tail) {
        if (s.find("error") != std::string::npos || s.find("failed") != std::string::npos ||
            s.find("not supported") != std::string::npos) {
            out = s;
        }
    }
    while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
    return out;
}

// ---- C++ exceptions stop here ----------------------------------------------------------
// llama.cpp's C API throws on some paths (llama_decode's batch conversion and graph
// allocation, std::bad_alloc from any of its containers or ours). Every public method runs
// its body through guarded(), so such a failure reaches Python as a Status (kEngineError),
// never as an exception through Cython (whose `except +` is only a backstop) nor as
// std::terminate.

// What the exception being handled says; call only inside a catch block.
std::string current_exception_text() {
    try {
        throw;
    } catch (const std::bad_alloc &) {
        return "out of memory (std::bad_alloc)";
    } catch (const std::exception & e) {
        return std::string("C++ exception: ") + e.what();
    } catch (...) {
        return "unknown C++ exception";
    }
}

template <class F>
Status guarded(const char * what, F && body) {
    try {
        return body();
    } catch (...) {
        return Status(kEngineError, std::string(what) + " failed: " + current_exception_text());
    }
}

// The most positions a Truncate drops on a rollback-limited cache (DeepSeek V4's n_rs_seq):
// a verifying step of a token and up to 32 drafts.
constexpr int32_t kRollbackWindow = 32;

std::once_flag g_backend_once;

void backend_init() {
    std::call_once(g_backend_once, [] {
        // ggml-vulkan fuses runs of neighbouring ops into one kernel where its checks allow, and
        // whether a run qualifies depends on the rest of the graph: a stage's graph fused a layer
        // other than the whole model's did (the tiny DeepSeek V4's MoE top-k in layers 3 and 4 of
        // 6: fused in the stage [3, 6), not in the whole model), and those layers computed other
        // bits (max |diff| 5.1e-07; deepseek2 cut after layer 5, 6 or 7 of 8: 4.5e-08 to 6.0e-08,
        // on lavapipe). With fusion off every split computes the whole model's bits
        // (docs/devices.md); DGR_VK_FUSION=1 keeps ggml's fusion. Set before any Vulkan device
        // exists (ggml reads it when it creates one); a value the user set is kept.
        const char * fuse = std::getenv("DGR_VK_FUSION");
        if (!(fuse && std::string(fuse) == "1")) {
#ifndef _WIN32
            setenv("GGML_VK_DISABLE_FUSION", "1", 0);
#else
            if (!std::getenv("GGML_VK_DISABLE_FUSION")) _putenv_s("GGML_VK_DISABLE_FUSION", "1");
#endif
        }
        llama_log_set(log_cb, nullptr);
        llama_backend_init();
    });
}

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

// ---- compute devices (ggml's backend registry) ------------------------------------------

const char * dev_type_name(enum ggml_backend_dev_type t) {
    switch (t) {
        case GGML_BACKEND_DEVICE_TYPE_CPU:   return "cpu";
        case GGML_BACKEND_DEVICE_TYPE_GPU:   return "gpu";
        case GGML_BACKEND_DEVICE_TYPE_IGPU:  return "igpu";
        case GGML_BACKEND_DEVICE_TYPE_ACCEL: return "accel";
        default:                             return "other";
    }
}

std::string lowered(std::string t) {
    for (auto & c : t) c = (char) std::tolower((unsigned char) c);
    return t;
}

// The driver of a device, where its backend can tell: Vulkan's driver name and version
// ("llvmpipe Mesa 22.3.6 (LLVM 15.0.6)"), matched by the device's name.
std::string device_driver(ggml_backend_dev_t dev) {
    const std::string reg = ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev));
#if DGR_WITH_VULKAN
    if (reg == "Vulkan") {
        static std::mutex mu;
        static std::vector<std::pair<std::string, std::string>> cache;  // (device name, driver)
        std::lock_guard<std::mutex> lk(mu);
        if (cache.empty()) {
            VkApplicationInfo app{};
            app.sType = VK_STRUCTURE_TYPE_APPLICATION_INFO;
            app.apiVersion = VK_API_VERSION_1_2;
            VkInstanceCreateInfo ci{};
            ci.sType = VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO;
            ci.pApplicationInfo = &app;
            VkInstance inst = VK_NULL_HANDLE;
            if (vkCreateInstance(&ci, nullptr, &inst) == VK_SUCCESS) {
                uint32_t n = 0;
                vkEnumeratePhysicalDevices(inst, &n, nullptr);
                std::vector<VkPhysicalDevice> pds(n);
                vkEnumeratePhysicalDevices(inst, &n, pds.data());
                for (VkPhysicalDevice pd : pds) {
                    VkPhysicalDeviceDriverProperties dp{};
                    dp.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES;
                    VkPhysicalDeviceProperties2 p2{};
                    p2.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2;
                    p2.pNext = &dp;
                    vkGetPhysicalDeviceProperties2(pd, &p2);
                    cache.emplace_back(p2.properties.deviceName,
                                       std::string(dp.driverName) + " " + dp.driverInfo);
                }
                vkDestroyInstance(inst, nullptr);
            }
            if (cache.empty()) cache.emplace_back("", "");  // asked once
        }
        const std::string desc = ggml_backend_dev_description(dev);
        for (const auto & e : cache) {
            if (!e.first.empty() && desc.rfind(e.first, 0) == 0) return e.second;
        }
    }
#endif
    (void) reg;
    return "";
}

DeviceInfo describe_device(ggml_backend_dev_t dev) {
    DeviceInfo d;
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    d.name = props.name ? props.name : "";
    d.description = props.description ? props.description : "";
    d.type = dev_type_name(props.type);
    d.backend = ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev));
    d.device_id = props.device_id ? props.device_id : "";
    d.driver = device_driver(dev);
    d.memory_free = props.memory_free;
    d.memory_total = props.memory_total;
    return d;
}

// The device an engine computes on: "cpu" (any case) is the CPU device, anything else a
// device name of the registry (case-insensitive).
Status find_device(const std::string & name, ggml_backend_dev_t * out) {
    const std::string want = lowered(name);
    std::string names;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        const std::string n = ggml_backend_dev_name(dev);
        const bool cpu = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
        if (lowered(n) == want || (cpu && want == "cpu")) {
            *out = dev;
            return Status();
        }
        names += (names.empty() ? "" : ", ") + (cpu ? std::string("cpu") : n);
    }
    std::string backends;
    for (size_t i = 0; i < ggml_backend_reg_count(); ++i) {
        backends += (i ? ", " : "") + std::string(ggml_backend_reg_name(ggml_backend_reg_get(i)));
    }
    // a device of a backend this binary lacks: say which build has it
    static const struct { const char * prefix; const char * backend; const char * flag; } kKnown[] = {
        {"vulkan", "Vulkan", "vulkan"}, {"cuda", "CUDA", "cuda"}, {"rocm", "ROCm", "rocm"},
        {"hip", "ROCm", "rocm"}, {"mtl", "Metal", "metal"}, {"metal", "Metal", "metal"},
    };
    for (const auto & k : kKnown) {
        if (want.rfind(k.prefix, 0) != 0) continue;
        bool built = false;
        for (size_t i = 0; i < ggml_backend_reg_count(); ++i) {
            built = built || lowered(ggml_backend_reg_name(ggml_backend_reg_get(i))) == lowered(k.backend);
        }
        if (!built) {
            return Status(kDeviceNotFound, "device '" + name + "' needs the " + k.backend + " backend, and this "
                          "build of dgr has only " + backends + ": rebuild it with `DGR_BACKEND=" + k.flag +
                          " pip install -e .`");
        }
        std::string hint;
        if (std::string(k.backend) == "Vulkan" && !std::getenv("GGML_VK_VISIBLE_DEVICES")) {
            hint = " (ggml lists a software Vulkan device such as lavapipe only when "
                   "GGML_VK_VISIBLE_DEVICES names it, e.g. GGML_VK_VISIBLE_DEVICES=0)";
        }
        return Status(kDeviceNotFound, "no device named '" + name + "': the " + k.backend + " backend sees " +
                      "no such device; this process can use " + names + hint);
    }
    return Status(kDeviceNotFound, "no device named '" + name + "'; this process can use " + names +
                  " (python -m dgr devices lists them)");
}

// A C++ exception or log line of a backend that says the device itself failed.
bool says_device_lost(const std::string & t) {
    const std::string l = lowered(t);
    return l.find("devicelost") != std::string::npos || l.find("device lost") != std::string::npos ||
           l.find("device_lost") != std::string::npos;
}

bool says_out_of_memory(const std::string & t) {
    const std::string l = lowered(t);
    return l.find("out of memory") != std::string::npos || l.find("outofdevicememory") != std::string::npos ||
           l.find("failed to allocate") != std::string::npos || l.find("unable to allocate") != std::string::npos;
}

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

// ---- MTP (NextN) drafting on the last stage ---------------------------------------------
// A second llama context of type MTP on the same model runs the NextN block. After every
// trunk chunk, the catch-up decode feeds it the pairs (x_q, h_{q-1}): the token at position q
// with the trunk's hidden row (t_h_nextn, n_embd_boundary wide) at q-1 (zeros at q = 0), as
// llama.cpp's draft-mtp driver does (common/speculative.cpp). Per slot the trunk rows of the
// last kRows positions are kept: the last one is the pending h a draft or the next step
// pairs with, the others are what a truncate restores. The engine calls it at four points:
// after each trunk decode (CatchUp), when a slot is cleared or truncated, and to draft.
class MtpDrafter {
public:
    static constexpr int32_t kRows = kRollbackWindow + 1;

    MtpDrafter() = default;
    MtpDrafter(const MtpDrafter &) = delete;
    MtpDrafter & operator=(const MtpDrafter &) = delete;
    ~MtpDrafter() {
        if (batch_.pos) {
            batch_.token = batch_token_;
            batch_.embd = nullptr;
            llama_batch_free(batch_);
        }
        if (ctx_) llama_free(ctx_);
    }

    // The MTP context beside the trunk context `trunk` (created with `cp`), which it reads
    // as its ctx_other.
    Status Init(llama_model * model, llama_context * trunk, const llama_context_params & cp,
                uint32_t n_slots, uint32_t n_ubatch) {
        // llama.cpp's own MTP context (common_speculative_init_result): the target's settings,
        // ctx_type MTP, no rollback snapshots (its memory is a plain KV cache of the NextN
        // block), the target as ctx_other
        llama_context_params mc = cp;
        mc.ctx_type = LLAMA_CONTEXT_TYPE_MTP;
        mc.n_rs_seq = 0;
        mc.ctx_other = trunk;
        ctx_ = llama_init_from_model(model, mc);
        if (!ctx_) {
            std::string why = log_last_error();
            return Status(kMtpNotSupported, "llama.cpp could not create the MTP context" +
                          (why.empty() ? std::string() : " (" + why + ")"));
        }
        // the NextN block's own hidden row of each logits row: the h of the next draft step
        llama_set_embeddings_nextn(ctx_, true, /*masked*/ true);
        llama_set_embeddings_layer_inp(ctx_, 0, false);  // a new graph plan, as for the trunk
        n_slots_ = n_slots;
        n_ubatch_ = n_ubatch;
        return Status();
    }

    // The buffers, once the widths are known (after the model's facts are read).
    void Size(int32_t width, int32_t n_vocab) {
        W_ = (size_t) width;
        n_vocab_ = n_vocab;
        batch_ = llama_batch_init((int32_t) n_ubatch_, 0, 1);
        batch_token_ = batch_.token;
        for (uint32_t i = 0; i < n_ubatch_; ++i) batch_.n_seq_id[i] = 1;
        embd_.assign((size_t) n_ubatch_ * W_, 0.0f);
        zeros_.assign(W_, 0.0f);
        seq_.assign(n_ubatch_, 0);
        tok_.assign(n_ubatch_, 0);
        slots_.resize(n_slots_);
        for (auto & sl : slots_) sl.rows.assign((size_t) kRows * W_, 0.0f);
    }

    llama_context * ctx() const noexcept { return ctx_; }

    void Clear(int32_t slot) {
        llama_memory_seq_rm(llama_get_memory(ctx_), slot, -1, -1);
        slots_[slot].pos0 = 0;
        slots_[slot].n = 0;
    }

    // Why the slot cannot be truncated to `pos` ("" when it can): the pending h after the
    // cut (the trunk's row at pos-1) must be one of the rows kept.
    std::string CannotTruncate(int32_t slot, int32_t pos) const {
        const Slot & ms = slots_[slot];
        if (pos - 1 < ms.pos0 || pos - 1 >= ms.pos0 + ms.n) {
            return "MTP keeps the trunk's hidden rows of the last " + std::to_string(kRows) +
                   " positions only (" + std::to_string(ms.pos0) + ".." + std::to_string(ms.pos0 + ms.n - 1) +
                   "), not that of position " + std::to_string(pos - 1);
        }
        return "";
    }

    // Drop positions from `pos` on; false when the MTP cache refuses.
    bool Truncate(int32_t slot, int32_t pos) {
        if (!llama_memory_seq_rm(llama_get_memory(ctx_), slot, pos, -1)) return false;
        Slot & ms = slots_[slot];
        ms.n = pos - ms.pos0;  // the last row kept is the trunk's h at pos-1: the pending h
        return true;
    }

    // Row k of the trunk chunk just decoded: its slot and token (batch order).
    void SetRow(int32_t k, int32_t slot, int32_t token) {
        seq_[k] = slot;
        tok_[k] = token;
    }

    // The catch-up decode of the n rows of the trunk's last llama_decode (row k: SetRow's
    // token and slot at position pos[k], its trunk hidden row h + k*W); a slot's rows are
    // consecutive and in position order. Returns llama_decode's code (0: done).
    int32_t CatchUp(const llama_pos * pos, const float * h, int32_t n) {
        llama_batch & b = batch_;
        // the pairs (x_q, h_{q-1}), gathered before this chunk's rows are kept
        for (int32_t k = 0; k < n; ++k) {
            const bool cont = k > 0 && seq_[k - 1] == seq_[k];
            const float * prev = cont ? h + (size_t) (k - 1) * W_ : PrevH(seq_[k], pos[k]);
            std::memcpy(embd_.data() + (size_t) k * W_, prev, sizeof(float) * W_);
            b.token[k] = tok_[k];
            b.pos[k] = pos[k];
            b.seq_id[k][0] = seq_[k];
            b.logits[k] = 0;
        }
        for (int32_t k = 0; k < n;) {
            int32_t e = k + 1;
            while (e < n && seq_[e] == seq_[k]) ++e;
            KeepRows(seq_[k], pos[k], h + (size_t) k * W_, e - k);
            k = e;
        }
        b.n_tokens = n;
        b.embd = embd_.data();
        int32_t rc;
        try {
            rc = llama_decode(ctx_, b);
        } catch (...) {
            b.embd = nullptr;
            throw;
        }
        b.embd = nullptr;
        return rc;
    }

    // A greedy chain of n drafts from `token` at pos0 (the slot's next position); the MTP
    // memory is left as before. *stuck: the MTP cache could not drop the draft (the caller
    // clears the slot).
    Status Draft(int32_t slot, int32_t pos0, int32_t token, int32_t n, std::vector<int32_t> * out,
                 bool * stuck) {
        *stuck = false;
        llama_memory_t mem = llama_get_memory(ctx_);
        const int32_t V = n_vocab_;
        llama_batch & b = batch_;
        float * h = embd_.data();
        std::memcpy(h, PrevH(slot, pos0), sizeof(float) * W_);
        auto failed = [&](const std::string & why) {
            // the MTP memory past pos0 is the draft's own: drop it; the slot keeps its state
            llama_memory_seq_rm(mem, slot, pos0, -1);
            out->clear();
            return Status(kEngineError, "MTP draft of slot " + std::to_string(slot) + " failed: " + why);
        };
        int32_t tok = token;
        try {
            for (int32_t i = 0; i < n; ++i) {
                b.n_tokens = 1;
                b.token[0] = tok;
                b.pos[0] = pos0 + i;
                b.seq_id[0][0] = slot;
                b.logits[0] = 1;
                b.embd = h;
                const int32_t rc = llama_decode(ctx_, b);
                b.embd = nullptr;
                if (rc != 0) {
                    std::string why = log_last_error();
                    return failed("llama_decode returned " + std::to_string(rc) + (why.empty() ? "" : ": " + why));
                }
                const float * lg = llama_get_logits_ith(ctx_, 0);
                if (!lg) return failed("llama.cpp returned no MTP logits");
                int32_t best = 0;
                for (int32_t v = 1; v < V; ++v) {
                    if (lg[v] > lg[best]) best = v;  // strict: the lowest id wins a tie
                }
                out->push_back(best);
                if (i + 1 < n) {
                    const float * hn = llama_get_embeddings_nextn_ith(ctx_, 0);
                    if (!hn) return failed("llama.cpp returned no NextN hidden row");
                    std::memcpy(h, hn, sizeof(float) * W_);
                }
                tok = best;
            }
        } catch (...) {
            b.embd = nullptr;
            return failed(current_exception_text());
        }
        if (!llama_memory_seq_rm(mem, slot, pos0, -1)) {
            *stuck = true;
            out->clear();
            return Status(kEngineError, "the MTP cache could not drop the draft of slot " + std::to_string(slot) +
                          "; the slot was cleared and must be re-prefilled");
        }
        return Status();
    }

private:
    struct Slot {
        int32_t pos0 = 0;              // position of the first row kept
        int32_t n = 0;                 // rows kept: positions [pos0, pos0 + n)
        std::vector<float> rows;       // kRows * W
    };

    // The h a token at `pos` of `slot` pairs with: the trunk row at pos-1 (zeros at 0).
    const float * PrevH(int32_t slot, int32_t pos) const {
        const Slot & ms = slots_[slot];
        if (pos <= 0 || ms.n <= 0 || pos - 1 != ms.pos0 + ms.n - 1) return zeros_.data();
        return ms.rows.data() + (size_t) (ms.n - 1) * W_;
    }

    // Keep the trunk rows h[0..n) of positions [pos, pos+n) as the slot's last rows.
    void KeepRows(int32_t slot, int32_t pos, const float * h, int32_t n) {
        Slot & ms = slots_[slot];
        if (ms.n > 0 && ms.pos0 + ms.n != pos) ms.n = 0;  // not a continuation: start over
        if (ms.n == 0) ms.pos0 = pos;
        if (n >= kRows) {
            std::memcpy(ms.rows.data(), h + (size_t) (n - kRows) * W_, sizeof(float) * W_ * kRows);
            ms.pos0 = pos + n - kRows;
            ms.n = kRows;
            return;
        }
        const int32_t drop = std::max(0, ms.n + n - kRows);
        if (drop > 0) {
            std::memmove(ms.rows.data(), ms.rows.data() + (size_t) drop * W_, sizeof(float) * W_ * (ms.n - drop));
            ms.pos0 += drop;
            ms.n -= drop;
        }
        std::memcpy(ms.rows.data() + (size_t) ms.n * W_, h, sizeof(float) * W_ * n);
        ms.n += n;
    }

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
    Status CheckStageInputs(const int32_t * tokens, const float * boundary, int32_t n_tokens) const;
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
        if (st.ok() || st.code == kDeviceLost || !says_device_lost(st.message)) return st;
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

Engine::Engine() : impl_(new Impl) {}
Engine::~Engine() = default;

const EngineInfo & Engine::info() const noexcept { return impl_->info; }
bool Engine::is_first() const noexcept { return impl_->first; }
bool Engine::is_last() const noexcept { return impl_->last; }
int32_t Engine::OutputWidth() const noexcept { return impl_->OutputWidth(); }

Status Engine::Load(const EngineConfig & cfg, std::unique_ptr<Engine> * out) {
    return guarded("loading the model", [&] { return Impl::Load(cfg, out); });
}

Status Engine::RefreshMemory() {
    return guarded("reading the memory figures", [&] { return impl_->RefreshMemory(); });
}

Status Engine::Tokenize(const std::string & text, bool add_special, bool parse_special,
                        std::vector<int32_t> * out) const {
    return guarded("tokenize", [&] { return impl_->Tokenize(text, add_special, parse_special, out); });
}

Status Engine::Detokenize(const int32_t * tokens, size_t n, bool remove_special, bool unparse_special,
                          std::string * out) const {
    return guarded("detokenize", [&] {
        return impl_->Detokenize(tokens, n, remove_special, unparse_special, out);
    });
}

Status Engine::Forward(int32_t slot, const int32_t * pos, const int32_t * tokens, const float * boundary,
                       int32_t n_tokens, const uint8_t * want, float * out, size_t out_capacity,
                       int32_t * n_out_rows) {
    *n_out_rows = 0;
    if (impl_->lost) return impl_->Refuse();
    log_clear();  // a failure's message quotes this call's log lines, not an earlier one's
    return impl_->Checked(guarded("forward", [&] {
        return impl_->Forward(slot, pos, tokens, boundary, n_tokens, want, out, out_capacity, n_out_rows);
    }));
}

Status Engine::ForwardBatch(const int32_t * slots, const int32_t * pos, const int32_t * tokens,
                            const float * boundary, int32_t n_tokens, const uint8_t * want, float * out,
                            size_t out_capacity, int32_t * n_out_rows) {
    *n_out_rows = 0;
    if (impl_->lost) return impl_->Refuse();
    log_clear();
    return impl_->Checked(guarded("forward_batch", [&] {
        return impl_->ForwardBatch(slots, pos, tokens, boundary, n_tokens, want, out, out_capacity,
                                   n_out_rows);
    }));
}

Status Engine::Embed(int32_t slot, const int32_t * pos, const int32_t * tokens, const float * boundary,
                     int32_t n_tokens, float * out, size_t out_capacity, int32_t * n_out_rows) {
    *n_out_rows = 0;
    if (impl_->lost) return impl_->Refuse();
    log_clear();
    return impl_->Checked(guarded("embed", [&] {
        return impl_->Embed(slot, pos, tokens, boundary, n_tokens, out, out_capacity, n_out_rows);
    }));
}

Status Engine::Release(int32_t slot) {
    return guarded("release", [&] { return impl_->Release(slot); });
}

Status Engine::CopySlot(int32_t src, int32_t dst) {
    if (impl_->lost) return impl_->Refuse();
    return guarded("copy_slot", [&] { return impl_->CopySlot(src, dst); });
}

Status Engine::Truncate(int32_t slot, int32_t pos) {
    if (impl_->lost) return impl_->Refuse();
    return impl_->Checked(guarded("truncate", [&] { return impl_->Truncate(slot, pos); }));
}

Status Engine::MtpDraft(int32_t slot, int32_t token, int32_t n_max, std::vector<int32_t> * out) {
    out->clear();
    if (impl_->lost) return impl_->Refuse();
    return impl_->Checked(guarded("mtp_draft", [&] { return impl_->MtpDraft(slot, token, n_max, out); }));
}

Status Engine::InjectFault(const std::string & what) {
    if (what == "device_lost") {
        impl_->MarkLost();
        return Status();
    }
    if (what == "device_lost_in_decode") {
        impl_->throw_in_decode = "vk::Queue::submit: ErrorDeviceLost (injected)";
        return Status();
    }
    return Status(kInvalidArgument, "unknown fault '" + what + "' (known: device_lost, "
                  "device_lost_in_decode)");
}

Status ListDevices(std::vector<DeviceInfo> * out) {
    out->clear();
    return guarded("listing the devices", [&] {
        backend_init();
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            out->push_back(describe_device(ggml_backend_dev_get(i)));
        }
        return Status();
    });
}

std::vector<std::string> BuiltBackends() {
    std::vector<std::string> out;
    try {
        backend_init();
        for (size_t i = 0; i < ggml_backend_reg_count(); ++i) out.emplace_back(ggml_backend_reg_name(ggml_backend_reg_get(i)));
    } catch (...) {
        // the registry's own start failed (a backend that throws at init): report none
    }
    return out;
}

// ggml's CPU reference kernels on every CPU backend of `ctx` (EngineConfig::batch_invariant):
// rows computed the same whatever else the forward holds. llama.cpp has no setting for it; its
// scheduler's backends are the context's own, and the CPU backend's setter is reached by name.
static bool UseReferenceKernels(llama_context * ctx) {
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

Status Engine::Impl::Load(const EngineConfig & cfg, std::unique_ptr<Engine> * out) {
    backend_init();
    log_clear();

    if (cfg.n_slots < 1 || cfg.n_slots > 256) {
        return Status(kInvalidArgument, "n_slots must be in [1, 256], got " + std::to_string(cfg.n_slots));
    }
    if (cfg.n_ctx < 1) return Status(kInvalidArgument, "n_ctx (per slot) must be >= 1");
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
    cp.n_ctx = cfg.n_ctx * cfg.n_slots;
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
    in.n_ctx = cfg.n_ctx;
    in.n_ctx_alloc = llama_n_ctx_seq(m.ctx);
    in.n_slots = cfg.n_slots;
    in.n_ubatch = cfg.n_ubatch;
    in.n_threads = cfg.n_threads;
    in.flash_attn = cfg.flash_attn;
    in.batch_invariant = cfg.batch_invariant;
    in.type_k = cfg.type_k;
    in.type_v = cfg.type_v;
    in.hash_layer_count = (int32_t) facts.hash_layer_count;
    m.trunk_tokens = m.first || start < facts.hash_layer_count;
    in.needs_token_ids = m.trunk_tokens || m.mtp != nullptr;  // the NextN block embeds the tokens
    in.mtp = m.mtp != nullptr;
    in.n_layer_nextn = (int32_t) facts.n_layer_nextn;
    in.rollback_window = m.rs_window;
    in.n_params = llama_model_n_params(m.model);
    in.token_bos = llama_vocab_bos(m.vocab);
    in.token_eos = llama_vocab_eos(m.vocab);
    in.add_bos = llama_vocab_get_add_bos(m.vocab);
    if (in.n_ctx_alloc < cfg.n_ctx) {
        return Status(kInvalidArgument, "llama.cpp allocated " + std::to_string(in.n_ctx_alloc) +
                      " context tokens per slot, fewer than the n_ctx=" + std::to_string(cfg.n_ctx) + " asked");
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
    if (!m.first && (rope == LLAMA_ROPE_TYPE_MROPE || rope == LLAMA_ROPE_TYPE_IMROPE)) {
        m.n_pos_sections = 4;  // GGML_MROPE_SECTIONS
        m.pos_sections.assign((size_t) cfg.n_ubatch * m.n_pos_sections, 0);
    }
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

Status Engine::Impl::Tokenize(const std::string & text, bool add_special, bool parse_special,
                              std::vector<int32_t> * out) const {
    const Impl & m = *this;
    if (text.size() > (size_t) INT32_MAX / 2) return Status(kInvalidArgument, "text too long to tokenize");
    out->resize(text.size() + 8);
    int32_t n = llama_tokenize(m.vocab, text.data(), (int32_t) text.size(), out->data(),
                               (int32_t) out->size(), add_special, parse_special);
    if (n < 0) {
        if (n == INT32_MIN) return Status(kInvalidArgument, "tokenization overflowed int32");
        out->resize((size_t) -n);
        n = llama_tokenize(m.vocab, text.data(), (int32_t) text.size(), out->data(),
                           (int32_t) out->size(), add_special, parse_special);
        if (n < 0) return Status(kEngineError, "tokenization failed");
    }
    out->resize((size_t) n);
    return Status();
}

Status Engine::Impl::Detokenize(const int32_t * tokens, size_t n, bool remove_special,
                                bool unparse_special, std::string * out) const {
    const Impl & m = *this;
    for (size_t i = 0; i < n; ++i) {
        if (tokens[i] < 0 || tokens[i] >= m.info.n_vocab) {
            return Status(kInvalidToken, "token id " + std::to_string(tokens[i]) + " at index " +
                          std::to_string(i) + " is outside the vocabulary [0, " +
                          std::to_string(m.info.n_vocab) + ")");
        }
    }
    out->resize(n * 8 + 16);
    int32_t k = llama_detokenize(m.vocab, tokens, (int32_t) n, out->data(), (int32_t) out->size(),
                                 remove_special, unparse_special);
    if (k < 0) {
        out->resize((size_t) -k);
        k = llama_detokenize(m.vocab, tokens, (int32_t) n, out->data(), (int32_t) out->size(),
                             remove_special, unparse_special);
        if (k < 0) return Status(kEngineError, "detokenization failed");
    }
    out->resize((size_t) k);
    return Status();
}

Status Engine::TokenPieces(int32_t first, int32_t count, bool special, std::string * bytes,
                           std::vector<int32_t> * ends) const {
    return guarded("token_pieces", [&]() -> Status {
        const int32_t n_vocab = impl_->info.n_vocab;
        if (first < 0 || count < 0) {
            return Status(kInvalidArgument, "token_pieces needs first >= 0 and count >= 0, got " +
                          std::to_string(first) + " and " + std::to_string(count));
        }
        const int32_t last = (int32_t) std::min<int64_t>((int64_t) first + count, n_vocab);
        bytes->clear();
        ends->clear();
        char buf[256];
        for (int32_t t = first; t < last; ++t) {
            int32_t k = llama_token_to_piece(impl_->vocab, t, buf, (int32_t) sizeof buf, 0, special);
            if (k < 0) {
                std::string big((size_t) -k, '\0');
                k = llama_token_to_piece(impl_->vocab, t, big.data(), (int32_t) big.size(), 0, special);
                if (k < 0) return Status(kEngineError, "token_to_piece failed for " + std::to_string(t));
                bytes->append(big.data(), (size_t) k);
            } else {
                bytes->append(buf, (size_t) k);
            }
            if (bytes->size() > (size_t) INT32_MAX) return Status(kInvalidArgument, "pieces too long");
            ends->push_back((int32_t) bytes->size());
        }
        return Status();
    });
}

bool Engine::IsEog(int32_t token) const {
    return token >= 0 && token < impl_->info.n_vocab && llama_vocab_is_eog(impl_->vocab, token);
}

int64_t Engine::GraphsReused() const {
    return impl_->ctx ? llama_perf_context(impl_->ctx).n_reused : 0;
}

Engine::Counters Engine::GetCounters() const {
    const auto & c = impl_->counters;
    Counters out;
    out.forwards = c.forwards.load(std::memory_order_relaxed);
    out.decodes = c.decodes.load(std::memory_order_relaxed);
    out.ubatches = c.ubatches.load(std::memory_order_relaxed);
    out.forward_ns = c.forward_ns.load(std::memory_order_relaxed);
    out.decode_ns = c.decode_ns.load(std::memory_order_relaxed);
    out.graphs_reused = c.graphs_reused.load(std::memory_order_relaxed);
    return out;
}

int32_t Engine::NextPos(int32_t slot) const {
    const Impl & m = *impl_;
    if (slot < 0 || (uint32_t) slot >= m.cfg.n_slots) return -1;
    return llama_memory_seq_pos_max(llama_get_memory(m.ctx), slot) + 1;
}

Status Engine::Impl::Release(int32_t slot) {
    Impl & m = *this;
    if (slot < 0 || (uint32_t) slot >= m.cfg.n_slots) {
        return Status(kUnknownSlot, "slot " + std::to_string(slot) + " does not exist; this engine has slots 0.." +
                      std::to_string(m.cfg.n_slots - 1));
    }
    m.ClearSlot(slot);
    return Status();
}

Status Engine::Impl::CopySlot(int32_t src, int32_t dst) {
    Impl & m = *this;
    for (const int32_t s : {src, dst}) {
        if (s < 0 || (uint32_t) s >= m.cfg.n_slots) {
            return Status(kUnknownSlot, "slot " + std::to_string(s) + " does not exist; this engine has slots 0.." +
                          std::to_string(m.cfg.n_slots - 1));
        }
    }
    if (src == dst) return Status(kInvalidArgument, "a slot is not copied onto itself");
    if (m.mtp || m.info.arch == "deepseek4") {
        return Status(kInvalidArgument, "this engine (" + m.info.arch + (m.mtp ? ", MTP" : "") +
                      ") does not copy a slot's caches");
    }
    llama_memory_t mem = llama_get_memory(m.ctx);
    m.ClearSlot(dst);
    // one KV stream per slot (kv_unified=false): llama.cpp copies the whole stream's buffers
    // at the start of the next decode (llama_kv_cache::seq_cp, update), the bytes as they are
    llama_memory_seq_cp(mem, src, dst, -1, -1);
    m.rs_tail[dst] = m.rs_tail[src];
    return Status();
}

void Engine::Impl::ClearSlot(int32_t slot) {
    Impl & m = *this;
    llama_memory_seq_rm(llama_get_memory(m.ctx), slot, -1, -1);
    m.rs_tail[slot] = 0;
    if (m.mtp) m.mtp->Clear(slot);
}

Status Engine::Impl::Truncate(int32_t slot, int32_t pos) {
    Impl & m = *this;
    if (slot < 0 || (uint32_t) slot >= m.cfg.n_slots) {
        return Status(kUnknownSlot, "slot " + std::to_string(slot) + " does not exist; this engine has slots 0.." +
                      std::to_string(m.cfg.n_slots - 1));
    }
    if (pos < 0) return Status(kInvalidPosition, "truncate position " + std::to_string(pos) + " is negative");
    llama_memory_t mem = llama_get_memory(m.ctx);
    const int32_t next = llama_memory_seq_pos_max(mem, slot) + 1;
    if (pos >= next) return Status();  // nothing past pos
    const std::string span = "positions " + std::to_string(pos) + ".." + std::to_string(next - 1) + " of slot " +
                             std::to_string(slot);
    auto refuse = [&](const std::string & why) {
        m.ClearSlot(slot);
        return Status(kRollbackUnsupported, "this stage cannot drop " + span + ": " + why +
                      "; the slot was cleared: re-prefill");
    };
    if (pos == 0) {  // the whole sequence: always possible
        m.ClearSlot(slot);
        return Status();
    }
    const int32_t drop = next - pos;
    if (m.rs_window >= 0 && drop > std::min(m.rs_window, m.rs_tail[slot])) {
        // The snapshots are of the slot's tokens in the last ubatch: past them (or after a
        // truncate with no forward since) llama.cpp's seq_rm would accept a rollback it cannot
        // restore exactly.
        if (m.rs_window == 0) {
            return refuse(m.info.arch + "'s recurrent state keeps no history of its positions");
        }
        return refuse(m.info.arch + "'s compressed state rolls back at most " + std::to_string(m.rs_window) +
                      " positions, and only of the slot's last forward (" + std::to_string(m.rs_tail[slot]) +
                      " positions since its last forward or truncate)");
    }
    if (m.mtp) {
        const std::string why = m.mtp->CannotTruncate(slot, pos);
        if (!why.empty()) return refuse(why);
    }
    if (!llama_memory_seq_rm(mem, slot, pos, -1)) {
        return refuse("the " + m.info.arch + " cache refuses this partial removal");
    }
    m.rs_tail[slot] = 0;
    if (m.mtp && !m.mtp->Truncate(slot, pos)) {
        return refuse("the MTP cache refuses this partial removal");
    }
    return Status();
}

Status Engine::Impl::MtpDraft(int32_t slot, int32_t token, int32_t n_max, std::vector<int32_t> * out) {
    Impl & m = *this;
    out->clear();
    if (!m.mtp) {
        return Status(kMtpNotSupported, "this engine was loaded without mtp: load the last stage with mtp=True "
                      "to draft with its NextN block");
    }
    if (slot < 0 || (uint32_t) slot >= m.cfg.n_slots) {
        return Status(kUnknownSlot, "slot " + std::to_string(slot) + " does not exist; this engine has slots 0.." +
                      std::to_string(m.cfg.n_slots - 1));
    }
    if (token < 0 || token >= m.info.n_vocab) {
        return Status(kInvalidToken, "token id " + std::to_string(token) + " is outside the vocabulary [0, " +
                      std::to_string(m.info.n_vocab) + ")");
    }
    if (n_max < 0) return Status(kInvalidArgument, "n_max must be >= 0, got " + std::to_string(n_max));
    const int32_t pos0 = llama_memory_seq_pos_max(llama_get_memory(m.ctx), slot) + 1;
    if (pos0 == 0) {
        return Status(kInvalidPosition, "slot " + std::to_string(slot) + " holds no positions: forward the prompt "
                      "before drafting from it");
    }
    // the verifying step (token + drafts) must fit in the slot's context
    const int32_t n = (int32_t) std::max<int64_t>(0, std::min<int64_t>(n_max, (int64_t) m.info.n_ctx - pos0 - 1));
    if (n == 0) return Status();
    bool stuck = false;
    Status st = m.mtp->Draft(slot, pos0, token, n, out, &stuck);
    if (stuck) m.ClearSlot(slot);  // the MTP cache kept a draft it could not drop
    return st;
}

// What a stage takes, checked before any compute: token ids on the first stage (and on one
// that owns hash-routed layers), a boundary on every other, and ids inside the vocabulary.
Status Engine::Impl::CheckStageInputs(const int32_t * tokens, const float * boundary,
                                      int32_t n_tokens) const {
    const Impl & m = *this;
    const EngineInfo & in = m.info;
    if (m.first && !tokens) {
        return Status(kInvalidArgument, "the first stage (layers starting at 0) takes token ids");
    }
    if (m.first && boundary) {
        return Status(kInvalidBoundary, "stage [" + std::to_string(in.layer_start) + ", " +
                      std::to_string(in.layer_end) + ") is the first stage: it takes token ids, "
                      "not a boundary");
    }
    if (!m.first && !boundary) {
        return Status(kInvalidBoundary, "stage [" + std::to_string(in.layer_start) + ", " +
                      std::to_string(in.layer_end) + ") takes a boundary array of shape [n_tokens, " +
                      std::to_string(in.n_embd_boundary) + "] from the stage before it");
    }
    if (!m.first && in.needs_token_ids && !tokens) {
        return Status(kMissingTokenIds, "stage [" + std::to_string(in.layer_start) + ", " +
                      std::to_string(in.layer_end) + ") " +
                      (m.trunk_tokens ? "owns hash-routed layers (hash_layer_count=" +
                                            std::to_string(in.hash_layer_count) + ")"
                                      : std::string("drafts with MTP (its NextN block embeds the tokens)")) +
                      " and needs the token ids with the boundary");
    }
    if (tokens) {
        for (int32_t i = 0; i < n_tokens; ++i) {
            if (tokens[i] < 0 || tokens[i] >= in.n_vocab) {
                return Status(kInvalidToken, "token id " + std::to_string(tokens[i]) + " at index " +
                              std::to_string(i) + " is outside the vocabulary [0, " +
                              std::to_string(in.n_vocab) + ")");
            }
        }
    }
    return Status();
}

int32_t Engine::Impl::Decode(int32_t n) {
    if (!throw_in_decode.empty()) {  // a fault a test injected, as a backend would throw it
        const std::string what = throw_in_decode;
        throw_in_decode.clear();
        throw std::runtime_error(what);
    }
    llama_batch & b = batch;
    // an embedding batch without token ids on an M-RoPE model: the sectioned positions
    llama_pos * const own_pos = b.pos;
    if (!b.token && b.embd && n_pos_sections > 1) {
        llama_pos * ps = pos_sections.data();
        for (int32_t i = 0; i < n; ++i) {
            ps[i] = ps[n + i] = ps[2 * n + i] = own_pos[i];
            ps[3 * n + i] = 0;
        }
        b.pos = ps;
    }
    int32_t rc;
    try {
        rc = llama_decode(ctx, b);
    } catch (...) {
        b.pos = own_pos;  // llama_batch_free frees the batch's own array
        throw;
    }
    b.pos = own_pos;
    b.token = nullptr;
    b.embd = nullptr;
    return rc;
}

// A step of one slot is a batch of one slot: the one forward core is ForwardBatch. Only the
// checks whose words are a single slot's are made here (a contiguous run of positions).
Status Engine::Impl::Forward(int32_t slot, const int32_t * pos, const int32_t * tokens,
                             const float * boundary, int32_t n_tokens, const uint8_t * want, float * out,
                             size_t out_capacity, int32_t * n_out_rows) {
    Impl & m = *this;
    *n_out_rows = 0;
    if (slot < 0 || (uint32_t) slot >= m.cfg.n_slots) {
        return Status(kUnknownSlot, "slot " + std::to_string(slot) + " does not exist; this engine has slots 0.." +
                      std::to_string(m.cfg.n_slots - 1));
    }
    if (n_tokens <= 0) return Status(kInvalidArgument, "forward needs at least one token");
    if (!pos) return Status(kInvalidPosition, "positions are required");
    for (int32_t i = 0; i < n_tokens; ++i) {
        if (pos[i] != pos[0] + i) {
            return Status(kInvalidPosition, "positions must be contiguous: position " + std::to_string(pos[i]) +
                          " at index " + std::to_string(i) + " should be " + std::to_string(pos[0] + i));
        }
    }
    m.one_slot.assign((size_t) n_tokens, slot);
    return m.ForwardBatch(m.one_slot.data(), pos, tokens, boundary, n_tokens, want, out, out_capacity,
                          n_out_rows);
}

Status Engine::Impl::Embed(int32_t slot, const int32_t * pos, const int32_t * tokens,
                           const float * boundary, int32_t n_tokens, float * out, size_t out_capacity,
                           int32_t * n_out_rows) {
    Impl & m = *this;
    *n_out_rows = 0;
    if (!m.last) {
        return Status(kInvalidArgument, "embeddings come from the last stage; this stage ends at layer " +
                      std::to_string(m.info.layer_end) + " of " + std::to_string(m.info.n_layer));
    }
    if (m.mtp || m.info.arch == "deepseek4") {
        return Status(kInvalidArgument, "this engine (" + m.info.arch + (m.mtp ? ", MTP" : "") +
                      ") does not return embeddings");
    }
    if (n_tokens <= 0) return Status(kInvalidArgument, "forward needs at least one token");
    m.embed_want.assign((size_t) n_tokens, 1);
    // on for this call only: a later forward's graph returns logits as before
    llama_set_embeddings(m.ctx, true);
    m.embed_rows = true;
    struct Off {
        Impl & m;
        ~Off() { m.embed_rows = false; llama_set_embeddings(m.ctx, false); }
    } off{m};
    return m.Forward(slot, pos, tokens, boundary, n_tokens, m.embed_want.data(), out, out_capacity,
                     n_out_rows);
}

Status Engine::Impl::ForwardBatch(const int32_t * slots, const int32_t * pos, const int32_t * tokens,
                                  const float * boundary, int32_t n_tokens, const uint8_t * want,
                                  float * out, size_t out_capacity, int32_t * n_out_rows) {
    Impl & m = *this;
    const EngineInfo & in = m.info;
    *n_out_rows = 0;
    if (n_tokens <= 0) return Status(kInvalidArgument, "forward needs at least one token");
    if (!slots) return Status(kUnknownSlot, "a batch needs the slot of every token");
    if (!pos) return Status(kInvalidPosition, "positions are required");
    const uint32_t n_slots = m.cfg.n_slots;
    for (int32_t i = 0; i < n_tokens; ++i) {
        if (slots[i] < 0 || (uint32_t) slots[i] >= n_slots) {
            return Status(kUnknownSlot, "slot " + std::to_string(slots[i]) + " of token " + std::to_string(i) +
                          " does not exist; this engine has slots 0.." + std::to_string(n_slots - 1));
        }
    }
    Status in_ok = CheckStageInputs(tokens, boundary, n_tokens);
    if (!in_ok.ok()) return in_ok;

    // Each slot's tokens, in input order, continue it: the first at its next position, each
    // later one at the position after the one before it.
    std::vector<int32_t> expect(n_slots, -1);   // next position a slot's next token must have
    std::vector<int32_t> start(n_slots, -1);    // the slot's position before this batch
    std::vector<int32_t> last_idx(n_slots, -1); // the slot's last token in the batch
    std::vector<int32_t> seen;                  // the slots of the batch, in order of appearance
    for (int32_t i = 0; i < n_tokens; ++i) {
        const int32_t s = slots[i];
        if (expect[s] < 0) {
            expect[s] = start[s] = llama_memory_seq_pos_max(llama_get_memory(m.ctx), s) + 1;
            seen.push_back(s);
            if (pos[i] != expect[s]) {
                return Status(kInvalidPosition, "slot " + std::to_string(s) + " continues at position " +
                              std::to_string(expect[s]) + " but its first token in the batch (index " +
                              std::to_string(i) + ") is at " + std::to_string(pos[i]) +
                              (pos[i] > expect[s] ? " (a gap: send the missing tokens first)"
                                                  : " (already computed: release the slot and re-prefill)"));
            }
        } else if (pos[i] != expect[s]) {
            return Status(kInvalidPosition, "slot " + std::to_string(s) + " appears again at index " +
                          std::to_string(i) + " with position " + std::to_string(pos[i]) + ", but its "
                          "tokens in a batch must have consecutive positions: it should be " +
                          std::to_string(expect[s]) + (pos[i] < expect[s] ? " (a duplicate position)" : ""));
        }
        ++expect[s];
        last_idx[s] = i;
    }
    for (const int32_t s : seen) {
        if ((int64_t) expect[s] > (int64_t) in.n_ctx) {
            return Status(kContextFull, "slot " + std::to_string(s) + " holds " + std::to_string(start[s]) +
                          " tokens; " + std::to_string(expect[s] - start[s]) + " more exceed its context of " +
                          std::to_string(in.n_ctx) + " tokens (release the slot or use a larger n_ctx)");
        }
    }

    // Where each token's output row goes, in input order (-1: no row).
    const int32_t width = OutputWidth();
    std::vector<int32_t> dst((size_t) n_tokens, -1);
    int32_t rows_wanted = 0;
    for (int32_t i = 0; i < n_tokens; ++i) {
        const bool w = !m.last || (want ? want[i] != 0 : last_idx[slots[i]] == i);
        if (w) dst[i] = rows_wanted++;
    }
    if ((size_t) rows_wanted * (size_t) width > out_capacity) {
        return Status(kInvalidArgument, "output buffer holds " + std::to_string(out_capacity) + " floats, " +
                      std::to_string((size_t) rows_wanted * width) + " needed");
    }

    // The llama_batch order: by slot, a slot's tokens in input order. llama.cpp's equal split
    // takes a ubatch's slots as a run of consecutive ids in batch order, so this order lets
    // slots s, s+1, ... share one ubatch whatever order the caller listed them in.
    std::vector<int32_t> order((size_t) n_tokens);
    for (int32_t i = 0; i < n_tokens; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return slots[a] < slots[b]; });

    const int32_t W = in.n_embd_boundary;
    const int32_t U = (int32_t) m.cfg.n_ubatch;
    const bool pass_tokens = tokens && m.trunk_tokens;
    // A failure once llama_decode may have run: no slot of the batch keeps a half-computed step.
    auto clear_all = [&]() {
        for (const int32_t s : seen) m.ClearSlot(s);
    };
    auto slot_list = [&]() {
        std::string t;
        for (size_t k = 0; k < seen.size(); ++k) t += (k ? ", " : "") + std::to_string(seen[k]);
        return t;
    };
    auto cleared = [&](const std::string & why) {
        clear_all();
        return Status(kEngineError, why + "; slots " + slot_list() + " were cleared and must be re-prefilled");
    };
    int32_t rows_out = 0;
    const auto t_forward = std::chrono::steady_clock::now();
    try {
        for (int32_t c0 = 0; c0 < n_tokens; c0 += U) {
            const int32_t n = std::min(U, n_tokens - c0);
            const int32_t * idx = order.data() + c0;
            // the caller's rows are already in batch order here: read them in place
            bool in_place = true;
            for (int32_t k = 1; k < n && in_place; ++k) in_place = idx[k] == idx[0] + k;
            llama_batch & b = m.batch;
            b.n_tokens = n;
            if (pass_tokens) {
                if (in_place) {
                    b.token = const_cast<int32_t *>(tokens + idx[0]);
                } else {
                    for (int32_t k = 0; k < n; ++k) m.batch_token[k] = tokens[idx[k]];
                    b.token = m.batch_token;
                }
            } else {
                b.token = nullptr;
            }
            if (m.first) {
                b.embd = nullptr;
            } else if (in_place) {
                b.embd = const_cast<float *>(boundary + (size_t) idx[0] * W);
            } else {
                m.embd_gather.resize((size_t) U * W);
                for (int32_t k = 0; k < n; ++k) {
                    std::memcpy(m.embd_gather.data() + (size_t) k * W, boundary + (size_t) idx[k] * W,
                                sizeof(float) * (size_t) W);
                }
                b.embd = m.embd_gather.data();
            }
            for (int32_t k = 0; k < n; ++k) {
                b.pos[k] = pos[idx[k]];
                b.seq_id[k][0] = slots[idx[k]];
                b.logits[k] = (m.last && dst[idx[k]] >= 0) ? 1 : 0;
            }
            // the ubatches llama.cpp's equal split will make of this decode: one per run of
            // consecutive slot ids holding as many tokens each (b is in slot order)
            int64_t runs = 0;
            for (int32_t k = 0, prev_s = -2, prev_n = -1; k < n;) {
                int32_t e = k + 1;
                while (e < n && b.seq_id[e][0] == b.seq_id[k][0]) ++e;
                const int32_t s = b.seq_id[k][0];
                if (s != prev_s + 1 || e - k != prev_n) ++runs;
                prev_s = s;
                prev_n = e - k;
                k = e;
            }
            const auto t_decode = std::chrono::steady_clock::now();
            const int32_t rc = m.Decode(n);
            m.counters.decode_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::steady_clock::now() - t_decode).count(), std::memory_order_relaxed);
            m.counters.decodes.fetch_add(1, std::memory_order_relaxed);
            m.counters.ubatches.fetch_add(runs, std::memory_order_relaxed);
            m.counters.graphs_reused.store(llama_perf_context(m.ctx).n_reused, std::memory_order_relaxed);
            if (rc != 0) {
                clear_all();
                std::string why = log_last_error();
                return Status(rc == 1 ? kContextFull : kEngineError,
                              "llama_decode failed with code " + std::to_string(rc) + " on a batch of slots " +
                              slot_list() + "; they were cleared and must be re-prefilled" +
                              (why.empty() ? "" : ": " + why));
            }
            // each slot's tokens in this decode: its rollback window (the last ubatch keeps a
            // sequence's last n_rs_seq+1 tokens together)
            for (int32_t k = 0; k < n;) {
                int32_t e = k + 1;
                while (e < n && slots[idx[e]] == slots[idx[k]]) ++e;
                m.rs_tail[slots[idx[k]]] = e - k;
                k = e;
            }
            if (m.mtp) {
                const float * h = llama_get_embeddings_nextn(m.ctx);
                if (!h) return cleared("llama.cpp returned no hidden rows for the MTP catch-up");
                for (int32_t k = 0; k < n; ++k) m.mtp->SetRow(k, slots[idx[k]], tokens[idx[k]]);
                const int32_t mrc = m.mtp->CatchUp(b.pos, h, n);
                if (mrc != 0) {
                    std::string why = log_last_error();
                    return cleared("the MTP catch-up decode failed with code " + std::to_string(mrc) +
                                   (why.empty() ? "" : ": " + why));
                }
            }
            if (m.last) {
                for (int32_t k = 0; k < n; ++k) {
                    if (!b.logits[k]) continue;
                    const float * row = m.embed_rows ? llama_get_embeddings_ith(m.ctx, k)
                                                     : llama_get_logits_ith(m.ctx, k);
                    if (!row) {
                        return cleared(std::string("llama.cpp returned no ") +
                                       (m.embed_rows ? "embedding" : "logits") + " for row " +
                                       std::to_string(idx[k]));
                    }
                    std::memcpy(out + (size_t) dst[idx[k]] * width, row, sizeof(float) * (size_t) width);
                    ++rows_out;
                }
            } else {
#if DGR_LAYER_RANGE
                const float * bnd = llama_get_boundary(m.ctx);
                if (!bnd) return cleared("llama.cpp returned no boundary");
                if (in_place) {
                    std::memcpy(out + (size_t) idx[0] * width, bnd, sizeof(float) * (size_t) n * width);
                } else {
                    for (int32_t k = 0; k < n; ++k) {
                        std::memcpy(out + (size_t) idx[k] * width, bnd + (size_t) k * width,
                                    sizeof(float) * (size_t) width);
                    }
                }
                rows_out += n;
#else
                return Status(kUnsupportedArch, "this build of llama.cpp has no layer ranges");
#endif
            }
        }
    } catch (...) {
        m.batch.token = nullptr;
        m.batch.embd = nullptr;
        const std::string why = current_exception_text();
        clear_all();
        return Status(kEngineError, "llama.cpp threw during the forward of a batch of slots " + slot_list() +
                      " (" + why + "); they were cleared and must be re-prefilled");
    }
    *n_out_rows = rows_out;
    m.counters.forwards.fetch_add(1, std::memory_order_relaxed);
    m.counters.forward_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - t_forward).count(), std::memory_order_relaxed);
    return Status();
}

}  // namespace dgr
