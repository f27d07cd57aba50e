"""The route driver: ``dgr.Route`` / ``dgr.RouteSession`` (sync) over ``AsyncRoute`` (asyncio).

A route is an ordered list of shard workers that together cover every layer of one model with
identical numeric settings. The driver tokenizes (through the first worker, or a local
tokenizer), prefills in chunks of at most ``n_ubatch`` tokens, relays each step's boundary
from stage to stage, has the last stage sample (or return logits), and streams tokens. It
keeps the token history and the step composition, so when a worker loses the session (cache
miss, unknown session, restart, deadline) it raises the epoch, replays the history exactly as
it was first computed and carries on: the generation's tokens are the same as without the
failure.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Sequence

import numpy as np

from dgr import errors
from dgr.driver.provider import RouteProvider, StaticPool, parse_endpoints
from dgr.protocol import wire
from dgr.protocol.describe import StageInfo
from dgr.protocol.sampling import SamplingParams
from dgr.transport.client import (
    DEFAULT_STEP_TIMEOUT,
    DEFAULT_TIMEOUT,
    ShardClient,
    StepStream,
    _timeout,
)
from dgr.transport.dataplane import AsyncLink

log = logging.getLogger("dgr.route")

__all__ = ["AsyncRoute", "AsyncRouteSession", "Route", "RouteSession", "Generation",
           "StageStats", "check_route", "parse_endpoints"]

# Failures the driver repairs by re-prefilling under a new epoch (on the same route, or after
# replacing the stage that failed). Everything else (bad request, model mismatch, a route that
# does not fit, frame errors) is fatal and never retried.
_RECOVERABLE = (errors.CacheMiss, errors.UnknownSession, errors.StaleEpoch,
                errors.StepDeadlineExceeded, errors.ResourceExhausted, errors.WorkerUnavailable)
# ... of which these mean the stage itself is suspect: ask the provider for a replacement.
_STAGE_FAILED = (errors.StepDeadlineExceeded, errors.WorkerUnavailable)


def retryable(exc: BaseException) -> bool:
    """Whether the driver repairs ``exc`` by recovery (re-prefill, maybe on another worker)."""
    if isinstance(exc, errors.NoHealthyWorker):
        return False
    return isinstance(exc, _RECOVERABLE) or type(exc) is errors.SessionError


async def _release_quietly(client: ShardClient, session: str, timeout: float) -> None:
    try:
        await client.release(session, timeout=timeout)
    except Exception:  # noqa: BLE001 - the old worker is gone: its TTL frees the session
        pass


def check_route(stages: Sequence[StageInfo]) -> list[StageInfo]:
    """Order stages by layer and check they form one route; returns them in route order.

    Raises
    ------
    dgr.errors.ModelMismatch
        Stages serve different models, numeric settings or wire formats.
    dgr.errors.RouteError
        The layer ranges leave a gap, overlap, or do not reach both ends.
    dgr.errors.WorkerDraining
        A stage is shutting down.
    """
    from dgr.protocol.settings import NUMERIC_SETTINGS

    if not stages:
        raise errors.RouteError("a route needs at least one stage")
    ref = stages[0]
    for s in stages[1:]:
        if s.model_identity != ref.model_identity:
            raise errors.ModelMismatch(
                f"{s.endpoint} serves model {s.model_identity}, but {ref.endpoint} serves "
                f"{ref.model_identity}")
        diff = [k for k in NUMERIC_SETTINGS if s.settings.get(k) != ref.settings.get(k)]
        if diff:
            pairs = ", ".join(f"{k}={s.settings.get(k)!r} vs {ref.settings.get(k)!r}"
                              for k in diff)
            raise errors.ModelMismatch(
                f"{s.endpoint} and {ref.endpoint} use different numeric settings ({pairs}); "
                "every stage of a route must use the same ones")
        if s.wire_format_version != ref.wire_format_version:
            raise errors.ModelMismatch(
                f"{s.endpoint} speaks wire format {s.wire_format_version}, {ref.endpoint} "
                f"{ref.wire_format_version}")
    for s in stages:
        if s.wire_format_version != wire.FORMAT_VERSION:
            raise errors.ModelMismatch(f"{s.endpoint} speaks wire format "
                                       f"{s.wire_format_version}; this driver speaks "
                                       f"{wire.FORMAT_VERSION}")
        if s.draining:
            raise errors.WorkerDraining(f"{s.endpoint} is draining (shutting down)")
    order = sorted(stages, key=lambda s: s.layers)
    n = ref.n_layer

    def name(s: StageInfo) -> str:
        return f"{s.endpoint} [{s.layers[0]}, {s.layers[1]})"

    if order[0].layers[0] != 0:
        raise errors.RouteError(f"layers [0, {order[0].layers[0]}) are not covered: the first "
                                f"stage is {name(order[0])}")
    for a, b in zip(order, order[1:]):
        if a.layers[1] < b.layers[0]:
            raise errors.RouteError(f"layers [{a.layers[1]}, {b.layers[0]}) are not covered: "
                                    f"gap between {name(a)} and {name(b)}")
        if a.layers[1] > b.layers[0]:
            raise errors.RouteError(f"layers [{b.layers[0]}, {min(a.layers[1], b.layers[1])}) "
                                    f"are served twice: {name(a)} overlaps {name(b)}")
    if order[-1].layers[1] != n:
        raise errors.RouteError(f"layers [{order[-1].layers[1]}, {n}) are not covered: the "
                                f"last stage is {name(order[-1])}")
    return order


def _from_stage(reply: wire.ErrorReply, st: StageInfo) -> errors.DgrError:
    """The stage's error, its message prefixed with the stage (same class, same retry hint)."""
    exc = reply.to_exception()
    exc.args = (f"{st.endpoint} [{st.layers[0]}, {st.layers[1]}): {reply.message}",)
    return exc


