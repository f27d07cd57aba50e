"""Side by side on SmolLM2 (or ``--model``): the whole model, dgr routes of 2-4 stages (gRPC
hop by hop and direct relay) and llama.cpp RPC, all with dgr's settings.

    python benches/compare.py [--rounds 3] [--stages 2,3,4] [--quick] [--json out.json]
                              [--rtt-ms 5,20 [--rtt-stages 3]] [--sessions 1,4,16,32
                              [--session-stages 3] [--only-sessions] [--no-batched-bench]]
                              [--no-relay] [--no-rpc] [--no-llama-bench]

Every row runs ``harness.common.SETTINGS`` (n_ctx 1024, one thread, n_ubatch = n_batch =
64, flash attention on, KV f16, one slot) and the same lengths: decode = ``--tokens`` N
single-token steps after a 16-token prompt (positions 16 .. 16 + N - 1), prefill = a 128- and
a 512-token prompt from an empty cache. Each round runs every configuration once,
round-robin; the table reports medians over rounds, so a busy machine skews them alike. The
header of the output prints the exact settings and command lines of every row family.

* whole (dgr):   ``dgr.Engine(M, **SETTINGS)`` in a fresh process each round. decode: the
  greedy loop of ``dgr.core.local.generate_local`` (forward, read the logits row, sample), timed
  from the first token (the prompt's) to the last, N steps. prefill n: n / the wall time of
  ``generate_local(prompt n, max_tokens=1)`` (the call that submits the prompt to its first
  token, sampled). TTFT = that time for 128 tokens. CPU s/token: utime + stime of the process
  over the N decode steps only (from the first token to the last).
* whole (llama-bench): two ``llama-bench`` runs derived from the same settings by
  ``llama_bench_commands`` (``-t 1 -b 64 -ub 64 -fa 1 -ctk f16 -ctv f16 -lm auto -ngl 0 -r 1
  -o json``; ``check_bench_record`` refuses a record that echoes other settings):
  ``-p 128,512 -n 0 -d 0`` (prefill from an empty cache) and ``-p 0 -n N -d 16`` (N decode
  steps after a 16-token depth). llama-bench sizes its context to prompt + generation + depth
  (``to_llama_cparams``), not 1024; llama.cpp pads every context to a multiple of 256
  (``llama-context.cpp``) and attends over n_kv = max(256, used cells rounded up to 256)
  (``llama_kv_cache::get_n_kv``), so while prompt + generation + depth <= 1024 (checked) both
  sides attend over the same n_kv at every step: only the allocated KV size differs. It times
  ``llama_decode`` alone (no logits row read, no sampling) and its tokens are random; it
  measures no TTFT or CPU. ``swa_full`` differs (dgr true, llama-bench false): SmolLM2 has no
  sliding-window layers.
* dgr k:         a ``LocalCluster`` of k ``python -m dgr.worker`` processes on loopback (the
  command lines are printed), same settings, driven through ``AsyncRoute(relay=False)``
  (gRPC, the driver relays every boundary). decode: N steps timed from the first token to the
  last; prefill n: n / the wall time from ``s.generate(prompt n, max_tokens=1)`` to its first
  token; CPU s/token summed over the workers and this (driving) process from /proc/<pid>/stat
  over the decode steps only; parity: the route's greedy tokens equal the whole model's.
* relay k:       the same workers driven with ``AsyncRoute(relay=True, loop=True,
  loop_window=32)``: the driver sends each step to stage 1 over the TCP data plane, each
  stage forwards its boundary to the next, the last samples and feeds stage 1 (the decode
  loop; the driver reads the tokens); a prompt's chunks are all in flight at once (pipelined
  prefill). Same measurements.
* rpc k:         k ``ggml-rpc-server -t 1 -H 127.0.0.1 -p PORT`` and the same two llama-bench
  runs with ``--rpc`` and ``-ngl 99`` (every layer on the servers).

seam B/tok (measured, dgr k and relay k): TCP payload bytes per decode step the sending side
of each seam put on its sockets, from the kernel (``ss -tinp``, ``bytes_sent``), in a separate
untimed pass: (bytes of a generation of N + 1 tokens - bytes of one of 1 token) / N. relay:
stage k's sockets to stage k+1's data port (the seam crossed once); dgr: the driver's sockets
to stage k+1's gRPC port (the boundary of stage k, sent on by the driver: HTTP/2 and gRPC
framing included; it also crossed stage k -> driver once). The mean over seams is printed;
the JSON has each. The relay frame computed from the wire format (``relay_frame_bytes``) is
printed on its own line, labelled computed.

Ratios: each family against the whole model of its own tool: dgr k / whole and relay k /
whole (dgr.Engine), rpc k / llama-bench (llama.cpp); across tools: whole / llama-bench, dgr k
/ rpc k, relay k / rpc k; relay k / dgr k. Added ms/token per stage: (1000/decode_tps(cfg) -
1000/decode_tps(its whole row)) / n_stages, the per-server figure llama.cpp RPC is quoted with.

``--rtt-ms``: the ``--rtt-stages`` clusters are started again behind ``dgr.testing.linkemu``
processes (delay RTT/2 each way) on both planes: each worker binds its data plane on a chosen
port D and advertises P (``--data-port D --advertise-data-port P``), an emulator listens on P
and forwards to D, another fronts its gRPC port; the delay changes per RTT through the
emulators' ``delay`` command. dgr k@R and relay k@R are reported against the model
TPOT = C + S * RTT, C the whole model's ms/token (``seams_model``): S = k for dgr (one driver
round trip per stage); for relay, a token crosses k one-way links of RTT/2 in the loop
(1 -> 2 -> ... -> k -> 1), and each loop window (32 tokens) starts from the driver (the
previous token reaches the driver, which sends it to stage 1: one link more), so over N timed
steps S = k/2 + ceil(N / 32) / (2 N): measured, model, ratio.

``--sessions 1,4,16,32``: ``--session-stages`` clusters started with max(sessions) slots; for
dgr k and relay k, k sessions at once (``asyncio.gather`` of ``r.complete`` with different
16-token prompts, ``--tokens`` each): aggregate tokens/s (all generated tokens / wall), the
median and slowest session's decode tokens/s (``Generation.decode_tokens_per_s``) and time per
output token (``decode_s`` / the tokens after the first); parity of every session against the
whole model's greedy tokens for its prompt, computed with the clusters' settings (the same
n_slots). In the same rounds, ``llama-batched-bench`` on the whole model
(``batched_bench_command``: the clusters' settings, ``-c n_ctx * max(sessions) -no-kvu``, one
KV stream of n_ctx per sequence as dgr's slots; ``-npp 16 -ntg N -npl <sessions>``) at ``-t``
one stage's threads and at the route's total (stages x threads, capped at the cores: the
"same total threads" reference, marked same-thr): its S_TG and time per step, and each
cluster's aggregate over it at every k. ``--no-llama-bench`` or ``--no-batched-bench`` skip
it; ``--only-sessions`` runs these rows alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time

from harness import cli, fresh
from harness.clusters import (LOOP_WINDOW, Emulated, EmulatedCluster, seams_model,
                              start_cluster, worker_lines)
from harness.common import (N_PROMPT_DECODE, N_VOCAB, SETTINGS, prompt_tokens, session_prompt,
                            smollm2_path)
from harness.llama import (RpcServers, batched_bench, batched_bench_command,
                           batched_bench_threads, llama_bench, llama_bench_commands, tool)
from harness.measure import cpu_of, decode_tps, rate

N_DECODE = 64
PREFILLS = (128, 512)
MODEL: str | None = None  # --model: another GGUF than SmolLM2 (e.g. benches/qwen2_7b.py's)


# --- helpers ---------------------------------------------------------------------------------

def model_path() -> str:
    """The GGUF every row runs: ``--model``, else the registry's SmolLM2."""
    return MODEL or smollm2_path()


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _prompts():
    return {n: [int(t) for t in prompt_tokens(n, N_VOCAB)]
            for n in (N_PROMPT_DECODE, *PREFILLS)}


