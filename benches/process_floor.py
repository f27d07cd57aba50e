"""What a multi-process pipeline costs before any transport: the floor under dgr's seams.

    python benches/process_floor.py [--stages 3] [--rounds 5] [--tokens 128]

Three ways to decode with the same SmolLM2 ranges (the settings of benches/compare.py, one
thread each), interleaved round by round because the machine's speed drifts:

* ``alone``: the ranges back to back in one process of their own (``timeline.range_compute_ms``);
  the time per token is the sum of their ``forward`` medians;
* ``pipes``: one process per range, chained by OS pipes (stdin to stdout), a 4-byte position
  and the raw f32 boundary row per token, a few lines of Python per step: the least any
  multi-process pipeline can cost here;
* ``relay``: dgr workers on loopback driven by ``AsyncRoute`` defaults (direct relay, decode
  loop), as ``compare.py`` measures them.

It prints each round and the medians: ms per token of each, each pipe stage's own compute,
``pipes / alone`` (what running the ranges as separate processes costs on this machine, with
no transport to speak of) and ``relay - pipes`` per stage (what dgr's seam adds over that
floor). ``--json FILE`` writes the rounds and the summary; ``summarize`` is pure, see
tests/unit/test_benches.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

POS = struct.Struct("<I")
STOP = 0xFFFFFFFF
N_PROMPT = 16


def _readn(fd: int, n: int) -> bytes:
    b = bytearray()
    while len(b) < n:
        c = os.read(fd, n - len(b))
        if not c:
            raise EOFError(f"pipe closed after {len(b)} of {n} bytes")
        b += c
    return bytes(b)


def stage_main(a: int, b: int) -> int:
    """One pipe stage: read (position, boundary row) from stdin, forward, write the next
    stage's input to stdout; at the stop position print the compute median to stderr."""
    import numpy as np

    import dgr
    from benchmarks.common import SETTINGS, smollm2_path

    eng = dgr.Engine(smollm2_path(), layers=(a, b), **{**SETTINGS, "n_slots": 1})
    width = eng.n_embd_boundary
    row = 4 * width
    n_in = 0 if eng.is_first else row
    n_out = 0 if eng.is_last else row
    ts = []
    while True:
        msg = _readn(0, POS.size + n_in)
        (p,) = POS.unpack_from(msg)
        if p == STOP:
            os.write(1, msg[:POS.size] + bytes(n_out))
            break
        n = N_PROMPT if p == 0 else 1  # position 0: the prompt, after it one token a step
        t = time.perf_counter()
        if eng.is_first:
            out = eng.forward(0, p, list(range(1, n + 1)))
        else:
            x = (np.zeros((n, width), np.float32) if p == 0 else
                 np.frombuffer(msg, np.float32, offset=POS.size).reshape(1, width))
            out = eng.forward(0, p, boundary=x)
        if p:
            ts.append(time.perf_counter() - t)
        tail = np.ascontiguousarray(out[-1:], dtype=np.float32).tobytes() if n_out else b""
        os.write(1, msg[:POS.size] + tail)
    print(json.dumps({"layers": [a, b], "compute_ms": 1e3 * statistics.median(ts)}),
          file=sys.stderr, flush=True)
    return 0


def pipes_decode(n_stages: int, n_tokens: int) -> dict:
    """Decode ``n_tokens`` through ``n_stages`` pipe-chained processes: ms per token and each
    stage's compute median."""
    from benchmarks.common import SETTINGS, smollm2_path

    import dgr
    from dgr.chain import split_layers

    n_layer = dgr.Engine(smollm2_path(), **{**SETTINGS, "n_slots": 1}).n_layer
    procs, logs = [], []
    stdin = subprocess.PIPE
    for a, b in split_layers(n_layer, n_stages):
        logs.append(tempfile.TemporaryFile())  # not a pipe: engine logs cannot fill it up
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--stage", f"{a}:{b}"],
                             stdin=stdin, stdout=subprocess.PIPE, stderr=logs[-1])
        if procs:
            procs[-1].stdout.close()  # the next stage owns it now
        stdin = p.stdout
        procs.append(p)
    w, r = procs[0].stdin.fileno(), procs[-1].stdout.fileno()
    try:
        def step(p: int) -> None:
            os.write(w, POS.pack(p))
            _readn(r, POS.size)

        step(0)  # the prompt: waits for every stage to load
        step(N_PROMPT)  # warm up
        t0 = time.perf_counter()
        for p in range(N_PROMPT + 1, N_PROMPT + 1 + n_tokens):
            step(p)
        token_ms = 1e3 * (time.perf_counter() - t0) / n_tokens
        step(STOP)
    finally:
        procs[0].stdin.close()
        for p in procs:
            p.wait(60)
        errs = []
        for f in logs:
            f.seek(0)
            errs.append(f.read().decode(errors="replace"))
            f.close()
    compute = []
    for e in errs:
        lines = [ln for ln in e.splitlines() if ln.startswith("{")]
        if not lines:
            raise RuntimeError(f"a pipe stage failed:\n{e}")
        compute.append(json.loads(lines[-1])["compute_ms"])
    return {"token_ms": token_ms, "compute_ms": compute}


