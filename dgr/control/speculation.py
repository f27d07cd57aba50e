"""Whether a speculative trip's rows are plain decoding's rows, measured on this build for one
model and its settings (the lane's ``speculation`` record, ``dgr certify``;
docs/speculative.md).

Speculative decoding verifies ``k`` drafts in one step of ``k + 1`` tokens and rolls back what
was rejected (``Engine.truncate``). Its tokens equal plain decoding's exactly when each of
those rows is bit-identical to the row a single-token step computes at that position.
``measure`` teacher-forces one sequence through a whole-model engine both ways: one token a
step, and trips of ``k + 1`` tokens where the first ``a + 1`` are kept and the rest rolled
back (``a`` cycling through ``0..k``, so every row position of a trip and every rollback
depth is exercised), and compares every row computed at a kept position: the largest
absolute difference, whether all are bit-identical, and the fraction whose top-1 token
agrees. It is measured, never assumed (ggml's CPU kernels decide: docs/batching.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SpeculationMeasure", "measure"]


@dataclass(frozen=True)
class SpeculationMeasure:
    prompt_tokens: int
    max_draft: int
    trips: int
    rows: int
    bit_identical: bool
    max_abs_diff: float
    top1_agreement: float


def measure(engine, *, prompt_tokens: int = 24, decode_tokens: int = 32, max_draft: int = 4,
            slot: int = 0, seed: int = 1234, far: int = 0) -> SpeculationMeasure:
    """Trips of ``max_draft + 1`` tokens with rollbacks against single-token steps on
    ``engine`` (a whole-model ``dgr.Engine`` with room for ``far + prompt_tokens +
    decode_tokens + max_draft`` tokens in ``slot``), which is released before and after.
    With ``far``, measured twice: with a prompt of ``prompt_tokens``, and again with ``far``
    more positions before it, since kernels may switch with the KV's length (ggml's CPU flash
    attention splits a lone row's KV of 512 cells or more over the threads, never a trip's);
    the figures cover both."""
    if not (engine.is_first and engine.is_last):
        raise ValueError("measure needs a whole-model engine (logits from token ids)")
    k = int(max_draft)
    if k < 1:
        raise ValueError(f"max_draft must be >= 1, got {max_draft}")
    rng = np.random.default_rng(seed)
    lo = 100 if engine.n_vocab > 1000 else 0
    seq = rng.integers(lo, engine.n_vocab, size=max(far, 0) + prompt_tokens + decode_tokens + k,
                       dtype=np.int32)
    plain, spec, trips = {}, {}, 0
    for n0 in sorted({prompt_tokens, prompt_tokens + max(far, 0)}):
        trips += _measure(engine, seq, n0, n0 + decode_tokens, k, slot, plain, spec)
    rows = sorted(plain)
    diffs = [float(np.max(np.abs(plain[q] - spec[q]))) for q in rows]
    same = all(plain[q].tobytes() == spec[q].tobytes() for q in rows)
    top1 = float(np.mean([int(np.argmax(plain[q])) == int(np.argmax(spec[q])) for q in rows]))
    return SpeculationMeasure(prompt_tokens=prompt_tokens, max_draft=k, trips=trips,
                              rows=len(rows), bit_identical=same, max_abs_diff=max(diffs),
                              top1_agreement=top1)


def _measure(engine, seq, n0: int, end: int, k: int, slot: int, plain: dict, spec: dict) -> int:
    """Positions ``[n0, end)`` of ``seq`` after its first ``n0``, one token a step into
    ``plain`` and in trips into ``spec`` (keyed by ``(n0, position)``); the trips made."""
    engine.release(slot)
    engine.forward(slot, 0, seq[:n0])
    for p in range(n0, end):
        plain[n0, p] = engine.forward(slot, p, seq[p:p + 1]).copy()[0]
    engine.release(slot)
    engine.forward(slot, 0, seq[:n0])
    p, trips, a = n0, 0, 0
    while p < end:
        out = engine.forward(slot, p, seq[p:p + k + 1], logits="all").copy()
        trips += 1
        keep = min(a + 1, end - p)  # the token and the drafts accepted, as a trip keeps them
        for i in range(keep):
            spec[n0, p + i] = out[i]
        p += keep
        engine.truncate(slot, p)  # the rejected drafts
        a = (a + 1) % (k + 1)
    engine.release(slot)
    return trips
