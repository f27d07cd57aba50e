"""The names of a prompt's first positions in the stages' prefix stores: a hash chain.

``chain(tokens, chunk, salt)`` gives one key per whole ``chunk`` of ``tokens`` from position 0:
key ``i`` is SHA-256 over key ``i - 1`` (or, for the first, over ``salt``) and chunk ``i``'s
token ids, so it names all of positions ``0 .. (i + 1) * chunk - 1``, and two prompts share key
``i`` only when they share those tokens. ``rows`` more keys name the positions after the whole
chunks one token at a time (rows computed in partial chunks or one per step, which a later
prompt may keep where every stage computes them as a partial chunk does); they are hashed apart
from whole chunks' keys, so a chain of whole chunks never matches rows. The driver salts the
chain with what else the cached rows depend on: the route's stage identities (model, numeric
settings, device kinds), the chunk size, and the tenant, so one tenant's keys never name
another's entries (each stage also keeps an entry for the credential that stored it only). The
stage compares keys and never sees the tokens (``SessionTable.keep`` and ``adopt``).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

__all__ = ["chain", "salt", "end_of"]

#: bytes of each key (a truncated SHA-256: collisions are as likely as a 128-bit hash's)
KEY_BYTES = 16


def salt(identities: Sequence[str], chunk: int, tenant: str | None) -> bytes:
    """The chain's first input: the route's stage identities, the chunk size and the tenant
    (None and "" are the same tenant: no API keys)."""
    parts = ["dgr-prefix-v1", str(int(chunk)), tenant or "", *identities]
    return hashlib.sha256("\x00".join(parts).encode()).digest()


def chain(tokens: Sequence[int], chunk: int, seed: bytes, n: int | None = None,
          rows: int = 0) -> list[bytes]:
    """The keys of ``tokens``' first ``n`` whole chunks of ``chunk`` tokens (all by default)
    from position 0, chained from ``seed`` (``salt``), then of the next ``rows`` tokens one
    each (as many as there are)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    arr = np.asarray(tokens, dtype="<i4").reshape(-1)
    whole = len(arr) // chunk if n is None else min(n, len(arr) // chunk)
    out, h = [], seed
    for i in range(whole):
        h = hashlib.sha256(h + b"C" + arr[i * chunk:(i + 1) * chunk].tobytes()).digest()
        out.append(h[:KEY_BYTES])
    for t in arr[whole * chunk:whole * chunk + max(rows, 0)]:
        h = hashlib.sha256(h + b"R" + t.tobytes()).digest()
        out.append(h[:KEY_BYTES])
    return out


def end_of(i: int, whole: int, chunk: int) -> int:
    """The positions key ``i`` of a chain of ``whole`` whole chunks' keys (then rows' keys)
    names: ``0 .. end_of - 1``."""
    return (i + 1) * chunk if i < whole else whole * chunk + (i - whole + 1)
