"""A growing chat, turn by turn: time to first token with the front's prompt cache, with the
stages' prefix stores alone, with neither, and ``llama-server`` (its slot cache) on the whole
model, side by side in one run.

    python benches/prompt_cache.py [--turns 5] [--tokens 32] [--stages 3] [--rules 18]
                                   [--ctx 1024] [--rtt MS] [--agent] [--batch-invariant]
                                   [--json out.json]

Each server holds its own conversation: a system prompt of about 570 tokens, then per turn a
short user message; the reply (greedy, ``--tokens`` at most) joins the history, and the next
turn sends it all again, as chat clients and agent loops do. Settings as
``benches/serve_load.py`` (one thread per process, ``n_ubatch`` 64, flash attention, 1024
context tokens per slot (``--ctx``), 2 slots). ``--rules`` sizes the system prompt (about
32 tokens a rule), to grow a history to 2k tokens say. dgr reuses the common prefix to the
row where every stage measured that a partial chunk gives a fresh prefill's bits, else to the
whole chunk (exact: docs/serve.md "Prompt cache"); llama-server reuses its slot's common
prefix to the token.

``--rtt MS``: each dgr front gets its own stages behind the project's link emulator
(``harness.clusters.EmulatedCluster``: every data-plane and gRPC link between the front and
the stages and between stages delayed RTT/2 each way); the HTTP client sits next to every front, and
llama-server (one process, no links) stays on loopback as the reference.

``--agent``: an agent loop instead of a chat: every request carries three function tools
(``tool_choice`` auto; each server's chat template renders them), and each turn's message is a
short observation, as a tool-using loop sends many short turns over a fixed prefix.

``dgr store`` is a front without a cache of its own (``--prompt-cache 0``): each turn's new
session adopts the whole chunks the previous turn's session left in the stages' prefix stores
(docs/serve.md "Prefix store"), as a second front on the same workers, or a restarted one,
would; ``dgr no cache`` uses neither (``--no-prefix-store``).

``--batch-invariant``: two more fronts, ``dgr cache (bi)`` and ``dgr store (bi)``, whose stages
run the batch-invariant kernels (``--batch-invariant on``: a row's bits do not depend on how its
prompt was cut into steps, so they reuse every shared row, as llama-server does, and stay
exact), in the same run.

After each turn the dgr front with the cache reports what its kept sessions hold (``/status``
``prompt_cache.bytes``: one KV cell per kept position on every stage), the memory an entry
holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from harness import cli
from harness.clusters import free_port
from harness.llama import llama_server
from serve_load import N_CTX, N_UBATCH, _wait_healthy, stop_servers, stream_chat


def system_prompt(rules: int = 18) -> str:
    """The conversation's system prompt: about 32 tokens per rule (18: about 570 tokens)."""
    return "You are a careful assistant for a small bakery. " + " ".join(
        f"Rule {i}: answer in plain words, mention the price of item {i} when asked, keep "
        f"replies short, and never invent opening hours." for i in range(1, rules + 1))


QUESTIONS = ["What bread do you recommend for breakfast?", "How much is item 3?",
             "Do you have anything without sugar?", "Which rule says to keep replies short?",
             "Thank you. Summarise our talk in one line.", "And item 7?", "Goodbye."]


OBSERVATIONS = ["The oven reads 180 degrees.", "Flour stock: 12 kg.", "Order 41 is ready.",
                "The card reader is offline.", "Two loaves of rye are left.",
                "A customer asks for gluten-free bread.", "The delivery van is late."]

TOOLS = [{"type": "function", "function": {
    "name": name, "description": doc,
    "parameters": {"type": "object", "properties": props, "required": list(props)}}}
    for name, doc, props in (
        ("check_stock", "How much of an item is left.", {"item": {"type": "string"}}),
        ("set_oven", "Set the oven's temperature.", {"degrees": {"type": "integer"}}),
        ("notify", "Send a short message to the staff.", {"text": {"type": "string"}}))]


