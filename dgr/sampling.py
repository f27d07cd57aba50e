"""Token sampling from a logits row: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidArgument

__all__ = ["SamplingParams", "Sampler"]


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
