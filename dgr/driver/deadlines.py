"""Step deadlines sized from each stage's recent step times (how the driver sees a hang)."""

from __future__ import annotations

import collections

import numpy as np

__all__ = ["Deadlines"]


class Deadlines:
    """Recent step seconds per token of each stage, and the deadlines they size.

    A step of ``n_tokens`` on stage ``i`` gets ``min(step_timeout, max(floor, factor * p99 *
    n_tokens))``, p99 over that stage's last 64 steps (per token); ``step_timeout`` until 8
    steps were measured. Index ``len(stages)`` is the whole route (relayed steps).
    """

    def __init__(self, step_timeout: float, floor: float, factor: float):
        self.step_timeout = step_timeout
        self.floor = floor
        self.factor = factor
        #: recent step seconds per token, per stage (and the whole route last)
        self._times: list[collections.deque] = []
        self._n_measured: dict[int, int] = {}
        self._p99: dict[int, tuple[int, float]] = {}

    def reset(self, n_stages: int) -> None:
        """Forget every measurement; a route of ``n_stages`` (one more slot for relayed
        steps, the whole route per token)."""
        self._times = [collections.deque(maxlen=64) for _ in range(n_stages + 1)]
        self._n_measured = {}
        self._p99 = {}

    def deadline(self, i: int, n_tokens: int) -> float:
        """Deadline of an ``n_tokens`` step on stage ``i``, sized from its recent steps."""
        times = self._times[i] if i < len(self._times) else ()
        if len(times) < 8:
            return self.step_timeout
        # np.percentile costs ~0.2 ms, as much as a loopback hop: refresh it every 16 steps
        n = self._n_measured.get(i, 0)
        cached = self._p99.get(i)
        if cached is None or n - cached[0] >= 16:
            cached = self._p99[i] = (n, float(np.percentile(np.fromiter(times, float), 99)))
        p99 = cached[1]
        return min(self.step_timeout, max(self.floor, self.factor * p99 * max(n_tokens, 1)))

    def measured(self, i: int, n_tokens: int, seconds: float) -> None:
        """Stage ``i`` ran an ``n_tokens`` step in ``seconds`` (as the driver saw it)."""
        if i < len(self._times):
            self._times[i].append(seconds / max(n_tokens, 1))
            self._n_measured[i] = self._n_measured.get(i, 0) + 1

    def measured_relay(self, n_tokens: int, seconds: float) -> None:
        """A relayed step's time bounds each stage's too: it sizes the deadlines of the
        relayed steps and of the hop-by-hop steps a recovery replays."""
        for i in range(len(self._times)):
            self.measured(i, n_tokens, seconds)
