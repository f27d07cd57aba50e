"""Decode over an emulated WAN: TPOT of a 3-stage route with RTT 0, 5, 20, 100 ms per seam.

    python benches/wan.py [--rtts 0,5,20,100] [--stages 3] [--budget-s 20]

Three SmolLM2 workers (one thread each, loopback) with a link emulator process
(``python -m dgr.testing.linkemu``, delay RTT/2 each way) between the driver and each worker:
every decode token crosses S = 3 seams. With C the stages' own compute per token (each
worker's ``recent_step_ms``), the per-seam overhead is

    P = (TPOT - C) / S - RTT          from TPOT = C + S * (RTT + P)

reported per RTT, with a least-squares fit of TPOT against RTT (slope should be S) and the
direct per-seam figure (the driver's round trip to a stage minus its compute minus RTT).
"direct" is the route without emulators (P then includes no proxy). Goal: P <= 1 ms.
Each RTT runs at most about ``--budget-s`` seconds of decoding.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmarks.bench_route import start_cluster  # noqa: E402
from benchmarks.common import prompt_tokens, smollm2_path  # noqa: E402


async def _decode(endpoints, n_decode: int, n_vocab: int, **route_kw) -> dict:
    """Decode tokens/s of one greedy generation; the driver's per-stage round trips and each
    stage's compute per decode step."""
    import time

    from dgr.route import AsyncRoute

    prompt = [int(t) % n_vocab for t in prompt_tokens(16, 49152)]
    async with AsyncRoute(endpoints, **route_kw) as r:
        s = r.session()
        t_first, n = None, 0
        async for _ in s.generate(prompt, max_tokens=n_decode + 1, stop_on_eog=False):
            if t_first is None:
                t_first = time.perf_counter()
            n += 1
        tps = (n - 1) / (time.perf_counter() - t_first)
        infos = await r.describe()
        await s.close()
    return {"tokens_per_s": tps, "rtt_ms": [st.decode_rtt_ms for st in s.stats],
            "compute_ms": [i.recent_step_ms for i in infos]}


def route_decode(endpoints, n_decode: int, n_vocab: int, **route_kw) -> dict:
    import asyncio

    return asyncio.run(_decode(endpoints, n_decode, n_vocab, **route_kw))


def _emulators(endpoints, delay_ms):
    procs, eps = [], []
    for ep in endpoints:
        p = subprocess.Popen([sys.executable, "-m", "dgr.testing.linkemu", "--target", ep,
                              "--delay-ms", str(delay_ms)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        line = p.stdout.readline().split()
        if not line or line[0] != "LISTENING":
            raise RuntimeError(f"link emulator for {ep} did not start")
        eps.append(line[1])
    return procs, eps


def _stop(procs):
    for p in procs:
        try:
            p.stdin.close()
            p.wait(5)
        except Exception:  # noqa: BLE001
            p.kill()
            p.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtts", default="0,5,20,100", help="RTT per seam, ms")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=20.0,
                    help="about how long each RTT decodes (tokens scale down with RTT)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None,
                    help="GGUF to serve instead of SmolLM2 (e.g. a tiny one, to isolate the "
                         "transport's share)")
    ap.add_argument("--inline-compute", action="store_true",
                    help="workers compute on their event loop thread (no thread handoff)")
    args = ap.parse_args(argv)

    from dgr._core import HAS_LAYER_RANGES

    if args.stages > 1 and not HAS_LAYER_RANGES:
        print("benches/wan.py: this build has no layer ranges (dgr._core.HAS_LAYER_RANGES)")
        return 0
    S = args.stages
    path = args.model or smollm2_path()
    import dgr

    probe = dgr.Engine(path, n_ctx=256)
    n_layer, n_vocab = probe.n_layer, probe.n_vocab
    del probe
    c = start_cluster(path, S, n_layer, args=["--inline-compute"] if args.inline_compute else [])
    rows = []
    configs = [("direct", 0.0)] + [("emulated", float(x)) for x in args.rtts.split(",")]
    emus: dict = {}
    runs: dict = {k: [] for k in configs}
    try:
        base = route_decode(c.endpoints, 32, n_vocab)
        for label, rtt in configs:
            emus[(label, rtt)] = ([], c.endpoints) if label == "direct" else _emulators(
                c.endpoints, rtt / 2)
        for _ in range(args.rounds):  # interleaved: a busy machine skews every RTT alike
            for label, rtt in configs:
                n = int(max(6, min(64, args.budget_s * 1e3 / (3 * rtt + 8.0) / args.rounds)))
                r = route_decode(emus[(label, rtt)][1], n, n_vocab,
                                 deadline_floor=max(2.0, rtt / 50))
                tpot = 1e3 / r["tokens_per_s"]
                comp = float(sum(r["compute_ms"]))
                hop = float(np.mean([a - b for a, b in zip(r["rtt_ms"], r["compute_ms"])]))
                runs[(label, rtt)].append((n, tpot, comp, (tpot - comp) / S - rtt, hop - rtt))
    finally:
        for procs, _ in emus.values():
            _stop(procs)
        c.stop()
    for (label, rtt), rs in runs.items():
        med = [float(np.median([r[k] for r in rs])) for k in range(1, 5)]
        rows.append((label, rtt, rs[0][0], *med))
    print(f"{S}-stage route of {os.path.basename(path)}, decode; warm-up direct TPOT "
          f"{1e3 / base['tokens_per_s']:.2f} ms")
    print(f"{'link':<9}{'RTT ms':>7}{'tokens':>7}{'TPOT ms':>9}{'C ms':>7}{'P ms':>7}"
          f"{'hop-RTT ms':>11}")
    for label, rtt, n, tpot, comp, p, hop in rows:
        print(f"{label:<9}{rtt:>7g}{n:>7d}{tpot:>9.2f}{comp:>7.2f}{p:>7.2f}{hop:>11.2f}")
    em = [r for r in rows if r[0] == "emulated"]
    if len(em) >= 2:
        x = np.array([r[1] for r in em])
        y = np.array([r[3] for r in em])
        slope, icpt = np.polyfit(x, y, 1)
        comp = float(np.mean([r[4] for r in em]))
        print(f"fit TPOT = {icpt:.2f} + {slope:.3f} * RTT  (S = {S}); with C = {comp:.2f} ms: "
              f"P = {(icpt - comp) / S:.2f} ms per seam")
    worst = max(r[5] for r in em) if em else float("nan")
    print(f"worst P over emulated RTTs: {worst:.2f} ms (goal <= 1 ms): "
          f"{'met' if worst <= 1.0 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
