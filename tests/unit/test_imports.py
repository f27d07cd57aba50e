"""The package layering holds: the import contracts pass, and a driver needs no compiled core."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.skipif(sys.platform == "darwin", reason="the link option is GNU ld's and lld's")
def test_each_compiled_module_keeps_its_llama_cpp_to_itself():
    """The engine (``_core``) and the chat binding (``_chat``) each link a static copy of
    llama.cpp. Exported, their symbols would be bound across the two modules: a C++ inline
    function's static local (GNU_UNIQUE) became one object for both copies, and a module
    loaded globally would take over the other's functions. Neither exports any."""
    import importlib.util

    nm = shutil.which("nm")
    assert nm, "nm (binutils, installed with the compiler) is needed to read the modules"
    for name in ("dgr._core._core", "dgr._chat._chat"):
        path = importlib.util.find_spec(name).origin
        r = subprocess.run([nm, "-D", "--defined-only", "-C", path], capture_output=True,
                           text=True, timeout=60, check=True)
        rows = (line.split(maxsplit=2) for line in r.stdout.splitlines())
        syms = [(row[1], row[2]) for row in rows if len(row) == 3]  # (kind, name)
        names = [n for _, n in syms]
        leaked = [n for n in names if n.startswith(("ggml_", "gguf_", "llama_", "common_"))]
        unique = [n for kind, n in syms if kind == "u" and not n.startswith("std::")]
        assert not leaked, f"{name} exports {len(leaked)} llama.cpp symbols: {leaked[:5]}"
        assert not unique, f"{name} shares statics process-wide: {unique[:5]}"
        assert any(n == f"PyInit_{name.rpartition('.')[2]}" for n in names), names[:20]


# --- benches/: the scripts and their harness -------------------------------------------------

def bench_import_graph(benches: Path) -> dict[str, set[str]]:
    """{module: the benches modules it imports}, anywhere in its code (function-level imports
    too): the scripts are top-level modules (``compare``), the harness is ``harness.*``."""
    import ast

    files = {p.stem: p for p in benches.glob("*.py")}
    files |= {("harness" if p.stem == "__init__" else f"harness.{p.stem}"): p
              for p in (benches / "harness").glob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        edges = graph.setdefault(mod, set())
        package = mod if path.stem == "__init__" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(filter(None, [package, base]))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                         for a in node.names]
            else:
                continue
            edges |= {t for t in map(resolve, names) if t and t != mod and t != "harness"}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_benches_have_no_import_cycle():
    """No benchmark script imports one that imports it back (``compare`` and ``wan`` did,
    through function-level imports), and the harness imports no script."""
    graph = bench_import_graph(ROOT / "benches")
    assert {"compare", "wan", "harness.clusters", "harness.fresh"} <= set(graph)
    assert find_cycle(graph) is None, find_cycle(graph)
    for mod, targets in graph.items():
        if mod.startswith("harness"):
            assert all(t.startswith("harness") for t in targets), (mod, targets)


def test_the_bench_cycle_check_finds_a_function_level_cycle(tmp_path):
    shutil.copytree(ROOT / "benches", tmp_path / "benches",
                    ignore=shutil.ignore_patterns("results", "__pycache__", ".asv"))
    compare = tmp_path / "benches" / "compare.py"
    compare.write_text(compare.read_text() + "\n\ndef _back():\n    import timeline\n")
    cycle = find_cycle(bench_import_graph(tmp_path / "benches"))
    assert cycle is not None and {"compare", "timeline"} <= set(cycle), cycle


def test_no_file_edits_sys_path():
    """Tests find benches/ through pytest's ``pythonpath``, scripts their own folder, the
    harness's fresh processes run in benches/, and gguf-py is loaded from its folder."""
    offenders = []
    for folder in ("dgr", "benches", "tests"):
        for p in (ROOT / folder).rglob("*.py"):
            if "results" in p.parts or p == Path(__file__):
                continue
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if "sys.path." in line or "sys.path[" in line:
                    offenders.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_every_benchmark_script_runs_through_the_harness():
    """Each script in benches/ takes its command line (and whatever else it shares) from
    ``benches/harness``: no script starts from its own copy of the common parts."""
    graph = bench_import_graph(ROOT / "benches")
    scripts = sorted(p.stem for p in (ROOT / "benches").glob("*.py"))
    assert "compare" in scripts and "wire_micro" in scripts
    lone = [s for s in scripts if not any(t.startswith("harness") for t in graph.get(s, ()))]
    assert not lone, f"benchmarks that do not import the harness: {lone}"