# --- bytes on the wire, from the kernel (ss -tinp) -------------------------------------------

def parse_ss(text: str) -> list[dict]:
    """The TCP sockets of ``ss -tinpH`` output: [{local, peer, pids, bytes_sent,
    bytes_received}] (a record is an address line, then its indented tcp_info line)."""
    out: list[dict] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            parts = line.split()
            if parts and not parts[0].isdigit():  # a State column (no ``state`` filter)
                parts = parts[1:]
            if len(parts) < 4:
                continue
            out.append({"local": parts[2], "peer": parts[3],
                        "pids": [int(p) for p in re.findall(r"pid=(\d+)", line)],
                        "bytes_sent": 0, "bytes_received": 0})
        elif out:
            for key in ("bytes_sent", "bytes_received"):
                m = re.search(rf"\b{key}:(\d+)", line)
                if m:
                    out[-1][key] = int(m.group(1))
    return out


def bytes_sent_to(sockets: list[dict], pid: int, port: int) -> int:
    """Bytes ``pid``'s sockets connected to ``port`` (the peer's) have sent."""
    return sum(s["bytes_sent"] for s in sockets
               if pid in s["pids"] and _port(s["peer"]) == port)


def tcp_sockets() -> list[dict] | None:
    """Every established TCP socket with its owner and byte counts; None without ``ss``."""
    exe = shutil.which("ss")
    if exe is None:
        return None
    out = subprocess.run([exe, "-tinpH", "state", "established"], capture_output=True,
                         text=True, timeout=30)
    return parse_ss(out.stdout) if out.returncode == 0 else None


def _sent(senders) -> list[int] | None:
    socks = tcp_sockets()
    return None if socks is None else [bytes_sent_to(socks, pid, port) for pid, port in senders]


# --- the whole model in one process ----------------------------------------------------------

def whole_measure(n_decode: int = N_DECODE, prefills=PREFILLS) -> dict:
    """In this process: load the whole model and measure (call it in a fresh process)."""
    import dgr
    from dgr.core.local import generate_local

    eng = dgr.Engine(model_path(), **SETTINGS)
    prompts = {**_prompts(), **{n: [int(t) for t in prompt_tokens(n, N_VOCAB)]
                                for n in prefills}}
    generate_local(eng, prompts[N_PROMPT_DECODE], max_tokens=2, stop_on_eog=False)  # warm up
    res = {"settings": dict(eng.settings)}
    for n in prefills:
        t0 = time.perf_counter()  # from the call that submits the prompt to its first token
        generate_local(eng, prompts[n], max_tokens=1, stop_on_eog=False)
        dt = time.perf_counter() - t0
        res[f"prefill{n}_tps"] = n / dt
        if n == PREFILLS[0]:
            res["ttft_ms"] = 1e3 * dt
    res.update(timed_decode(eng, prompts[N_PROMPT_DECODE], n_decode))
    return res


def timed_decode(eng, prompt, n_decode: int) -> dict:
    """``n_decode`` greedy steps after ``prompt`` through ``generate_local``, timed as
    ``_route_measure`` times a route: wall clock and this process's CPU from the prompt's row
    to the last token (the decode steps only): {decode_tps, cpu_s_per_token, tokens}."""
    from dgr.core.local import generate_local

    t: dict = {}
    toks, _ = generate_local(eng, prompt, max_tokens=n_decode + 1, stop_on_eog=False, timing=t)
    return {"decode_tps": t["decode_steps"] / t["decode_s"],
            "cpu_s_per_token": t["decode_cpu_s"] / t["decode_steps"],
            "tokens": [int(x) for x in toks]}


def whole_in_own_process(n_decode: int = N_DECODE, prefills=PREFILLS) -> dict:
    return fresh.call("compare", "whole_measure", n_decode, list(prefills),
                      set={"MODEL": MODEL})


# --- dgr routes ------------------------------------------------------------------------------

def relay_frame_bytes(r, s, width: int, k: int) -> int:
    """Bytes of the relayed decode frame stage ``k`` sends to stage ``k + 1`` (0-based) of
    route ``r``, session ``s``, computed (not measured): a ``wire.Forward`` header as the
    worker builds it (the hops still ahead, reply_to) plus one boundary row of ``width`` f32,
    through ``wire.encode``, plus the data plane's 4-byte length prefix."""
    import numpy as np

    from dgr.protocol import wire

    nxt = r.stages[k + 1]
    hops = [wire.Hop(endpoint=st.data_endpoint, tokens=st.needs_token_ids)
            for st in r.stages[k + 2:]]
    h = wire.Forward(model=nxt.identity, session=s.id, epoch=s.epoch, first_pos=1000,
                     n_tokens=1, layer=nxt.layers[0],
                     tokens=[1000] if nxt.needs_token_ids else None, want="token",
                     relay=hops, reply_to=r.route_id, loop=r.loop_hops() if r.loop else None,
                     steps=LOOP_WINDOW if r.loop else 0)
    return 4 + len(wire.encode(h, np.zeros((1, width), np.float32)))


