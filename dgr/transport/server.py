"""The shard service over grpc.aio: control RPCs in protobuf, steps as raw frames, health."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
from typing import Any, Protocol, Sequence

import grpc
import numpy as np
from grpc_health.v1 import health as _health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dgr import errors
from dgr._proto import dgr_pb2, dgr_pb2_grpc
from dgr.protocol import wire
from dgr.transport.common import (
    HEALTH_SERVICE,
    MAX_MESSAGE,
    MAX_PIECES,
    SERVICE,
    server_options,
)
from dgr.transport.security import CALLER, METADATA_KEY, PUBLIC_METHODS, Security
from dgr.transport.status import to_status

__all__ = ["StageBackend", "ShardServer"]

log = logging.getLogger("dgr.transport")


class StageBackend(Protocol):
    """What a worker gives the server: the state machine behind each RPC."""

    def describe(self) -> dict[str, Any]:
        """Fields of ``DescribeReply`` (``settings`` as a dict of ``EngineSettings`` fields)."""

    def release(self, session: str, keep: Sequence[bytes] = (), chunk: int = 0,
                whole: int | None = None) -> tuple[bool, bool]:
        """End ``session``: ``(released, kept)``; with ``keep``, keep its caches as a prefix
        entry where the stage's store takes it."""

    def adopt(self, session: str, epoch: int, keys: Sequence[bytes], chunk: int) -> int:
        """Open ``session`` on the caller's prefix entry that holds the most of ``keys``; the
        position it continues at, 0 for a miss (run on a thread: it waits for the engine)."""

    def fork(self, session: str, epoch: int, into: list[str], into_epoch: int) -> int:
        """Open ``into`` as copies of ``session``; the position they continue at (run on a
        thread: it may wait for the engine)."""

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> Sequence[int]: ...

    def encode_media(self, prompt: str, media: list[bytes], add_special: bool,
                     parse_special: bool, first_pos: int, encode_from: int = 0,
                     max_pixels: int = 0) -> list[dict]:
        """``prompt``'s text and media chunks, the media ones from ``encode_from`` on
        encoded (``Worker``'s)."""

    def detokenize(self, tokens: Sequence[int], remove_special: bool,
                   unparse_special: bool) -> str: ...

    def token_pieces(self, first: int, count: int, special: bool) -> list[bytes]: ...

    async def step(self, frame: bytes) -> bytes:
        """One request frame in, one reply frame (``Result`` or ``ErrorReply``) out; never
        raises for a bad request (that is an ``ErrorReply``)."""


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    status, details, md = to_status(exc)
    context.set_trailing_metadata(md)
    await context.abort(status, details)


