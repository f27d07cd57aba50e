"""The stage: a worker serving one layer range of a GGUF model (gRPC ``Step`` and data plane).

Both planes feed one step pipeline (``dgr.worker.pipeline``); they differ in how a frame
arrives (a gRPC stream's coroutine, a data connection's thread) and where its frames go (the
stream's reply; ``dgr.worker.forwarder`` on the data plane).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import threading
import time
from typing import Any

from dgr import __version__, errors
from dgr.control.capability import build_info
from dgr.control.prefix import chunk_rows_exact_cached as prefix_chunk_rows_exact
from dgr.control.prefix import rows_exact_cached as prefix_rows_exact
from dgr.control.prefix import single_rows_exact_cached as prefix_single_rows_exact
from dgr.protocol import wire
from dgr.protocol.settings import NUMERIC_SETTINGS
from dgr.transport.security import CALLER, Security
from dgr.transport.server import ShardServer
from dgr.worker.config import WorkerConfig
from dgr.worker.frames import Frames
from dgr.worker.pipeline import StagePipeline
from dgr.worker.step import Step
from dgr.worker.trust import RelayPolicy

__all__ = ["MAX_PIXELS", "Worker"]

log = logging.getLogger("dgr.worker")

#: the most pixels (width x height) an image given to ``Worker.encode_media`` may have, read
#: from its header before it is decoded (a few kilobytes may claim a gigapixel image): 8192 x
#: 8192; a caller may ask for less (the front's ``--max-image-pixels``)
MAX_PIXELS = 8192 * 8192


class Worker:
    """The stage backend of one worker: it owns the step pipeline (which owns the engine, the
    session table and the scheduler), feeds it from both planes, and describes the stage.

    Parameters
    ----------
    engine : dgr.Engine
        The loaded range (its ``lock`` is held around every compute).
    config : dgr.worker.config.WorkerConfig, optional
        The worker's settings (sessions' expiry, inline compute, batching, frame I/O, tenant
        caps, the prefix store, the certification store), each documented there;
        ``**settings`` changes some of them (``Worker(engine, ttl=60)``), and an unknown one
        is ``InvalidArgument``.
    name : str
        Label for log lines (the listen address once known).
    security : dgr.transport.security.Security, optional
        The credentials accepted and presented, and TLS (both planes; None: none).
    relay_allow : sequence of str, optional
        Whom relayed frames may make this worker connect to (``RelayPolicy``; None: loopback
        only).
    """

    def __init__(self, engine, *, config: WorkerConfig | None = None, name: str = "",
                 security: Security | None = None, relay_allow=None, **settings):
        c = self.config = (config or WorkerConfig()).with_(**settings)
        #: the data plane's frame codec and I/O (dgr.worker.frames): C++ unless
        #: ``native_frames`` is False or the build lacks it
        self.frames = Frames(c.native_frames, c.max_message)
        #: how long a data connection polls for its next frame before sleeping (native
        #: frame I/O only; 0: sleep at once)
        self.busy_poll_s = float(c.busy_poll_s)
        if self.busy_poll_s and not self.frames.native:
            raise errors.InvalidArgument("busy polling needs the native frame I/O, which this "
                                         "build lacks")
        self.eog_tokens = [t for t in range(engine.n_vocab) if engine.is_eog(t)]
        #: whether a partial prefill chunk's rows are any partial chunk's rows here, measured
        #: before the stage serves, and before its scheduler's thread starts
        #: (``Describe.prefix_rows_exact``: routes reuse kept prompt rows past whole chunks
        #: only where every stage says so)
        self.prefix_rows_exact = prefix_rows_exact(engine)
        #: and rows computed one per step (``Describe.prefix_single_rows_exact``: routes reuse
        #: a reply's decoded rows only where every stage says so)
        self.prefix_single_rows_exact = (self.prefix_rows_exact
                                         and prefix_single_rows_exact(engine))
        #: and a whole chunk's rows (``Describe.prefix_chunk_rows_exact``: with the first,
        #: routes keep every prompt row a later prompt shares, however its prompts were cut
        #: into chunks; with both above, every row); measured only where it could count
        self.prefix_chunk_rows_exact = (self.prefix_rows_exact
                                        and prefix_chunk_rows_exact(engine))
        #: the projector beside this stage (``mmproj``, the first stage only: ``dgr.Media``
        #: on its engine, its device), which ``encode_media`` runs; None without one
        self.media = None
        if c.mmproj:
            if not engine.is_first:
                raise errors.InvalidArgument(
                    "--mmproj: a projector runs beside the first stage (layers from 0), "
                    "which embeds the tokens")
            from dgr.core.media import Media

            info = engine.describe()
            self.media = Media(engine, c.mmproj, n_threads=int(info["n_threads"]),
                               flash_attn=bool(info["flash_attn"]))
        # fast data plane (dgr.transport.dataplane): set by serve_data()
        self.data_server = None
        self.forwarder = None
        #: the step pipeline: the engine, the session table, the scheduler, the counters
        self.pipeline = p = StagePipeline(engine, c, relay_policy=RelayPolicy(relay_allow),
                                          burst=self._burst)
        #: hooks called (from any thread) when the stage can no longer serve (its device was
        #: lost): the gRPC server adds one that turns health NOT_SERVING
        self.on_unservable = p.on_unservable
        #: the credentials accepted and presented, and TLS (dgr.transport.security; both
        #: planes use it): none by default
        self.security = security if security is not None else Security()
        self.inline = c.inline
        self.inline_below_ms = float(c.inline_below_ms)
        self.inline_steps = 0
        self.name = name
        self.cert_store = c.cert_store  # certified lanes advertised in the capability record
        #: optional span log (``--trace``): one JSON line per data-plane step, times from
        #: time.perf_counter() (CLOCK_MONOTONIC on Linux: comparable across processes)
        self.trace = None
        #: the data port named in Describe when it differs from the bound one (a proxy or
        #: port forward in front of it)
        self.advertise_data_port = 0
        self._tls = threading.local()  # per thread: a reused frame-encode buffer
        self._trace_lock = threading.Lock()  # trace lines come from several threads

    # -- control plane -------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """The fields of ``DescribeReply`` (``settings``: a dict of ``EngineSettings``)."""
        p = self.pipeline
        with p.lock:  # the table's writers hold it, data-plane threads included
            free_slots, sessions = p.table.free_slots, len(p.table)
            free_context = p.table.free_context
        return dict(
            model_identity=p.model_identity,
            model_name=os.path.basename(p.info["model"]),
            arch=p.info["arch"], n_layer=p.n_layer,
            layer_start=p.layers[0], layer_end=p.layers[1],
            is_first=p.is_first, is_last=p.is_last,
            needs_token_ids=bool(p.engine.needs_token_ids),
            boundary_width=p.width, boundary_dtype="f32", n_vocab=int(p.engine.n_vocab),
            settings={k: p.settings[k] for k in NUMERIC_SETTINGS},
            eog_tokens=self.eog_tokens, add_bos=bool(p.info["add_bos"]),
            free_slots=free_slots, sessions=sessions,
            free_context=max(free_context, 0), queue_depth=p.inflight,
            recent_tokens_per_s=p.window.tokens_per_s(),
            recent_step_ms=p.window.decode_ms, draining=p.draining,
            dgr_version=__version__, wire_format_version=wire.FORMAT_VERSION,
            wire_schema_version=wire.SCHEMA_VERSION,
            weight_bytes=int(p.info["weight_bytes"]), kv_bytes=int(p.info["kv_bytes"]),
            steps_total=p.steps_total, errors_total=p.errors_total,
            uptime_s=time.monotonic() - p.started,
            capability_json=self.capability_json(),
            data_port=(self.advertise_data_port or self.data_server.port)
            if self.data_server is not None else 0,
            **p.compute_counters(),
            drafters=p.drafters,
            device=self.device_facts(),
            prefix_rows_exact=self.prefix_rows_exact,
            prefix_single_rows_exact=self.prefix_single_rows_exact,
            prefix_chunk_rows_exact=self.prefix_chunk_rows_exact,
            prefix_store=p.slots.prefix_store(),
            rollback_window=int(p.info.get("rollback_window", -1)),
            state_bytes=int(p.info.get("state_bytes", 0)),
            state_snapshots=int(p.info.get("state_snapshots", 0)),
            n_ctx=p.n_ctx, n_ctx_train=int(p.info.get("n_ctx_train", 0)),
            n_ctx_source=str(p.info.get("n_ctx_source", "")),
            **{k: v for k, v in build_info().items()
               if k in ("llama_cpp_commit", "patch_stack_hash", "cpu_variant")},
            media_marker=self.media.marker if self.media is not None else "",
            media_vision=self.media is not None and self.media.vision,
            media_audio=self.media is not None and self.media.audio,
        )

    def profile_snapshot(self) -> dict[str, Any]:
        """Where the stage's time went since it started (docs/performance.md): ``parts``,
        wall seconds by part (``dgr.worker.profile.PARTS``) summed over its threads;
        ``engine``, the engine's forward counters (``Engine.counters``; empty for an engine
        without them); ``cpu_s``, the process's CPU seconds (user and system, every thread);
        ``batches`` and ``steps_batched``, the stage loop's forwards and the steps in them;
        ``tokens``, tokens computed."""
        p = self.pipeline
        counters = getattr(p.engine, "counters", None)
        sizes = p.scheduler.batch_sizes.copy()
        return {"parts": p.profile.totals(),
                "engine": dict(counters) if counters is not None else {},
                "cpu_s": time.process_time(),
                "batches": p.scheduler.batches,
                "steps_batched": sum(k * v for k, v in sizes.items()),
                "tokens": p.window.tokens_computed_total}

    def device_facts(self) -> dict[str, Any]:
        """The ``ComputeDevice`` fields: the engine's device and what it holds there (read
        when the worker started: see ``StagePipeline.engine_device``)."""
        f = self.pipeline.engine_device
        if f is None:  # an engine without devices (a test double): the CPU
            return {"backend": "cpu", "name": "cpu", "type": "cpu", "description": "",
                    "driver": "", "software": False, "memory_free": 0, "memory_total": 0,
                    "weight_bytes": int(self.pipeline.info.get("weight_bytes", 0)),
                    "kv_bytes": int(self.pipeline.info.get("kv_bytes", 0)), "compute_bytes": 0}
        return {"backend": f["backend"], "name": f["device"], "type": f["type"],
                "description": f["description"], "driver": f["driver"],
                "software": bool(f["software"]), "memory_free": int(f["memory_free"]),
                "memory_total": int(f["memory_total"]), "weight_bytes": int(f["weight_bytes"]),
                "kv_bytes": int(f["kv_bytes"]), "compute_bytes": int(f["compute_bytes"])}

    def capability(self):
        """The capability record (``dgr.protocol.capability.Capability``), live figures."""
        from dgr.control.capability import record_for

        p = self.pipeline
        return record_for(p.engine, pipeline=p, cert_store=self.cert_store, endpoint=self.name)

    def capability_json(self) -> bytes:
        from dgr.protocol.capability import encode

        try:
            return encode(self.capability())
        except Exception:  # noqa: BLE001 - describe must answer even when the record cannot
            log.exception("capability record failed")
            return b""

    # -- sessions (the Shard service's calls, for the caller: ``CALLER``) -----------------

    def release(self, session: str, keep=(), chunk: int = 0,
                whole: int | None = None) -> tuple[bool, bool]:
        """``Slots.release`` for the caller (another credential's session is not)."""
        return self.pipeline.slots.release(session, CALLER.get(), keep, chunk, whole)

    def adopt(self, session: str, epoch: int, keys, chunk: int) -> int:
        """``Slots.adopt`` from the caller's prefix entries."""
        return self.pipeline.slots.adopt(session, epoch, keys, chunk, CALLER.get())

    def fork(self, session: str, epoch: int, into: list[str], into_epoch: int) -> int:
        """``Slots.fork`` of the caller's session."""
        return self.pipeline.slots.fork(session, epoch, into, into_epoch, CALLER.get())

    def encode_media(self, prompt: str, media: list[bytes], add_special: bool,
                     parse_special: bool, first_pos: int, encode_from: int = 0,
                     max_pixels: int = 0) -> list[dict]:
        """``prompt``'s chunks by the projector beside this stage (``--mmproj``): each a
        dict of ``Media.tokenize``'s, a media chunk that starts at ``encode_from`` or later
        with its ``rows`` (``Media.encode``, on this stage's device) and ``positions``
        (positions from ``first_pos`` on). An image of more than ``max_pixels`` pixels (the
        caller's cap, at most ``MAX_PIXELS``) is refused before it is decoded. Serialized by
        the engine's lock (libmtmd's context is not thread-safe), as a forward is."""
        m = self.media
        if m is None:
            raise errors.InvalidArgument(
                "this worker has no projector: start the first stage with --mmproj "
                "(the model's mmproj GGUF)")
        cap = min(int(max_pixels), MAX_PIXELS) if max_pixels else MAX_PIXELS
        with self.pipeline.engine.lock:
            chunks = m.tokenize(prompt, media, add_special, parse_special, cap)
            p = int(first_pos)
            for i, c in enumerate(chunks):
                if c["kind"] != "text":
                    c["width"] = m.n_embd_inp
                if c["kind"] != "text" and p >= encode_from:
                    c["rows"], c["positions"] = m.encode(i), m.positions(i, p)
                p += c["n_pos"]
        return chunks

    def tokenize(self, text: str, add_special: bool, parse_special: bool):
        return self.pipeline.engine.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens, remove_special: bool, unparse_special: bool) -> str:
        return self.pipeline.engine.detokenize(tokens, remove_special, unparse_special)

    def token_pieces(self, first: int, count: int, special: bool) -> list[bytes]:
        return self.pipeline.engine.token_pieces(first, count, special)

    # -- gRPC Step stream ----------------------------------------------------------------

    async def step(self, data: bytes) -> bytes:
        """One gRPC ``Step`` frame: computed by the stage loop, replied with a frame."""
        t_arrive = time.perf_counter()
        h = None
        try:
            frame = self.frames.decode(data)
            h = frame.header
            step = self.pipeline.accept(frame, t_arrive, credential=CALLER.get())
        except Exception as e:  # noqa: BLE001 - every refusal is an ErrorReply
            return self.pipeline.error(e, *_who(h))
        aloop = asyncio.get_running_loop()
        fut = aloop.create_future()

        def settle(out) -> None:
            if not fut.done():
                fut.set_result(out)

        def done(step: Step, failure: BaseException | None) -> None:
            # on the thread that computed: the results view its buffer, so encode here
            out = (self.pipeline.reply(step), None) if failure is None else (None, failure)
            try:
                here = asyncio.get_running_loop() is aloop  # computed inline on the loop
            except RuntimeError:  # another thread: the stage loop's
                here = False
            if here:
                settle(out)
            else:
                try:
                    aloop.call_soon_threadsafe(settle, out)
                except RuntimeError:  # the event loop closed: nobody waits for the reply
                    pass

        inline = self.inline or (h.n_tokens == 1 and self.inline_below_ms > 0
                                 and 0 < self.pipeline.window.decode_ms < self.inline_below_ms)
        if self.pipeline.scheduler.submit(step, done, inline=inline):
            self.inline_steps += 1
        reply, failure = await fut
        if failure is not None:
            if not isinstance(failure, Exception):
                raise failure
            return self.pipeline.error(failure, h.session, h.epoch)
        return reply

    # -- fast data plane (dgr.transport.dataplane, docs/dataplane.md) ----------------------

    def serve_data(self, host: str, port: int = 0, max_connections: int = 256,
                   max_per_address: int | None = 64, frame_timeout: float | None = 30.0) -> int:
        """Start the TCP data plane on ``host:port``; returns the bound port. Limits:
        ``DataServer``'s (connections in all and per remote address, a frame's deadline)."""
        from dgr.transport.dataplane import DataServer
        from dgr.worker.forwarder import Forwarder

        p = self.pipeline
        self.forwarder = Forwarder(p.layers[1], p.is_first, p.is_last, self.frames,
                                   self.security, p.speculator)
        self.data_server = DataServer(self._data_connection, host, port, max_connections,
                                      conn_class=self.frames.conn_class,
                                      max_per_address=max_per_address,
                                      frame_timeout=frame_timeout,
                                      security=self.security).start()
        return self.data_server.port

    def stop_data(self) -> None:
        if self.data_server is not None:
            self.data_server.stop()
        if self.forwarder is not None:
            self.forwarder.close()
        if self.trace is not None:
            self.trace.flush()

    def _data_connection(self, conn) -> None:
        """One data-plane connection (its own thread): frames in order until EOF."""
        conn.spin = self.busy_poll_s
        try:
            while True:
                try:
                    view = conn.recv()
                except errors.FrameError as e:  # an unframeable stream: answer, hang up
                    conn.send(self.pipeline.error(e))
                    return
                if view is None:
                    return
                self._data_frame(conn, view)
        finally:
            self.forwarder.forget(conn)

    def _data_frame(self, conn, view) -> None:
        """One data-plane frame: a ``Hello``, or a step for the stage loop. The step runs on
        this thread when the engine is idle and no further frame already waits on this
        connection; otherwise it queues and this thread reads on, so frames that arrive
        together (one stage's batch, relayed) compute together."""
        t_arrive = time.perf_counter()
        fw = self.forwarder
        h = None
        try:
            frame = self.frames.decode(view)
            h = frame.header
            if type(h) is wire.Hello:  # a driver's return connection
                fw.hello(conn, h.route)
                return
            step = self.pipeline.accept(frame, t_arrive, returns=fw,
                               credential=getattr(conn, "credential", None))
        except Exception as e:  # noqa: BLE001 - every refusal is an ErrorReply
            fw.send_back(conn, getattr(h, "reply_to", ""), self.pipeline.error(e, *_who(h)))
            return
        more = conn.pending()  # a burst: queue it with the rest, as one batch
        self.pipeline.profile.add("frame_in", time.perf_counter() - t_arrive)
        self.pipeline.scheduler.submit(step, functools.partial(self._data_done, conn),
                                       inline=not more,
                         hold=more)

    def _data_done(self, conn, step: Step, failure: BaseException | None) -> None:
        """A data-plane step finished: send its frames on (or its error back). Runs on the
        thread that computed it, outside the engine's lock (its buffers are that thread's)."""
        fw, h = self.forwarder, step.header
        if failure is not None:
            fw.send_back(conn, h.reply_to, self.pipeline.error(failure, h.session, h.epoch))
            return
        t_done = time.perf_counter()

        def failed(e: BaseException) -> None:  # a relay or loop frame of a burst not sent
            fw.send_back(conn, h.reply_to, self.pipeline.error(e, h.session, h.epoch))

        try:
            fw.send_on(conn, step, self._reply_parts, self._thread_buf(), failed)
        except Exception as e:  # noqa: BLE001 - e.g. the next stage is unreachable
            fw.send_back(conn, h.reply_to, self.pipeline.error(e, h.session, h.epoch))
        if self.trace is not None:
            self._trace(step, t_done)

    def _burst(self):
        """The block a batch's steps are handed on in: its relay and loop frames leave as one
        write per next stage (``Links.burst``), so they batch together there too."""
        fw = self.forwarder
        return fw.links.burst() if fw is not None else contextlib.nullcontext()

    def _reply_parts(self, step: Step, buf: bytearray) -> tuple:
        """The data plane's ``Result`` frame of ``step`` as the pieces to send."""
        r, res, codec, compress = self.pipeline.result_of(step)
        return self.frames.result(r, res, codec, compress, buf)

    def _thread_buf(self) -> bytearray:
        """This thread's reusable frame-encode buffer."""
        buf = getattr(self._tls, "buf", None)
        if buf is None:
            buf = self._tls.buf = bytearray()
        return buf

    def _trace(self, step: Step, t_done: float) -> None:
        h = step.header
        span = {"stage": list(self.pipeline.layers), "session": h.session, "epoch": h.epoch,
                "pos": h.first_pos, "n": h.n_tokens, "arrive": step.t_arrive,
                "compute_end": t_done, "compute_s": step.seconds, "sent": time.perf_counter(),
                "batch": step.batch[0] if step.batch else 0,
                "batch_steps": step.batch[1] if step.batch else 1}
        with self._trace_lock:
            self.trace.write(json.dumps(span) + "\n")

    # -- lifecycle -----------------------------------------------------------------------

    async def housekeeping(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            self.pipeline.expire()

    async def drain(self, server: ShardServer, timeout: float) -> None:
        """Stop taking work, let in-flight steps finish (up to ``timeout`` s), stop serving."""
        p = self.pipeline
        if p.draining:
            return
        p.draining = True
        # new work is refused at admission (``accept``) from here on; the session table stays
        # open: a step admitted before now takes its lease only when it reaches the engine,
        # and one that opens its session (or a new epoch) is in flight like any other
        log.info("draining: health NOT_SERVING, %d step(s) in flight", p.inflight)
        await server.set_serving(False)
        deadline = time.monotonic() + timeout
        while p.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        # no compute starts from here on: steps still queued at a drain timeout are refused
        # instead of keeping the worker alive until they are all done
        p.stopped = True
        if p.inflight:
            log.warning("drain timeout: %d step(s) still running", p.inflight)
        await server.stop(grace=0.5)
        self.stop_data()
        await asyncio.to_thread(p.close)
        log.info("drained; %d steps served; %d admitted step(s) not run", p.steps_total,
                 p.not_run)


def _who(h) -> tuple[str, int]:
    """(session, epoch) a reply about header ``h`` names (none for a frame without them)."""
    return getattr(h, "session", ""), getattr(h, "epoch", 0)
