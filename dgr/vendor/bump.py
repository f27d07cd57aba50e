"""``python -m dgr.vendor bump --to VERSION``: try dgr's patch stack on the llama.cpp of
another ``llama-cpp-python`` sdist, in a scratch workspace, and report patch by patch.

It downloads the sdist (pip, as the pin's own), unpacks its llama.cpp with the vendor
pipeline into a scratch cache (the real pin's workspace is never touched), and applies
``patches/`` in manifest order, each one reported as ``applied`` (cleanly), ``fuzz`` (applied
with offsets or fuzz: the lines that say so), ``failed`` (the hunks that did not apply), or
``not tried`` (after a failure the tree is no longer the one later patches were written
for). The report (``--report FILE``, Markdown) fits one screen.

With ``--check`` a stack that applies is then proved (:func:`prove`), each step reported:
``build`` (a scratch copy of this checkout's tracked files, pinned to the new sdist,
``pip install -e .[test]`` into a fresh venv: it builds the patched llama.cpp in its own
workspace of ``$DGR_CACHE`` and the compiled core against it), ``probe`` (``python -m
dgr.testing.archs``: every architecture's fixture whole and split, bit for bit; it passes when
as many architectures split as the pin's ``docs/architectures.md`` says) and ``parity``
(``python -m dgr parity``: the default model in 3 stages against the whole, every step).
``--write`` also writes the new ``vendor-manifest.json`` and ``docs/architectures.md`` into
this checkout, only when every step passed and the target is not the pin already.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dgr.errors import VendorError

__all__ = ["Applied", "Step", "bump", "prove", "report_markdown", "try_stack"]


@dataclass(frozen=True)
class Applied:
    """One patch's result: ``status`` ``applied``, ``fuzz``, ``failed`` or ``not tried``;
    ``detail`` the lines of ``patch`` that say where (offsets, fuzz, failed hunks)."""

    file: str
    status: str
    detail: str = ""


@dataclass(frozen=True)
class Step:
    """One proof step after the stack applied: ``build``, ``probe`` or ``parity``."""

    name: str
    ok: bool
    seconds: float
    detail: str = ""


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def try_stack(tree: Path, patches: list[Path]) -> list[Applied]:
    """Apply ``patches`` in order to ``tree`` (changed in place), each as ``Applied``."""
    # patch(1), not git apply: it says where a hunk went (an offset, fuzz), which git apply
    # accepts silently
    if shutil.which("patch") is None:
        raise VendorError("bump needs the patch program (Debian: apt-get install patch)")
    out: list[Applied] = []
    for p in patches:
        if out and out[-1].status in ("failed", "not tried"):
            out.append(Applied(p.name, "not tried"))
            continue
        dry = _run(["patch", "-p1", "--forward", "--batch", "--dry-run", "--fuzz=3", "-i",
                    str(p)], tree)
        said = [ln for ln in dry.stdout.splitlines()
                if "offset" in ln or "fuzz" in ln or "FAILED" in ln or "saving rejects" in ln]
        if dry.returncode != 0:
            out.append(Applied(p.name, "failed", "\n".join(said) or dry.stdout[-2000:]))
            continue
        r = _run(["patch", "-p1", "--forward", "--batch", "--fuzz=3", "--no-backup-if-mismatch",
                  "-i", str(p)], tree)
        if r.returncode != 0:
            out.append(Applied(p.name, "failed", r.stdout[-2000:]))
        else:
            out.append(Applied(p.name, "fuzz" if said else "applied", "\n".join(said)))
    return out


def _download(package: str, version: str, dest: Path) -> Path:
    """The sdist of ``package==version`` in ``dest`` (pip, source only)."""
    dest.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                           package, "--no-build-isolation", "--disable-pip-version-check",
                           "-d", str(dest), f"{package}=={version}"], capture_output=True,
                          text=True, env=env)
    got = sorted(dest.glob("*.tar.gz"))
    if proc.returncode != 0 and not got:
        # without isolation pip needs the sdist's build backend to prepare its metadata
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               "--no-binary", package, "--disable-pip-version-check", "-d",
                               str(dest), f"{package}=={version}"], capture_output=True,
                              text=True, env=env)
        got = sorted(dest.glob("*.tar.gz"))
    if not got:
        raise VendorError(f"pip download of {package}=={version} failed (exit "
                          f"{proc.returncode}):\n{proc.stderr[-2000:]}")
    return got[0]


def bump(to: str, *, commit: str = "", root: Path | None = None,
         workdir: Path | None = None) -> dict:
    """Try the stack on ``llama-cpp-python==to``'s llama.cpp; returns the report (a dict:
    ``from``, ``to``, ``sdist_sha256``, ``patches`` of ``Applied``, ``clean``)."""
    from dgr.vendor import Vendor, repo_root, sha256_file

    root = Path(root) if root else repo_root()
    pinned = Vendor(root=root, backend="cpu")
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="dgr-bump-"))
    scratch = work / "root"
    if scratch.exists():
        shutil.rmtree(scratch)
    shutil.copytree(root / "patches", scratch / "patches")
    src = dict(pinned.source)
    cache = work / "cache"
    name = f"{src['package'].replace('-', '_')}-{to}.tar.gz"
    have = pinned.cache / "downloads" / name  # the pin's own download, when it is this one
    if to == src["version"] and have.exists():
        archive = have
    else:
        archive = _download(src["package"], to, work / "downloads")
    manifest = json.loads((root / "vendor-manifest.json").read_text())
    manifest.pop("prepared", None)
    same = to == src["version"]
    manifest["llama_cpp"] = {
        "commit": commit or (pinned.commit if same else "0" * 40),
        "source": {**src, "version": to, "filename": archive.name,
                   "sha256": sha256_file(archive),
                   "subpath": f"{archive.name.removesuffix('.tar.gz')}/vendor/llama.cpp"}}
    (scratch / "vendor-manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    trial = Vendor(root=scratch, cache=cache, backend="cpu")
    (cache / "downloads").mkdir(parents=True, exist_ok=True)
    shutil.copy2(archive, trial.archive)
    tree = trial.fetch()
    results = try_stack(tree, [trial.patch_dir / p.file for p in trial.patches])
    return {"from": src["version"], "from_commit": pinned.commit, "to": to,
            "to_commit": manifest["llama_cpp"]["commit"] if (commit or same) else "",
            "sdist": archive.name, "sdist_sha256": sha256_file(archive),
            "tree": str(tree), "patches": results, "work": str(work), "same": same,
            "manifest": str(scratch / "vendor-manifest.json"), "steps": [],
            "clean": all(a.status == "applied" for a in results),
            "applies": all(a.status in ("applied", "fuzz") for a in results)}


_SPLIT_RE = re.compile(r"(\d+) architectures, \d+ files; (\d+) split bit-exact")


def _split_count(doc: Path) -> tuple[int, int] | None:
    """(architectures, how many split bit-exact) from an architectures table, if it says."""
    m = _SPLIT_RE.search(doc.read_text()) if doc.exists() else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def _step(name: str, cmd: list[str], cwd: Path, env: dict, log: Path,
          timeout: float) -> tuple[subprocess.CompletedProcess | None, float, str]:
    """Run one step's command, its output to ``log``; (process or None on timeout, seconds,
    the output's last lines)."""
    print(f"[dgr.vendor] bump: {name} (its output: {log})", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            proc = None
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-4:])
    return proc, time.monotonic() - t0, (tail if proc is not None
                                         else f"{name}: no result after {timeout:.0f} s")


