"""A scripted coding-agent conversation through the Anthropic Messages API: each turn's time
to first token and output tokens/s for dgr (3 stages), an uncached dgr front and
llama-server, side by side in one run, on the same trace.

    python benches/agent_trace.py [--turns 20] [--system-tokens 12000] [--tool-min 200]
                                  [--tool-max 2000] [--tokens 32] [--ctx 0] [--ubatch 64]
                                  [--model M] [--no-uncached] [--json out.json]

The trace (seeded, the same for every server): a system prompt of about ``--system-tokens``
(an agent's rules), five tools (``read_file``, ``grep``, ``run_tests``, ``edit_file``,
``list_dir``), a first user task, then per turn the assistant's scripted ``tool_use`` and the
user's ``tool_result`` of ``--tool-min`` to ``--tool-max`` tokens (a source file, a grep, a
test log). The model's own reply (greedy, ``--tokens`` at most) is measured and compared, and
the next turn carries the scripted call instead, so every server prefills the same
conversation, as a replayed agent trace does. Every request is streamed (``stream: true``):
TTFT = from sending it to the first ``content_block_delta``; output tokens/s = (output tokens
- 1) over the time from that delta to ``message_stop``; prompt tokens = ``input_tokens`` +
``cache_read_input_tokens`` + ``cache_creation_input_tokens`` of ``message_start``.

Servers, one thread per process, ``n_ubatch`` = ``n_batch`` = ``--ubatch``, flash attention,
one slot, ``--ctx`` tokens (0: the model's trained context, or what the trace needs rounded
up to 4096 where that is more: past its training the rope runs beyond it, which changes no
cost):

* ``dgr``: ``python -m dgr serve --stages 3`` with its prompt cache (kept an hour here:
  ``--prompt-cache-ttl 3600``, so a slow turn of another server does not expire it);
* ``dgr uncached``: the same with ``--prompt-cache 0 --no-prefix-store``, every turn a fresh
  prefill: its replies are the reference the cached front's must equal, token for token;
* ``llama-server t1`` and ``t2``: the pinned tree's server (``--jinja``, its slot cache) at 1
  and 2 threads. On a 2-core machine dgr's three stages share both cores, so ``t2`` is the
  reference with the same cores.

Each request carries the tools with ``tool_choice`` ``none`` (``--tool-choice``): the model's
reply streams as text, token by token, on every server, so its first delta is its first
token. With ``auto`` each server holds a reply that may be a call until it can parse it (dgr
sends a call's first delta when its JSON is whole, llama-server a partial JSON diff), and a
first delta times two different things.

``--no-uncached`` leaves the uncached front out (it prefills the whole history every turn).
The summary: per turn each server's TTFT, and dgr's TTFT over each llama-server's; the
median of turns 2 to the last; and whether every reply equals the uncached front's.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import subprocess
import sys
import time

from harness import cli
from harness.clusters import free_port
from harness.llama import llama_server
from serve_load import _median, _wait_healthy, stop_servers

#: characters per token of the trace's text on a BPE vocabulary (code and English): sizes the
#: system prompt and the tool results; the servers report the tokens they counted
CHARS_PER_TOKEN = 3.2

TOOLS = [
    {"name": "read_file", "description": "Read a file of the repository.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                      "required": ["path"]}},
    {"name": "grep", "description": "Search the repository for a regular expression.",
     "input_schema": {"type": "object", "properties": {"pattern": {"type": "string"}},
                      "required": ["pattern"]}},
    {"name": "run_tests", "description": "Run the test suite, or the tests named.",
     "input_schema": {"type": "object", "properties": {"target": {"type": "string"}},
                      "required": ["target"]}},
    {"name": "edit_file", "description": "Replace text in a file.",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
         "required": ["path", "old", "new"]}},
    {"name": "list_dir", "description": "List a directory.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                      "required": ["path"]}},
]

TASK = ("The test tests/test_parser.py::test_nested_lists fails since the last change to "
        "src/parser.py. Find the cause, fix it, and run the tests.")


def system_prompt(tokens: int) -> str:
    """An agent's rules, about ``tokens`` tokens."""
    rng = random.Random(1)
    verbs = ["read", "check", "test", "keep", "name", "explain", "prefer", "avoid"]
    things = ["the diff", "each file", "the failing test", "the public API", "error paths",
              "the commit message", "imports", "the docstring", "a regression test"]
    out = ["You are a coding agent working in a Python repository. Use the tools to read, "
           "search, edit and test. Follow every rule below."]
    i, size = 0, len(out[0])
    while size < tokens * CHARS_PER_TOKEN:
        i += 1
        r = (f"Rule {i}: {rng.choice(verbs)} {rng.choice(things)} before you "
             f"{rng.choice(verbs)} {rng.choice(things)}; if step {rng.randint(1, 99)} "
             f"fails, say so and stop.")
        out.append(r)
        size += len(r) + 1
    return "\n".join(out)


