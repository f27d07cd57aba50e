"""Model manifests: what one model's files hold, hashed (``docs/artifacts.md``).

A manifest records, for one model (one GGUF or all files of a split GGUF), every file's size
and sha256, the sha256 of each fixed-size chunk of every file, and every tensor's file, offset,
size, layer, role and hash, plus the model identity workers report. This module builds, writes,
loads and validates manifests, and says which tensors a stage owning a layer range loads.
Verification is ``dgr.artifacts.verify``, its journal ``dgr.artifacts.journal``, slices
``dgr.artifacts.slice``, the command line ``dgr.artifacts.cli``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from dgr.artifacts import gguf as gguf_io
from dgr.artifacts.progress import Progress
from dgr.artifacts.storage import BLOCK, TENSOR_HASHES, atomic_write, count_read, hasher
from dgr.artifacts.store import check_production_path
from dgr.errors import (
    ArtifactMissing,
    ArtifactTruncated,
    InvalidLayerRange,
    InvalidManifest,
    InvalidModel,
    ModelNotFound,
)

__all__ = [
    "layer_costs",
    "SCHEMA", "DEFAULT_CHUNK_SIZE", "TENSOR_HASHES", "NOT_METADATA", "Manifest", "tensor_role",
    "needed_tensor_names", "check_range", "n_layer_of", "metadata_sha256", "model_headers",
    "model_facts", "build_manifest", "write_manifest",
]

SCHEMA = "dgr.artifacts.manifest/1"
DEFAULT_CHUNK_SIZE = 64 << 20
#: metadata keys that are not the model's: a split's place, a slice's range and source
NOT_METADATA = ("split.", "dgr.slice.")


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


def n_layer_of(block_count: int, nextn: int | None, arch: str = "",
               tensor_names: Iterable[str] | None = None) -> int:
    """Layers a route splits: multi-token-prediction layers (``nextn``) are counted in
    ``block_count`` but sit after the last layer.

    The rule is llama.cpp's, and the engine's (``cpp/src/engine/load.cpp``, which checks it against
    llama.cpp's own count at load): ``nextn`` blocks are subtracted when ``0 < nextn <
    block_count``, and for ``deepseek4`` only when the first one is in the file
    (``blk.<block_count - nextn>.nextn.eh_proj.weight``; a conversion that drops the MTP
    weights keeps ``nextn_predict_layers`` and counts only the trunk). ``tensor_names`` None:
    not known (a split whose other parts were not read): the block is taken as present.
    """
    nextn = nextn or 0
    if not 0 < nextn < block_count:
        return block_count
    if arch == "deepseek4" and tensor_names is not None:
        probe = f"blk.{block_count - nextn}.nextn.eh_proj.weight"
        if probe not in set(tensor_names):
            return block_count
    return block_count - nextn


def needed_tensor_names(tensors: Iterable[tuple[str, int | None, str]], a: int, b: int,
                        n_layer: int, tied: bool) -> set[str]:
    """Names of the tensors a stage owning layers ``[a, b)`` loads.

    ``tensors`` yields ``(name, layer, role)``. The first stage (``a == 0``) gets the input
    embeddings; the last (``b == n_layer``) the head, plus any layer past ``n_layer`` (MTP
    lives on the last stage), plus ``token_embd.weight`` when the embeddings are tied or
    there is such a layer (the NextN block embeds the drafted tokens with it: what llama.cpp
    loads on a last stage with ``load_mtp``, patch 0001); every stage gets the shared globals.
    """
    tensors = list(tensors)
    last = b >= n_layer
    nextn = last and any(role == "layer" and layer >= n_layer for _, layer, role in tensors)
    out = set()
    for name, layer, role in tensors:
        if role == "layer":
            keep = a <= layer < b or (last and layer >= n_layer)
        elif role == "input":
            keep = a == 0 or (last and (tied or nextn) and name == "token_embd.weight")
        elif role == "output":
            keep = last
        else:
            keep = True
        if keep:
            out.add(name)
    return out


def check_range(layers, n_layer: int, what: str) -> tuple[int, int]:
    """``layers`` as ``(a, b)``, a non-empty part of ``[0, n_layer)`` of ``what``.

    Raises
    ------
    dgr.errors.InvalidLayerRange
    """
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
        a, b = check_range(layers, self.n_layer, f"the manifest's model {self.identity}")
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


def metadata_sha256(head: gguf_io.GGUFHeader) -> str:
    """sha256 of the model's metadata pairs (raw encoded, sorted by key), split/slice keys aside."""
    h = hashlib.sha256()
    for key in sorted(head.kv_raw):
        if not key.startswith(NOT_METADATA):
            h.update(head.kv_raw[key])
    return h.hexdigest()


def model_headers(paths: Sequence[str | os.PathLike]) -> list[gguf_io.GGUFHeader]:
    """Headers of every file of one model, in split order; names a missing split."""
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
        heads.append(gguf_io.check_data_in_file(h))  # ArtifactTruncated when cut short
    return heads


def model_facts(heads: Sequence[gguf_io.GGUFHeader]) -> dict:
    """The manifest's ``model`` object: architecture, layer counts, tied embeddings, tensor
    count, GGUF version and the metadata's sha256 (read from the headers)."""
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
        "n_layer": n_layer_of(block_count, nextn, arch, names),
        "tied_embeddings": "output.weight" not in names and "token_embd.weight" in names,
        "n_tensors": len(names),
        "gguf_version": first.version,
        "metadata_sha256": metadata_sha256(first),
    }