def route_kwargs(relay: bool) -> dict:
    """``AsyncRoute`` arguments of dgr<k> (relay=False) and relay<k>."""
    return dict(relay=True, loop=True, loop_window=LOOP_WINDOW) if relay else dict(relay=False)


async def _seam_bytes(r, s, senders, prompt, n_decode: int) -> list[float] | None:
    """Measured bytes per decode step of each (pid, port) seam sender: (bytes of a generation
    of n_decode + 1 tokens - bytes of one of 1 token) / n_decode, untimed."""
    async def run(n):
        b0 = _sent(senders)
        async for _ in s.generate(prompt, max_tokens=n, stop_on_eog=False):
            pass
        b1 = _sent(senders)
        if b0 is None or b1 is None or len(b0) != len(b1):
            return None
        return [y - x for x, y in zip(b0, b1)]

    one = await run(1)
    full = await run(n_decode + 1)
    if one is None or full is None or len(one) != len(full):
        return None
    return [(f - o) / n_decode for o, f in zip(one, full)]


async def _route_measure(endpoints, pids, n_decode: int, prefills, relay: bool = False,
                         width: int | None = None, stage_pids=None) -> dict:
    """One route over ``endpoints``; ``pids``: the processes whose CPU counts (this one and the
    workers); ``stage_pids``: {gRPC endpoint: worker pid} for the seam bytes (None: none)."""
    from dgr.driver.route import AsyncRoute

    prompts = {**_prompts(), **{n: [int(t) for t in prompt_tokens(n, N_VOCAB)]
                                for n in prefills}}
    res = {}
    async with AsyncRoute(endpoints, **route_kwargs(relay)) as r:
        s = r.session()
        try:
            async for _ in s.generate(prompts[N_PROMPT_DECODE], max_tokens=2,
                                      stop_on_eog=False):  # warm up
                pass
            for n in prefills:
                t0 = time.perf_counter()  # from the call that submits the prompt
                async for _ in s.generate(prompts[n], max_tokens=1, stop_on_eog=False):
                    dt = time.perf_counter() - t0  # to its first token
                res[f"prefill{n}_tps"] = n / dt
                if n == PREFILLS[0]:
                    res["ttft_ms"] = 1e3 * dt
            toks = []
            t_first = c0 = b0 = None
            relayed0 = r.relay_steps
            async for tok in s.generate(prompts[N_PROMPT_DECODE], max_tokens=n_decode + 1,
                                        stop_on_eog=False):
                if t_first is None:
                    t_first = time.perf_counter()
                    c0 = cpu_of(pids)
                    b0 = [(st.bytes_sent, st.bytes_received) for st in s.stats]
                toks.append(tok)
            t1 = time.perf_counter()
            c1 = cpu_of(pids)
            steps = len(toks) - 1
            res["decode_tps"] = steps / (t1 - t_first)
            res["cpu_s_per_token"] = (c1 - c0) / steps  # the decode steps only
            res["relay"] = bool(r.relay)
            if bool(r.relay) != relay:
                raise RuntimeError(f"asked for relay={relay}, the route ran relay={r.relay}")
            if relay:
                res["relay_steps"] = r.relay_steps - relayed0
                if width is not None:
                    res["relay_frame_bytes_computed"] = [relay_frame_bytes(r, s, width, k)
                                                         for k in range(len(r.stages) - 1)]
            else:
                b1 = [(st.bytes_sent, st.bytes_received) for st in s.stats]
                if len(b0) != len(b1):
                    raise RuntimeError("the route changed its stages while decoding")
                # gRPC message bytes the driver sent to / received from each stage per step
                res["stage_bytes_per_token"] = [[(b[0] - a[0]) / steps, (b[1] - a[1]) / steps]
                                                for a, b in zip(b0, b1)]
            res["tokens"] = toks
            if stage_pids is not None:
                st = r.stages
                if relay:  # stage k -> stage k+1's data port
                    senders = [(stage_pids[st[k].endpoint], _port(st[k + 1].data_endpoint))
                               for k in range(len(st) - 1)]
                else:  # the driver -> stage k+1's gRPC port
                    senders = [(os.getpid(), _port(st[k + 1].endpoint))
                               for k in range(len(st) - 1)]
                res["seam_bytes_per_token"] = await _seam_bytes(
                    r, s, senders, prompts[N_PROMPT_DECODE], n_decode)
        finally:
            await s.close()
    return res


def route_measure(cluster, n_decode: int = N_DECODE, prefills=PREFILLS, relay: bool = False,
                  width: int | None = None, seam_bytes: bool = True) -> dict:
    """``_route_measure`` over ``cluster`` (``endpoints`` and ``workers``, in stage order);
    ``seam_bytes``: also measure the bytes per seam (an untimed pass more)."""
    workers = [w.proc.pid for w in cluster.workers]
    eps = list(cluster.endpoints)
    if len(eps) != len(workers):
        raise RuntimeError(f"{len(eps)} endpoints for {len(workers)} workers")
    return asyncio.run(_route_measure(eps, [os.getpid(), *workers], n_decode, prefills, relay,
                                      width, dict(zip(eps, workers)) if seam_bytes else None))


def session_tpot_ms(gens) -> list[float]:
    """Each session's time per output token (ms): its ``decode_s`` (from its first token to
    its last) over the tokens after the first; a session of one token has none (raises)."""
    out = []
    for g in gens:
        n = len(g.tokens) - 1
        if n < 1 or g.decode_s <= 0:
            raise ValueError(f"a session of {len(g.tokens)} tokens has no decode steps")
        out.append(1e3 * g.decode_s / n)
    return out


