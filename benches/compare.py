"""Side by side on SmolLM2: the whole model, dgr routes of 2-4 stages and llama.cpp RPC.

    python benches/compare.py [--rounds 3] [--stages 2,3,4] [--quick] [--json out.json]

Every process has one thread. Each round runs every configuration once, round-robin, and
the table reports medians over rounds, so a busy machine skews them alike.

* whole (dgr):   ``dgr.Engine`` in a fresh process each round (same settings as the
  workers): decode tokens/s over ``--tokens`` greedy steps after a 16-token prompt, prefill
  tokens/s of 128- and 512-token prompts (prompt / time to first token), TTFT of the
  128-token prompt, CPU seconds per decoded token.
* whole (llama-bench): upstream ``llama-bench -m M -t 1 -p 128,512 -n N -r 1 -o json``.
* dgr k stages:  a ``LocalCluster`` of k ``python -m dgr.worker`` processes on loopback (as
  ``dgr run`` starts them), driven through ``AsyncRoute``: the same measurements, plus the
  bytes of the boundary frame sent to each later stage per decode token (the driver relays
  boundaries, so each seam costs that frame once out and once back in), CPU s/token summed
  over the workers and this (driving) process from /proc/<pid>/stat, and parity: the route's
  greedy tokens equal the whole model's.
* rpc k:         k ``ggml-rpc-server -t 1`` on 127.0.0.1 and ``llama-bench --rpc ...``.

Ratios: dgr k stages / whole (dgr engine), and dgr k stages / rpc k, per metric.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchmarks.bench_route import start_cluster  # noqa: E402
from benchmarks.common import SETTINGS, prompt_tokens, smollm2_path  # noqa: E402

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

async def _route_measure(endpoints, pids, n_decode: int, prefills) -> dict:
    from dgr.route import AsyncRoute

    prompts = _prompts()
    res = {}
    async with AsyncRoute(endpoints) as r:
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


def route_measure(cluster, n_decode: int = N_DECODE, prefills=PREFILLS) -> dict:
    pids = [os.getpid()] + [w.proc.pid for w in cluster.workers]
    return asyncio.run(_route_measure(cluster.endpoints, pids, n_decode, prefills))


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
    of each endpoint; ``endpoints`` are the proxies."""

    def __init__(self, targets, rtt_ms: float):
        self.targets, self.rtt_ms = list(targets), rtt_ms
        self.procs, self.endpoints = [], []

    def start(self, timeout: float = 30.0) -> list[str]:
        try:
            for ep in self.targets:  # as wan._emulators, with its shutdown noise silenced
                p = subprocess.Popen([sys.executable, "-m", "dgr.testing.linkemu", "--target",
                                      ep, "--delay-ms", str(self.rtt_ms / 2)],
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


def run_compare(stages=(2, 3, 4), rounds: int = 3, n_decode: int = N_DECODE,
                prefills=PREFILLS, rpc: bool = True, llama: bool = True,
                bench_args=(), log=None, rtts=(), rtt_stages=(3,)) -> dict:
    """Start everything, run ``rounds`` interleaved rounds, stop everything; medians.

    ``rtts`` (ms): also run the ``rtt_stages`` configurations through link emulators.
    """
    import dgr

    log = log or (lambda m: None)
    path = smollm2_path()
    n_layer = dgr.Engine(path, **SETTINGS).n_layer
    clusters, servers, emus = {}, {}, {}
    samples: dict[str, list[dict]] = {}
    ref_tokens = None
    try:
        for n in sorted(set(stages) | (set(rtt_stages) if rtts else set())):
            log(f"starting {n} dgr workers ...")
            clusters[n] = start_cluster(path, n, n_layer)
            if rpc:
                log(f"starting {n} ggml-rpc-servers ...")
                servers[n] = RpcServers(n)
                servers[n].start()
        for rtt in rtts:
            for n in rtt_stages:
                log(f"starting link emulators, RTT {rtt:g} ms, {n} stages ...")
                emus[("dgr", n, rtt)] = Emulated(clusters[n].endpoints, rtt)
                emus[("dgr", n, rtt)].start()
                if rpc:
                    emus[("rpc", n, rtt)] = Emulated(servers[n].endpoints, rtt)
                    emus[("rpc", n, rtt)].start()
        for r in range(rounds):
            w = whole_in_own_process(n_decode, prefills)
            ref_tokens = ref_tokens or w["tokens"]
            samples.setdefault("whole", []).append(w)
            if llama:
                samples.setdefault("llama-bench", []).append(
                    llama_bench(n_decode, prefills, extra=bench_args))
            for n in stages:
                m = route_measure(clusters[n], n_decode, prefills)
                m["parity"] = m["tokens"] == w["tokens"]
                samples.setdefault(f"dgr{n}", []).append(m)
                if rpc:
                    samples.setdefault(f"rpc{n}", []).append(
                        llama_bench(n_decode, prefills, servers[n].endpoints, bench_args))
            for rtt in rtts:
                for n in rtt_stages:
                    m = route_measure(_Proxied(clusters[n], emus[("dgr", n, rtt)]), n_decode,
                                      prefills)
                    m["parity"] = m["tokens"] == w["tokens"]
                    samples.setdefault(f"dgr{n}@{rtt:g}ms", []).append(m)
                    if rpc:
                        samples.setdefault(f"rpc{n}@{rtt:g}ms", []).append(llama_bench(
                            n_decode, prefills, emus[("rpc", n, rtt)].endpoints, bench_args))
            log(f"round {r + 1}/{rounds} done (load {os.getloadavg()[0]:.2f})")
    finally:
        for e in emus.values():
            e.stop()
        for c in clusters.values():
            c.stop()
        for s in servers.values():
            s.stop()
    return summarize(samples, stages, rounds, n_decode, prefills,
                     [f"{n}@{r:g}ms" for r in rtts for n in rtt_stages])


def summarize(samples, stages, rounds, n_decode, prefills, emulated=()) -> dict:
    def med(rows, key):
        vals = [x[key] for x in rows if key in x]
        return statistics.median(vals) if vals else None

    out = {"model": smollm2_path(), "settings": SETTINGS, "rounds": rounds,
           "n_decode": n_decode, "prefills": list(prefills), "loadavg": os.getloadavg(),
           "configs": {}, "ratios": {}}
    for name, rows in samples.items():
        c = {k: med(rows, k) for k in (*METRICS, "cpu_s_per_token")}
        if name.startswith("dgr"):
            c["parity"] = all(x["parity"] for x in rows)
            c["seam_bytes_per_token"] = [statistics.median(v) for v in
                                         zip(*(x["seam_bytes_per_token"] for x in rows))]
        c["samples"] = [{k: v for k, v in x.items() if k != "tokens"} for x in rows]
        out["configs"][name] = c
    cf = out["configs"]
    if cf.get("whole") and cf.get("llama-bench"):
        w, lb = cf["whole"], cf["llama-bench"]
        out["ratios"]["whole/llama-bench"] = {
            k: (w[k] / lb[k] if w.get(k) and lb.get(k) else None) for k in METRICS}
    for n in [*stages, *emulated]:
        d = cf.get(f"dgr{n}")
        for base in ("whole", f"rpc{n}"):
            b = cf.get(base)
            if d is None or b is None:
                continue
            out["ratios"][f"dgr{n}/{base}"] = {
                k: (d[k] / b[k] if d.get(k) and b.get(k) else None) for k in METRICS}
        w, rp = cf.get("whole"), cf.get(f"rpc{n}")
        if w and rp:
            out["ratios"][f"rpc{n}/whole"] = {
                k: (rp[k] / w[k] if rp.get(k) and w.get(k) else None) for k in METRICS}
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
    print("(whole = dgr.Engine in one process; TTFT ratio is of times (>1: slower); "
          "llama-bench/rpc TTFT and CPU are not measured; seam B/tok = boundary frame bytes sent to a later stage per decode "
          "token, mean over seams)", file=file)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=N_DECODE, help="greedy decode steps")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--quick", action="store_true",
                    help="1 round, 3 stages only, 32 decode steps, 128-token prefill")
    ap.add_argument("--no-rpc", action="store_true", help="skip llama.cpp RPC")
    ap.add_argument("--no-llama-bench", action="store_true",
                    help="skip llama-bench (whole and RPC)")
    ap.add_argument("--bench-args", default="",
                    help="extra llama-bench arguments, e.g. '-fa 1 -ub 64'")
    ap.add_argument("--rtt-ms", default="",
                    help="also run through link emulators at these RTTs, e.g. 5,20")
    ap.add_argument("--rtt-stages", default="3", help="stage counts run with --rtt-ms")
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
                      rtt_stages=[int(x) for x in args.rtt_stages.split(",") if x])
    res["command"] = " ".join([os.path.basename(sys.executable), *sys.argv])
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
