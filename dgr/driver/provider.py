"""Route providers: where the route driver gets its workers, and where it reports failures.

Choosing workers is not dgr's job: in production a tracker does it. The driver only consumes
the ``RouteProvider`` interface: ``route()`` for a first route, ``candidates(layers)`` for the
workers that could replace a failed stage (best first), ``report_failure`` /
``report_success`` so the provider can rank them. ``StaticPool`` is the embedded default: a
fixed list of endpoints (primaries and spares per layer range) that it describes itself.
"""

from __future__ import annotations

import abc
import asyncio
import time
from dataclasses import dataclass
from typing import Sequence

from dgr import errors

__all__ = ["RouteProvider", "StaticPool", "parse_endpoints"]


class RouteProvider(abc.ABC):
    """What the route driver asks of a tracker. Every method runs in the driver's event loop."""

    @abc.abstractmethod
    async def route(self) -> list[str]:
        """Endpoints that together cover every layer once (any order).

        Raises ``dgr.errors.NoHealthyWorker`` naming a layer range no healthy worker serves.
        """

    @abc.abstractmethod
    async def candidates(self, layers: tuple[int, int]) -> list[str]:
        """Endpoints that serve exactly ``layers``, best first (recently failed ones last)."""

    def report_failure(self, endpoint: str, layers: tuple[int, int] | None,
                       error: BaseException) -> None:
        """``endpoint`` failed a step or a probe (deadline, unavailable, lost state)."""

    def report_success(self, endpoint: str, layers: tuple[int, int] | None) -> None:
        """``endpoint`` was probed healthy and joined a route."""


@dataclass
class _Entry:
    endpoint: str
    layers: tuple[int, int] | None = None
    n_layer: int = 0
    failures: int = 0
    last_failure: float = 0.0   # time.monotonic() of the last reported failure (0: never)
    last_error: str = ""


class StaticPool(RouteProvider):
    """A fixed pool of workers: primaries and spares for each layer range.

    Parameters
    ----------
    endpoints : sequence of str
        ``host:port`` of every worker of the pool, in preference order.
    layers : dict, optional
        ``{endpoint: (first, end)}`` for endpoints whose range is known; the others are
        described on first use (and again while they cannot be reached).
    describe_timeout : float
        Deadline of a describe while learning an endpoint's range, seconds.
    security : dgr.transport.security.Security, optional
        Credential and TLS of those describes (None: the environment's).
    """

    def __init__(self, endpoints: Sequence[str], *,
                 layers: dict[str, tuple[int, int]] | None = None,
                 describe_timeout: float = 2.0, security=None):
        self.security = security
        self.entries = {e: _Entry(e) for e in parse_endpoints(list(endpoints))}
        for ep, lr in (layers or {}).items():
            self.entries.setdefault(ep, _Entry(ep)).layers = (int(lr[0]), int(lr[1]))
        self.describe_timeout = describe_timeout

    async def _learn(self) -> None:
        from dgr.transport.client import ShardClient

        todo = [e for e in self.entries.values() if e.layers is None]
        if not todo:
            return

        async def one(e: _Entry) -> None:
            c = ShardClient(e.endpoint, timeout=self.describe_timeout, security=self.security)
            try:
                info = await c.describe()
                e.layers, e.n_layer = tuple(info.layers), info.n_layer
            except errors.DgrError as exc:
                self.report_failure(e.endpoint, None, exc)
            finally:
                await c.close()

        await asyncio.gather(*(one(e) for e in todo))

    def _rank(self, entries: list[_Entry]) -> list[_Entry]:
        # never failed first (pool order), then the longest ago failed
        return sorted(entries, key=lambda e: (e.last_failure > 0, e.last_failure))

    async def route(self) -> list[str]:
        await self._learn()
        known = [e for e in self.entries.values() if e.layers is not None]
        if not known:
            raise errors.NoHealthyWorker(
                "no worker of the pool could be reached: " + ", ".join(
                    f"{e.endpoint} ({e.last_error or 'unreachable'})"
                    for e in self.entries.values()))
        n = max(e.n_layer or e.layers[1] for e in known)
        by_start: dict[int, list[_Entry]] = {}
        for e in self._rank(known):
            by_start.setdefault(e.layers[0], []).append(e)
        out, pos = [], 0
        while pos < n:
            # the best endpoint starting here, preferring the range that reaches furthest
            starts = by_start.get(pos, [])
            if not starts:
                raise errors.NoHealthyWorker(
                    f"no reachable worker of the pool serves layers starting at {pos} "
                    f"(of [0, {n}))")
            best = starts[0]
            out.append(best.endpoint)
            pos = best.layers[1]
        return out

    async def candidates(self, layers: tuple[int, int]) -> list[str]:
        layers = (int(layers[0]), int(layers[1]))
        await self._learn()
        return [e.endpoint for e in self._rank([e for e in self.entries.values()
                                                if e.layers == layers])]

    def report_failure(self, endpoint, layers, error) -> None:
        e = self.entries.get(endpoint)
        if e is None:
            return
        if e.layers is None and layers is not None:
            # a stage that failed before this pool described it: it still serves that range
            # (a candidate once it answers again, and NoHealthyWorker says why it did not)
            e.layers = (int(layers[0]), int(layers[1]))
        e.failures += 1
        e.last_failure = time.monotonic()
        e.last_error = f"{type(error).__name__}: {error}"

    def report_success(self, endpoint, layers) -> None:
        e = self.entries.get(endpoint)
        if e is not None and layers is not None:
            e.layers = (int(layers[0]), int(layers[1]))

    def failures(self) -> dict[str, int]:
        """Failures reported per endpoint."""
        return {ep: e.failures for ep, e in self.entries.items()}


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``"h:p,h:p"`` or a list of ``"h:p"`` -> a list of endpoints."""
    if isinstance(endpoints, str):
        endpoints = endpoints.split(",")
    out = [e.strip() for e in endpoints if e and e.strip()]
    if not out:
        raise errors.RouteError("a route needs at least one endpoint")
    return out
