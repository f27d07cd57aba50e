"""What splitting costs in compute alone: the whole model vs its ranges, in one process.

    python benches/split_compute.py [--stages 3] [--rounds 9] [--tokens 64]

No transport and no other process: per decode token, the whole model's ``forward`` against
the sum of the range engines' ``forward`` calls, run back to back in each round (the same
thread, the same settings as the workers). Prints the per-round figures and the medians of
the sum minus the whole; what is left of a route's overhead is the seam (transport and
Python around each step).
"""

from __future__ import annotations

import os
import statistics
import sys
import time


from harness import cli
from harness.common import SETTINGS, smollm2_path


def _decode_ms(step, n_tokens: int) -> float:
    ts = []
    for p in range(16, 16 + n_tokens):
        t = time.perf_counter()
        step(p)
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def main(argv=None) -> int:
    ap = cli.parser(__doc__, stages=3, rounds=9)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per round")
    args = ap.parse_args(argv)

    import dgr
    from dgr.protocol.ranges import split_layers

    path = smollm2_path()
    settings = {**SETTINGS, "n_slots": 1}
    whole = dgr.Engine(path, **settings)
    parts = [dgr.Engine(path, layers=r, **settings)
             for r in split_layers(whole.n_layer, args.stages)]
    prompt = list(range(1, 17))

    def whole_step(p):
        whole.forward(0, p, [5])

    def parts_step(p):
        b = parts[0].forward(0, p, [5])
        for e in parts[1:]:
            b = e.forward(0, p, boundary=b)

    rows = []
    for r in range(args.rounds):
        whole.release(0)
        whole.forward(0, 0, prompt)
        w = _decode_ms(whole_step, args.tokens)
        for e in parts:
            e.release(0)
        b = parts[0].forward(0, 0, prompt)
        for e in parts[1:]:
            b = e.forward(0, 0, boundary=b)
        s = _decode_ms(parts_step, args.tokens)
        rows.append((w, s))
        print(f"round {r + 1}: whole {w:.2f} ms/token, {args.stages} ranges {s:.2f} "
              f"(+{s - w:.2f})", flush=True)
    extra = [s - w for w, s in rows]
    print(f"\nmedian whole {statistics.median(w for w, _ in rows):.2f} ms/token; "
          f"{args.stages} ranges {statistics.median(s for _, s in rows):.2f}; extra compute of "
          f"the split: median {statistics.median(extra):+.2f} ms/token "
          f"(rounds {min(extra):+.2f} .. {max(extra):+.2f}); load average "
          f"{os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
