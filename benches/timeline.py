"""Pipelined relay prefill, drawn: one row per stage, each chunk's compute span on a time axis.

    python benches/timeline.py [--stages 3] [--prompt 512] [--width 100] [--json spans.json]

Starts ``--stages`` SmolLM2 workers (``python -m dgr.worker --trace FILE``, one thread each,
the settings of benches/compare.py), runs one relayed prefill of ``--prompt`` tokens (+1
generated token) through ``AsyncRoute(relay=True)`` (every ``n_ubatch`` chunk sent at once,
so stage k can work on chunk i while stage k+1 works on chunk i-1), stops the workers (which
flushes the traces), reads the span lines ({"stage": [a, b], "pos", "n", "arrive",
"compute_end", "compute_s", "sent", ...}; perf_counter = CLOCK_MONOTONIC, one clock for all
processes) and prints:

* the timeline: one row per stage, ``--width`` columns from the first arrival to the last
  send; each chunk's compute span [compute_end - compute_s, compute_end] is drawn with the
  last digit of its chunk index (chunk = pos // n_ubatch), idle time as ``.``;
* overlap statistics: wall time (driver's send of the first chunk to the reply), busy time
  (sum of compute) per stage, the fraction of the span window where >= 2 stages compute at
  once, prefill tokens/s of the route vs the whole model in its own process
  (``compare.whole_measure``: wall time of ``generate_local(max_tokens=1)`` on the same
  prompt, which forwards it in n_ubatch chunks).

``--decode N`` traces a relayed decode loop of N tokens instead and prints where a token's
time goes, stage by stage (medians over the tokens): ``compute`` (the engine's forward),
``python`` (the step's own Python: decode, checks and session table before the forward,
bookkeeping after it, and sampling on the last stage; the trace's span ends after these, so
``start - arrive`` counts them) and ``hop in`` (from the previous stage's
compute end to this stage's arrival: encode, send, the kernel, the wakeup, the receive; for
stage 0 from the last stage of the previous token). The sum is the route's time per token.
For comparison it measures the same ranges' forward in one process of their own, right
before and after the route (the machine's speed drifts), so the difference between a
range's compute inside a worker and alone is visible.

``--json FILE`` writes the spans and the statistics. The parsing/rendering functions
(``load_spans``, ``intervals``, ``overlap_stats``, ``render``, ``decode_breakdown``) are
pure, see tests/unit/test_benches.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time

from harness import cli


# --- pure functions --------------------------------------------------------------------------

def load_spans(lines, session: str | None = None) -> list[dict]:
    """Parse trace lines (JSON objects, one a line; blank lines skipped) into span dicts with
    ``start`` = compute_end - compute_s added; keep one ``session`` when given."""
    out = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        d = json.loads(line)
        if session is not None and d.get("session") != session:
            continue
        d["start"] = d["compute_end"] - d["compute_s"]
        d["stage"] = tuple(d["stage"])
        out.append(d)
    return out


def stage_order(spans) -> list[tuple]:
    """The stages' layer ranges in route order (by first layer)."""
    return sorted({s["stage"] for s in spans})


def intervals(spans) -> dict[tuple, list[tuple[float, float, int]]]:
    """{stage: [(start, end, first_pos), ...] sorted by start}."""
    out: dict[tuple, list] = {}
    for s in spans:
        out.setdefault(s["stage"], []).append((s["start"], s["compute_end"], s["pos"]))
    for v in out.values():
        v.sort()
    return out


def overlap_stats(spans, t0: float | None = None, t1: float | None = None) -> dict:
    """Busy seconds per stage and how much of [t0, t1] (default: first compute start to last
    compute end) has >= 1, >= 2 stages computing at once (a stage's own spans are merged)."""
    iv = intervals(spans)
    if not iv:
        return {"window_s": 0.0, "busy_s": {}, "any_s": 0.0, "overlap2_s": 0.0,
                "overlap2_frac": 0.0}
    t0 = min(a for v in iv.values() for a, _, _ in v) if t0 is None else t0
    t1 = max(b for v in iv.values() for _, b, _ in v) if t1 is None else t1
    events = []
    busy = {}
    for st, v in iv.items():
        busy[st] = sum(b - a for a, b, _ in v)
        # merge this stage's spans so a stage counts once
        merged = []
        for a, b, _ in v:
            a, b = max(a, t0), min(b, t1)
            if b <= a:
                continue
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        for a, b in merged:
            events += [(a, 1), (b, -1)]
    events.sort()
    level, last, any_s, two_s = 0, t0, 0.0, 0.0
    for t, d in events:
        if level >= 1:
            any_s += t - last
        if level >= 2:
            two_s += t - last
        level += d
        last = t
    window = t1 - t0
    return {"window_s": window, "busy_s": {"%d:%d" % st: b for st, b in busy.items()},
            "any_s": any_s, "overlap2_s": two_s,
            "overlap2_frac": two_s / window if window > 0 else 0.0}


