// Compute devices: ggml's backend registry, found by name, described, listed.

#include <cstdlib>
#include <mutex>
#include <utility>

#include "impl.h"

#if DGR_WITH_VULKAN
#include <vulkan/vulkan.h>
#endif

namespace dgr {
namespace detail {

namespace {

const char * dev_type_name(enum ggml_backend_dev_type t) {
    switch (t) {
        case GGML_BACKEND_DEVICE_TYPE_CPU:   return "cpu";
        case GGML_BACKEND_DEVICE_TYPE_GPU:   return "gpu";
        case GGML_BACKEND_DEVICE_TYPE_IGPU:  return "igpu";
        case GGML_BACKEND_DEVICE_TYPE_ACCEL: return "accel";
        default:                             return "other";
    }
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

}  // namespace

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

}  // namespace detail

using namespace detail;

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

std::vector<std::string> CpuFeatures() {
    // the CPU backend's ggml_backend_get_features: what its code was compiled for (ggml_cpu_has_*
    // are compile-time facts in a build without backend loading), e.g. "AVX2", "OPENMP"
    std::vector<std::string> out;
    try {
        backend_init();
        ggml_backend_reg_t reg = ggml_backend_reg_by_name("CPU");
        if (reg == nullptr) return out;
        using get_features_t = ggml_backend_feature * (*)(ggml_backend_reg_t);
        auto get = (get_features_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_get_features");
        if (get == nullptr) return out;
        for (ggml_backend_feature * f = get(reg); f != nullptr && f->name != nullptr; ++f) {
            std::string value = f->value ? f->value : "";
            out.emplace_back(value == "1" ? std::string(f->name) : std::string(f->name) + "=" + value);
        }
    } catch (...) {
        // as BuiltBackends: a registry that fails to start reports nothing
    }
    return out;
}

}  // namespace dgr