def layer_costs(path: str | os.PathLike) -> tuple[list[float], float]:
    """Each trunk layer's cost per token and the output head's, in weights multiplied
    (``dgr.protocol.ranges.balance_layers``' inputs), read from the GGUF's headers: the
    elements of a layer's matrices (a mixture of experts' expert tensors scaled by the
    experts used per token over the experts), and of ``output.weight`` (``token_embd.weight``
    where the head is tied). Norms, biases and the embedding lookup count for nothing."""
    heads = [gguf_io.read_header(f, decode_arrays=False) for f in gguf_io.model_files(path)]
    facts = model_facts(heads)
    n_layer = facts["n_layer"]
    first = heads[0]
    used, experts = first.arch_int("expert_used_count", 0), first.arch_int("expert_count", 0)
    costs = [0.0] * n_layer
    head = 0.0
    tensors = {t.name: t for h in heads for t in h.tensors}
    for name, t in tensors.items():
        if len(t.shape) < 2:
            continue
        elems = 1.0
        for d in t.shape:
            elems *= d
        m = _BLK.match(name)
        if m:
            i = int(m.group(1))
            if i < n_layer:
                costs[i] += elems * (used / experts if "_exps" in name and experts else 1.0)
        elif name == "output.weight":
            head = elems
    if not head and "token_embd.weight" in tensors:
        t = tensors["token_embd.weight"]
        head = float(t.shape[0]) * float(t.shape[1])
    return costs, head


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
    heads = model_headers(paths)
    facts = model_facts(heads)
    bar = Progress(sum(h.file_size for h in heads), "manifest", progress)
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
               bar: "Progress") -> tuple[dict, list[dict]]:
    """One pass over a file: whole-file, per-chunk, header and per-tensor hashes.

    The whole-file and the per-tensor digests each run in their own single-thread pool (FIFO,
    so each digest sees its blocks in order) while this thread reads the next block and does
    the chunk digests: hashlib releases the GIL on large buffers, so the three overlap.
    """
    file_pool, tensor_pool = pools
    size = h.file_size
    order = sorted(h.tensors, key=lambda t: t.offset)
    thash = {t.name: hasher(tensor_alg) for t in order}
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

    bufs = [bytearray(BLOCK), bytearray(BLOCK)]
    busy: list[list] = [[], []]
    with open(h.path, "rb") as f:
        pos, i = 0, 0
        chunk_h = hashlib.sha256()
        while pos < size:
            b = i & 1
            for fut in busy[b]:  # the buffer is free once both digests consumed it
                fut.result()
            n = min(BLOCK, size - pos, chunk_size - pos % chunk_size)
            view = memoryview(bufs[b])[:n]
            got = f.readinto(view)
            if got != n:
                raise ArtifactTruncated(f"{h.path.name} shrank while being hashed (at byte {pos})")
            count_read(n)
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
    """Serialise a manifest (stable layout); write it atomically to ``out`` when given.

    Raises
    ------
    dgr.errors.StorageLocationError
        ``out`` lies under ``/home``, where no model artifact may be placed (nothing written).
    """
    text = json.dumps(data, indent=1) + "\n"
    if out is not None:
        atomic_write(check_production_path(out, what="a manifest"), text.encode())
    return text