async def _sessions_measure(endpoints, k: int, n_decode: int, relay: bool) -> dict:
    from dgr.driver.route import AsyncRoute

    async with AsyncRoute(endpoints, **route_kwargs(relay)) as r:
        await r.complete(session_prompt(0), max_tokens=2, stop_on_eog=False)  # warm up
        t0 = time.perf_counter()
        gens = await asyncio.gather(*(r.complete(session_prompt(i), max_tokens=n_decode,
                                                 stop_on_eog=False) for i in range(k)))
        wall = time.perf_counter() - t0
    total = sum(len(g.tokens) for g in gens)
    per = [g.decode_tokens_per_s for g in gens]
    tpot = session_tpot_ms(gens)
    return {"sessions": k, "wall_s": wall, "tokens": total,
            "aggregate_tps": total / wall,
            "decode_tps": decode_tps([g.token_times for g in gens]),
            "per_session_tps": statistics.median(per),
            "per_session_tps_min": min(per),
            "tpot_ms_p50": statistics.median(tpot), "tpot_ms_max": max(tpot),
            "ttft_ms": 1e3 * statistics.median(g.time_to_first_token_s for g in gens),
            "session_tokens": [list(g.tokens) for g in gens]}


def sessions_measure(cluster, k: int, n_decode: int, relay: bool) -> dict:
    return asyncio.run(_sessions_measure(cluster.endpoints, k, n_decode, relay))


def session_parity(tokens: list[list[int]], refs: list[list[int]]) -> tuple[bool, int]:
    """(every session's tokens equal its reference, sessions checked): all of them."""
    if len(tokens) > len(refs):
        raise ValueError(f"{len(tokens)} sessions, references for {len(refs)}")
    return all(t == refs[i] for i, t in enumerate(tokens)), len(tokens)


def whole_tokens(prompts, n: int, n_slots: int = 1) -> list[list[int]]:
    """Greedy tokens (``n`` each) of the whole model for each prompt, in this process, with
    SETTINGS and ``n_slots`` slots (the settings of the cluster it is the reference of)."""
    import dgr
    from dgr.core.local import generate_local

    eng = dgr.Engine(model_path(), **{**SETTINGS, "n_slots": n_slots})
    out = []
    for p in prompts:
        toks, _ = generate_local(eng, p, max_tokens=n, stop_on_eog=False)
        out.append([int(t) for t in toks])
        eng.release(0)
    return out


def whole_tokens_in_own_process(prompts, n: int, n_slots: int = 1) -> list[list[int]]:
    return fresh.call("compare", "whole_tokens", [[int(t) for t in p] for p in prompts], n,
                      n_slots)


# --- the comparison --------------------------------------------------------------------------

METRICS = ["decode_tps", *(f"prefill{n}_tps" for n in PREFILLS), "ttft_ms"]


