"""Model artifacts: hashed manifests, resumable verification, split GGUFs and per-range slices.

A manifest (``docs/artifacts.md``) records, for one model (one GGUF or all files of a split
GGUF), every file's size and sha256, the sha256 of each fixed-size chunk of every file, and every
tensor's file, offset, size, layer, role and hash, plus the model identity workers report.
Verification hashes chunks, so a journal of verified chunks lets an interrupted run resume
where it stopped; a mismatching chunk is then narrowed down to the tensors or header it covers.
A slice is a GGUF holding only the tensors one stage loads, with the full metadata.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from dgr.artifacts import gguf as gguf_io
from dgr.errors import (
    ArtifactError,
    ArtifactMismatch,
    ArtifactMissing,
    ArtifactTruncated,
    DgrError,
    InvalidLayerRange,
    InvalidManifest,
    InvalidModel,
)

__all__ = [
    "SCHEMA", "DEFAULT_CHUNK_SIZE", "TENSOR_HASHES", "COUNTERS", "Manifest", "Problem",
    "VerifyReport", "tensor_role", "needed_tensor_names", "build_manifest", "write_manifest",
    "verify", "verify_for_worker", "slice_model", "precheck", "main", "add_subparser",
]

SCHEMA = "dgr.artifacts.manifest/1"
JOURNAL_SCHEMA = "dgr.artifacts.journal/1"
DEFAULT_CHUNK_SIZE = 64 << 20
TENSOR_HASHES = ("sha256", "xxh3_128")
_BLOCK = 4 << 20          # read size inside a chunk
_SLICE_KEYS = ("dgr.slice.layer_start", "dgr.slice.layer_end", "dgr.slice.source_identity")
_NOT_METADATA = ("split.", "dgr.slice.")

#: bytes read from artifacts by this process (manifest, verify, slice); tests watch it
COUNTERS = {"bytes_read": 0}
_counter_lock = threading.Lock()

# fault injection for tests: SIGKILL this process right after the journal records the N-th
# verified chunk (or tensor); and a sleep per chunk, so a test can kill a run from outside
_KILL_ENV = "DGR_ARTIFACTS_KILL_AFTER"
_DELAY_ENV = "DGR_ARTIFACTS_CHUNK_DELAY"


def _count(n: int) -> None:
    with _counter_lock:
        COUNTERS["bytes_read"] += n


def _hasher(alg: str):
    if alg == "sha256":
        return hashlib.sha256()
    if alg == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    raise InvalidManifest(f"unknown hash algorithm {alg!r} (known: {', '.join(TENSOR_HASHES)})")


# ---- roles and the tensors a range needs ----------------------------------------------------

_BLK = re.compile(r"^blk\.(\d+)\.")
_INPUT = ("token_embd", "position_embd", "token_types")
_OUTPUT = ("output", "cls")


def tensor_role(name: str) -> tuple[int | None, str]:
    """``(layer, role)`` of a tensor by its name.

    ``blk.N.*`` belongs to layer N (role ``layer``); token/position embeddings are ``input``
    (first stage); ``output*`` and classifier heads are ``output`` (last stage); any other
    global tensor (e.g. ``rope_freqs.weight``, which llama.cpp uses in every layer) is
    ``shared`` and goes to every stage.
    """
    m = _BLK.match(name)
    if m:
        return int(m.group(1)), "layer"
    stem = name.split(".", 1)[0]
    if stem.startswith(_INPUT):
        return None, "input"
    if stem.startswith(_OUTPUT):
        return None, "output"
    return None, "shared"


def _n_layer(block_count: int, nextn: int | None) -> int:
    # multi-token-prediction layers are counted in block_count but sit after the last layer
    return block_count - (nextn or 0)


def needed_tensor_names(tensors: Iterable[tuple[str, int | None, str]], a: int, b: int,
                        n_layer: int, tied: bool) -> set[str]:
    """Names of the tensors a stage owning layers ``[a, b)`` loads.

    ``tensors`` yields ``(name, layer, role)``. The first stage (``a == 0``) gets the input
    embeddings; the last (``b == n_layer``) the head, plus ``token_embd.weight`` when the
    embeddings are tied, plus any layer past ``n_layer`` (MTP lives on the last stage);
    every stage gets the shared globals.
    """
    last = b >= n_layer
    out = set()
    for name, layer, role in tensors:
        if role == "layer":
            keep = a <= layer < b or (last and layer >= n_layer)
        elif role == "input":
            keep = a == 0 or (last and tied and name == "token_embd.weight")
        elif role == "output":
            keep = last
        else:
            keep = True
        if keep:
            out.add(name)
    return out


def _check_range(layers, n_layer: int, what: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in layers)
    except (TypeError, ValueError):
        raise InvalidLayerRange(f"layers must be a pair (start, end), got {layers!r}") from None
    if not 0 <= a < b <= n_layer:
        raise InvalidLayerRange(f"layer range [{a}, {b}) is not a non-empty part of "
                                f"[0, {n_layer}) of {what}")
    return a, b


# ---- the manifest -------------------------------------------------------------------------


@dataclass
class Manifest:
    """A loaded manifest (``docs/artifacts.md``); ``data`` is the JSON object."""

    data: dict
    path: Path | None = None
    sha256: str = ""
    tensors_by_name: dict[str, dict] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.tensors_by_name = {t["name"]: t for t in self.data["tensors"]}

    @classmethod
    def load(cls, source: "str | os.PathLike | Manifest") -> "Manifest":
        """Read and validate a manifest file.

        Raises
        ------
        dgr.errors.InvalidManifest
            Unreadable, not JSON, another schema, or inconsistent fields.
        """
        if isinstance(source, Manifest):
            return source
        p = Path(source)
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise InvalidManifest(f"cannot read manifest {p}: {e.strerror or e}") from None
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise InvalidManifest(f"{p} is not JSON: {e}") from None
        m = cls(_validate(data, p), p, hashlib.sha256(raw).hexdigest())
        return m

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        data = _validate(data, "<manifest>")
        raw = json.dumps(data, indent=1).encode()
        return cls(data, None, hashlib.sha256(raw).hexdigest())

    @property
    def identity(self) -> str:
        return self.data["identity"]

    @property
    def chunk_size(self) -> int:
        return self.data["hashes"]["chunk_size"]

    @property
    def files(self) -> list[dict]:
        return self.data["files"]

    @property
    def tensors(self) -> list[dict]:
        return self.data["tensors"]

    @property
    def model(self) -> dict:
        return self.data["model"]

    @property
    def n_layer(self) -> int:
        return self.model["n_layer"]

    def needed(self, layers: tuple[int, int] | None) -> set[str]:
        """Tensor names a stage owning ``layers`` loads (all tensors for None)."""
        if layers is None:
            return set(self.tensors_by_name)
        a, b = _check_range(layers, self.n_layer, f"the manifest's model {self.identity}")
        return needed_tensor_names(((t["name"], t["layer"], t["role"]) for t in self.tensors),
                                   a, b, self.n_layer, self.model["tied_embeddings"])


def _validate(data: Any, where) -> dict:
    def bad(msg: str):
        return InvalidManifest(f"{where}: {msg}")

    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise bad(f"not a dgr artifact manifest (schema {got!r}, this dgr reads {SCHEMA!r})")
    try:
        h = data["hashes"]
        if h["chunk"] != "sha256" or h["file"] != "sha256" or h["tensor"] not in TENSOR_HASHES:
            raise bad(f"unsupported hash algorithms {h}")
        cs = h["chunk_size"]
        if not isinstance(cs, int) or cs <= 0:
            raise bad(f"chunk_size must be a positive integer, got {cs!r}")
        names = set()
        for f in data["files"]:
            size, chunks = f["size"], f["chunks"]
            if not isinstance(f["name"], str) or "/" in f["name"] or f["name"] in ("", ".", ".."):
                raise bad(f"bad file name {f['name']!r}")
            if len(chunks) != -(-size // cs):
                raise bad(f"{f['name']}: {len(chunks)} chunk hashes for {size} bytes")
            names.add(f["name"])
        if not data["files"]:
            raise bad("lists no files")
        for t in data["tensors"]:
            if t["file"] not in names:
                raise bad(f"tensor {t['name']} names unknown file {t['file']!r}")
            size = next(f["size"] for f in data["files"] if f["name"] == t["file"])
            if t["offset"] < 0 or t["offset"] + t["size"] > size:
                raise bad(f"tensor {t['name']} lies outside its file")
        m = data["model"]
        int(m["n_layer"]), bool(m["tied_embeddings"])
        if not str(data["identity"]).startswith("sha256:"):
            raise bad(f"identity {data['identity']!r} is not sha256:<hex>")
    except InvalidManifest:
        raise
    except (KeyError, TypeError, ValueError, StopIteration) as e:
        raise bad(f"malformed ({type(e).__name__}: {e})") from None
    return data


def _metadata_sha256(head: gguf_io.GGUFHeader) -> str:
    """sha256 of the model's metadata pairs (raw encoded, sorted by key), split/slice keys aside."""
    h = hashlib.sha256()
    for key in sorted(head.kv_raw):
        if not key.startswith(_NOT_METADATA):
            h.update(head.kv_raw[key])
    return h.hexdigest()