def _expire(keys) -> None:
    """A relayed batch's deadline passed: cancel what is still awaited (marked expired)."""
    for _, _, fut in keys:
        if not fut.done():
            fut.expired = True
            fut.cancel()


def _wire_sampling(p: SamplingParams | None) -> wire.Sampling | None:
    if p is None or p.greedy:
        return None
    return wire.Sampling(temperature=float(p.temperature), top_k=int(p.top_k),
                         top_p=float(p.top_p), seed=int(p.seed))


@dataclass
class StageStats:
    """Per-stage timings seen by the driver (decode steps are single-token steps)."""

    endpoint: str
    layers: tuple[int, int]
    steps: int = 0
    decode_steps: int = 0
    decode_rtt_s: float = 0.0  # time from sending the frame to having the reply, decode steps
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def decode_rtt_ms(self) -> float:
        return 1e3 * self.decode_rtt_s / self.decode_steps if self.decode_steps else 0.0


@dataclass
class Generation:
    """The outcome of ``complete``: tokens, text, why it stopped, and timings."""

    tokens: list[int]
    text: str
    stop_reason: str              # "eos", "length" or "stop"
    prompt_tokens: int
    time_to_first_token_s: float
    decode_s: float               # from the first token to the last
    recoveries: int = 0           # re-prefills after a failure
    logits: list[np.ndarray] | None = None

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


class _RemoteTokenizer:
    """The first stage's tokenizer; follows the route when that stage is replaced."""

    def __init__(self, route: AsyncRoute):
        self.route = route

    async def _call(self, fn):
        r = self.route
        for attempt in range(r.max_retries + 1):
            client = r.clients[0]
            try:
                return await fn(client)
            except (errors.WorkerUnavailable, errors.StepDeadlineExceeded) as e:
                if isinstance(e, errors.NoHealthyWorker) or attempt == r.max_retries:
                    raise
                await r.replace_stage(0, client, e)

    async def tokenize(self, text, add_special, parse_special):
        return await self._call(lambda c: c.tokenize(text, add_special, parse_special))

    async def detokenize(self, tokens):
        return await self._call(lambda c: c.detokenize(tokens))


class _LocalTokenizer:
    def __init__(self, tok):
        self.tok = tok

    async def tokenize(self, text, add_special, parse_special):
        return np.asarray(self.tok.tokenize(text, add_special, parse_special), dtype=np.int32)

    async def detokenize(self, tokens):
        return self.tok.detokenize(tokens)