def alone_decode(n_stages: int) -> dict:
    import timeline

    compute = timeline._range_compute_own_process(n_stages)
    return {"token_ms": sum(compute), "compute_ms": compute}


def relay_decode(cluster, n_tokens: int, width: int) -> dict:
    import compare

    res = compare.route_measure(cluster, n_tokens, prefills=(), relay=True, width=width)
    return {"token_ms": 1e3 / res["decode_tps"]}


def summarize(rounds: list[dict], n_stages: int) -> dict:
    """Medians over rounds of {"alone", "pipes", "relay"} ms/token, the ratio pipes/alone
    and relay's ms per stage over pipes (each round's own difference, then the median)."""
    def med(key, f=lambda r: r):
        return statistics.median(f(r[key]) for r in rounds)

    out = {k: med(k, lambda v: v["token_ms"]) for k in ("alone", "pipes", "relay")}
    out["pipes_over_alone"] = statistics.median(r["pipes"]["token_ms"] / r["alone"]["token_ms"]
                                                for r in rounds)
    out["relay_over_pipes_ms_per_stage"] = statistics.median(
        (r["relay"]["token_ms"] - r["pipes"]["token_ms"]) / n_stages for r in rounds)
    out["relay_over_alone"] = statistics.median(r["relay"]["token_ms"] / r["alone"]["token_ms"]
                                                for r in rounds)
    out["pipes_stage_compute_ms"] = [statistics.median(r["pipes"]["compute_ms"][i]
                                                       for r in rounds)
                                     for i in range(n_stages)]
    out["alone_stage_compute_ms"] = [statistics.median(r["alone"]["compute_ms"][i]
                                                       for r in rounds)
                                     for i in range(n_stages)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128, help="decode steps per measurement")
    ap.add_argument("--json", help="write the rounds and the summary here")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one pipe stage
    args = ap.parse_args(argv)
    if args.stage:
        a, b = (int(x) for x in args.stage.split(":"))
        return stage_main(a, b)

    import dgr
    from benchmarks.bench_route import start_cluster
    from benchmarks.common import SETTINGS, smollm2_path

    n = args.stages
    path = smollm2_path()
    whole = dgr.Engine(path, **SETTINGS)
    n_layer, width = whole.n_layer, whole.n_embd_boundary
    del whole
    print(f"starting {n} dgr workers ...", file=sys.stderr, flush=True)
    cluster = start_cluster(path, n, n_layer)
    rounds = []
    try:
        for i in range(args.rounds):
            r = {"alone": alone_decode(n), "pipes": pipes_decode(n, args.tokens),
                 "relay": relay_decode(cluster, args.tokens, width)}
            rounds.append(r)
            print(f"round {i + 1}: alone {r['alone']['token_ms']:.2f} ms/token, pipes "
                  f"{r['pipes']['token_ms']:.2f} (stages "
                  f"{', '.join(f'{c:.2f}' for c in r['pipes']['compute_ms'])}), relay "
                  f"{r['relay']['token_ms']:.2f}", flush=True)
    finally:
        cluster.stop()
    s = summarize(rounds, n)
    print(f"\n{n} stages, {args.tokens} decode steps, medians of {args.rounds} interleaved rounds; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"  alone (the ranges in one process) {s['alone']:7.2f} ms/token  stages "
          f"{', '.join(f'{c:.2f}' for c in s['alone_stage_compute_ms'])}")
    print(f"  pipes (one process a range)       {s['pipes']:7.2f} ms/token  stages "
          f"{', '.join(f'{c:.2f}' for c in s['pipes_stage_compute_ms'])}")
    print(f"  relay (dgr workers, defaults)     {s['relay']:7.2f} ms/token")
    print(f"  pipes / alone {s['pipes_over_alone']:.2f}: the cost of separate processes here, "
          f"without a transport")
    print(f"  relay - pipes {s['relay_over_pipes_ms_per_stage']:+.2f} ms per stage: what dgr's "
          f"seam adds over that floor; relay / alone {s['relay_over_alone']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stages": n, "tokens": args.tokens, "rounds": rounds, "summary": s}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
