"""Pooling a prompt's embedding rows into one vector (``POST /v1/embeddings``; docs/serve.md
"Embeddings").

A route's last stage returns every row's final hidden state, after the model's output norm
(``Forward.want`` ``"embedding"``, llama.cpp's embeddings without its pooling: a stage sees a
chunk, not the prompt). The driver pools them here, the same code for a split route and for
the whole model, so the bits of a split are the whole model's:

- ``mean``: the mean of every row (float64 sums, in row order);
- ``last``: the last row (a causal model's summary: the token that saw the whole prompt);
- ``cls``: the first row.

``normalize`` scales the vector to unit Euclidean length (float64), as OpenAI's embeddings
are; the result is float32.
"""

from __future__ import annotations

import numpy as np

__all__ = ["POOLING", "pool"]

#: the pooling kinds, as ``--pooling`` and the GGUF's ``pooling_type`` name them
POOLING = ("mean", "last", "cls")


def pool(rows: np.ndarray, kind: str, *, normalize: bool = True) -> np.ndarray:
    """One float32 vector of ``rows`` (``[n_tokens, n_embd]``, at least one row)."""
    if kind not in POOLING:
        raise ValueError(f"unknown pooling {kind!r} (known: {', '.join(POOLING)})")
    rows = np.asarray(rows, dtype=np.float32)
    if rows.ndim != 2 or not rows.shape[0]:
        raise ValueError(f"pooling needs rows [n_tokens, n_embd], got shape {rows.shape}")
    if kind == "mean":
        v = rows.astype(np.float64).sum(axis=0) / rows.shape[0]
    elif kind == "last":
        v = rows[-1].astype(np.float64)
    else:
        v = rows[0].astype(np.float64)
    if normalize:
        norm = float(np.sqrt(np.dot(v, v)))
        if norm > 0:
            v = v / norm
    return v.astype(np.float32)
