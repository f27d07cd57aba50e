"""In-process chains of range engines, and the reference generation loop."""

from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np

from dgr.errors import InvalidArgument, InvalidLayerRange
from dgr.protocol.grammar import Constraint, Vocabulary
from dgr.protocol.sampling import SamplingParams, sample_rows

__all__ = ["LocalChain", "generate_local", "vocabulary"]

#: llguidance vocabularies by model identity (``vocabulary``)
_VOCABS: dict[str, Vocabulary] = {}


def vocabulary(engine) -> Vocabulary:
    """The grammar engine's view of ``engine``'s vocabulary, built once per model."""
    key = getattr(engine, "identity", None) or str(id(engine))
    if key not in _VOCABS:
        if len(_VOCABS) >= 4:
            _VOCABS.pop(next(iter(_VOCABS)))
        _VOCABS[key] = Vocabulary(engine)
    return _VOCABS[key]


class LocalChain:
    """Range engines of one model in this process, run one after another.

    It has the same ``forward``/``release`` surface as a whole-model ``dgr.Engine``, so the
    generation loop and the parity tools treat both alike. Every stage gets the same engine
    settings (they decide numerics).
    """

    def __init__(self, model: str | os.PathLike, ranges: Sequence[tuple[int, int]], **settings):
        from dgr.core.engine import Engine

        if not ranges:
            raise InvalidArgument("a chain needs at least one stage")
        self.stages = [Engine(model, layers=r, **settings) for r in ranges]
        n_layer = self.stages[0].n_layer
        cover = [s.layers for s in self.stages]
        if cover[0][0] != 0 or cover[-1][1] != n_layer or any(
                a[1] != b[0] for a, b in zip(cover, cover[1:])):
            raise InvalidLayerRange(f"stages {cover} do not cover [0, {n_layer}) contiguously")
        self.first, self.last = self.stages[0], self.stages[-1]
        self.n_layer = n_layer
        self.n_vocab = self.last.n_vocab

    def tokenize(self, text, add_special=True, parse_special=False):
        return self.first.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens, remove_special=False, unparse_special=False):
        return self.first.detokenize(tokens, remove_special, unparse_special)

    def token_pieces(self, first=0, count=None, special=False):
        return self.first.token_pieces(first, count, special)

    def is_eog(self, token: int) -> bool:
        return self.first.is_eog(token)

    def release(self, slot: int) -> None:
        for s in self.stages:
            s.release(slot)

    def next_pos(self, slot: int) -> int:
        return self.last.next_pos(slot)

    def forward(self, slot, positions, tokens, *, logits="last", out=None):
        tok = np.ascontiguousarray(tokens, dtype=np.int32)
        x = None
        for st in self.stages:
            kw = {"logits": logits, "out": out} if st is self.last else {}
            tk = tok if (st.is_first or st.needs_token_ids) else None
            x = st.forward(slot, positions, tk, boundary=x, **kw)
        return x


def generate_local(engine, prompt: Sequence[int], *, max_tokens: int = 64,
                   sampling: SamplingParams | None = None, stop_on_eog: bool = True,
                   logits: bool = False, slot: int = 0, timing: dict | None = None
                   ) -> tuple[list[int], list[np.ndarray]]:
    """What a route computes, in one process: the reference for parity.

    Same chunking (the engine splits the prompt into ``n_ubatch`` chunks as the driver does),
    same rows (last row only) and the same position-keyed sampling as the last stage.
    Returns the tokens and, with ``logits=True``, the logits row that sampled each (an
    end-of-generation token that stopped it included, as ``AsyncRouteSession.logits``).
    ``timing``, when given, receives ``prefill_s``, ``decode_s``, ``decode_cpu_s`` (this
    process's CPU time over the same span, all threads) and ``decode_steps``.
    """
    prompt = np.ascontiguousarray(prompt, dtype=np.int32)
    engine.release(slot)
    t0 = time.perf_counter()
    row = engine.forward(slot, 0, prompt)
    t1, c1 = time.perf_counter(), time.process_time()
    pos = len(prompt)
    toks: list[int] = []
    rows: list[np.ndarray] = []
    steps = 0
    seq = [int(t) for t in prompt]  # the penalties' window: every token before the next
    grammar = None
    if sampling is not None and sampling.grammar:  # as the last stage masks (worker.grammar)
        grammar = Constraint(vocabulary(engine), sampling.grammar, len(prompt))
    for i in range(max_tokens):
        if grammar is not None:
            grammar.seek(len(seq), lambda a, b: seq[a:b])
            row = grammar.mask(row[-1])[None]
        t = sample_rows(row, [pos], sampling, [seq])[0]
        seq.append(t)
        if logits:
            rows.append(np.array(row[-1]))
        if stop_on_eog and engine.is_eog(t):
            break
        toks.append(t)
        if i + 1 == max_tokens:
            break
        row = engine.forward(slot, pos, np.array([t], dtype=np.int32))
        pos += 1
        steps += 1
    t2, c2 = time.perf_counter(), time.process_time()
    engine.release(slot)
    if timing is not None:
        timing.update(prefill_s=t1 - t0, decode_s=t2 - t1, decode_cpu_s=c2 - c1,
                      decode_steps=steps)
    return toks, rows
