"""The build names its CPU code, and asks the CPU itself whether it runs it (dgr._cpu).

The portable variant's own checks (its wheel under an emulated Haswell and Nehalem) are the
release tests' (tests/release/test_wheel.py)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from dgr import _cpu, errors
from dgr._core import BUILD_INFO, cpu_features
from dgr.vendor import cpu_features as host_features

x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 only")

#: GCC's names of the instruction sets dgr._cpu asks about, and /proc/cpuinfo's
NAMES = {"sse4.2": "sse4_2", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
         "bmi2": "bmi2", "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512vl": "avx512vl"}


@x86
def test_the_cpu_check_agrees_with_the_kernel():
    flags = set(host_features()[1])
    assert {gcc: _cpu.has(gcc) for gcc in NAMES} == {gcc: k in flags for gcc, k in NAMES.items()}
    assert _cpu.has("no-such-isa") is None  # not asked: never reported missing
    assert _cpu.missing(("avx2", "no-such-isa")) == ([] if "avx2" in flags else ["avx2"])


def test_this_checkouts_build_is_native_and_runs_here():
    assert _cpu.VARIANT == BUILD_INFO["cpu_variant"] == "native" and _cpu.REQUIRES == ()
    _cpu.require()


@x86
def test_ggmls_compiled_features_are_this_cpus_in_a_native_build():
    compiled, flags = set(cpu_features()), set(host_features()[1])
    pairs = {"AVX": "avx", "AVX2": "avx2", "F16C": "f16c", "FMA": "fma", "BMI2": "bmi2",
             "AVX512": "avx512f"}
    assert {g: g in compiled for g in pairs} == {g: k in flags for g, k in pairs.items()}


def test_a_cpu_that_lacks_the_variants_code_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(_cpu._cpu, "REQUIRES", ("avx2", "sse4.2"))
    monkeypatch.setattr(_cpu._cpu, "VARIANT", "x86-64-v3")
    monkeypatch.setattr(_cpu._cpu, "has", lambda name: name != "avx2")
    with pytest.raises(errors.CpuNotSupported) as e:
        _cpu.require()
    assert isinstance(e.value, errors.CoreNotBuilt) and isinstance(e.value, ImportError)
    msg = str(e.value)
    assert "for x86-64-v3 CPUs (avx2 sse4.2); this CPU lacks avx2" in msg
    assert "--no-binary dgr" in msg


def test_devices_prints_the_cpu_code():
    r = subprocess.run([sys.executable, "-m", "dgr", "devices"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("CPU code:")]
    assert line.startswith("CPU code: native (compiled for ") and all(
        f in line for f in cpu_features())