class AsyncRoute:
    """A route over running workers, asyncio API (``Route`` is the blocking one).

    Parameters
    ----------
    endpoints : str or sequence of str
        ``host:port`` of each stage, in any order (they are ordered by layer range).
    timeout : float
        Deadline of control calls (describe, release, tokenize), seconds.
    step_timeout : float
        Deadline of one step on one stage, seconds.
    connect_timeout : float
        How long recovery waits for a stage to come back (a restarted worker loads its range
        first), seconds.
    codec : str
        Boundary codec on the wire (``"raw"``: bit-exact, the default; ``"f16"``, ``"bf16"``,
        ``"q8"`` are lossy, opt-in). ``compress`` adds zstd.
    tokenizer : object, optional
        Anything with ``tokenize(text, add_special, parse_special)`` and
        ``detokenize(tokens)`` (e.g. a local ``dgr.Engine`` of the same model). Default: the
        first worker's tokenizer, over its control RPCs.
    max_retries : int
        Recoveries (re-prefill under a new epoch) attempted for one step.
    provider : dgr.provider.RouteProvider, optional
        Where replacements for a failed stage come from (and where failures are reported).
        Default: a ``StaticPool`` of ``endpoints`` plus ``spares``. Without ``endpoints`` the
        first route comes from ``provider.route()``.
    spares : sequence of str
        More workers for the default pool (same ranges as the route's stages).
    deadline_floor, deadline_factor : float
        A step's deadline on a stage is ``max(deadline_floor, deadline_factor * p99)`` of
        that stage's recent step times (per token for multi-token steps), at most
        ``step_timeout``; ``step_timeout`` until 8 steps were measured.
    probe_timeout : float
        Deadline of the connect and describe that vet a replacement worker, seconds.
    backoff : float
        First pause between recovery attempts (doubles each time, at most 2 s), seconds.
    relay : bool, optional
        Direct relay over the workers' fast data plane (docs/dataplane.md): the driver sends
        each step to the first stage, every stage forwards its boundary straight to the next
        and the last stage answers the driver; a prompt's chunks are all sent at once, so the
        stages work on consecutive chunks at the same time (pipelined prefill). Same tokens
        and logits as ``relay=False``, which relays every boundary through the driver over
        gRPC. Recovery always replays over gRPC (it finds which stage failed). Needs every
        worker to serve a data port and the raw codec. Default (None): relay when the codec is
        raw and every stage's data port answers at ``connect``, else the gRPC path.
    loop : bool
        With relay, ``generate`` hands decoding to the stages: the last stage feeds each token
        it samples straight back to the first stage (``Forward.steps``), so no driver round
        trip sits between two tokens; the driver streams the tokens as they arrive. It stops
        at ``max_tokens`` and at end-of-generation tokens. False: one driver round trip per
        token.
    loop_window : int
        The decode loop runs this many tokens at a time; the next window starts when the
        reader asks for its first token. So the stages run at most this far ahead of a
        consumer that is slow or stops early (a stop string, a closed stream), and one
        driver hop per window is added (32 by default).
    """

    def __init__(self, endpoints: str | Sequence[str] | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT,
                 step_timeout: float = DEFAULT_STEP_TIMEOUT, connect_timeout: float = 30.0,
                 codec: str = "raw", compress: bool = False, tokenizer: Any = None,
                 max_retries: int = 3, provider: RouteProvider | None = None,
                 spares: Sequence[str] = (), deadline_floor: float = 2.0,
                 deadline_factor: float = 10.0, probe_timeout: float = 1.0,
                 backoff: float = 0.05, relay: bool | None = None, loop: bool = True,
                 loop_window: int = 32):
        if codec not in wire.CODECS:
            raise errors.UnknownCodec(f"unknown codec {codec!r} (known: {', '.join(wire.CODECS)})")
        self._relay_arg = relay
        if relay is None:  # auto: direct relay where it applies (checked again at connect)
            relay = codec == "raw" and not compress
        elif relay and (codec != "raw" or compress):
            raise errors.InvalidArgument(
                f"relay=True carries raw f32 boundaries stage to stage; codec={codec!r}, "
                f"compress={compress} need relay=False")
        if endpoints is None and provider is None:
            raise errors.RouteError("a route needs endpoints or a provider")
        self.endpoints = parse_endpoints(endpoints) if endpoints is not None else []
        self.provider = provider if provider is not None else StaticPool(
            self.endpoints + parse_endpoints(list(spares)) if spares else self.endpoints)
        self.timeout = timeout
        self.step_timeout = step_timeout
        self.connect_timeout = connect_timeout
        self.codec = codec
        self.compress = compress
        self.max_retries = max_retries
        self.deadline_floor = deadline_floor
        self.deadline_factor = deadline_factor
        self.probe_timeout = probe_timeout
        self.backoff = backoff
        self._tokenizer_arg = tokenizer
        self.clients: list[ShardClient] = []
        self.stages: list[StageInfo] = []
        self.tokenizer: Any = None
        #: recent step seconds per token, per stage (sized deadlines)
        self._times: list[collections.deque] = []
        self._n_measured: dict[int, int] = {}
        self._p99: dict[int, tuple[int, float]] = {}
        self._locks: list[asyncio.Lock] = []
        self._retired: list[ShardClient] = []
        #: stage replacements done by this route: (layers, old endpoint, new endpoint)
        self.replacements: list[tuple[tuple[int, int], str, str]] = []
        # direct relay: data links by endpoint, replies awaited by (session, epoch, first_pos)
        self.relay = bool(relay)
        self.route_id = uuid.uuid4().hex
        self._links: dict[str, AsyncLink] = {}
        self._hellos: dict[str, asyncio.Future] = {}
        self._pending: dict[tuple[str, int, int], asyncio.Future] = {}
        self._link_lock: asyncio.Lock | None = None
        self._route_links: tuple | None = None  # (stages list it was built for, links, hops)
        self.loop = bool(loop)
        if loop_window < 1:
            raise errors.InvalidArgument(f"loop_window must be >= 1, got {loop_window}")
        self.loop_window = int(loop_window)
        self._rings: dict[tuple[str, int], asyncio.Queue] = {}  # decode loops being read
        self.relay_steps = 0

    # -- setup ---------------------------------------------------------------------------

    async def connect(self) -> AsyncRoute:
        """Describe every stage and check that together they form one route.

        Raises
        ------
        dgr.errors.WorkerUnavailable
            A stage cannot be reached.
        dgr.errors.ModelMismatch, dgr.errors.RouteError, dgr.errors.WorkerDraining
            See ``check_route``.
        """
        if not self.endpoints:
            self.endpoints = parse_endpoints(await self.provider.route())
        if not self.clients:
            self.clients = [ShardClient(e, timeout=self.timeout) for e in self.endpoints]
        infos = await asyncio.gather(*(c.describe() for c in self.clients))
        order = check_route(infos)
        by_ep = {c.endpoint: c for c in self.clients}
        self.stages = order
        self.clients = [by_ep[s.endpoint] for s in order]
        # one more for relayed steps (the whole route, per token)
        self._times = [collections.deque(maxlen=64) for _ in range(len(order) + 1)]
        self._n_measured: dict[int, int] = {}
        self._p99: dict[int, tuple[int, float]] = {}
        self._locks = [asyncio.Lock() for _ in order]
        if self._relay_arg is None:
            self.relay = self.relay and all(st.data_port for st in order)
            if self.relay:
                # every stage answered over gRPC just now: a data port that cannot be reached
                # (a firewall, a proxy that forwards gRPC only) means the gRPC path, not errors
                try:
                    await self.links()
                except errors.DgrError as e:
                    log.warning("direct relay unavailable (%s): steps go over gRPC", e)
                    self.relay = False
        tok = self._tokenizer_arg
        self.tokenizer = _LocalTokenizer(tok) if tok is not None else _RemoteTokenizer(self)
        return self

    async def __aenter__(self) -> AsyncRoute:
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        self._fail_pending(errors.WorkerUnavailable("the route was closed"))
        clients, self.clients = self.clients + self._retired, []
        self._retired = []
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)

    # -- direct relay over the data plane -------------------------------------------------

    async def links(self) -> list[AsyncLink]:
        """Open data links to every stage (once; reopened after a loss) and say ``Hello``.

        Raises
        ------
        dgr.errors.RouteError
            A stage serves no data plane.
        dgr.errors.WorkerUnavailable
            A data port cannot be reached (or does not answer the ``Hello``).
        """
        cached = self._route_links
        if cached is not None and not any(link.closed for link in cached[1]) and all(
                a is b for a, b in zip(cached[0], self.stages)):
            return cached[1]
        if self._link_lock is None:
            self._link_lock = asyncio.Lock()
        stages = list(self.stages)
        out = []
        for i, st in enumerate(self.stages):
            ep = st.data_endpoint
            if ep is None:
                raise errors.RouteError(
                    f"{st.endpoint} [{st.layers[0]}, {st.layers[1]}) serves no data plane "
                    "(started with --data-port -1): use relay=False")
            link = self._links.get(ep)
            if link is None or link.closed:
                async with self._link_lock:
                    link = self._links.get(ep)
                    if link is None or link.closed:
                        try:
                            link = await self._open_link(ep, i)
                        except errors.DgrError as e:
                            e.stage_index = i  # recovery replaces that stage
                            raise
            out.append(link)
        hops = [wire.Hop(endpoint=st.data_endpoint, tokens=st.needs_token_ids)
                for st in stages[1:]]
        self._route_links = (stages, out, hops)
        return out

    def hops(self) -> list[wire.Hop]:
        """``Forward.relay`` of the current route (after ``links()``)."""
        return self._route_links[2]

    def loop_hops(self) -> list[wire.Hop]:
        """``Forward.loop`` of the current route: every stage, the first included."""
        first = self._route_links[0][0]
        return [wire.Hop(endpoint=first.data_endpoint, tokens=True), *self._route_links[2]]

    async def _open_link(self, ep: str, i: int) -> AsyncLink:
        t = max(self.probe_timeout, 1.0)
        hello = self._hellos[ep] = asyncio.get_running_loop().create_future()
        link = await AsyncLink(ep, self._on_frame, self._on_lost, i).open(
            t, wire.Hello(route=self.route_id))
        try:  # the echo: this stage knows the return path before any relayed step gets there
            await asyncio.wait_for(hello, t)
        except (asyncio.TimeoutError, TimeoutError):
            link.close()
            raise errors.WorkerUnavailable(f"{ep}: no answer to the data-plane Hello within "
                                           f"{t:g} s") from None
        finally:
            self._hellos.pop(ep, None)
        self._links[ep] = link
        return link

    def _stage_of(self, link: AsyncLink) -> int | None:
        for i, st in enumerate(self.stages):
            if st.data_endpoint == link.endpoint:
                return i
        return None

    def _on_frame(self, link: AsyncLink, data: bytes) -> None:
        try:
            f = wire.decode(data)
        except errors.FrameError as e:
            self._fail_pending(e)
            return
        h = f.header
        cls = type(h)
        if cls is wire.Result:
            fut = self._pending.pop((h.session, h.epoch, h.first_pos), None)
            if fut is not None:
                if not fut.done():
                    fut.set_result(f)
            else:
                q = self._rings.get((h.session, h.epoch))
                if q is not None:
                    q.put_nowait(f)
        elif cls is wire.ErrorReply:
            i = self._stage_of(link)
            exc = _from_stage(h, self.stages[i]) if i is not None else h.to_exception()
            # "unavailable" from a stage means its next hop could not be reached; any other
            # error is the stage's own (stale epoch, draining, cache miss, ...)
            if isinstance(exc, errors.WorkerUnavailable) and not isinstance(
                    exc, errors.WorkerDraining):
                # (the last stage's next hop is the first: the decode loop)
                exc.stage_index = (i + 1) % len(self.stages) if i is not None else None
            else:
                exc.stage_index = i
            if h.session:
                self._fail_pending(exc, lambda k: k[0] == h.session and k[1] == h.epoch)
            else:
                self._fail_pending(exc)
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
        self._fail_pending(err)
        fut = self._hellos.get(link.endpoint)
        if fut is not None and not fut.done():
            fut.set_exception(err)

    def _fail_pending(self, exc: BaseException, match=None) -> None:
        for k in [k for k in self._pending if match is None or match(k)]:
            fut = self._pending.pop(k)
            if not fut.done():
                fut.set_exception(exc)
        for k, q in self._rings.items():
            if match is None or match((*k, 0)):
                q.put_nowait(exc)

    # -- failure detection and replacement --------------------------------------------------

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
        return min(self.step_timeout,
                   max(self.deadline_floor, self.deadline_factor * p99 * max(n_tokens, 1)))

    def _measured(self, i: int, n_tokens: int, seconds: float) -> None:
        if i < len(self._times):
            self._times[i].append(seconds / max(n_tokens, 1))
            self._n_measured[i] = self._n_measured.get(i, 0) + 1

    async def unresponsive_stage(self) -> int | None:
        """The first stage that does not answer a describe within ``probe_timeout`` (None:
        all answer)."""
        res = await asyncio.gather(*(c.describe(timeout=self.probe_timeout)
                                     for c in self.clients), return_exceptions=True)
        for i, x in enumerate(res):
            if isinstance(x, BaseException):
                return i
        return None

    def _measured_relay(self, n_tokens: int, seconds: float) -> None:
        """A relayed step's time bounds each stage's too: it sizes the deadlines of the
        relayed steps and of the hop-by-hop steps a recovery replays."""
        for i in range(len(self.stages) + 1):
            self._measured(i, n_tokens, seconds)

    async def replace_stage(self, i: int, failed: ShardClient, err: BaseException) -> bool:
        """Replace stage ``i`` (whose client ``failed`` failed with ``err``) by a healthy
        worker of the same range from the provider. Returns False when another session did it
        already. Raises ``NoHealthyWorker`` naming the range when none answers within
        ``connect_timeout``."""
        async with self._locks[i]:
            if self.clients[i] is not failed:
                return False
            st = self.stages[i]
            self.provider.report_failure(st.endpoint, st.layers, err)
            client, info = await self._find(st)
            self.clients[i], self.stages[i] = client, info
            self._retired.append(failed)
            self.replacements.append((tuple(st.layers), st.endpoint, info.endpoint))
            return True

    async def _find(self, st: StageInfo) -> tuple[ShardClient, StageInfo]:
        a, b = st.layers
        deadline = time.monotonic() + self.connect_timeout
        tried: dict[str, str] = {}
        attempt = 0
        while True:
            for ep in await self.provider.candidates(st.layers):
                c = ShardClient(ep, timeout=self.timeout)
                try:
                    await c.wait_ready(self.probe_timeout)
                    info = await c.describe(timeout=self.probe_timeout)
                    if info.identity != st.identity or tuple(info.layers) != tuple(st.layers):
                        raise errors.ModelMismatch(
                            f"{ep} serves {info.identity} layers {list(info.layers)}, not "
                            f"{st.identity} layers [{a}, {b})")
                    if info.draining:
                        raise errors.WorkerDraining(f"{ep} is draining")
                except errors.DgrError as e:
                    tried[ep] = f"{type(e).__name__}: {e}"
                    self.provider.report_failure(ep, st.layers, e)
                    await c.close()
                    continue
                self.provider.report_success(ep, info.layers)
                return c, info
            left = deadline - time.monotonic()
            if left <= 0:
                why = "; ".join(f"{k}: {v}" for k, v in tried.items()) or \
                    "the route provider has no worker for it"
                raise errors.NoHealthyWorker(
                    f"no healthy worker serves layers [{a}, {b}) within "
                    f"{self.connect_timeout:g} s ({why})")
            await asyncio.sleep(min(left, self.backoff * 2 ** min(attempt, 5), 1.0))
            attempt += 1

    # -- facts ---------------------------------------------------------------------------

    @property
    def identity(self) -> str:
        """Model identity plus numeric settings: what every frame of this route names."""
        return self.stages[0].identity

    @property
    def n_ubatch(self) -> int:
        return int(self.stages[0].settings["n_ubatch"])

    @property
    def eog_tokens(self) -> frozenset:
        return self.stages[-1].eog_tokens

    @property
    def settings(self) -> dict:
        return dict(self.stages[0].settings)

    async def describe(self) -> list[StageInfo]:
        """Fresh describe records of every stage, in route order."""
        return list(await asyncio.gather(*(c.describe() for c in self.clients)))

    # -- use -----------------------------------------------------------------------------

    def session(self, session_id: str | None = None) -> AsyncRouteSession:
        """A new route session (its id names it on every worker)."""
        if not self.stages:
            raise errors.RouteError("connect() the route first")
        return AsyncRouteSession(self, session_id or uuid.uuid4().hex)

    async def tokenize(self, text: str, add_special: bool = True,
                       parse_special: bool = False) -> np.ndarray:
        return await self.tokenizer.tokenize(text, add_special, parse_special)

    async def detokenize(self, tokens: Sequence[int]) -> str:
        return await self.tokenizer.detokenize(tokens)

    async def complete(self, prompt: str | Sequence[int], **kw) -> Generation:
        """Generate in a fresh session and release it; see ``AsyncRouteSession.complete``."""
        s = self.session()
        try:
            return await s.complete(prompt, **kw)
        finally:
            await s.close()


