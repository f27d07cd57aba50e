"""Model identity: a content hash of the GGUF model a process serves, cached by path and mtime.

The identity names the model, not the artifact layout a worker happens to hold:

- a one-file model: ``sha256:<hex>`` of the file's bytes (what ``sha256sum`` prints);
- a split model (``name-0000k-of-0000N.gguf``): ``sha256:<hex>`` of the text made of each
  file's sha256 hex digest followed by a newline, in split order; i.e.
  ``sha256sum name-*-of-*.gguf | cut -c1-64 | sha256sum``;
- a dgr slice: the identity of the model it was cut from (``dgr.slice.source_identity``),
  which the slice's tensors are checked against by ``dgr.artifacts.verify``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Sequence

from dgr.artifacts.storage import read_json, update_json
from dgr.vendor import cache_root, sha256_file

__all__ = ["model_identity", "split_identity", "file_sha256", "remember_file_sha256",
           "remember_verified"]


def _cache_file() -> Path:
    return cache_root() / "identity-cache.json"


def _key(p: Path) -> str:
    st = p.stat()
    return f"{p}|{st.st_size}|{st.st_mtime_ns}"


def _load() -> dict[str, str]:
    """The cache (its writes are atomic, and ``_store``'s are serialized: ``update_json``)."""
    return read_json(_cache_file())


def _store(updates: dict[str, str], drop_prefixes: Sequence[str] = ()) -> None:
    """Merge entries into the cache file (``update_json``: other processes' entries stay);
    best effort."""
    def merged(table: dict) -> dict:
        table = {k: v for k, v in table.items()
                 if not any(k.startswith(d) for d in drop_prefixes)}
        table.update(updates)
        return table

    try:
        update_json(_cache_file(), merged)
    except OSError:
        pass  # a read-only cache only costs a rehash next time


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 hex digest of one file, cached under ``$DGR_CACHE`` by path, size and mtime."""
    p = Path(path).resolve()
    key = _key(p)
    hit = _load().get(key)
    if hit and hit.startswith("sha256:"):
        return hit[7:]
    hexd = sha256_file(p)
    _store({key: "sha256:" + hexd}, drop_prefixes=(f"{p}|",))
    return hexd


def remember_file_sha256(path: str | os.PathLike, hexdigest: str) -> None:
    """Cache a digest computed elsewhere (``dgr.artifacts.manifest.build_manifest`` hashes
    every file)."""
    p = Path(path).resolve()
    _store({_key(p): "sha256:" + hexdigest}, drop_prefixes=(f"{p}|",))


def split_identity(file_sha256s: Sequence[str]) -> str:
    """Identity of a split model from its files' sha256 hex digests in split order."""
    text = "".join(f"{h}\n" for h in file_sha256s)
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()


def _verified_key(files: Sequence[Path]) -> str:
    return "verified:" + ";".join(_key(f) for f in files)


def remember_verified(files: Sequence[str | os.PathLike], identity: str) -> None:
    """Record that ``files`` (as they are now: size and mtime) were verified to be ``identity``.

    ``dgr.artifacts.verify`` calls this after a successful check against a manifest, so that
    ``model_identity`` of the same, unchanged files answers without hashing them.
    """
    paths = [Path(f).resolve() for f in files]
    _store({_verified_key(paths): identity}, drop_prefixes=(f"verified:{paths[0]}|",))


def model_identity(path: str | os.PathLike) -> str:
    """The identity of the model at ``path`` (see the module docstring for the definition).

    ``path`` is a one-file model, any file of a split model, or a dgr slice. Hashing a large
    model takes a while, so per-file digests are cached under ``$DGR_CACHE`` keyed by the
    resolved path, size and modification time, and files verified against a manifest
    (``dgr.artifacts.verify.verify_for_worker``) are remembered: a worker restart does not
    rehash.

    Raises
    ------
    dgr.errors.ArtifactMissing
        A split of a split model is missing.
    """
    from dgr.artifacts import gguf as gguf_io
    from dgr.errors import ArtifactMissing, InvalidModel

    p = Path(path).resolve()
    try:
        head = gguf_io.read_header(p, decode_arrays=False)
    except InvalidModel:
        head = None  # not GGUF: still a file with a content hash
    if head is not None and head.slice_range is not None:
        src = head.kv.get("dgr.slice.source_identity")
        if isinstance(src, str) and src.startswith("sha256:"):
            return src
        raise InvalidModel(f"{p} is a dgr slice without a valid dgr.slice.source_identity")
    files = [p]
    if head is not None and head.split_count > 1:
        files = [f.resolve() for f in gguf_io.model_files(p)]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ArtifactMissing(f"split model {files[0].name} is missing "
                                  f"{', '.join(missing)} (in {files[0].parent})")
    hit = _load().get(_verified_key(files))
    if hit:
        return hit
    if len(files) == 1:
        return "sha256:" + file_sha256(p)
    return split_identity([file_sha256(f) for f in files])
