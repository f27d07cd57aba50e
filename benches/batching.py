"""Many sessions through one route: dgr's batching stage loop against llama.cpp's
``llama-batched-bench`` on the whole model, side by side in one run.

    python benches/batching.py [--sessions 1,16,32] [--tokens 64] [--stages 3]
                               [--split cost|weights|even|A,B] [--threads 1,2] [--rounds 1]
                               [--ungrouped] [--busy-poll-us US] [--pin] [--contention]
                               [--name batching]
                               [--json out.json]

- **dgr**: ``--stages`` worker processes on loopback (one thread each, ``max(sessions)``
  slots, the settings below), direct relay with the decode loop. For each k, k sessions at
  once (``asyncio.gather`` of ``AsyncRoute.complete``, a different 16-token prompt each,
  ``--tokens`` greedy tokens each), twice on the same workers: ``batched`` (the stage loop
  computes the ready steps of several sessions as one forward) and ``solo`` (every step
  ``Forward.solo``: one step per forward, as before the stage loop batched). Reported:
  aggregate output tokens/s (all tokens / wall time), each session's time per output token
  (median and slowest) and time to first token; and parity: every session's tokens against
  the whole model's greedy tokens for its prompt computed alone. With ``--ungrouped``, also
  ``ungrouped``: a second set of workers started ``--no-ring-groups`` (batched, but a batch
  takes every ready step instead of splitting the sessions into as many groups as the ring
  has stages; docs/batching.md), in the same rounds. With ``--busy-poll-us US``, also
  ``busypoll``: workers started ``--busy-poll-us US`` (batched), in the same rounds.
- **llama-batched-bench** (the pinned tree's, built on demand): ``-npp 16 -ntg <tokens> -npl
  <sessions>`` on the whole model with the same settings (``-c`` n_ctx per sequence times
  the most sequences, ``-no-kvu``: one KV stream per sequence as dgr's slots, ``-b``/``-ub``
  n_ubatch, flash attention, f16 KV, no GPU layers; benches/compare.py's
  ``batched_bench_command``, its records checked by ``parse_batched_bench``), at each
  ``--threads`` count. Its ``S_TG`` (generated tokens/s over the generation phase) is the
  reference figure.
- **The pipeline figure** (``bb -t1 pipeline``): ``-t 1`` also runs at ``-npl`` = the rows
  of a ring group, ``ceil(k / stages)``; its S_TG times the stages busy at once (at most k,
  the stages and the cores) is what llama.cpp's own engine gives one-thread stages that each
  compute a group of that many rows while the others compute theirs (``pipeline_tps``).
  Where the matrix kernel costs as much for 8 rows as for 16 (AMX takes tiles of 16 rows),
  this sits well below ``-t 2`` at 16 sessions. ``batched/bb-t1 pipeline`` is the share of
  it the route keeps (its own work, the stages' imbalance and their computing at once take
  the rest).

- **Where each stage's time goes** (docs/performance.md): every worker serves Prometheus
  metrics, scraped before and after each measurement. Per stage and per output token: its
  process's CPU, and its wall time by part (``dgr.worker.profile``: frame in, lease, engine,
  sample, commit, turn wait, hand on, held, idle), the engine's forwards, llama.cpp ubatches
  and graphs reused per forward, and steps per forward. Also the driver's CPU per token (this
  process, which runs only the route's client during a measurement).
- **Each stage's upper bound**: each stage's engine alone, in this process, one at a time
  (the workers' settings): decode steps of ``b`` consecutive slots after a ``N_PROMPT``-token
  prompt each, for ``b`` = 1 and ``ceil(k / stages)`` (the ring groups' batch), as the route
  runs them: every group of the ``k`` sessions in turn, over the same tokens per session
  (the same contexts), the mean per token. Its tokens/s is what that stage could serve with
  nothing else on the machine; the slowest stage's is the route's bound (with more stages than
  cores, the cores over the stages' summed time per token is lower, and is the bound).

The stages' layer ranges: ``--split cost`` (default) balances each layer's time measured
on this machine (``dgr.control.layercost``: an engine of each layer, decode steps of the
ring groups' rows at the most sessions after ``N_PROMPT`` tokens, cached per machine),
``weights`` the layers' and the output head's weights multiplied per token
(``dgr.protocol.ranges.balance_layers`` of ``dgr.artifacts.manifest.layer_costs``), ``even``
splits by layer count, ``A,B`` names the interior split points. The stages' balance is
printed: each stage's engine alone at the ring groups' batch, slowest over fastest. The
workers use one thread each, so ``--stages`` 3 runs 3 threads on this machine's cores; the
reference is given at each thread count asked for. ``--pin`` pins stage i's process to core
i; ``--contention`` measures the host's share of the stages' slowdown when they compute at
once (:func:`contention`). The CPU model is printed with the figures. Results go to
``benches/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import time
import urllib.request

from harness import cli, clusters, fresh
from harness import llama as llama_tools
from harness.common import N_PROMPT_DECODE as N_PROMPT
from harness.common import session_prompt, smollm2_path  # benches/compare.py's --sessions
from harness.measure import decode_tps, end_to_end_tps, rate

#: engine settings of every worker and of the reference (n_slots: the most sessions)
SETTINGS = dict(n_ctx=256, n_threads=1, n_ubatch=64, flash_attn=True)


def log(msg: str) -> None:
    print(f"[batching] {msg}", file=sys.stderr, flush=True)


def scrape(port: int) -> dict[str, float]:
    """A worker's metrics (``--metrics-port``): ``name`` or ``name{label=value}`` -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            lab = ",".join(f"{k}={v}" for k, v in sorted(smp.labels.items()))
            out[smp.name + (f"{{{lab}}}" if lab else "")] = smp.value
    return out


