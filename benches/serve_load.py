"""Load on the HTTP front: k concurrent streaming clients against ``python -m dgr serve`` (a local
cluster of ``--stages`` workers) and against ``llama-server`` of the pinned tree on the whole
model, side by side in one run.

    python benches/serve_load.py [--clients 1,4,16] [--tokens 64] [--requests 2]
                                 [--rounds 3] [--stages 3] [--json out.json]

Both servers get the same model (the registry's default), one thread per process, ``n_ubatch``
= ``n_batch`` 64, flash attention on, 1024 context tokens per slot and as many slots as the
largest client count. Each client sends ``--requests`` streamed ``/v1/chat/completions``
requests one after the other (its own user message, temperature 0, ``max_tokens``
``--tokens``), reading the server-sent events as they arrive. Per request: TTFT = from
sending the request to the first content event; time per output token = (last content event
- first) / (content events - 1); output tokens = the ``usage`` of the last event (both servers
send it with ``stream_options.include_usage``). Per client count and server: requests/s and
output tokens/s over the wall time of the whole batch, TTFT and TPOT p50 and p99, and CPU
milliseconds per output token of each process over the batch (``/proc``: the server, then
the processes it started: dgr's front, then its workers; llama-server is one process).

Both servers stay up for the whole run, and ``--rounds`` repeats every client count on both,
in turn: in even rounds dgr goes first, in odd rounds llama-server, so a drift of the machine
(the cache a VM's host shares with other tenants moves the figures by a tenth between runs of
a few seconds) weighs on both sides alike. The summary gives per client count each server's
median over the rounds, and dgr's ratio to llama-server round by round (output tokens/s, TTFT
p50) with its median.

llama-server is built once from the pinned, patched tree into ``$DGR_CACHE/llama-server-<key>``
(``LLAMA_BUILD_SERVER=ON``, no UI assets, no network). Note what differs: dgr runs a process
per stage (each with its own thread), so on this 2-core machine up to 2 of its stages compute
at once; llama-server computes in one process with one thread but batches its slots' tokens
into one decode.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import subprocess
import sys
import threading
import time

from harness import cli
from harness.clusters import free_port
from harness.llama import llama_server
from harness.measure import children, cpu_seconds

N_CTX, N_UBATCH = 1024, 64


def _wait_healthy(port: int, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            r = c.getresponse()
            r.read()
            c.close()
            if r.status == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not healthy within {timeout:g} s")
        time.sleep(0.25)


def stop_servers(procs: dict) -> None:
    """SIGINT to every server (dgr serve stops its workers), then wait; kill what lingers."""
    for p in procs.values():
        p.send_signal(2)
    for p in procs.values():
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def stream_chat(port: int, model: str, messages: list, max_tokens: int,
                extra: dict | None = None):
    """A streamed greedy chat completion (``extra``: more request fields, tools say):
    yields ``(time received, event)`` for each server-sent event, the first with ``event``
    None at the time the request was sent."""
    body = json.dumps({"model": model, "stream": True, "max_tokens": max_tokens,
                       "temperature": 0, "stream_options": {"include_usage": True},
                       "messages": messages, **(extra or {})})
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    yield time.perf_counter(), None
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    for raw in r:
        line = raw.decode().strip()
        if line.startswith("data: {"):
            yield time.perf_counter(), json.loads(line[6:])
    c.close()


def one_request(port: int, model: str, message: str, max_tokens: int) -> dict:
    """One streamed chat completion: TTFT, TPOT, output tokens."""
    times, usage, t0 = [], None, None
    for t, ev in stream_chat(port, model, [{"role": "user", "content": message}],
                             max_tokens):
        if ev is None:
            t0 = t
            continue
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices") or []:
            if (ch.get("delta") or {}).get("content"):
                times.append(t)
    t_end = time.perf_counter()
    n = usage["completion_tokens"] if usage else len(times)
    return {"ttft_s": (times[0] - t0) if times else t_end - t0,
            "tpot_s": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
            "tokens": n, "wall_s": t_end - t0}


def cpu_per_token(pids: list[int], load) -> dict:
    """``load()``'s row, with the CPU milliseconds per output token each of ``pids`` spent
    while it ran (``cpu_ms_per_token``: their sum; ``cpu_ms_per_token_by_process``: in the
    order of ``pids``)."""
    before = [cpu_seconds(p) for p in pids]
    row = load()
    per = [1e3 * (cpu_seconds(p) - b) / max(row["output_tokens"], 1)
           for p, b in zip(pids, before)]
    return {**row, "cpu_ms_per_token": sum(per), "cpu_ms_per_token_by_process": per}


def _cpu_text(row: dict) -> str:
    """``total (each process)``, e.g. ``20.4 (0.4 + 5.6 + 5.6 + 8.8)``."""
    per = row.get("cpu_ms_per_token_by_process") or []
    each = " + ".join(f"{x:.1f}" for x in per)
    return f"{row.get('cpu_ms_per_token', 0):.1f}" + (f" ({each})" if len(per) > 1 else "")


def run_load(port: int, model: str, k: int, n_requests: int, max_tokens: int,
             tag: str = "") -> dict:
    """k clients at once, each ``n_requests`` requests in a row. Every request's message is
    its own (``tag``, client, request), so that no server answers one from a cached prompt
    seen before (both cache a prompt's common prefix alike)."""
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for j in range(n_requests):
            msg = f"Write a short story about a robot named R{tag}{i}-{j} who learns to paint."
            try:
                res = one_request(port, model, msg, max_tokens)
            except Exception as e:  # noqa: BLE001 - the report counts failures
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

    def pct(xs, q):
        xs = sorted(x for x in xs if x is not None)
        if not xs:
            return None
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]

    ttft = [r["ttft_s"] for r in results]
    tpot = [r["tpot_s"] for r in results]
    return {"clients": k, "requests": len(results), "failed": len(errors),
            "errors": errors[:3], "wall_s": wall,
            "requests_per_s": len(results) / wall,
            "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "output_tokens": sum(r["tokens"] for r in results),
            "ttft_ms_p50": 1e3 * statistics.median(ttft) if ttft else None,
            "ttft_ms_p99": 1e3 * pct(ttft, 0.99) if ttft else None,
            "tpot_ms_p50": 1e3 * pct(tpot, 0.5) if pct(tpot, 0.5) else None,
            "tpot_ms_p99": 1e3 * pct(tpot, 0.99) if pct(tpot, 0.99) else None}


