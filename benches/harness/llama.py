"""The pinned llama.cpp tree's own programs as references: ``llama-bench`` (the whole model,
and over ``ggml-rpc-server`` processes), ``llama-batched-bench`` (many sequences in one
forward). Each command mirrors dgr's engine settings, or refuses what it cannot mirror."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time

from .clusters import free_port
from .common import N_PROMPT_DECODE


def tool(name: str, build: bool = False) -> str:
    """The pinned tree's program ``name`` (one of the vendor's known tools), from this
    backend's build; ``build``: build it when it is missing (else FileNotFoundError)."""
    from dgr.vendor import Vendor

    v = Vendor()
    p = v.tool_path(name)
    if (p is None or not os.path.exists(str(p))) and build:
        print(f"building {name} (the pinned tree's) ...", file=sys.stderr, flush=True)
        v.build(tools=[name])
        p = v.tool_path(name)
    if p is None or not os.path.exists(str(p)):
        raise FileNotFoundError(f"{name} is not built: python -m dgr.vendor build "
                                f"--tools llama-bench,ggml-rpc-server,llama-batched-bench")
    return str(p)


def llama_server() -> str:
    """The pinned tree's llama-server, built once into the cache (a few minutes cold)."""
    from dgr.vendor import Vendor

    v = Vendor()
    exe = v.cache / f"llama-server-{v.key()}" / "bin" / "llama-server"
    if exe.exists():
        return str(exe)
    v.build()  # fetches and patches the tree if needed
    b = exe.parent.parent
    cmake = shutil.which("cmake") or "cmake"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run([cmake, "-S", str(v.src), "-B", str(b), *gen, "-DCMAKE_BUILD_TYPE=Release",
                    "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF",
                    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DGGML_RPC=OFF"], check=True,
                   stdout=subprocess.DEVNULL)
    print(f"building llama-server into {b} ...", file=sys.stderr, flush=True)
    subprocess.run([cmake, "--build", str(b), "--target", "llama-server", "-j",
                    str(v.jobs())], check=True, stdout=subprocess.DEVNULL)
    return str(exe)


#: the engine settings llama-bench can mirror, and dgr.Engine's defaults for those not given
_BENCH_DEFAULTS = {"n_ctx": 1024, "n_slots": 1, "n_threads": 1, "n_ubatch": 64,
                   "flash_attn": True, "type_k": "f16", "type_v": "f16", "use_mmap": True,
                   "batch_invariant": False}


def _mirrored(settings: dict, tool: str) -> dict:
    """dgr's engine ``settings`` over the defaults of those not given, where ``tool`` can run
    them; ValueError for an unknown key, or ``batch_invariant`` on (dgr's batch-invariant
    kernels: the llama.cpp tools run llama.cpp's own)."""
    unknown = set(settings) - set(_BENCH_DEFAULTS)
    if unknown:
        raise ValueError(f"{tool} cannot mirror the settings {sorted(unknown)}")
    s = {**_BENCH_DEFAULTS, **settings}
    if s["batch_invariant"]:
        raise ValueError(f"{tool} cannot mirror batch_invariant=True (dgr's batch-invariant "
                         "kernels): it runs llama.cpp's own")
    return s


def llama_bench_commands(settings: dict, n_decode: int, prefills, model: str, *,
                         n_prompt_decode: int = N_PROMPT_DECODE, exe: str = "llama-bench",
                         rpc=None, extra=()) -> dict[str, list[str]]:
    """The llama-bench command lines that run dgr's engine ``settings`` at dgr's lengths:
    {"prefill": ``-p <prefills> -n 0 -d 0``, "decode": ``-p 0 -n <n_decode> -d
    <n_prompt_decode>``} (no "prefill" when ``prefills`` is empty).

    Both: ``-t n_threads``, ``-b n_ubatch -ub n_ubatch`` (dgr's n_batch is its n_ubatch,
    cpp/src/engine/load.cpp), ``-fa 1|0``, ``-ctk/-ctv``, ``-lm auto|none`` (use_mmap), ``-r 1 -o json``;
    ``-ngl 0`` (dgr keeps every layer on the CPU) or, with ``rpc`` endpoints, ``-ngl 99
    --rpc ...``; then ``extra``. llama-bench sizes its context to prompt + generation + depth,
    which gives the same n_kv at every step as dgr's n_ctx only while that length fits in
    n_ctx: longer raises ValueError, as does a setting llama-bench cannot mirror (n_slots > 1,
    an unknown key, ``batch_invariant`` on)."""
    s = _mirrored(settings, "llama-bench")
    if s["n_slots"] != 1:
        raise ValueError(f"llama-bench runs one sequence; n_slots={s['n_slots']}")
    longest = max([*prefills, n_prompt_decode + n_decode])
    # n_ctx 0: the model's trained context (dgr.Engine's n_ctx=0), which holds any bench length
    if s["n_ctx"] and longest > s["n_ctx"]:
        raise ValueError(f"{longest} tokens do not fit n_ctx={s['n_ctx']}: llama-bench's "
                         f"context would be larger than dgr's")
    ub = str(s["n_ubatch"])
    common = [exe, "-m", model, "-t", str(s["n_threads"]), "-b", ub, "-ub", ub,
              "-fa", "1" if s["flash_attn"] else "0", "-ctk", s["type_k"], "-ctv", s["type_v"],
              "-lm", "auto" if s["use_mmap"] else "none", "-ngl", "99" if rpc else "0",
              *(["--rpc", ",".join(rpc)] if rpc else []), "-r", "1", "-o", "json", *extra]
    out = {}
    if prefills:
        out["prefill"] = [*common, "-p", ",".join(str(n) for n in prefills), "-n", "0",
                          "-d", "0"]
    out["decode"] = [*common, "-p", "0", "-n", str(n_decode), "-d", str(n_prompt_decode)]
    return out


def check_bench_record(rec: dict, settings: dict, n_depth: int, rpc: bool = False) -> None:
    """Raise RuntimeError unless llama-bench's JSON record ``rec`` ran ``settings`` (its own
    echo of n_threads, n_batch, n_ubatch, flash_attn, type_k/type_v, n_gpu_layers) at depth
    ``n_depth``."""
    s = {**_BENCH_DEFAULTS, **settings}
    want = {"n_threads": s["n_threads"], "n_batch": s["n_ubatch"], "n_ubatch": s["n_ubatch"],
            "flash_attn": 1 if s["flash_attn"] else 0, "type_k": s["type_k"],
            "type_v": s["type_v"], "n_gpu_layers": 99 if rpc else 0, "n_depth": n_depth}
    got = {k: rec.get(k) for k in want}
    if isinstance(got["flash_attn"], bool):
        got["flash_attn"] = int(got["flash_attn"])
    if got != want:
        raise RuntimeError(f"llama-bench ran {got}, not {want}")


def parse_bench(records: list[dict], settings: dict, n_depth: int, rpc: bool = False) -> dict:
    """{prefill<n>_tps, decode_tps} of llama-bench's JSON ``records`` (each checked: prefill
    at depth 0, decode at ``n_depth``)."""
    res = {}
    for rec in records:
        if rec.get("n_gen", 0) == 0:
            check_bench_record(rec, settings, 0, rpc)
            res[f"prefill{rec['n_prompt']}_tps"] = float(rec["avg_ts"])
        elif rec.get("n_prompt", 0) == 0:
            check_bench_record(rec, settings, n_depth, rpc)
            res["decode_tps"] = float(rec["avg_ts"])
        else:
            raise RuntimeError(f"unexpected llama-bench record {rec}")
    return res


def llama_bench(cmds: dict[str, list[str]], settings: dict, rpc: bool = False,
                n_prompt_decode: int = N_PROMPT_DECODE) -> dict:
    """Run ``llama_bench_commands``' command lines; {prefill<n>_tps, decode_tps}."""
    res = {}
    for cmd in cmds.values():
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} failed ({out.returncode}):\n"
                               f"{out.stderr[-2000:]}")
        res.update(parse_bench(json.loads(out.stdout), settings, n_prompt_decode, rpc))
    return res