def _model_headers(paths: Sequence[str | os.PathLike]) -> list[gguf_io.GGUFHeader]:
    """Headers of every file of one model, in split order; names a missing split."""
    from dgr.errors import ModelNotFound

    given = [Path(p) for p in paths]
    if not given:
        raise InvalidModel("no model files given")
    if len(given) == 1:
        files = gguf_io.model_files(given[0])
    else:
        files = sorted(given, key=lambda p: p.name)
        expect = gguf_io.model_files(files[0])
        if [p.name for p in files] != [p.name for p in expect]:
            raise InvalidModel(f"{', '.join(p.name for p in given)} are not exactly the files of "
                               f"one split model (expected {', '.join(p.name for p in expect)})")
        files = [f.parent / f.name for f in expect]
    missing = [f for f in files if not f.exists()]
    if missing:
        raise ArtifactMissing(f"split model {files[0].name} is missing "
                              f"{', '.join(f.name for f in missing)} (in {files[0].parent})")
    heads = []
    for i, f in enumerate(files):
        try:
            h = gguf_io.read_header(f, decode_arrays=False)
        except ModelNotFound as e:
            raise ArtifactMissing(str(e)) from None
        if len(files) > 1 and (h.split_no != i or h.split_count != len(files)):
            raise InvalidModel(f"{f.name}: metadata says split {h.split_no + 1} of "
                               f"{h.split_count}, expected {i + 1} of {len(files)}")
        if h.file_size < h.data_end:
            cut = [t.name for t in h.tensors if t.offset + t.nbytes > h.file_size]
            raise ArtifactTruncated(f"{f.name} is truncated: {h.file_size} bytes, its tensors end "
                                    f"at {h.data_end} ({len(cut)} tensors cut, from {cut[0]})")
        heads.append(h)
    return heads


def _model_facts(heads: Sequence[gguf_io.GGUFHeader]) -> dict:
    first = heads[0]
    arch = first.arch
    if not arch:
        raise InvalidModel(f"{first.path} has no general.architecture")
    block_count = first.arch_int("block_count")
    if block_count is None:
        raise InvalidModel(f"{first.path} has no {arch}.block_count")
    nextn = first.arch_int("nextn_predict_layers", 0)
    names = {t.name for h in heads for t in h.tensors}
    return {
        "arch": arch,
        "block_count": block_count,
        "n_layer": _n_layer(block_count, nextn),
        "tied_embeddings": "output.weight" not in names and "token_embd.weight" in names,
        "n_tensors": len(names),
        "gguf_version": first.version,
        "metadata_sha256": _metadata_sha256(first),
    }


def build_manifest(paths: Sequence[str | os.PathLike] | str | os.PathLike, *,
                   chunk_size: int = DEFAULT_CHUNK_SIZE, tensor_hash: str = "sha256",
                   progress: bool = False) -> dict:
    """Hash a model's files into a manifest (the JSON object; see ``docs/artifacts.md``).

    Parameters
    ----------
    paths : path or list of paths
        A one-file GGUF, or any split of a split GGUF (the others are found by name), or all
        the splits.
    chunk_size : int
        Verification granularity in bytes (the unit an interrupted verify resumes at).
    tensor_hash : "sha256" or "xxh3_128"
        Algorithm of the per-tensor hashes.

    Raises
    ------
    dgr.errors.ArtifactMissing, dgr.errors.ArtifactTruncated, dgr.errors.InvalidModel
    """
    from dgr.artifacts.identity import remember_file_sha256, split_identity

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if tensor_hash not in TENSOR_HASHES:
        raise ValueError(f"tensor_hash must be one of {TENSOR_HASHES}, got {tensor_hash!r}")
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    heads = _model_headers(paths)
    facts = _model_facts(heads)
    bar = _Progress(sum(h.file_size for h in heads), "manifest", progress)
    files, tensors = [], []
    try:
        with ThreadPoolExecutor(1) as file_pool, ThreadPoolExecutor(1) as tensor_pool:
            for i, h in enumerate(heads):
                fe, te = _hash_file(h, chunk_size, tensor_hash, (file_pool, tensor_pool), bar)
                fe["split"] = i
                files.append(fe)
                tensors.extend(te)
                remember_file_sha256(h.path, fe["sha256"])
    finally:
        bar.close()
    if len(files) == 1:
        identity, rule = "sha256:" + files[0]["sha256"], "file-sha256"
    else:
        identity, rule = split_identity([f["sha256"] for f in files]), "split-file-sha256s"
    return {
        "schema": SCHEMA,
        "identity": identity,
        "identity_rule": rule,
        "model": facts,
        "hashes": {"file": "sha256", "chunk": "sha256", "tensor": tensor_hash,
                   "chunk_size": chunk_size},
        "files": files,
        "tensors": tensors,
    }


