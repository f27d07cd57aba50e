"""Print the cost of seams: decode tokens/s of 1, 2 and 3 loopback stages vs the whole model.

    python benches/seams.py [--rounds 5] [--tokens 64] [--stages 1,2,3] [--inline-compute]

Every stage is a worker process with one thread; the whole model runs in a fresh process of
its own each round (same settings, same thread count), so both sides start alike. Rounds of
all configurations are interleaved and the median is reported, so a busy machine skews them
alike. "added ms/token" is against the whole model in this process; "ms per seam" is what
each seam adds over the 1-stage route, (t_k - t_1) / (k - 1); "hop ms" is the transport per
link a token crosses: with direct relay (the default) time per token minus the stages'
compute, over the links (the decode loop: one per stage); on the gRPC path the driver's
round trip to a stage minus that stage's own compute, averaged over stages.
"""

from __future__ import annotations

import os
import statistics
import sys


from harness.bench_route import route_decode, route_decode_sync
from harness.clusters import start_cluster
from harness import cli, fresh
from harness.common import SETTINGS, decode_tps, smollm2_path


def _whole_in_own_process(n_tokens: int) -> float:
    return fresh.call("seams", "whole_decode_tps", n_tokens)


def whole_decode_tps(n_tokens: int) -> float:
    """The whole model's decode tokens/s with the benchmarks' settings."""
    import dgr

    return decode_tps(dgr.Engine(smollm2_path(), **SETTINGS), n_tokens)


def main(argv=None) -> int:
    ap = cli.parser(__doc__, stages="1,2,3", rounds=5)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per round")
    ap.add_argument("--inline-compute", action="store_true",
                    help="workers compute decode steps on their event loop thread "
                         "(--inline-below-ms 50: no thread handoff)")
    ap.add_argument("--both", action="store_true",
                    help="measure workers with and without inline decode, interleaved")
    ap.add_argument("--sync", action="store_true", help="also time the blocking API (1 stage)")
    args = ap.parse_args(argv)

    import dgr
    from dgr._core import HAS_LAYER_RANGES

    path = smollm2_path()
    n_layer = dgr.Engine(path, **SETTINGS).n_layer  # the whole model runs in its own process
    modes = ["", "inline"] if args.both else ["inline" if args.inline_compute else ""]
    clusters = {}
    skipped = []
    for mode in modes:
        for n in (int(x) for x in args.stages.split(",")):
            if n > 1 and not HAS_LAYER_RANGES:
                skipped.append(n)
                continue
            print(f"starting {n} stage(s) {mode} ...", file=sys.stderr, flush=True)
            clusters[(n, mode)] = start_cluster(path, n, n_layer,
                                                ["--inline-below-ms", "50"] if mode else [])
    try:
        res = {"whole": [], **{n: [] for n in clusters}}
        hops = {n: [] for n in clusters}
        sync = []
        for r in range(args.rounds):
            res["whole"].append(_whole_in_own_process(args.tokens))
            for n, c in clusters.items():
                m = route_decode(c.endpoints, args.tokens)
                res[n].append(m["tokens_per_s"])
                hops[n].append(m["hop_ms"])
            if args.sync and (1, modes[0]) in clusters:
                sync.append(route_decode_sync(clusters[(1, modes[0])].endpoints, args.tokens))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for c in clusters.values():
            c.stop()

    med = {k: statistics.median(v) for k, v in res.items()}
    w = med["whole"]
    print(f"\nSmolLM2-135M Q4_1, {SETTINGS}, {args.tokens} decode steps, median of "
          f"{args.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    print(f"{'configuration':<30} {'tokens/s':>9} {'x whole':>8} {'ms/token':>9} "
          f"{'added ms':>9} {'ms/seam':>8} {'hop ms':>7}")
    print(f"{'whole model, one process':<30} {w:9.1f} {1.0:8.2f} {1e3 / w:9.3f} {0.0:9.3f} "
          f"{'':>8} {'':>7}")
    for key in clusters:
        n, mode = key
        t = med[key]
        one = med.get((1, mode))
        seam = "" if n == 1 or one is None else f"{(1e3 / t - 1e3 / one) / (n - 1):8.3f}"
        name = f"{n} stage(s), loopback{', inline' if mode else ''}"
        print(f"{name:<30} {t:9.1f} {t / w:8.2f} {1e3 / t:9.3f} "
              f"{1e3 / t - 1e3 / w:9.3f} {seam:>8} {statistics.median(hops[key]):7.3f}")
    if sync:
        t = statistics.median(sync)
        print(f"{'1 stage, blocking API':<30} {t:9.1f} {t / w:8.2f} {1e3 / t:9.3f} "
              f"{1e3 / t - 1e3 / w:9.3f}")
    for n in sorted(set(skipped)):
        print(f"{f'{n} stages':<30} skipped: this build has no partial layer ranges "
              "(dgr._core.HAS_LAYER_RANGES is False)")
    print("goal (issue 8): 3 stages >= 0.95 x whole; each seam <= 0.2 ms/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
