"""Decode tokens/s of k sessions: each stepped alone, one by one, vs one forward_batch per step.

    python benches/batch_decode.py [--sessions 1,4,16] [--threads 2] [--steps 32] [--rounds 3]

The whole SmolLM2 (the registry's default model) in one engine with 16 slots. Each of k
sessions gets a 16-token seeded prompt (computed alone, not timed), then ``--steps``
greedy decode steps are timed two ways: ``solo`` runs one ``forward`` per session per step,
the sessions one after another; ``batch`` runs one ``forward_batch`` of k tokens per step.
Prints the median over rounds of the aggregate decode tokens/s (k * steps / seconds) and
the batch/solo ratio; ``gapped`` is the batch on slots 0, 2, 4, ... (for k <= 8): llama.cpp's
equal split puts only consecutive slot ids in one ubatch, so it computes one ubatch per
session. ``--json`` also writes them.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np


from harness import cli
from harness.common import prompt_tokens, smollm2_path

N_SLOTS = 16
N_PROMPT = 16


def _prefill(eng, k: int, stride: int = 1) -> list[int]:
    """Prefill k sessions alone (on slots 0, stride, 2 * stride, ...); the greedy first
    decode token of each."""
    first = []
    for j in range(k):
        eng.release(j * stride)
        logits = eng.forward(j * stride, 0, prompt_tokens(N_PROMPT, eng.n_vocab, seed=1234 + j))
        first.append(int(logits[0].argmax()))
    return first


def _solo(eng, k: int, steps: int) -> float:
    tok = _prefill(eng, k)
    t0 = time.perf_counter()
    for i in range(steps):
        for j in range(k):
            tok[j] = int(eng.forward(j, N_PROMPT + i, [tok[j]])[0].argmax())
    return k * steps / (time.perf_counter() - t0)


def _batch(eng, k: int, steps: int, stride: int = 1) -> float:
    tok = np.array(_prefill(eng, k, stride), np.int32)
    slots = np.arange(k, dtype=np.int32) * stride
    out = np.empty((k, eng.output_width), np.float32)
    t0 = time.perf_counter()
    for i in range(steps):
        pos = np.full(k, N_PROMPT + i, np.int32)
        logits = eng.forward_batch(slots, pos, tok, out=out)
        tok = logits.argmax(1).astype(np.int32)
    return k * steps / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = cli.parser(__doc__, rounds=3, json=True)
    ap.add_argument("--sessions", default="1,4,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)
    import dgr

    eng = dgr.Engine(smollm2_path(), n_ctx=N_PROMPT + args.steps + 8, n_slots=N_SLOTS,
                     n_threads=args.threads, n_ubatch=64)
    _solo(eng, 1, 4)  # warm-up (page in the weights), not reported
    rows = []
    print(f"SmolLM2 whole model, n_threads={args.threads}, {args.steps} decode steps, "
          f"median of {args.rounds} rounds")
    print(f"{'sessions':>8} {'solo tok/s':>11} {'batch tok/s':>12} {'batch/solo':>10} "
          f"{'gapped tok/s':>12}")
    for k in (int(x) for x in args.sessions.split(",")):
        solo, batch, gapped = [], [], []
        for _ in range(args.rounds):
            solo.append(_solo(eng, k, args.steps))
            batch.append(_batch(eng, k, args.steps))
            if 1 < k <= N_SLOTS // 2:
                gapped.append(_batch(eng, k, args.steps, stride=2))
        s, b = statistics.median(solo), statistics.median(batch)
        g = statistics.median(gapped) if gapped else None
        rows.append({"sessions": k, "solo_tps": s, "batch_tps": b, "ratio": b / s,
                     "gapped_tps": g, "solo_rounds": solo, "batch_rounds": batch,
                     "gapped_rounds": gapped})
        gs = "-" if g is None else f"{g:.1f}"
        print(f"{k:>8} {s:>11.1f} {b:>12.1f} {b / s:>10.2f} {gs:>12}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "steps": args.steps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
