"""``python -m dgr.vendor bump --to VERSION``: try dgr's patch stack on the llama.cpp of
another ``llama-cpp-python`` sdist, in a scratch workspace, and report patch by patch.

It downloads the sdist (pip, as the pin's own), unpacks its llama.cpp with the vendor
pipeline into a scratch cache (the real pin's workspace is never touched), and applies
``patches/`` in manifest order, each one reported as ``applied`` (cleanly), ``fuzz`` (applied
with offsets or fuzz: the lines that say so), ``failed`` (the hunks that did not apply), or
``not tried`` (after a failure the tree is no longer the one later patches were written
for). The report (``--report FILE``, Markdown) fits one screen.

What it does not do yet: build the patched tree, run the architecture probe and the parity
certification on it, and write the new ``vendor-manifest.json``. After a clean report those
are a scratch checkout with the new source pinned (``python -m dgr.vendor pin`` for the
patches' hashes), ``pip install -e .`` in a fresh venv (it builds), ``python -m
dgr.testing.archs --markdown`` and the test suite; the report names them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dgr.errors import VendorError

__all__ = ["Applied", "bump", "report_markdown", "try_stack"]


@dataclass(frozen=True)
class Applied:
    """One patch's result: ``status`` ``applied``, ``fuzz``, ``failed`` or ``not tried``;
    ``detail`` the lines of ``patch`` that say where (offsets, fuzz, failed hunks)."""

    file: str
    status: str
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
            "tree": str(tree), "patches": results,
            "clean": all(a.status == "applied" for a in results),
            "applies": all(a.status in ("applied", "fuzz") for a in results)}


def report_markdown(r: dict) -> str:
    """The report as one screen of Markdown."""
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
    lines += ["", "Next, " + ("the stack applies: build it, probe the architectures and run "
                              "the parity suite on the fixtures (a scratch checkout pinned to "
                              "it, `pip install -e .`, `python -m dgr.testing.archs "
                              "--markdown docs/architectures.md`, `python -m pytest`); only "
                              "then pin it." if r["applies"] else
                              "refresh the failed patch against the new tree (the tree with the "
                              f"patches before it applied: `{r['tree']}`), then run this again.")]
    return "\n".join(lines) + "\n"
