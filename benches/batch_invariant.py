"""What the batch-invariant kernels cost and what they give: the whole model with and without
``batch_invariant`` (ggml's CPU reference kernels), side by side in one run.

    python benches/batch_invariant.py [--threads 1,2] [--context 1536] [--decode 32]
                                      [--rounds 3] [--model M.gguf] [--json out.json]

For each thread count and each setting, one engine (``n_ubatch`` 64, flash attention, f16 KV)
prefills ``--context`` tokens in whole chunks (prompt tokens/s), then decodes ``--decode``
single-token steps at that context (ms per token); figures are medians over ``--rounds``. Then
the checks a worker runs before it serves (``dgr.control.prefix``: partial chunks' rows, rows
one per step, a whole chunk's rows; each from position 0 and 1024 in) and the lane's
batching and speculation checks (``dgr.control.batching`` / ``speculation``, from position
0 and 1024 in) say which rows are alike: with the invariant kernels every one, so prompt
caches keep every shared row and batched sessions and speculation give the whole model's
rows at any context length (docs/batching.md "Exactness").
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from harness import cli


def _time(engine, tokens: np.ndarray, decode: int) -> tuple[float, float]:
    """(prefill tokens/s, decode ms per token at the context) in slot 0."""
    engine.release(0)
    t = time.perf_counter()
    engine.forward(0, 0, tokens[:-decode])
    pp = (len(tokens) - decode) / (time.perf_counter() - t)
    t = time.perf_counter()
    for p in range(len(tokens) - decode, len(tokens)):
        engine.forward(0, p, tokens[p:p + 1])
    tg = 1e3 * (time.perf_counter() - t) / decode
    engine.release(0)
    return pp, tg


def main(argv=None) -> int:
    ap = cli.parser(__doc__, rounds=3, json=True)
    ap.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    ap.add_argument("--context", type=int, default=1536,
                    help="tokens prefilled before the decode steps (default 1536)")
    ap.add_argument("--decode", type=int, default=32, help="decode steps timed (default 32)")
    ap.add_argument("--model", help="GGUF (default: the registry's default model)")
    args = ap.parse_args(argv)
    import dgr
    from dgr.artifacts import models
    from dgr.control import batching, prefix, speculation

    model = args.model or str(models.path(models.DEFAULT_MODEL))
    n_ctx = max(2048, args.context + args.decode + 64)
    rows = []
    for t in cli.counts(args.threads):
        engines = {bi: dgr.Engine(model, n_ctx=n_ctx, n_slots=4, n_threads=t, n_ubatch=64,
                                  batch_invariant=bi) for bi in (False, True)}
        tokens = np.random.default_rng(1).integers(
            100, engines[False].n_vocab, args.context + args.decode, dtype=np.int32)
        figs = {bi: [] for bi in engines}
        for _ in range(args.rounds):  # interleaved: both settings see the same machine
            for bi, e in engines.items():
                figs[bi].append(_time(e, tokens, args.decode))
        for bi, e in engines.items():
            row = {"threads": t, "batch_invariant": bi,
                   "prefill_tok_s": statistics.median(f[0] for f in figs[bi]),
                   "decode_ms": statistics.median(f[1] for f in figs[bi]),
                   "rows_exact": prefix.rows_exact(e),
                   "single_rows_exact": prefix.single_rows_exact(e),
                   "chunk_rows_exact": prefix.chunk_rows_exact(e),
                   "batched_exact": batching.measure(e, far=prefix.FAR).bit_identical,
                   "speculation_exact": speculation.measure(e, far=prefix.FAR).bit_identical}
            rows.append(row)
            print(row, flush=True)
    print("\n| threads | kernels | prefill tok/s | decode ms/token | partial rows | single rows | "
          "whole chunk rows | batched = alone | trips = steps |")
    print("|---:|---|---:|---:|---|---|---|---|---|")
    yes = {True: "alike", False: "differ"}
    for r in rows:
        print(f"| {r['threads']} | {'invariant' if r['batch_invariant'] else 'default'} | "
              f"{r['prefill_tok_s']:.1f} | {r['decode_ms']:.1f} | {yes[r['rows_exact']]} | "
              f"{yes[r['single_rows_exact']]} | {yes[r['chunk_rows_exact']]} | "
              f"{yes[r['batched_exact']]} | {yes[r['speculation_exact']]} |")
    by = {(r["threads"], r["batch_invariant"]): r for r in rows}
    for t in cli.counts(args.threads):
        d, i = by[t, False], by[t, True]
        print(f"{t} thread(s): invariant prefill {i['prefill_tok_s'] / d['prefill_tok_s']:.2f} x "
              f"default, decode {i['decode_ms'] / d['decode_ms']:.2f} x default's time")
    cli.write_json(args.json, {"model": model, "context": args.context,
                               "decode": args.decode, "rounds": args.rounds, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
