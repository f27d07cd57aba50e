"""Test helpers for what ships: a copy of the tracked tree (what a release builds from), a
fresh virtual environment to install into, and the README's demo run there."""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

__all__ = ["tracked_copy", "fresh_venv", "run_demo"]


def tracked_copy(root: Path, dest: Path) -> Path:
    """Copy the files git tracks under ``root`` to ``dest``: no build output or cache can stand
    in for a source. Raises ``LookupError`` outside a git checkout."""
    if shutil.which("git") is None or not (root / ".git").exists():
        raise LookupError(f"{root} is not a git checkout (the tracked files are what ships)")
    files = subprocess.run(["git", "ls-files"], cwd=root, check=True, capture_output=True,
                           text=True).stdout.split()
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, dest / f)
    return dest


def fresh_venv(where: Path, *, path: str | None = None) -> tuple[str, dict[str, str]]:
    """A new virtual environment at ``where``: its python and an environment to run it in
    (no ``PYTHONPATH`` or outer venv; ``PATH`` = the venv's ``bin`` then ``path`` when given,
    else the caller's ``PATH``)."""
    venv.create(where, with_pip=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    bindir = str(where / "bin")
    env["PATH"] = bindir + os.pathsep + (os.environ.get("PATH", "") if path is None else path)
    env["VIRTUAL_ENV"] = str(where)
    return str(where / "bin" / "python"), env


def run_demo(py: str, env: dict[str, str], cwd: Path, *, timeout: float = 900) -> str:
    """``python -m dgr run --max-tokens 8`` with ``py``; its output, after checking that it
    exited 0 and said the split matches the whole model."""
    r = subprocess.run([py, "-m", "dgr", "run", "--max-tokens", "8"], env=env, cwd=cwd,
                       capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    said = [ln for ln in out.splitlines() if "matches the whole model" in ln]
    assert said and said[0].rstrip().endswith(": yes"), out[-3000:]
    return out
