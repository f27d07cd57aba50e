"""What a pause between forwards costs the next forward's compute, on this machine.

    python benches/compute_gap.py [--layers 0,19] [--gaps 0,2,5,10] [--rounds 2] [--tokens 64]

One engine (a stage's range, or the whole model with ``--layers all``; the workers' settings),
in one process and nothing else running: decode steps of one slot back to back, then with a
pause of G ms after each, sleeping or spinning (a Python loop that touches no memory). Prints
the median ms per step for each gap and way, per round.

In a route a stage pauses between its steps while the others compute theirs: at one session
each stage of two waits about as long as it computes. Where a pause alone makes the next
forward slower (measured on a 2-core Sapphire Rapids VM: 2.6-2.8 ms back to back, 4.2-4.3
after 10 ms, the same whether the thread slept or spun), that is what the stages' engines lose
in a route against the same engine driven back to back, and no transport can win it back.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from harness import cli
from harness.common import SETTINGS, smollm2_path

PROMPT = 16


def step_ms(engine, gap_s: float, spin: bool, n_tokens: int) -> float:
    """Median ms of ``n_tokens`` decode steps of slot 0, each followed by a pause of
    ``gap_s`` (``time.sleep``, or a busy loop when ``spin``)."""
    width, first = engine.n_embd_boundary, engine.is_first
    engine.release(0)
    if first:
        engine.forward(0, 0, tokens=np.arange(1, PROMPT + 1, dtype=np.int32))
    else:  # a later range: a boundary in (its values do not change the cost)
        engine.forward(0, 0, boundary=np.zeros((PROMPT, width), np.float32))
    ts = []
    for i in range(n_tokens):
        tok = np.array([5 + i % 50], np.int32)
        bnd = None if first else np.zeros((1, width), np.float32)
        t0 = time.perf_counter()
        engine.forward(0, PROMPT + i, tokens=tok if first else None, boundary=bnd)
        ts.append(time.perf_counter() - t0)
        if spin:
            t1 = time.perf_counter()
            while time.perf_counter() - t1 < gap_s:
                pass
        elif gap_s:
            time.sleep(gap_s)
    return 1e3 * statistics.median(ts)


def main(argv=None) -> int:
    ap = cli.parser(__doc__, rounds=2)
    ap.add_argument("--layers", default="0,19",
                    help="the engine's range A,B, or all (default 0,19: the first of two stages "
                         "of benches/batching.py's cost split)")
    ap.add_argument("--gaps", default="0,2,5,10", help="pauses in ms (default 0,2,5,10)")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per measurement")
    args = ap.parse_args(argv)

    import dgr

    layers = None if args.layers == "all" else tuple(cli.counts(args.layers))
    gaps = [float(g) for g in args.gaps.split(",")]
    engine = dgr.Engine(smollm2_path(), layers=layers, **{**SETTINGS, "n_slots": 1})
    print(f"layers {args.layers}, settings {SETTINGS}; median ms per decode step")
    print("| round | way | " + " | ".join(f"gap {g:g} ms" for g in gaps) + " |")
    print("|---:|---|" + "---:|" * len(gaps))
    for r in range(args.rounds):
        for spin in (False, True):
            row = [step_ms(engine, g / 1e3, spin, args.tokens) for g in gaps]
            print(f"| {r + 1} | {'spin' if spin else 'sleep'} | "
                  + " | ".join(f"{v:.2f}" for v in row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