def prove(r: dict, *, root: Path | None = None) -> list[Step]:
    """Build the bumped pin in a scratch checkout and prove it (build, probe, parity); stops
    at the first failed step. Each step's whole output is in ``<work>/<step>.log``."""
    from dgr.vendor import repo_root

    root = Path(root) if root else repo_root()
    work = Path(r["work"])
    co = work / "checkout"
    if co.exists():
        shutil.rmtree(co)
    files = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True)
    if files.returncode != 0:
        raise VendorError(f"--check copies this checkout's tracked files: {root} is not a git "
                          "checkout")
    for f in files.stdout.split():
        (co / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, co / f)
    shutil.copy2(r["manifest"], co / "vendor-manifest.json")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["DGR_BACKEND"] = "cpu"
    steps: list[Step] = []
    proc, secs, tail = _step("build", [py, "-m", "pip", "install", "-v", "-e", f"{co}[test]"],
                             work, env, work / "build.log", 7200)
    steps.append(Step("build", proc is not None and proc.returncode == 0, secs,
                      tail if proc is None or proc.returncode else "the patched llama.cpp and "
                      "the compiled core built"))
    if not steps[-1].ok:
        return steps
    doc = work / "architectures.md"
    proc, secs, tail = _step("probe", [py, "-m", "dgr.testing.archs", "--markdown", str(doc)],
                             co, env, work / "probe.log", 7200)
    got, pin = _split_count(doc), _split_count(root / "docs" / "architectures.md")
    ok = proc is not None and proc.returncode == 0 and got is not None and (
        pin is None or got[1] >= pin[1])
    steps.append(Step("probe", ok, secs, (f"{got[1]} of {got[0]} architectures split bit-exact "
                                           f"(the pin: {pin[1] if pin else '?'})")
                      if got else tail))
    if not ok:
        return steps
    proc, secs, tail = _step("parity", [py, "-m", "dgr", "parity", "--stages", "3"], co, env,
                             work / "parity.log", 3600)
    steps.append(Step("parity", proc is not None and proc.returncode == 0, secs, tail))
    return steps


