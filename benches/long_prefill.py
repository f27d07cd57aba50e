"""Long-context speed and memory: a ``--tokens`` prompt (default 32768) through 3 stages
against the whole model and llama-server, side by side in one run, on SmolLM2 (or
``--model``, or ``--fixture-layers``).

    python benches/long_prefill.py [--tokens 32768] [--decode 16] [--ubatch 512] [--model M]
                                   [--fixture-layers N] [--no-llama-server] [--json out.json]

Every engine runs the same settings but its threads: ``n_ctx`` = the prompt + the decode
steps rounded up to 256 (SmolLM2 was trained for 8192: past it the rope runs beyond its
training, which changes no cost), ``n_ubatch`` = ``--ubatch``, flash attention on, KV f16,
one slot.

* whole t1, whole t2: ``dgr.Engine`` in this process at 1 and 2 threads;
  ``dgr.core.local.generate_local(prompt, max_tokens=1 + decode)``: prefill = the prompt's
  tokens over the time to its first token; decode = the steps after it, at the far end of
  the context.
* relay 3: three ``python -m dgr.worker`` processes at 1 thread each (the cores shared by
  the OS), driven by ``AsyncRoute(relay=True, loop=True)``: a prompt's chunks are all in
  flight at once, each stage computing chunk i while the next computes chunk i - 1
  (pipelined prefill); the same generation. Its tokens must equal the whole model's.
* llama-server t1, t2: the pinned tree's server on the same model and settings (``-c``,
  ``-ub``/``-b``, ``-fa on``, one slot, ``-t``/``-tb``), one ``/completion`` of the same token
  ids with ``cache_prompt`` off: its own ``timings`` (prompt and predicted tokens/s).
* memory: each stage's KV bytes (its describe record) over its layer share of the whole
  model's, and each process's RSS after the generation.

``--fixture-layers N``: instead of SmolLM2, a random-weight llama of SmolLM2's width (576
wide, 9 query and 3 KV heads of 64, FFN 1536, f16 matrices) with ``N`` layers, trained for
the prompt's context. At 32k a prefill is attention-bound, and its cost per layer is
SmolLM2's; fewer layers make a 32k run fit a small machine (SmolLM2's 30 layers at 1 thread
took over 12 minutes on a 2-core VM). The stages are the layers' thirds.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import subprocess
import tempfile
import time

from harness import cli
from harness.clusters import free_port
from harness.common import N_VOCAB, prompt_tokens, smollm2_path
from harness.llama import llama_server
from serve_load import _wait_healthy

#: the fixture's vocabulary (its head runs over one row per prefill: its size costs nothing)
FIXTURE_VOCAB = 2048


def thirds(n_layer: int) -> list[tuple[int, int]]:
    """Three contiguous layer ranges as equal as ``n_layer`` allows."""
    cut = [round(n_layer * i / 3) for i in range(4)]
    return [(cut[i], cut[i + 1]) for i in range(3)]


def fixture(path: str, n_layer: int, n_ctx: int) -> str:
    """A random llama of SmolLM2's width with ``n_layer`` layers, trained for ``n_ctx``."""
    from dgr.testing.fixtures import TinyLlama, write_tiny_llama

    return str(write_tiny_llama(path, TinyLlama(
        n_layer=n_layer, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=FIXTURE_VOCAB,
        n_ctx_train=n_ctx, weight_type="f16")))


def server(model: str, settings: dict, threads: int, prompt, decode: int) -> dict:
    """One uncached ``/completion`` of ``prompt``'s ids through llama-server: its timings."""
    port = free_port()
    cmd = [llama_server(), "-m", model, "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-c", str(settings["n_ctx"]), "-np", "1",
           "-b", str(settings["n_ubatch"]), "-ub", str(settings["n_ubatch"]), "-fa", "on",
           "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(port, proc, "llama-server")
        body = json.dumps({"prompt": [int(t) for t in prompt], "n_predict": 1 + decode,
                           "cache_prompt": False, "ignore_eos": True, "temperature": 0})
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=7200)
        c.request("POST", "/completion", body, {"Content-Type": "application/json"})
        r = c.getresponse()
        out = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"llama-server answered {r.status}: {out}")
        tm = out["timings"]
        return {"prefill_tps": tm["prompt_per_second"],
                "decode_tps": tm["predicted_per_second"], "prompt_n": tm["prompt_n"],
                "command": cmd}
    finally:
        proc.terminate()
        proc.wait(60)