class AsyncRouteSession:
    """One route session: its streams, epoch, token history and step composition."""

    def __init__(self, route: AsyncRoute, session_id: str):
        self.route = route
        self.id = session_id
        self.epoch = 0
        #: tokens whose state every stage holds under the current epoch
        self.history: list[int] = []
        #: (first_pos, n_tokens) of each step that built ``history`` (replayed on recovery)
        self.steps: list[tuple[int, int]] = []
        #: logits rows that sampled each token (only with ``logits=True``)
        self.logits: list[np.ndarray] = []
        self.recoveries = 0
        self.stats = [StageStats(s.endpoint, s.layers) for s in route.stages]
        self._streams: list[StepStream | None] = [None] * len(route.stages)
        self._cleanup: set[asyncio.Task] = set()  # releases on replaced workers

    # -- one step through every stage -----------------------------------------------------

    async def _forward(self, toks: list[int], pos: int, want: str,
                       sampling: wire.Sampling | None) -> wire.Frame:
        r = self.route
        n = len(toks)
        x = None
        last = len(r.stages) - 1
        for i, st in enumerate(r.stages):
            is_last = i == last
            h = wire.Forward(model=st.identity, session=self.id, epoch=self.epoch,
                             first_pos=pos, n_tokens=n, layer=st.layers[0],
                             tokens=toks if (i == 0 or st.needs_token_ids) else None,
                             want=want if is_last else "boundary",
                             sampling=sampling if is_last else None)
            if x is None:
                data = wire.encode(h)
            else:
                data = wire.encode(h, x, codec=r.codec, compress=r.compress)
            stream = self._streams[i]
            if stream is not None and stream.client is not r.clients[i]:
                self._forget(i)  # the stage was replaced (by another session's recovery)
                stream = None
            if stream is None or stream.broken:
                stream = self._streams[i] = r.clients[i].stream()
                self.stats[i].endpoint = st.endpoint
            t0 = time.perf_counter()
            try:
                reply = await stream.step(data, r.deadline(i, n))
            except errors.DgrError as e:
                e.stage_index = i  # which stage failed: recovery replaces that one
                raise
            dt = time.perf_counter() - t0
            r._measured(i, n, dt)
            f = wire.decode(reply)
            rh = f.header
            stat = self.stats[i]
            stat.steps += 1
            stat.bytes_sent += len(data)
            stat.bytes_received += len(reply)
            if n == 1:
                stat.decode_steps += 1
                stat.decode_rtt_s += dt
            if type(rh) is wire.ErrorReply:
                e = _from_stage(rh, st)
                e.stage_index = i
                raise e
            if type(rh) is not wire.Result or rh.session != self.id or rh.epoch != self.epoch \
                    or rh.first_pos != pos:
                raise errors.FrameError(f"{st.endpoint} answered with an unexpected frame {rh!r}")
            if not is_last:
                if rh.kind != "boundary" or f.array is None or f.array.shape[0] != n \
                        or rh.layer != r.stages[i + 1].layers[0]:
                    raise errors.FrameError(
                        f"{st.endpoint} returned {rh.kind} [{rh.rows}, {rh.cols}] ending at "
                        f"layer {rh.layer}; the next stage needs a boundary of {n} rows "
                        f"starting at layer {r.stages[i + 1].layers[0]}")
                x = f.array
        return f

    async def _run(self, toks: list[int], want: str, sampling: wire.Sampling | None
                   ) -> wire.Frame:
        """One step at the end of ``history``; see ``_run_chunks``."""
        return await self._run_chunks([toks], want, sampling)

    async def _run_chunks(self, chunks: list[list[int]], want: str,
                          sampling: wire.Sampling | None, err: BaseException | None = None
                          ) -> wire.Frame:
        """Steps at the end of ``history`` (``want``/``sampling`` apply to the last one),
        repaired by re-prefill when a stage lost the session (on a replacement worker when
        the stage itself failed). With relay every chunk is sent at once (pipelined).
        ``err``: a failure already seen (the route is repaired first)."""
        done = 0
        for attempt in range(self.route.max_retries + 1):
            try:
                if err is not None:
                    await self._recover(err, attempt)
                if self.route.relay:
                    async for f in self._relayed(chunks[done:], want, sampling):
                        self._extend(chunks[done])
                        done += 1
                else:
                    while done < len(chunks):
                        end = done == len(chunks) - 1
                        f = await self._forward(chunks[done], len(self.history),
                                                want if end else "boundary",
                                                sampling if end else None)
                        self._extend(chunks[done])
                        done += 1
            except errors.DgrError as e:
                if not retryable(e):  # bad request, model mismatch, no healthy worker, ...
                    raise
                err = e
                continue
            return f
        assert err is not None
        raise err

    def _extend(self, toks: list[int]) -> None:
        self.steps.append((len(self.history), len(toks)))
        self.history.extend(toks)

    async def _relayed(self, chunks: list[list[int]], want: str,
                       sampling: wire.Sampling | None) -> AsyncIterator[wire.Frame]:
        """Send every chunk to the first stage at once (direct relay); yield each chunk's
        reply from the last stage, in order."""
        r = self.route
        links = await r.links()
        hops = r.hops()
        st0 = r.stages[0]
        loop = asyncio.get_running_loop()
        pos = len(self.history)
        keys = []
        total = 0
        timer = None
        t0 = time.perf_counter()
        try:
            for k, toks in enumerate(chunks):
                end = k == len(chunks) - 1
                h = wire.Forward(model=st0.identity, session=self.id, epoch=self.epoch,
                                 first_pos=pos, n_tokens=len(toks), layer=st0.layers[0],
                                 tokens=toks, want=want if end else "boundary",
                                 sampling=sampling if end else None, relay=hops,
                                 reply_to=r.route_id)
                key = (self.id, self.epoch, pos)
                fut = r._pending[key] = loop.create_future()
                keys.append((key, len(toks), fut))
                links[0].send(wire.encode(h))
                pos += len(toks)
                total += len(toks)
            # one timer for the whole batch (cheaper than asyncio.wait_for per step)
            timer = loop.call_later(r.deadline(len(r.stages), total), _expire, keys)
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
                    r._measured_relay(n, time.perf_counter() - t0)
                r.relay_steps += 1
                yield f
            if len(keys) > 1:
                r._measured_relay(total, time.perf_counter() - t0)
        finally:
            if timer is not None:
                timer.cancel()
            for key, _, fut in keys:
                if r._pending.get(key) is fut:
                    del r._pending[key]
                if not fut.done():
                    fut.cancel()
                elif not fut.cancelled():
                    fut.exception()  # retrieved: a later chunk's error is not "unhandled"

    def _forget(self, i: int) -> None:
        """Drop stage ``i``'s stream and free this session on its worker (in the background;
        a worker that cannot be reached frees it by TTL). Not when stage ``i``'s replacement
        is the same worker (it came back, or was only slow): a late Release there would drop
        the session this route is rebuilding on it, and the new epoch supersedes the old
        state anyway."""
        s, self._streams[i] = self._streams[i], None
        if s is None:
            return
        coros = [s.close()]
        if s.client.endpoint != self.route.clients[i].endpoint:
            coros.append(_release_quietly(s.client, self.id, self.route.probe_timeout))
        for coro in coros:
            t = asyncio.ensure_future(coro)
            self._cleanup.add(t)
            t.add_done_callback(self._cleanup.discard)

    async def _recover(self, err: BaseException, attempt: int = 1) -> None:
        """Replace the failed stage if it failed (deadline, unavailable), raise the epoch and
        replay the history."""
        r = self.route
        i = getattr(err, "stage_index", None)
        if isinstance(err, errors.ResourceExhausted):
            await asyncio.sleep(min(max(err.retry_after or 0.1, 0.01), 5.0))
        elif type(err) is errors.SessionError:
            await asyncio.sleep(0.05)
        elif attempt > 1:
            await asyncio.sleep(min(r.backoff * 2 ** (attempt - 2), 2.0))
        if i is None and r.relay and isinstance(err, _STAGE_FAILED):
            i = await r.unresponsive_stage()  # a relayed step does not say where it stuck
        if i is not None and isinstance(err, _STAGE_FAILED):
            s = self._streams[i]
            failed = s.client if s is not None else r.clients[i]
            await r.replace_stage(i, failed, err)
            self._forget(i)
        elif i is not None and isinstance(err, errors.StaleEpoch):
            # the worker holds a newer epoch of this session id: free it, start over there
            await _release_quietly(r.clients[i], self.id, r.probe_timeout)
        self.recoveries += 1
        self.epoch += 1
        hist, steps = self.history, self.steps
        for p, n in steps:  # the same chunks as the first time: bit-identical caches
            await self._forward(hist[p:p + n], p, "boundary", None)

    # -- public --------------------------------------------------------------------------

    async def reset(self) -> None:
        """Start over: the next step begins a new epoch at position 0."""
        self.epoch += 1
        self.history, self.steps, self.logits = [], [], []

    async def prefill(self, tokens: Sequence[int], *, sample: bool = True,
                      sampling: SamplingParams | None = None, logits: bool = False
                      ) -> int | None:
        """Append ``tokens`` in chunks of at most ``n_ubatch``; returns the next token sampled
        from the last row (None with ``sample=False``)."""
        toks = [int(t) for t in np.asarray(tokens, dtype=np.int64).reshape(-1)]
        if not toks:
            raise errors.InvalidArgument("prefill needs at least one token")
        if self.epoch == 0:
            self.epoch = 1
        ub = self.route.n_ubatch
        want = ("token+logits" if logits else "token") if sample else (
            "logits" if logits else "boundary")
        ws = _wire_sampling(sampling)
        chunks = [toks[a:a + ub] for a in range(0, len(toks), ub)]
        f = await self._run_chunks(chunks, want, ws)
        return self._take(f, logits) if sample else None

    def _take(self, f: wire.Frame, logits: bool) -> int:
        if logits:
            self.logits.append(np.array(f.array[-1]))
        return int(f.header.tokens[-1])

    async def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 64,
                       sampling: SamplingParams | None = None, stop: Sequence[str] = (),
                       stop_on_eog: bool = True, logits: bool = False,
                       add_special: bool = True, parse_special: bool = True
                       ) -> AsyncIterator[int]:
        """Prefill ``prompt`` (from position 0, new epoch) and yield sampled tokens.

        Stops after ``max_tokens``, at an end-of-generation token (not yielded) or once the
        text contains one of ``stop`` (the token completing it is yielded). ``logits=True``
        (parity mode) also keeps, in ``self.logits``, the last-row logits that sampled each
        token, computed exactly as a whole-model ``Engine.forward(..., logits="last")``.

        Raises
        ------
        dgr.errors.DgrError
            A failure recovery could not repair (``WorkerDraining``, ``StaleEpoch``,
            ``ModelMismatch``, ``WorkerUnavailable`` after ``connect_timeout``, ...).
        """
        r = self.route
        if isinstance(prompt, str):
            prompt = await r.tokenize(prompt, add_special, parse_special)
        prompt = [int(t) for t in np.asarray(prompt).reshape(-1)]
        if not prompt:
            raise errors.InvalidArgument("the prompt has no tokens")
        if max_tokens < 1:
            return
        await self.reset()
        self.stop_reason = "length"
        want = "token+logits" if logits else "token"
        ws = _wire_sampling(sampling)
        eog = r.eog_tokens if stop_on_eog else frozenset()
        stops = [s for s in stop if s]
        out: list[int] = []
        tok = await self.prefill(prompt, sampling=sampling, logits=logits)
        tokens = None  # the tokens after the prefill's, made on demand
        try:
            while True:
                if tok in eog:
                    self.stop_reason = "eos"
                    return
                out.append(tok)
                yield tok
                if stops:
                    text = await r.detokenize(out)
                    if any(s in text for s in stops):
                        self.stop_reason = "stop"
                        return
                if len(out) == max_tokens:
                    return
                if tokens is None:
                    tokens = self._decode(tok, max_tokens - len(out), want, ws, eog, logits)
                tok = await anext(tokens)
        finally:
            if tokens is not None:
                await tokens.aclose()

    async def _decode(self, tok: int, n: int, want: str, sampling: wire.Sampling | None,
                      eog: frozenset, logits: bool) -> AsyncIterator[int]:
        """The ``n`` tokens after ``tok`` (which is fed first): from the stages' decode loop
        when the route has one, then (after a failure, or without a loop) one step each."""
        r = self.route
        made = 0
        broken: BaseException | None = None
        if r.relay and r.loop:
            ring = self._ring(tok, n, want, sampling, eog, logits)
            try:
                async for tok in ring:
                    made += 1
                    yield tok
            except errors.DgrError as e:
                if not retryable(e):
                    raise
                # ``tok`` (the last token yielded) is not in ``history`` yet: repair the
                # route (first thing in _run_chunks), then feed it step by step
                broken = e
            finally:
                await ring.aclose()
        while made < n:
            f = await self._run_chunks([[tok]], want, sampling, broken)
            broken = None
            tok = self._take(f, logits)
            made += 1
            yield tok

    async def _ring(self, tok: int, steps: int, want: str, sampling: wire.Sampling | None,
                    eog: frozenset, logits: bool) -> AsyncIterator[int]:
        """Feed ``tok`` with ``Forward.steps``: the last stage samples and feeds each next
        token to the first stage itself; yield the sampled tokens as they arrive.

        The stages loop ``loop_window`` tokens at a time: the next window starts (from the
        window's last token, sent to the first stage) only when the reader asks for its
        first token, so the stages never run more than a window ahead of the reader."""
        r = self.route
        links = await r.links()
        key = (self.id, self.epoch)
        q: asyncio.Queue = asyncio.Queue()
        r._rings[key] = q
        pos = len(self.history)
        st0 = r.stages[0]
        left = steps
        n_ctx = int(r.settings.get("n_ctx") or 0)
        try:
            while left > 0:
                # a window never loops past the context: the first stage's refusal of the
                # step after the last one that fits (ContextFull) would race that step's
                # token, which comes from the last stage, and could reach us first; a step
                # at or past n_ctx is sent alone and refused with nothing else in flight
                window = min(left, r.loop_window, max(n_ctx - pos, 1) if n_ctx else left)
                h = wire.Forward(model=st0.identity, session=self.id, epoch=self.epoch,
                                 first_pos=pos, n_tokens=1, layer=st0.layers[0], tokens=[tok],
                                 want=want, sampling=sampling, relay=r.hops(),
                                 reply_to=r.route_id, loop=r.loop_hops(), steps=window,
                                 stop_tokens=sorted(eog) if eog else None)
                links[0].send(wire.encode(h))
                fed = tok
                for _ in range(window):
                    t0 = time.perf_counter()
                    try:
                        async with _timeout(r.deadline(len(r.stages), 1)):
                            item = await q.get()
                    except TimeoutError:
                        raise errors.StepDeadlineExceeded(
                            f"decode loop at position {pos}: no token from the route within "
                            "its deadline") from None
                    if isinstance(item, BaseException):
                        raise item
                    rh = item.header
                    if rh.first_pos != pos or not rh.tokens:
                        # the loop and this session's history disagree: re-prefill, go on
                        raise errors.CacheMiss(
                            f"decode loop: expected the token after position {pos}, got a "
                            f"reply for position {rh.first_pos} with tokens {rh.tokens}")
                    r._measured_relay(1, time.perf_counter() - t0)
                    r.relay_steps += 1
                    self._extend([fed])
                    pos += 1
                    fed = self._take(item, logits)
                    left -= 1
                    yield fed
                tok = fed
        finally:
            if r._rings.get(key) is q:
                del r._rings[key]

    async def complete(self, prompt: str | Sequence[int], *, max_tokens: int = 64,
                       sampling: SamplingParams | None = None, stop: Sequence[str] = (),
                       stop_on_eog: bool = True, logits: bool = False,
                       add_special: bool = True, parse_special: bool = True) -> Generation:
        """Run ``generate`` to the end and return tokens, text and timings."""
        r = self.route
        if isinstance(prompt, str):
            prompt = await r.tokenize(prompt, add_special, parse_special)
        n_prompt = len(prompt)
        t0 = time.perf_counter()
        t_first = None
        toks: list[int] = []
        rec0 = self.recoveries
        async for t in self.generate(prompt, max_tokens=max_tokens, sampling=sampling,
                                     stop=stop, stop_on_eog=stop_on_eog, logits=logits):
            if t_first is None:
                t_first = time.perf_counter()
            toks.append(t)
        t1 = time.perf_counter()
        text = await r.detokenize(toks) if toks else ""
        if self.stop_reason == "stop":
            cut = min((text.find(s) for s in stop if s and s in text), default=-1)
            if cut >= 0:
                text = text[:cut]
        return Generation(tokens=toks, text=text, stop_reason=self.stop_reason,
                          prompt_tokens=n_prompt, time_to_first_token_s=(t_first or t1) - t0,
                          decode_s=t1 - (t_first or t1), recoveries=self.recoveries - rec0,
                          logits=list(self.logits) if logits else None)

    async def release(self) -> None:
        """Free this session's slot on every stage now (ignores stages that are gone)."""
        await asyncio.gather(*(c.release(self.id) for c in self.route.clients),
                             return_exceptions=True)

    async def close(self) -> None:
        """Release the session and close its streams."""
        streams, self._streams = self._streams, [None] * len(self._streams)
        await asyncio.gather(*(s.close() for s in streams if s is not None),
                             return_exceptions=True)
        await self.release()


# --- the blocking API -----------------------------------------------------------------------


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

    ``Route(endpoints)`` connects: it describes every stage and checks the route. Parameters
    are those of ``AsyncRoute``. Use it as a context manager, or ``close()`` it.

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
    def stop_reason(self) -> str:
        return getattr(self.inner, "stop_reason", "")

    def generate(self, prompt: str | Sequence[int], **kw) -> Iterator[int]:
        """Yield sampled tokens; arguments as ``AsyncRouteSession.generate``."""
        return self.route._loop.iterate(self.inner.generate(prompt, **kw))

    def complete(self, prompt: str | Sequence[int], **kw) -> Generation:
        return self.route._loop.run(self.inner.complete(prompt, **kw))

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
