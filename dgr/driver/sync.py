"""The blocking API: ``dgr.Route`` / ``dgr.RouteSession`` over ``AsyncRoute`` (asyncio), whose
coroutines run on a private event loop in a daemon thread."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Iterator, Sequence

import numpy as np

from dgr.driver.async_route import AsyncRoute
from dgr.driver.results import Generation, StageStats
from dgr.driver.session import AsyncRouteSession
from dgr.protocol.describe import StageInfo

__all__ = ["Route", "RouteSession"]


async def _aclose_soon(agen, patience: float = 5.0) -> None:
    """Close an async generator whose interrupted step may still be unwinding."""
    deadline = time.monotonic() + patience
    while True:
        try:
            await agen.aclose()
            return
        except RuntimeError:  # "already running": its cancelled __anext__ has not ended yet
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.01)
        except Exception:  # noqa: BLE001 - cleanup after an interruption: nothing to report
            return


class _LoopThread:
    """A private event loop in a daemon thread; blocking calls submit coroutines to it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dgr-route",
                                       daemon=True)
        self.thread.start()

    def run(self, coro):
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    def iterate(self, agen) -> Iterator:
        try:
            while True:
                try:
                    yield self.run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if self.loop.is_running():
                self.run(_aclose_soon(agen))

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
        if not self.loop.is_running():
            self.loop.close()


class Route:
    """A route over running workers (blocking API; ``AsyncRoute`` is the asyncio one).

    ``Route(endpoints)`` connects: it describes every stage and checks the route. Parameters are
    those of ``AsyncRoute`` (the settings: a ``RouteConfig``, or its fields). Use it as a
    context manager, or ``close()`` it.

    Examples
    --------
    >>> with dgr.Route("127.0.0.1:7001,127.0.0.1:7002") as route:      # doctest: +SKIP
    ...     for tok in route.session().generate("Hello", max_tokens=8):
    ...         print(tok)

    Raises
    ------
    dgr.errors.WorkerUnavailable, dgr.errors.ModelMismatch, dgr.errors.RouteError
        A stage is unreachable, or the stages do not form one route.
    """

    def __init__(self, endpoints: str | Sequence[str] | None = None, **kw):
        self._loop = _LoopThread()
        try:
            self._r = self._loop.run(self._make(endpoints, kw))
        except BaseException:
            self._loop.close()
            raise

    @staticmethod
    async def _make(endpoints, kw) -> AsyncRoute:
        r = AsyncRoute(endpoints, **kw)
        try:
            return await r.connect()
        except BaseException:
            await r.close()
            raise

    @property
    def aroute(self) -> AsyncRoute:
        return self._r

    @property
    def stages(self) -> list[StageInfo]:
        return self._r.stages

    @property
    def identity(self) -> str:
        return self._r.identity

    @property
    def settings(self) -> dict:
        return self._r.settings

    @property
    def n_ctx(self) -> int:
        return self._r.n_ctx

    @property
    def eog_tokens(self) -> frozenset:
        return self._r.eog_tokens

    def describe(self) -> list[StageInfo]:
        return self._loop.run(self._r.describe())

    def session(self, session_id: str | None = None) -> RouteSession:
        return RouteSession(self, self._r.session(session_id))

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = False) -> np.ndarray:
        return self._loop.run(self._r.tokenize(text, add_special, parse_special))

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._loop.run(self._r.detokenize(tokens))

    def pieces(self) -> list[bytes]:
        """Every token id's bytes, as llama.cpp renders each alone (``AsyncRoute.pieces``)."""
        return self._loop.run(self._r.pieces())

    def complete(self, prompt: str | Sequence[int], **kw) -> Generation:
        return self._loop.run(self._r.complete(prompt, **kw))

    def close(self) -> None:
        if self._loop.loop.is_running():
            self._loop.run(self._r.close())
        self._loop.close()

    def __enter__(self) -> Route:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RouteSession:
    """A route session, blocking API (see ``AsyncRouteSession``)."""

    def __init__(self, route: Route, inner: AsyncRouteSession):
        self.route = route
        self.inner = inner

    @property
    def id(self) -> str:
        return self.inner.id

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    @property
    def history(self) -> list[int]:
        return self.inner.history

    @property
    def logits(self) -> list[np.ndarray]:
        return self.inner.logits

    @property
    def stats(self) -> list[StageStats]:
        return self.inner.stats

    @property
    def recoveries(self) -> int:
        return self.inner.recoveries

    @property
    def speculation(self) -> tuple[int, int, int]:
        """Decode-loop trips, drafts sent and drafts accepted so far (docs/speculative.md)."""
        s = self.inner
        return s.trips, s.drafted, s.accepted

    @property
    def stop_reason(self) -> str:
        return getattr(self.inner, "stop_reason", "")

    def generate(self, prompt: str | Sequence[int], **kw) -> Iterator[int]:
        """Yield sampled tokens; arguments as ``AsyncRouteSession.generate``."""
        return self.route._loop.iterate(self.inner.generate(prompt, **kw))

    def complete(self, prompt: str | Sequence[int], **kw) -> Generation:
        return self.route._loop.run(self.inner.complete(prompt, **kw))

    def reusable(self, prompt: Sequence[int]) -> int:
        """Positions of this session a later ``prompt`` may keep (``generate``'s ``reuse``)
        and still get a fresh prefill's bits; see ``AsyncRouteSession.reusable``."""
        return self.inner.reusable(prompt)

    def prefill(self, tokens: Sequence[int], **kw) -> int | None:
        return self.route._loop.run(self.inner.prefill(tokens, **kw))

    def release(self) -> None:
        self.route._loop.run(self.inner.release())

    def close(self) -> None:
        self.route._loop.run(self.inner.close())

    def __enter__(self) -> RouteSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
