// Facts about the llama.cpp this binary was compiled against, baked in by setup.py, so that a
// process reports the patch stack it really runs, not whatever patches/ holds now.
#pragma once

#ifndef DGR_LLAMA_COMMIT
#define DGR_LLAMA_COMMIT "unknown"
#endif
#ifndef DGR_PATCH_STACK_HASH
#define DGR_PATCH_STACK_HASH "unknown"
#endif
#ifndef DGR_VENDOR_KEY
#define DGR_VENDOR_KEY "unknown"
#endif
// the CPU code the llama.cpp build compiled (dgr.vendor.CPU_VARIANTS: native, x86-64-v3, custom)
#ifndef DGR_CPU_VARIANT
#define DGR_CPU_VARIANT "native"
#endif