def run_compare(stages=(2, 3, 4), rounds: int = 3, n_decode: int = N_DECODE,
                prefills=PREFILLS, rpc: bool = True, llama: bool = True,
                bench_args=(), log=None, rtts=(), rtt_stages=(3,), relay: bool = True,
                sessions=(), session_stages=(3,), whole: bool = True,
                batched: bool | None = None) -> dict:
    """Start everything, run ``rounds`` interleaved rounds, stop everything; medians.

    ``relay``: also drive each dgr cluster with ``AsyncRoute(relay=True)`` ("relay<k>").
    ``rtts`` (ms): also run the ``rtt_stages`` configurations through link emulators (gRPC
    and data plane). ``sessions``: concurrent-session counts run on ``session_stages``
    clusters started with that many slots (dgr<k> and relay<k>), and in the same rounds
    ``llama-batched-bench`` on the whole model with the clusters' settings at one stage's
    thread count and at each cluster's total (``batched_bench_threads``); ``batched``: run it
    (default: ``llama``; False skips it, logged). ``whole``: run the whole-model row (False
    only without ``stages`` and ``rtts``, whose parity is taken against it). The result's
    ``ran`` says what each row family ran (settings and command lines).
    """
    import dgr

    log = log or (lambda m: None)
    if not whole and (stages or rtts):
        raise ValueError("the dgr<k> and @RTT rows need the whole model's row (parity)")
    batched = llama if batched is None else batched
    path = model_path()
    eng = dgr.Engine(path, **SETTINGS)
    n_layer, width = eng.n_layer, eng.n_embd_boundary
    settings = dict(eng.settings)  # what dgr runs: SETTINGS and the engine's defaults
    del eng
    bench = "llama-bench"
    if llama or rpc:
        bench = tool("llama-bench")
        # refuse lengths or settings llama-bench cannot mirror before starting anything
        llama_bench_commands(settings, n_decode, prefills, path, exe=bench, extra=bench_args)
    kinds = ["dgr", "relay"] if relay else ["dgr"]
    ran: dict[str, list[str]] = {} if not whole else {
        "whole": [f"dgr.Engine({path!r}, **{SETTINGS}) in a fresh process (settings "
                  f"{settings}); decode: generate_local's greedy loop, {n_decode} steps after "
                  f"a {N_PROMPT_DECODE}-token prompt, timed and CPU from the first token to the "
                  f"last; prefill n: n / wall of generate_local(prompt n, max_tokens=1)"]}
    for kind in kinds:
        ran[f"{kind}<k>"] = [f"AsyncRoute(endpoints, **{route_kwargs(kind == 'relay')}) over "
                             f"the workers below; decode timed and CPU (driver + workers) from "
                             f"the first token to the last; prefill n: n / wall from "
                             f"s.generate(prompt n, max_tokens=1) to its first token"]
    if llama:
        ran["llama-bench"] = [shlex.join(c) for c in llama_bench_commands(
            settings, n_decode, prefills, path, exe=bench, extra=bench_args).values()]
    clusters, servers, emus, emu_clusters, sess_clusters = {}, {}, {}, {}, {}
    samples: dict[str, list[dict]] = {}
    sess: dict[str, dict[int, list[dict]]] = {}
    try:
        for n in sorted(set(stages)):
            log(f"starting {n} dgr workers ...")
            clusters[n] = start_cluster(path, n, n_layer)
            ran[f"workers of dgr{n}/relay{n}"] = worker_lines(clusters[n])
        for n in sorted(set(stages) | (set(rtt_stages) if rtts else set())):
            if rpc:
                log(f"starting {n} ggml-rpc-servers ...")
                servers[n] = RpcServers(n, settings["n_threads"])
                servers[n].start()
                ran[f"rpc{n}"] = [shlex.join(c) for c in servers[n].commands] + [
                    shlex.join(c) for c in llama_bench_commands(
                        settings, n_decode, prefills, path, exe=bench,
                        rpc=servers[n].endpoints, extra=bench_args).values()]
        if rtts:
            for n in rtt_stages:
                log(f"starting {n} dgr workers behind link emulators (gRPC + data plane) ...")
                emu_clusters[n] = EmulatedCluster(path, n, n_layer, rtts[0]).start()
                ran[f"workers of dgr{n}@R/relay{n}@R (behind linkemu, RTT/2 each way, both "
                    f"planes)"] = worker_lines(emu_clusters[n])
        for rtt in rtts:
            for n in rtt_stages:
                if rpc:
                    log(f"starting link emulators, RTT {rtt:g} ms, {n} rpc servers ...")
                    emus[("rpc", n, rtt)] = Emulated(servers[n].endpoints, rtt)
                    emus[("rpc", n, rtt)].start()
                    ran[f"rpc{n}@{rtt:g}ms (llama-bench --rpc through linkemu)"] = [
                        shlex.join(c) for c in llama_bench_commands(
                            settings, n_decode, prefills, path, exe=bench,
                            rpc=emus[("rpc", n, rtt)].endpoints, extra=bench_args).values()]
        session_refs: dict[int, list[list[int]]] = {}
        bb_cmds: dict[int, list[str]] = {}  # llama-batched-bench command line per -t
        bb_same: dict[str, int] = {}  # each session cluster's "same total threads" -t
        if sessions:
            n_slots = max(sessions)
            sess_settings = {**settings, "n_slots": n_slots}
            if batched:
                bb = tool("llama-batched-bench")
                for n in session_stages:
                    one, same = batched_bench_threads(n, settings["n_threads"],
                                                      os.cpu_count() or 1)
                    for kind in kinds:
                        bb_same[f"{kind}{n}"] = same
                    for t in (one, same):
                        bb_cmds[t] = batched_bench_command(sess_settings, sessions, n_decode,
                                                           t, path, exe=bb)
                bb_cmds = dict(sorted(bb_cmds.items()))
                ran["llama-batched-bench (the whole model, the session clusters' settings)"] = [
                    shlex.join(c) for c in bb_cmds.values()]
            else:
                log("llama-batched-bench skipped: the llama.cpp tools are not wanted "
                    "(--no-llama-bench / --no-batched-bench)")
            for n in session_stages:
                log(f"starting {n} dgr workers with {n_slots} slots ...")
                sess_clusters[n] = start_cluster(path, n, n_layer, n_slots=n_slots)
                ran[f"workers of sessions dgr{n}/relay{n}"] = worker_lines(sess_clusters[n])
            # parity references of every session, with the clusters' settings (n_slots)
            log(f"parity references of {n_slots} sessions ({n_slots} slots) ...")
            session_refs[n_slots] = whole_tokens_in_own_process(
                [session_prompt(i) for i in range(n_slots)], n_decode, n_slots)
            ran["sessions reference"] = [
                f"dgr.Engine(**{ {**SETTINGS, 'n_slots': n_slots} }): generate_local of each "
                f"session's prompt, {n_decode} tokens, in a fresh process"]
        bb_samples: dict[int, list[dict]] = {}
        for r in range(rounds):
            if whole:
                w = whole_in_own_process(n_decode, prefills)
                samples.setdefault("whole", []).append(w)
            if llama:
                samples.setdefault("llama-bench", []).append(llama_bench(
                    llama_bench_commands(settings, n_decode, prefills, path, exe=bench,
                                         extra=bench_args), settings))
            for n in stages:
                for kind in kinds:
                    m = route_measure(clusters[n], n_decode, prefills, kind == "relay", width)
                    m["parity"] = m["tokens"] == w["tokens"]
                    samples.setdefault(f"{kind}{n}", []).append(m)
                if rpc:
                    samples.setdefault(f"rpc{n}", []).append(llama_bench(llama_bench_commands(
                        settings, n_decode, prefills, path, exe=bench,
                        rpc=servers[n].endpoints, extra=bench_args), settings, rpc=True))
            for rtt in rtts:
                for n in rtt_stages:
                    emu_clusters[n].set_rtt(rtt)
                    for kind in kinds:
                        m = route_measure(emu_clusters[n], n_decode, prefills,
                                          kind == "relay", width)
                        m["parity"] = m["tokens"] == w["tokens"]
                        samples.setdefault(f"{kind}{n}@{rtt:g}ms", []).append(m)
                    if rpc:
                        samples.setdefault(f"rpc{n}@{rtt:g}ms", []).append(llama_bench(
                            llama_bench_commands(settings, n_decode, prefills, path, exe=bench,
                                                 rpc=emus[("rpc", n, rtt)].endpoints,
                                                 extra=bench_args), settings, rpc=True))
            for n in sess_clusters:
                refs = session_refs[max(sessions)]
                for kind in kinds:
                    for k in sessions:
                        m = sessions_measure(sess_clusters[n], k, n_decode, kind == "relay")
                        m["parity"], m["parity_checked"] = session_parity(
                            m.pop("session_tokens"), refs)
                        sess.setdefault(f"{kind}{n}", {}).setdefault(k, []).append(m)
            for t, cmd in bb_cmds.items():
                bb_samples.setdefault(t, []).append(batched_bench(
                    cmd, sess_settings, sessions, n_decode, t))
            log(f"round {r + 1}/{rounds} done (load {os.getloadavg()[0]:.2f})")
    finally:
        for e in emus.values():
            e.stop()
        for c in (*clusters.values(), *emu_clusters.values(), *sess_clusters.values()):
            c.stop()
        for s in servers.values():
            s.stop()
    out = summarize(samples, stages, rounds, n_decode, prefills,
                    [f"{n}@{r:g}ms" for r in rtts for n in rtt_stages], settings=settings)
    out["sessions"] = summarize_sessions(sess)
    out["session_settings"] = {**settings, "n_slots": max(sessions)} if sessions else None
    out["batched_bench"] = summarize_batched_bench(bb_samples)
    out["batched_bench_same_threads"] = bb_same
    out["batched_bench_records"] = {f"t{t}": [{k: m["record"] for k, m in r.items()}
                                              for r in rounds_]
                                    for t, rounds_ in bb_samples.items()}
    out["sessions_ratios"] = session_ratios(out["sessions"], out["batched_bench"])
    out["ran"] = ran
    return out