def write_pin(r: dict, root: Path) -> list[Path]:
    """Write the proved pin's manifest and architectures table into ``root``."""
    work = Path(r["work"])
    shutil.copy2(r["manifest"], root / "vendor-manifest.json")
    shutil.copy2(work / "architectures.md", root / "docs" / "architectures.md")
    return [root / "vendor-manifest.json", root / "docs" / "architectures.md"]


def report_markdown(r: dict, *, advice: bool = True) -> str:
    """The report as one screen of Markdown; ``advice=False`` leaves out what to do next
    (the patches' part, said while the proof runs)."""
    n = {s: sum(a.status == s for a in r["patches"])
         for s in ("applied", "fuzz", "failed", "not tried")}
    lines = [f"# Patch stack on llama-cpp-python {r['to']}",
             "",
             f"From the pin llama-cpp-python {r['from']} (llama.cpp "
             f"{r['from_commit'][:12]}) to {r['to']} (llama.cpp "
             f"{r['to_commit'][:12] or 'commit not named: pass --commit'}); sdist "
             f"`{r['sdist']}` sha256 `{r['sdist_sha256'][:16]}...`.",
             "",
             f"{len(r['patches'])} patches: {n['applied']} applied, {n['fuzz']} with fuzz or "
             f"offsets, {n['failed']} failed, {n['not tried']} not tried.",
             "",
             "| patch | result | where |", "|---|---|---|"]
    for a in r["patches"]:
        where = "; ".join(a.detail.splitlines()[:3]).replace("|", "/")
        lines.append(f"| {a.file} | {a.status} | {where} |")
    if r.get("steps"):
        lines += ["", "| step | result | seconds | what |", "|---|---|---|---|"]
        for st in r["steps"]:
            what = "; ".join(st.detail.splitlines()[-2:]).replace("|", "/")
            lines.append(f"| {st.name} | {'pass' if st.ok else 'FAIL'} | {st.seconds:.0f} | "
                         f"{what} |")
        proved = len(r["steps"]) == 3 and all(st.ok for st in r["steps"])
        lines += ["", ("Every step passed: " + ("it is the pin already; nothing to write."
                                                if r["same"] else "`--write` pins it (the "
                                                "manifest and docs/architectures.md).")
                       if proved else f"A step failed: its log is under `{r['work']}`.")]
        return "\n".join(lines) + "\n"
    if not advice:
        return "\n".join(lines) + "\n"
    lines += ["", "Next, " + ("the stack applies: build it, probe the architectures and run "
                              "the parity suite: `python -m dgr.vendor bump --to "
                              f"{r['to']} --check` (then `--write` pins it)." if r["applies"] else
                              "refresh the failed patch against the new tree (the tree with the "
                              f"patches before it applied: `{r['tree']}`), then run this again.")]
    return "\n".join(lines) + "\n"