def _rss(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def whole(model: str, settings: dict, prompt, decode: int) -> dict:
    from dgr.core.engine import Engine
    from dgr.core.local import generate_local

    e = Engine(model, **settings)
    timing: dict = {}
    toks, _ = generate_local(e, prompt, max_tokens=1 + decode, stop_on_eog=False,
                             timing=timing)
    out = {"prefill_tps": len(prompt) / timing["prefill_s"],
           "decode_tps": timing["decode_steps"] / timing["decode_s"],
           "kv_bytes": int(e.describe()["kv_bytes"]), "rss_bytes": _rss(), "tokens": toks}
    del e
    return out


async def _route(endpoints, prompt, decode: int) -> dict:
    from dgr.driver.route import AsyncRoute

    async with AsyncRoute(endpoints, relay=True, loop=True, loop_window=32) as r:
        s = r.session()
        toks, t_first = [], None
        t0 = time.perf_counter()
        async for tok in s.generate(prompt, max_tokens=1 + decode, stop_on_eog=False):
            if t_first is None:
                t_first = time.perf_counter()
            toks.append(tok)
        t1 = time.perf_counter()
        infos = await r.describe()
        relay = bool(r.relay)
        await s.close()
    return {"prefill_tps": len(prompt) / (t_first - t0),
            "decode_tps": (len(toks) - 1) / (t1 - t_first), "tokens": toks, "relay": relay,
            "kv_bytes": [int(i.kv_bytes) for i in infos], "n_ctx": [i.n_ctx for i in infos]}


def main(argv=None) -> int:
    ap = cli.parser(__doc__, json=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--model", help="GGUF (default: SmolLM2)")
    ap.add_argument("--fixture-layers", type=int, metavar="N",
                    help="a random llama of SmolLM2's width with N layers instead (docstring)")
    ap.add_argument("--no-llama-server", action="store_true",
                    help="leave out the llama-server rows")
    a = ap.parse_args(argv)
    if a.model and a.fixture_layers:
        ap.error("--model and --fixture-layers are exclusive")
    from dgr.artifacts.gguf import read_header
    from dgr.vendor import cpu_features
    from dgr.worker.process import LocalCluster

    n_ctx = -(-(a.tokens + a.decode + 1) // 256) * 256
    tmp = tempfile.TemporaryDirectory()
    if a.fixture_layers:
        model, n_vocab = fixture(os.path.join(tmp.name, "long.gguf"), a.fixture_layers,
                                 n_ctx), FIXTURE_VOCAB
    else:
        model, n_vocab = a.model or smollm2_path(), N_VOCAB
    kv = read_header(model).kv
    n_layer = int(kv[f"{kv['general.architecture']}.block_count"])
    ranges = thirds(n_layer)
    base = dict(n_ctx=n_ctx, n_slots=1, n_ubatch=a.ubatch, flash_attn=True)
    prompt = prompt_tokens(a.tokens, n_vocab)
    rec: dict = {"cpu": cpu_features()[0], "cores": os.cpu_count(),
                 "model": f"fixture: SmolLM2's width, {n_layer} layers" if a.fixture_layers
                 else os.path.basename(model), "n_layer": n_layer, "ranges": ranges,
                 "prompt_tokens": a.tokens, "decode_steps": a.decode, "settings": base}
    for t in (1, 2):
        rec[f"whole_t{t}"] = whole(model, {**base, "n_threads": t}, prompt, a.decode)
        print(f"whole t{t}: prefill {rec[f'whole_t{t}']['prefill_tps']:.1f} tok/s, decode "
              f"{rec[f'whole_t{t}']['decode_tps']:.2f} tok/s", flush=True)
    if not a.no_llama_server:
        for t in (1, 2):
            rec[f"llama_server_t{t}"] = x = server(model, base, t, prompt, a.decode)
            print(f"llama-server t{t}: prefill {x['prefill_tps']:.1f} tok/s, decode "
                  f"{x['decode_tps']:.2f} tok/s", flush=True)
    with LocalCluster(model, ranges, settings={**base, "n_threads": 1}) as c:
        eps = c.start(timeout=300)
        r = asyncio.run(_route(eps, prompt, a.decode))
        r["rss_bytes"] = [_rss(w.proc.pid) for w in c.workers]
    tmp.cleanup()
    rec["relay_3"] = r
    print(f"relay 3: prefill {r['prefill_tps']:.1f} tok/s, decode {r['decode_tps']:.2f} tok/s",
          flush=True)
    w1 = rec["whole_t1"]
    share = [w1["kv_bytes"] * (b - a_) / n_layer for a_, b in ranges]
    rec["ratios"] = {
        "prefill_relay3_over_whole_t1": r["prefill_tps"] / w1["prefill_tps"],
        "prefill_relay3_over_whole_t2": r["prefill_tps"] / rec["whole_t2"]["prefill_tps"],
        "decode_relay3_over_whole_t1": r["decode_tps"] / w1["decode_tps"],
        "stage_kv_over_layer_share": [k / s for k, s in zip(r["kv_bytes"], share)],
        "stage_rss_over_whole_rss": [x / w1["rss_bytes"] for x in r["rss_bytes"]]}
    for t in (1, 2):
        if f"llama_server_t{t}" in rec:
            ls = rec[f"llama_server_t{t}"]
            rec["ratios"][f"prefill_relay3_over_llama_server_t{t}"] = \
                r["prefill_tps"] / ls["prefill_tps"]
            rec["ratios"][f"decode_relay3_over_llama_server_t{t}"] = \
                r["decode_tps"] / ls["decode_tps"]
    rec["parity"] = r["tokens"] == w1["tokens"]
    for k in ("whole_t1", "whole_t2", "relay_3"):
        rec[k].pop("tokens")
    print(json.dumps(rec, indent=2))
    cli.write_json(a.json, rec, indent=2)
    return 0 if rec["parity"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
