"""In-process chains of range engines, layer splits, and the generation loop they share."""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import numpy as np

from .errors import InvalidArgument, InvalidLayerRange
from .sampling import Sampler, SamplingParams

__all__ = ["split_layers", "parse_splits", "LocalChain", "generate"]


def split_layers(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges covering ``[0, n_layer)``, as even as possible (earlier stages larger)."""
    if not 1 <= n_stages <= n_layer:
        raise InvalidLayerRange(f"cannot split {n_layer} layers into {n_stages} stages")
    base, extra = divmod(n_layer, n_stages)
    out, a = [], 0
    for i in range(n_stages):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


def parse_splits(points: Sequence[int], n_layer: int) -> list[tuple[int, int]]:
    """Ranges from interior split points, e.g. ``[10, 20]`` of 30 layers -> 3 stages."""
    pts = [0, *sorted(int(p) for p in points), n_layer]
    if any(b <= a for a, b in zip(pts, pts[1:])) or pts[1] <= 0 or pts[-2] >= n_layer:
        raise InvalidLayerRange(f"split points {list(points)} must be distinct and inside "
                                f"(0, {n_layer})")
    return list(zip(pts, pts[1:]))


class LocalChain:
    """Range engines of one model in this process, run one after another.

    It has the same ``forward``/``release`` surface as a whole-model ``dgr.Engine``, so the
    generation loop and the parity tools treat both alike. Every stage gets the same engine
    settings (they decide numerics).
    """

    def __init__(self, model: str | os.PathLike, ranges: Sequence[tuple[int, int]], **settings):
        from .engine import Engine

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
        #: the boundary each seam carried in the last forward (for inspection and benchmarks)
        self.last_boundaries: list[np.ndarray] = []

    def tokenize(self, text, add_special=True, parse_special=False):
        return self.first.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens, remove_special=False, unparse_special=False):
        return self.first.detokenize(tokens, remove_special, unparse_special)

    def is_eog(self, token: int) -> bool:
        return self.first.is_eog(token)

    def release(self, slot: int) -> None:
        for s in self.stages:
            s.release(slot)

    def next_pos(self, slot: int) -> int:
        return self.last.next_pos(slot)

    def forward(self, slot, positions, tokens, *, logits="last", out=None):
        tok = np.ascontiguousarray(tokens, dtype=np.int32)
        x = self.first.forward(slot, positions, tok)
        seams = [x]
        for st in self.stages[1:]:
            kw = {"logits": logits, "out": out} if st is self.last else {}
            x = st.forward(slot, positions, tok if st.needs_token_ids else None, boundary=x, **kw)
            if st is not self.last:
                seams.append(x)
        self.last_boundaries = seams if len(self.stages) > 1 else []
        return x


def generate(model, prompt_tokens: Sequence[int], *, max_tokens: int = 64,
             sampling: SamplingParams | None = None, slot: int = 0,
             stop_on_eog: bool = True) -> Iterator[int]:
    """Prefill ``prompt_tokens`` then yield sampled tokens one by one.

    ``model`` is anything with ``forward``/``release``/``is_eog`` (an Engine, a LocalChain or a
    route session). Stops after ``max_tokens`` or at an end-of-generation token (not yielded).
    """
    sampler = Sampler(sampling)
    prompt = np.ascontiguousarray(prompt_tokens, dtype=np.int32)
    if len(prompt) == 0:
        raise InvalidArgument("the prompt has no tokens")
    model.release(slot)
    logits = model.forward(slot, 0, prompt)
    pos = len(prompt)
    buf = np.empty(1, dtype=np.int32)
    for i in range(max_tokens):
        t = sampler(logits[-1])
        if stop_on_eog and model.is_eog(t):
            return
        yield t
        if i + 1 == max_tokens:
            return
        buf[0] = t
        logits = model.forward(slot, pos, buf)
        pos += 1