def stage_profile(before: dict, after: dict, tokens: int) -> dict:
    """One stage's share of a measurement, from two scrapes: per output token, its CPU and
    its wall time by part (ms; the window also holds every session's prompt); per decode
    step, the engine's share of its forward (ms: what the stage's engine alone at that batch
    measures; None without decode steps); per forward, steps, llama.cpp ubatches, graphs
    reused."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    fw = max(d.get("dgr_engine_forwards_total", 0.0), 1.0)
    steps = d.get("dgr_worker_decode_steps_total", 0.0)
    parts = {k.split("part=")[1].rstrip("}"): v for k, v in d.items()
             if k.startswith("dgr_worker_stage_seconds_total{")}
    return {"cpu_ms_per_token": 1e3 * d["process_cpu_seconds_total"] / tokens,
            "ms_per_token": {p: 1e3 * v / tokens for p, v in parts.items()},
            "engine_decode_ms_per_token": 1e3 * d["dgr_engine_decode_seconds_total"] / tokens,
            "engine_ms_per_decode_step":
            1e3 * d.get("dgr_worker_decode_compute_seconds_total", 0.0) / steps
            if steps else None,
            "forwards": d.get("dgr_engine_forwards_total", 0.0),
            "steps_per_forward": d["dgr_worker_batched_steps_total"]
            / max(d["dgr_worker_batches_total"], 1.0),
            "ubatches_per_forward": d["dgr_engine_ubatches_total"] / fw,
            "graphs_reused_per_forward": d["dgr_engine_graphs_reused_total"] / fw}


async def _sessions(endpoints, k: int, n: int, batching: bool, ports=()) -> dict:
    from dgr.driver.route import AsyncRoute

    async with AsyncRoute(endpoints, batching=batching) as r:
        await r.complete(session_prompt(0), max_tokens=2, stop_on_eog=False)  # warm up
        before = [scrape(p) for p in ports]
        c0, t0 = time.process_time(), time.perf_counter()
        gens = await asyncio.gather(*(r.complete(session_prompt(i), max_tokens=n,
                                                 stop_on_eog=False) for i in range(k)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        after = [scrape(p) for p in ports]
    tokens = sum(len(g.tokens) for g in gens)
    tpot = [1e3 * g.decode_s / max(len(g.tokens) - 1, 1) for g in gens]
    return {"sessions": k, "batching": batching, "wall_s": wall,
            "tokens": tokens, "aggregate_tps": tokens / wall,
            "decode_tps": decode_tps([g.token_times for g in gens]),
            "tpot_ms_p50": statistics.median(tpot), "tpot_ms_max": max(tpot),
            "ttft_ms_p50": 1e3 * statistics.median(g.time_to_first_token_s for g in gens),
            "driver_cpu_ms_per_token": 1e3 * cpu / tokens,
            "stages": [stage_profile(b, a, tokens) for b, a in zip(before, after)],
            "session_tokens": [list(g.tokens) for g in gens]}


def stage_bounds(path: str, ranges, k_max: int, groups: dict[int, int], n: int) -> list:
    """Each stage's engine alone (the workers' settings, ``k_max`` slots): ms per token of
    the route's decode steps. For each batch ``b`` of ``groups`` (``b`` -> the sessions
    ``k``), slots ``0..k-1``, each after a ``N_PROMPT``-token prompt, cut into runs of ``b``
    (the ring groups; the last may be shorter), decode ``n`` steps, the groups in turn, from
    position ``N_PROMPT``: the contexts and the KV working set the route's sessions have
    (decode attention grows with the context, and at a few hundred tokens it costs more
    than the weights on a CPU). [{b: mean ms per token}] per stage."""
    import numpy as np

    import dgr

    out = []
    for rng in ranges:
        kw = {} if rng is None else {"layers": tuple(rng)}
        e = dgr.Engine(path, **{**SETTINGS, "n_slots": k_max}, **kw)
        w = e.n_embd_boundary
        gen = np.random.default_rng(0)
        res = {}
        for b, k in sorted(groups.items()):
            for s in range(k_max):
                e.release(s)
            for s in range(k):  # each slot's prompt
                e.forward_batch(np.full(N_PROMPT, s, np.int32),
                                np.arange(N_PROMPT, dtype=np.int32),
                                np.ones(N_PROMPT, np.int32) if e.is_first else None,
                                None if e.is_first else
                                gen.standard_normal((N_PROMPT, w)).astype(np.float32))
            t = 0.0
            for r in range(n):
                for j in range(0, k, b):
                    slots = np.arange(j, min(j + b, k), dtype=np.int32)
                    m = len(slots)
                    bnd = None if e.is_first else gen.standard_normal((m, w)).astype(np.float32)
                    t0 = time.perf_counter()
                    e.forward_batch(slots, np.full(m, N_PROMPT + r, np.int32),
                                    np.ones(m, np.int32) if e.is_first else None, bnd)
                    t += time.perf_counter() - t0
            res[b] = 1e3 * t / (n * k)
        out.append(res)
        del e
    return out


def bound_tps(stage_ms: list[float], cores: int) -> float:
    """The route's tokens/s bound from each stage's ms per token alone: the slowest stage's,
    or with more stages than cores, the cores over their summed time per token."""
    slowest = 1e3 / max(stage_ms)
    return min(slowest, cores * 1e3 / sum(stage_ms)) if len(stage_ms) > cores else slowest


def group_rows(k: int, n_stages: int) -> int:
    """The rows of a ring group: ``k`` sessions over ``n_stages`` stages, ``ceil(k / n)``."""
    return -(-k // n_stages)


def pipeline_npl(sessions: list[int], n_stages: int) -> list[int]:
    """The ``-npl`` values of ``llama-batched-bench -t 1``: the session counts and the rows of
    their ring groups, for the pipeline figure."""
    return sorted(set(sessions) | {group_rows(k, n_stages) for k in sessions})


def pipeline_tps(s_tg_group: float, k: int, n_stages: int, cores: int) -> float:
    """What the whole model's own engine gives a pipeline of one-thread stages at ``k``
    sessions: ``llama-batched-bench -t 1``'s S_TG at the rows each stage computes per forward
    (``s_tg_group``, npl = ``ceil(k / stages)``), times the stages busy at once (at most
    ``k``, the stages and the cores). Each stage computes its share of the layers for one
    group while the others compute theirs, so a group's pass through all of them takes as
    long as the whole model's step at that many rows on one thread, over the stages busy."""
    return min(k, n_stages, cores) * s_tg_group