def tool_result(kind: str, tokens: int, rng: random.Random) -> str:
    """A tool's output of about ``tokens`` tokens: source lines, grep hits or a test log."""
    lines, size, n = [], 0, 0
    while size < tokens * CHARS_PER_TOKEN:
        n += 1
        a, b = rng.randint(1, 999), rng.randint(1, 99)
        if kind == "grep":
            s = f"src/mod_{b}.py:{a}:    value = parse_item(tokens[{b}], depth={a % 7})"
        elif kind == "run_tests":
            s = f"tests/test_mod_{b}.py::test_case_{a} {'PASSED' if a % 5 else 'FAILED'}"
        else:
            s = f"    def step_{n}(self, x_{a}):  # {b}\n        return x_{a} * {b} + {a}"
        lines.append(s)
        size += len(s) + 1
    return "\n".join(lines)


def trace(turns: int, system_tokens: int, tool_min: int, tool_max: int, seed: int = 7):
    """The scripted conversation: (system, [turn 1's messages, turn 2's, ...]); each turn's
    messages are the whole history to send."""
    rng = random.Random(seed)
    history = [{"role": "user", "content": TASK}]
    out = [list(history)]
    for t in range(2, turns + 1):
        tool = TOOLS[(t - 2) % len(TOOLS)]
        arg = {"read_file": {"path": f"src/mod_{t}.py"}, "grep": {"pattern": f"parse_item.*{t}"},
               "run_tests": {"target": "tests/test_parser.py"}, "list_dir": {"path": "src"},
               "edit_file": {"path": f"src/mod_{t}.py", "old": "depth=0", "new": "depth=1"}}
        call = f"toolu_{t:02d}{'0' * 20}"
        history = history + [
            {"role": "assistant", "content": [
                {"type": "text", "text": f"Next I will use {tool['name']}."},
                {"type": "tool_use", "id": call, "name": tool["name"],
                 "input": arg[tool["name"]]}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call,
                 "content": tool_result(tool["name"], rng.randint(tool_min, tool_max), rng)}]}]
        out.append(list(history))
    return system_prompt(system_tokens), out


