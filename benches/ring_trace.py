"""How the stages of a decode-loop ring share the work of many sessions, from the workers'
traces: the size of each stage's forwards, and how many stages compute at the same time.

    python benches/ring_trace.py [--sessions 16] [--tokens 64] [--stages 3] [--no-ring-groups]

Starts ``--stages`` SmolLM2 workers on loopback (``benches/batching.py``'s settings, one
thread each), each with ``--trace``, runs k sessions at once over direct relay with the decode
loop (``AsyncRoute.complete``, a different 16-token prompt each, ``--tokens`` greedy tokens),
then reads the traces (docs/dataplane.md, "Tracing"):

- per stage, the number of its forwards of decode steps by how many steps each held (one
  ``batch`` id is one forward);
- the share of the run's time during which 0, 1, 2, ... stages computed at once (a forward's
  span: its end minus its compute time).

``--no-ring-groups`` starts the workers with the ring-group cap off (docs/batching.md,
"Keeping the ring busy"), for comparison. Not a test; prints its figures.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import sys
import tempfile
import time

from batching import SETTINGS
from harness import cli
from harness.clusters import route_ranges
from harness.common import session_prompt, smollm2_path


def batch_sizes(spans: list[dict], stage: int, since: float) -> dict[int, int]:
    """{steps in a forward: forwards} of ``stage``'s decode steps that arrived after
    ``since``."""
    by_batch: dict[int, int] = collections.Counter()
    for d in spans:
        if d["st"] == stage and d["n"] == 1 and d["arrive"] > since:
            by_batch[d["batch"]] += 1
    return dict(sorted(collections.Counter(by_batch.values()).items()))


def concurrency(spans: list[dict], since: float) -> dict[int, float]:
    """{stages computing at once: share of the time from the first forward's start to the
    last one's end}, from every forward after ``since`` (its steps' compute shares summed)."""
    forwards: dict[tuple[int, int], list[float]] = {}
    for d in spans:
        if d["arrive"] > since:
            f = forwards.setdefault((d["st"], d["batch"]), [d["compute_end"], 0.0])
            f[1] += d["compute_s"]
    events = sorted([(end - s, 1) for end, s in forwards.values()]
                    + [(end, -1) for end, _ in forwards.values()])
    if not events:
        return {}
    busy: dict[int, float] = collections.Counter()
    cur, last = 0, events[0][0]
    for t, delta in events:
        busy[cur] += t - last
        cur += delta
        last = t
    total = sum(busy.values()) or 1.0
    return {k: v / total for k, v in sorted(busy.items())}


def main(argv=None) -> int:
    ap = cli.parser(__doc__, stages=3)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-ring-groups", action="store_true")
    a = ap.parse_args(argv)

    import dgr
    from dgr.driver.route import AsyncRoute
    from dgr.worker.process import LocalCluster

    path = smollm2_path()
    n_layer = int(dgr.Engine(path, n_ctx=64, n_slots=1).describe()["n_layer"])
    tmp = tempfile.mkdtemp(prefix="dgr-ring-trace-")
    c = LocalCluster(path, route_ranges(n_layer, a.stages),
                     settings={**SETTINGS, "n_slots": a.sessions},
                     args=["--no-ring-groups"] if a.no_ring_groups else [])
    for i, w in enumerate(c.workers):
        w.args = [*w.args, "--trace", os.path.join(tmp, f"stage{i}.jsonl")]
    c.start(timeout=180)

    async def sessions() -> tuple[float, float]:
        async with AsyncRoute(c.endpoints) as r:
            await r.complete(session_prompt(0), max_tokens=2, stop_on_eog=False)  # warm up
            t0 = time.perf_counter()
            gens = await asyncio.gather(*(r.complete(session_prompt(i), max_tokens=a.tokens,
                                                     stop_on_eog=False)
                                          for i in range(a.sessions)))
            wall = time.perf_counter() - t0
        return t0, sum(len(g.tokens) for g in gens) / wall

    try:
        t0, tps = asyncio.run(sessions())
    finally:
        c.stop()
    spans = []
    for i in range(a.stages):
        with open(os.path.join(tmp, f"stage{i}.jsonl")) as f:
            spans += [{**json.loads(line), "st": i} for line in f]
    print(f"{a.sessions} sessions x {a.tokens} tokens over {a.stages} stages, ring groups "
          f"{'off' if a.no_ring_groups else 'on'}: {tps:.1f} tokens/s; traces in {tmp}")
    for i in range(a.stages):
        print(f"  stage {i}: forwards of decode steps by steps in them: "
              f"{batch_sizes(spans, i, t0)}")
    share = concurrency(spans, t0)
    print("  stages computing at once, share of the time: "
          + ", ".join(f"{k}: {v:.2f}" for k, v in share.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
