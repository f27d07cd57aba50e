// XXH3-64 compiled for AVX2, picked at run time by cpp/src/frame.cpp when the CPU has it (the
// rest of the build targets baseline x86-64, whose XXH3 is SSE2: half the speed on a 147 KB
// prefill boundary). Only xxhash is compiled under the avx2 target here.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#pragma GCC target("avx2")
#include <immintrin.h>  // the AVX2 intrinsics xxhash.h uses (it includes them only under -mavx2)
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include "xxhash/xxhash.h"

#include <cstddef>
#include <cstdint>

namespace dgr {
namespace wire {

uint64_t xxh3_avx2(const void* data, size_t size) noexcept { return XXH3_64bits(data, size); }

}  // namespace wire
}  // namespace dgr
#endif
