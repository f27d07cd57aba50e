"""Split-vs-whole parity: run a prompt and greedy decode steps through the whole model and a
chain of range engines, and compare logits step by step.

Library: :func:`compare`. Script: ``python -m dgr parity --model M --splits 10,20``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from dgr.core.local import LocalChain
from dgr.protocol import settings as engine_settings
from dgr.protocol.ranges import ranges_for

__all__ = ["StepResult", "ParityReport", "compare", "main"]


@dataclass
class StepResult:
    step: int            # 0: the prompt's last row; k: the k-th decode step
    position: int
    max_abs_diff: float
    top1_whole: int
    top1_split: int
    bit_identical: bool


@dataclass
class ParityReport:
    model: str
    ranges: list[tuple[int, int]]
    settings: dict
    prompt_tokens: int
    decode_steps: int
    steps: list[StepResult] = field(default_factory=list)
    prompt_rows_identical: bool = True
    seconds: float = 0.0

    @property
    def bit_identical(self) -> bool:
        return self.prompt_rows_identical and all(s.bit_identical for s in self.steps)

    @property
    def top1_agreement(self) -> float:
        return float(np.mean([s.top1_whole == s.top1_split for s in self.steps])) if self.steps else 1.0

    @property
    def max_abs_diff(self) -> float:
        return max((s.max_abs_diff for s in self.steps), default=0.0)

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(bit_identical=self.bit_identical, top1_agreement=self.top1_agreement,
                 max_abs_diff=self.max_abs_diff)
        return d


def compare(model: str | os.PathLike, ranges: Sequence[tuple[int, int]], prompt_tokens: Sequence[int],
            decode_steps: int = 16, *, slot: int = 0, whole=None, chain=None,
            **settings) -> ParityReport:
    """Whole model vs a chain of ``ranges``, same settings, greedy decode driven by the whole model.

    Both sides are fed the same tokens (the whole model's greedy choice) so a divergence shows
    as a logits difference at that step instead of derailing the rest. Every prompt row's
    logits are compared too. ``whole``/``chain`` may be passed in to reuse loaded engines.
    """
    from dgr.core.engine import Engine

    t0 = time.perf_counter()
    whole = whole or Engine(model, **settings)
    chain = chain or LocalChain(model, ranges, **settings)
    prompt = np.ascontiguousarray(prompt_tokens, dtype=np.int32)
    rep = ParityReport(model=os.fspath(model), ranges=[tuple(r) for r in ranges],
                       settings=dict(settings), prompt_tokens=len(prompt), decode_steps=decode_steps)
    whole.release(slot)
    chain.release(slot)
    lw = whole.forward(slot, 0, prompt, logits="all")
    ls = chain.forward(slot, 0, prompt, logits="all")
    rep.prompt_rows_identical = lw.tobytes() == ls.tobytes()
    pos = len(prompt)
    for step in range(decode_steps + 1):
        a, b = lw[-1], ls[-1]
        rep.steps.append(StepResult(
            step=step, position=pos - 1,
            max_abs_diff=float(np.max(np.abs(a.astype(np.float64) - b))),
            top1_whole=int(np.argmax(a)), top1_split=int(np.argmax(b)),
            bit_identical=a.tobytes() == b.tobytes()))
        if step == decode_steps:
            break
        t = np.array([np.argmax(a)], dtype=np.int32)
        lw = whole.forward(slot, pos, t)
        ls = chain.forward(slot, pos, t)
        pos += 1
    rep.seconds = time.perf_counter() - t0
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dgr parity",
        description="Compare a split model with the whole model: per step max |diff| of logits, "
                    "top-1 agreement and bit identity. Every stage and the reference use the "
                    "same engine settings.")
    ap.add_argument("--model", help="GGUF path (default: the registry's default model)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--splits", help="interior split points, e.g. 10,20 (3 stages of 30 layers)")
    g.add_argument("--stages", type=int, default=3, help="even split into N stages (default 3)")
    ap.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. " * 8)
    ap.add_argument("--steps", type=int, default=16, help="greedy decode steps (default 16)")
    engine_settings.add_arguments(ap)
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)

    from dgr import errors
    from dgr.artifacts.models import path as model_path
    from dgr.core.engine import Engine

    try:
        model = args.model or str(model_path())
        settings = engine_settings.from_args(args)
        whole = Engine(model, **settings)
        ranges = ranges_for(args.splits, args.stages, whole.n_layer)
        prompt = whole.tokenize(args.prompt)
        rep = compare(model, ranges, prompt, args.steps, whole=whole, **settings)
    except errors.DgrError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"model   {rep.model}\nstages  {rep.ranges}\nprompt  {rep.prompt_tokens} tokens, "
          f"{rep.decode_steps} greedy steps, settings {rep.settings}")
    print(f"{'step':>4} {'pos':>5} {'max|diff|':>10} {'top1':>7} {'bits':>5}")
    for s in rep.steps:
        print(f"{s.step:>4} {s.position:>5} {s.max_abs_diff:>10.3g} "
              f"{'same' if s.top1_whole == s.top1_split else 'DIFF':>7} "
              f"{'=' if s.bit_identical else 'x':>5}")
    print(f"prompt rows identical: {rep.prompt_rows_identical}; top-1 agreement "
          f"{rep.top1_agreement:.3f}; bit-identical: {rep.bit_identical} ({rep.seconds:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep.to_json(), f, indent=2)
    return 0 if rep.bit_identical else 1


if __name__ == "__main__":
    sys.exit(main())