def parse_config(name: str):
    """``"relay3@20ms"`` -> ("relay", 3, 20.0); ``"dgr2"`` -> ("dgr", 2, None);
    ``"whole"`` -> ("whole", None, None)."""
    m = re.fullmatch(r"([a-z-]+?)(\d+)?(?:@([\d.]+)ms)?", name)
    if not m:
        return name, None, None
    kind, n, rtt = m.groups()
    return kind, (int(n) if n else None), (float(rtt) if rtt else None)


#: the whole-model row each family's ratios and added ms are taken against (the same tool)
BASELINE = {"dgr": "whole", "relay": "whole", "rpc": "llama-bench"}


def summarize(samples, stages, rounds, n_decode, prefills, emulated=(), model=None,
              settings=None) -> dict:
    def med(rows, key):
        vals = [x[key] for x in rows if x.get(key) is not None]
        return statistics.median(vals) if vals else None

    def med_list(rows, key):
        lists = [x[key] for x in rows if x.get(key) is not None]
        if not lists or any(len(v) != len(lists[0]) for v in lists):
            return None
        return [statistics.median(v[i] for v in lists) for i in range(len(lists[0]))]

    out = {"model": model_path() if model is None else model,
           "settings": SETTINGS if settings is None else settings, "rounds": rounds,
           "n_decode": n_decode, "n_prompt_decode": N_PROMPT_DECODE,
           "prefills": list(prefills), "loadavg": os.getloadavg(), "baselines": BASELINE,
           "configs": {}, "ratios": {}, "added_ms_per_stage": {}, "rtt_model": {}}
    for name, rows in samples.items():
        c = {k: med(rows, k) for k in (*METRICS, "cpu_s_per_token")}
        if name.startswith(("dgr", "relay")):
            c["parity"] = all(x["parity"] for x in rows)
            for key in ("seam_bytes_per_token", "relay_frame_bytes_computed"):
                v = med_list(rows, key)
                if v is not None:
                    c[key] = v
        c["samples"] = [{k: v for k, v in x.items() if k != "tokens"} for x in rows]
        out["configs"][name] = c
    cf = out["configs"]

    def ratio(a, b, name):
        if a is not None and b is not None:
            out["ratios"][name] = {
                k: (a[k] / b[k] if a.get(k) and b.get(k) else None) for k in METRICS}

    ratio(cf.get("whole"), cf.get("llama-bench"), "whole/llama-bench")
    for n in [*stages, *emulated]:
        for kind in ("dgr", "relay"):
            d = cf.get(f"{kind}{n}")
            for base in (BASELINE[kind], f"rpc{n}"):
                ratio(d, cf.get(base), f"{kind}{n}/{base}")
        ratio(cf.get(f"relay{n}"), cf.get(f"dgr{n}"), f"relay{n}/dgr{n}")
        ratio(cf.get(f"rpc{n}"), cf.get(BASELINE["rpc"]), f"rpc{n}/{BASELINE['rpc']}")
    for name, c in cf.items():
        kind, n, rtt = parse_config(name)
        w = (cf.get(BASELINE.get(kind, "")) or {}).get("decode_tps")
        if not w or not n or not c.get("decode_tps"):
            continue
        tpot, base = 1e3 / c["decode_tps"], 1e3 / w
        out["added_ms_per_stage"][name] = (tpot - base) / n
        if rtt is not None and kind in ("dgr", "relay"):
            s = seams_model(kind, n, n_decode)
            model = base + s * rtt
            out["rtt_model"][name] = {"rtt_ms": rtt, "S": s, "C_ms": base, "tpot_ms": tpot,
                                      "model_tpot_ms": model, "ratio": tpot / model,
                                      "excess_ms_per_link": (tpot - model) / n}
    return out


def summarize_sessions(sess: dict) -> dict:
    """{config: {k: medians of the concurrent-session runs}}."""
    out = {}
    for name, by_k in sess.items():
        for k, rows in sorted(by_k.items()):
            out.setdefault(name, {})[k] = {
                key: statistics.median(x[key] for x in rows)
                for key in ("aggregate_tps", "decode_tps", "per_session_tps",
                            "per_session_tps_min", "tpot_ms_p50", "tpot_ms_max", "ttft_ms",
                            "wall_s")
                if all(x.get(key) is not None for x in rows)} | {
                "parity": all(x["parity"] for x in rows),
                "parity_checked": min(x["parity_checked"] for x in rows),
                "tokens": rows[0]["tokens"]}
    return out


def summarize_batched_bench(runs: dict[int, list[dict]]) -> dict[str, dict[int, dict]]:
    """{"t<threads>": {sequences: medians over rounds of aggregate_tps, tpot_ms,
    prefill_tps}} of ``parse_batched_bench`` results per thread count."""
    out: dict[str, dict[int, dict]] = {}
    for t, rounds in sorted(runs.items()):
        for k in sorted({k for r in rounds for k in r}):
            rows = [r[k] for r in rounds if k in r]
            out.setdefault(f"t{t}", {})[k] = {
                key: statistics.median(x[key] for x in rows)
                for key in ("aggregate_tps", "tpot_ms", "prefill_tps")} | {"rounds": len(rows)}
    return out


def session_ratios(sessions: dict, bb: dict) -> dict[str, dict[int, float]]:
    """{"<config>/batched-bench-t<T>": {k: the decode-phase tokens/s of config with k
    sessions (``harness.measure.decode_tps``; output tokens over the wall time in results
    from before token times) over llama-batched-bench's S_TG at k sequences, -t T}} for
    every config, k and T measured."""
    out: dict[str, dict[int, float]] = {}
    for name, by_k in sessions.items():
        for t, by_pl in bb.items():
            for k, m in by_k.items():
                ref = by_pl.get(k, {}).get("aggregate_tps")
                if ref:
                    out.setdefault(f"{name}/batched-bench-{t}", {})[k] = (
                        rate(m) / ref)
    return out


def _f(v, fmt="9.1f"):
    return f"{v:{fmt}}" if isinstance(v, (int, float)) else f"{'-':>{fmt.split('.')[0]}}"


