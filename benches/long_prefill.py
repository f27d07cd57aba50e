"""Long-context speed and memory: a ``--tokens`` prompt (default 32768) through 3 stages
against the whole model, side by side in one run, on SmolLM2 (or ``--model``).

    python benches/long_prefill.py [--tokens 32768] [--decode 16] [--ubatch 512] [--model M]
                                   [--json out.json]

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
* memory: each stage's KV bytes (its describe record) over its layer share of the whole
  model's, and each process's RSS after the generation.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from harness import cli
from harness.common import N_VOCAB, prompt_tokens, smollm2_path

RANGES = [(0, 10), (10, 20), (20, 30)]


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
    ap.add_argument("--model")
    a = ap.parse_args(argv)
    from dgr.vendor import cpu_features
    from dgr.worker.process import LocalCluster

    model = a.model or smollm2_path()
    n_ctx = -(-(a.tokens + a.decode + 1) // 256) * 256
    base = dict(n_ctx=n_ctx, n_slots=1, n_ubatch=a.ubatch, flash_attn=True)
    prompt = prompt_tokens(a.tokens, N_VOCAB)
    rec: dict = {"cpu": cpu_features()[0], "cores": os.cpu_count(), "model": os.path.basename(model),
                 "prompt_tokens": a.tokens, "decode_steps": a.decode, "settings": base}
    for t in (1, 2):
        rec[f"whole_t{t}"] = whole(model, {**base, "n_threads": t}, prompt, a.decode)
        print(f"whole t{t}: prefill {rec[f'whole_t{t}']['prefill_tps']:.1f} tok/s, decode "
              f"{rec[f'whole_t{t}']['decode_tps']:.2f} tok/s", flush=True)
    with LocalCluster(model, RANGES, settings={**base, "n_threads": 1}) as c:
        eps = c.start(timeout=300)
        r = asyncio.run(_route(eps, prompt, a.decode))
        r["rss_bytes"] = [_rss(w.proc.pid) for w in c.workers]
    rec["relay_3"] = r
    w1 = rec["whole_t1"]
    share = [w1["kv_bytes"] * (b - a_) / 30 for a_, b in RANGES]
    rec["ratios"] = {
        "prefill_relay3_over_whole_t1": r["prefill_tps"] / w1["prefill_tps"],
        "prefill_relay3_over_whole_t2": r["prefill_tps"] / rec["whole_t2"]["prefill_tps"],
        "decode_relay3_over_whole_t1": r["decode_tps"] / w1["decode_tps"],
        "stage_kv_over_layer_share": [k / s for k, s in zip(r["kv_bytes"], share)],
        "stage_rss_over_whole_rss": [x / w1["rss_bytes"] for x in r["rss_bytes"]]}
    rec["parity"] = r["tokens"] == w1["tokens"]
    for k in ("whole_t1", "whole_t2", "relay_3"):
        rec[k].pop("tokens")
    print(json.dumps(rec, indent=2))
    cli.write_json(a.json, rec, indent=2)
    return 0 if rec["parity"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
