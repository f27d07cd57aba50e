"""Decode over an emulated WAN: TPOT of an n-stage route, direct relay and gRPC, against the
delay model of each path.

    python benches/wan.py [--rtts 0,5,20,100] [--stages 3] [--budget-s 20] [--rounds 3]
                          [--paths relay,grpc] [--json out.json]

n SmolLM2 workers (``harness.common.SETTINGS``: one thread, n_ctx 1024, ubatch 64, flash
attention; one slot) on loopback, started twice:

* ``direct``: plain workers, no emulator;
* ``emulated``: every port of every worker behind a ``python -m dgr.testing.linkemu`` process
  (delay RTT/2 each way), on both planes (``harness.clusters.EmulatedCluster``): the gRPC port,
  and the data plane (worker i binds D_i and advertises P_i, ``--data-port D_i
  --advertise-data-port P_i``; the emulator listens on P_i and forwards to D_i). The driver's
  data link to stage 1, every stage-to-stage link and the last stage's reply to the driver each
  cross one emulator one way (RTT/2); a gRPC round trip crosses one twice (RTT). The delay
  changes per RTT through the emulators' ``delay`` command.

Each configuration is driven on two paths (``--paths``):

* ``relay``: ``AsyncRoute(relay=True, loop=True, loop_window=32)``, the default path: the
  stages' decode loop (1 -> 2 -> ... -> n -> 1, the last stage samples and feeds stage 1; the
  driver only reads the tokens). A token crosses n one-way links: S = n/2 round trips, plus
  half a round trip per loop window after the first (the window's last token goes to the
  driver and back to stage 1);
* ``grpc``: ``AsyncRoute(relay=False)``: the driver sends every step to each stage over
  gRPC in turn: S = n round trips.

A run is one greedy generation of a 16-token prompt; TPOT = wall clock from the first token
(the prompt's) to the last / the decode steps between them. C = the TPOT of the same path on
the direct workers (no emulator) in the same round: measured, it holds the compute and the
transport's own cost. Against its own path's model (``seams``, ``model``)::

    TPOT = C + S * RTT + n * P

P is what an emulated link adds per seam crossed beyond its delay (the proxies' own
forwarding, and whatever the delay costs beyond the wait): a token crosses n seams on both
paths (n driver round trips under gRPC, n one-way links under relay), so
P = (TPOT - C - S * RTT) / n. Reported per path and RTT (medians over ``--rounds``
interleaved rounds): TPOT, C, the model's TPOT (C + S * RTT), P, and under gRPC the driver's
round trip to a stage minus the stage's compute minus RTT ("hop"), both means over the same
single-token steps: the compute is the delta of the worker's exact totals
(``decode_compute_s_total`` / ``decode_steps_total`` in its describe record, read before and
after the timed run; a stage whose count differs from the steps the driver sent it gets no
hop); a least-squares fit of TPOT against the emulated RTTs
(its slope should be S); parity of every run's tokens with the whole model's
(``dgr.core.local.generate_local``). The emulated RTT 0 row is the proxies' cost alone. Goal:
P <= 1 ms. Each path and RTT decodes at most about ``--budget-s`` seconds in all (at most
64 steps a run).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


from harness import cli
from harness.clusters import route_ranges, start_cluster
from harness.common import SETTINGS, prompt_tokens, smollm2_path

N_PROMPT = 16
MAX_TOKENS = 64  # decode steps of one run, at most
WINDOW = 32  # AsyncRoute's loop_window, passed explicitly
PATHS = ("relay", "grpc")


# --- the model (pure) ------------------------------------------------------------------------

def seams(n_stages: int, relay: bool, steps: int, window: int = WINDOW) -> float:
    """S in TPOT = C + S * RTT: emulated round trips a decode token pays, averaged over
    ``steps`` timed steps (timed from the prompt's token); ``harness.clusters.seams_model``, one
    definition for both benchmarks.

    relay (decode loop): every token crosses n one-way links of RTT/2 (1 -> 2 -> ... -> n
    -> 1): n/2. Every loop window, the first included, starts from the driver: the token
    before it goes n -> driver -> 1 (two one-way links instead of one): + 1/2 per window.
    grpc: one driver round trip per stage: n."""
    from harness.clusters import seams_model

    return seams_model("relay" if relay else "dgr", n_stages, steps, window)


def model(tpot_ms: float, compute_ms: float, rtt_ms: float, n_stages: int, relay: bool,
          steps: int, window: int = WINDOW) -> dict:
    """A measured TPOT against its path's model TPOT = C + S * RTT + n * P: S, the model's
    TPOT (P = 0), the excess over it and P, the excess per seam crossed (n a token)."""
    s = seams(n_stages, relay, steps, window)
    model_tpot = compute_ms + s * rtt_ms
    excess = tpot_ms - model_tpot
    return {"S": s, "model_tpot_ms": model_tpot, "excess_ms": excess,
            "P_ms": excess / n_stages}


# --- measuring -------------------------------------------------------------------------------

async def _decode(endpoints, n_decode: int, prompt: list[int], relay: bool,
                  **route_kw) -> dict:
    """One greedy generation of ``n_decode`` steps after ``prompt``: TPOT (wall clock from the
    prompt's token to the last, / steps), the driver's per-stage round trips and their
    steps, each stage's compute per decode step over the run (deltas of its worker's totals
    between describes before and after it) and the steps it counted, the tokens, and which
    path ran."""
    import time

    from dgr.driver.route import AsyncRoute

    kw = dict(relay=True, loop=True, loop_window=WINDOW) if relay else dict(relay=False)
    async with AsyncRoute(endpoints, **kw, **route_kw) as r:
        s = r.session()
        try:
            async for _ in s.generate(prompt, max_tokens=2, stop_on_eog=False):
                pass  # warm up: links, Hello
        finally:
            await s.close()
        s = r.session()
        relayed0 = r.relay_steps
        before = await r.describe()  # the stages' compute totals before the timed run
        toks, t_first = [], None
        try:
            async for tok in s.generate(prompt, max_tokens=n_decode + 1, stop_on_eog=False):
                if t_first is None:
                    t_first = time.perf_counter()
                toks.append(tok)
            t_end = time.perf_counter()
            infos = await r.describe()
        finally:
            await s.close()
        ran = {"relay": r.relay, "loop": r.relay and r.loop,
               "relay_steps": r.relay_steps - relayed0}
    if ran["relay"] != relay:
        raise RuntimeError(f"asked for relay={relay}, the route ran relay={ran['relay']}")
    steps = len(toks) - 1
    from dgr.protocol.describe import measured_compute

    counted = measured_compute(before, infos)
    return {"steps": steps, "tpot_ms": 1e3 * (t_end - t_first) / steps, "tokens": toks,
            "stage_rtt_ms": [st.decode_rtt_ms for st in s.stats],
            "stage_rtt_steps": [st.decode_steps for st in s.stats],
            "compute_steps": [n for n, _ in counted],
            "compute_ms": [1e3 * sec / n for n, sec in counted], **ran}


def hop_ms(run: dict, rtt_ms: float) -> float | None:
    """gRPC: the mean over stages of (driver round trip - the stage's compute - RTT) per
    decode step, both over the same steps; None when a stage computed a different number of
    single-token steps than the driver sent it (the means would cover different steps)."""
    rtt, n_rtt = run["stage_rtt_ms"], run["stage_rtt_steps"]
    comp, n_comp = run["compute_ms"], run["compute_steps"]
    if not (len(rtt) == len(n_rtt) == len(comp) == len(n_comp)) or n_rtt != n_comp:
        return None
    return float(np.mean([a - c - rtt_ms for a, c in zip(rtt, comp)]))


def route_decode(endpoints, n_decode: int, prompt: list[int], relay: bool, **route_kw) -> dict:
    import asyncio

    return asyncio.run(_decode(endpoints, n_decode, prompt, relay, **route_kw))


def _emulated_cluster(path: str, n: int, n_layer: int, rtt_ms: float, args=()):
    """``harness.clusters.EmulatedCluster`` (both planes behind emulators), its workers started with
    ``args`` as well."""
    from harness.clusters import EmulatedCluster

    return EmulatedCluster(path, n, n_layer, rtt_ms, args).start()


def n_tokens(budget_s: float, rounds: int, s: float, rtt_ms: float) -> int:
    """Decode steps of one run: about ``budget_s`` over all rounds at TPOT ~ 8 ms + S * RTT."""
    return int(max(6, min(MAX_TOKENS, budget_s * 1e3 / (s * rtt_ms + 8.0) / rounds)))


def fit(rows) -> tuple[float, float] | None:
    """Least squares TPOT = a + b * RTT over ``rows`` of (rtt, tpot); None under 2 RTTs."""
    if len({r[0] for r in rows}) < 2:
        return None
    slope, icpt = np.polyfit([r[0] for r in rows], [r[1] for r in rows], 1)
    return float(icpt), float(slope)


def main(argv=None) -> int:
    ap = cli.parser(__doc__, stages=3, rounds=3, json=True)
    ap.add_argument("--rtts", default="0,5,20,100", help="RTT per link, ms (emulated)")
    ap.add_argument("--budget-s", type=float, default=20.0,
                    help="about how long each path and RTT decodes in all (tokens per run "
                         "scale down with RTT)")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="relay (AsyncRoute relay=True, decode loop) and/or grpc (relay=False)")
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
    n = args.stages
    paths = [p for p in args.paths.split(",") if p]
    if not paths or any(p not in PATHS for p in paths):
        ap.error(f"--paths: a comma list of {', '.join(PATHS)}")
    rtts = [float(x) for x in args.rtts.split(",") if x]
    path = args.model or smollm2_path()
    import dgr
    from dgr.core.local import generate_local

    whole = dgr.Engine(path, **SETTINGS)
    n_layer, n_vocab = whole.n_layer, whole.n_vocab
    prompt = [int(t) % n_vocab for t in prompt_tokens(N_PROMPT, 49152)]
    ref, _ = generate_local(whole, prompt, max_tokens=MAX_TOKENS + 1, stop_on_eog=False)
    del whole
    wargs = ["--inline-compute"] if args.inline_compute else []
    configs = [("direct", 0.0)] + [("emulated", r) for r in rtts]
    runs: dict = {(p, label, rtt): [] for p in paths for label, rtt in configs}
    print(f"starting {n} workers, and {n} more behind link emulators (gRPC + data plane) ...",
          file=sys.stderr, flush=True)
    direct = emu = None
    try:
        direct = start_cluster(path, n, n_layer, args=wargs)
        emu = _emulated_cluster(path, n, n_layer, rtts[0] if rtts else 0.0, wargs)
        for i in range(args.rounds):  # interleaved: a busy machine skews every RTT alike
            base: dict[str, float] = {}
            for label, rtt in configs:
                if label == "emulated":
                    emu.set_rtt(rtt)
                eps = direct.endpoints if label == "direct" else emu.endpoints
                for p in paths:
                    relay = p == "relay"
                    k = n_tokens(args.budget_s, args.rounds, seams(n, relay, MAX_TOKENS), rtt)
                    r = route_decode(eps, k, prompt, relay, deadline_floor=max(2.0, rtt / 50))
                    r["parity"] = len(r["tokens"]) == k + 1 and r["tokens"] == ref[:k + 1]
                    # C: the same path's direct route (no emulator) in this round, measured
                    c = r["tpot_ms"] if label == "direct" else base[p]
                    if label == "direct":
                        base[p] = c
                    r["C_ms"] = c
                    r["model"] = model(r["tpot_ms"], c, rtt, n, relay, r["steps"])
                    if not relay:
                        r["hop_ms"] = hop_ms(r, rtt)
                    runs[(p, label, rtt)].append(r)
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        if emu is not None:
            emu.stop()
        if direct is not None:
            direct.stop()

    def med(rs, f):
        return float(np.median([f(r) for r in rs]))

    ranges = route_ranges(n_layer, n)
    print(f"{n}-stage route of {os.path.basename(path)}, ranges {ranges}; settings "
          f"{SETTINGS} n_slots 1{', --inline-compute' if args.inline_compute else ''}")
    print(f"  one greedy generation a run: {N_PROMPT}-token prompt, then the steps below; TPOT "
          f"= wall / steps from the prompt's token; medians of {args.rounds} interleaved rounds")
    print("  direct: workers without emulators; emulated: linkemu (RTT/2 each way) on every "
          "worker's gRPC port and data plane (--data-port D --advertise-data-port P)")
    print(f"  emulated RTTs (ms): {', '.join(f'{r:g}' for r in rtts)}")
    print(f"  relay: AsyncRoute(relay=True, loop=True, loop_window={WINDOW}), S = n/2 + 1/2 "
          "per window / steps;  grpc: AsyncRoute(relay=False), S = n")
    print("  C = the same path's TPOT on the direct workers in the same round; model TPOT = "
          "C + S * RTT; P = (TPOT - model) / n per seam crossed; hop = driver "
          "round trip to a stage - its compute - RTT (grpc only; compute from the worker's "
          "exact totals over the same steps, '-' where the step counts differ)")
    print(f"{'path':<6}{'link':<9}{'RTT ms':>7}{'steps':>6}{'S':>7}{'TPOT ms':>9}{'C ms':>7}"
          f"{'model ms':>9}{'P ms':>7}{'hop ms':>8}{'parity':>8}")
    summary = []
    for (p, label, rtt), rs in runs.items():
        row = {"path": p, "link": label, "rtt_ms": rtt, "steps": rs[0]["steps"],
               "S": rs[0]["model"]["S"],
               "tpot_ms": med(rs, lambda r: r["tpot_ms"]),
               "C_ms": med(rs, lambda r: r["C_ms"]),
               "stage_compute_ms": med(rs, lambda r: sum(r["compute_ms"])),
               "model_tpot_ms": med(rs, lambda r: r["model"]["model_tpot_ms"]),
               "P_ms": med(rs, lambda r: r["model"]["P_ms"]),
               "hop_ms": med(rs, lambda r: r["hop_ms"])
               if p == "grpc" and all(r["hop_ms"] is not None for r in rs) else None,
               "parity": all(r["parity"] for r in rs),
               "relay_steps": [r["relay_steps"] for r in rs]}
        summary.append(row)
        hop = f"{row['hop_ms']:>8.2f}" if row["hop_ms"] is not None else f"{'-':>8}"
        print(f"{p:<6}{label:<9}{rtt:>7g}{row['steps']:>6d}{row['S']:>7.3f}"
              f"{row['tpot_ms']:>9.2f}{row['C_ms']:>7.2f}{row['model_tpot_ms']:>9.2f}"
              f"{row['P_ms']:>7.2f}{hop}{'yes' if row['parity'] else 'NO':>8}")
    for p in paths:
        em = [r for r in summary if r["path"] == p and r["link"] == "emulated"]
        f = fit([(r["rtt_ms"], r["tpot_ms"]) for r in em])
        if f is not None:
            icpt, slope = f
            comp = float(np.mean([r["C_ms"] for r in em]))
            print(f"{p}: fit TPOT = {icpt:.2f} + {slope:.3f} * RTT (model S = "
                  f"{seams(n, p == 'relay', MAX_TOKENS):.3f} at {MAX_TOKENS} steps); "
                  f"with C = {comp:.2f} ms: P = {(icpt - comp) / n:.2f} ms per seam")
        worst = max((r["P_ms"] for r in em), default=float("nan"))
        print(f"{p}: worst P over emulated RTTs: {worst:.2f} ms (goal <= 1 ms): "
              f"{'met' if worst <= 1.0 else 'NOT met'}")
    print(f"parity with the whole model (generate_local, greedy): "
          f"{'every run' if all(r['parity'] for r in summary) else 'NOT every run'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stages": n, "ranges": ranges, "settings": SETTINGS, "rtts": rtts,
                       "rounds": args.rounds, "paths": paths, "window": WINDOW,
                       "runs": [{"path": p, "link": label, "rtt_ms": rtt, **{
                           k: v for k, v in r.items() if k != "tokens"}}
                           for (p, label, rtt), rs in runs.items() for r in rs],
                       "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
