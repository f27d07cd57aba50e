"""Side by side on SmolLM2: the whole model, dgr routes of 2-4 stages (gRPC hop by hop and
direct relay) and llama.cpp RPC.

    python benches/compare.py [--rounds 3] [--stages 2,3,4] [--quick] [--json out.json]
                              [--rtt-ms 5,20 [--rtt-stages 3]] [--sessions 1,4,16]
                              [--no-relay] [--no-rpc] [--no-llama-bench]

Every process has one thread. Each round runs every configuration once, round-robin, and
the table reports medians over rounds, so a busy machine skews them alike.

* whole (dgr):   ``dgr.Engine`` in a fresh process each round (same settings as the
  workers): decode tokens/s over ``--tokens`` greedy steps after a 16-token prompt, prefill
  tokens/s of 128- and 512-token prompts (prompt / time to first token), TTFT of the
  128-token prompt, CPU seconds per decoded token.
* whole (llama-bench): upstream ``llama-bench -m M -t 1 -p 128,512 -n N -r 1 -o json``.
* dgr k:         a ``LocalCluster`` of k ``python -m dgr.worker`` processes on loopback (as
  ``dgr run`` starts them), driven through ``AsyncRoute`` (gRPC, the driver relays every
  boundary): the same measurements, plus the bytes of the boundary frame sent to each later
  stage per decode token (from the gRPC stream counters; each seam costs that frame once out
  and once back in), CPU s/token summed over the workers and this (driving) process from
  /proc/<pid>/stat, and parity: the route's greedy tokens equal the whole model's.
* relay k:       the same workers driven with ``AsyncRoute(relay=True)``: the driver sends
  each step to stage 1 over the TCP data plane, each stage forwards its boundary to the next,
  the last answers the driver; a prompt's chunks are all in flight at once (pipelined
  prefill). Same measurements; seam bytes = the relayed decode frame, computed as
  ``len(wire.encode(Forward(... relay=<hops ahead>, reply_to=...), zeros[1, n_embd] f32))``
  (``relay_frame_bytes``), crossing each seam once.
* rpc k:         k ``ggml-rpc-server -t 1`` on 127.0.0.1 and ``llama-bench --rpc ...``.

Ratios: dgr k / whole, relay k / whole, dgr k / rpc k, relay k / rpc k, relay k / dgr k.
Added ms/token per stage: (1000/decode_tps(cfg) - 1000/decode_tps(whole)) / n_stages, the
per-server figure llama.cpp RPC is quoted with (relay with its decode loop crosses n_stages
links a token: s1 -> ... -> sN -> s1, the driver only reads the tokens).

``--rtt-ms``: the ``--rtt-stages`` clusters are started again behind ``dgr.testing.linkemu``
processes (delay RTT/2 each way) on both planes: each worker binds its data plane on a chosen
port D and advertises P (``--data-port D --advertise-data-port P``), an emulator listens on P
and forwards to D, another fronts its gRPC port; the delay changes per RTT through the
emulators' ``delay`` command. dgr k@R and relay k@R are reported against the model
TPOT = C + S * RTT, C the whole model's ms/token, S = k/2 for relay (the decode loop crosses
k one-way links of RTT/2 a token: 1 -> 2 -> ... -> k -> 1) and S = k for dgr (one driver
round trip per stage): measured, model, ratio.

``--sessions 1,4,16``: ``--session-stages`` clusters started with that many slots; for dgr k
and relay k, k sessions at once (``asyncio.gather`` of ``r.complete`` with different 16-token
prompts, ``--tokens`` each): aggregate tokens/s (all generated tokens / wall) and the median
and slowest session's decode tokens/s; parity of the first and last session against the
whole model's greedy tokens for the same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchmarks.bench_route import start_cluster  # noqa: E402
from benchmarks.common import SEED, SETTINGS, prompt_tokens, smollm2_path  # noqa: E402

N_DECODE = 64
N_PROMPT_DECODE = 16
PREFILLS = (128, 512)
N_VOCAB = 49152
_TICK = os.sysconf("SC_CLK_TCK")


# --- helpers ---------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (seconds) from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14, 15 of stat(5)


def cpu_of(pids) -> float:
    return sum(cpu_seconds(p) for p in pids)


def _prompts():
    return {n: [int(t) for t in prompt_tokens(n, N_VOCAB)]
            for n in (N_PROMPT_DECODE, *PREFILLS)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the whole model in one process ----------------------------------------------------------

def whole_measure(n_decode: int = N_DECODE, prefills=PREFILLS) -> dict:
    """In this process: load the whole model and measure (call it in a fresh process)."""
    import dgr
    from dgr.chain import generate_local

    eng = dgr.Engine(smollm2_path(), **SETTINGS)
    prompts = _prompts()
    generate_local(eng, prompts[N_PROMPT_DECODE], max_tokens=2, stop_on_eog=False)  # warm up
    res = {}
    for n in prefills:
        t = {}
        generate_local(eng, prompts[n], max_tokens=1, stop_on_eog=False, timing=t)
        res[f"prefill{n}_tps"] = n / t["prefill_s"]
        if n == PREFILLS[0]:
            res["ttft_ms"] = 1e3 * t["prefill_s"]
    t = {}
    c0 = cpu_seconds(os.getpid())
    toks, _ = generate_local(eng, prompts[N_PROMPT_DECODE], max_tokens=n_decode + 1,
                             stop_on_eog=False, timing=t)
    c1 = cpu_seconds(os.getpid())
    res["decode_tps"] = t["decode_steps"] / t["decode_s"]
    res["cpu_s_per_token"] = (c1 - c0) / (n_decode + 1)  # prompt + steps: ~ the decode CPU
    res["tokens"] = toks
    return res


def whole_in_own_process(n_decode: int = N_DECODE, prefills=PREFILLS) -> dict:
    code = (f"import sys, json; sys.path.insert(0, {HERE!r}); import compare; "
            f"print(json.dumps(compare.whole_measure({n_decode}, {tuple(prefills)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


# --- dgr routes ------------------------------------------------------------------------------

def relay_frame_bytes(r, s, width: int, k: int) -> int:
    """Bytes of the relayed decode frame stage ``k`` sends to stage ``k + 1`` (0-based) of
    route ``r``, session ``s``: a ``wire.Forward`` header as the worker builds it (the hops
    still ahead, reply_to) plus one boundary row of ``width`` f32, through ``wire.encode``."""
    import numpy as np

    from dgr import wire

    nxt = r.stages[k + 1]
    hops = [wire.Hop(endpoint=st.data_endpoint, tokens=st.needs_token_ids)
            for st in r.stages[k + 2:]]
    h = wire.Forward(model=nxt.identity, session=s.id, epoch=s.epoch, first_pos=1000,
                     n_tokens=1, layer=nxt.layers[0],
                     tokens=[1000] if nxt.needs_token_ids else None, want="token",
                     relay=hops, reply_to=r.route_id, loop=r.loop_hops() if r.loop else None,
                     steps=N_DECODE if r.loop else 0)
    return len(wire.encode(h, np.zeros((1, width), np.float32)))


async def _route_measure(endpoints, pids, n_decode: int, prefills, relay: bool = False,
                         width: int | None = None) -> dict:
    from dgr.route import AsyncRoute

    prompts = _prompts()
    res = {}
    async with AsyncRoute(endpoints, relay=relay) as r:
        s = r.session()
        try:
            async for _ in s.generate(prompts[N_PROMPT_DECODE], max_tokens=2,
                                      stop_on_eog=False):  # warm up
                pass
            for n in prefills:
                t0 = time.perf_counter()
                async for _ in s.generate(prompts[n], max_tokens=1, stop_on_eog=False):
                    dt = time.perf_counter() - t0
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
            res["cpu_s_per_token"] = (c1 - c0) / steps
            if relay:
                # the frame each stage forwards to the next, computed (see relay_frame_bytes)
                res["relay_steps"] = r.relay_steps - relayed0
                res["seam_bytes_per_token"] = [relay_frame_bytes(r, s, width, k)
                                               for k in range(len(r.stages) - 1)]
            else:
                b1 = [(st.bytes_sent, st.bytes_received) for st in s.stats]
                # seam k: the boundary frame from stage k (received) sent on to stage k+1
                res["seam_bytes_per_token"] = [(b1[k + 1][0] - b0[k + 1][0]) / steps
                                               for k in range(len(b1) - 1)]
                res["stage_bytes_per_token"] = [[(b[0] - a[0]) / steps, (b[1] - a[1]) / steps]
                                                for a, b in zip(b0, b1)]
            res["tokens"] = toks
        finally:
            await s.close()
    return res


def route_measure(cluster, n_decode: int = N_DECODE, prefills=PREFILLS, relay: bool = False,
                  width: int | None = None) -> dict:
    pids = [os.getpid()] + [w.proc.pid for w in cluster.workers]
    return asyncio.run(_route_measure(cluster.endpoints, pids, n_decode, prefills, relay,
                                      width))


def session_prompt(i: int) -> list[int]:
    """The 16-token prompt of concurrent session ``i`` (a different seed per session)."""
    return [int(t) for t in prompt_tokens(N_PROMPT_DECODE, N_VOCAB, seed=SEED + 1 + i)]


async def _sessions_measure(endpoints, k: int, n_decode: int, relay: bool) -> dict:
    from dgr.route import AsyncRoute

    async with AsyncRoute(endpoints, relay=relay) as r:
        await r.complete(session_prompt(0), max_tokens=2, stop_on_eog=False)  # warm up
        t0 = time.perf_counter()
        gens = await asyncio.gather(*(r.complete(session_prompt(i), max_tokens=n_decode,
                                                 stop_on_eog=False) for i in range(k)))
        wall = time.perf_counter() - t0
    total = sum(len(g.tokens) for g in gens)
    per = [g.decode_tokens_per_s for g in gens]
    return {"sessions": k, "wall_s": wall, "tokens": total,
            "aggregate_tps": total / wall,
            "per_session_tps": statistics.median(per),
            "per_session_tps_min": min(per),
            "ttft_ms": 1e3 * statistics.median(g.time_to_first_token_s for g in gens),
            "session_tokens": [list(g.tokens) for g in gens]}


def sessions_measure(cluster, k: int, n_decode: int, relay: bool) -> dict:
    return asyncio.run(_sessions_measure(cluster.endpoints, k, n_decode, relay))


def whole_tokens(prompts, n: int) -> list[list[int]]:
    """Greedy tokens (``n`` each) of the whole model for each prompt, in this process."""
    import dgr
    from dgr.chain import generate_local

    eng = dgr.Engine(smollm2_path(), **SETTINGS)
    out = []
    for p in prompts:
        toks, _ = generate_local(eng, p, max_tokens=n, stop_on_eog=False)
        out.append([int(t) for t in toks])
        eng.release(0)
    return out


def whole_tokens_in_own_process(prompts, n: int) -> list[list[int]]:
    code = (f"import sys, json; sys.path.insert(0, {HERE!r}); import compare; "
            f"print(json.dumps(compare.whole_tokens({[list(p) for p in prompts]!r}, {n})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


# --- llama.cpp: llama-bench and ggml-rpc-server ----------------------------------------------

def tool(name: str) -> str:
    from dgr.vendor import Vendor

    p = Vendor().tool_path(name)
    if p is None or not os.path.exists(str(p)):
        raise FileNotFoundError(f"{name} is not built: python -m dgr.vendor build "
                                f"--tools llama-bench,ggml-rpc-server")
    return str(p)


def llama_bench(n_decode: int = N_DECODE, prefills=PREFILLS, rpc=None, extra=()) -> dict:
    """One ``llama-bench -t 1 -r 1 -o json`` run; {prefill<n>_tps, decode_tps}."""
    cmd = [tool("llama-bench"), "-m", smollm2_path(), "-t", "1",
           "-p", ",".join(str(n) for n in prefills), "-n", str(n_decode), "-r", "1",
           "-o", "json", *extra]
    if rpc:
        cmd += ["--rpc", ",".join(rpc)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    res = {}
    for rec in json.loads(out.stdout):
        if rec.get("n_gen", 0) == 0:
            res[f"prefill{rec['n_prompt']}_tps"] = float(rec["avg_ts"])
        elif rec.get("n_prompt", 0) == 0:
            res["decode_tps"] = float(rec["avg_ts"])
    return res


class RpcServers:
    """``n`` ``ggml-rpc-server -t 1 -H 127.0.0.1 -p PORT`` processes; stop() reaps them."""

    def __init__(self, n: int):
        self.n = n
        self.procs: list[subprocess.Popen] = []
        self.endpoints: list[str] = []

    def start(self, timeout: float = 30.0) -> list[str]:
        exe = tool("ggml-rpc-server")
        try:
            for _ in range(self.n):
                port = _free_port()
                self.procs.append(subprocess.Popen(
                    [exe, "-t", "1", "-H", "127.0.0.1", "-p", str(port)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, start_new_session=True))
                self.endpoints.append(f"127.0.0.1:{port}")
            deadline = time.monotonic() + timeout
            for ep, p in zip(self.endpoints, self.procs):
                host, port = ep.split(":")
                while True:
                    if p.poll() is not None:
                        raise RuntimeError(f"ggml-rpc-server on {ep} exited ({p.returncode})")
                    try:
                        socket.create_connection((host, int(port)), timeout=1).close()
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"ggml-rpc-server on {ep} did not listen")
                        time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


# --- the comparison --------------------------------------------------------------------------

METRICS = ["decode_tps", *(f"prefill{n}_tps" for n in PREFILLS), "ttft_ms"]


class Emulated:
    """A ``dgr.testing.linkemu`` process (delay RTT/2 each way, as benches/wan.py) in front
    of each endpoint; ``endpoints`` are the proxies. ``listens``: the ``host:port`` each
    proxy listens on (default: any free port)."""

    def __init__(self, targets, rtt_ms: float, listens=None):
        self.targets, self.rtt_ms = list(targets), rtt_ms
        self.listens = list(listens) if listens else ["127.0.0.1:0"] * len(self.targets)
        self.procs, self.endpoints = [], []

    def start(self, timeout: float = 30.0) -> list[str]:
        try:
            for ep, ls in zip(self.targets, self.listens):  # as wan._emulators, quieter
                p = subprocess.Popen([sys.executable, "-m", "dgr.testing.linkemu", "--target",
                                      ep, "--listen", ls, "--delay-ms", str(self.rtt_ms / 2)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
                self.procs.append(p)
                line = p.stdout.readline().split()
                if not line or line[0] != "LISTENING":
                    raise RuntimeError(f"link emulator for {ep} did not start")
                self.endpoints.append(line[1])
        except BaseException:
            self.stop()
            raise
        return self.endpoints

    def set_rtt(self, rtt_ms: float) -> None:
        """Change every proxy's delay to RTT/2 each way (waits for each one's OK)."""
        for p in self.procs:
            p.stdin.write(f"delay {rtt_ms / 2}\n")
            p.stdin.flush()
        for p in self.procs:
            if not p.stdout.readline().startswith("OK"):
                raise RuntimeError("link emulator did not take the new delay")
        self.rtt_ms = rtt_ms

    def stop(self) -> None:
        from wan import _stop

        _stop(self.procs)
        for p in self.procs:
            p.stdout.close()
        self.procs = []


class _Proxied:
    """A cluster seen through emulators (route_measure needs endpoints and workers)."""

    def __init__(self, cluster, emu: Emulated):
        self.workers, self.endpoints = cluster.workers, emu.endpoints


class EmulatedCluster:
    """``n`` workers behind link emulators on both planes, for relay=False and relay=True.

    Worker i binds its data plane on a chosen port D_i and advertises P_i
    (``--data-port D_i --advertise-data-port P_i``); a linkemu listens on P_i and forwards to
    D_i, another fronts its gRPC port. Every data-plane link (driver -> stage 1, stage k ->
    stage k+1, and the last stage's reply to the driver, which goes back over the driver's
    connection to P_n) then crosses one emulator one way: RTT/2.
    """

    def __init__(self, path: str, n: int, n_layer: int, rtt_ms: float):
        self.n, self.path, self.n_layer, self.rtt_ms = n, path, n_layer, rtt_ms
        self.cluster = self.grpc = self.data = None

    def start(self) -> EmulatedCluster:
        ports = [(_free_port(), _free_port()) for _ in range(self.n)]
        try:
            self.cluster = start_cluster(
                self.path, self.n, self.n_layer,
                worker_args=[["--data-port", str(d), "--advertise-data-port", str(p)]
                             for d, p in ports])
            self.data = Emulated([f"127.0.0.1:{d}" for d, _ in ports], self.rtt_ms,
                                 listens=[f"127.0.0.1:{p}" for _, p in ports])
            self.data.start()
            self.grpc = Emulated(self.cluster.endpoints, self.rtt_ms)
            self.grpc.start()
        except BaseException:
            self.stop()
            raise
        self.workers, self.endpoints = self.cluster.workers, self.grpc.endpoints
        return self

    def set_rtt(self, rtt_ms: float) -> None:
        self.grpc.set_rtt(rtt_ms)
        self.data.set_rtt(rtt_ms)
        self.rtt_ms = rtt_ms

    def stop(self) -> None:
        for e in (self.grpc, self.data):
            if e is not None:
                e.stop()
        if self.cluster is not None:
            self.cluster.stop()


def run_compare(stages=(2, 3, 4), rounds: int = 3, n_decode: int = N_DECODE,
                prefills=PREFILLS, rpc: bool = True, llama: bool = True,
                bench_args=(), log=None, rtts=(), rtt_stages=(3,), relay: bool = True,
                sessions=(), session_stages=(3,)) -> dict:
    """Start everything, run ``rounds`` interleaved rounds, stop everything; medians.

    ``relay``: also drive each dgr cluster with ``AsyncRoute(relay=True)`` ("relay<k>").
    ``rtts`` (ms): also run the ``rtt_stages`` configurations through link emulators (gRPC
    and data plane). ``sessions``: concurrent-session counts run on ``session_stages``
    clusters started with that many slots (dgr<k> and relay<k>).
    """
    import dgr

    log = log or (lambda m: None)
    path = smollm2_path()
    eng = dgr.Engine(path, **SETTINGS)
    n_layer, width = eng.n_layer, eng.n_embd_boundary
    del eng
    clusters, servers, emus, emu_clusters, sess_clusters = {}, {}, {}, {}, {}
    samples: dict[str, list[dict]] = {}
    sess: dict[str, dict[int, list[dict]]] = {}
    ref_tokens = None
    kinds = ["dgr", "relay"] if relay else ["dgr"]
    try:
        for n in sorted(set(stages)):
            log(f"starting {n} dgr workers ...")
            clusters[n] = start_cluster(path, n, n_layer)
        for n in sorted(set(stages) | (set(rtt_stages) if rtts else set())):
            if rpc:
                log(f"starting {n} ggml-rpc-servers ...")
                servers[n] = RpcServers(n)
                servers[n].start()
        if rtts:
            for n in rtt_stages:
                log(f"starting {n} dgr workers behind link emulators (gRPC + data plane) ...")
                emu_clusters[n] = EmulatedCluster(path, n, n_layer, rtts[0]).start()
        for rtt in rtts:
            for n in rtt_stages:
                if rpc:
                    log(f"starting link emulators, RTT {rtt:g} ms, {n} rpc servers ...")
                    emus[("rpc", n, rtt)] = Emulated(servers[n].endpoints, rtt)
                    emus[("rpc", n, rtt)].start()
        session_refs = {}
        if sessions:
            for n in session_stages:
                log(f"starting {n} dgr workers with {max(sessions)} slots ...")
                sess_clusters[n] = start_cluster(path, n, n_layer, n_slots=max(sessions))
            # parity references: the first and the last session of every count
            idx = sorted({0} | {k - 1 for k in sessions})
            refs = whole_tokens_in_own_process([session_prompt(i) for i in idx], n_decode)
            session_refs = dict(zip(idx, refs))
        for r in range(rounds):
            w = whole_in_own_process(n_decode, prefills)
            ref_tokens = ref_tokens or w["tokens"]
            samples.setdefault("whole", []).append(w)
            if llama:
                samples.setdefault("llama-bench", []).append(
                    llama_bench(n_decode, prefills, extra=bench_args))
            for n in stages:
                for kind in kinds:
                    m = route_measure(clusters[n], n_decode, prefills, kind == "relay", width)
                    m["parity"] = m["tokens"] == w["tokens"]
                    samples.setdefault(f"{kind}{n}", []).append(m)
                if rpc:
                    samples.setdefault(f"rpc{n}", []).append(
                        llama_bench(n_decode, prefills, servers[n].endpoints, bench_args))
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
                            n_decode, prefills, emus[("rpc", n, rtt)].endpoints, bench_args))
            for n in sess_clusters:
                for kind in kinds:
                    for k in sessions:
                        m = sessions_measure(sess_clusters[n], k, n_decode, kind == "relay")
                        toks = m.pop("session_tokens")
                        checked = [i for i in (0, k - 1) if i in session_refs]
                        m["parity"] = all(toks[i] == session_refs[i] for i in checked)
                        m["parity_checked"] = sorted(set(checked))
                        sess.setdefault(f"{kind}{n}", {}).setdefault(k, []).append(m)
            log(f"round {r + 1}/{rounds} done (load {os.getloadavg()[0]:.2f})")
    finally:
        for e in emus.values():
            e.stop()
        for c in (*clusters.values(), *emu_clusters.values(), *sess_clusters.values()):
            c.stop()
        for s in servers.values():
            s.stop()
    out = summarize(samples, stages, rounds, n_decode, prefills,
                    [f"{n}@{r:g}ms" for r in rtts for n in rtt_stages])
    out["sessions"] = summarize_sessions(sess)
    return out


def parse_config(name: str):
    """``"relay3@20ms"`` -> ("relay", 3, 20.0); ``"dgr2"`` -> ("dgr", 2, None);
    ``"whole"`` -> ("whole", None, None)."""
    m = re.fullmatch(r"([a-z-]+?)(\d+)?(?:@([\d.]+)ms)?", name)
    if not m:
        return name, None, None
    kind, n, rtt = m.groups()
    return kind, (int(n) if n else None), (float(rtt) if rtt else None)


def seams_model(kind: str, n: int) -> float:
    """S in TPOT = C + S * RTT: round trips a decode token pays for ``n`` stages.

    relay (with the decode loop, the default): n one-way links a token (1 -> 2 -> ... -> n
    -> 1; the driver only reads), each RTT/2: n/2.
    dgr (gRPC hop by hop, the driver relays): one driver round trip per stage: n."""
    return n / 2 if kind == "relay" else float(n)


def summarize(samples, stages, rounds, n_decode, prefills, emulated=(), model=None) -> dict:
    def med(rows, key):
        vals = [x[key] for x in rows if key in x]
        return statistics.median(vals) if vals else None

    out = {"model": smollm2_path() if model is None else model, "settings": SETTINGS, "rounds": rounds,
           "n_decode": n_decode, "prefills": list(prefills), "loadavg": os.getloadavg(),
           "configs": {}, "ratios": {}, "added_ms_per_stage": {}, "rtt_model": {}}
    for name, rows in samples.items():
        c = {k: med(rows, k) for k in (*METRICS, "cpu_s_per_token")}
        if name.startswith(("dgr", "relay")):
            c["parity"] = all(x["parity"] for x in rows)
            c["seam_bytes_per_token"] = [statistics.median(v) for v in
                                         zip(*(x["seam_bytes_per_token"] for x in rows))]
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
            for base in ("whole", f"rpc{n}"):
                ratio(d, cf.get(base), f"{kind}{n}/{base}")
        ratio(cf.get(f"relay{n}"), cf.get(f"dgr{n}"), f"relay{n}/dgr{n}")
        ratio(cf.get(f"rpc{n}"), cf.get("whole"), f"rpc{n}/whole")
    w = (cf.get("whole") or {}).get("decode_tps")
    for name, c in cf.items():
        kind, n, rtt = parse_config(name)
        if not w or not n or not c.get("decode_tps"):
            continue
        tpot, base = 1e3 / c["decode_tps"], 1e3 / w
        out["added_ms_per_stage"][name] = (tpot - base) / n
        if rtt is not None and kind in ("dgr", "relay"):
            s = seams_model(kind, n)
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
                for key in ("aggregate_tps", "per_session_tps", "per_session_tps_min",
                            "ttft_ms", "wall_s")} | {
                "parity": all(x["parity"] for x in rows),
                "parity_checked": rows[0]["parity_checked"], "tokens": rows[0]["tokens"]}
    return out


def _f(v, fmt="9.1f"):
    return f"{v:{fmt}}" if isinstance(v, (int, float)) else f"{'-':>{fmt.split('.')[0]}}"


def print_table(res: dict, file=sys.stdout) -> None:
    p = res["prefills"]
    la = res["loadavg"]
    print(f"\nSmolLM2 {os.path.basename(res['model'])}, {res['settings']}, "
          f"{res['n_decode']} decode steps, median of {res['rounds']} rounds; "
          f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}", file=file)
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
    if res["ratios"]:
        print(f"\n{'ratio':<22} {'decode':>10} " +
              " ".join(f"{'pp' + str(n):>10}" for n in p) + f" {'TTFT':>8}", file=file)
        for name, rt in res["ratios"].items():
            print(f"{name:<22} {_f(rt.get('decode_tps'), '10.2f')} " +
                  " ".join(_f(rt.get(f'prefill{n}_tps'), '10.2f') for n in p) +
                  f" {_f(rt.get('ttft_ms'), '8.2f')}", file=file)
    print("(whole = dgr.Engine in one process; dgr<k> = k workers, the driver relays each "
          "boundary over gRPC; relay<k> = the same workers with AsyncRoute(relay=True): "
          "stage to stage over the data plane, prefill chunks pipelined; TTFT ratio is of "
          "times (>1: slower); llama-bench/rpc TTFT and CPU are not measured; seam B/tok = "
          "boundary frame bytes sent to a later stage per decode token, mean over seams: "
          "dgr measured from the gRPC stream counters, relay computed as len(wire.encode("
          "Forward header with the hops ahead, zeros[1, n_embd] f32)))", file=file)
    if res.get("added_ms_per_stage"):
        print("\nadded ms/token per stage = (1000/decode_tps(cfg) - 1000/decode_tps(whole)) "
              "/ n_stages (as llama.cpp RPC's per-server figure; with relay's decode loop a token "
              "crosses n_stages links, s1 -> ... -> sN -> s1)", file=file)
        for name, v in res["added_ms_per_stage"].items():
            print(f"  {name:<20} {v:8.2f} ms", file=file)
    if res.get("rtt_model"):
        print("\nTPOT vs model C + S*RTT (C = whole-model ms/token; S = n/2 for relay: the decode "
              "loop crosses n one-way links of RTT/2; S = n for dgr: one driver round trip per "
              "stage)",
              file=file)
        print(f"  {'configuration':<20} {'RTT':>6} {'S':>5} {'TPOT ms':>9} {'model ms':>9} "
              f"{'ratio':>6} {'excess ms/link':>14}", file=file)
        for name, m in res["rtt_model"].items():
            print(f"  {name:<20} {m['rtt_ms']:6g} {m['S']:5.1f} {m['tpot_ms']:9.2f} "
                  f"{m['model_tpot_ms']:9.2f} {m['ratio']:6.2f} "
                  f"{m['excess_ms_per_link']:14.2f}", file=file)
    if res.get("sessions"):
        print("\nconcurrent sessions (k x r.complete(16-token prompt, max_tokens=N), "
              "asyncio.gather; aggregate = all generated tokens / wall time)", file=file)
        print(f"  {'configuration':<12} {'k':>3} {'aggr t/s':>9} {'per-session t/s':>16} "
              f"{'min t/s':>8} {'TTFT ms':>8} {'parity':>8}", file=file)
        for name, by_k in res["sessions"].items():
            for k, m in by_k.items():
                par = ("yes" if m["parity"] else "NO") + \
                    f"({','.join(str(i) for i in m['parity_checked'])})"
                print(f"  {name:<12} {k:>3} {m['aggregate_tps']:9.1f} "
                      f"{m['per_session_tps']:16.1f} {m['per_session_tps_min']:8.1f} "
                      f"{m['ttft_ms']:8.1f} {par:>8}", file=file)
        print("  (parity(i,j): sessions i and j checked against the whole model's greedy "
              "tokens)", file=file)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=N_DECODE, help="greedy decode steps")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--quick", action="store_true",
                    help="1 round, 3 stages only (dgr3, relay3), 32 decode steps, "
                         "128-token prefill")
    ap.add_argument("--no-rpc", action="store_true", help="skip llama.cpp RPC")
    ap.add_argument("--no-llama-bench", action="store_true",
                    help="skip llama-bench (whole and RPC)")
    ap.add_argument("--bench-args", default="",
                    help="extra llama-bench arguments, e.g. '-fa 1 -ub 64'")
    ap.add_argument("--rtt-ms", default="",
                    help="also run through link emulators at these RTTs, e.g. 5,20")
    ap.add_argument("--rtt-stages", default="3", help="stage counts run with --rtt-ms")
    ap.add_argument("--no-relay", action="store_true", help="skip the relay<k> configurations")
    ap.add_argument("--sessions", default="",
                    help="concurrent-session counts, e.g. 1,4,16 (dgr/relay, --session-stages)")
    ap.add_argument("--session-stages", default="3", help="stage counts run with --sessions")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    stages = [int(x) for x in args.stages.split(",") if x]
    rounds, n_decode, prefills = args.rounds, args.tokens, PREFILLS
    if args.quick:
        stages, rounds, n_decode, prefills = [3], 1, 32, (128,)
    res = run_compare(stages, rounds, n_decode, prefills,
                      rpc=not (args.no_rpc or args.no_llama_bench),
                      llama=not args.no_llama_bench, bench_args=args.bench_args.split(),
                      log=lambda m: print(m, file=sys.stderr, flush=True),
                      rtts=[float(x) for x in args.rtt_ms.split(",") if x],
                      rtt_stages=[int(x) for x in args.rtt_stages.split(",") if x],
                      relay=not args.no_relay,
                      sessions=[int(x) for x in args.sessions.split(",") if x],
                      session_stages=[int(x) for x in args.session_stages.split(",") if x])
    res["command"] = " ".join([os.path.basename(sys.executable), *sys.argv])
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
