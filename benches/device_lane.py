"""One device lane, certified and measured side by side in one run: the split against the
whole model on the device, and dgr against llama.cpp's own programs on the same device.

    python benches/device_lane.py --device CUDA0 [--models smollm2,qwen2-7b] [--tokens 64]
                                  [--sessions 1,16,64] [--pp 512] [--json out.json]
    python benches/device_lane.py --device Vulkan0 --tiny      # minutes on lavapipe

``benches/device/lane.sh BACKEND`` builds the backend and runs this on its first device. Per
model (``smollm2``: the registry's SmolLM2-135M; ``qwen2-7b``: ``benches/qwen2_7b.py``'s
random-weight 7B-shaped qwen2; ``tiny``: a 4-layer random llama):

1. **certify**: ``python -m dgr certify --device D --stages 2`` (the split's tokens and logits
   rows against the whole model on the device, batching and speculative trips measured), the
   record written to a store in the output folder.
2. **decode**: whole-model greedy decode tokens/s in one process (``dgr.Engine`` on the
   device), against the model split in 2 in the same process (``LocalChain``: the seam's
   host copies and second graph launch, no transport; its ms per token), and against relay
   over 2 and 3 worker processes sharing the device (direct relay and the decode loop):
   tokens/s and the ratio to the whole model.
3. **sessions**: k concurrent sessions through 2 stages (``AsyncRoute.complete`` gathered),
   aggregate output tokens/s, against ``llama-batched-bench -ngl 99`` on the whole model with
   the same settings (``-npl k``, one KV stream per sequence).
4. **pp**: prompt tokens/s of one ``--pp``-token prompt through the whole model on the device
   (dgr) against ``llama-bench -ngl 99 -p N -n 0``.

The workers and llama.cpp's programs see the device as this process does: a software Vulkan
device (lavapipe) only when ``GGML_VK_VISIBLE_DEVICES`` names it (lane.sh sets it). The table
is printed last; ``--json`` keeps every figure with the commands that gave it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

from harness import cli
from harness.llama import tool
from harness.measure import decode_tps, rate

#: every engine's settings (n_slots: the most sessions); llama.cpp's programs mirror them
SETTINGS = dict(n_ctx=512, n_threads=1, n_ubatch=64, flash_attn=True)
N_PROMPT = 16


def log(msg: str) -> None:
    print(f"[device-lane] {msg}", file=sys.stderr, flush=True)


def model_path(name: str, tmp: str) -> str:
    if name == "smollm2":
        from dgr.artifacts import models

        return str(models.path(models.DEFAULT_MODEL))
    if name == "qwen2-7b":
        import qwen2_7b  # benches/qwen2_7b.py, beside this script

        return str(qwen2_7b.write())
    if name == "tiny":
        from dgr.testing.fixtures import write_tiny_llama

        return str(write_tiny_llama(os.path.join(tmp, "tiny-llama.gguf")))
    if os.path.exists(name):
        return name
    raise SystemExit(f"unknown model {name!r}: smollm2, qwen2-7b, tiny or a GGUF path")


def prompt(i: int, n: int = N_PROMPT) -> list[int]:
    """A different ``n``-token prompt per session (ids inside every vocabulary here)."""
    return [1 + (17 * i + 7 * k) % 97 for k in range(n)]


# an engine built after what a worker and the CLI import first (gRPC, the chat binding): on
# the first CUDA run that order crashed (SIGSEGV in Engine.__new__), so the lane checks it first
PROBE = ("import sys, grpc, dgr._chat._chat, dgr\n"
         "dgr.Engine(sys.argv[1], device=sys.argv[2], n_ctx=256)\nprint('engine built')")


def probe(model: str, device: str, code: str = PROBE) -> dict:
    """Build an engine on ``device`` in a fresh process after ``code``'s imports; a process
    killed by a signal is run again under gdb (or CUDA's cuda-gdb) for a native backtrace."""
    import glob
    import shutil

    cmd = [sys.executable, "-c", code, model, device]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out = {"command": shlex.join(cmd), "ok": p.returncode == 0, "returncode": p.returncode,
           "stderr_tail": p.stderr[-1500:]}
    if p.returncode < 0:
        gdb = (shutil.which("gdb") or shutil.which("cuda-gdb")
               or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/cuda-gdb"))), None))
        if gdb is None:
            out["backtrace"] = "no gdb on this machine"
        else:
            g = subprocess.run([gdb, "-q", "-batch", "-ex", "run", "-ex", "bt 40", "--args",
                                *cmd], capture_output=True, text=True, timeout=600)
            out["backtrace"] = (g.stdout + g.stderr)[-8000:]
    return out


def certify(model: str, device: str, store: str, tokens: int, slots: int) -> dict:
    cmd = [sys.executable, "-m", "dgr", "certify", "--model", model, "--stages", "2",
           "--device", device, "--store", store, "--max-tokens", str(min(tokens, 16)),
           "--ctx", str(SETTINGS["n_ctx"]), "--slots", str(slots), "--ubatch",
           str(SETTINGS["n_ubatch"]), "--threads", str(SETTINGS["n_threads"]),
           "--flash-attn", "on" if SETTINGS["flash_attn"] else "off"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    recs = sorted((os.path.join(store, f) for f in os.listdir(store) if f.endswith(".json")),
                  key=os.path.getmtime) if os.path.isdir(store) else []
    rec = json.load(open(recs[-1])) if p.returncode == 0 and recs else None
    return {"command": shlex.join(cmd), "passed": rec is not None,
            "bit_identical": bool(rec and rec["parity"]["logits_bit_identical"]),
            "record": recs[-1] if rec else None, "stderr_tail": p.stderr[-1500:]}


def _decode(eng, tokens: int) -> dict:
    """Greedy decode tokens/s of ``eng`` (an engine or an in-process chain of them): the
    single-token steps after the prompt, timed alone (a first untimed run warms up)."""
    import numpy as np

    def run(n: int) -> float:
        eng.release(0)
        p = prompt(0)
        tok, pos = int(np.argmax(eng.forward(0, 0, p)[-1])), len(p)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = int(np.argmax(eng.forward(0, pos, [tok])[-1]))
            pos += 1
        dt = time.perf_counter() - t0
        eng.release(0)
        return dt

    run(2)
    return {"tokens": tokens, "decode_tps": tokens / run(tokens)}


def whole_decode(model: str, device: str, tokens: int) -> dict:
    import dgr

    return _decode(dgr.Engine(model, device=device, n_slots=1, **SETTINGS), tokens)


def seam_in_process(model: str, device: str, tokens: int, whole_tps: float) -> dict:
    """The model split in 2 in this process on the device (``LocalChain``: no transport):
    what one seam costs per token on the device, the boundary row's copy to host memory and
    back and the second stage's own graph launch, against the whole model."""
    from dgr.artifacts.gguf import read_header
    from dgr.artifacts.manifest import model_facts
    from dgr.core.local import LocalChain
    from dgr.protocol.ranges import ranges_for

    n_layer = model_facts([read_header(model, decode_arrays=False)])["n_layer"]
    chain = LocalChain(model, ranges_for(None, 2, n_layer), device=device, n_slots=1,
                       **SETTINGS)
    r = _decode(chain, tokens)
    r["seam_ms_per_token"] = 1e3 / r["decode_tps"] - 1e3 / whole_tps
    return r


def pp(model: str, device: str, n: int) -> dict:
    import dgr

    eng = dgr.Engine(model, device=device, n_slots=1, **{**SETTINGS, "n_ctx": max(n + 8, 64)})
    toks = [1 + (7 * k) % 97 for k in range(n)]
    eng.forward(0, 0, toks[:8])
    eng.release(0)
    t0 = time.perf_counter()
    eng.forward(0, 0, toks)
    return {"tokens": n, "pp_tps": n / (time.perf_counter() - t0)}


async def _gather(endpoints, k: int, n: int) -> dict:
    from dgr.driver.route import AsyncRoute

    async with AsyncRoute(endpoints) as r:
        await r.complete(prompt(0), max_tokens=2, stop_on_eog=False)  # warm up
        t0 = time.perf_counter()
        gens = await asyncio.gather(*(r.complete(prompt(i), max_tokens=n, stop_on_eog=False)
                                      for i in range(k)))
        wall = time.perf_counter() - t0
        relay = r.relay
    toks = sum(len(g.tokens) for g in gens)
    dec = [g.decode_s / max(len(g.tokens) - 1, 1) for g in gens]
    return {"sessions": k, "wall_s": wall, "tokens": toks, "aggregate_tps": toks / wall,
            "decode_tps": decode_tps([g.token_times for g in gens]),
            "tpot_ms_max": 1e3 * max(dec), "relay": relay}


def route_runs(model: str, device: str, stages: int, tokens: int, sessions: list[int]) -> dict:
    import dgr
    from dgr.protocol.ranges import ranges_for
    from dgr.worker.process import LocalCluster

    n_layer = dgr.Engine(model, n_ctx=64).n_layer
    ranges = ranges_for(None, stages, n_layer)
    cluster = LocalCluster(model, ranges, settings={**SETTINGS, "n_slots": max(sessions),
                                                    "device": device})
    try:
        eps = cluster.start(timeout=600)
        return {k: asyncio.run(_gather(eps, k, tokens)) for k in sessions}
    finally:
        cluster.stop()


def _tool(name: str) -> str:
    return tool(name, build=True)  # this backend's build


#: runs of llama-batched-bench for one count before its record is given up as lost
BENCH_ATTEMPTS = 3


def batched_bench(model: str, sessions: list[int], tokens: int) -> dict:
    """``llama-batched-bench -ngl 99`` on the whole model, one run per session count.

    Its records are written through llama.cpp's asynchronous log, whose thread the program
    does not wait for at exit (``common/log.cpp``: the logger is leaked on purpose, "logs may
    be lost if not flushed before the program exits", upstream issue 22142): on a loaded
    machine the last lines, the record itself, can be lost though the run succeeded. A count
    whose run exits 0 without its record is run again, at most ``BENCH_ATTEMPTS`` times; the
    runs each took are kept (``attempts``)."""
    ub = str(SETTINGS["n_ubatch"])
    out: dict = {}
    for k in sessions:
        cmd = [_tool("llama-batched-bench"), "-m", model, "-c", str(SETTINGS["n_ctx"] * k),
               "-no-kvu", "-b", ub, "-ub", ub, "-t", str(SETTINGS["n_threads"]),
               "-fa", "on" if SETTINGS["flash_attn"] else "off", "-ngl", "99",
               "-npp", str(N_PROMPT), "-ntg", str(tokens), "-npl", str(k),
               "--output-format", "jsonl"]
        out.setdefault("commands", []).append(shlex.join(cmd))
        for attempt in range(1, BENCH_ATTEMPTS + 1):
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            if p.returncode != 0:
                out[k] = {"error": p.stderr[-1500:], "attempts": attempt}
                break
            recs = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
            if recs:
                out[k] = {"aggregate_tps": float(recs[-1]["speed_tg"]),
                          "n_gpu_layers": recs[-1].get("n_gpu_layers"), "attempts": attempt}
                break
            log(f"llama-batched-bench -npl {k} exited 0 without its record (its log thread "
                f"was not flushed at exit): run {attempt} of {BENCH_ATTEMPTS}")
        else:
            out[k] = {"error": f"no record in {BENCH_ATTEMPTS} runs", "attempts": BENCH_ATTEMPTS}
    return out


def llama_bench_pp(model: str, n: int) -> dict:
    cmd = [_tool("llama-bench"), "-m", model, "-ngl", "99", "-p", str(n), "-n", "0", "-r", "2",
           "-t", str(SETTINGS["n_threads"]), "-fa", "1" if SETTINGS["flash_attn"] else "0",
           "-ub", str(SETTINGS["n_ubatch"]),
           "-b", str(SETTINGS["n_ubatch"]), "-o", "jsonl"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        return {"command": shlex.join(cmd), "error": p.stderr[-1500:]}
    recs = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    return {"command": shlex.join(cmd), "pp_tps": float(recs[-1]["avg_ts"]),
            "backends": recs[-1].get("backends", "")}


def main(argv: list[str] | None = None) -> int:
    ap = cli.parser(__doc__, json=True, prog="python benches/device_lane.py",
                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", required=True, help="the device, as --device takes it")
    ap.add_argument("--models", default="smollm2,qwen2-7b",
                    help="comma-separated: smollm2, qwen2-7b, tiny, or GGUF paths")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per generation")
    ap.add_argument("--sessions", default="1,16,64", help="concurrent sessions")
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens of the pp row")
    ap.add_argument("--flash-attn", choices=["on", "off"], default="on",
                    help="flash attention in every engine and reference (default on)")
    ap.add_argument("--tiny", action="store_true",
                    help="a size for a software device: the tiny model, 8 tokens, sessions "
                         "1,4, pp 64, flash attention off (lavapipe of Mesa 22.3 crashes in a "
                         "flash-attention decode of several sequences whose slots were "
                         "released and filled again)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.models, args.tokens, args.sessions, args.pp = "tiny", 8, "1,4", 64
        args.flash_attn = "off"
    SETTINGS["flash_attn"] = args.flash_attn == "on"
    sessions = sorted({int(k) for k in args.sessions.split(",")})

    import dgr

    dev = next((d for d in dgr.devices() if d["name"].lower() == args.device.lower()), None)
    if dev is None:
        raise SystemExit(f"no device {args.device!r} here: "
                         + ", ".join(d["name"] for d in dgr.devices()))
    t0 = time.monotonic()
    res = {"device": dev, "settings": SETTINGS, "host": platform.node(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        res["probe"] = probe(model_path("tiny", tmp), dev["name"])
        if not res["probe"]["ok"]:
            log(f"an engine built after importing grpc and the chat binding failed "
                f"(exit {res['probe']['returncode']}):\n{res['probe']['stderr_tail']}\n"
                f"{res['probe'].get('backtrace', '')}")
            save(res, args.json)
            return 1
        log("an engine builds after importing grpc and the chat binding")
        for name in args.models.split(","):
            path = model_path(name, tmp)
            log(f"{name}: {path}")
            m = res["models"][name] = {"path": path}
            m["certify"] = certify(path, dev["name"], os.path.join(tmp, "certs"), args.tokens,
                                   max(4, max(sessions)))
            log(f"{name}: certified {m['certify']['passed']} "
                f"(bit-identical {m['certify']['bit_identical']})")
            m["whole"] = whole_decode(path, dev["name"], args.tokens)
            m["chain2"] = seam_in_process(path, dev["name"], args.tokens,
                                          m["whole"]["decode_tps"])
            m["relay"] = {}
            for k in (2, 3):
                m["relay"][k] = route_runs(path, dev["name"], k, args.tokens, [1])[1]
                log(f"{name}: relay{k} {m['relay'][k]['aggregate_tps']:.1f} tokens/s")
            m["sessions"] = route_runs(path, dev["name"], 2, args.tokens, sessions)
            m["batched_bench"] = batched_bench(path, sessions, args.tokens)
            m["pp"] = pp(path, dev["name"], args.pp)
            m["llama_bench_pp"] = llama_bench_pp(path, args.pp)
    res["seconds"] = round(time.monotonic() - t0, 1)
    save(res, args.json)
    print(table(res))
    return 0 if all(m["certify"]["passed"] for m in res["models"].values()) else 1


def save(res: dict, path: str | None) -> None:
    """Every figure of the run, with the commands that gave them, as JSON (``--json``)."""
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=2, default=str)


def table(res: dict) -> str:
    """The run as a markdown table (printed last)."""
    d = res["device"]

    def f(v) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [f"device {d['name']}: {d['description']} ({d['backend']}"
             + (", software device" if d.get("software") else "") + f"), {res['seconds']} s",
             "", "| model | row | dgr | reference | dgr / reference |", "|---|---|---:|---:|---:|"]
    for name, m in res["models"].items():
        c = m["certify"]
        lines.append(f"| {name} | certify 2 stages | {'passed' if c['passed'] else 'FAILED'} | "
                     f"whole model | bit-identical: {c['bit_identical']} |")
        w = m["whole"]["decode_tps"]
        c = m["chain2"]
        lines.append(f"| {name} | decode, 2 stages in one process (tokens/s) | "
                     f"{f(c['decode_tps'])} | {f(w)} (whole) | {c['decode_tps'] / w:.2f} "
                     f"(seam {c['seam_ms_per_token']:+.2f} ms/token) |")
        for k, r in m["relay"].items():
            lines.append(f"| {name} | decode relay{k} (tokens/s) | {f(r['aggregate_tps'])} | "
                         f"{f(w)} (whole) | {r['aggregate_tps'] / w:.2f} |")
        bb = m["batched_bench"]
        for k, r in m["sessions"].items():
            ref = bb.get(k, {}).get("aggregate_tps") if isinstance(bb.get(k), dict) else None
            # the decode phase's rate against batched-bench's S_TG (its generation phase)
            got = rate(r)
            ratio = f"{got / ref:.2f}" if ref else "-"
            lines.append(f"| {name} | {k} session(s), 2 stages, decoding (tokens/s) | "
                         f"{f(got)} | {f(ref)} (llama-batched-bench S_TG) | {ratio} |")
        ref = m["llama_bench_pp"].get("pp_tps")
        ratio = f"{m['pp']['pp_tps'] / ref:.2f}" if ref else "-"
        lines.append(f"| {name} | pp{m['pp']['tokens']} (tokens/s) | {f(m['pp']['pp_tps'])} | "
                     f"{f(ref)} (llama-bench) | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