# --- llama-batched-bench (many sequences in one forward, the whole model) ---------------------

def batched_bench_threads(n_stages: int, n_threads: int, cpu_count: int) -> tuple[int, int]:
    """(one stage's thread count, the "same total threads" of an ``n_stages`` route): every
    worker runs ``n_threads``, so the route runs ``n_stages * n_threads`` on this machine,
    capped at its ``cpu_count`` cores (more threads than cores in one process only contend)."""
    if n_stages < 1 or n_threads < 1 or cpu_count < 1:
        raise ValueError(f"n_stages={n_stages}, n_threads={n_threads}, cpu_count={cpu_count}")
    return n_threads, min(n_stages * n_threads, cpu_count)


def batched_bench_command(settings: dict, sessions, n_decode: int, threads: int, model: str,
                          *, n_prompt: int = N_PROMPT_DECODE,
                          exe: str = "llama-batched-bench") -> list[str]:
    """The ``llama-batched-bench`` command line that runs ``sessions`` sequences on the whole
    model with dgr's engine ``settings`` (those of the session clusters): ``-c n_ctx *
    max(sessions)`` with ``-no-kvu`` (one KV stream per sequence, as dgr's slots:
    ``kv_unified=false`` and ``n_ctx`` per slot, cpp/src/engine/load.cpp), ``-b -ub n_ubatch``, ``-fa
    on|off``, ``-ctk/-ctv``, ``-lm auto|none`` (use_mmap), ``-ngl 0``, ``-t threads``;
    ``-npp n_prompt -ntg n_decode -npl <sessions>`` (a prompt per sequence, not shared),
    ``--output-format jsonl``. Raises ValueError for a setting it cannot mirror (an unknown
    key, ``batch_invariant`` on, fewer slots than sequences) or a sequence longer than
    ``n_ctx``."""
    s = _mirrored(settings, "llama-batched-bench")
    sessions = sorted(set(int(k) for k in sessions))
    if not sessions or sessions[0] < 1:
        raise ValueError(f"sessions must be >= 1, got {sessions}")
    if s["n_slots"] < sessions[-1]:
        raise ValueError(f"{sessions[-1]} sequences need {sessions[-1]} slots; "
                         f"n_slots={s['n_slots']}")
    if not s["n_ctx"]:
        raise ValueError("n_ctx=0 (the model's trained context per slot) has no "
                         "llama-batched-bench spelling (its -c 0 is one context for all "
                         "sequences): give the n_ctx the engines chose (Engine.n_ctx)")
    if n_prompt + n_decode > s["n_ctx"]:
        raise ValueError(f"{n_prompt} + {n_decode} tokens do not fit n_ctx={s['n_ctx']}")
    ub = str(s["n_ubatch"])
    return [exe, "-m", model, "-c", str(s["n_ctx"] * sessions[-1]), "-no-kvu", "-b", ub,
            "-ub", ub, "-t", str(threads), "-fa", "on" if s["flash_attn"] else "off",
            "-ctk", s["type_k"], "-ctv", s["type_v"], "-lm", "auto" if s["use_mmap"] else "none",
            "-ngl", "0", "-npp", str(n_prompt), "-ntg", str(n_decode),
            "-npl", ",".join(str(k) for k in sessions), "--output-format", "jsonl"]


