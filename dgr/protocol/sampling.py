"""Token sampling from a logits row: logit bias, greedy, temperature, top-k, top-p, min-p,
seeded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dgr.errors import InvalidArgument

__all__ = ["SamplingParams", "Sampler", "sample_rows", "biased"]


@dataclass(frozen=True)
class SamplingParams:
    """How the last stage picks the next token.

    ``logit_bias`` (token id -> a value added to its logit, ``-inf`` bans it) applies first,
    as llama.cpp's logit-bias sampler heads its chain. ``temperature == 0`` is then greedy
    (argmax, lowest id on ties); otherwise the logits are cut to the ``top_k`` best (0: all),
    divided by the temperature, cut to the smallest set whose probability reaches ``top_p``
    (1.0: all) and to the tokens whose probability is at least ``min_p`` times the best one's
    (0: all; llama.cpp's min-p, on the logits before the temperature), and sampled with a
    generator seeded by ``seed`` (so a seeded generation is reproducible).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p}")
        if any(t < 0 or b != b for t, b in self.logit_bias):
            raise InvalidArgument("logit_bias takes token ids >= 0 and numbers")
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def biased(row: np.ndarray, ids: Sequence[int], bias: Sequence[float]) -> np.ndarray:
    """``row`` (float32) with ``bias[i]`` added to the logit of ``ids[i]`` (a copy; ``row``
    itself when there is no bias). Ids outside the row are refused."""
    if not len(ids):
        return row
    out = np.array(row, dtype=np.float32, copy=True)
    idx = np.asarray(ids, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= out.shape[-1]):
        raise InvalidArgument(f"logit_bias names a token id outside the vocabulary "
                              f"[0, {out.shape[-1]})")
    np.add.at(out, idx, np.asarray(bias, dtype=np.float32))
    return out


class Sampler:
    """Stateful sampler for one generation (its random stream advances per token)."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self._rng = np.random.default_rng(self.params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        row = np.asarray(logits, dtype=np.float32).reshape(-1)
        if p.logit_bias:
            row = biased(row, [t for t, _ in p.logit_bias], [b for _, b in p.logit_bias])
        if p.greedy:
            return int(np.argmax(row))
        n = row.shape[0]
        if 0 < p.top_k < n:
            idx = np.argpartition(-row, p.top_k - 1)[: p.top_k]
        else:
            idx = np.arange(n)
        z = row[idx].astype(np.float64) / p.temperature
        order = np.argsort(-z, kind="stable")
        idx, z = idx[order], z[order]
        probs = np.exp(z - z[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            idx, probs = idx[:keep], probs[:keep] / probs[:keep].sum()
        if p.min_p > 0.0:
            # llama.cpp: keep logit >= max logit + log(min_p), before the temperature
            raw = row[idx].astype(np.float64)
            keep_mask = raw >= raw[0] + np.log(p.min_p)
            keep_mask[0] = True
            idx, probs = idx[keep_mask], probs[keep_mask] / probs[keep_mask].sum()
        return int(idx[self._rng.choice(len(idx), p=probs)])


_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _mix(seed: int, pos: int) -> int:
    """splitmix64 of (seed, position): an independent, reproducible stream per position."""
    z = (seed + _GOLDEN * (pos + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample_rows(logits: np.ndarray, positions: Sequence[int], sampling) -> list[int]:
    """Sample one token per logits row; ``positions[i]`` is the position the token will take.

    ``sampling``: a ``SamplingParams`` or a ``wire.Sampling``; its logit bias applies first.
    Greedy (``sampling`` None, ``greedy`` or temperature 0) is the argmax. Otherwise each row
    is drawn with ``Sampler`` seeded by ``(seed, position)``: a token depends on
    its position, not on how many draws came before, so a re-prefill after a failover, or a
    reference computed elsewhere, draws the same tokens.
    """
    if isinstance(sampling, SamplingParams):
        ids = tuple(t for t, _ in sampling.logit_bias)
        bias = tuple(b for _, b in sampling.logit_bias)
    else:  # a wire.Sampling
        ids, bias = tuple(getattr(sampling, "bias_ids", ())), tuple(getattr(sampling, "bias", ()))
    if ids:
        logits = [biased(np.asarray(r, dtype=np.float32), ids, bias) for r in logits]
    if sampling is None or getattr(sampling, "greedy", False) or sampling.temperature == 0:
        return [int(np.argmax(r)) for r in logits]
    out = []
    for row, pos in zip(logits, positions):
        p = SamplingParams(temperature=float(sampling.temperature), top_k=int(sampling.top_k),
                           top_p=float(sampling.top_p), seed=_mix(int(sampling.seed), int(pos)),
                           min_p=float(getattr(sampling, "min_p", 0.0)))
        out.append(Sampler(p)(row))
    return out
