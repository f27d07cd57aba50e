"""How a session's steps reach the stages: one interface, three paths.

- ``HopByHop``: the driver relays every boundary, one gRPC step stream per stage.
- ``Relay``: direct relay over the data plane (docs/dataplane.md): the driver sends a step to
  the first stage, each stage forwards its boundary to the next, the last one answers the
  driver; a prompt's chunks are all sent at once (pipelined prefill).
- ``DecodeLoop``: ``Relay`` whose decode runs on the stages: the last stage feeds each token
  it samples to the first stage itself (``Forward.steps``), no driver hop between tokens.

The session picks one from the route's configuration (``path_for``) and applies the recovery
policy (``dgr.driver.recovery``) around it; a path only runs steps and says what failed
(``stage_index`` on the error when it knows the stage). Every ``wire.Forward`` comes from
``dgr.driver.headers.forward_header``.
"""

from __future__ import annotations

import abc
import asyncio
import time
from typing import Any, AsyncIterator

from dgr import errors
from dgr.driver.checks import stage_error
from dgr.driver.headers import forward_header, media_header, solo_of
from dgr.driver.media import MediaStep
from dgr.driver.recovery import release_quietly
from dgr.protocol import wire
from dgr.transport.client import ShardClient, StepStream, timeout_after

__all__ = ["DecodeLoop", "HopByHop", "Relay", "StepPath", "path_for"]


class StepPath(abc.ABC):
    """Steps of session ``s`` (an ``AsyncRouteSession``) at the end of its history.

    ``want`` and ``sampling`` (a ``wire.Sampling`` or None) apply to the last step only; the
    steps before it ask for the boundary.
    """

    def __init__(self, s: Any):
        self.s = s

    @abc.abstractmethod
    def prefill(self, chunks: list[list[int]], want: str, sampling: wire.Sampling | None
                ) -> AsyncIterator[wire.Frame]:
        """Run one step per chunk; yield each one's reply from the last stage, in order, once
        every stage holds it (the chunk is then appended to the session's history)."""

    async def decode(self, tok: int, n: int, want: str, sampling: wire.Sampling | None,
                     eog: frozenset, logits: bool) -> AsyncIterator[int]:
        """Feed ``tok`` and yield the ``n`` tokens after it (``eog``: end-of-generation
        tokens; ``logits``: keep each sampling row). When a token is yielded, the token fed
        before it is in the history. Here: one step per token."""
        s = self.s
        for _ in range(n):
            async for f in self.prefill([[tok]], want, sampling):
                pass
            tok = s._take(f, logits)
            yield tok

    @property
    def fallback(self) -> StepPath:
        """The path a decode goes on with after this one's ``decode`` failed (itself)."""
        return self


