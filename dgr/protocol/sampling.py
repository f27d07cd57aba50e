"""Token sampling from a logits row: logit bias, repetition/frequency/presence penalties,
greedy, temperature, top-k, top-p, min-p, seeded (llama.cpp's chain and meanings)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from dgr.errors import InvalidArgument

__all__ = ["SamplingParams", "Sampler", "sample_rows", "adjusted", "params_of"]


@dataclass(frozen=True)
class SamplingParams:
    """How the last stage picks the next token, in llama.cpp's order.

    1. ``logit_bias`` (token id -> a value added to its logit, ``-inf`` bans it).
    2. The penalties over the last ``penalty_last_n`` tokens of the sequence (the prompt's
       included, as llama-server feeds its sampler the prompt): a token seen ``c`` times gets
       its logit divided by ``repeat_penalty`` (multiplied, when it is not positive), then
       ``c * frequency_penalty + presence_penalty`` subtracted (llama.cpp's penalties
       sampler; ``penalty_last_n`` 0 or the neutral values switch it off).
    3. ``temperature == 0`` is greedy (argmax, lowest id on ties); otherwise the logits are
       cut to the ``top_k`` best (0: all), divided by the temperature, cut to the smallest
       set whose probability reaches ``top_p`` (1.0: all) and to the tokens whose probability
       is at least ``min_p`` times the best one's (0: all; on the logits before the
       temperature, as llama.cpp's min-p), and drawn with a generator seeded by ``seed`` (so
       a seeded generation is reproducible).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    #: llguidance's grammar definition the sampled tokens follow (``dgr.protocol.grammar``;
    #: "": none)
    grammar: str = ""

    def __post_init__(self):
        if not (self.temperature >= 0.0 and np.isfinite(self.temperature)):
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"min_p must be in [0, 1], got {self.min_p}")
        if any(t < 0 or b != b for t, b in self.logit_bias):
            raise InvalidArgument("logit_bias takes token ids >= 0 and numbers")
        if not (self.repeat_penalty > 0.0 and np.isfinite(self.repeat_penalty)):
            raise InvalidArgument(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not np.isfinite(getattr(self, name)):
                raise InvalidArgument(f"{name} must be a finite number")
        if not 0 <= self.penalty_last_n <= 2**31 - 1:
            raise InvalidArgument(f"penalty_last_n must be >= 0, got {self.penalty_last_n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the penalties change anything (they need the sequence's tokens)."""
        return self.penalty_last_n > 0 and (self.repeat_penalty != 1.0 or
                                            self.frequency_penalty != 0.0 or
                                            self.presence_penalty != 0.0)


def params_of(sampling) -> SamplingParams | None:
    """``sampling`` (a ``SamplingParams``, a ``wire.Sampling`` or None) as ``SamplingParams``
    (None: plain greedy)."""
    if sampling is None or isinstance(sampling, SamplingParams):
        return sampling
    g = getattr
    return SamplingParams(
        temperature=0.0 if sampling.greedy else float(sampling.temperature),
        top_k=int(sampling.top_k), top_p=float(sampling.top_p), seed=int(sampling.seed),
        min_p=float(g(sampling, "min_p", 0.0)),
        logit_bias=tuple(zip(g(sampling, "bias_ids", ()), g(sampling, "bias", ()))),
        repeat_penalty=float(g(sampling, "repeat_penalty", 1.0)),
        frequency_penalty=float(g(sampling, "frequency_penalty", 0.0)),
        presence_penalty=float(g(sampling, "presence_penalty", 0.0)),
        penalty_last_n=int(g(sampling, "penalty_last_n", 0)),
        grammar=g(sampling, "grammar", "") or "")


def adjusted(row: np.ndarray, p: SamplingParams, window: Sequence[int] = ()) -> np.ndarray:
    """``row`` (float32) after the logit bias and the penalties over ``window`` (the
    sequence's tokens before the one sampled; its last ``penalty_last_n`` count), in float32
    as llama.cpp computes them. ``row`` itself when neither applies."""
    row = np.asarray(row, dtype=np.float32).reshape(-1)
    out = row
    if p.logit_bias:
        out = np.array(row, dtype=np.float32, copy=True)
        idx = np.fromiter((t for t, _ in p.logit_bias), dtype=np.int64)
        if idx.max() >= out.shape[0]:
            raise InvalidArgument(f"logit_bias names a token id outside the vocabulary "
                                  f"[0, {out.shape[0]})")
        np.add.at(out, idx, np.fromiter((b for _, b in p.logit_bias), dtype=np.float32))
    if p.penalized and len(window):
        seen = collections.Counter(window[-p.penalty_last_n:])
        if out is row:
            out = np.array(row, dtype=np.float32, copy=True)
        rep = np.float32(p.repeat_penalty)
        freq, present = np.float32(p.frequency_penalty), np.float32(p.presence_penalty)
        for t, c in seen.items():
            if not 0 <= t < out.shape[0]:
                continue
            x = out[t]
            x = x * rep if x <= 0 else x / rep
            out[t] = x - (np.float32(c) * freq + np.float32(1.0) * present)
    return out


class Sampler:
    """Stateful sampler for one generation (its random stream advances per token)."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        # The bit generator, not a Generator's methods: numpy keeps PCG64's stream (seeded
        # through SeedSequence) the same in every release, not the algorithms of
        # Generator.choice and the like (NEP 19), and a replay on another host must draw alike.
        self._bits = np.random.PCG64(self.params.seed)

    def uniform(self) -> float:
        """The next draw in [0, 1): the top 53 bits of the stream's next 64 (as
        ``Generator.random`` makes them today)."""
        return (int(self._bits.random_raw()) >> 11) * (1.0 / 9007199254740992.0)

    def __call__(self, logits: np.ndarray, window: Sequence[int] = ()) -> int:
        """A token from ``logits``; ``window``: the sequence's tokens before it (for the
        penalties)."""
        p = self.params
        row = adjusted(logits, p, window)
        if p.greedy:
            return int(np.argmax(row))
        n = row.shape[0]
        if 0 < p.top_k < n:
            idx = top_k(row, p.top_k)
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
        cdf = np.cumsum(probs)
        cdf /= cdf[-1]  # as Generator.choice(p=...) draws: the same tokens as before
        pick = int(np.searchsorted(cdf, self.uniform(), side="right"))
        return int(idx[min(pick, len(idx) - 1)])


def top_k(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest values of ``row``, lowest ids first among values tied at
    the cut. ``argpartition`` alone keeps whichever tied ids its algorithm meets first, and
    that differs between numpy releases and between CPUs (its SIMD kernels)."""
    cut = np.partition(row, row.shape[0] - k)[row.shape[0] - k]  # a value: the same anywhere
    above = np.flatnonzero(row > cut)
    return np.concatenate([above, np.flatnonzero(row == cut)[: k - above.shape[0]]])