def print_header(res: dict, file=sys.stdout) -> None:
    """What each row family ran: settings, lengths, command lines."""
    s = res["settings"]
    if res.get("configs"):
        print(f"\nsettings of every row: {s}; decode: {res['n_decode']} steps after a "
              f"{res.get('n_prompt_decode', N_PROMPT_DECODE)}-token prompt; prefill: "
              f"{', '.join(str(n) for n in res['prefills'])}-token prompts from an empty cache",
              file=file)
    if "llama-bench" in res.get("configs", {}):
        print("llama-bench: -b = -ub = n_ubatch (dgr's n_batch), its context = prompt + "
              "generation + depth (padded to 256 by llama.cpp: the same n_kv as dgr's n_ctx "
              "at every step of these lengths); it times llama_decode alone (no logits read, "
              "no sampling), random tokens; no TTFT or CPU", file=file)
    if res.get("session_settings"):
        print(f"\nsettings of the concurrent-session rows: {res['session_settings']}; each "
              f"session: a {res.get('n_prompt_decode', N_PROMPT_DECODE)}-token prompt, "
              f"{res['n_decode']} tokens", file=file)
    print("what each row ran:", file=file)
    for name, lines in res.get("ran", {}).items():
        print(f"  {name}:", file=file)
        for line in lines:
            print(f"    {line}", file=file)


def print_table(res: dict, file=sys.stdout) -> None:
    p = res["prefills"]
    la = res["loadavg"]
    print_header(res, file)
    if not res["configs"]:  # --only-sessions
        if res.get("sessions") or res.get("batched_bench"):
            print(f"\n{os.path.basename(res['model'])}, {res['n_decode']} tokens a session, "
                  f"median of {res['rounds']} rounds; load average {la[0]:.2f} {la[1]:.2f} "
                  f"{la[2]:.2f}\n" + sessions_table(res), file=file)
        return
    print(f"\n{os.path.basename(res['model'])}, {res['n_decode']} decode steps, "
          f"median of {res['rounds']} rounds; load average {la[0]:.2f} {la[1]:.2f} "
          f"{la[2]:.2f}", file=file)
    hdr = (f"{'configuration':<22} {'decode t/s':>10} " +
           " ".join(f"{'pp' + str(n) + ' t/s':>10}" for n in p) +
           f" {'TTFT ms':>8} {'CPU ms/tok':>10} {'seam B/tok':>11} {'parity':>6}")
    print(hdr, file=file)
    for name, c in res["configs"].items():
        seam = c.get("seam_bytes_per_token")
        seam = f"{statistics.mean(seam):11.0f}" if seam else f"{'-':>11}"
        cpu = c.get("cpu_s_per_token")
        par = {True: "yes", False: "NO"}.get(c.get("parity"), "-")
        print(f"{name:<22} {_f(c.get('decode_tps'), '10.1f')} " +
              " ".join(_f(c.get(f'prefill{n}_tps'), '10.1f') for n in p) +
              f" {_f(c.get('ttft_ms'), '8.1f')} "
              f"{_f(None if cpu is None else 1e3 * cpu, '10.2f')} {seam} {par:>6}",
              file=file)
    print("(pp t/s: whole, dgr, relay: n / wall time from the call that submits the prompt to "
          "its first token; llama-bench, rpc: n / llama-bench's prompt time. TTFT: that wall "
          "time for the first prefill. CPU ms/tok: the decode steps only, from the first token "
          "to the last; whole: its process, dgr/relay: the driver + the workers. seam B/tok: "
          "measured, TCP payload bytes per decode step from ss -tinp bytes_sent, mean over "
          "seams; relay: stage k -> stage k+1's data port; dgr: the driver -> stage k+1's "
          "gRPC port, HTTP/2 framing included)", file=file)
    computed = {name: c["relay_frame_bytes_computed"] for name, c in res["configs"].items()
                if c.get("relay_frame_bytes_computed")}
    for name, v in computed.items():
        print(f"computed, not measured: {name} relayed decode frame = 4 + len(wire.encode("
              f"Forward header with the hops ahead, zeros[1, n_embd] f32)) = "
              f"{', '.join(str(int(x)) for x in v)} B per seam", file=file)
    if res["ratios"]:
        print(f"\n{'ratio':<22} {'decode':>10} " +
              " ".join(f"{'pp' + str(n):>10}" for n in p) + f" {'TTFT':>8}", file=file)
        for name, rt in res["ratios"].items():
            print(f"{name:<22} {_f(rt.get('decode_tps'), '10.2f')} " +
                  " ".join(_f(rt.get(f'prefill{n}_tps'), '10.2f') for n in p) +
                  f" {_f(rt.get('ttft_ms'), '8.2f')}", file=file)
        print("(each family over the whole model of its own tool: dgr<k>, relay<k> over whole "
              "(dgr.Engine), rpc<k> over llama-bench; across tools: whole/llama-bench, "
              "<kind><k>/rpc<k>; TTFT ratio is of times (>1: slower))", file=file)
    if res.get("added_ms_per_stage"):
        print("\nadded ms/token per stage = (1000/decode_tps(cfg) - 1000/decode_tps(its "
              "whole row: whole for dgr/relay, llama-bench for rpc)) / n_stages (as llama.cpp "
              "RPC's per-server figure)", file=file)
        for name, v in res["added_ms_per_stage"].items():
            print(f"  {name:<20} {v:8.2f} ms", file=file)
    if res.get("rtt_model"):
        print(f"\nTPOT vs model C + S*RTT (C = whole-model ms/token; dgr: S = n, one driver "
              f"round trip per stage; relay: S = n/2 + ceil(N/{LOOP_WINDOW})/(2N), the decode "
              f"loop crosses n one-way links of RTT/2 a token and each loop window starts "
              f"from the driver, one link more)", file=file)
        print(f"  {'configuration':<20} {'RTT':>6} {'S':>6} {'TPOT ms':>9} {'model ms':>9} "
              f"{'ratio':>6} {'excess ms/link':>14}", file=file)
        for name, m in res["rtt_model"].items():
            print(f"  {name:<20} {m['rtt_ms']:6g} {m['S']:6.3f} {m['tpot_ms']:9.2f} "
                  f"{m['model_tpot_ms']:9.2f} {m['ratio']:6.2f} "
                  f"{m['excess_ms_per_link']:14.2f}", file=file)
    if res.get("sessions") or res.get("batched_bench"):
        print("\n" + sessions_table(res), file=file)