def _rewrap(handler, wrap):
    """``handler`` with its behaviour replaced by ``wrap(behaviour, streaming_response)``."""
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(
            wrap(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            wrap(handler.unary_stream, True), handler.request_deserializer,
            handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(
            wrap(handler.stream_unary), handler.request_deserializer,
            handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(
        wrap(handler.stream_stream, True), handler.request_deserializer,
        handler.response_serializer)


class Authenticate(grpc.aio.ServerInterceptor):
    """Every call but ``PUBLIC_METHODS`` (health) needs a token of a credential in
    ``security.keys`` in its ``x-dgr-auth`` metadata (``dgr.transport.security``); the
    handler of an accepted call sees the credential as ``CALLER``. A refused call ends with
    UNAUTHENTICATED before its handler runs; a refused ``Step`` stream first answers its
    first frame with an ``ErrorReply`` (``Unauthenticated``), since aborting a stream before
    its first message can reach the client as INTERNAL."""

    def __init__(self, security: Security):
        self.keys = security.keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method in PUBLIC_METHODS:
            return handler
        token = None
        for k, v in details.invocation_metadata or ():
            if k == METADATA_KEY:
                token = v
                break
        try:
            cred = self.keys.verify(token, "grpc:" + details.method)
        except errors.Unauthenticated as e:
            refusal = e
            return _rewrap(handler, lambda fn, streaming=False: _deny(refusal, details.method))
        return _rewrap(handler, lambda fn, streaming=False: _as_caller(fn, cred, streaming))


def _as_caller(fn, cred, streaming: bool):
    if streaming and not asyncio.iscoroutinefunction(fn):  # an async generator handler
        async def gen(request, context):
            CALLER.set(cred)
            async for r in fn(request, context):
                yield r
        return gen

    async def call(request, context):
        CALLER.set(cred)
        return await fn(request, context)
    return call


def _deny(exc: errors.Unauthenticated, method: str):
    async def deny(request, context):
        if method.endswith("/Step"):
            data = await context.read()
            if data is not grpc.aio.EOF:
                await context.write(wire.encode(wire.ErrorReply.from_exception(exc)))
        await _abort(context, exc)
    return deny


class _Servicer(dgr_pb2_grpc.ShardServicer):
    def __init__(self, backend: StageBackend):
        self.b = backend
        # Release, Reuse and Fork give out and take back slots, on one thread in the order
        # the RPCs came. A front sends each of them to every stage at once, so each stage
        # then makes the same choices: a session gets the same slot on every stage, and the
        # stages form the same ring groups of slot runs (scheduler.RingLoad). On threads of
        # a pool, concurrent adoptions that matched entries alike took them in whatever order
        # the engine's lock let them, and the slots of a route's sessions diverged.
        self._ordered = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="dgr-slots")
        #: the slot RPCs handed to that thread so far (in the order they came)
        self.ordered_calls = 0

    def close(self) -> None:
        """Let the slots' thread end (the server stopped: no RPC comes any more)."""
        self._ordered.shutdown(wait=False)

    async def _in_order(self, fn, *args):
        """``fn(*args)`` on the slots' thread (``__init__``), in the caller's context (its
        credential)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        self.ordered_calls += 1
        return await asyncio.get_running_loop().run_in_executor(self._ordered, call)

    async def Describe(self, request, context):
        try:
            d = dict(self.b.describe())
            d["settings"] = dgr_pb2.EngineSettings(**d["settings"])
            if "device" in d:
                d["device"] = dgr_pb2.ComputeDevice(**d["device"])
            if "prefix_store" in d:
                d["prefix_store"] = dgr_pb2.PrefixStore(**d["prefix_store"])
            return dgr_pb2.DescribeReply(**d)
        except Exception as e:  # noqa: BLE001 - every failure leaves as a mapped status
            await _abort(context, e)

    async def Release(self, request, context):
        try:
            released, kept = await self._in_order(
                self.b.release, request.session, list(request.keep), request.chunk,
                request.whole if request.HasField("whole") else None)
            return dgr_pb2.ReleaseReply(released=released, kept=kept)
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def Reuse(self, request, context):
        # under the engine's lock, which a forward holds: off the event loop, in order
        try:
            pos = await self._in_order(self.b.adopt, request.session, request.epoch,
                                       list(request.keys), request.chunk)
            return dgr_pb2.ReuseReply(next_pos=pos)
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def Fork(self, request, context):
        # under the engine's lock, which a forward holds: off the event loop, in order
        try:
            pos = await self._in_order(self.b.fork, request.session, request.epoch,
                                       list(request.into), request.into_epoch)
            return dgr_pb2.ForkReply(next_pos=pos)
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    # The tokenizer's RPCs read the vocabulary only: they run on a thread, off the event loop
    # (which serves the Step streams) and without the engine's lock (which every forward
    # holds), so a prompt never waits for a forward to be tokenized.

    async def Tokenize(self, request, context):
        try:
            toks = await asyncio.to_thread(self.b.tokenize, request.text, request.add_special,
                                           request.parse_special)
            return dgr_pb2.TokenizeReply(tokens=[int(t) for t in toks])
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def EncodeMedia(self, request, context):
        # the projector computes on the stage's device, under the engine's lock: on a thread
        try:
            chunks = await asyncio.to_thread(self.b.encode_media, request.prompt,
                                             list(request.media), request.add_special,
                                             request.parse_special, request.first_pos,
                                             request.encode_from, request.max_pixels)
            out = []
            for c in chunks:
                m = dgr_pb2.MediaChunk(kind=c["kind"], tokens=c["tokens"], n_rows=c["n_rows"],
                                       n_pos=c["n_pos"], id=c["id"],
                                       non_causal=c["non_causal"])
                m.width = int(c.get("width", 0))
                if "rows" in c:
                    rows = np.ascontiguousarray(c["rows"], dtype="<f4")
                    m.width, m.rows = rows.shape[1], rows.tobytes()
                if "positions" in c:
                    m.positions.extend(int(p) for p in np.asarray(c["positions"]).reshape(-1))
                out.append(m)
            return dgr_pb2.EncodeMediaReply(chunks=out)
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def Detokenize(self, request, context):
        try:
            text = await asyncio.to_thread(self.b.detokenize, list(request.tokens),
                                           request.remove_special, request.unparse_special)
            return dgr_pb2.DetokenizeReply(text=text)
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def TokenPieces(self, request, context):
        try:
            if not 0 <= request.count <= MAX_PIECES:
                raise errors.InvalidArgument(
                    f"TokenPieces count must be in [0, {MAX_PIECES}], got {request.count}")
            pieces = await asyncio.to_thread(self.b.token_pieces, request.first, request.count,
                                             request.special)
            return dgr_pb2.TokenPiecesReply(pieces=pieces)
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def Step(self, request_iterator, context):
        # Raw bytes both ways (no (de)serializer on the method): one reply frame per request
        # frame. read()/write() measured faster than iterating request_iterator. Refusals
        # (draining included) are ErrorReply frames: aborting a stream before its first
        # message races with the client's write and may reach it as INTERNAL.
        step = self.b.step
        while True:
            data = await context.read()
            if data is grpc.aio.EOF:
                return
            await context.write(await step(data))


class ShardServer:
    """A gRPC server for one stage backend: the Shard service, raw-frame steps and health.

    Parameters
    ----------
    backend : StageBackend
        The worker's logic.
    listen : str
        ``host:port`` to bind (port 0 picks a free one; ``port`` tells which). Loopback by
        default.
    max_message : int
        Largest gRPC message accepted or sent (bytes).
    maximum_concurrent_rpcs : int, optional
        Beyond this many concurrent RPCs (open step streams count) gRPC answers
        RESOURCE_EXHAUSTED.
    security : Security, optional
        With ``keys``: every call but health needs a credential (``Authenticate``); with
        ``tls``: the port serves TLS (mutual with ``tls.client_auth``). None: neither.
    """

    def __init__(self, backend: StageBackend, listen: str = "127.0.0.1:0", *,
                 max_message: int = MAX_MESSAGE, maximum_concurrent_rpcs: int | None = None,
                 security: Security | None = None):
        self.backend = backend
        self.listen = listen
        self.port: int | None = None
        self.security = security
        interceptors = ([Authenticate(security)]
                        if security is not None and security.keys is not None else [])
        self._server = grpc.aio.server(options=server_options(max_message),
                                       maximum_concurrent_rpcs=maximum_concurrent_rpcs,
                                       interceptors=interceptors)
        self._servicer = servicer = _Servicer(backend)
        dgr_pb2_grpc.add_ShardServicer_to_server(servicer, self._server)
        # The Step method is not in the generated service (its messages are not protobuf):
        # a generic handler without (de)serializers hands the frame bytes through untouched.
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            SERVICE, {"Step": grpc.stream_stream_rpc_method_handler(servicer.Step)}),))
        self.health = _health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)

    @property
    def address(self) -> str:
        host = self.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> int:
        """Bind and start serving; returns the bound port.

        Raises
        ------
        dgr.errors.InvalidArgument
            The address cannot be bound (in use, not local, malformed).
        """
        tls = self.security.tls if self.security is not None else None
        try:
            if tls is not None and tls.cert:
                self.port = self._server.add_secure_port(self.listen, tls.server_credentials())
            else:
                self.port = self._server.add_insecure_port(self.listen)
        except RuntimeError as e:
            raise errors.InvalidArgument(f"cannot listen on {self.listen}: {e}") from None
        if not self.port:
            raise errors.InvalidArgument(f"cannot listen on {self.listen}")
        await self._server.start()
        await self.set_serving(True)
        # a backend that can become unable to serve (a lost compute device) says so through
        # these hooks, from any thread: health then answers NOT_SERVING
        hooks = getattr(self.backend, "on_unservable", None)
        if isinstance(hooks, list):
            loop = asyncio.get_running_loop()
            hooks.append(lambda: asyncio.run_coroutine_threadsafe(self.set_serving(False), loop))
        return self.port

    async def set_serving(self, serving: bool) -> None:
        st = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", HEALTH_SERVICE):
            await self.health.set(name, st)

    async def stop(self, grace: float | None = 1.0) -> None:
        """Stop: new RPCs are refused, open ones get ``grace`` seconds, then are cancelled."""
        await self._server.stop(grace)
        self._servicer.close()
