"""Image prefill through the HTTP front: a chat request with one image (the pinned tree's
``tools/mtmd/test-1.jpeg``) and one token out, split against whole, and against llama-server
``--mmproj``, side by side in one run, on a random-weight Qwen2.5-VL-style fixture.

    python benches/media_prefill.py [--stages 3] [--rounds 5] [--layers 12] [--width 512]
                                    [--patch 14] [--json out.json]

Each server gets the same request (``max_tokens`` 1, greedy, no prompt cache) ``--rounds``
times, interleaved; the figure is the median wall time of the request as a client sees it:
the image's bytes decoded, preprocessed and encoded by the projector (libmtmd, beside the
first stage), the prompt's rows prefilled, one token sampled.

* whole: ``python -m dgr serve --stages 1`` (one worker, 1 thread), the projector beside it;
* split: ``python -m dgr serve --stages N`` (N workers at 1 thread each, the cores shared by
  the OS), the projector beside the first;
* llama-server t1: the pinned tree's server on the same text model and projector
  (``--mmproj``, ``-t 1``, ``-c``, ``-b``/``-ub``, ``-fa on``, one slot, ``cache_prompt``
  off). Its replies must be the whole model's text too (greedy).

Also, to say where the time goes: the projector alone (``AsyncRoute.encode_media`` on a
whole-model worker: the image's rows, no prefill), and llama-server's own ``timings.prompt_ms``
(its image encode and prefill, without HTTP and preprocessing).

The fixture: text model ``--layers`` x ``--width`` (``qwen2vl``, M-RoPE, f32), projector a
4-block ViT of width 256 with ``--patch`` pixel patches (the image is resized to multiples of
2 x patch: 14 gives 391 image rows of test-1.jpeg's 640 x 488).
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from harness import cli
from harness.clusters import free_port
from harness.llama import llama_server
from serve_load import _wait_healthy

SETTINGS = dict(n_ctx=1024, n_ubatch=256)


def _fixture(out: str, layers: int, width: int, patch: int) -> tuple[str, str]:
    from dgr.testing.mmproj import TinyMmproj, TinyQwen2VL, write_mmproj, write_tiny_qwen2vl

    heads = max(1, width // 64)
    text = write_tiny_qwen2vl(os.path.join(out, "text.gguf"), TinyQwen2VL(
        n_layer=layers, n_embd=width, n_head=heads, n_head_kv=max(1, heads // 2),
        n_ff=3 * width, rope_sections=(8, 12, 12, 0), n_ctx_train=SETTINGS["n_ctx"]))
    proj = write_mmproj(os.path.join(out, "mmproj.gguf"), text, TinyMmproj(
        projector="qwen25vl", n_embd=256, n_head=4, n_ff=1024, n_layer=4, patch_size=patch))
    return str(text), str(proj)


def _body(image: bytes, model: str, llama: bool) -> bytes:
    url = "data:image/jpeg;base64," + base64.b64encode(image).decode()
    # llama-server's prompt cache off by its own field (dgr's fronts run --prompt-cache 0)
    extra = {"cache_prompt": False} if llama else {}
    return json.dumps({"model": model, "max_tokens": 1, "temperature": 0, **extra,
                       "messages": [{"role": "user", "content": [
                           {"type": "text", "text": "What is in this picture?"},
                           {"type": "image_url", "image_url": {"url": url}}]}]}).encode()


def _post(port: int, body: bytes) -> tuple[float, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    dt = time.perf_counter() - t0
    c.close()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
    return dt, json.loads(data)


def _dgr(text: str, proj: str, stages: int, port: int, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dgr", "serve", "--model", text, "--mmproj", proj,
         "--stages", str(stages), "--ctx", str(SETTINGS["n_ctx"]), "--slots", "1",
         "--threads", "1", "--ubatch", str(SETTINGS["n_ubatch"]), "--prompt-cache", "0",
         "--no-prefix-store", "--model-name", "m", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT)


def _llama(text: str, proj: str, port: int, log) -> subprocess.Popen:
    ub = str(SETTINGS["n_ubatch"])
    return subprocess.Popen(
        [llama_server(), "-m", text, "--mmproj", proj, "--host", "127.0.0.1", "--port",
         str(port), "-t", "1", "-tb", "1", "-c", str(SETTINGS["n_ctx"]), "-np", "1", "-b", ub,
         "-ub", ub, "-fa", "on", "--no-webui", "--no-warmup"], stdout=log,
        stderr=subprocess.STDOUT)


def _encode_only(endpoint: str, image: bytes, rounds: int) -> float:
    """The projector alone on a whole-model worker: median seconds of encode_media."""
    from dgr.driver.route import AsyncRoute

    async def go():
        async with AsyncRoute([endpoint]) as r:
            m = r.stages[0].media_marker
            out = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                await r.encode_media(f"What is in this picture? {m}", [image])
                out.append(time.perf_counter() - t0)
            return statistics.median(out)

    return asyncio.run(go())


def main(argv=None) -> dict:
    ap = cli.parser(__doc__, stages=3, rounds=5, json=True)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--patch", type=int, default=14)
    ap.add_argument("--no-llama-server", action="store_true")
    args = ap.parse_args(argv)
    from dgr.vendor import Vendor

    image = (Vendor().src / "tools" / "mtmd" / "test-1.jpeg").read_bytes()
    tmp = tempfile.mkdtemp(prefix="dgr-media-bench-")
    text, proj = _fixture(tmp, args.layers, args.width, args.patch)
    log = open(os.path.join(tmp, "servers.log"), "w")
    servers = {"whole": (_dgr, 1), f"split {args.stages}": (_dgr, args.stages)}
    if not args.no_llama_server:
        servers["llama-server t1"] = (_llama, None)
    procs, ports = {}, {}
    try:
        for name, (start, n) in servers.items():
            ports[name] = free_port()
            procs[name] = (start(text, proj, n, ports[name], log) if n is not None
                           else start(text, proj, ports[name], log))
            _wait_healthy(ports[name], procs[name], name)
        times = {name: [] for name in servers}
        replies, rows = {}, {}
        for name in servers:  # one warm-up request each (not timed)
            _, r = _post(ports[name], _body(image, "m", name.startswith("llama")))
            replies[name] = r["choices"][0]["message"]["content"]
            rows[name] = r["usage"]["prompt_tokens"]
        timings = []  # llama-server's own: its prompt's milliseconds (the image's encode in)
        for _ in range(args.rounds):
            for name in servers:
                dt, r = _post(ports[name], _body(image, "m", name.startswith("llama")))
                times[name].append(dt)
                if "timings" in r:
                    timings.append(r["timings"])
        # the projector alone, on a worker of its own (the servers' are theirs)
        from dgr.worker.process import LocalCluster

        alone = LocalCluster(text, [None], settings=dict(SETTINGS, n_slots=1, n_threads=1),
                             first_args=["--mmproj", proj])
        try:
            enc = _encode_only(alone.start()[0], image, args.rounds)
        finally:
            alone.stop()
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
    med = {name: statistics.median(t) for name, t in times.items()}
    whole = med["whole"]
    res = {"settings": SETTINGS, "layers": args.layers, "width": args.width,
           "patch": args.patch, "rounds": args.rounds, "cpu": _cpu(),
           "prompt_tokens": rows, "replies_equal_whole": {
               n: replies[n] == replies["whole"] for n in servers},
           "median_s": med, "min_s": {n: min(t) for n, t in times.items()},
           "max_s": {n: max(t) for n, t in times.items()},
           "ratio_to_whole": {n: med[n] / whole for n in servers},
           "projector_only_s": enc,
           "llama_server_prompt_ms": statistics.median(t["prompt_ms"] for t in timings)
           if timings else None}
    if "llama-server t1" in med:
        res["ratio_to_llama_server"] = {n: med[n] / med["llama-server t1"] for n in servers}
    print(f"CPU: {res['cpu']}; {args.layers} layers x {args.width}, image rows: {rows}")
    for n in servers:
        print(f"  {n:16s} median {med[n] * 1e3:8.1f} ms  (x{res['ratio_to_whole'][n]:.2f} "
              f"of whole)  reply equal to whole's: {res['replies_equal_whole'][n]}")
    print(f"  projector alone  median {enc * 1e3:8.1f} ms")
    if timings:
        print(f"  llama-server's own prompt_ms (image encode and prefill) median "
              f"{res['llama_server_prompt_ms']:.1f} ms")
    cli.write_json(args.json, res)
    return res


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        name = "unknown"
    return f"{name}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