def _hash_file(h: gguf_io.GGUFHeader, chunk_size: int, tensor_alg: str, pools,
               bar: "_Progress") -> tuple[dict, list[dict]]:
    """One pass over a file: whole-file, per-chunk, header and per-tensor hashes.

    The whole-file and the per-tensor digests each run in their own single-thread pool (FIFO,
    so each digest sees its blocks in order) while this thread reads the next block and does
    the chunk digests: hashlib releases the GIL on large buffers, so the three overlap.
    """
    file_pool, tensor_pool = pools
    size = h.file_size
    order = sorted(h.tensors, key=lambda t: t.offset)
    thash = {t.name: _hasher(tensor_alg) for t in order}
    file_h, head_h = hashlib.sha256(), hashlib.sha256()
    chunks: list[str] = []
    state = {"ti": 0}  # first tensor that may still overlap (touched by the tensor pool only)

    def tensors_update(pos: int, view) -> None:
        end = pos + len(view)
        ti = state["ti"]
        while ti < len(order) and order[ti].offset + order[ti].nbytes <= pos:
            ti += 1
        state["ti"] = ti
        while ti < len(order) and order[ti].offset < end:
            t = order[ti]
            lo, hi = max(pos, t.offset), min(end, t.offset + t.nbytes)
            if lo < hi:
                thash[t.name].update(view[lo - pos:hi - pos])
            ti += 1

    bufs = [bytearray(_BLOCK), bytearray(_BLOCK)]
    busy: list[list] = [[], []]
    with open(h.path, "rb") as f:
        pos, i = 0, 0
        chunk_h = hashlib.sha256()
        while pos < size:
            b = i & 1
            for fut in busy[b]:  # the buffer is free once both digests consumed it
                fut.result()
            n = min(_BLOCK, size - pos, chunk_size - pos % chunk_size)
            view = memoryview(bufs[b])[:n]
            got = f.readinto(view)
            if got != n:
                raise ArtifactTruncated(f"{h.path.name} shrank while being hashed (at byte {pos})")
            _count(n)
            busy[b] = [file_pool.submit(file_h.update, view),
                       tensor_pool.submit(tensors_update, pos, view)]
            chunk_h.update(view)
            end = pos + n
            if pos < h.data_offset:
                head_h.update(view[:min(end, h.data_offset) - pos])
            pos, i = end, i + 1
            bar.update(n, h.path.name)
            if pos % chunk_size == 0 or pos == size:
                chunks.append(chunk_h.hexdigest())
                chunk_h = hashlib.sha256()
        for fut in busy[0] + busy[1]:
            fut.result()
    fe = {"name": h.path.name, "split": 0, "size": size, "sha256": file_h.hexdigest(),
          "data_offset": h.data_offset, "header_sha256": head_h.hexdigest(), "chunks": chunks}
    te = []
    for t in h.tensors:
        layer, role = tensor_role(t.name)
        te.append({"name": t.name, "file": h.path.name, "offset": t.offset, "size": t.nbytes,
                   "type": t.type_name, "shape": list(t.shape), "layer": layer, "role": role,
                   "hash": thash[t.name].hexdigest()})
    return fe, te


def write_manifest(data: dict, out: str | os.PathLike | None) -> str:
    """Serialise a manifest (stable layout); write it atomically to ``out`` when given."""
    text = json.dumps(data, indent=1) + "\n"
    if out is not None:
        _atomic_write(Path(out), text.encode())
    return text


def _atomic_write(path: Path, raw: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    try:  # make the rename itself durable (power loss)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


# ---- progress -----------------------------------------------------------------------------


class _Progress:
    """A byte progress bar on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

    def __init__(self, total: int, what: str, enabled: bool):
        self.total, self.what, self.enabled = max(total, 1), what, enabled
        self.done = 0
        self.t0 = time.perf_counter()
        self.last_draw = 0.0
        self.last_decile = -1
        self.tty = enabled and sys.stderr.isatty()

    def update(self, n: int, label: str = "") -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        frac = min(self.done / self.total, 1.0)
        if self.tty:
            if now - self.last_draw < 0.1 and self.done < self.total:
                return
            self.last_draw = now
            width = 28
            fill = int(frac * width)
            sys.stderr.write(f"\r[{self.what}] |{'#' * fill}{'.' * (width - fill)}| "
                             f"{self._stats(now)} {label[:40]:<40}")
            sys.stderr.flush()
        elif int(frac * 10) > self.last_decile:
            self.last_decile = int(frac * 10)
            print(f"[{self.what}] {self._stats(now)} {label}", file=sys.stderr, flush=True)

    def _stats(self, now: float) -> str:
        rate = self.done / max(now - self.t0, 1e-9) / 2**20
        return (f"{self.done / 2**20:9.1f}/{self.total / 2**20:.1f} MiB "
                f"{100 * self.done / self.total:5.1f}% {rate:8.1f} MiB/s")

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ---- the verification journal ---------------------------------------------------------------


def _ranges(ints: Iterable[int]) -> str:
    out, run = [], None
    for i in sorted(set(ints)):
        if run and i == run[1] + 1:
            run[1] = i
        else:
            if run:
                out.append(f"{run[0]}" if run[0] == run[1] else f"{run[0]}-{run[1]}")
            run = [i, i]
    if run:
        out.append(f"{run[0]}" if run[0] == run[1] else f"{run[0]}-{run[1]}")
    return ",".join(out)


def _unranges(s: str) -> set[int]:
    out: set[int] = set()
    for part in filter(None, s.split(",")):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def _stat_sig(p: Path) -> list[int] | None:
    try:
        st = p.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


class _Journal:
    """What an earlier run verified, per file as it then was (size, mtime, ctime, inode).

    Entries only ever claim chunks (or tensors) whose hashes matched; a file whose stat
    changed loses its entry. Written atomically (temporary file, fsync, rename) and merged
    under a lock with concurrent verifiers of the same manifest.
    """

    def __init__(self, path: Path | None, manifest_sha256: str):
        self.path = path
        self.manifest_sha256 = manifest_sha256
        self.files: dict[str, dict] = {}
        if path is not None:
            self.files = self._read()

    def _read(self) -> dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if (not isinstance(data, dict) or data.get("schema") != JOURNAL_SCHEMA
                or data.get("manifest_sha256") != self.manifest_sha256):
            return {}
        out = {}
        for k, e in (data.get("files") or {}).items():
            try:
                out[k] = {"stat": list(e["stat"]), "chunks": _unranges(e.get("chunks", "")),
                          "tensors": set(e.get("tensors", []))}
            except (KeyError, TypeError, ValueError):
                continue
        return out

    def entry(self, p: Path, sig: list[int] | None) -> dict:
        key = str(p.resolve())
        e = self.files.get(key)
        if e is None or sig is None or e["stat"] != sig:
            e = {"stat": sig, "chunks": set(), "tensors": set()}
            self.files[key] = e
        return e

    def drop(self, p: Path) -> None:
        self.files.pop(str(p.resolve()), None)

    def flush(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = self.path.with_name(self.path.name + ".lock")
        with open(lock, "a") as lf:
            fcntl.flock(lf, fcntl.LOCK_EX)
            try:
                theirs = self._read()
                for k, mine in self.files.items():
                    t = theirs.get(k)
                    if t is not None and t["stat"] == mine["stat"]:
                        mine["chunks"] |= t["chunks"]
                        mine["tensors"] |= t["tensors"]
                merged = {**theirs, **self.files}
                data = {"schema": JOURNAL_SCHEMA, "manifest_sha256": self.manifest_sha256,
                        "files": {k: {"stat": e["stat"], "chunks": _ranges(e["chunks"]),
                                      "tensors": sorted(e["tensors"])}
                                  for k, e in merged.items() if e["stat"] is not None}}
                _atomic_write(self.path, json.dumps(data, indent=0).encode())
            finally:
                fcntl.flock(lf, fcntl.LOCK_UN)


def _cache_dir() -> Path:
    from dgr.vendor import cache_root

    return cache_root() / "artifacts"


def default_journal_path(manifest: Manifest) -> Path:
    """``$DGR_CACHE/artifacts/journal-<manifest sha256>.json`` (mounted model storage is often
    read-only, so the journal does not go next to the manifest unless asked)."""
    return _cache_dir() / f"journal-{manifest.sha256[:32]}.json"


# ---- verification -------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One finding: ``kind`` is missing, truncated, oversized, different, changed, range,
    foreign or unreadable; ``what`` names the tensor or region (empty for a whole file)."""

    kind: str
    file: str
    what: str = ""
    detail: str = ""

    def __str__(self) -> str:
        s = f"{self.file}: " + (f"{self.what} " if self.what else "") + self.kind
        return s + (f" ({self.detail})" if self.detail else "")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "file": self.file, "what": self.what, "detail": self.detail}


