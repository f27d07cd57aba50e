"""What a grammar costs per sampled token: llguidance's mask (dgr's engine) against llama.cpp's
own grammar sampler, on a 49k and a 262k vocabulary, side by side in one run.

    python benches/grammar_mask.py [--tokens 64] [--json out.json]

- **llguidance** (``dgr.protocol.grammar``): the time of one ``Constraint.mask`` (computing the
  token bitmask and applying it to a logits row) per token of a JSON document that follows
  the schema below, consumed token by token; the median and the 95th percentile. Also the
  vocabulary's one-time build (``Vocabulary``).
- **llama.cpp's grammar sampler** (the pinned tree's ``llama-completion``, built on demand):
  ``--json-schema`` (converted to GBNF by ``common/json-schema-to-grammar``) against the same
  run without it, greedy, ``--tokens`` tokens; the difference of its ``sampling time`` per
  token is the grammar's cost.

Models: SmolLM2-135M (49,152 tokens) and Gemma 3 270M (262,144 tokens), from the registry.
Results go to ``benches/results/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import re
import statistics
import subprocess
import sys
import time

from harness import cli

import numpy as np


SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object",
                                     "properties": {"city": {"type": "string"},
                                                    "zip": {"type": "string"}},
                                     "required": ["city"]}},
          "required": ["name", "age", "tags", "address"]}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["mathematics", "engines", "poetry"],
       "address": {"city": "London", "zip": "W1"}}
MODELS = ["smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m"]


def log(msg: str) -> None:
    print(f"[grammar_mask] {msg}", file=sys.stderr, flush=True)


def llguidance_cost(path: str) -> dict:
    import dgr
    from dgr.protocol.grammar import Constraint, Vocabulary, compile_grammar

    e = dgr.Engine(path, n_ctx=64, n_threads=1)
    t0 = time.perf_counter()
    vocab = Vocabulary(e)
    vocab.tokenizer  # noqa: B018 - built here, timed
    build_s = time.perf_counter() - t0
    grammar = compile_grammar("json_schema", SCHEMA)
    c = Constraint(vocab, grammar, 0)
    ids = [int(t) for t in e.tokenize(json.dumps(DOC), False, False)]
    row = np.random.default_rng(0).standard_normal(e.n_vocab).astype(np.float32)
    ts = []
    for i, t in enumerate(ids):
        assert c.seek(i, lambda a, b: ids[a:b])
        t1 = time.perf_counter()
        masked = c.mask(row)
        ts.append(time.perf_counter() - t1)
        assert np.isfinite(masked[t]), f"the document's token {t} is masked"
    return {"n_vocab": int(e.n_vocab), "vocab_build_s": build_s, "tokens": len(ids),
            "mask_ms_p50": 1e3 * statistics.median(ts),
            "mask_ms_p95": 1e3 * float(np.percentile(ts, 95))}


def llama_cpp_cost(path: str, tokens: int) -> dict:
    from dgr.vendor import Vendor

    v = Vendor()
    v.build(tools=["llama-completion"])
    exe = str(v.tool_path("llama-completion"))

    def run(extra: list[str]) -> float:
        cmd = [exe, "-m", path, "-p", "Describe a person as JSON:", "-n", str(tokens),
               "--temp", "0", "-no-cnv", "--no-display-prompt", "-t", "1", "-c", "512",
               "--ignore-eos", "--simple-io", "-ngl", "0", "--perf", *extra]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                           stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            raise RuntimeError(p.stderr[-2000:])
        m = re.search(r"sampling time =\s*([\d.]+) ms", p.stderr)
        n = re.search(r"samplers time =\s*[\d.]+ ms /\s*(\d+) tokens", p.stderr)
        if not m or not n:
            raise RuntimeError("no sampling time in llama-completion's output")
        return float(m.group(1)) / int(n.group(1))

    plain = run([])
    constrained = run(["--json-schema", json.dumps(SCHEMA)])
    return {"sampling_ms_per_token_plain": plain,
            "sampling_ms_per_token_grammar": constrained,
            "grammar_ms_per_token": constrained - plain}


def main() -> None:
    ap = cli.parser(__doc__, json=True, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64,
                    help="tokens llama-completion generates per run (default 64)")
    a = ap.parse_args()
    from dgr.artifacts import models

    rows = []
    for name in MODELS:
        path = str(models.path(name))
        log(f"{name}: llguidance ...")
        row = {"model": name, **llguidance_cost(path)}
        log(f"{name}: llama.cpp's grammar sampler ...")
        row.update(llama_cpp_cost(path, a.tokens))
        rows.append(row)
    print("| model | vocabulary | llguidance mask ms/token p50 | p95 | vocabulary build s | "
          "llama.cpp grammar ms/token | llama.cpp sampling ms/token plain | with grammar |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['n_vocab']} | {r['mask_ms_p50']:.3f} | "
              f"{r['mask_ms_p95']:.3f} | {r['vocab_build_s']:.2f} | "
              f"{r['grammar_ms_per_token']:.3f} | {r['sampling_ms_per_token_plain']:.3f} | "
              f"{r['sampling_ms_per_token_grammar']:.3f} |")
    out = {"date": datetime.date.today().isoformat(), "schema": SCHEMA, "rows": rows}
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
