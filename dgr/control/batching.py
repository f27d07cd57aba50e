"""Whether a session's rows computed in one forward with other sessions' rows are its rows
computed alone, measured on this build for one model and its settings (the lane's
``batching`` record, ``dgr certify``; docs/batching.md).

``measure`` runs ``sessions`` teacher-forced sessions through one engine two ways with the
same inputs: alone (each prompt in one ``forward``, then one ``forward`` per decode token, the
sessions one after another) and as the stage loop batches them (the prompts, each under
``dgr.worker.scheduler.SOLO_ROWS`` tokens, in one ``forward_batch``, then one ``forward_batch``
of every session's token per decode step). It compares every logits row: the largest
absolute difference, whether all rows are bit-identical, and the fraction whose top-1 token
agrees. ggml's CPU kernels decide the answer (benches/batch_exactness.py maps it: quantized
weights at one thread are bit-identical; f32/f16 weights, and a lone sequence's decode past
512 KV cells at two threads or more, are not), so it is measured, never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["BatchingMeasure", "measure"]


@dataclass(frozen=True)
class BatchingMeasure:
    sessions: int
    prompt_tokens: list[int]
    decode_steps: int
    rows: int
    bit_identical: bool
    max_abs_diff: float
    top1_agreement: float


def _prompts(k: int, n_vocab: int, steps: int, longest: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lo = 100 if n_vocab > 1000 else 0
    lens = [max(2, longest - 7 * j) for j in range(k)]
    return [rng.integers(lo, n_vocab, size=n + steps, dtype=np.int32) for n in lens]


def measure(engine, *, sessions: int = 4, decode_steps: int = 8, longest_prompt: int = 40,
            seed: int = 1234, far: int = 0) -> BatchingMeasure:
    """Batched against alone on ``engine`` (a whole-model ``dgr.Engine`` with at least
    ``sessions`` slots, each with room for ``far + longest_prompt + decode_steps`` tokens);
    its slots ``[0, sessions)`` are released before and after. With ``far``, measured twice:
    from position 0, and again after a shared prefix of ``far`` positions (prefilled once and
    copied to every session's slot where the engine copies), since kernels may switch with
    the KV's length (ggml's CPU flash attention splits a lone row's KV of 512 cells or more
    over the threads); the figures cover both."""
    if not (engine.is_first and engine.is_last):
        raise ValueError("measure needs a whole-model engine (logits from token ids)")
    k = int(sessions)
    if engine.n_slots < k:
        raise ValueError(f"{k} sessions need {k} slots; the engine has {engine.n_slots}")
    seqs = _prompts(k, int(engine.n_vocab), decode_steps, longest_prompt, seed)
    n_prompt = [len(s) - decode_steps for s in seqs]
    lo = 100 if engine.n_vocab > 1000 else 0
    prefix = np.random.default_rng(seed + 1).integers(lo, engine.n_vocab, size=max(far, 0),
                                                      dtype=np.int32)
    solo, batched = [], []
    for start in sorted({0, max(far, 0)}):
        a, b = _measure(engine, k, seqs, n_prompt, decode_steps, prefix[:start])
        solo.append(a)
        batched.append(b)
    a, b = np.concatenate(solo), np.concatenate(batched)
    return BatchingMeasure(sessions=k, prompt_tokens=n_prompt, decode_steps=decode_steps,
                           rows=len(a), bit_identical=bool(np.array_equal(a, b)),
                           max_abs_diff=float(np.max(np.abs(a - b))),
                           top1_agreement=float(np.mean(a.argmax(1) == b.argmax(1))))


def _measure(engine, k: int, seqs, n_prompt, decode_steps: int, prefix: np.ndarray):
    """Every session's logits rows alone and batched, after ``prefix`` in every slot."""
    start = len(prefix)

    def release():
        for j in range(k):
            engine.release(j)
        if not start:
            return
        engine.forward(0, 0, prefix)
        for j in range(1, k):
            try:
                engine.copy_slot(0, j)
            except Exception:  # noqa: BLE001 - an engine without copies: prefilled again
                engine.forward(j, 0, prefix)

    release()
    solo = [[] for _ in range(k)]
    for j, s in enumerate(seqs):
        solo[j].append(engine.forward(j, start, s[:n_prompt[j]]).copy()[-1])
        for i in range(decode_steps):
            p = n_prompt[j] + i
            solo[j].append(engine.forward(j, start + p, s[p:p + 1]).copy()[0])
    release()
    batched = [[] for _ in range(k)]
    slots = np.concatenate([np.full(n, j, np.int32) for j, n in enumerate(n_prompt)])
    pos = np.concatenate([np.arange(start, start + n, dtype=np.int32) for n in n_prompt])
    out = engine.forward_batch(slots, pos, np.concatenate([s[:n] for s, n in zip(seqs, n_prompt)]))
    for j in range(k):
        batched[j].append(out[j].copy())
    one = np.arange(k, dtype=np.int32)
    for i in range(decode_steps):
        p = np.array([n + i for n in n_prompt], np.int32)
        out = engine.forward_batch(one, start + p,
                                   np.array([s[q] for s, q in zip(seqs, p)], np.int32))
        for j in range(k):
            batched[j].append(out[j].copy())
    for j in range(k):
        engine.release(j)
    return (np.stack([r for rows in solo for r in rows]),
            np.stack([r for rows in batched for r in rows]))
