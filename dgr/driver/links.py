"""The driver's data links for direct relay (docs/dataplane.md): one per stage, and where the
frames that come back on them go."""

from __future__ import annotations

import asyncio
from typing import Callable

from dgr import errors
from dgr.driver.checks import stage_error, stage_name
from dgr.protocol import wire
from dgr.protocol.describe import StageInfo
from dgr.transport.dataplane import AsyncLink

__all__ = ["RelayLinks"]


class RelayLinks:
    """Data links to the stages of one route, and the replies they are awaited for.

    The driver sends a relayed step to the first stage; the reply comes back on any link
    (from the last stage, or an ``ErrorReply`` from the stage that failed). A ``Result`` goes
    to the future in ``pending`` under ``(session, epoch, first_pos)``, else to the decode
    loop's queue in ``rings`` under ``(session, epoch)``; an error fails what it concerns,
    with ``stage_index`` set to the stage recovery replaces.

    Parameters
    ----------
    route_id : str
        ``Hello.route`` and ``Forward.reply_to``: how the last stage finds its way back.
    stages : callable
        The route's stages now (they change when a stage is replaced).
    probe_timeout : float
        A link's connect and ``Hello`` wait at least this long (and at least 1 s), seconds.
    security : dgr.transport.security.Security, optional
        The credential and TLS of every link (None: ``default_security()``).
    """

    def __init__(self, route_id: str, stages: Callable[[], list[StageInfo]],
                 probe_timeout: float, security=None):
        self.route_id = route_id
        self.security = security  # presented on every link (None: the environment's)
        self._stages = stages
        self.probe_timeout = probe_timeout
        self._links: dict[str, AsyncLink] = {}
        self._hellos: dict[str, asyncio.Future] = {}
        #: relayed steps' replies awaited, by (session, epoch, first_pos)
        self.pending: dict[tuple[str, int, int], asyncio.Future] = {}
        #: decode loops being read, by (session, epoch)
        self.rings: dict[tuple[str, int], asyncio.Queue] = {}
        self._lock: asyncio.Lock | None = None
        self._route: tuple | None = None  # (stages list it was built for, links, hops)

    async def links(self) -> list[AsyncLink]:
        """Open data links to every stage (once; reopened after a loss) and say ``Hello``.

        Raises
        ------
        dgr.errors.RouteError
            A stage serves no data plane.
        dgr.errors.WorkerUnavailable
            A data port cannot be reached (or does not answer the ``Hello``).
        """
        stages_now = self._stages()
        cached = self._route
        if cached is not None and not any(link.closed for link in cached[1]) and all(
                a is b for a, b in zip(cached[0], stages_now)):
            return cached[1]
        if self._lock is None:
            self._lock = asyncio.Lock()
        stages = list(stages_now)
        out = []
        for i, st in enumerate(stages_now):
            ep = st.data_endpoint
            if ep is None:
                raise errors.RouteError(
                    f"{stage_name(st)} serves no data plane (started with --data-port -1): "
                    "use relay=False")
            link = self._links.get(ep)
            if link is None or link.closed:
                async with self._lock:
                    link = self._links.get(ep)
                    if link is None or link.closed:
                        try:
                            link = await self._open(ep, i)
                        except errors.DgrError as e:
                            e.stage_index = i  # recovery replaces that stage
                            raise
            out.append(link)
        last = len(stages) - 1
        # frames relayed to the last stage carry the token ids: it keeps the session's
        # tokens (its drafter and the penalties read them; dgr.worker.history)
        hops = [wire.Hop(endpoint=st.data_endpoint, tokens=st.needs_token_ids or i == last)
                for i, st in enumerate(stages) if i > 0]
        self._route = (stages, out, hops)
        return out

    def hops(self) -> list[wire.Hop]:
        """``Forward.relay`` of the current route (after ``links()``)."""
        return self._route[2]

    def loop_hops(self) -> list[wire.Hop]:
        """``Forward.loop`` of the current route: every stage, the first included."""
        first = self._route[0][0]
        return [wire.Hop(endpoint=first.data_endpoint, tokens=True), *self._route[2]]

    async def _open(self, ep: str, i: int) -> AsyncLink:
        t = max(self.probe_timeout, 1.0)
        hello = self._hellos[ep] = asyncio.get_running_loop().create_future()
        link = await AsyncLink(ep, self._on_frame, self._on_lost, i).open(
            t, wire.Hello(route=self.route_id), self.security)
        try:  # the echo: this stage knows the return path before any relayed step gets there
            await asyncio.wait_for(hello, t)
        except (asyncio.TimeoutError, TimeoutError):
            link.close()
            raise errors.WorkerUnavailable(f"{ep}: no answer to the data-plane Hello within "
                                           f"{t:g} s") from None
        except BaseException:  # refused (Unauthenticated, say) or lost: let it go
            link.close()
            raise
        finally:
            self._hellos.pop(ep, None)
        self._links[ep] = link
        return link

    def _stage_of(self, link: AsyncLink) -> int | None:
        for i, st in enumerate(self._stages()):
            if st.data_endpoint == link.endpoint:
                return i
        return None

    def _on_frame(self, link: AsyncLink, data: bytes) -> None:
        try:
            f = wire.decode(data)
        except errors.FrameError as e:
            self.fail_pending(e)
            return
        h = f.header
        cls = type(h)
        if cls is wire.Result:
            fut = self.pending.pop((h.session, h.epoch, h.first_pos), None)
            if fut is not None:
                if not fut.done():
                    fut.set_result(f)
            else:
                q = self.rings.get((h.session, h.epoch))
                if q is not None:
                    q.put_nowait(f)
        elif cls is wire.ErrorReply:
            stages = self._stages()
            i = self._stage_of(link)
            exc = stage_error(h, stages[i]) if i is not None else h.to_exception()
            # "unavailable" from a stage means its next hop could not be reached; any other
            # error is the stage's own (stale epoch, draining, cache miss, ...)
            if isinstance(exc, errors.WorkerUnavailable) and not isinstance(
                    exc, errors.WorkerDraining):
                # (the last stage's next hop is the first: the decode loop)
                exc.stage_index = (i + 1) % len(stages) if i is not None else None
            else:
                exc.stage_index = i
            if h.session:
                self.fail_pending(exc, lambda k: k[0] == h.session and k[1] == h.epoch)
            else:
                self.fail_pending(exc)
                fut = self._hellos.get(link.endpoint)  # e.g. the connection was refused
                if fut is not None and not fut.done():  # (Unauthenticated): say so
                    fut.set_exception(exc)
        elif cls is wire.Hello:
            fut = self._hellos.get(link.endpoint)
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _on_lost(self, link: AsyncLink, exc) -> None:
        if self._links.get(link.endpoint) is link:
            del self._links[link.endpoint]
        err = errors.WorkerUnavailable(f"{link.endpoint}: data connection lost"
                                       f"{f' ({exc})' if exc else ''}")
        err.stage_index = self._stage_of(link)
        self.fail_pending(err)
        fut = self._hellos.get(link.endpoint)
        if fut is not None and not fut.done():
            fut.set_exception(err)

    def fail_pending(self, exc: BaseException, match=None) -> None:
        """Fail the awaited replies and decode loops whose key ``match`` accepts (all)."""
        for k in [k for k in self.pending if match is None or match(k)]:
            fut = self.pending.pop(k)
            if not fut.done():
                fut.set_exception(exc)
        for k, q in self.rings.items():
            if match is None or match((*k, 0)):
                q.put_nowait(exc)

    def close(self) -> list[AsyncLink]:
        """Close every link and fail what is still awaited; returns the links closed (their
        ``wait_closed`` ends their TLS close)."""
        links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        self.fail_pending(errors.WorkerUnavailable("the route was closed"))
        return links
