"""The stage: a worker serving one layer range of a GGUF model (gRPC ``Step`` and data plane)."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import numpy as np

from dgr import __version__, errors
from dgr.protocol import wire
from dgr.protocol.sampling import sample_rows
from dgr.protocol.settings import settings_tag, stage_identity
from dgr.transport.common import MAX_MESSAGE
from dgr.transport.server import ShardServer
from dgr.worker.sessions import Lease, SessionTable

__all__ = ["Worker"]

log = logging.getLogger("dgr.worker")


class _Window:
    """Tokens and compute time of recent steps (throughput over the last ``span`` seconds),
    and exact totals since the worker started.

    The totals are monotonic counters: a caller describes the worker before and after the
    steps it timed and divides the deltas (``decode_s`` / ``decode_steps``: the mean compute
    of exactly those single-token steps), where ``decode_ms`` (an EWMA of the last few)
    covers another window. Compute seconds are the engine's forward call (sampling and
    transport excluded)."""

    def __init__(self, span: float = 10.0):
        self.span = span
        self.items: collections.deque = collections.deque()
        self.decode_ms = 0.0  # EWMA of single-token step compute time
        self.started = time.monotonic()
        self.decode_steps = 0  # single-token steps computed
        self.decode_s = 0.0  # their compute seconds, summed
        self.tokens = 0  # tokens computed, every step
        self.compute_s = 0.0  # compute seconds of every step, summed

    def add(self, n: int, seconds: float) -> None:
        now = time.monotonic()
        self.items.append((now, n, seconds))
        self.tokens += n
        self.compute_s += seconds
        if n == 1:
            self.decode_steps += 1
            self.decode_s += seconds
            self.decode_ms = seconds * 1e3 if not self.decode_ms else (
                0.8 * self.decode_ms + 0.2 * seconds * 1e3)
        while self.items and now - self.items[0][0] > self.span:
            self.items.popleft()

    def tokens_per_s(self) -> float:
        """Tokens computed per second of wall time over the last ``span`` seconds (load)."""
        now = time.monotonic()
        while self.items and now - self.items[0][0] > self.span:
            self.items.popleft()
        span = min(self.span, max(now - self.started, 1e-3))
        return sum(n for _, n, _ in self.items) / span


class _DeferredRelease:
    """The session table's view of the engine: a released slot is queued and dropped from the
    engine by the next compute, before it runs (so a slot handed to a new session is always
    empty when that session's first step runs, and table calls never wait for compute)."""

    def __init__(self, worker: Worker):
        self.w = worker

    def release(self, slot: int) -> None:
        self.w._releases.append(slot)  # the caller holds the table lock


class Worker:
    """The stage backend of one worker: validates frames, keeps sessions, runs the engine.

    Parameters
    ----------
    engine : dgr.Engine
        The loaded range.
    ttl, evict_after : float
        Session idle expiry and minimum idle time before LRU eviction (seconds).
    inline : bool
        Compute on the event loop thread instead of the engine's compute thread (saves a
        thread handoff per step; health and describe then wait for the running step).
    inline_below_ms : float
        Compute a single-token step on the event loop thread when recent single-token steps
        took less than this (ms) and the compute thread is idle; everything else runs on the
        compute thread. 0 (default): never. Bounds how long the loop can be blocked while
        saving the handoff where a step is short (decode of a small range).
    name : str
        Label for log lines (the listen address once known).
    """

    def __init__(self, engine, *, ttl: float = 600.0, evict_after: float = 5.0,
                 inline: bool = False, name: str = "", max_message: int = MAX_MESSAGE,
                 cert_store: str | None = None, inline_below_ms: float = 0.0):
        import threading

        self.engine = engine
        self.inline_below_ms = float(inline_below_ms)
        # work submitted to the compute thread and not finished: inline compute is allowed
        # only at 0, so the engine is never used by two threads and releases keep their order
        self._pending = 0
        self._pending_lock = threading.Lock()
        self.inline_steps = 0
        self.cert_store = cert_store  # certified lanes advertised in the capability record
        self.inline = inline
        self.name = name
        self.max_payload = max_message
        info = engine.describe()
        self.info = info
        self.settings = dict(engine.settings)
        self.model_identity = info["identity"]
        self.identity = stage_identity(self.model_identity, self.settings)
        self.layers = tuple(engine.layers)
        self.n_layer = info["n_layer"]
        self.is_first, self.is_last = bool(engine.is_first), bool(engine.is_last)
        self.width = int(engine.n_embd_boundary)
        #: columns of what the engine returns: the boundary, or logits on the last stage
        self.out_width = self.width if not engine.is_last else int(engine.n_vocab)
        self.eog_tokens = [t for t in range(engine.n_vocab) if engine.is_eog(t)]
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="dgr-compute")
        #: guards the session table (short sections only: the event loop takes it)
        self.lock = threading.RLock()
        #: held while the engine computes (compute thread or data-plane threads)
        self.engine_lock = threading.Lock()
        self._releases: list[int] = []  # slots released by the table, not yet by the engine
        self._counts = threading.Lock()  # counters bumped by the loop and data threads
        self.table = SessionTable(_DeferredRelease(self), engine.n_slots, self.settings["n_ctx"],
                                  ttl=ttl, evict_after=evict_after, listener=self._event)
        self.draining = False
        #: set when a drain stops waiting: admitted steps that have not started computing
        #: are refused from then on (counted in ``not_run``)
        self.stopped = False
        self.not_run = 0
        self.inflight = 0
        self.steps_total = 0
        self.errors_total = 0
        self.streams_open = 0
        self.window = _Window()
        self.started = time.monotonic()
        # capability record (dgr.capability): hop latency of 1-token steps, health
        self.hop_ms: collections.deque = collections.deque(maxlen=1024)
        self.computing = 0
        self.engine_restarts = 0
        self.last_error, self.last_error_at = "", None
        # fast data plane (dgr.transport.dataplane): set by serve_data()
        self.data_server = None
        self.links = None
        self._returns: dict[str, Any] = {}  # route id -> the driver's return connection
        self._tls = threading.local()  # per data-connection-thread reusable buffers
        #: optional span log (``--trace``): one JSON line per data-plane step, times from
        #: time.perf_counter() (CLOCK_MONOTONIC on Linux: comparable across processes)
        self.trace = None
        #: the data port named in Describe when it differs from the bound one (a proxy or
        #: port forward in front of it)
        self.advertise_data_port = 0

    # -- logging -------------------------------------------------------------------------

    def _event(self, event: str, session: str, epoch: int, slot: int, detail: str) -> None:
        log.info("%s session=%s epoch=%d slot=%d%s", event, session, epoch, slot,
                 f" ({detail})" if detail else "")

    # -- control plane -------------------------------------------------------------------

    def compute_counters(self) -> dict[str, float]:
        """The compute totals since start (``_Window``), read together: single-token steps
        and their compute seconds, tokens and compute seconds of every step."""
        w = self.window
        with self._counts:
            return dict(decode_steps_total=w.decode_steps, decode_compute_s_total=w.decode_s,
                        tokens_computed_total=w.tokens, compute_s_total=w.compute_s)

    def describe(self) -> dict[str, Any]:
        s = self.settings
        with self.lock:  # the table's writers hold it, data-plane threads included
            free_slots, sessions = self.table.free_slots, len(self.table)
            free_context = self.table.free_context
        return dict(
            model_identity=self.model_identity,
            model_name=os.path.basename(self.info["model"]),
            arch=self.info["arch"], n_layer=self.n_layer,
            layer_start=self.layers[0], layer_end=self.layers[1],
            is_first=self.is_first, is_last=self.is_last,
            needs_token_ids=bool(self.engine.needs_token_ids),
            boundary_width=self.width, boundary_dtype="f32", n_vocab=int(self.engine.n_vocab),
            settings=dict(n_ctx=s["n_ctx"], n_slots=s["n_slots"], n_threads=s["n_threads"],
                          n_ubatch=s["n_ubatch"], flash_attn=bool(s["flash_attn"]),
                          type_k=s["type_k"], type_v=s["type_v"]),
            eog_tokens=self.eog_tokens, add_bos=bool(self.info["add_bos"]),
            free_slots=free_slots, sessions=sessions,
            free_context=max(free_context, 0), queue_depth=self.inflight,
            recent_tokens_per_s=self.window.tokens_per_s(),
            recent_step_ms=self.window.decode_ms, draining=self.draining,
            dgr_version=__version__, wire_format_version=wire.FORMAT_VERSION,
            wire_schema_version=wire.SCHEMA_VERSION,
            weight_bytes=int(self.info["weight_bytes"]), kv_bytes=int(self.info["kv_bytes"]),
            steps_total=self.steps_total, errors_total=self.errors_total,
            uptime_s=time.monotonic() - self.started,
            capability_json=self.capability_json(),
            data_port=(self.advertise_data_port or self.data_server.port)
            if self.data_server is not None else 0,
            **self.compute_counters(),
        )

    def capability(self):
        """The capability record (``dgr.capability.Capability``) with live figures."""
        from dgr.control.capability import record_for

        return record_for(self.engine, worker=self, cert_store=self.cert_store)

    def capability_json(self) -> bytes:
        from dgr.protocol.capability import encode

        try:
            return encode(self.capability())
        except Exception:  # noqa: BLE001 - describe must answer even when the record cannot
            log.exception("capability record failed")
            return b""

    def release(self, session: str) -> bool:
        with self.lock:
            return self.table.release(session)

    def tokenize(self, text: str, add_special: bool, parse_special: bool):
        return self.engine.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens, remove_special: bool, unparse_special: bool) -> str:
        return self.engine.detokenize(tokens, remove_special, unparse_special)

    # -- data plane ----------------------------------------------------------------------

    def _error(self, exc: BaseException, session: str = "", epoch: int = 0) -> bytes:
        with self._counts:
            self.errors_total += 1
        self.last_error, self.last_error_at = f"{type(exc).__name__}: {exc}", time.monotonic()
        if isinstance(exc, (errors.SessionError, errors.ModelMismatch, errors.RouteError)):
            log.info("refused session=%s epoch=%d: %s: %s", session or "-", epoch,
                     type(exc).__name__, exc)
        elif not isinstance(exc, errors.DgrError):
            log.exception("step failed", exc_info=exc)
        return wire.encode(wire.ErrorReply.from_exception(exc, session=session, epoch=epoch))

    def _check(self, h, array) -> None:
        if type(h) is not wire.Forward:
            raise errors.FrameError(f"a step takes Forward frames, got {type(h).__name__}")
        if h.model != self.identity:
            theirs, _, their_tag = h.model.partition("+")
            if theirs == self.model_identity:
                raise errors.ModelMismatch(
                    f"frame was built for numeric settings {their_tag or '(none)'}; this worker "
                    f"runs {settings_tag(self.settings)}")
            raise errors.ModelMismatch(
                f"frame is for model {theirs or '(none)'}; this worker serves "
                f"{self.model_identity} layers [{self.layers[0]}, {self.layers[1]})")
        if h.layer != self.layers[0]:
            raise errors.RouteError(
                f"frame starts at layer {h.layer}; this worker serves layers "
                f"[{self.layers[0]}, {self.layers[1]})")
        if self.is_first:
            if array is not None:
                raise errors.InvalidBoundary(
                    "this worker is the first stage: it takes token ids, not a boundary")
        else:
            if array is None:
                raise errors.InvalidBoundary(
                    f"this stage starts at layer {self.layers[0]}: the frame needs a boundary "
                    f"[{h.n_tokens}, {self.width}]")
            if array.shape[1] != self.width:
                raise errors.InvalidBoundary(
                    f"boundary width {array.shape[1]} differs from this stage's {self.width}")
            if self.engine.needs_token_ids and h.tokens is None:
                raise errors.MissingTokenIds(
                    f"layers [{self.layers[0]}, {self.layers[1]}) route by token id: send the "
                    "token ids with the boundary")
        if h.reply_to:  # relayed: want/sampling are the last stage's, carried along
            if not self.is_last and not h.relay:
                raise errors.RouteError(
                    f"relayed frame ends its route at layer {self.layers[1]} of {self.n_layer}:"
                    " Forward.relay names no next stage")
            if self.is_last and h.relay:
                raise errors.RouteError(
                    f"this worker runs the last layers; Forward.relay names {len(h.relay)} more "
                    "stage(s)")
        elif not self.is_last and h.want != "boundary":
            raise errors.InvalidArgument(
                f"want={h.want!r} asks for the last stage's output; this stage ends at layer "
                f"{self.layers[1]} of {self.n_layer} and returns a boundary")

    async def step(self, data: bytes) -> bytes:
        """One gRPC ``Step`` frame: compute off the event loop, reply with a frame."""
        t_arrive = time.perf_counter()
        try:
            frame = wire.decode(data, max_payload=self.max_payload)
        except errors.FrameError as e:
            return self._error(e)
        h = frame.header
        session, epoch = getattr(h, "session", ""), getattr(h, "epoch", 0)
        if self.draining:
            return self._error(errors.WorkerDraining(
                "this worker is draining (shutting down): the step was not run"), session, epoch)
        try:
            if getattr(h, "reply_to", ""):
                raise errors.InvalidArgument("relayed frames (reply_to) travel on the data "
                                             "plane, not on a gRPC Step stream")
            self._check(h, frame.array)
            with self.lock:
                lease = self.table.acquire(h.session, h.epoch, h.first_pos, h.n_tokens)
        except Exception as e:  # noqa: BLE001 - every refusal is an ErrorReply
            return self._error(e, session, epoch)
        self._busy(1)
        try:
            if self.inline or (h.n_tokens == 1 and self.inline_below_ms > 0
                               and 0 < self.window.decode_ms < self.inline_below_ms
                               and not self._pending):
                self.inline_steps += 1
                out = self._counted_compute(lease, h, frame.array)
            else:
                out = await asyncio.wrap_future(
                    self._submit(self._counted_compute, lease, h, frame.array))
        except BaseException as e:
            with self.lock:
                self.table.abort(lease, f"{type(e).__name__}: {e}")
            if not isinstance(e, Exception):
                raise
            return self._error(e, session, epoch)
        finally:
            self._busy(-1)
        with self.lock:
            self.table.commit(lease)
        self._account(h.n_tokens, out[3], t_arrive)
        return self._reply(h, frame.array, *out[:3])

    def _account(self, n_tokens: int, seconds: float, t_arrive: float) -> None:
        with self._counts:
            self.steps_total += 1
            self.window.add(n_tokens, seconds)
            if n_tokens == 1:
                self.hop_ms.append((time.perf_counter() - t_arrive) * 1e3)

    def _busy(self, delta: int) -> None:
        with self._counts:
            self.inflight += delta

    def _submit(self, fn, *args):
        """Run ``fn`` on the compute thread (FIFO), counted in ``_pending`` until it ends."""
        with self._pending_lock:
            self._pending += 1
        fut = self.executor.submit(fn, *args)
        fut.add_done_callback(self._finished)
        return fut

    def _finished(self, fut) -> None:
        with self._pending_lock:
            self._pending -= 1
        if fut.cancelled():  # its stream was cancelled (a drain) before it started
            with self._counts:
                self.not_run += 1

    def _counted_compute(self, lease: Lease, h: wire.Forward, array, out=None):
        with self.engine_lock:
            if self.stopped:  # the drain is over: the process exits, the engine with it
                with self._counts:
                    self.not_run += 1
                raise errors.WorkerDraining(
                    "this worker stopped draining (drain timeout): the step was not run")
            with self.lock:
                releases, self._releases = self._releases, []
                holds = self.table.holds(lease)
            for slot in releases:
                self.engine.release(slot)
            if not holds:  # released while it waited: its slot may be another session's now
                raise errors.CacheMiss(
                    f"session {lease.session!r} epoch {lease.epoch} was released while this "
                    "step waited for the engine; the step was not run: re-prefill")
            self.computing += 1  # computes are serialized by the engine lock: 0 or 1
            try:
                return self._compute(lease, h, array, out)
            finally:
                self.computing -= 1

    def _compute(self, lease: Lease, h: wire.Forward, array, out=None):
        """Run one step on the engine (lock held): (kind, array, tokens, compute seconds).

        ``kind`` is ``"boundary"`` (not the last stage), ``"logits"`` or ``"none"``;
        ``out`` is an optional reusable output buffer for the boundary.
        """
        eng = self.engine
        n = h.n_tokens
        tokens = None
        if h.tokens is not None and (self.is_first or eng.needs_token_ids):
            tokens = np.asarray(h.tokens, dtype=np.int32)
        positions = (np.asarray(h.positions, dtype=np.int32) if h.positions is not None
                     else h.first_pos)
        t0 = time.perf_counter()
        if not self.is_last:
            if out is None:
                res = eng.forward(lease.slot, positions, tokens, boundary=array)
            else:
                res = eng.forward(lease.slot, positions, tokens, boundary=array, out=out)
            return "boundary", res, None, time.perf_counter() - t0
        want = h.want
        if want == "boundary":  # the last stage has no boundary: run, return nothing
            rows: list[int] = []
            mask: Any = np.zeros(n, dtype=bool)
        elif h.rows is None:
            rows, mask = [n - 1], "last"
        else:
            rows = sorted(set(h.rows))
            mask = np.zeros(n, dtype=bool)
            mask[rows] = True
        if out is None:
            logits = eng.forward(lease.slot, positions, tokens, boundary=array, logits=mask)
        else:  # a reused [rows, n_vocab] buffer (data plane: its thread's own)
            logits = eng.forward(lease.slot, positions, tokens, boundary=array, logits=mask,
                                 out=out)
        dt = time.perf_counter() - t0
        toks = None
        if want.startswith("token"):
            first = h.first_pos
            pos = [(h.positions[r] if h.positions is not None else first + r) + 1 for r in rows]
            toks = sample_rows(logits, pos, h.sampling)
        if want in ("logits", "token+logits"):
            return "logits", logits, toks, dt
        return "none", None, toks, dt

    def _reply(self, h: wire.Forward, array, kind: str, res, toks) -> bytes:
        """The reply frame of a hop-by-hop step."""
        if kind == "boundary":
            r = wire.Result(session=h.session, epoch=h.epoch, first_pos=h.first_pos,
                            n_tokens=h.n_tokens, kind="boundary", layer=self.layers[1])
            codec = h.codec if array is not None else "raw"
            return wire.encode(r, res, codec=codec, compress=h.compression == "zstd")
        r = wire.Result(session=h.session, epoch=h.epoch, first_pos=h.first_pos,
                        n_tokens=h.n_tokens, kind=kind, tokens=toks)
        return wire.encode(r, None if res is None else np.ascontiguousarray(res))

    # -- fast data plane (dgr.transport.dataplane, docs/dataplane.md) ----------------------

    def serve_data(self, host: str, port: int = 0, max_connections: int = 256) -> int:
        """Start the TCP data plane on ``host:port``; returns the bound port."""
        from dgr.transport.dataplane import DataServer, Links

        self.links = Links()
        self.data_server = DataServer(self._data_connection, host, port,
                                      max_connections).start()
        return self.data_server.port

    def stop_data(self) -> None:
        if self.data_server is not None:
            self.data_server.stop()
        if self.links is not None:
            self.links.close()
        if self.trace is not None:
            self.trace.flush()

    def _data_connection(self, conn) -> None:
        """One data-plane connection (its own thread): frames in order until EOF."""
        tls = self._tls
        tls.out = None  # reusable boundary buffer of this thread
        tls.buf = bytearray()  # reusable encode buffer of this thread
        try:
            while True:
                try:
                    view = conn.recv()
                except errors.FrameError as e:  # an unframeable stream: answer, hang up
                    conn.send(self._error(e))
                    return
                if view is None:
                    return
                self._data_frame(conn, view)
        finally:
            if conn.route:
                with self.lock:
                    if self._returns.get(conn.route) is conn:
                        del self._returns[conn.route]

    def _send_back(self, conn, reply_to: str, frame) -> None:
        """Send a reply: to the route's return connection when relayed, else to ``conn``."""
        # a relayed reply goes to the route's return connection; without one (no Hello) to
        # the sender (a driver reads it there; a previous stage's link drops it)
        target = self._returns.get(reply_to, conn) if reply_to else conn
        try:
            target.send(frame)
        except OSError as e:
            log.info("return connection of route %s broke: %s", reply_to or conn.name, e)

    def _data_frame(self, conn, view) -> None:
        t_arrive = time.perf_counter()
        try:
            frame = wire.decode(view, max_payload=self.max_payload)
        except errors.FrameError as e:
            self._send_back(conn, "", self._error(e))
            return
        h = frame.header
        if type(h) is wire.Hello:  # a driver's return connection: register, then echo
            conn.route = h.route
            with self.lock:
                self._returns[h.route] = conn
            self._send_back(conn, "", wire.encode(wire.Hello(route=h.route)))
            return
        session, epoch = getattr(h, "session", ""), getattr(h, "epoch", 0)
        reply_to = getattr(h, "reply_to", "")
        array = frame.array
        tls = self._tls
        try:
            self._check(h, array)
            if reply_to and self.is_last and reply_to not in self._returns:
                raise errors.RouteError(f"relayed frame names route {reply_to!r}, which sent "
                                        "this worker no Hello (no return connection)")
            if self.draining:
                raise errors.WorkerDraining(
                    "this worker is draining (shutting down): the step was not run")
            with self.lock:
                lease = self.table.acquire(h.session, h.epoch, h.first_pos, h.n_tokens)
            self._busy(1)
            try:
                # reused output buffers: the boundary, or the last stage's logits rows
                out = tls.out
                need = h.n_tokens if not self.is_last else (
                    1 if h.rows is None else len(set(h.rows)))
                if out is None or out.shape[0] < need:
                    out = tls.out = np.empty((max(need, 1), self.out_width), np.float32)
                kind, res, toks, seconds = self._counted_compute(lease, h, array, out)
            except BaseException as e:
                with self.lock:
                    self.table.abort(lease, f"{type(e).__name__}: {e}")
                raise
            finally:
                self._busy(-1)
            with self.lock:
                self.table.commit(lease)
            self._account(h.n_tokens, seconds, t_arrive)
            t_done = time.perf_counter()
        except Exception as e:  # noqa: BLE001 - every refusal is an ErrorReply
            self._send_back(conn, reply_to, self._error(e, session, epoch))
            return
        # the engine is free again: encode and send outside the lock (buffers are this
        # thread's own)
        try:
            if not reply_to:
                self._send_back(conn, "", self._reply(h, array, kind, res, toks))
            elif not self.is_last:
                self._relay(h, array, res)
            else:
                loop = h.steps > 1 and toks and (h.stop_tokens is None
                                                 or toks[-1] not in h.stop_tokens)
                # the loop step first, so stage 1 starts at once; but when this worker is
                # stage 1 too, the next step runs here on another thread and its reply must
                # not overtake this one: reply first then
                if loop and not self.is_first:
                    self._loop(h, toks[-1])
                r = wire.Result(session=h.session, epoch=h.epoch, first_pos=h.first_pos,
                                n_tokens=h.n_tokens, kind=kind, tokens=toks)
                buf = tls.buf
                wire.encode_into(r, None if res is None else np.ascontiguousarray(res), buf)
                self._send_back(conn, reply_to, buf)
                if loop and self.is_first:
                    self._loop(h, toks[-1])
        except Exception as e:  # noqa: BLE001 - e.g. the next stage is unreachable
            self._send_back(conn, reply_to, self._error(e, session, epoch))
        if self.trace is not None:
            self._trace(h, t_arrive, seconds, t_done)

    def _trace(self, h, t_arrive: float, seconds: float, t_done: float) -> None:
        import json

        span = {"stage": list(self.layers), "session": h.session, "epoch": h.epoch,
                "pos": h.first_pos, "n": h.n_tokens, "arrive": t_arrive,
                "compute_end": t_done, "compute_s": seconds, "sent": time.perf_counter()}
        with self._counts:
            self.trace.write(json.dumps(span) + "\n")

    def _loop(self, h: wire.Forward, token: int) -> None:
        """Decode loop (``Forward.steps``): feed the token just sampled to the first stage
        (``loop[0]``) as the next step, without a round trip to the driver."""
        first = h.loop[0]
        nh = wire.Forward(model=h.model, session=h.session, epoch=h.epoch,
                          first_pos=h.first_pos + h.n_tokens, n_tokens=1, layer=0,
                          tokens=[token], want=h.want, sampling=h.sampling, relay=h.loop[1:],
                          reply_to=h.reply_to, loop=h.loop, steps=h.steps - 1,
                          stop_tokens=h.stop_tokens)
        self.links.send(first.endpoint, wire.encode(nh))

    def _relay(self, h: wire.Forward, array, res) -> None:
        """Forward this stage's boundary to the next stage named by ``h.relay``."""
        nxt = h.relay[0]
        # the same step for the next range: every other field (positions, want, rows,
        # sampling, reply_to, the decode loop's) travels on as it came; encode refills the
        # payload fields from the boundary
        nh = msgspec.structs.replace(h, layer=self.layers[1], relay=h.relay[1:],
                                     tokens=h.tokens if nxt.tokens else None)
        codec = h.codec if array is not None else "raw"
        buf = self._tls.buf
        wire.encode_into(nh, res[:h.n_tokens], buf, codec=codec,
                         compress=h.compression == "zstd")
        self.links.send(nxt.endpoint, buf)

    # -- lifecycle -----------------------------------------------------------------------

    async def housekeeping(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            with self.lock:
                self.table.expire()

    async def drain(self, server: ShardServer, timeout: float) -> None:
        """Stop taking work, let in-flight steps finish (up to ``timeout`` s), stop serving."""
        if self.draining:
            return
        self.draining = True
        self.table.closed = True
        log.info("draining: health NOT_SERVING, %d step(s) in flight", self.inflight)
        await server.set_serving(False)
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        # no compute starts from here on: steps still queued at a drain timeout are refused
        # instead of keeping the worker alive until they are all done
        self.stopped = True
        if self.inflight:
            log.warning("drain timeout: %d step(s) still running", self.inflight)
        await server.stop(grace=0.5)
        self.stop_data()
        with self.lock:
            self.table.clear()
        self.executor.shutdown(wait=True)
        # a step computing on a data connection's thread cannot be interrupted: wait for it,
        # the process must not exit (and tear the engine down) under it
        with self.engine_lock:
            pass
        log.info("drained; %d steps served; %d admitted step(s) not run", self.steps_total,
                 self.not_run)