@dataclass
class VerifyReport:
    """The outcome of ``verify``: ``ok`` and the problems found, and what it cost."""

    manifest: str
    identity: str
    mode: str                       # "files" or "slice"
    layers: tuple[int, int] | None
    problems: list[Problem] = field(default_factory=list)
    bytes_planned: int = 0          # bytes the verification covers
    bytes_journal: int = 0          # of those, skipped as verified by an earlier run
    bytes_read: int = 0             # read by this run (hashing, and narrowing down failures)
    seconds: float = 0.0
    journal: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"ok": self.ok, "manifest": self.manifest, "identity": self.identity,
                "mode": self.mode, "layers": list(self.layers) if self.layers else None,
                "problems": [p.to_dict() for p in self.problems],
                "bytes_planned": self.bytes_planned, "bytes_journal": self.bytes_journal,
                "bytes_read": self.bytes_read, "seconds": round(self.seconds, 4),
                "mib_per_s": round(self.bytes_read / 2**20 / max(self.seconds, 1e-9), 1),
                "journal": self.journal}


class _Reader:
    """pread-based block hashing of file ranges (thread-safe; counts bytes)."""

    def __init__(self):
        self.local = threading.local()
        self.bytes = 0
        self.lock = threading.Lock()

    def hash_range(self, fd: int, start: int, end: int, alg: str = "sha256") -> str:
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = bytearray(_BLOCK)
        h = _hasher(alg)
        pos = start
        while pos < end:
            view = memoryview(buf)[:min(_BLOCK, end - pos)]
            got = os.preadv(fd, [view], pos)
            if got <= 0:
                break  # short file: the hash will not match
            h.update(view[:got])
            pos += got
        n = pos - start
        _count(n)
        with self.lock:
            self.bytes += n
        return h.hexdigest()