def _median(xs: list) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(rows: list[dict]) -> list[dict]:
    """Per client count (in the order first seen): each server's median output tokens/s and
    TTFT p50 over its rounds, and dgr / llama-server of both figures round by round
    (``ratio_tokens_per_s``, ``ratio_ttft_p50``: lists in round order) with the medians."""
    out = []
    for k in dict.fromkeys(r["clients"] for r in rows):
        by = {(r["server"], r["round"]): r for r in rows if r["clients"] == k}
        rounds = sorted({rd for _, rd in by})
        pairs = [(by[("dgr", rd)], by[("llama-server", rd)]) for rd in rounds
                 if ("dgr", rd) in by and ("llama-server", rd) in by]
        tok = [d["output_tokens_per_s"] / ls["output_tokens_per_s"] for d, ls in pairs
               if ls["output_tokens_per_s"]]
        ttft = [d["ttft_ms_p50"] / ls["ttft_ms_p50"] for d, ls in pairs
                if d["ttft_ms_p50"] and ls["ttft_ms_p50"]]
        row = {"clients": k, "rounds": len(pairs), "ratio_tokens_per_s": tok,
               "ratio_ttft_p50": ttft, "ratio_tokens_per_s_median": _median(tok),
               "ratio_ttft_p50_median": _median(ttft)}
        for what in ("dgr", "llama-server"):
            mine = [r for (w, _), r in by.items() if w == what]
            row[what] = {f: _median([r[f] for r in mine if r[f] is not None])
                         for f in ("output_tokens_per_s", "ttft_ms_p50")}
        out.append(row)
    return out


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _summary_table(summary: list[dict]) -> str:
    """``summarize``'s rows as a markdown table."""
    lines = ["| clients | rounds | dgr tok/s | llama-server tok/s | dgr / llama-server tok/s: "
             "median (each round) | TTFT p50 dgr / llama-server: median (each round) |",
             "|---:|---:|---:|---:|---|---|"]
    for s in summary:
        ratios = [f"{_num(s[f + '_median'], '.2f')} ("
                  + ", ".join(_num(x, ".2f") for x in s[f]) + ")"
                  for f in ("ratio_tokens_per_s", "ratio_ttft_p50")]
        lines.append(f"| {s['clients']} | {s['rounds']} | "
                     f"{_num(s['dgr']['output_tokens_per_s'])} | "
                     f"{_num(s['llama-server']['output_tokens_per_s'])} | "
                     f"{ratios[0]} | {ratios[1]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = cli.parser(__doc__, stages=3, rounds=3, json=True)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of each request")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, in a row")
    ap.add_argument("--model", help="GGUF (default: the registry's default model)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    from dgr.artifacts import models

    model = args.model or str(models.path(models.DEFAULT_MODEL))
    ks = [int(x) for x in args.clients.split(",") if x]
    slots = max(ks)
    name = "bench"
    exe = llama_server()
    dgr_port, ls_port = free_port(), free_port()
    dgr_cmd = [sys.executable, "-m", "dgr", "serve", "--model", model, "--stages",
               str(args.stages), "--port", str(dgr_port), "--model-name", name,
               "--ctx", str(N_CTX), "--slots", str(slots), "--threads", "1", "--ubatch",
               str(N_UBATCH), "--flash-attn", "on", "--queue-timeout", "600"]
    ls_cmd = [exe, "-m", model, "--host", "127.0.0.1", "--port", str(ls_port), "-t", "1",
              "-tb", "1", "-c", str(N_CTX * slots), "-np", str(slots), "-b", str(N_UBATCH),
              "-ub", str(N_UBATCH), "-fa", "on", "--alias", name, "--no-webui"]
    print("dgr:         " + " ".join(dgr_cmd), file=sys.stderr)
    print("llama-server: " + " ".join(ls_cmd), file=sys.stderr, flush=True)
    log = open(os.devnull, "w")
    procs = {"dgr": subprocess.Popen(dgr_cmd, stdout=log, stderr=log),
             "llama-server": subprocess.Popen(ls_cmd, stdout=log, stderr=log)}
    ports = {"dgr": dgr_port, "llama-server": ls_port}
    out = {"model": model, "stages": args.stages, "tokens": args.tokens,
           "requests_per_client": args.requests, "rounds": args.rounds,
           "commands": {"dgr": dgr_cmd, "llama-server": ls_cmd}, "rows": []}
    try:
        for what, p in procs.items():
            _wait_healthy(ports[what], p, what)
        for what in procs:  # warm-up: one request each
            one_request(ports[what], name, "Hello.", 8)
        for rd, k in ((rd, k) for rd in range(args.rounds) for k in ks):
            order = list(procs) if rd % 2 == 0 else list(procs)[::-1]
            for what in order:  # side by side: each client count on both, in turn
                pids = [procs[what].pid, *children(procs[what].pid)]
                row = cpu_per_token(pids, lambda: run_load(ports[what], name, k, args.requests,
                                                           args.tokens, tag=f"{rd}-"))
                row["server"], row["round"] = what, rd
                out["rows"].append(row)
                print(f"round {rd} {what:<13} k={k:<3} {row['requests_per_s']:6.2f} req/s "
                      f"{row['output_tokens_per_s']:7.1f} tok/s  TTFT p50 "
                      f"{row['ttft_ms_p50'] or 0:8.1f} p99 {row['ttft_ms_p99'] or 0:8.1f} ms  "
                      f"TPOT p50 {row['tpot_ms_p50'] or 0:6.1f} p99 {row['tpot_ms_p99'] or 0:6.1f}"
                      f" ms  CPU/token {_cpu_text(row)} ms  failed {row['failed']}", flush=True)
    finally:
        stop_servers(procs)
    print("\n| round | clients | server | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | "
          "TPOT p50 ms | TPOT p99 ms | CPU ms/token (each process) |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for r in out["rows"]:
        print(f"| {r['round']} | {r['clients']} | {r['server']} | {r['requests_per_s']:.2f} | "
              f"{r['output_tokens_per_s']:.1f} | {r['ttft_ms_p50'] or 0:.0f} | "
              f"{r['ttft_ms_p99'] or 0:.0f} | {r['tpot_ms_p50'] or 0:.1f} | "
              f"{r['tpot_ms_p99'] or 0:.1f} | {_cpu_text(r)} |")
    out["summary"] = summarize(out["rows"])
    print("\n" + _summary_table(out["summary"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