class HopByHop(StepPath):
    """The driver sends each step to every stage in turn over gRPC, relaying the boundary.

    It holds the session's step streams (one per stage, reopened when broken or when the
    stage was replaced), and counts ``s.stats``. Recovery replays over this path whatever the
    session's path is: a stage that fails here names itself.
    """

    def __init__(self, s: Any):
        super().__init__(s)
        self.streams: list[StepStream | None] = [None] * len(s.route.stages)

    def client(self, i: int) -> ShardClient:
        """The client stage ``i``'s stream runs on (the route's when none is open)."""
        stream = self.streams[i]
        return stream.client if stream is not None else self.s.route.clients[i]

    async def forward(self, toks: list[int], pos: int, want: str,
                      sampling: wire.Sampling | None, media: MediaStep | None = None
                      ) -> wire.Frame:
        """One step of ``toks`` at ``pos`` through every stage; the last stage's reply. With
        ``media`` (``toks`` unused), the media step's rows instead: the first stage takes
        them as embedding rows, every stage its positions and causality."""
        s = self.s
        r = s.route
        n = media.n_rows if media is not None else len(toks)
        rollback = s.take_rollback(pos)
        x = None if media is None else media.rows
        last = len(r.stages) - 1
        for i, st in enumerate(r.stages):
            if media is not None:
                h = media_header(s.id, s.epoch, st, media, want=want, sampling=sampling,
                                 last=i == last, rollback=rollback)
            else:
                h = forward_header(s.id, s.epoch, st, pos, toks, want=want, sampling=sampling,
                                   last=i == last,
                                   # the last stage keeps the session's tokens (its drafter
                                   # and the penalties read them)
                                   tokens=i == 0 or i == last or st.needs_token_ids,
                                   solo=solo_of(r, want), rollback=rollback,
                                   speculate=r.speculate if i == last else "")
            if x is None:
                data = wire.encode(h)
            else:
                data = wire.encode(h, x, codec=r.codec, compress=r.compress)
            stream = self.streams[i]
            if stream is not None and stream.client is not r.clients[i]:
                self.forget(i)  # the stage was replaced (by another session's recovery)
                stream = None
            if stream is None or stream.broken:
                stream = self.streams[i] = r.clients[i].stream()
                s.stats[i].endpoint = st.endpoint
            t0 = time.perf_counter()
            try:
                reply = await stream.step(data, r.deadline(i, n))
            except errors.DgrError as e:
                e.stage_index = i  # which stage failed: recovery replaces that one
                raise
            dt = time.perf_counter() - t0
            r.deadlines.measured(i, n, dt)
            f = wire.decode(reply)
            rh = f.header
            stat = s.stats[i]
            stat.steps += 1
            stat.bytes_sent += len(data)
            stat.bytes_received += len(reply)
            if n == 1:
                stat.decode_steps += 1
                stat.decode_rtt_s += dt
            if type(rh) is wire.ErrorReply:
                e = stage_error(rh, st)
                e.stage_index = i
                raise e
            if type(rh) is not wire.Result or rh.session != s.id or rh.epoch != s.epoch \
                    or rh.first_pos != pos:
                raise errors.FrameError(f"{st.endpoint} answered with an unexpected frame {rh!r}")
            if i != last:
                if rh.kind != "boundary" or f.array is None or f.array.shape[0] != n \
                        or rh.layer != r.stages[i + 1].layers[0]:
                    raise errors.FrameError(
                        f"{st.endpoint} returned {rh.kind} [{rh.rows}, {rh.cols}] ending at "
                        f"layer {rh.layer}; the next stage needs a boundary of {n} rows "
                        f"starting at layer {r.stages[i + 1].layers[0]}")
                x = f.array
        return f

    async def prefill(self, chunks: list[list[int]], want: str,
                      sampling: wire.Sampling | None) -> AsyncIterator[wire.Frame]:
        s = self.s
        for k, toks in enumerate(chunks):
            end = k == len(chunks) - 1
            f = await self.forward(toks, len(s.history), want if end else "boundary",
                                   sampling if end else None)
            s._extend(toks)
            yield f

    def forget(self, i: int) -> None:
        """Drop stage ``i``'s stream and free this session on its worker (in the background;
        a worker that cannot be reached frees it by TTL). Not when stage ``i``'s replacement
        is the same worker (it came back, or was only slow): a late Release there would drop
        the session this route is rebuilding on it, and the new epoch supersedes the old
        state anyway."""
        s = self.s
        stream, self.streams[i] = self.streams[i], None
        if stream is None:
            return
        coros = [stream.close()]
        if stream.client.endpoint != s.route.clients[i].endpoint:
            coros.append(release_quietly(stream.client, s.id, s.route.probe_timeout))
        for coro in coros:
            t = asyncio.ensure_future(coro)
            s._cleanup.add(t)
            t.add_done_callback(s._cleanup.discard)

    async def close(self) -> None:
        """Close every stream."""
        streams, self.streams = self.streams, [None] * len(self.streams)
        await asyncio.gather(*(st.close() for st in streams if st is not None),
                             return_exceptions=True)


def _expire(keys) -> None:
    """A relayed batch's deadline passed: cancel what is still awaited (marked expired)."""
    for _, _, fut in keys:
        if not fut.done():
            fut.expired = True
            fut.cancel()


class Relay(StepPath):
    """Direct relay: every chunk goes to the first stage at once, the replies come back from
    the last stage on the route's data links (``AsyncRoute.relay_links``)."""

    async def prefill(self, chunks: list[list[int]], want: str,
                      sampling: wire.Sampling | None) -> AsyncIterator[wire.Frame]:
        s = self.s
        r = s.route
        links = await r.links()
        rl = r.relay_links
        hops = rl.hops()
        st0 = r.stages[0]
        loop = asyncio.get_running_loop()
        pos = len(s.history)
        keys = []
        total = 0
        timer = None
        t0 = time.perf_counter()
        try:
            for k, toks in enumerate(chunks):
                h = forward_header(s.id, s.epoch, st0, pos, toks, want=want, sampling=sampling,
                                   last=k == len(chunks) - 1, relay=hops, reply_to=r.route_id,
                                   solo=solo_of(r, want), rollback=s.take_rollback(pos),
                                   speculate=r.speculate)
                key = (s.id, s.epoch, pos)
                fut = rl.pending[key] = loop.create_future()
                keys.append((key, len(toks), fut))
                links[0].send(wire.encode(h))
                pos += len(toks)
                total += len(toks)
            # One timer at a time (cheaper than asyncio.wait_for per step), for progress, not
            # for the whole batch: each chunk's reply is due within its own step's deadline of
            # the one before it (the first's, of sending). The chunks queue on the stages, so
            # a long prompt's last reply comes after all the others' compute: a deadline for
            # the whole batch, capped at step_timeout, expired a 32k prompt on a slow machine.
            timer = loop.call_later(r.deadline(len(r.stages), keys[0][1]), _expire, keys)
            for k, (key, n, fut) in enumerate(keys):
                try:
                    f = await fut
                except asyncio.CancelledError:
                    if timer.cancelled() or not getattr(fut, "expired", False):
                        raise
                    raise errors.StepDeadlineExceeded(
                        f"relayed step of {n} token(s) at position {key[2]}: no reply from "
                        f"the route within its deadline") from None
                rh = f.header
                if k == len(keys) - 1 and want.startswith("token") and not rh.tokens:
                    raise errors.FrameError(f"{r.stages[-1].endpoint} sent no token")
                if len(keys) == 1:
                    r.deadlines.measured_relay(n, time.perf_counter() - t0)
                r.relay_steps += 1
                s._extend(chunks[k])
                timer.cancel()
                if k + 1 < len(keys):
                    timer = loop.call_later(r.deadline(len(r.stages), keys[k + 1][1]),
                                            _expire, keys[k + 1:])
                yield f
            if len(keys) > 1:
                r.deadlines.measured_relay(total, time.perf_counter() - t0)
        finally:
            if timer is not None:
                timer.cancel()
            for key, _, fut in keys:
                if rl.pending.get(key) is fut:
                    del rl.pending[key]
                if not fut.done():
                    fut.cancel()
                elif not fut.cancelled():
                    fut.exception()  # retrieved: a later chunk's error is not "unhandled"


