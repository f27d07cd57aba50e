"""The sdist holds what a source build needs (MANIFEST.in): the patch stack the manifest
names, the pin (vendor-manifest.json), the C++ engine, the gRPC schema, every Cython source;
no generated or built file. Built with ``python -m build --sdist`` (PEP 517, isolated) from
a copy of the tracked tree, as a release is."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from dgr.testing.packaging import fresh_venv, run_demo, tracked_copy

pytest.importorskip("build")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (the tracked files are what ships)")
    return subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.split()


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("sdist")
    _tracked()
    src = tracked_copy(ROOT, tmp / "src")  # no build output can stand in for a source
    subprocess.run([sys.executable, "-m", "build", "--sdist", "-o", str(tmp / "dist"),
                    str(src)], check=True, capture_output=True, timeout=900)
    (out,) = (tmp / "dist").glob("dgr-*.tar.gz")
    return out


def test_the_sdist_holds_what_a_source_build_needs(sdist):
    tracked = _tracked()
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    manifest = json.loads((ROOT / "vendor-manifest.json").read_text())
    need = {"vendor-manifest.json", "proto/dgr.proto", "setup.py", "pyproject.toml",
            "README.md", *(f"patches/{p['file']}" for p in manifest["patches"]),
            *(f for f in tracked if f.startswith("cpp/")),
            *(f for f in tracked if f.startswith("dgr/") and f.endswith((".pyx", ".pxi",
                                                                          ".pxd")))}
    assert not need - names, sorted(need - names)
    built = [n for n in names if n.endswith((".so", ".o", ".a"))
             or (n.startswith(("dgr/_core/", "dgr/_chat/", "dgr/_cpu/")) and n.endswith(".cpp"))]
    assert not built, built


def test_pip_install_of_the_sdist_in_a_fresh_venv_runs_the_demo(sdist, tmp_path):
    """``pip install dgr-*.tar.gz`` into a fresh virtual environment (the CPU backend; the
    pinned llama.cpp from the shared cache when built there before), then the README's demo
    from another directory: the split's text equals the whole model's."""
    py, env = fresh_venv(tmp_path / "venv")
    env["DGR_BACKEND"] = "cpu"
    subprocess.run([py, "-m", "pip", "install", "-q", str(sdist)], check=True, env=env,
                   capture_output=True, timeout=3000, cwd=tmp_path)
    # one version: the package's metadata is dgr.__version__ (which the capability record and
    # Describe say)
    v = subprocess.run([py, "-c", "import importlib.metadata as m, dgr; "
                        "print(m.version('dgr'), dgr.__version__)"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    meta, own = v.stdout.split()
    assert meta == own, v.stdout
    run_demo(py, env, tmp_path)
