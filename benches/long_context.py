"""Exactness and memory at long context: a prompt of ``--tokens`` (default 131072) through 3
stages against the whole model, bit for bit, on a tiny llama trained for that context.

    python benches/long_context.py [--tokens 131072] [--kv f16] [--threads 2] [--json out.json]

The test suite checks 32k (``tests/integration/test_long_context.py``); this is its 128k run,
too slow for the suite (attention over 128k cells, every row). It loads the whole model and
the stages ``[0, 1) [1, 3) [3, 4)`` with ``n_ctx=0`` (each chooses the trained context),
prefills the prompt in each (the stages chained as a route chains them), and compares every
prompt row's logits (KV lengths 1 to the prompt's), then ``--steps`` greedy decode steps at
the far end. It reports each engine's KV bytes against its layer share of the whole model's,
the time of each prefill, and the CPU. Nothing is timed against a goal here: the figures go to
docs/performance.md "Long context".
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np
from harness import cli

RANGES = [(0, 1), (1, 3), (3, 4)]


def run(tokens: int, kv: str, threads: int, steps: int, ubatch: int) -> dict:
    from dgr.core.engine import Engine
    from dgr.testing.fixtures import TinyLlama, write_tiny_llama
    from dgr.vendor import cpu_features

    with tempfile.TemporaryDirectory() as d:
        path = write_tiny_llama(os.path.join(d, "tiny-long.gguf"),
                                TinyLlama(n_ctx_train=tokens, n_head=2, n_head_kv=1))
        settings = dict(n_ctx=0, n_slots=1, n_threads=threads, n_ubatch=ubatch, type_k=kv,
                        type_v=kv)
        prompt_len = tokens - ubatch  # room for the decode steps
        prompt = np.random.default_rng(7).integers(1, 128, prompt_len, dtype=np.int32)
        whole = Engine(path, **settings)
        t0 = time.perf_counter()
        want = np.array(whole.forward(0, 0, tokens=prompt, logits="all"), copy=True)
        whole_s = time.perf_counter() - t0
        chain = [Engine(path, layers=r, **settings) for r in RANGES]
        x, stage_s = None, []
        for e in chain:
            t0 = time.perf_counter()
            x = e.forward(0, 0, tokens=prompt if e.is_first else None, boundary=x,
                          **({"logits": "all"} if e.is_last else {}))
            stage_s.append(time.perf_counter() - t0)
        same = np.all(want == x, axis=1)
        rows_equal = bool(same.all())
        first_diff = None if rows_equal else int(np.argmin(same))
        # greedy decode steps at the far end, the whole model and the chain side by side
        tok, pos, decode_equal = int(np.argmax(want[-1])), prompt_len, rows_equal
        for _ in range(steps):
            w = whole.forward(0, pos, tokens=[tok])[-1]
            y = None
            for e in chain:
                y = e.forward(0, pos, tokens=[tok] if e.is_first else None, boundary=y)
            decode_equal = decode_equal and w.tobytes() == y[-1].tobytes()
            tok, pos = int(np.argmax(w)), pos + 1
        n_layer = whole.n_layer
        wkv = int(whole.describe()["kv_bytes"])
        stages = []
        for (a, b), e, s in zip(RANGES, chain, stage_s):
            kvb = int(e.describe()["kv_bytes"])
            share = wkv * (b - a) / n_layer
            stages.append({"layers": [a, b], "n_ctx": e.n_ctx, "kv_bytes": kvb,
                           "kv_share_ratio": kvb / share, "prefill_s": s})
        return {"tokens": tokens, "prompt_tokens": prompt_len, "kv": kv, "threads": threads,
                "n_ubatch": ubatch, "cpu": cpu_features()[0], "cores": os.cpu_count(),
                "whole_n_ctx": whole.n_ctx, "whole_kv_bytes": wkv, "whole_prefill_s": whole_s,
                "prompt_rows_bit_identical": rows_equal, "first_differing_row": first_diff,
                "decode_steps": steps, "decode_bit_identical": decode_equal,
                "stages": stages}


def main(argv=None) -> int:
    ap = cli.parser(__doc__, json=True)
    ap.add_argument("--tokens", type=int, default=131072, help="trained context and KV length")
    ap.add_argument("--kv", default="f16", help="KV cache type (type_k and type_v)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="decode steps at the far end")
    ap.add_argument("--ubatch", type=int, default=512)
    a = ap.parse_args(argv)
    rec = run(a.tokens, a.kv, a.threads, a.steps, a.ubatch)
    print(json.dumps(rec, indent=2))
    cli.write_json(a.json, rec, indent=2)
    return 0 if rec["prompt_rows_bit_identical"] and rec["decode_bit_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
