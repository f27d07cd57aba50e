"""The bytes of model artifacts, shared by manifests, verification, the journal and slices:
the hash algorithms, the read block size, the count of bytes read, atomic file writes, and
the read-modify-write of the JSON tables under ``$DGR_CACHE`` that several processes share."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from dgr.errors import InvalidManifest

__all__ = ["TENSOR_HASHES", "BLOCK", "COUNTERS", "count_read", "hasher", "atomic_write",
           "atomic_file", "read_json", "update_json"]

TENSOR_HASHES = ("sha256", "xxh3_128")
BLOCK = 4 << 20          # read size inside a chunk

#: bytes read from artifacts by this process (manifest, verify, slice); tests watch it
COUNTERS = {"bytes_read": 0}
_counter_lock = threading.Lock()


def count_read(n: int) -> None:
    """Add ``n`` bytes read from an artifact to ``COUNTERS["bytes_read"]``."""
    with _counter_lock:
        COUNTERS["bytes_read"] += n


def hasher(alg: str):
    """A new hash object of ``alg`` (one of ``TENSOR_HASHES``)."""
    if alg == "sha256":
        return hashlib.sha256()
    if alg == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    raise InvalidManifest(f"unknown hash algorithm {alg!r} (known: {', '.join(TENSOR_HASHES)})")


def atomic_write(path: Path, raw: bytes) -> None:
    """Write ``raw`` to ``path`` atomically (``atomic_file``)."""
    with atomic_file(path) as f:
        f.write(raw)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new bytes into, atomically: they go to a temporary
    name beside it (``.<name>.<pid>.<thread>.tmp``); when the block ends they are flushed,
    fsynced and renamed over ``path``, then the directory is fsynced. A reader sees the old
    bytes or the new, never a part. If the block raises, the temporary file is removed and
    ``path`` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
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


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; ``{}`` where it is missing, unreadable or not an object."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


_update_lock = threading.Lock()


def update_json(path: Path, update: Callable[[dict], dict]) -> dict:
    """Read the JSON object in ``path`` (``read_json``), pass it to ``update``, and write what
    that returns atomically, all under an exclusive ``flock`` of ``<path>.lock``: several
    processes (the workers of one machine, starting together) may update the same table and
    none loses another's entries. Returns the table written.

    Raises
    ------
    OSError
        The lock or the file cannot be written (a read-only cache).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _update_lock, open(path.with_name(path.name + ".lock"), "a") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)
        try:
            table = update(read_json(path))
            atomic_write(path, json.dumps(table, indent=0).encode())
            return table
        finally:
            fcntl.flock(lf, fcntl.LOCK_UN)