_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _mix(seed: int, pos: int) -> int:
    """splitmix64 of (seed, position): an independent, reproducible stream per position."""
    z = (seed + _GOLDEN * (pos + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample_rows(logits: np.ndarray, positions: Sequence[int], sampling,
                windows: Sequence[Sequence[int]] | None = None) -> list[int]:
    """Sample one token per logits row; ``positions[i]`` is the position the token will take.

    ``sampling``: a ``SamplingParams``, a ``wire.Sampling`` or None (greedy). ``windows[i]``:
    the sequence's tokens before row ``i``'s token (at least its last ``penalty_last_n``),
    needed when the penalties apply. Greedy is the argmax of the adjusted row. Otherwise
    each row is drawn with ``Sampler`` seeded by ``(seed, position)``: a token depends on
    its position, not on how many draws came before, so a re-prefill after a failover, or a
    reference computed elsewhere, draws the same tokens.
    """
    p = params_of(sampling)
    if p is None:
        return [int(np.argmax(r)) for r in logits]
    if p.penalized and (windows is None or len(windows) != len(logits)):
        raise InvalidArgument("the penalties need the sequence's tokens before each row")
    out = []
    for i, (row, pos) in enumerate(zip(logits, positions)):
        window = windows[i] if windows is not None else ()
        if p.greedy:
            out.append(int(np.argmax(adjusted(row, p, window))))
        else:
            out.append(Sampler(replace(p, seed=_mix(p.seed, int(pos))))(row, window))
    return out
