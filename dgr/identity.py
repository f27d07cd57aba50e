"""Model identity: a content hash of the GGUF a process serves, cached by path, size and mtime."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from .vendor import cache_root

__all__ = ["model_identity"]

_lock = threading.Lock()


def _cache_file() -> Path:
    return cache_root() / "identity-cache.json"


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def model_identity(path: str | os.PathLike) -> str:
    """``sha256:<hex>`` of the model file's bytes (metadata and tensor data).

    Hashing a large model takes a while, so the result is cached under ``$DGR_CACHE`` keyed by
    the resolved path, size and modification time: a worker restart does not rehash.
    """
    p = Path(path).resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    cache = _cache_file()
    with _lock:
        try:
            table = json.loads(cache.read_text())
        except (OSError, ValueError):
            table = {}
        if key in table:
            return table[key]
        ident = "sha256:" + _file_sha256(p)
        table = {k: v for k, v in table.items() if not k.startswith(f"{p}|")}
        table[key] = ident
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=0))
            tmp.replace(cache)
        except OSError:
            pass  # a read-only cache only costs a rehash next time
        return ident
