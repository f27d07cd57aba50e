"""Token sampling from a logits row: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dgr.errors import InvalidArgument

__all__ = ["SamplingParams", "Sampler", "sample_rows"]


@dataclass(frozen=True)
class SamplingParams:
    """How the last stage picks the next token.

    ``temperature == 0`` is greedy (argmax, lowest id on ties); otherwise the logits are
    divided by the temperature, cut to the ``top_k`` best (0: all) and to the smallest set
    whose probability reaches ``top_p`` (1.0: all), and sampled with a generator seeded by
    ``seed`` (so a seeded generation is reproducible).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Stateful sampler for one generation (its random stream advances per token)."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self._rng = np.random.default_rng(self.params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        row = np.asarray(logits, dtype=np.float32).reshape(-1)
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

    Greedy (``sampling`` None, ``greedy`` or temperature 0) is the argmax. Otherwise each row
    is drawn with ``Sampler`` seeded by ``(seed, position)``: a token depends on
    its position, not on how many draws came before, so a re-prefill after a failover, or a
    reference computed elsewhere, draws the same tokens.
    """
    if sampling is None or getattr(sampling, "greedy", False) or sampling.temperature == 0:
        return [int(np.argmax(r)) for r in logits]
    out = []
    for row, pos in zip(logits, positions):
        p = SamplingParams(temperature=float(sampling.temperature), top_k=int(sampling.top_k),
                           top_p=float(sampling.top_p), seed=_mix(int(sampling.seed), int(pos)))
        out.append(Sampler(p)(row))
    return out