class _Killer:
    """Counts completed units; SIGKILLs the process at the configured count (tests)."""

    def __init__(self):
        v = os.environ.get(_KILL_ENV, "")
        self.after = int(v) if v.strip().isdigit() else None
        d = os.environ.get(_DELAY_ENV, "")
        try:
            self.delay = float(d) if d else 0.0
        except ValueError:
            self.delay = 0.0
        self.done = 0

    def unit_done(self, journal: _Journal) -> None:
        self.done += 1
        if self.after is not None and self.done >= self.after:
            journal.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def verify(manifest: "str | os.PathLike | Manifest", *, dir: str | os.PathLike | None = None,
           model: str | os.PathLike | None = None, layers: tuple[int, int] | None = None,
           journal: str | os.PathLike | None | bool = None, fresh: bool = False,
           threads: int | None = None, flush_bytes: int | None = None,
           progress: bool = False) -> VerifyReport:
    """Check model artifacts against a manifest, resuming from the journal of earlier runs.

    Parameters
    ----------
    manifest : path or Manifest
    dir : path, optional
        Directory holding the manifest's files (default: the manifest's own directory).
    model : path, optional
        The artifact to check instead: a file of the manifest's model (its directory is then
        ``dir``), or a dgr slice of that model (checked tensor by tensor).
    layers : (int, int), optional
        Check only what a stage owning ``[a, b)`` loads: the chunks holding its tensors plus
        every file's header (all chunks / all of a slice's tensors when None).
    journal : path, False or None
        Where progress is recorded (default ``$DGR_CACHE/artifacts/journal-<manifest>.json``);
        False keeps no journal.
    fresh : bool
        Ignore what the journal says was verified (it is still written).
    threads : int, optional
        Chunks hashed in parallel (default min(4, CPUs)).
    flush_bytes : int, optional
        Write the journal after at least this many newly verified bytes (default: the chunk
        size, i.e. after every chunk).

    Returns
    -------
    VerifyReport
        ``ok`` is True when nothing differs; ``problems`` names every file, header or tensor
        that is missing, truncated or different.

    Raises
    ------
    dgr.errors.InvalidManifest
        The manifest cannot be read.
    dgr.errors.InvalidLayerRange
        ``layers`` is not a range of the manifest's model.
    """
    t0 = time.perf_counter()
    m = Manifest.load(manifest)
    if layers is not None:
        layers = _check_range(layers, m.n_layer, f"the manifest's model {m.identity}")
    jpath = None if journal is False else (Path(journal) if journal else default_journal_path(m))
    jr = _Journal(jpath, m.sha256)
    if fresh:
        jr.files = {}
    rep = VerifyReport(str(m.path or "<manifest>"), m.identity, "files", layers,
                       journal=str(jpath) if jpath else None)
    flush_bytes = flush_bytes or m.chunk_size
    threads = threads or min(4, os.cpu_count() or 1)
    if model is not None:
        mp = Path(model)
        head = None
        try:
            head = gguf_io.read_header(mp, decode_arrays=False)
        except DgrError:
            pass
        if head is not None and head.slice_range is not None:
            rep.mode = "slice"
            _verify_slice(m, mp, head, layers, jr, rep, flush_bytes, progress)
            rep.seconds = time.perf_counter() - t0
            return rep
        names = [f["name"] for f in m.files]
        if mp.name not in names:
            rep.problems.append(Problem("foreign", mp.name, detail=(
                f"not a file of the manifest's model {m.identity} (it lists "
                f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''}) nor a slice of it")))
            rep.seconds = time.perf_counter() - t0
            return rep
        dir = mp.parent
    base = Path(dir) if dir is not None else (m.path.parent if m.path else Path("."))
    _verify_files(m, base, layers, jr, rep, threads, flush_bytes, progress)
    rep.seconds = time.perf_counter() - t0
    if rep.ok:
        from dgr.artifacts.identity import remember_verified

        remember_verified([base / f["name"] for f in m.files], m.identity)
    return rep


def _planned_chunks(m: Manifest, layers) -> dict[str, set[int]]:
    cs = m.chunk_size
    plan: dict[str, set[int]] = {}
    for f in m.files:
        n = len(f["chunks"])
        if layers is None:
            plan[f["name"]] = set(range(n))
        else:  # the header (metadata and every tensor info) of every file
            plan[f["name"]] = set(range(0, (max(f["data_offset"], 1) - 1) // cs + 1))
    if layers is not None:
        for name in m.needed(layers):
            t = m.tensors_by_name[name]
            if t["size"]:
                plan[t["file"]].update(range(t["offset"] // cs,
                                             (t["offset"] + t["size"] - 1) // cs + 1))
    return plan


def _verify_files(m: Manifest, base: Path, layers, jr: _Journal, rep: VerifyReport,
                  threads: int, flush_bytes: int, progress: bool) -> None:
    cs = m.chunk_size
    plan = _planned_chunks(m, layers)
    reader = _Reader()
    killer = _Killer()

    def chunk_len(f: dict, k: int) -> int:
        return min(cs, f["size"] - k * cs)

    # what is there, and what is left to hash
    todo: list[tuple[dict, Path, dict, int]] = []
    open_files: dict[str, int] = {}
    sigs: dict[str, list[int]] = {}
    for f in m.files:
        p = base / f["name"]
        want = plan[f["name"]]
        rep.bytes_planned += sum(chunk_len(f, k) for k in want)
        sig = _stat_sig(p)
        if sig is None:
            jr.drop(p)
            rep.problems.append(Problem("missing", f["name"], detail=f"not found in {base}"))
            continue
        size = sig[0]
        if size < f["size"]:
            jr.drop(p)
            cut = sorted((t for t in m.tensors if t["file"] == f["name"]
                          and t["offset"] + t["size"] > size), key=lambda t: t["offset"])
            more = (f"; {len(cut)} tensors cut off, from {cut[0]['name']}" if cut
                    else "; only padding is cut off")
            rep.problems.append(Problem("truncated", f["name"],
                                        detail=f"{size} of {f['size']} bytes{more}"))
            continue
        if size > f["size"]:
            jr.drop(p)
            rep.problems.append(Problem("oversized", f["name"], detail=(
                f"{size} bytes, the manifest says {f['size']}: not the manifest's file")))
            continue
        entry = jr.entry(p, sig)
        done = entry["chunks"] & want
        rep.bytes_journal += sum(chunk_len(f, k) for k in done)
        sigs[f["name"]] = sig
        try:
            open_files[f["name"]] = os.open(p, os.O_RDONLY)
        except OSError as e:
            rep.problems.append(Problem("unreadable", f["name"], detail=e.strerror or str(e)))
            continue
        for k in sorted(want - done):
            todo.append((f, p, entry, k))

    bar = _Progress(sum(chunk_len(f, k) for f, _, _, k in todo), "verify", progress)
    bad: dict[str, list[int]] = {}
    pending = 0

    def job(item):
        f, _p, _e, k = item
        if killer.delay:
            time.sleep(killer.delay)
        start = k * cs
        return item, reader.hash_range(open_files[f["name"]], start, start + chunk_len(f, k))

    def results():
        if threads <= 1:
            for item in todo:
                yield job(item)
        else:
            with ThreadPoolExecutor(threads) as pool:
                # bounded look-ahead keeps memory and wasted work (on a kill) small
                it = iter(todo)
                futs = [pool.submit(job, x) for _, x in zip(range(threads * 2), it)]
                while futs:
                    res = futs.pop(0).result()
                    nxt = next(it, None)
                    if nxt is not None:
                        futs.append(pool.submit(job, nxt))
                    yield res

    n_results = 0
    try:
        for (f, p, entry, k), digest in results():
            n_results += 1
            n = chunk_len(f, k)
            bar.update(n, f["name"])
            if digest == f["chunks"][k]:
                entry["chunks"].add(k)
                pending += n
                if pending >= flush_bytes:
                    jr.flush()
                    pending = 0
                killer.unit_done(jr)
            else:
                bad.setdefault(f["name"], []).append(k)
    finally:
        bar.close()
        if pending:
            jr.flush()
    rep.bytes_read = reader.bytes
    if n_results != len(todo):  # never report success for chunks nobody hashed
        raise ArtifactError(f"internal error: {n_results} of {len(todo)} chunks were hashed")

    # a file that changed while it was read: nothing it gave can be trusted
    for f in m.files:
        if f["name"] in sigs and _stat_sig(base / f["name"]) != sigs[f["name"]]:
            jr.drop(base / f["name"])
            rep.problems.append(Problem("changed", f["name"],
                                        detail="modified while being verified; run again"))
            bad.pop(f["name"], None)
    needed = m.needed(layers) if layers is not None else None
    for name, ks in bad.items():
        _localise(m, name, sorted(ks), open_files[name], reader, rep, needed)
    rep.bytes_read = reader.bytes
    for fd in open_files.values():
        os.close(fd)
    jr.flush()


def _localise(m: Manifest, name: str, ks: list[int], fd: int, reader: _Reader,
              rep: VerifyReport, needed: set[str] | None) -> None:
    """Name what mismatching chunks hold that differs: the header, tensors, or padding.

    With ``needed`` (a range check) only the header and the range's tensors count: a chunk
    that also holds other tensors may differ there without touching what the range loads
    (the range's tensors are then accepted on their own tensor hashes).
    """
    cs = m.chunk_size
    f = next(x for x in m.files if x["name"] == name)
    alg = m.data["hashes"]["tensor"]
    tensors = sorted((t for t in m.tensors if t["file"] == name
                      and (needed is None or t["name"] in needed)), key=lambda t: t["offset"])
    differs: dict[str, bool] = {}

    def header_differs() -> bool:
        if "<header>" not in differs:
            differs["<header>"] = bad = (reader.hash_range(fd, 0, f["data_offset"])
                                         != f["header_sha256"])
            if bad:
                rep.problems.append(Problem("different", name, "header", (
                    f"metadata or tensor infos in bytes 0..{f['data_offset']} differ")))
        return differs["<header>"]

    def tensor_differs(t: dict) -> bool:
        if t["name"] not in differs:
            lo, hi = t["offset"], t["offset"] + t["size"]
            differs[t["name"]] = bad = reader.hash_range(fd, lo, hi, alg) != t["hash"]
            if bad:
                where = f"layer {t['layer']}" if t["layer"] is not None else t["role"]
                rep.problems.append(Problem("different", name, f"tensor {t['name']}",
                                            f"bytes {lo}..{hi}, {where}"))
        return differs[t["name"]]

    for k in ks:
        lo, hi = k * cs, min((k + 1) * cs, f["size"])
        found = [header_differs()] if lo < f["data_offset"] else []
        found += [tensor_differs(t) for t in tensors
                  if t["offset"] < hi and t["offset"] + t["size"] > lo]
        if not any(found) and needed is None:
            rep.problems.append(Problem("different", name, f"chunk {k}",
                                        f"bytes {lo}..{hi} differ outside any tensor (padding)"))


def _verify_slice(m: Manifest, path: Path, head: gguf_io.GGUFHeader, layers,
                  jr: _Journal, rep: VerifyReport, flush_bytes: int, progress: bool) -> None:
    name = path.name
    s, e = head.slice_range
    src = head.kv.get("dgr.slice.source_identity")
    if src != m.identity:
        rep.problems.append(Problem("foreign", name, detail=(
            f"a slice of {src}, the manifest is of {m.identity}")))
        return
    if layers is None:
        layers = (s, e)
    elif not (s <= layers[0] and layers[1] <= e):
        rep.problems.append(Problem("range", name, detail=(
            f"the slice holds layers [{s}, {e}), layers [{layers[0]}, {layers[1]}) were asked")))
        return
    if _metadata_sha256(head) != m.model["metadata_sha256"]:
        rep.problems.append(Problem("different", name, "metadata",
                                    "the slice's metadata differs from the model's"))
    expect = m.needed((s, e))
    have = set(head.by_name)
    for t in sorted(expect - have):
        rep.problems.append(Problem("missing", name, f"tensor {t}",
                                    f"a slice of [{s}, {e}) must hold it"))
    for t in sorted(have - expect):
        rep.problems.append(Problem("different", name, f"tensor {t}",
                                    f"not a tensor of layers [{s}, {e}) of the model"))
    check = []
    for tn in sorted(m.needed(layers) & have, key=lambda n: head.by_name[n].offset):
        t, ref = head.by_name[tn], m.tensors_by_name[tn]
        if t.type_name != ref["type"] or list(t.shape) != ref["shape"]:
            rep.problems.append(Problem("different", name, f"tensor {tn}", (
                f"{t.type_name} {list(t.shape)}, the model has {ref['type']} {ref['shape']}")))
        elif t.offset + t.nbytes > head.file_size:
            rep.problems.append(Problem("truncated", name, f"tensor {tn}", (
                f"ends at byte {t.offset + t.nbytes}, the file has {head.file_size}")))
        else:
            check.append((t, ref))
    rep.bytes_planned = sum(t.nbytes for t, _ in check)
    sig = _stat_sig(path)
    entry = jr.entry(path, sig)
    todo = [(t, ref) for t, ref in check if t.name not in entry["tensors"]]
    rep.bytes_journal = rep.bytes_planned - sum(t.nbytes for t, _ in todo)
    reader, killer = _Reader(), _Killer()
    alg = m.data["hashes"]["tensor"]
    bar = _Progress(sum(t.nbytes for t, _ in todo), "verify", progress)
    pending = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for t, ref in todo:
            if killer.delay:
                time.sleep(killer.delay)
            digest = reader.hash_range(fd, t.offset, t.offset + t.nbytes, alg)
            bar.update(t.nbytes, t.name)
            if digest != ref["hash"]:
                layer = f"layer {ref['layer']}" if ref["layer"] is not None else ref["role"]
                rep.problems.append(Problem("different", name, f"tensor {t.name}",
                                            f"bytes {t.offset}..{t.offset + t.nbytes}, {layer}"))
                continue
            entry["tensors"].add(t.name)
            pending += t.nbytes
            if pending >= flush_bytes:
                jr.flush()
                pending = 0
            killer.unit_done(jr)
    finally:
        os.close(fd)
        bar.close()
    rep.bytes_read = reader.bytes
    if _stat_sig(path) != sig:
        jr.drop(path)
        rep.problems.append(Problem("changed", name,
                                    detail="modified while being verified; run again"))
    jr.flush()


_RAISE_ORDER = [("range", InvalidLayerRange), ("missing", ArtifactMissing),
                ("truncated", ArtifactTruncated), ("foreign", ArtifactMismatch),
                ("oversized", ArtifactMismatch), ("different", ArtifactMismatch),
                ("changed", ArtifactMismatch), ("unreadable", ArtifactError)]


def raise_for(report: VerifyReport, model: str | os.PathLike | None = None) -> None:
    """Raise the typed error for a failed report (nothing when it is ok)."""
    if report.ok:
        return
    kinds = {p.kind for p in report.problems}
    cls = next((c for k, c in _RAISE_ORDER if k in kinds), ArtifactError)
    shown = "; ".join(str(p) for p in report.problems[:8])
    more = len(report.problems) - 8
    where = f" at {model}" if model is not None else ""
    msg = (f"model artifacts{where} do not match manifest {report.manifest} "
           f"({report.identity}): {shown}" + (f"; and {more} more" if more > 0 else ""))
    if cls is InvalidLayerRange:
        raise InvalidLayerRange(msg)
    raise cls(msg, report.problems)


def verify_for_worker(manifest_path: "str | os.PathLike | Manifest",
                      model_path: str | os.PathLike, layers: tuple[int, int] | None, *,
                      journal: str | os.PathLike | None | bool = None,
                      progress: bool = False) -> str:
    """Check, before serving, that ``model_path`` holds what the manifest certifies.

    Verifies the headers of every file and the chunks holding the tensors a stage owning
    ``layers`` loads (everything for None), resuming from the journal, so a restart on
    unchanged files reads nothing. ``model_path`` is the model (a one-file GGUF or any split)
    or a dgr slice of it. On success the files are remembered as verified, so
    ``dgr.artifacts.identity.model_identity(model_path)`` returns the manifest's identity without
    hashing.

    Returns
    -------
    str
        The model identity (``sha256:...``) the worker reports.

    Raises
    ------
    dgr.errors.InvalidManifest
        The manifest is unreadable or of another schema.
    dgr.errors.InvalidLayerRange
        ``layers`` is outside the model, or not held by the slice.
    dgr.errors.ArtifactMissing
        A file (e.g. a split) or, in a slice, a tensor is missing.
    dgr.errors.ArtifactTruncated
        A file is shorter than the manifest says.
    dgr.errors.ArtifactMismatch
        Bytes differ (header, tensor, padding), or the file is another model's.
    """
    rep = verify(manifest_path, model=model_path, layers=layers, journal=journal,
                 progress=progress)
    raise_for(rep, model_path)
    return rep.identity


# ---- pre-load check -----------------------------------------------------------------------


def precheck(model_path: str | os.PathLike, layers: tuple[int, int] | None = None) -> dict:
    """Cheap checks before an engine loads ``model_path`` (reads headers only).

    Returns ``{"load_path", "files", "n_layer", "slice", "layers"}``: ``load_path`` is the
    first split (llama.cpp must be given the first split of a split model), ``slice`` the
    range a dgr slice holds (None for a whole model), ``layers`` the resolved range.

    Raises
    ------
    dgr.errors.ModelNotFound, dgr.errors.InvalidModel
    dgr.errors.ArtifactMissing
        A split of a split model is missing.
    dgr.errors.InvalidLayerRange
        The range is outside the model, or outside what a slice holds.
    """
    p = Path(model_path)
    head = gguf_io.read_header(p, decode_arrays=False)
    files = gguf_io.model_files(p)
    missing = [f for f in files if not f.exists()]
    if missing:
        raise ArtifactMissing(f"split model {files[0].name} is missing "
                              f"{', '.join(f.name for f in missing)} (in {files[0].parent})")
    block_count = head.arch_int("block_count")
    if block_count is None:
        first = gguf_io.read_header(files[0], decode_arrays=False)
        block_count = first.arch_int("block_count")
        head = first
    if block_count is None:
        raise InvalidModel(f"{files[0]} has no block_count")
    n_layer = _n_layer(block_count, head.arch_int("nextn_predict_layers", 0))
    a, b = (0, n_layer) if layers is None else _check_range(layers, n_layer, str(p))
    held = head.slice_range
    if held is not None and not (held[0] <= a and b <= held[1]):
        raise InvalidLayerRange(
            f"{p.name} is a dgr slice holding layers [{held[0]}, {held[1]}) of {n_layer}; it "
            f"cannot serve layers [{a}, {b}): load the full model or a slice that holds them")
    return {"load_path": files[0], "files": files, "n_layer": n_layer, "slice": held,
            "layers": (a, b)}


# ---- slices -------------------------------------------------------------------------------


def slice_model(model: str | os.PathLike, layers: tuple[int, int], out: str | os.PathLike, *,
                manifest: "str | os.PathLike | Manifest | None" = None,
                progress: bool = False) -> dict:
    """Write a GGUF holding only what a stage owning ``layers`` loads, with the full metadata.

    Tensors keep their names (absolute layer indices) and the metadata is copied byte for byte
    (``block_count`` unchanged; ``split.*`` keys dropped), plus ``dgr.slice.layer_start`` and
    ``dgr.slice.layer_end`` (u32) and ``dgr.slice.source_identity`` (string). The copy streams
    in blocks. With ``manifest``, the source's identity is taken from it and every copied
    tensor and the metadata are checked against it while copying (a mismatch leaves no file).

    Returns
    -------
    dict
        ``path``, ``layers``, ``size``, ``tensors`` (count), ``tensor_bytes``,
        ``needed_bytes`` (header plus tensors the range needs, as in the source), ``source``.

    Raises
    ------
    dgr.errors.InvalidLayerRange, dgr.errors.ArtifactMissing, dgr.errors.InvalidModel,
    dgr.errors.ArtifactMismatch
    """
    heads = _model_headers([model])
    facts = _model_facts(heads)
    n_layer = facts["n_layer"]
    a, b = _check_range(layers, n_layer, str(model))
    first = heads[0]
    held = first.slice_range
    if held is not None and not (held[0] <= a and b <= held[1]):
        raise InvalidLayerRange(f"{model} is a slice holding layers [{held[0]}, {held[1]}); "
                                f"it cannot give [{a}, {b})")
    m = Manifest.load(manifest) if manifest is not None else None
    if held is not None:
        source = str(first.kv["dgr.slice.source_identity"])
    elif m is not None:
        source = m.identity
    else:
        from dgr.artifacts.identity import model_identity

        source = model_identity(first.path)
    if m is not None:
        if m.identity != source:
            raise ArtifactMismatch(f"{model} is a slice of {source}, the manifest is of "
                                   f"{m.identity}")
        if facts["metadata_sha256"] != m.model["metadata_sha256"]:
            raise ArtifactMismatch(f"the metadata of {model} differs from the manifest's model")
    all_t = [(t, h.path) for h in heads for t in h.tensors]
    keep = needed_tensor_names(((t.name, *tensor_role(t.name)) for t, _ in all_t), a, b,
                               n_layer, facts["tied_embeddings"])
    chosen = [(t, p) for t, p in all_t if t.name in keep]
    kv = [raw for key, raw in first.kv_raw.items() if not key.startswith(_NOT_METADATA)]
    kv += [gguf_io.encode_kv("dgr.slice.layer_start", gguf_io.T_U32, a),
           gguf_io.encode_kv("dgr.slice.layer_end", gguf_io.T_U32, b),
           gguf_io.encode_kv("dgr.slice.source_identity", gguf_io.T_STRING, source)]
    total = sum(t.nbytes for t, _ in chosen)
    bar = _Progress(total, "slice", progress)
    hashers: dict[str, Any] = {}
    alg = m.data["hashes"]["tensor"] if m is not None else None

    seen: dict[str, int] = {}

    def on_bytes(t: gguf_io.GGUFTensor, chunk) -> None:
        n = len(chunk)
        _count(n)
        bar.update(n, t.name)
        if alg is None:
            return
        h = hashers.get(t.name)
        if h is None:
            h = hashers[t.name] = _hasher(alg)
        h.update(chunk)
        seen[t.name] = seen.get(t.name, 0) + n
        if seen[t.name] == t.nbytes:
            ref = m.tensors_by_name.get(t.name)
            if (ref is None or ref["type"] != t.type_name or ref["shape"] != list(t.shape)
                    or h.hexdigest() != ref["hash"]):
                raise ArtifactMismatch(f"tensor {t.name} of {model} differs from the manifest's "
                                       f"(no slice written to {out})")

    try:
        size = gguf_io.write_gguf(out, version=first.version, kv_pairs=kv, tensors=chosen,
                                  alignment=first.alignment, on_bytes=on_bytes)
    finally:
        bar.close()
    # what the range needs at least: the GGUF prefix, the model's metadata, the infos and
    # bytes of its tensors (no padding)
    needed = (24 + sum(len(r) for k, r in first.kv_raw.items() if not k.startswith(_NOT_METADATA))
              + sum(len(t.info_bytes) + t.nbytes for t, _ in chosen))
    return {"path": str(out), "layers": [a, b], "size": size, "tensors": len(chosen),
            "tensor_bytes": total, "needed_bytes": needed, "source": source}


# ---- command line -------------------------------------------------------------------------


def _parse_range(s: str) -> tuple[int, int]:
    try:
        a, b = s.split(":")
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A:B (e.g. 0:10), got {s!r}") from None


def _parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]i?B?)?", s.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size like 64MiB, got {s!r}")
    unit = (m.group(2) or "").upper()[:1]
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit]


def _build_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub = p.add_subparsers(dest="artifacts_cmd", required=True)
    mk = sub.add_parser("manifest", help="hash a model's files into a JSON manifest",
                        description="Hash a model (a GGUF, or a split GGUF: give any split or "
                                    "all of them) into a manifest: files, chunks, tensors, "
                                    "identity (docs/artifacts.md).")
    mk.add_argument("paths", nargs="+", metavar="PATH")
    mk.add_argument("--out", help="write here (default: stdout)")
    mk.add_argument("--chunk-size", type=_parse_size, default=DEFAULT_CHUNK_SIZE,
                    help="verification chunk, e.g. 64MiB (default)")
    mk.add_argument("--tensor-hash", choices=TENSOR_HASHES, default="sha256")
    mk.add_argument("--quiet", action="store_true", help="no progress bar")
    vf = sub.add_parser("verify", help="check files against a manifest (resumable)",
                        description="Verify model files against a manifest with a progress "
                                    "bar; progress is journaled so an interrupted run resumes. "
                                    "Exit status 1 names every missing, truncated or "
                                    "different file, header or tensor.")
    vf.add_argument("manifest", metavar="MANIFEST")
    vf.add_argument("--dir", help="directory holding the files (default: the manifest's)")
    vf.add_argument("--model", help="check this artifact instead: a file of the model or a "
                                    "dgr slice of it")
    vf.add_argument("--range", type=_parse_range, metavar="A:B",
                    help="only what a stage owning layers [A, B) loads, plus every header")
    vf.add_argument("--journal", help="journal file (default: $DGR_CACHE/artifacts/...)")
    vf.add_argument("--no-journal", action="store_true", help="neither read nor write one")
    vf.add_argument("--fresh", action="store_true", help="ignore earlier progress")
    vf.add_argument("--threads", type=int, default=None, help="parallel chunk hashing")
    vf.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    vf.add_argument("--quiet", action="store_true", help="no progress bar")
    sl = sub.add_parser("slice", help="write a GGUF with only one stage's tensors",
                        description="Write a GGUF holding the tensors a stage owning layers "
                                    "[A, B) loads (plus the embeddings on the first stage and "
                                    "the head on the last), the full metadata and the range.")
    sl.add_argument("model", metavar="MODEL")
    sl.add_argument("--layers", type=_parse_range, required=True, metavar="A:B")
    sl.add_argument("--out", required=True)
    sl.add_argument("--manifest", help="check the copied tensors against this manifest")
    sl.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run)
    return p


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Register ``artifacts`` on a parent CLI's subparsers (``python -m dgr artifacts``)."""
    p = subparsers.add_parser("artifacts", help="model manifests, verification, slices",
                              description="Model artifacts: hashed manifests, resumable "
                                          "verification, split GGUFs, per-range slices.")
    return _build_parser(p)


