"""Speculative decoding across the ring, side by side with speculation off (docs/speculative.md).

    python benches/speculative.py [--rtts 0,20] [--stages 3] [--rounds 3] [--tokens 96]
                                  [--max-draft 8] [--json out.json]

n SmolLM2 workers (``harness.common.SETTINGS``: one thread each, n_ctx 1024, ubatch 64,
flash attention; one slot) on loopback, and n more behind ``dgr.testing.linkemu`` processes
on both planes (``harness.clusters.EmulatedCluster``, RTT/2 each way; the same as benches/wan.py).
RTT 0 is the plain loopback workers (no emulator). Each configuration runs the decode loop
(``AsyncRoute(relay=True, loop=True)``) with ``speculate=""`` (off) and ``speculate="ngram"``,
side by side within each round (off first in even rounds, on first in odd ones), on each
prompt:

* ``code-rewrite``: a block of Python code and "rewrite it with one change" (the model's chat
  template): meant to be repetition-heavy, but SmolLM2-135M writes new code instead of
  copying, so its n-gram drafts are mostly rejected: the case where the policy must stop
  drafting;
* ``list-pattern``: a list of "the X of the Y" pairs to continue: the model repeats it, so
  drafts from the prompt and from its own output are accepted (repetition-heavy);
* ``story``: a short story (chat template): new text, drafts find few matches.

Reported per prompt and RTT (medians over ``--rounds``): tokens/s off and on and their ratio,
the acceptance (drafts accepted / sent), tokens per ring trip, TPOT on, and the per-trip
model: a trip costs about ``C + S * RTT`` (C: the loopback TPOT with speculation off in the
same round; S: the seams a token crosses, ``harness.clusters.seams_model``), so TPOT on should be
about ``(C + S * RTT) / tokens_per_trip`` plus the extra compute of the drafts' rows. The
tokens of every run are checked against speculation off (the same tokens: the exactness
contract). Goals (issue 20): at RTT 20 ms, >= 2x tokens/s on a repetition-heavy prompt and
>= 0.97x where drafts are rejected; on loopback, >= 1x on every prompt.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import numpy as np


from harness import cli
from harness.clusters import route_ranges, start_cluster
from harness.common import SETTINGS, smollm2_path

CODE = ('def parse(line):\n    key, _, value = line.partition("=")\n'
        '    return key.strip(), value.strip()\n\n\n'
        'def load(path):\n    out = {}\n    with open(path) as f:\n        for line in f:\n'
        '            if line.strip() and not line.startswith("#"):\n'
        '                k, v = parse(line)\n                out[k] = v\n    return out\n')


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = {
    "code-rewrite": _chat(f"{CODE}\nRewrite the code above, unchanged except that `load` is "
                          "called `read_config`."),
    "list-pattern": " ".join(f"the {a} of the {b}" for a, b in zip(
        "king queen dog river house city boat tree star road wind door bird song".split(),
        "sea hill lake town moon wood farm ship rain gate sun field coast cave".split()))
    + ". Continue the list in the same pattern:",
    "story": _chat("Write a short story about a lighthouse keeper who finds a map."),
}
MODES = ("off", "ngram")


async def _run(endpoints, prompt: str, n: int, speculate: str, max_draft: int,
               **kw) -> dict:
    from dgr.driver.route import AsyncRoute

    async with AsyncRoute(endpoints, relay=True, loop=True, speculate=speculate,
                          max_draft=max_draft, **kw) as r:
        toks_prompt = await r.tokenize(prompt, True, True)
        s = r.session()
        try:  # warm up: links, Hello
            async for _ in s.generate(toks_prompt[:8], max_tokens=2, stop_on_eog=False):
                pass
        finally:
            await s.close()
        s = r.session()
        toks, t_first = [], None
        try:
            async for t in s.generate(toks_prompt, max_tokens=n + 1, stop_on_eog=False):
                if t_first is None:
                    t_first = time.perf_counter()
                toks.append(t)
            t_end = time.perf_counter()
        finally:
            await s.close()
        trips, drafted, accepted = s.trips, s.drafted, s.accepted
    steps = len(toks) - 1
    return {"tokens": toks, "steps": steps, "tpot_ms": 1e3 * (t_end - t_first) / steps,
            "tps": steps / (t_end - t_first), "trips": trips, "drafted": drafted,
            "accepted": accepted}


def main(argv=None) -> int:
    ap = cli.parser(__doc__, stages=3, rounds=3, json=True)
    ap.add_argument("--rtts", default="0,20", help="RTTs per link, ms (0: plain loopback)")
    ap.add_argument("--tokens", type=int, default=96, help="decode steps of one run")
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--prompts", default=",".join(PROMPTS))
    args = ap.parse_args(argv)

    from dgr._core import HAS_LAYER_RANGES

    if args.stages > 1 and not HAS_LAYER_RANGES:
        print("benches/speculative.py: this build has no layer ranges")
        return 0
    from harness.clusters import EmulatedCluster, seams_model

    n = args.stages
    rtts = [float(x) for x in args.rtts.split(",") if x]
    prompts = [p for p in args.prompts.split(",") if p]
    path = smollm2_path()
    import dgr

    n_layer = dgr.Engine(path, **SETTINGS).n_layer
    runs: dict = {(p, rtt, m): [] for p in prompts for rtt in rtts for m in MODES}
    print(f"starting {n} workers, and {n} more behind link emulators ...", file=sys.stderr,
          flush=True)
    direct = emu = None
    try:
        direct = start_cluster(path, n, n_layer)
        emu = EmulatedCluster(path, n, n_layer, max(rtts)).start()
        for i in range(args.rounds):
            for rtt in rtts:
                if rtt > 0:
                    emu.set_rtt(rtt)
                eps = direct.endpoints if rtt == 0 else emu.endpoints
                for p in prompts:
                    # side by side on the same route in the same round; the order alternates
                    # by round, so a drift within a round favours neither
                    for m in (MODES if i % 2 == 0 else MODES[::-1]):
                        r = asyncio.run(_run(eps, PROMPTS[p], args.tokens,
                                             "" if m == "off" else m, args.max_draft,
                                             deadline_floor=max(2.0, rtt / 50)))
                        runs[(p, rtt, m)].append(r)
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        if emu is not None:
            emu.stop()
        if direct is not None:
            direct.stop()

    def med(rs, f):
        return float(np.median([f(r) for r in rs]))

    print(f"{n}-stage route of {os.path.basename(path)}, ranges {route_ranges(n_layer, n)}; "
          f"settings {SETTINGS} n_slots 1; decode loop (window 32), {args.tokens} greedy "
          f"steps a run, max_draft {args.max_draft}; medians of {args.rounds} interleaved "
          "rounds; RTT 0 = loopback without emulators")
    print("  model: a trip costs C + S * RTT (C = loopback TPOT off, same round; S = seams a "
          "token crosses); TPOT on ~ that / tokens per trip")
    print(f"{'prompt':<13}{'RTT':>5}{'tok/s off':>10}{'tok/s on':>9}{'ratio':>7}"
          f"{'accept':>8}{'tok/trip':>9}{'TPOT on':>9}{'model':>8}{'same':>6}")
    summary = []
    for p in prompts:
        c = {i: runs[(p, 0.0, "off")][i]["tpot_ms"] for i in range(args.rounds)} \
            if 0.0 in rtts else None
        for rtt in rtts:
            off, on = runs[(p, rtt, "off")], runs[(p, rtt, "ngram")]
            ratio = med(range(args.rounds), lambda i: on[i]["tps"] / off[i]["tps"])
            drafted = sum(r["drafted"] for r in on)
            acc = sum(r["accepted"] for r in on) / drafted if drafted else 0.0
            tpt = med(on, lambda r: (r["trips"] + r["accepted"]) / max(r["trips"], 1))
            s = seams_model("relay", n, args.tokens, 32)
            model_ms = (med(range(args.rounds), lambda i: c[i]) + s * rtt) / tpt \
                if c is not None else float("nan")
            same = all(a["tokens"] == b["tokens"] for a, b in zip(on, off))
            row = {"prompt": p, "rtt_ms": rtt, "tps_off": med(off, lambda r: r["tps"]),
                   "tps_on": med(on, lambda r: r["tps"]), "ratio": ratio,
                   "acceptance": acc, "tokens_per_trip": tpt,
                   "tpot_on_ms": med(on, lambda r: r["tpot_ms"]),
                   "tpot_off_ms": med(off, lambda r: r["tpot_ms"]),
                   "model_tpot_on_ms": model_ms, "S": s, "same_tokens": same}
            summary.append(row)
            print(f"{p:<13}{rtt:>5g}{row['tps_off']:>10.1f}{row['tps_on']:>9.1f}"
                  f"{ratio:>7.2f}{acc:>8.0%}{tpt:>9.2f}{row['tpot_on_ms']:>9.2f}"
                  f"{model_ms:>8.2f}{'yes' if same else 'NO':>6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stages": n, "settings": SETTINGS, "rtts": rtts, "rounds": args.rounds,
                       "tokens": args.tokens, "max_draft": args.max_draft,
                       "prompts": {p: PROMPTS[p] for p in prompts},
                       "runs": [{"prompt": p, "rtt_ms": rtt, "mode": m,
                                 **{k: v for k, v in r.items() if k != "tokens"}}
                                for (p, rtt, m), rs in runs.items() for r in rs],
                       "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