def parse_batched_bench(text: str, settings: dict, sessions, n_decode: int, threads: int,
                        n_prompt: int = N_PROMPT_DECODE) -> dict[int, dict]:
    """{sequences: {aggregate_tps, tpot_ms, prefill_tps, record}} of ``llama-batched-bench
    --output-format jsonl`` output ``text``. aggregate_tps: its ``speed_tg`` (sequences *
    generated tokens / the generation phase's time); tpot_ms: that time per step (every
    sequence gets one token a step). Each record must echo ``settings``, ``threads`` and the
    lengths (RuntimeError otherwise), and every one of ``sessions`` must have one
    (batched-bench skips a count whose KV does not fit, silently)."""
    s = {**_BENCH_DEFAULTS, **settings}
    want = {"n_batch": s["n_ubatch"], "n_ubatch": s["n_ubatch"],
            "flash_attn": 1 if s["flash_attn"] else 0, "is_pp_shared": 0, "n_gpu_layers": 0,
            "n_threads": threads, "n_threads_batch": threads, "pp": n_prompt, "tg": n_decode}
    out: dict[int, dict] = {}
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        got = {k: rec.get(k) for k in want}
        if got != want:
            raise RuntimeError(f"llama-batched-bench ran {got}, not {want}")
        if int(rec.get("n_kv_max", 0)) < s["n_ctx"] * max(sessions):
            raise RuntimeError(f"llama-batched-bench's context {rec.get('n_kv_max')} is "
                               f"smaller than n_ctx={s['n_ctx']} x {max(sessions)} sequences")
        out[int(rec["pl"])] = {"aggregate_tps": float(rec["speed_tg"]),
                               "tpot_ms": 1e3 * float(rec["t_tg"]) / n_decode,
                               "prefill_tps": float(rec["speed_pp"]), "record": rec}
    missing = sorted(set(int(k) for k in sessions) - set(out))
    if missing:
        raise RuntimeError(f"llama-batched-bench reported no record for {missing} sequences")
    return out


def batched_bench(cmd: list[str], settings: dict, sessions, n_decode: int, threads: int,
                  n_prompt: int = N_PROMPT_DECODE) -> dict[int, dict]:
    """Run ``batched_bench_command``'s command line; ``parse_batched_bench`` of its output."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({out.returncode}):\n"
                           f"{out.stderr[-2000:]}")
    return parse_batched_bench(out.stdout, settings, sessions, n_decode, threads, n_prompt)


class RpcServers:
    """``n`` ``ggml-rpc-server -t 1 -H 127.0.0.1 -p PORT`` processes; stop() reaps them."""

    def __init__(self, n: int, n_threads: int = 1):
        self.n, self.n_threads = n, n_threads
        self.procs: list[subprocess.Popen] = []
        self.endpoints: list[str] = []
        self.commands: list[list[str]] = []

    def start(self, timeout: float = 30.0) -> list[str]:
        exe = tool("ggml-rpc-server")
        try:
            for _ in range(self.n):
                port = free_port()
                cmd = [exe, "-t", str(self.n_threads), "-H", "127.0.0.1", "-p", str(port)]
                self.commands.append(cmd)
                self.procs.append(subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
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