def sessions_table(res: dict) -> str:
    """The concurrent-session rows of ``run_compare``'s result: dgr/relay clusters and
    llama-batched-bench at each k, with each cluster's ratio to batched-bench at each -t."""
    bb = res.get("batched_bench", {})
    same = res.get("batched_bench_same_threads", {})
    ts = list(bb)  # "t1", "t2", ...
    same_ts = {f"t{t}" for t in same.values()}
    cols = [f"/bb-{t}" + (" same-thr" if t in same_ts else "") for t in ts]
    lines = ["concurrent sessions (k x r.complete(16-token prompt, max_tokens=N), asyncio.gather;"
             " aggr = all generated tokens / wall time (prefills included); S_TG-like = tokens/s "
             "while every session decoded; TPOT = a session's decode time / its tokens after "
             "the first, median and slowest session)"]
    if bb:
        lines.append("batched-bench-t<T>: llama-batched-bench on the whole model, the clusters' "
                     "settings (-c n_ctx x max(k) -no-kvu, -b -ub n_ubatch, -fa, f16 KV, -ngl 0),"
                     " k sequences of a 16-token prompt and N tokens each; aggr = its S_TG "
                     "(k*N / generation time), TPOT = generation time / N")
    if same:
        by_t: dict[int, list[str]] = {}
        for name, t in same.items():
            by_t.setdefault(t, []).append(name)
        lines.append("same-thr: the same total thread count as the route (one thread per stage,"
                     " capped at this machine's cores): " + "; ".join(
                         f"-t{t} for {', '.join(names)}" for t, names in sorted(by_t.items())))
    hdr = (f"  {'configuration':<17} {'k':>3} {'aggr t/s':>9} {'S_TG-like':>10} "
           f"{'TPOT p50 ms':>11} {'TPOT max ms':>11} {'TTFT ms':>8} "
           + " ".join(f"{c:>{max(len(c), 7)}}" for c in cols) + f" {'parity':>10}")
    lines.append(hdr)
    ratios = res.get("sessions_ratios", {})
    for name, by_k in res.get("sessions", {}).items():
        for k, m in by_k.items():
            par = ("yes" if m["parity"] else "NO") + f" ({m['parity_checked']})"
            rts = [ratios.get(f"{name}/batched-bench-{t}", {}).get(k) for t in ts]
            lines.append(
                f"  {name:<17} {k:>3} {m['aggregate_tps']:9.1f} "
                f"{_f(m.get('decode_tps'), '10.1f')} {_f(m.get('tpot_ms_p50'), '11.1f')} "
                f"{_f(m.get('tpot_ms_max'), '11.1f')} "
                f"{m['ttft_ms']:8.1f} " + " ".join(_f(r, f"{max(len(c), 7)}.2f")
                                                   for r, c in zip(rts, cols)) + f" {par:>10}")
    for t, by_pl in bb.items():
        for k, m in by_pl.items():
            lines.append(
                f"  {'batched-bench-' + t:<17} {k:>3} {'-':>9} {m['aggregate_tps']:10.1f} "
                f"{m['tpot_ms']:11.1f} {m['tpot_ms']:11.1f} {'-':>8} " +
                " ".join(f"{'-':>{max(len(c), 7)}}" for c in cols) + f" {'-':>10}")
    if res.get("sessions"):
        lines.append("  (parity (n): all n sessions checked against the whole model's greedy "
                     "tokens for their prompts, computed with the clusters' settings, n_slots "
                     "included; /bb-tT: S_TG-like (aggr in results without it) over "
                     "batched-bench-tT's S_TG at the same k)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = cli.parser(__doc__, stages="2,3,4", rounds=3, json=True)
    ap.add_argument("--tokens", type=int, default=N_DECODE, help="greedy decode steps")
    ap.add_argument("--quick", action="store_true",
                    help="1 round, 3 stages only (dgr3, relay3, rpc3), 32 decode steps, "
                         "128-token prefill")
    ap.add_argument("--no-rpc", action="store_true", help="skip llama.cpp RPC")
    ap.add_argument("--no-llama-bench", action="store_true",
                    help="skip llama-bench (whole and RPC)")
    ap.add_argument("--bench-args", default="",
                    help="extra llama-bench arguments, appended to every llama-bench command "
                         "(printed in the header; a record that departs from dgr's settings "
                         "is refused)")
    ap.add_argument("--rtt-ms", default="",
                    help="also run through link emulators at these RTTs, e.g. 5,20")
    ap.add_argument("--rtt-stages", default="3", help="stage counts run with --rtt-ms")
    ap.add_argument("--no-relay", action="store_true", help="skip the relay<k> configurations")
    ap.add_argument("--sessions", default="",
                    help="concurrent-session counts, e.g. 1,4,16 (dgr/relay, --session-stages)")
    ap.add_argument("--session-stages", default="3", help="stage counts run with --sessions")
    ap.add_argument("--no-batched-bench", action="store_true",
                    help="with --sessions: skip llama-batched-bench (also skipped with "
                         "--no-llama-bench)")
    ap.add_argument("--only-sessions", action="store_true",
                    help="run the --sessions rows only (and llama-batched-bench): no whole, "
                         "dgr<k>, relay<k>, rpc<k>, llama-bench or --rtt-ms rows")
    ap.add_argument("--model", help="run every row on this GGUF instead of SmolLM2 (e.g. the "
                                    "7B-shaped qwen2 of benches/qwen2_7b.py)")
    args = ap.parse_args(argv)
    global MODEL
    MODEL = args.model

    stages = [int(x) for x in args.stages.split(",") if x]
    rounds, n_decode, prefills = args.rounds, args.tokens, PREFILLS
    if args.quick:
        stages, rounds, n_decode, prefills = [3], 1, 32, (128,)
    sessions = [int(x) for x in args.sessions.split(",") if x]
    rtts = [float(x) for x in args.rtt_ms.split(",") if x]
    only = args.only_sessions
    if only and not sessions:
        ap.error("--only-sessions needs --sessions")
    if only:
        stages, rtts = [], []
    res = run_compare(stages, rounds, n_decode, prefills,
                      rpc=not (only or args.no_rpc or args.no_llama_bench),
                      llama=not (only or args.no_llama_bench),
                      bench_args=args.bench_args.split(),
                      log=lambda m: print(m, file=sys.stderr, flush=True),
                      rtts=rtts,
                      rtt_stages=[int(x) for x in args.rtt_stages.split(",") if x],
                      relay=not args.no_relay,
                      sessions=sessions,
                      session_stages=[int(x) for x in args.session_stages.split(",") if x],
                      whole=not only,
                      batched=not (args.no_llama_bench or args.no_batched_bench))
    res["command"] = " ".join([os.path.basename(sys.executable), *sys.argv])
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
