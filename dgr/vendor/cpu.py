"""The host CPU as a build sees it, and the CPU code a build compiles.

A native build (ggml's default, ``-march=native``) is keyed by this CPU's instruction sets,
read from ``/proc/cpuinfo``; a portable variant (``$DGR_CPU_VARIANT``) compiles a fixed
baseline instead and names the instruction sets its code needs, which ``dgr._cpu`` checks
before the compiled core loads.

Only the standard library is used: ``setup.py`` imports this module before any dependency
is installed.
"""

from __future__ import annotations

import functools
import os
import platform
import re

from dgr.errors import VendorError

__all__ = ["CPU_VARIANTS", "CPU_REQUIRES", "cpu_features", "selected_cpu_variant"]

#: The CPU code a build compiles (``$DGR_CPU_VARIANT``), and the cmake options that pick it:
#:
#: - ``native`` (the default; ggml's own): ``-march=native``, every instruction set of the
#:   building CPU (AVX-512, AMX where it has them). Fastest here; it runs only on CPUs with the
#:   same instruction sets, so each CPU gets its own cached build.
#: - ``x86-64-v3``: the portable baseline a wheel is built for: SSE4.2, AVX, AVX2, FMA, F16C
#:   and BMI2, no AVX-512 and no AMX. Every x86-64 CPU since Intel Haswell (2013) and AMD
#:   Zen (2017) has them; the compiled core refuses, at import, a CPU that lacks one
#:   (``dgr._cpu``) instead of dying of an illegal instruction.
#:
#: Variants may compute different bits (other kernels), so a certified lane names its variant.
CPU_VARIANTS: dict[str, tuple[str, ...]] = {
    "native": (),
    "x86-64-v3": ("-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
                  "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF",
                  "-DGGML_AVX_VNNI=OFF"),
}

#: The instruction sets each variant's code needs (GCC's ``__builtin_cpu_supports`` names),
#: checked when the compiled core is imported.
CPU_REQUIRES: dict[str, tuple[str, ...]] = {
    "native": (),
    "x86-64-v3": ("sse4.2", "avx", "avx2", "fma", "f16c", "bmi2"),
}


def selected_cpu_variant() -> str:
    """``$DGR_CPU_VARIANT`` (``native`` when unset); one :data:`CPU_VARIANTS` names."""
    v = os.environ.get("DGR_CPU_VARIANT", "").strip().lower() or "native"
    if v not in CPU_VARIANTS:
        raise VendorError(f"unknown CPU variant {v!r} (from DGR_CPU_VARIANT); known: "
                          f"{', '.join(CPU_VARIANTS)}")
    if v != "native" and platform.machine().lower() not in ("x86_64", "amd64"):
        raise VendorError(f"the CPU variant {v} is for x86-64; this machine is "
                          f"{platform.machine()} (build it native)")
    return v


#: /proc/cpuinfo flags that change the code a native build compiles (``-march=native``) and
#: which kernels ggml's CPU backend runs, hence the bits
_ISA_PREFIXES = ("sse", "ssse3", "avx", "fma", "f16c", "amx", "bmi", "vnni", "neon", "asimd",
                 "sve", "dotprod", "i8mm", "fp16", "bf16")


@functools.lru_cache(maxsize=1)
def cpu_features() -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(CPU model name, all /proc/cpuinfo flags, the kernel-selecting ISA subset); empty
    where the system has no /proc/cpuinfo."""
    model, flags = "", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model") and not model:
                    model = val.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = val.split()
    except OSError:
        pass
    isa = tuple(sorted(f for f in set(flags) if f.startswith(_ISA_PREFIXES)))
    return model, tuple(sorted(set(flags))), isa


def _host_isa(cmake_args: list[str]) -> str:
    """What a native build is compiled for: this CPU's instruction sets (``-march=native``),
    or "" when the build is portable (``-DGGML_NATIVE=OFF`` in ``CMAKE_ARGS``)."""
    if any(re.fullmatch(r"-DGGML_NATIVE(:BOOL)?=(OFF|0|FALSE|NO)", a, re.I) for a in cmake_args):
        return ""
    model, _, isa = cpu_features()
    return " ".join(isa) if isa else f"{platform.machine()} {platform.processor() or model}"
