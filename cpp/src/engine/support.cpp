// llama.cpp's log capture, C++ exceptions stopped at the boundary, and the backends' start.

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <mutex>
#include <new>

#include "impl.h"

namespace dgr {
namespace detail {


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

// ---- C++ exceptions stop here (guarded, impl.h) ------------------------------------------

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


std::string lowered(std::string t) {
    for (auto & c : t) c = (char) std::tolower((unsigned char) c);
    return t;
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

namespace {
std::once_flag g_backend_once;
}  // namespace

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

}  // namespace detail
}  // namespace dgr