def stream_message(port: int, body: dict) -> dict:
    """One streamed ``/v1/messages``: TTFT, output tokens/s, prompt tokens, the reply."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=7200)
    t0 = time.perf_counter()
    c.request("POST", "/v1/messages", json.dumps({**body, "stream": True}),
              {"Content-Type": "application/json", "anthropic-version": "2023-06-01"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:400]!r}")
    first, end, reply, n_out, n_in, n_cached, deltas = None, None, [], 0, 0, 0, 0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: {"):
            continue
        ev = json.loads(line[6:])
        kind = ev.get("type")
        if kind == "message_start":
            u = ev["message"].get("usage") or {}
            n_in = sum(int(u.get(k) or 0) for k in (
                "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
            n_cached = int(u.get("cache_read_input_tokens") or 0)
        elif kind == "content_block_start":
            b = ev["content_block"]
            reply.append(b.get("name", "") if b.get("type") == "tool_use" else "")
        elif kind == "content_block_delta":
            first = first or time.perf_counter()
            deltas += 1
            d = ev["delta"]
            reply.append(d.get("text") or d.get("partial_json") or d.get("thinking") or "")
        elif kind == "message_delta":
            n_out = int((ev.get("usage") or {}).get("output_tokens") or n_out)
        elif kind == "message_stop":
            end = time.perf_counter()
    c.close()
    end = end or time.perf_counter()
    first = first or end
    return {"ttft_ms": 1e3 * (first - t0), "prompt_tokens": n_in, "cached_tokens": n_cached,
            "output_tokens": n_out,
            # a rate only where the reply streamed (more than one delta)
            "output_tps": (n_out - 1) / (end - first) if n_out > 1 and deltas > 1 else None,
            "reply": "".join(reply)}


def main(argv=None) -> int:
    ap = cli.parser(__doc__, stages=3, json=True)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--system-tokens", type=int, default=12000)
    ap.add_argument("--tool-min", type=int, default=200)
    ap.add_argument("--tool-max", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=32, help="max_tokens of each reply")
    ap.add_argument("--ctx", type=int, default=0,
                    help="context tokens of every server (0: the model's trained context, or "
                         "the trace's need rounded up to 4096 where that is more)")
    ap.add_argument("--ubatch", type=int, default=64)
    ap.add_argument("--model", help="GGUF (default: the registry's default model)")
    ap.add_argument("--no-uncached", action="store_true", help="leave out the uncached front")
    ap.add_argument("--tool-choice", choices=("none", "auto"), default="none",
                    help="each request's tool_choice (default none: docstring)")
    args = ap.parse_args(argv)
    if args.turns < 2 or not 0 < args.tool_min <= args.tool_max:
        ap.error("--turns must be 2 or more, and 0 < --tool-min <= --tool-max")
    from dgr.artifacts import models
    from dgr.artifacts.gguf import read_header
    from dgr.vendor import cpu_features

    model = args.model or str(models.path(models.DEFAULT_MODEL))
    kv = read_header(model).kv
    trained = int(kv[f"{kv['general.architecture']}.context_length"])
    system, turns = trace(args.turns, args.system_tokens, args.tool_min, args.tool_max)
    chars = len(system) + len(json.dumps(turns[-1])) + len(json.dumps(TOOLS))
    need = int(chars / CHARS_PER_TOKEN * 1.25) + args.tokens * args.turns
    ctx = args.ctx or (trained if need <= trained else -(-need // 4096) * 4096)
    name = "bench"
    common = ["--stages", str(args.stages), "--model-name", name, "--ctx", str(ctx),
              "--slots", "1", "--threads", "1", "--ubatch", str(args.ubatch),
              "--flash-attn", "on"]
    fronts = {"dgr": ["--prompt-cache", "1", "--prompt-cache-ttl", "3600"]}
    if not args.no_uncached:
        fronts["dgr uncached"] = ["--prompt-cache", "0", "--no-prefix-store"]
    ports = {k: free_port() for k in (*fronts, "llama-server t1", "llama-server t2")}
    cmds = {k: [sys.executable, "-m", "dgr", "serve", "--model", model, "--port",
                str(ports[k]), *common, *flags] for k, flags in fronts.items()}
    for t in (1, 2):
        k = f"llama-server t{t}"
        cmds[k] = [llama_server(), "-m", model, "--host", "127.0.0.1", "--port", str(ports[k]),
                   "-t", str(t), "-tb", str(t), "-c", str(ctx), "-np", "1", "-b",
                   str(args.ubatch), "-ub", str(args.ubatch), "-fa", "on", "--jinja",
                   "--alias", name, "--no-webui"]
    rec = {"cpu": cpu_features()[0], "cores": os.cpu_count(), "model": os.path.basename(model),
           "n_ctx": ctx, "n_ctx_train": trained, "args": vars(args), "commands": cmds,
           "rows": []}
    log = open(os.devnull, "w")
    procs = {}
    try:
        for k in cmds:
            procs[k] = subprocess.Popen(cmds[k], stdout=log, stderr=log)
        for k, p in procs.items():
            _wait_healthy(ports[k], p, k, timeout=600)
        for i, messages in enumerate(turns, 1):
            body = {"model": name, "max_tokens": args.tokens, "temperature": 0,
                    "system": system, "tools": TOOLS, "messages": messages,
                    "tool_choice": {"type": args.tool_choice}}
            row = {"turn": i}
            for k in cmds:  # one at a time: each has the machine to itself while it works
                row[k] = stream_message(ports[k], body)
            rec["rows"].append(row)
            print(f"turn {i}: " + "  ".join(
                f"{k} {row[k]['ttft_ms']:7.0f} ms ({row[k]['prompt_tokens']} tok)"
                for k in cmds), flush=True)
    finally:
        stop_servers(procs)
    rows = rec["rows"]
    later = rows[1:]
    summary = {"ttft_ms_median_turns_2_on": {
        k: _median([r[k]["ttft_ms"] for r in later]) for k in cmds},
        "output_tps_median": {k: _median([r[k]["output_tps"] for r in rows
                                          if r[k]["output_tps"] is not None]) for k in cmds}}
    for t in (1, 2):
        k = f"llama-server t{t}"
        summary[f"dgr_ttft_over_{k.replace(' ', '_').replace('-', '_')}_median"] = _median(
            [r["dgr"]["ttft_ms"] / r[k]["ttft_ms"] for r in later])
        summary[f"dgr_ttft_over_{k.replace(' ', '_').replace('-', '_')}_max"] = max(
            r["dgr"]["ttft_ms"] / r[k]["ttft_ms"] for r in later)
    if "dgr uncached" in cmds:
        summary["replies_equal_uncached"] = all(
            r["dgr"]["reply"] == r["dgr uncached"]["reply"] for r in rows)
    rec["summary"] = summary
    keys = list(cmds)
    print("\n| turn | prompt tokens | " + " | ".join(f"{k} TTFT ms" for k in keys)
          + " | dgr / llama-server t1 | dgr / llama-server t2 |")
    print("|---:|---:|" + "---:|" * (len(keys) + 2))
    for r in rows:
        print(f"| {r['turn']} | {r['dgr']['prompt_tokens']} | "
              + " | ".join(f"{r[k]['ttft_ms']:.0f}" for k in keys)
              + f" | {r['dgr']['ttft_ms'] / r['llama-server t1']['ttft_ms']:.2f}"
              f" | {r['dgr']['ttft_ms'] / r['llama-server t2']['ttft_ms']:.2f} |")
    print(json.dumps(summary, indent=1))
    cli.write_json(args.json, rec)
    return 0 if summary.get("replies_equal_uncached", True) else 1


if __name__ == "__main__":
    sys.exit(main())