def _run(args) -> int:
    try:
        if args.artifacts_cmd == "manifest":
            data = build_manifest(args.paths, chunk_size=args.chunk_size,
                                  tensor_hash=args.tensor_hash, progress=not args.quiet)
            text = write_manifest(data, args.out)
            if args.out is None:
                sys.stdout.write(text)
            else:
                print(f"{args.out}: {len(data['files'])} file(s), {len(data['tensors'])} "
                      f"tensors, {data['identity']}", file=sys.stderr)
            return 0
        if args.artifacts_cmd == "verify":
            journal = False if args.no_journal else args.journal
            rep = verify(args.manifest, dir=args.dir, model=args.model, layers=args.range,
                         journal=journal, fresh=args.fresh, threads=args.threads,
                         progress=not args.quiet)
            if args.json:
                print(json.dumps(rep.to_dict(), indent=1))
            what = f"layers [{rep.layers[0]}, {rep.layers[1]})" if rep.layers else "everything"
            if rep.ok:
                print(f"ok: {what} of {rep.identity}; {rep.bytes_read / 2**20:.1f} MiB hashed, "
                      f"{rep.bytes_journal / 2**20:.1f} MiB verified earlier (journal), "
                      f"{rep.seconds:.2f} s", file=sys.stderr)
                return 0
            print(f"FAILED: {what} of {rep.identity}:", file=sys.stderr)
            for p in rep.problems:
                print(f"  {p}", file=sys.stderr)
            return 1
        info = slice_model(args.model, args.layers, args.out, manifest=args.manifest,
                           progress=not args.quiet)
        print(f"{info['path']}: layers [{info['layers'][0]}, {info['layers'][1]}), "
              f"{info['tensors']} tensors, {info['size'] / 2**20:.1f} MiB "
              f"({info['needed_bytes'] / 2**20:.1f} MiB needed), slice of {info['source']}",
              file=sys.stderr)
        return 0
    except DgrError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """``python -m dgr.artifacts {manifest,verify,slice}``."""
    p = _build_parser(argparse.ArgumentParser(
        prog="python -m dgr artifacts",
        description="Model artifacts: hashed manifests, resumable verification, split GGUFs, "
                    "per-range slices."))
    args = p.parse_args(argv)
    return args.func(args)