def plan_ranges(path: str, n_layer: int, n_stages: int, split: str, batch: int = 1):
    """The stages' ranges for ``--split`` (see the module docstring); ``batch``: the rows a
    stage computes per forward (``cost`` times the layers at it)."""
    from dgr.artifacts.manifest import layer_costs
    from dgr.control.layercost import route_ranges
    from dgr.protocol.ranges import balance_layers, ranges_for

    if n_stages == 1:
        return [None]
    if split == "cost":
        return route_ranges(path, n_stages, SETTINGS, batch=batch, context=N_PROMPT)
    if split == "weights":
        costs, head = layer_costs(path)
        return balance_layers(costs, n_stages, head)
    if split == "even":
        return ranges_for(None, n_stages, n_layer)
    return ranges_for(split, n_stages, n_layer)


def whole_refs(path: str, k: int, n: int) -> list[list[int]]:
    """Greedy tokens of the whole model for each session's prompt, each computed alone, in a
    fresh process (the workers' settings, ``k`` slots)."""
    return fresh.call("batching", "_whole_refs_here", path, k, n, timeout=1200)


def _whole_refs_here(path: str, k: int, n: int) -> list[list[int]]:
    import dgr
    from dgr.core.local import generate_local

    e, out = dgr.Engine(path, **{**SETTINGS, "n_slots": k}), []
    for i in range(k):
        t, _ = generate_local(e, session_prompt(i), max_tokens=n, stop_on_eog=False)
        out.append([int(x) for x in t])
        e.release(0)
    return out