def turn(port: int, name: str, messages: list, max_tokens: int,
         extra: dict | None = None) -> tuple[float, str, int]:
    """One streamed chat request: (TTFT s: the first content or tool-call delta, the reply's
    text, prompt tokens)."""
    t0, first, text, usage = None, None, "", {}
    for t, ev in stream_chat(port, name, messages, max_tokens, extra):
        if ev is None:
            t0 = t
            continue
        usage = ev.get("usage") or usage
        for ch in ev.get("choices") or []:
            delta = ch.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls"):
                first = first or t
            text += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                text += (call.get("function") or {}).get("arguments") or ""
    return (first or time.perf_counter()) - t0, text, usage.get("prompt_tokens", 0)


def _held(port: int) -> dict:
    """The dgr front's prompt cache now (``/status``)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=60) as r:
        return json.load(r)["prompt_cache"]


def main(argv=None) -> int:
    ap = cli.parser(__doc__, stages=3, json=True)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rules", type=int, default=18,
                    help="rules in the system prompt, about 32 tokens each (default 18)")
    ap.add_argument("--ctx", type=int, default=N_CTX,
                    help=f"context tokens per slot, every server (default {N_CTX})")
    ap.add_argument("--model", help="GGUF (default: the registry's default model)")
    ap.add_argument("--chat-template-file", metavar="FILE",
                    help="a Jinja chat template for every server (dgr's fronts and "
                         "llama-server), for a model without one such as the generator's "
                         "fixtures (default: the GGUF's own)")
    ap.add_argument("--ubatch", type=int, default=N_UBATCH,
                    help=f"n_ubatch of every server (default {N_UBATCH}). Where every stage "
                         "measures a partial chunk's rows (and rows one per step, and a whole "
                         "chunk's) exact, dgr's cache reuses to the row")
    ap.add_argument("--rtt", type=float, default=0.0, metavar="MS",
                    help="round-trip time of every link between a dgr front and its stages, "
                         "and between stages (the link emulator); 0: loopback (default)")
    ap.add_argument("--agent", action="store_true",
                    help="an agent loop: three function tools in every request, short "
                         "observations as turns (module docstring)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="also run a cached and a store-only front whose stages compute with the "
                         "batch-invariant kernels (module docstring)")
    args = ap.parse_args(argv)
    from dgr.artifacts import models

    model = args.model or str(models.path(models.DEFAULT_MODEL))
    name = "bench"
    fronts = {"dgr cache": ["--prompt-cache", "2"], "dgr store": ["--prompt-cache", "0"],
              "dgr no cache": ["--prompt-cache", "0", "--no-prefix-store"]}
    invariant = ["--batch-invariant", "on"]  # the engine flag: every stage of the front
    engine = {k: [] for k in fronts}
    if args.batch_invariant:
        fronts |= {"dgr cache (bi)": ["--prompt-cache", "2"],
                   "dgr store (bi)": ["--prompt-cache", "0"]}
        engine |= {"dgr cache (bi)": invariant, "dgr store (bi)": invariant}
    ports = {k: free_port() for k in (*fronts, "llama-server")}
    common = ["--stages", str(args.stages), "--model-name", name, "--ctx", str(args.ctx),
              "--slots", "2", "--threads", "1", "--ubatch", str(args.ubatch), "--flash-attn",
              "on"]
    template = ["--chat-template-file", args.chat_template_file] if args.chat_template_file \
        else []
    cmds = {k: [sys.executable, "-m", "dgr", "serve", "--model", model, "--port", str(ports[k]),
                *flags, *common, *template, *engine[k]] for k, flags in fronts.items()}
    cmds |= {
        "llama-server": [llama_server(), "-m", model, "--host", "127.0.0.1", "--port",
                         str(ports["llama-server"]), "-t", "1", "-tb", "1", "-c",
                         str(args.ctx * 2), "-np", "2", "-b", str(args.ubatch), "-ub",
                         str(args.ubatch), "-fa", "on", "--alias", name, "--no-webui",
                         *(["--jinja", *template] if template else [])]}
    from harness.clusters import EmulatedCluster, worker_lines

    clusters = []
    if args.rtt > 0:  # the fronts use stages behind the link emulator (module docstring)
        from dgr.artifacts.gguf import read_header

        kv = read_header(model).kv
        n_layer = int(kv[f"{kv['general.architecture']}.block_count"])
        for k, flags in fronts.items():
            c = EmulatedCluster(model, args.stages, n_layer, args.rtt,
                                ["--ctx", str(args.ctx), "--ubatch", str(args.ubatch),
                                 *engine[k]],
                                n_slots=2)
            clusters.append(c)
            c.start()
            cmds[k] = [sys.executable, "-m", "dgr", "serve", "--model", model, "--route",
                       ",".join(c.endpoints), "--port", str(ports[k]), "--model-name", name,
                       *flags, *template]
    log = open(os.devnull, "w")
    procs = {}
    rows = []
    try:
        for k in cmds:  # one at a time: each has the machine to itself while it works
            procs[k] = subprocess.Popen(cmds[k], stdout=log, stderr=log)
        for k, p in procs.items():
            _wait_healthy(ports[k], p, k)
        history = {k: [{"role": "system", "content": system_prompt(args.rules)}]
                   for k in cmds}
        extra = {"tools": TOOLS, "tool_choice": "auto"} if args.agent else None
        said = OBSERVATIONS if args.agent else QUESTIONS
        for t in range(args.turns):
            row = {"turn": t + 1}
            for k in cmds:
                history[k].append({"role": "user", "content": said[t % len(said)]})
                ttft, reply, n = turn(ports[k], name, history[k], args.tokens, extra)
                history[k].append({"role": "assistant", "content": reply})
                row[k] = {"ttft_ms": 1e3 * ttft, "prompt_tokens": n}
            pc = _held(ports["dgr cache"])
            row["cache_held"] = {"kept": pc["kept"], "bytes": pc["bytes"]}
            ps = _held(ports["dgr store"])  # what the stores gave the front without a cache
            row["store"] = {"hits": ps["store_hits"], "tokens_reused": ps["store_tokens_reused"]}
            rows.append(row)
            print(f"turn {t + 1}: " + "  ".join(
                f"{k} {row[k]['ttft_ms']:7.0f} ms ({row[k]['prompt_tokens']} tokens)"
                for k in cmds) + f"  cache holds {pc['kept']} session(s), "
                f"{pc['bytes'] / 2**20:.1f} MiB; stores gave {ps['store_tokens_reused']} "
                "tokens", flush=True)
    finally:
        stop_servers(procs)
        for c in clusters:
            c.stop()
    print("\n| turn | prompt tokens | dgr cache ms | dgr store ms | dgr no cache ms | "
          "llama-server ms | cache / no cache | store / no cache | cache / llama-server | "
          "store / llama-server | cache holds MiB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        a, s_, b, c = (r[k]["ttft_ms"] for k in ("dgr cache", "dgr store", "dgr no cache",
                                                  "llama-server"))
        print(f"| {r['turn']} | {r['dgr cache']['prompt_tokens']} | {a:.0f} | {s_:.0f} | "
              f"{b:.0f} | {c:.0f} | {a / b:.2f} | {s_ / b:.2f} | {a / c:.2f} | {s_ / c:.2f} | "
              f"{r['cache_held']['bytes'] / 2**20:.1f} |")
    if args.batch_invariant:
        print("\n| turn | dgr cache (bi) ms | dgr store (bi) ms | llama-server ms | "
              "cache (bi) / llama-server | store (bi) / llama-server | cache (bi) / cache |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            a, s_, c, d = (r[k]["ttft_ms"] for k in ("dgr cache (bi)", "dgr store (bi)",
                                                      "llama-server", "dgr cache"))
            print(f"| {r['turn']} | {a:.0f} | {s_:.0f} | {c:.0f} | {a / c:.2f} | {s_ / c:.2f} | "
                  f"{a / d:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "rtt_ms": args.rtt, "agent": args.agent,
                       "n_ubatch": args.ubatch,
                       "commands": cmds,
                       "workers": [w for c in clusters for w in worker_lines(c)],
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
