"""What a multi-process pipeline costs before any transport: the floor under dgr's seams.

    python benches/process_floor.py [--stages 3] [--rounds 5] [--tokens 128] [--json out.json]
                                    [--no-python-frames]

Three ways to decode with the same SmolLM2 ranges (``dgr.protocol.ranges.split_layers``, the
settings of ``harness.common.SETTINGS``: one thread, n_ctx 1024, ubatch 64, flash attention; one
slot), all doing the same work: the same 16-token prompt, then ``--tokens`` greedy decode
steps, each token the argmax of the last range's logits, fed back to the first range:

* ``alone``: one process holding every range; each step runs the ranges back to back in it
  (the boundary handed over in memory) and feeds the token back in process;
* ``pipes``: one process per range, chained by OS pipes: a range's process reads (position,
  token ids, boundary rows f32) on stdin, forwards, writes the same for the next range on
  stdout; the last samples the argmax, writes the token to the driver and feeds it to the
  first range over a pipe of its own (the shape of dgr's decode loop, the driver only
  reading the tokens): the least any multi-process pipeline can cost here;
* ``relay``: dgr workers on loopback driven by ``AsyncRoute(relay=True, loop=True)``
  (direct relay over the data plane, the stages' decode loop, loop_window 32), and
  ``relay-py``: the same with workers started ``--frames python`` (the data plane's
  per-frame work in Python instead of C++; ``relay-py - relay`` per stage is what the native
  path saves; ``--no-python-frames`` skips it).

All three are timed the same way, in the driver: ms/token = wall clock from the arrival of
the prompt's token to that of the last, / ``--tokens``; each measured generation follows a
warm-up generation (the prompt, one step) on the same processes. Rounds run the three in turn
(interleaved, the machine's speed drifts); the table reports medians over rounds of each
round's ms/token, ``pipes / alone`` (what running the ranges as separate processes costs on
this machine, with no transport to speak of), ``relay / alone`` and ``relay - pipes`` per
stage (what dgr's seam adds over that floor, from each round's own difference). Per-range
compute: median over the decode steps of each range's ``forward`` (perf_counter in its
process) for alone and pipes, for relay the mean compute of the single-token steps each
worker computed during the run (deltas of its Describe totals).
Parity: every row's tokens (the prompt's and the ``--tokens`` after it) equal the whole
model's, ``dgr.core.local.generate_local`` greedy, computed before the rest starts.
``--json FILE`` writes the rounds and the summary; ``summarize`` is pure, see
tests/unit/test_bench_models.py.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import struct
import subprocess
import sys
import tempfile
import time

from harness import cli

# to a range: first position, rows, decode steps still to run after these rows, compute
# times carried (f32 ms, one per range run so far this step); then rows i32 token ids,
# the times, and (to a range that is not the first) rows x width f32 boundary
HDR = struct.Struct("<iIII")
# to the driver: position the token takes, the token, times that follow (f32 ms per range)
REPLY = struct.Struct("<iiI")
N_PROMPT = 16
CONFIGS = ("alone", "pipes", "relay", "relay-py")  # relay-py: the same workers' path with
#                                              # --frames python (absent with --no-python-frames)
LOAD_TIMEOUT_S = 600.0  # the warm-up waits for every range to load
STEP_TIMEOUT_S = 120.0


def _readn(fd: int, n: int, timeout: float | None = None) -> bytes:
    """Exactly ``n`` bytes from ``fd``; ``timeout`` (seconds, None: block) for all of them."""
    deadline = None if timeout is None else time.monotonic() + timeout
    b = bytearray()
    while len(b) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"no data within {timeout} s ({len(b)} of {n} bytes)")
        c = os.read(fd, n - len(b))
        if not c:
            raise EOFError(f"pipe closed after {len(b)} of {n} bytes")
        b += c
    return bytes(b)


def _writeall(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


# --- a process serving ranges ----------------------------------------------------------------

def serve(ranges: list[tuple[int, int]], ring_fd: int | None) -> int:
    """Serve ``ranges`` (back to back) on stdin/stdout until a message of 0 rows.

    Position 0 starts a generation (the slot is released first). Not the last range: write
    the boundary rows on to the next process. The last range: sample the argmax, write the
    token to stdout (the driver); with steps left feed it back to the first range, over
    ``ring_fd`` (pipes) or in process (``ring_fd`` None: alone)."""
    import numpy as np
    from harness.common import SETTINGS, smollm2_path

    import dgr

    engines = [dgr.Engine(smollm2_path(), layers=(a, b), **{**SETTINGS, "n_slots": 1})
               for a, b in ranges]
    first, last = engines[0].is_first, engines[-1].is_last
    width = engines[0].n_embd_boundary
    while True:
        pos, rows, steps, nt = HDR.unpack(_readn(0, HDR.size))
        if rows == 0:  # stop: pass it on, then end
            _writeall(1, REPLY.pack(-1, -1, 0) if last else HDR.pack(-1, 0, 0, 0))
            return 0
        toks = np.frombuffer(_readn(0, 4 * rows), np.int32).copy()
        times = list(np.frombuffer(_readn(0, 4 * nt), np.float32)) if nt else []
        x = (None if first else
             np.frombuffer(_readn(0, 4 * rows * width), np.float32).reshape(rows, width))
        while True:
            if pos == 0:
                for eng in engines:
                    eng.release(0)
            for eng in engines:
                t = time.perf_counter()
                if eng.is_first:
                    x = eng.forward(0, pos, toks)
                else:
                    x = eng.forward(0, pos, toks if eng.needs_token_ids else None,
                                    boundary=np.ascontiguousarray(x))
                times.append(1e3 * (time.perf_counter() - t))
            ts = np.asarray(times, np.float32).tobytes()
            if not last:
                _writeall(1, HDR.pack(pos, rows, steps, len(times)) + toks.tobytes() + ts
                          + np.ascontiguousarray(x, np.float32).tobytes())
                break
            tok = int(np.argmax(x[-1]))
            pos += rows
            _writeall(1, REPLY.pack(pos, tok, len(times)) + ts)
            if steps == 0:
                break
            steps -= 1
            if ring_fd is not None:
                _writeall(ring_fd, HDR.pack(pos, 1, steps, 0) + struct.pack("<i", tok))
                break
            toks, rows, times = np.array([tok], np.int32), 1, []


class Procs:
    """The driver's side of ``alone`` (one process, every range) or ``pipes`` (one process a
    range, chained, the last feeding the first)."""

    def __init__(self, groups: list[list[tuple[int, int]]]):
        self.groups = groups
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        n_ranges = sum(len(g) for g in groups)
        self.n_ranges = n_ranges
        ring_r, ring_w = os.pipe()  # into the first process: from the driver and the last
        try:
            stdin = ring_r
            for i, g in enumerate(groups):
                lastp = i == len(groups) - 1
                cmd = [sys.executable, os.path.abspath(__file__), "--serve",
                       ",".join(f"{a}:{b}" for a, b in g)]
                if lastp and len(groups) > 1:
                    cmd += ["--ring-fd", str(ring_w)]
                self.logs.append(tempfile.TemporaryFile())  # not a pipe: logs cannot fill it
                p = subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE,
                                     stderr=self.logs[-1],
                                     pass_fds=(ring_w,) if lastp and len(groups) > 1 else ())
                if i == 0:
                    os.close(ring_r)
                    ring_r = -1
                else:
                    self.procs[-1].stdout.close()  # the next process owns it now
                stdin = p.stdout
                self.procs.append(p)
        except BaseException:
            if ring_r >= 0:
                os.close(ring_r)
            os.close(ring_w)
            self.close()
            raise
        self.w = ring_w
        self.r = self.procs[-1].stdout.fileno()

    def generate(self, prompt: list[int], steps: int, timeout: float = STEP_TIMEOUT_S) -> dict:
        """The prompt, then ``steps`` decode steps: tokens, ms/token (wall clock from the
        prompt's token to the last, / steps) and each range's forward median over the steps."""
        import numpy as np

        _writeall(self.w, HDR.pack(0, len(prompt), steps, 0)
                  + np.asarray(prompt, np.int32).tobytes())
        toks, compute, t_first = [], [], None
        for i in range(steps + 1):
            pos, tok, nt = REPLY.unpack(_readn(self.r, REPLY.size, timeout))
            times = list(np.frombuffer(_readn(self.r, 4 * nt, timeout), np.float32))
            if i == 0:
                t_first = time.perf_counter()
            else:
                compute.append(times)
            if pos != len(prompt) + i or len(times) != self.n_ranges:
                raise RuntimeError(f"reply {i}: position {pos}, {len(times)} times; expected "
                                   f"{len(prompt) + i}, {self.n_ranges}")
            toks.append(tok)
        t_end = time.perf_counter()
        return {"tokens": toks, "token_ms": 1e3 * (t_end - t_first) / steps,
                "compute_ms": [float(statistics.median(c[k] for c in compute))
                               for k in range(self.n_ranges)]}

    def errors(self) -> str:
        out = []
        for f in self.logs:
            f.seek(0)
            out.append(f.read().decode(errors="replace")[-2000:])
        return "\n".join(out)

    def close(self) -> None:
        if self.procs and self.procs[0].poll() is None and getattr(self, "w", None):
            try:
                _writeall(self.w, HDR.pack(-1, 0, 0, 0))
                _readn(self.r, REPLY.size, 30)
            except (OSError, EOFError, TimeoutError):
                pass
        if getattr(self, "w", None):
            os.close(self.w)
            self.w = None
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout:
                p.stdout.close()
        for f in self.logs:
            f.close()
        self.procs, self.logs = [], []


def procs_decode(procs: Procs, prompt: list[int], steps: int) -> dict:
    """A warm-up generation (the prompt, one step), then the measured one."""
    try:
        procs.generate(prompt, 1, timeout=LOAD_TIMEOUT_S)
        return procs.generate(prompt, steps)
    except (EOFError, TimeoutError, RuntimeError) as e:
        raise RuntimeError(f"{e}\n{procs.errors()}") from e


def relay_decode(cluster, prompt: list[int], steps: int) -> dict:
    """dgr workers with direct relay and the decode loop: ``wan.route_decode``'s timed run
    (a warm-up generation, then ``steps`` greedy steps after ``prompt``; each stage's compute
    from its worker's exact totals over the run)."""
    from wan import route_decode

    r = route_decode(cluster.endpoints, steps, prompt, relay=True)
    if not r["loop"]:
        raise RuntimeError("the route did not take direct relay with the decode loop")
    return {"tokens": r["tokens"], "token_ms": r["tpot_ms"], "compute_ms": r["compute_ms"]}


# --- the summary (pure) ----------------------------------------------------------------------

def summarize(rounds: list[dict], n_stages: int, reference: list[int] | None = None) -> dict:
    """Medians over rounds of each configuration's ms/token; the per-round ratios pipes/alone
    and relay/alone and relay's ms per stage over pipes (each round's own, then the median);
    each range's compute median; and with ``reference`` (the whole model's tokens) parity:
    for each configuration, whether every round's tokens equal it (same length, same ids)."""
    def med(f):
        return statistics.median(f(r) for r in rounds)

    configs = [k for k in CONFIGS if all(k in r for r in rounds)]
    out = {k: med(lambda r, k=k: r[k]["token_ms"]) for k in configs}
    out["pipes_over_alone"] = med(lambda r: r["pipes"]["token_ms"] / r["alone"]["token_ms"])
    out["relay_over_pipes_ms_per_stage"] = med(
        lambda r: (r["relay"]["token_ms"] - r["pipes"]["token_ms"]) / n_stages)
    out["relay_over_alone"] = med(lambda r: r["relay"]["token_ms"] / r["alone"]["token_ms"])
    if "relay-py" in configs:  # the native frame path against the Python one, per round
        out["relay_py_over_alone"] = med(
            lambda r: r["relay-py"]["token_ms"] / r["alone"]["token_ms"])
        out["relay_py_minus_relay_ms_per_stage"] = med(
            lambda r: (r["relay-py"]["token_ms"] - r["relay"]["token_ms"]) / n_stages)
    for k in configs:
        if all("compute_ms" in r[k] for r in rounds):
            out[f"{k}_stage_compute_ms"] = [med(lambda r, k=k, i=i: r[k]["compute_ms"][i])
                                            for i in range(n_stages)]
    if reference is not None:
        out["parity"] = {k: all(list(r[k]["tokens"]) == list(reference) for r in rounds)
                         for k in configs}
    return out


# --- the run ---------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = cli.parser(__doc__, stages=3, rounds=5, json=True)
    ap.add_argument("--tokens", type=int, default=128, help="decode steps per measurement")
    ap.add_argument("--no-python-frames", action="store_true",
                    help="skip relay-py (the same workers with --frames python)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # internal: a process serving ranges
    ap.add_argument("--ring-fd", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return serve([tuple(int(x) for x in g.split(":")) for g in args.serve.split(",")],
                     args.ring_fd)

    from harness.clusters import start_cluster
    from harness.common import SETTINGS, prompt_tokens, smollm2_path

    import dgr
    from dgr.core.local import generate_local
    from dgr.protocol.ranges import split_layers

    n, steps = args.stages, args.tokens
    if n < 2 or steps < 1:
        ap.error("--stages >= 2 and --tokens >= 1")
    path = smollm2_path()
    whole = dgr.Engine(path, **SETTINGS)
    n_layer = whole.n_layer
    prompt = [int(t) for t in prompt_tokens(N_PROMPT, whole.n_vocab)]
    reference, _ = generate_local(whole, prompt, max_tokens=steps + 1, stop_on_eog=False)
    del whole
    ranges = split_layers(n_layer, n)
    print(f"starting {n} dgr workers, {n} pipe processes and one for the ranges alone ...",
          file=sys.stderr, flush=True)
    cluster = py_cluster = alone = pipes = None
    rounds = []
    try:
        cluster = start_cluster(path, n, n_layer)
        if not args.no_python_frames:
            py_cluster = start_cluster(path, n, n_layer, args=["--frames", "python"])
        alone = Procs([list(ranges)])
        pipes = Procs([[r] for r in ranges])
        for i in range(args.rounds):
            r = {"alone": procs_decode(alone, prompt, steps),
                 "pipes": procs_decode(pipes, prompt, steps),
                 "relay": relay_decode(cluster, prompt, steps)}
            if py_cluster is not None:
                r["relay-py"] = relay_decode(py_cluster, prompt, steps)
            rounds.append(r)
            print(f"round {i + 1}: alone {r['alone']['token_ms']:.2f} ms/token, pipes "
                  f"{r['pipes']['token_ms']:.2f} (ranges "
                  f"{', '.join(f'{c:.2f}' for c in r['pipes']['compute_ms'])}), relay "
                  f"{r['relay']['token_ms']:.2f}" + (
                      f", relay-py {r['relay-py']['token_ms']:.2f}" if "relay-py" in r else ""),
                  file=sys.stderr, flush=True)
    finally:
        for p in (alone, pipes):
            if p is not None:
                p.close()
        for c in (cluster, py_cluster):
            if c is not None:
                c.stop()
    s = summarize(rounds, n, reference)

    def stages(k):
        return ", ".join(f"{c:.2f}" for c in s[f"{k}_stage_compute_ms"])

    def par(k):
        return "yes" if s["parity"][k] else "NO"

    print(f"\n{n} ranges {ranges} of {os.path.basename(path)}, settings {SETTINGS} n_slots 1")
    print(f"each row, each round: a warm-up generation, then a {N_PROMPT}-token prompt and "
          f"{steps} greedy decode steps (argmax, fed back); ms/token = wall from the prompt's "
          f"token to the last / {steps}; medians of {args.rounds} interleaved rounds; "
          f"parity: all {steps + 1} tokens equal the whole model's (generate_local); "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"  alone (one process, the ranges back to back)  {s['alone']:7.2f} ms/token  "
          f"ranges {stages('alone')} (forward medians)  parity {par('alone')}")
    print(f"  pipes (a process a range, OS pipes, ring)     {s['pipes']:7.2f} ms/token  "
          f"ranges {stages('pipes')} (forward medians)  parity {par('pipes')}")
    print(f"  relay (dgr workers, relay + decode loop)      {s['relay']:7.2f} ms/token  "
          f"ranges {stages('relay')} (worker totals)  parity {par('relay')}")
    if "relay-py" in s:
        print(f"  relay-py (the same, --frames python)          {s['relay-py']:7.2f} ms/token  "
              f"ranges {stages('relay-py')} (worker totals)  parity {par('relay-py')}")
    print(f"  pipes / alone {s['pipes_over_alone']:.2f}: the cost of separate processes here, "
          f"without a transport")
    print(f"  relay - pipes {s['relay_over_pipes_ms_per_stage']:+.2f} ms per stage: what dgr's "
          f"seam adds over that floor; relay / alone {s['relay_over_alone']:.2f}")
    if "relay-py" in s:
        print(f"  relay-py - relay {s['relay_py_minus_relay_ms_per_stage']:+.2f} ms per stage: "
              f"what the native frame path saves; relay-py / alone "
              f"{s['relay_py_over_alone']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stages": n, "ranges": ranges, "tokens": steps, "prompt": prompt,
                       "settings": SETTINGS, "reference": reference, "rounds": rounds,
                       "summary": s}, f, indent=1)
    return 0 if all(s["parity"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
