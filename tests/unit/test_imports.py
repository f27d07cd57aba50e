"""The package layering holds: the import contracts pass, and a driver needs no compiled core."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# lint-imports through this interpreter (a venv that is not activated has it off PATH)
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())"]


def _lint(cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*LINT, "--no-cache"], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


def test_import_contracts_are_kept():
    """lint-imports checks the contracts of pyproject.toml: layers (each folder imports only
    those beneath it), no compiled core under the driver, no cycles inside any package."""
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Contracts: 3 kept, 0 broken." in r.stdout, r.stdout


def test_a_new_upward_import_breaks_a_contract(tmp_path):
    """The contracts would catch a protocol module importing the worker (a copy of the
    package with one such import added fails lint-imports)."""
    shutil.copytree(ROOT / "dgr", tmp_path / "dgr",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bad = tmp_path / "dgr" / "protocol" / "wire.py"
    bad.write_text(bad.read_text() + "\nfrom dgr.worker import stage  # noqa: E402\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    r = _lint(tmp_path, env)
    assert r.returncode != 0, r.stdout
    assert "dgr.protocol.wire -> dgr.worker" in r.stdout.replace("\n", " ") or \
        "dgr.protocol is not allowed to import dgr.worker" in r.stdout, r.stdout


_HIDE_CORE = """
import importlib.abc, sys

class _NoCore(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "dgr._core" or name.startswith("dgr._core.") or name == "dgr.core" \\
                or name.startswith("dgr.core."):
            raise ImportError(f"{name} hidden by the test")
        return None

sys.meta_path.insert(0, _NoCore())
import dgr.driver
from dgr.driver import Route, StaticPool
from dgr.driver.route import check_route
import dgr.transport.client, dgr.protocol.wire
assert not any(m == "dgr._core" or m.startswith(("dgr._core.", "dgr.core")) for m in sys.modules)
print("OK")
"""


def test_the_driver_imports_without_the_compiled_core():
    r = subprocess.run([sys.executable, "-c", _HIDE_CORE], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "OK", r.stdout + r.stderr