def batched_bench(path: str, sessions: list[int], n: int, threads: int) -> dict[int, dict]:
    """``llama-batched-bench`` at ``threads`` with these settings (harness.llama's
    ``batched_bench_command``, checked by its ``parse_batched_bench``): {npl: its jsonl
    record, with the command line}."""
    exe = llama_tools.tool("llama-batched-bench", build=True)
    settings = {**SETTINGS, "n_slots": max(sessions)}
    cmd = llama_tools.batched_bench_command(settings, sessions, n, threads, path,
                                            exe=str(exe), n_prompt=N_PROMPT)
    res = llama_tools.batched_bench(cmd, settings, sessions, n, threads, N_PROMPT)
    return {k: m["record"] | {"command": cmd} for k, m in res.items()}


def pin_process(pid: int, core: int) -> None:
    """Every thread of process ``pid`` onto CPU ``core`` (threads made later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # a thread that has just ended
            pass


def contention(path: str, rows: list[int], n: int, copies: int, pin: bool) -> dict:
    """The host's share of the in-route slowdown: ``llama-batched-bench -t 1`` at each of
    ``rows`` (a ring group's rows), alone, then ``copies`` of it at once (as many stages
    computing at once; each on a core of its own with ``pin``). {rows: {"alone": S_TG,
    "at_once": [S_TG of each copy], "slowdown": alone over the copies' mean}}. Two stages of
    one host computing at once share its memory bandwidth and last-level cache; if
    llama.cpp's own engine slows as much, the slowdown is the host's, not dgr's."""
    import threading

    exe = llama_tools.tool("llama-batched-bench", build=True)
    settings = {**SETTINGS, "n_slots": max(rows)}
    out = {}
    for g in rows:
        cmd = llama_tools.batched_bench_command(settings, [g], n, 1, path, exe=str(exe),
                                                n_prompt=N_PROMPT)
        alone = llama_tools.batched_bench(cmd, settings, [g], n, 1,
                                          N_PROMPT)[g]["aggregate_tps"]
        got: list = [None] * copies

        def one(i: int) -> None:  # a failed copy leaves None (its error on stderr)
            c = (["taskset", "-c", str(i % (os.cpu_count() or 1))] if pin else []) + cmd
            got[i] = llama_tools.batched_bench(c, settings, [g], n, 1,
                                               N_PROMPT)[g]["aggregate_tps"]

        ts = [threading.Thread(target=one, args=(i,)) for i in range(copies)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if None in got:
            raise RuntimeError(f"a copy of {' '.join(cmd)} failed")
        out[g] = {"alone": alone, "at_once": got,
                  "slowdown": alone / statistics.mean(got)}
        log(f"llama-batched-bench -t 1 -npl {g}: alone {alone:.1f} tok/s, {copies} at once "
            + ", ".join(f"{x:.1f}" for x in got) + f": {out[g]['slowdown']:.2f}x slower")
    return out


def run(path: str, sessions: list[int], n: int, n_stages: int, threads: list[int],
        rounds: int, ungrouped: bool = False, split: str = "cost",
        busy_poll_us: int = 0, pin: bool = False, contend: bool = False) -> dict:
    import dgr
    from dgr.vendor.cpu import cpu_features
    from dgr.worker.process import LocalCluster

    k_max = max(sessions)
    info = dgr.Engine(path, n_ctx=64, n_slots=1).describe()
    n_layer = int(info["n_layer"])
    ranges = plan_ranges(path, n_layer, n_stages, split, group_rows(k_max, n_stages))
    res: dict = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                          "model": os.path.basename(path), "stages": n_stages,
                          "ranges": [None if r is None else list(r) for r in ranges],
                          "split": split, "pinned": pin,
                          "settings": {**SETTINGS, "n_slots": k_max}, "tokens": n,
                          "prompt_tokens": N_PROMPT, "rounds": rounds,
                          "machine": platform.machine(), "cpu_count": os.cpu_count(),
                          "cpu": cpu_features()[0] or platform.processor(),
                          "dgr_version": dgr.__version__},
                 "dgr": [], "llama_batched_bench": {}}
    log(f"whole-model references of {k_max} sessions ...")
    refs = whole_refs(path, k_max, n)
    groups = {1: 1} | {group_rows(k, n_stages): k for k in sessions if k > 1}
    log(f"each stage's engine alone at batches of {sorted(groups)} ...")
    res["stage_bounds"] = [{str(b): ms for b, ms in st.items()}
                           for st in stage_bounds(path, ranges, k_max, groups, n)]
    log(f"starting {n_stages} workers with {k_max} slots, ranges {ranges} ...")
    def cluster_of(args):
        c = LocalCluster(path, ranges, settings={**SETTINGS, "n_slots": k_max}, args=args)
        ports[id(c)] = [clusters.free_port() for _ in ranges]
        for w, port in zip(c.workers, ports[id(c)]):
            w.args += ["--metrics-port", str(port)]
        return c

    ports: dict[int, list[int]] = {}
    cluster = cluster_of([])
    # more sets of workers, run batched in the same rounds: (mode, their arguments)
    extras = ([("ungrouped", ["--no-ring-groups"])] if ungrouped else []) + (
        [("busypoll", ["--busy-poll-us", str(busy_poll_us)])] if busy_poll_us else [])
    others = [(mode, cluster_of(args)) for mode, args in extras]
    cluster.start(timeout=180)
    try:
        for _, c in others:
            c.start(timeout=180)
        if pin:  # stage i's process on core i (of the cores there are)
            for c in [cluster] + [c for _, c in others]:
                for i, w in enumerate(c.workers):
                    pin_process(w.proc.pid, i % (os.cpu_count() or 1))
        if contend:
            res["contention"] = {str(g): v for g, v in contention(
                path, sorted({group_rows(k, n_stages) for k in sessions}), n,
                min(n_stages, os.cpu_count() or 1), pin).items()}
        modes = [("batched", cluster, True), ("solo", cluster, False)]
        modes += [(mode, c, True) for mode, c in others]
        for r in range(rounds):
            for k in sessions:
                for mode, c, batching in modes:
                    m = asyncio.run(_sessions(c.endpoints, k, n, batching, ports[id(c)]))
                    toks = m.pop("session_tokens")
                    m["parity"] = all(t == refs[i] for i, t in enumerate(toks))
                    m["round"] = r
                    m["mode"] = mode
                    res["dgr"].append(m)
                    log(f"dgr {mode:9s} k={k:2d}: "
                        f"{m['aggregate_tps']:6.1f} tok/s, TPOT p50 {m['tpot_ms_p50']:.1f} ms, "
                        f"parity {m['parity']}; CPU ms/token: " + ", ".join(
                            f"stage {i} {st['cpu_ms_per_token']:.2f}"
                            for i, st in enumerate(m["stages"]))
                        + f", driver {m['driver_cpu_ms_per_token']:.2f}")
            for t in threads:  # -t 1 also at the ring groups' rows (the pipeline figure)
                bb = batched_bench(path, pipeline_npl(sessions, n_stages) if t == 1
                                   else sessions, n, t)
                res["llama_batched_bench"].setdefault(str(t), []).append(bb)
                log(f"llama-batched-bench -t {t}: " + ", ".join(
                    f"npl {k}: {bb[k]['speed_tg']:.1f}" for k in sorted(bb)))
    finally:
        cluster.stop()
        for _, c in others:
            c.stop()
    return res


def balance(res: dict) -> str:
    """The stages' balance: each one's engine alone at the ring groups' rows of the most
    sessions (ms per token), slowest over fastest."""
    bounds, meta = res.get("stage_bounds"), res["meta"]
    if not bounds or len(bounds) < 2:
        return "one stage"
    b = str(group_rows(meta["settings"]["n_slots"], meta["stages"]))
    ms = [st[b] for st in bounds]
    return (f"each stage alone at {b} rows: " + ", ".join(f"{m:.3f}" for m in ms)
            + f" ms/token, slowest/fastest {max(ms) / min(ms):.2f}")


#: the modes of the extra sets of workers (``--ungrouped``, ``--busy-poll-us``)
EXTRA_MODES = ("ungrouped", "busypoll")


def _mode(m: dict) -> str:
    """A measurement's mode; results from before ``--ungrouped`` have none: by its flag."""
    return m.get("mode") or ("batched" if m["batching"] else "solo")


def measure(sessions: list[int], tokens: int, stages: int, threads: list[int],
            rounds: int) -> list[dict]:
    """``summarize`` of one ``run`` on SmolLM2 (asv's bench_batching runs it in a fresh
    process)."""
    res = run(smollm2_path(), sessions, tokens, stages, threads, rounds)
    return summarize(res, sessions, threads)


def summarize(res: dict, sessions: list[int], threads: list[int]) -> list[dict]:
    rows = []
    for k in sessions:
        row: dict = {"sessions": k}
        for name in ("batched", "solo", *EXTRA_MODES):
            ms = [m for m in res["dgr"] if m["sessions"] == k and _mode(m) == name]
            if not ms:
                continue
            row[name] = {key: statistics.median(m[key] for m in ms)
                         for key in ("aggregate_tps", "decode_tps", "tpot_ms_p50",
                                     "tpot_ms_max", "ttft_ms_p50")
                         if all(m.get(key) is not None for m in ms)}
            row[name]["parity"] = all(m["parity"] for m in ms)
            if all("stages" in m for m in ms):  # each stage's CPU per output token
                row[name]["stage_cpu_ms_per_token"] = {
                    str(i): statistics.median(m["stages"][i]["cpu_ms_per_token"] for m in ms)
                    for i in range(len(ms[0]["stages"]))}
        # dgr's rates: the decode phase's, like for like with batched-bench's S_TG and the
        # stages' engines alone (decode steps)
        rates = {name: rate(row[name]) for name in ("batched", "solo", *EXTRA_MODES)
                 if name in row}
        for t in threads:
            runs = [r[k] for r in res["llama_batched_bench"].get(str(t), []) if k in r]
            row[f"bb_t{t}"] = statistics.median(r["speed_tg"] for r in runs) if runs else None
            e2e = [end_to_end_tps(r) for r in runs if "t_pp" in r]
            row[f"bb_e2e_t{t}"] = statistics.median(e2e) if e2e else None
            if row[f"bb_t{t}"]:
                row[f"batched_over_bb_t{t}"] = rates["batched"] / row[f"bb_t{t}"]
            if row[f"bb_e2e_t{t}"]:
                row[f"batched_e2e_over_bb_t{t}"] = (row["batched"]["aggregate_tps"]
                                                   / row[f"bb_e2e_t{t}"])
        meta = res.get("meta")
        g = group_rows(k, meta["stages"]) if meta else None
        runs = [r[g] for r in res["llama_batched_bench"].get("1", []) if g in r]
        if runs:
            row["pipeline_tps"] = pipeline_tps(
                statistics.median(r["speed_tg"] for r in runs), k, meta["stages"],
                meta["cpu_count"])
            row["batched_over_pipeline"] = rates["batched"] / row["pipeline_tps"]
        bounds = res.get("stage_bounds")
        if bounds:
            row["bound_tps"] = bound_tps([st[str(g)] for st in bounds],
                                         res["meta"]["cpu_count"])
            row["batched_over_bound"] = rates["batched"] / row["bound_tps"]
        row["batched_over_solo"] = rates["batched"] / rates["solo"]
        if "ungrouped" in row:
            row["batched_over_ungrouped"] = rates["batched"] / rates["ungrouped"]
        if "busypoll" in row:
            row["busypoll_over_batched"] = rates["busypoll"] / rates["batched"]
        rows.append(row)
    return rows


def breakdown(res: dict) -> str:
    """Where each stage's time went, per output token (ms), by session count and mode (the
    first round's measurement), with each stage's engine alone beside it."""
    parts = ("engine", "frame_in", "lease", "sample", "commit", "turn_wait", "hand_on",
             "held", "idle")
    head = ["sessions", "mode", "stage", "CPU", *parts, "steps/forward", "ubatches/forward",
            "graphs reused/forward", "engine per decode step", "alone at that batch"]
    out = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    n_stages = res["meta"]["stages"]
    for m in res["dgr"]:
        if m.get("round", 0) or "stages" not in m:
            continue
        k = m["sessions"]
        for i, st in enumerate(m["stages"]):
            bounds = res.get("stage_bounds") or []
            b = 1 if _mode(m) == "solo" else group_rows(k, n_stages)
            alone = bounds[i].get(str(b)) if i < len(bounds) else None
            out.append("| " + " | ".join([
                str(k), _mode(m), str(i), f"{st['cpu_ms_per_token']:.2f}",
                *[f"{st['ms_per_token'].get(p, 0.0):.2f}" for p in parts],
                f"{st['steps_per_forward']:.1f}", f"{st['ubatches_per_forward']:.2f}",
                f"{st['graphs_reused_per_forward']:.2f}",
                f"{st['engine_ms_per_decode_step']:.2f}"
                if st.get("engine_ms_per_decode_step") is not None else "-",
                f"{alone:.2f} (b={b})" if alone is not None else "-"]) + " |")
        out.append("| " + " | ".join([str(k), _mode(m), "driver",
                                      f"{m['driver_cpu_ms_per_token']:.2f}",
                                      *[""] * (len(head) - 4)]) + " |")
    return "\n".join(out)


def table(rows: list[dict], threads: list[int], n_stages: int) -> str:
    """Decode-phase rates (tok/s) against llama-batched-bench's S_TG and the stages alone;
    output tokens over the wall time (prefills included) against batched-bench's
    end-to-end figure."""
    ung = all("ungrouped" in r for r in rows)
    bp = all("busypoll" in r for r in rows)
    bnd = all("bound_tps" in r for r in rows)
    pipe = all("pipeline_tps" in r for r in rows)
    e2e = [t for t in threads if all(r.get(f"bb_e2e_t{t}") for r in rows)]
    d = f"dgr{n_stages}"
    head = ["sessions", f"{d} batched tok/s", f"{d} solo tok/s",
            *([f"{d} ungrouped tok/s"] if ung else []),
            *([f"{d} busy-poll tok/s"] if bp else []),
            "batched/solo", *(["batched/ungrouped"] if ung else []),
            *(["busy-poll/batched"] if bp else []),
            *(["stages alone bound tok/s", "batched/bound"] if bnd else []),
            *[f"batched-bench -t{t} S_TG tok/s" for t in threads],
            *[f"batched/bb-t{t}" for t in threads],
            *(["bb -t1 pipeline tok/s", "batched/bb-t1 pipeline"] if pipe else []),
            f"{d} batched wall tok/s", *[f"bb -t{t} end-to-end tok/s" for t in e2e],
            *[f"wall/bb-t{t} end-to-end" for t in e2e],
            "TPOT p50 batched ms", "TPOT p50 solo ms",
            "parity batched", "parity solo", *(["parity ungrouped"] if ung else []),
            *(["parity busy-poll"] if bp else [])]
    out = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [str(r["sessions"]), f"{rate(r['batched']):.1f}", f"{rate(r['solo']):.1f}",
                 *([f"{rate(r['ungrouped']):.1f}"] if ung else []),
                 *([f"{rate(r['busypoll']):.1f}"] if bp else []),
                 f"{r['batched_over_solo']:.2f}",
                 *([f"{r['batched_over_ungrouped']:.2f}"] if ung else []),
                 *([f"{r['busypoll_over_batched']:.2f}"] if bp else []),
                 *([f"{r['bound_tps']:.1f}", f"{r['batched_over_bound']:.2f}"] if bnd else []),
                 *[f"{r[f'bb_t{t}']:.1f}" if r[f"bb_t{t}"] else "-" for t in threads],
                 *[f"{r.get(f'batched_over_bb_t{t}', 0):.2f}" for t in threads],
                 *([f"{r['pipeline_tps']:.1f}", f"{r['batched_over_pipeline']:.2f}"]
                   if pipe else []),
                 f"{r['batched']['aggregate_tps']:.1f}",
                 *[f"{r[f'bb_e2e_t{t}']:.1f}" for t in e2e],
                 *[f"{r[f'batched_e2e_over_bb_t{t}']:.2f}" for t in e2e],
                 f"{r['batched']['tpot_ms_p50']:.1f}", f"{r['solo']['tpot_ms_p50']:.1f}",
                 str(r["batched"]["parity"]), str(r["solo"]["parity"]),
                 *([str(r["ungrouped"]["parity"])] if ung else []),
                 *([str(r["busypoll"]["parity"])] if bp else [])]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = cli.parser(__doc__, stages=3, rounds=1, json=True,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", default="1,16,32")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per session")
    ap.add_argument("--split", default="cost",
                    help="the stages' ranges: cost (balance each layer's time measured on "
                         "this machine at the ring groups' rows), weights (balance the weights "
                         "multiplied per token, the output head's included), even (by layer "
                         "count), or interior split points A,B")
    ap.add_argument("--threads", default="1,2", help="llama-batched-bench thread counts")
    ap.add_argument("--model", help="GGUF (default: SmolLM2-135M from the registry)")
    ap.add_argument("--ungrouped", action="store_true",
                    help="also run workers started --no-ring-groups (batched, no ring groups)")
    ap.add_argument("--busy-poll-us", type=int, default=0, metavar="US",
                    help="also run workers started --busy-poll-us US (batched)")
    ap.add_argument("--pin", action="store_true",
                    help="pin stage i's worker process (every thread) to core i")
    ap.add_argument("--contention", action="store_true",
                    help="also run llama-batched-bench -t 1 at a ring group's rows alone and as "
                         "many copies at once as stages compute at once (pinned with --pin): "
                         "the host's share of the in-route slowdown")
    ap.add_argument("--name", default="batching",
                    help="results go to benches/results/<name>-<date>.{json,txt}")
    a = ap.parse_args(argv)
    sessions = sorted({int(x) for x in a.sessions.split(",")})
    threads = [int(x) for x in a.threads.split(",")]
    path = a.model or smollm2_path()
    res = run(path, sessions, a.tokens, a.stages, threads, a.rounds, ungrouped=a.ungrouped,
              split=a.split, busy_poll_us=a.busy_poll_us, pin=a.pin, contend=a.contention)
    res["summary"] = summarize(res, sessions, threads)
    text = (f"{res['meta']['cpu']}, {res['meta']['cpu_count']} cores\n"
            f"ranges {res['meta']['ranges']} (--split {a.split}); {balance(res)}\n\n"
            + table(res["summary"], threads, a.stages)
            + ("\n\nbb -t1 pipeline: llama-batched-bench -t 1's S_TG at npl = ceil(sessions"
               " / stages) (a ring group's rows) times the stages busy at once (at most the"
               " sessions, the stages and the cores)" if 1 in threads else "")
            + "\n\nWhere each stage's time went, ms per output token:\n\n" + breakdown(res)
            + "".join(f"\n\nllama-batched-bench -t 1 -npl {g}: alone {v['alone']:.1f} tok/s, "
                      f"{len(v['at_once'])} at once " + ", ".join(f"{x:.1f}" for x in v["at_once"])
                      + f" each: {v['slowdown']:.2f}x slower (the host's share)"
                      for g, v in res.get("contention", {}).items()))
    print(text)
    day = datetime.date.today().isoformat()
    os.makedirs(os.path.join(fresh.BENCHES, "results"), exist_ok=True)
    base = os.path.join(fresh.BENCHES, "results", f"{a.name}-{day}")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(base + ".txt", "w") as f:
        f.write(text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    log(f"results: {base}.json, {base}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