class DecodeLoop(Relay):
    """``Relay`` whose decode runs on the stages (``Forward.steps``, ``Forward.loop``).

    The stages loop ``loop_window`` tokens at a time: the next window starts (from the
    window's last token, sent to the first stage) only when the reader asks for its first
    token, so the stages never run more than a window ahead of the reader. A broken loop is
    not restarted: the decode goes on one relayed step per token (``fallback``).
    """

    def __init__(self, s: Any):
        super().__init__(s)
        self._steps = Relay(s)

    @property
    def fallback(self) -> StepPath:
        return self._steps

    async def decode(self, tok: int, n: int, want: str, sampling: wire.Sampling | None,
                     eog: frozenset, logits: bool) -> AsyncIterator[int]:
        s = self.s
        r = s.route
        links = await r.links()
        rl = r.relay_links
        key = (s.id, s.epoch)
        q: asyncio.Queue = asyncio.Queue()
        rl.rings[key] = q
        pos = len(s.history)
        st0 = r.stages[0]
        left = n
        n_ctx = int(r.n_ctx)
        # the parity mode (logits) keeps one row per token: it never speculates
        spec = "" if logits else r.speculate
        per_trip = 1 + (r.max_draft if spec else 0)  # tokens a trip's step may carry
        try:
            while left > 0:
                # a window never loops past the context: the first stage's refusal of the
                # step after the last one that fits (ContextFull) would race that step's
                # token, which comes from the last stage, and could reach us first; a step
                # at or past n_ctx is sent alone and refused with nothing else in flight
                # (the last stage drafts nothing past the context either)
                window = min(left, r.loop_window, max(n_ctx - pos, 1) if n_ctx else left)
                h = forward_header(s.id, s.epoch, st0, pos, [tok], want=want,
                                   sampling=sampling, relay=rl.hops(), reply_to=r.route_id,
                                   loop=rl.loop_hops(), steps=window,
                                   stop_tokens=sorted(eog) if eog else None,
                                   solo=solo_of(r, want), rollback=s.take_rollback(pos),
                                   speculate=spec, max_draft=r.max_draft if spec else 0)
                links[0].send(wire.encode(h))
                fed = tok
                got = 0
                while got < window:
                    t0 = time.perf_counter()
                    try:
                        async with timeout_after(r.deadline(len(r.stages), per_trip)):
                            item = await q.get()
                    except TimeoutError:
                        raise errors.StepDeadlineExceeded(
                            f"decode loop at position {pos}: no token from the route within "
                            "its deadline") from None
                    if isinstance(item, BaseException):
                        raise item
                    rh = item.header
                    toks = rh.tokens
                    if rh.first_pos != pos or not toks or got + len(toks) > window \
                            or len(toks) > rh.drafted + 1 \
                            or rh.n_tokens != rh.drafted + 1:
                        # the loop and this session's history disagree: re-prefill, go on
                        raise errors.CacheMiss(
                            f"decode loop: expected the tokens after position {pos}, got a "
                            f"reply for position {rh.first_pos} with tokens {toks}")
                    r.deadlines.measured_relay(rh.n_tokens, time.perf_counter() - t0)
                    r.relay_steps += 1
                    s.trip(rh.drafted, len(toks))
                    # the token fed and the drafts accepted after it are the caches' now;
                    # the rejected ones stay there until the next step rolls them back
                    s._extend([fed, *toks[:-1]])
                    pos += len(toks)
                    s.rollback = rh.first_pos + rh.n_tokens - pos
                    if logits:
                        s.logits.append(item.array[-1].copy())
                    for t in toks:
                        got += 1
                        left -= 1
                        yield int(t)
                    fed = int(toks[-1])
                tok = fed
        finally:
            if rl.rings.get(key) is q:
                del rl.rings[key]


def path_for(s: Any) -> StepPath:
    """Session ``s``'s path from its route's configuration (fixed at ``connect``): the
    decode loop with ``relay`` and ``loop``, direct relay with ``relay``, else hop by hop
    (the session's ``hop_by_hop``, which recovery replays over in every case)."""
    r = s.route
    if r.relay:
        return DecodeLoop(s) if r.loop else Relay(s)
    return s.hop_by_hop