def render(spans, width: int = 100, chunk: int = 64, t0: float | None = None,
           t1: float | None = None) -> list[str]:
    """ASCII rows, one per stage: ``.`` idle, the last digit of the chunk index
    (pos // chunk) where that chunk computes (a cell shows the chunk covering most of it)."""
    iv = intervals(spans)
    if not iv:
        return []
    t0 = min(a for v in iv.values() for a, _, _ in v) if t0 is None else t0
    t1 = max(b for v in iv.values() for _, b, _ in v) if t1 is None else t1
    dt = (t1 - t0) / width if t1 > t0 else 1.0
    rows = []
    for st in stage_order(spans):
        cover = [0.0] * width
        cells = ["."] * width
        for a, b, pos in iv[st]:
            c = str((pos // chunk) % 10)
            i0 = max(int((a - t0) / dt), 0)
            i1 = min(int((b - t0) / dt), width - 1)
            for i in range(i0, i1 + 1):
                lo, hi = t0 + i * dt, t0 + (i + 1) * dt
                part = min(b, hi) - max(a, lo)
                if part > cover[i] or (part > 0 and cells[i] == "."):
                    cover[i], cells[i] = part, c
        rows.append(f"{st[0]:>3}:{st[1]:<3} |{''.join(cells)}|")
    return rows


def decode_breakdown(spans) -> dict:
    """Where a decode token's time goes, from single-token spans of one session.

    Per stage (route order), medians over the positions every stage traced: ``compute_ms``,
    ``python_ms`` (start - arrive) and ``hop_in_ms`` (this arrive - the previous stage's
    compute end; stage 0: from the last stage's compute end at the previous position). Also
    ``token_ms``: median of stage 0's start-to-start period, and ``sum_ms`` of the medians.
    """
    import statistics

    order = stage_order(spans)
    by: dict[int, dict] = {}
    for s in spans:
        if s["n"] == 1:
            by.setdefault(s["pos"], {})[s["stage"]] = s
    full = {p: d for p, d in by.items() if len(d) == len(order)}
    parts = {st: {"compute": [], "python": [], "hop_in": []} for st in order}
    period = []
    for p, d in sorted(full.items()):
        for i, st in enumerate(order):
            s = d[st]
            parts[st]["compute"].append(s["compute_s"])
            parts[st]["python"].append(s["start"] - s["arrive"])
            prev = d[order[i - 1]] if i > 0 else full.get(p - 1, {}).get(order[-1])
            if prev is not None:
                parts[st]["hop_in"].append(s["arrive"] - prev["compute_end"])
        if p - 1 in full:
            period.append(d[order[0]]["start"] - full[p - 1][order[0]]["start"])

    def med(v):
        return 1e3 * statistics.median(v) if v else float("nan")

    stages = [{"stage": "%d:%d" % st, **{f"{k}_ms": med(v) for k, v in parts[st].items()}}
              for st in order]
    total = sum(v for row in stages for k, v in row.items() if k != "stage" and v == v)
    return {"stages": stages, "tokens": len(full), "token_ms": med(period), "sum_ms": total}


def range_compute_ms(n_stages: int, n_tokens: int = 64) -> list[float]:
    """Median decode ``forward`` ms of each of the ``n_stages`` ranges, run back to back in
    this process (the workers' settings; no transport)."""
    import statistics

    from harness.common import SETTINGS, smollm2_path

    import dgr
    from dgr.protocol.ranges import split_layers

    path = smollm2_path()
    settings = {**SETTINGS, "n_slots": 1}
    n_layer = dgr.Engine(path, **settings).n_layer
    parts = [dgr.Engine(path, layers=r, **settings) for r in split_layers(n_layer, n_stages)]
    b = parts[0].forward(0, 0, list(range(1, 17)))
    for e in parts[1:]:
        b = e.forward(0, 0, boundary=b)
    ts: list[list[float]] = [[] for _ in parts]
    for p in range(16, 16 + n_tokens):
        b = None
        for i, e in enumerate(parts):
            t = time.perf_counter()
            b = e.forward(0, p, [5]) if i == 0 else e.forward(0, p, boundary=b)
            ts[i].append(time.perf_counter() - t)
    return [1e3 * statistics.median(v) for v in ts]


def _range_compute_own_process(n_stages: int) -> list[float]:
    from harness import fresh

    return fresh.call("timeline", "range_compute_ms", n_stages)


# --- the run ---------------------------------------------------------------------------------

async def _prefill(endpoints, prompt) -> dict:
    from dgr.driver.route import AsyncRoute

    async with AsyncRoute(endpoints, relay=True) as r:
        s = r.session()
        try:
            async for _ in s.generate(prompt[:16], max_tokens=2, stop_on_eog=False):
                pass  # warm up (links, Hello), a short prompt at a different position
            await s.close()
            s = r.session()
            steps0 = r.relay_steps
            t0 = time.perf_counter()
            toks = []
            async for tok in s.generate(prompt, max_tokens=1, stop_on_eog=False):
                toks.append(tok)
            t1 = time.perf_counter()
            return {"session": s.id, "t0": t0, "t1": t1, "tokens": toks,
                    "relay_steps": r.relay_steps - steps0}
        finally:
            await s.close()


async def _decode(endpoints, prompt, n: int) -> dict:
    from dgr.driver.route import AsyncRoute

    async with AsyncRoute(endpoints, relay=True) as r:
        s = r.session()
        try:
            async for _ in s.generate(prompt[:16], max_tokens=4, stop_on_eog=False):
                pass  # warm up (links, Hello)
            await s.close()
            s = r.session()
            toks = [t async for t in s.generate(prompt, max_tokens=n, stop_on_eog=False)]
            return {"session": s.id, "tokens": toks, "relay_steps": r.relay_steps}
        finally:
            await s.close()


def _traced(n_stages: int, log, go):
    """Start traced workers, ``go(endpoints)`` (a coroutine function), stop them (which
    flushes the traces) and return (go's result, the spans of its session)."""
    from harness.clusters import start_cluster
    from harness.common import SETTINGS, smollm2_path

    import dgr

    path = smollm2_path()
    n_layer = dgr.Engine(path, **SETTINGS).n_layer
    tmp = tempfile.mkdtemp(prefix="dgr-timeline-")
    traces = [os.path.join(tmp, f"stage{i}.jsonl") for i in range(n_stages)]
    log(f"starting {n_stages} workers (traces in {tmp}) ...")
    cluster = start_cluster(path, n_stages, n_layer, worker_args=[["--trace", t]
                                                                  for t in traces])
    try:
        res = asyncio.run(go(cluster.endpoints))
    finally:
        cluster.stop()  # SIGTERM: the workers drain and flush their traces
    spans = []
    for t in traces:
        with open(t) as f:
            spans += load_spans(f, session=res["session"])
    spans.sort(key=lambda s: (s["stage"], s["start"]))
    return res, spans


def run_decode(n_stages: int, n_tokens: int, log=print) -> dict:
    """Trace a relayed decode loop; the same ranges' compute alone before and after."""
    import statistics

    from harness.common import N_VOCAB, prompt_tokens

    prompt = [int(t) for t in prompt_tokens(32, N_VOCAB)]
    log("the ranges alone, in a process of their own ...")
    before = _range_compute_own_process(n_stages)
    res, spans = _traced(n_stages, log, lambda eps: _decode(eps, prompt, n_tokens))
    log("the ranges alone again ...")
    after = _range_compute_own_process(n_stages)
    out = decode_breakdown(spans)
    for row, a, b in zip(out["stages"], before, after):
        row["alone_ms"] = statistics.median([a, b])
    return {"n_stages": n_stages, "n_tokens": n_tokens, "breakdown": out,
            "alone_before_ms": before, "alone_after_ms": after, "spans": spans}


def report_decode(out: dict, file=sys.stdout) -> None:
    b = out["breakdown"]
    print(f"\nrelayed decode loop over {out['n_stages']} stages: where a token's time goes "
          f"(medians over {b['tokens']} tokens, ms)", file=file)
    print(f"  {'stage':<8}{'hop in':>8}{'python':>8}{'compute':>9}{'alone':>8}{'extra':>8}",
          file=file)
    for r in b["stages"]:
        print(f"  {r['stage']:<8}{r['hop_in_ms']:8.3f}{r['python_ms']:8.3f}"
              f"{r['compute_ms']:9.3f}{r['alone_ms']:8.3f}"
              f"{r['compute_ms'] - r['alone_ms']:+8.3f}", file=file)
    seam = sum(r["hop_in_ms"] + r["python_ms"] for r in b["stages"])
    extra = sum(r["compute_ms"] - r["alone_ms"] for r in b["stages"])
    alone = sum(r["alone_ms"] for r in b["stages"])
    print(f"  sum {b['sum_ms']:.2f} ms/token (stage 0's period: {b['token_ms']:.2f}); "
          f"seams (hop in + python) {seam:.2f} = {seam / out['n_stages']:.2f} a stage; "
          f"compute {extra:+.2f} over the ranges alone ({alone:.2f}; measured before "
          f"{sum(out['alone_before_ms']):.2f}, after {sum(out['alone_after_ms']):.2f})",
          file=file)


def run(n_stages: int, n_prompt: int, whole: bool = True, log=print) -> dict:
    import compare
    from harness.common import N_VOCAB, SETTINGS, prompt_tokens

    prompt = [int(t) for t in prompt_tokens(n_prompt, N_VOCAB)]
    res, spans = _traced(n_stages, log, lambda eps: _prefill(eps, prompt))
    stats = overlap_stats(spans)
    stats["wall_s"] = res["t1"] - res["t0"]
    stats["prefill_tps"] = n_prompt / stats["wall_s"]
    stats["relay_steps"] = res["relay_steps"]
    if whole:
        log("whole model in its own process ...")
        w = compare.whole_in_own_process(2, (n_prompt,))
        stats["whole_prefill_tps"] = w[f"prefill{n_prompt}_tps"]
        stats["ratio_to_whole"] = stats["prefill_tps"] / stats["whole_prefill_tps"]
    return {"n_stages": n_stages, "n_prompt": n_prompt, "chunk": SETTINGS["n_ubatch"],
            "t0": res["t0"], "t1": res["t1"], "spans": spans, "stats": stats}


def report(out: dict, width: int = 100, file=sys.stdout) -> None:
    st, spans = out["stats"], out["spans"]
    print(f"\nrelayed prefill of {out['n_prompt']} tokens over {out['n_stages']} stages, "
          f"chunks of {out['chunk']} ({len(spans)} spans, {st['relay_steps']} relayed "
          f"replies); time runs left to right from the driver's first send to the reply, "
          f"{1e3 * (out['t1'] - out['t0']) / width:.2f} ms a column; digit = chunk index "
          f"mod 10, '.' = idle", file=file)
    for row in render(spans, width, out["chunk"], out["t0"], out["t1"]):
        print(row, file=file)
    print(f"\nwall {1e3 * st['wall_s']:.1f} ms; compute window {1e3 * st['window_s']:.1f} ms "
          f"(first compute start to last compute end)", file=file)
    for name, b in st["busy_s"].items():
        print(f"  stage {name:<7} busy {1e3 * b:8.1f} ms ({b / st['wall_s']:.0%} of wall)",
              file=file)
    print(f"  >= 2 stages computing at once: {1e3 * st['overlap2_s']:.1f} ms = "
          f"{st['overlap2_frac']:.0%} of the compute window "
          f"({st['overlap2_s'] / st['wall_s']:.0%} of wall)", file=file)
    line = f"prefill {st['prefill_tps']:.1f} tokens/s (route, relay)"
    if "whole_prefill_tps" in st:
        line += (f" vs {st['whole_prefill_tps']:.1f} whole model in one process: "
                 f"ratio {st['ratio_to_whole']:.2f}")
    print(line, file=file)


def main(argv=None) -> int:
    ap = cli.parser(__doc__, stages=3, json=True)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--width", type=int, default=100, help="timeline columns")
    ap.add_argument("--no-whole", action="store_true", help="skip the whole-model run")
    ap.add_argument("--decode", type=int, metavar="N",
                    help="trace a relayed decode loop of N tokens instead: where a token's "
                         "time goes, stage by stage")
    args = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.decode:
        out = run_decode(args.stages, args.decode, log=log)
        report_decode(out)
    else:
        out = run(args.stages, args.prompt, whole=not args.no_whole, log=log)
        report(out, args.width)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
