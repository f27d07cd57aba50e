"""The README stays true to the tree: every path its architecture map names exists, and
``.ci/run`` runs the README's test command verbatim."""

from __future__ import annotations

import collections
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert m, f"README has no '## {title}' section"
    return m.group(1)


def map_paths() -> list[str]:
    """The backticked paths in the first column of the architecture map's table."""
    rows = [ln for ln in _section("Architecture map").splitlines() if ln.startswith("| `")]
    return [p for ln in rows for p in re.findall(r"`([^`]+)`", ln.split("|")[1])]


def test_every_path_of_the_architecture_map_exists():
    paths = map_paths()
    assert len(paths) >= 15, paths  # the table was read, not skipped
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README's architecture map names paths that do not exist: {missing}"


def test_the_architecture_map_names_every_package_of_dgr():
    named = set(map_paths())
    packages = sorted(f"dgr/{p.name}/" for p in (ROOT / "dgr").iterdir()
                      if (p / "__init__.py").exists())
    assert len(packages) >= 10, packages
    unnamed = [p for p in packages if p not in named]
    assert not unnamed, f"README's architecture map leaves out {unnamed}"


def test_the_readme_has_two_commands_and_ci_runs_the_test_one():
    cmds = re.findall(r"^    \$ (.+?)\s+# (\w+)$", _section("Two commands"), re.M)
    assert [tag for _, tag in cmds] == ["demo", "tests"], cmds
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert cmds[1][0] in ci.splitlines(), "'.ci/run' does not run the README's test command"


def test_ci_runs_the_test_command_in_a_virtual_environment_made_afresh():
    """A package left on the machine by hand must not stand in for a requirement: .ci/run
    removes its venv, makes a new one and activates it, all before the README's command."""
    cmd = re.findall(r"^    \$ (.+?)\s+# tests$", _section("Two commands"), re.M)[0]
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    venv = [ln.split("=", 1)[1] for ln in lines if ln.startswith("venv=")]
    assert venv and not venv[0].startswith("/"), "'.ci/run' names no venv inside the clone"
    assert f"{venv[0]}/" in (ROOT / ".gitignore").read_text().splitlines()

    def at(prefix: str) -> int:
        found = [i for i, ln in enumerate(lines) if ln.startswith(prefix)]
        assert len(found) == 1, (prefix, found)
        return found[0]

    assert (at('rm -rf "$venv"') < at('python3 -m venv "$venv"') < at('. "$venv/bin/activate"')
            < lines.index(cmd))


def test_every_project_path_the_docs_name_exists():
    """docs/*.md and the README name modules by path; a move must update them."""
    names = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        for p in re.findall(r"`((?:dgr|benches|tests|cpp|proto|docs)/[A-Za-z0-9_./-]+)", text):
            names.append((doc.name, p.split("::")[0].rstrip(".")))
    assert len(names) >= 30, names  # the docs were read
    missing = sorted({(d, p) for d, p in names if not (ROOT / p).exists()})
    assert not missing, f"the docs name paths that do not exist: {missing}"


def test_a_hung_test_is_stopped_by_the_suites_timeout(tmp_path):
    """pyproject's pytest settings bound every test (pytest-timeout): a test that hangs fails
    alone, named, instead of holding the CI run (here with the bound set to 1 s)."""
    import subprocess
    import sys

    import tomllib

    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 0 < int(ini["timeout"]) <= 1800
    (tmp_path / "test_hang.py").write_text("import time\n\ndef test_hangs():\n"
                                           "    time.sleep(60)\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-o", "timeout=1", str(tmp_path / "test_hang.py")],
                       capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert r.returncode == 1 and "Timeout" in r.stdout and "test_hangs" in r.stdout, r.stdout


def test_test_module_names_are_unique_across_folders():
    # the test folders are not packages: pytest imports each module by its base name, so two
    # folders holding one name fail the README's single `python -m pytest` at collection
    names = collections.Counter(p.name for p in (ROOT / "tests").rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
