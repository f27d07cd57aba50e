"""Whether a session's rows computed in a batch are bit-identical to the same session alone.

    python benches/batch_exactness.py [--ks 2,4,16] [--threads 1,2] [--steps 8] [--no-tiny]
                                      [--cases short,p64,long]

For each model (SmolLM2, the registry's default quant; the tiny random llama of
``dgr.testing`` in f32, f16, q8_0 and q4_0), each thread count and two stages (the whole
model and a middle split stage), k sessions (slots 0..k-1 of one engine with 16 slots) are
computed two ways on the same engine, with the same inputs:

- solo: each session alone, its prompt in one ``forward`` then one ``forward`` per decode
  token, the slots one after another;
- batched: the k prompts in one ``forward_batch`` (phase ``prefill``; case ``long``: alone,
  as solo), then one ``forward_batch`` of k tokens per decode step (phase ``decode``).

Cases (:data:`CASES`) pick the prompt lengths that steer ggml's flash-attention kernels.

Inputs are teacher-forced (seeded token ids; the middle stage gets the boundary rows a
``[0, a)`` engine computes for them), so both ways see identical inputs. Reported per
phase: the max |batched - solo| over every output row (logits on the whole model, boundary
rows on the middle stage), whether all rows are bit-identical, and on logits the fraction
of rows whose top-1 token agrees. A table is printed and JSON written to
``benches/results/batch-exactness-<date>.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import tempfile

import numpy as np

from harness import cli

N_SLOTS = 16
N_CTX = 512
N_UBATCH = 64


# (case, prompt length of session j, prompts batched too): "short" prompts of 5..11 tokens
# (every ubatch piece of a slot under 64 rows: the tiled flash attention's threshold until
# patch 0026), "p64" prompts of 64..70 (alone: a first ubatch of 64 rows of one slot;
# batched: the equal split's smaller pieces), "long" prompts of 300..306 computed alone both ways, then decode at a KV of 512
# cells (ggml's split-KV flash attention takes a lone sequence's decode row there)
CASES = (("short", lambda j: 5 + j % 7, True), ("p64", lambda j: 64 + j % 7, True),
         ("long", lambda j: 300 + j % 7, False))


def _sessions(k: int, n_vocab: int, steps: int, plen, seed: int = 1234) -> list[np.ndarray]:
    """k teacher-forced token sequences: a prompt of plen(j) tokens then ``steps`` decode ids."""
    rng = np.random.default_rng(seed)
    lo = 100 if n_vocab > 1000 else 0
    return [rng.integers(lo, n_vocab, size=plen(j) + steps, dtype=np.int32) for j in range(k)]


def _inputs(model: str, a: int, seqs: list[np.ndarray]) -> list[np.ndarray] | None:
    """Boundary rows entering layer ``a`` for each sequence (None for a = 0)."""
    import dgr

    if a == 0:
        return None
    first = dgr.Engine(model, (0, a), n_ctx=N_CTX, n_slots=1, n_threads=1, n_ubatch=N_UBATCH)
    rows = []
    for s in seqs:
        first.release(0)
        rows.append(first.forward(0, 0, s).copy())
    return rows


def _run(eng, seqs, bnds, steps: int, batched: bool, batch_prefill: bool = True
         ) -> tuple[list, list]:
    """Per session: its prefill output row(s) and its decode output rows, one way (with
    ``batch_prefill`` False the prompts are computed alone either way)."""
    k = len(seqs)
    n_prompt = [len(s) - steps for s in seqs]
    for j in range(k):
        eng.release(j)
    prefill: list = [None] * k
    decode: list = [[] for _ in range(k)]

    def rows_of(j, lo, hi):
        if bnds is None:
            return seqs[j][lo:hi], None
        return (seqs[j][lo:hi] if eng.needs_token_ids else None), bnds[j][lo:hi]

    if not batched or not batch_prefill:
        for j in range(k):
            t, b = rows_of(j, 0, n_prompt[j])
            prefill[j] = eng.forward(j, 0, t, b).copy()
    if not batched:
        for j in range(k):
            for i in range(steps):
                p = n_prompt[j] + i
                t, b = rows_of(j, p, p + 1)
                decode[j].append(eng.forward(j, p, t, b)[0].copy())
        return prefill, decode
    if batch_prefill:
        slots = np.concatenate([np.full(n, j, np.int32) for j, n in enumerate(n_prompt)])
        pos = np.concatenate([np.arange(n, dtype=np.int32) for n in n_prompt])
        parts = [rows_of(j, 0, n_prompt[j]) for j in range(k)]
        tok = None if parts[0][0] is None else np.concatenate([p[0] for p in parts])
        bnd = None if parts[0][1] is None else np.concatenate([p[1] for p in parts])
        out = eng.forward_batch(slots, pos, tok, bnd)
        if eng.is_last:
            prefill = [out[j:j + 1].copy() for j in range(k)]
        else:
            offs = np.cumsum([0, *n_prompt])
            prefill = [out[offs[j]:offs[j + 1]].copy() for j in range(k)]
    slots = np.arange(k, dtype=np.int32)
    for i in range(steps):
        pos = np.array([n_prompt[j] + i for j in range(k)], np.int32)
        parts = [rows_of(j, pos[j], pos[j] + 1) for j in range(k)]
        tok = None if parts[0][0] is None else np.concatenate([p[0] for p in parts])
        bnd = None if parts[0][1] is None else np.concatenate([p[1] for p in parts])
        out = eng.forward_batch(slots, pos, tok, bnd)
        for j in range(k):
            decode[j].append(out[j].copy())
    return prefill, decode


def _compare(solo: list[np.ndarray], batch: list[np.ndarray], logits: bool) -> dict:
    s = np.concatenate([np.atleast_2d(x) for x in solo])
    b = np.concatenate([np.atleast_2d(x) for x in batch])
    d = float(np.max(np.abs(s - b)))
    return {"rows": len(s), "max_abs_diff": d, "bit_identical": bool(np.array_equal(s, b)),
            "top1_agree": (float(np.mean(s.argmax(1) == b.argmax(1))) if logits else None)}


def _cpu() -> dict:
    """The CPU's model name and the SIMD flags that pick ggml's kernels."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "sse4", "asimd", "sve")))
    return {"model_name": name, "simd": simd}


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--ks", default="2,4,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per session")
    ap.add_argument("--no-tiny", action="store_true", help="SmolLM2 only")
    ap.add_argument("--cases", default="short,p64,long", help="of: short, p64, long")
    ap.add_argument("--out", default=None, help="JSON path (default benches/results/...)")
    args = ap.parse_args(argv)
    ks = [int(x) for x in args.ks.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    assert max(ks) <= N_SLOTS

    from harness.common import smollm2_path

    import dgr
    from dgr.testing.fixtures import TinyLlama, write_tiny_llama

    tmp = tempfile.TemporaryDirectory(prefix="dgr-batch-exact-")
    models = [("smollm2", smollm2_path())]
    if not args.no_tiny:
        for wt in ("f32", "f16", "q8_0", "q4_0"):
            models.append((f"tiny-{wt}", str(write_tiny_llama(
                os.path.join(tmp.name, f"tiny-{wt}.gguf"), TinyLlama(weight_type=wt)))))
    results = []
    print(f"{'model':<12} {'quant':<6} {'thr':>3} {'stage':<9} {'case':<5} {'k':>3} "
          f"{'phase':<8} {'rows':>5} {'max|diff|':>10} {'bit-id':>6} {'top1':>6}")
    for name, path in models:
        probe = dgr.Engine(path, n_ctx=16, n_slots=1)
        n_layer, n_vocab = probe.n_layer, probe.n_vocab
        quant = probe.describe()["desc"].split()[-1]
        del probe
        third = max(1, n_layer // 3)
        cases = [(c, _sessions(max(ks), n_vocab, args.steps, plen), bp)
                 for c, plen, bp in CASES if c in args.cases.split(",")]
        for stage in ((0, n_layer), (third, n_layer - third)):
            inputs = {c: _inputs(path, stage[0], seqs) for c, seqs, _ in cases}
            for nt in threads:
                eng = dgr.Engine(path, None if stage == (0, n_layer) else stage, n_ctx=N_CTX,
                                 n_slots=N_SLOTS, n_threads=nt, n_ubatch=N_UBATCH)
                for case, seqs, batch_prefill in cases:
                    bnds = inputs[case]
                    for k in ks:
                        sb = None if bnds is None else bnds[:k]
                        sp, sd = _run(eng, seqs[:k], sb, args.steps, False)
                        bp, bd = _run(eng, seqs[:k], sb, args.steps, True, batch_prefill)
                        phases = [("decode", [np.stack(x) for x in sd], [np.stack(x) for x in bd])]
                        if batch_prefill:
                            phases.insert(0, ("prefill", sp, bp))
                        for phase, s_rows, b_rows in phases:
                            r = {"model": name, "quant": quant, "n_threads": nt,
                                 "stage": list(stage), "whole": stage == (0, n_layer),
                                 "case": case, "k": k, "phase": phase,
                                 **_compare(s_rows, b_rows, eng.is_last)}
                            results.append(r)
                            top1 = "-" if r["top1_agree"] is None else f"{r['top1_agree']:.3f}"
                            rng = f"{stage[0]}-{stage[1]}"
                            print(f"{name:<12} {quant:<6} {nt:>3} {rng:<9} {case:<5} {k:>3} "
                                  f"{phase:<8} {r['rows']:>5} {r['max_abs_diff']:>10.3g} "
                                  f"{r['bit_identical']!s:>6} {top1:>6}", flush=True)
                del eng
    tmp.cleanup()
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results",
        f"batch-exactness-{datetime.date.today().isoformat()}.json")
    from dgr._core import BUILD_INFO

    meta = {"build": BUILD_INFO, "machine": platform.machine(), "cpu": _cpu(),
            "cpu_count": os.cpu_count(),
            "settings": {"n_ctx": N_CTX, "n_slots": N_SLOTS, "n_ubatch": N_UBATCH,
                         "flash_attn": True, "type_k": "f16", "type_v": "f16"},
            "steps": args.steps}
    with open(out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"wrote {out}")
    print(f"all bit-identical: {all(r['bit_identical'] for r in results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
