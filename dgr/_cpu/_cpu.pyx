# cython: language_level=3, embedsignature=True
"""Private: the CPU code the compiled core was built for, and whether this CPU runs it.

This module links no llama.cpp and is compiled without ``-march``, so it imports on any x86-64
CPU. ``dgr._core`` and ``dgr._chat`` call :func:`require` before loading their own modules: a
portable build (``x86-64-v3``) on a CPU without AVX2 then raises ``CpuNotSupported``, naming
what is missing and how to build for it, instead of dying of an illegal instruction. The
instruction sets are asked of the CPU itself (CPUID, through GCC's ``__builtin_cpu_supports``),
not of ``/proc/cpuinfo``.
"""

cdef extern from *:
    """
    #include <string.h>
    #ifndef DGR_CPU_VARIANT
    #define DGR_CPU_VARIANT "native"
    #endif
    #ifndef DGR_CPU_REQUIRES
    #define DGR_CPU_REQUIRES ""
    #endif
    /* 1 when this CPU has the instruction set `name` (GCC's names), 0 when not, -1 unknown */
    static int dgr_cpu_has(const char * name) {
    #if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
        __builtin_cpu_init();
    #define DGR_HAS(s) if (strcmp(name, s) == 0) return __builtin_cpu_supports(s) ? 1 : 0;
        DGR_HAS("sse4.2") DGR_HAS("avx") DGR_HAS("avx2") DGR_HAS("fma") DGR_HAS("f16c")
        DGR_HAS("bmi2") DGR_HAS("avx512f") DGR_HAS("avx512bw") DGR_HAS("avx512vl")
    #undef DGR_HAS
    #endif
        (void) name;
        return -1;
    }
    """
    const char * DGR_CPU_VARIANT
    const char * DGR_CPU_REQUIRES
    int dgr_cpu_has(const char * name)

#: the CPU variant the core was built for (``dgr.vendor.CPU_VARIANTS``)
VARIANT = DGR_CPU_VARIANT.decode()
#: the instruction sets that variant's code needs (empty for a native build: it runs where built)
REQUIRES = tuple(f for f in DGR_CPU_REQUIRES.decode().split(",") if f)


def has(str name):
    """True/False: this CPU has instruction set ``name`` (``avx2``, ``fma``, ...); None where
    it cannot be asked (another architecture, or a name not checked here)."""
    r = dgr_cpu_has(name.encode())
    return None if r < 0 else bool(r)


def missing(requires=None):
    """The instruction sets of ``requires`` (default :data:`REQUIRES`) this CPU lacks."""
    return [f for f in (REQUIRES if requires is None else requires) if has(f) is False]


def require():
    """Raise ``dgr.errors.CpuNotSupported`` unless this CPU runs the compiled core's code."""
    lack = missing()
    if lack:
        from dgr.errors import CpuNotSupported

        raise CpuNotSupported(
            f"this build of dgr's compiled core is for {VARIANT} CPUs ({' '.join(REQUIRES)}); "
            f"this CPU lacks {', '.join(lack)}. Build dgr from source for this machine "
            "(`pip install --no-binary dgr dgr`, or `pip install .` in a checkout: it needs a "
            "C++ compiler and cmake, and compiles for this CPU's own instruction sets).")
