"""Client of the shard service over grpc.aio: control calls and per-session step streams."""

from __future__ import annotations

import asyncio
import sys
from typing import Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dgr import errors
from dgr._proto import dgr_pb2, dgr_pb2_grpc
from dgr.protocol.describe import StageInfo
from dgr.transport.common import MAX_MESSAGE, SERVICE, STEP_METHOD, channel_options
from dgr.transport.security import Security, default_security
from dgr.transport.status import CODE_KEY, from_rpc_error, from_status

__all__ = ["ShardClient", "StepStream", "DEFAULT_TIMEOUT", "DEFAULT_STEP_TIMEOUT",
           "DEFAULT_STREAM_TIMEOUT", "timeout_after"]

#: Deadline of a control call (describe, release, tokenize, health), seconds.
DEFAULT_TIMEOUT = 10.0
#: Deadline of one step on a stream (a prefill chunk on a slow machine included), seconds.
DEFAULT_STEP_TIMEOUT = 60.0
#: Deadline of a whole step stream; the route driver opens a new one when it ends.
DEFAULT_STREAM_TIMEOUT = 6 * 3600.0

#: the full gRPC method of each control call (what a call's token is signed for)
_METHODS = {"describe": f"/{SERVICE}/Describe", "release": f"/{SERVICE}/Release",
            "fork": f"/{SERVICE}/Fork", "reuse": f"/{SERVICE}/Reuse",
            "tokenize": f"/{SERVICE}/Tokenize", "detokenize": f"/{SERVICE}/Detokenize",
            "token_pieces": f"/{SERVICE}/TokenPieces",
            "encode_media": f"/{SERVICE}/EncodeMedia",
            "health": "/grpc.health.v1.Health/Check"}

if sys.version_info >= (3, 11):
    timeout_after = asyncio.timeout
else:  # pragma: no cover - Python 3.10
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def timeout_after(delay):
        task = asyncio.current_task()
        fired = []

        def expire():
            fired.append(True)
            task.cancel()

        handle = asyncio.get_running_loop().call_later(delay, expire)
        try:
            yield
        except asyncio.CancelledError:
            if fired:
                raise TimeoutError from None
            raise
        finally:
            handle.cancel()


class StepStream:
    """One open Step stream: ``step(frame)`` sends a request frame and returns the reply frame.

    Replies come in request order, one each; after a failure (deadline, broken connection) the
    stream is closed and ``broken`` is true: open a new one.
    """

    def __init__(self, client: ShardClient, timeout: float):
        self.client = client
        self._call = client._step_method(timeout=timeout,
                                         metadata=client.security.metadata(STEP_METHOD))
        self.broken = False

    async def step(self, frame: bytes, timeout: float = DEFAULT_STEP_TIMEOUT) -> bytes:
        """Send one frame and wait for its reply.

        Raises
        ------
        dgr.errors.WorkerUnavailable, dgr.errors.WorkerDraining
            The stream or the worker went away (or refused the stream).
        dgr.errors.StepDeadlineExceeded
            No reply within ``timeout`` seconds (the stream is cancelled).
        """
        if self.broken:
            raise errors.WorkerUnavailable(f"{self.client.endpoint}: this step stream is closed")
        call = self._call
        try:
            async with timeout_after(timeout):
                try:
                    await call.write(frame)
                    reply = await call.read()
                except (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                    # the call ended: its final status says why (a failed write alone may
                    # only say "internal error")
                    self.broken = True
                    raise await self._ended() from None
                if reply is grpc.aio.EOF:
                    self.broken = True
                    raise await self._ended()
        except TimeoutError as e:
            if isinstance(e, errors.DgrError):  # StepDeadlineExceeded is a TimeoutError too
                raise
            self._break()
            raise errors.StepDeadlineExceeded(
                f"{self.client.endpoint}: no reply within {timeout:g} s") from None
        return reply

    async def _ended(self) -> errors.DgrError:
        call = self._call
        try:
            code = await call.code()
            details = await call.details()
            md = await call.trailing_metadata()
        except Exception:  # noqa: BLE001
            return errors.WorkerUnavailable(f"{self.client.endpoint}: the step stream ended")
        if code == grpc.StatusCode.OK:
            return errors.WorkerUnavailable(f"{self.client.endpoint}: the worker closed the "
                                            "step stream")
        if code == grpc.StatusCode.INTERNAL and not any(k == CODE_KEY for k, _ in (md or ())):
            # grpc core's own "internal error" (no dgr code): the stream's connection broke
            return errors.WorkerUnavailable(f"{self.client.endpoint}: the step stream broke "
                                            f"({details})")
        exc = from_status(code, details, md)
        if isinstance(exc, errors.WorkerUnavailable):
            exc.args = (f"{self.client.endpoint}: {exc.args[0] if exc.args else code.name}",)
        return exc

    def _break(self) -> None:
        self.broken = True
        self._call.cancel()  # a late reply must never be read as the next step's

    async def close(self) -> None:
        """Half-close and let the worker end the stream (cancels it if that fails)."""
        if self.broken:
            return
        self.broken = True
        try:
            await self._call.done_writing()
        except Exception:  # noqa: BLE001 - closing a dead stream is fine
            pass
        self._call.cancel()


class ShardClient:
    """Calls to one worker. Create it (and use it) inside the event loop that will run it.

    Parameters
    ----------
    endpoint : str
        ``host:port`` of the worker.
    timeout : float
        Deadline of control calls (seconds).
    max_message : int
        Largest gRPC message sent or accepted (bytes).
    security : Security, optional
        The credential presented on every call and TLS (``dgr.transport.security``); None:
        ``default_security()`` (the environment's).
    """

    def __init__(self, endpoint: str, *, timeout: float = DEFAULT_TIMEOUT,
                 max_message: int = MAX_MESSAGE, security: Security | None = None):
        self.endpoint = endpoint
        self.timeout = timeout
        self.security = security = security if security is not None else default_security()
        options = channel_options(max_message)
        if security.tls is not None:
            self._channel = grpc.aio.secure_channel(endpoint, security.tls.channel_credentials(),
                                                    options=options)
        else:
            self._channel = grpc.aio.insecure_channel(endpoint, options=options)
        self._stub = dgr_pb2_grpc.ShardStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._step_method = self._channel.stream_stream(STEP_METHOD)  # raw bytes both ways

    async def _unary(self, what: str, fn, request, timeout: float | None):
        try:
            return await fn(request, timeout=self.timeout if timeout is None else timeout,
                            metadata=self.security.metadata(_METHODS[what]))
        except grpc.RpcError as e:
            raise from_rpc_error(e, f"{self.endpoint} {what}") from None

    async def wait_ready(self, timeout: float) -> None:
        """Wait until the channel is connected.

        Raises
        ------
        dgr.errors.WorkerUnavailable
            Not connected within ``timeout`` seconds.
        """
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            raise errors.WorkerUnavailable(
                f"{self.endpoint}: not reachable within {timeout:g} s") from None

    async def describe(self, timeout: float | None = None) -> StageInfo:
        """The worker's describe record (identity, settings, range, capacity, load)."""
        r = await self._unary("describe", self._stub.Describe, dgr_pb2.DescribeRequest(), timeout)
        return StageInfo.from_proto(self.endpoint, r)

    async def capability(self, timeout: float | None = None):
        """The worker's capability record (``dgr.protocol.capability.Capability``;
        docs/capability.md).

        Raises
        ------
        dgr.errors.RouteError
            The worker predates the record (its describe reply carries none).
        """
        from dgr.protocol.capability import decode

        r = await self._unary("describe", self._stub.Describe, dgr_pb2.DescribeRequest(), timeout)
        if not r.capability_json:
            raise errors.RouteError(f"{self.endpoint}: this worker sends no capability record "
                                    "(it predates dgr.control.capability)")
        return decode(r.capability_json)

    async def release(self, session: str, timeout: float | None = None) -> bool:
        r = await self._unary("release", self._stub.Release,
                              dgr_pb2.ReleaseRequest(session=session), timeout)
        return r.released

    async def keep(self, session: str, keys: Sequence[bytes], chunk: int,
                   whole: int | None = None, timeout: float | None = None) -> bool:
        """End ``session``, keeping its caches as a prefix entry named by ``keys`` (``whole``
        of them one per ``chunk`` positions, all by default, then one per position:
        ``dgr.protocol.prefix.chain``) where the stage's store takes it; whether it did
        (else the session was released)."""
        r = await self._unary("release", self._stub.Release, dgr_pb2.ReleaseRequest(
            session=session, keep=list(keys), chunk=chunk, whole=whole), timeout)
        return r.kept

    async def reuse(self, session: str, epoch: int, keys: Sequence[bytes], chunk: int,
                    timeout: float | None = None) -> int:
        """Open new ``session`` at ``epoch`` on the caller's prefix entry holding the most of
        ``keys`` (``Worker.adopt``): the position it continues at, 0 for a miss."""
        r = await self._unary("reuse", self._stub.Reuse, dgr_pb2.ReuseRequest(
            session=session, epoch=epoch, keys=list(keys), chunk=chunk), timeout)
        return int(r.next_pos)

    async def fork(self, session: str, epoch: int, into: Sequence[str], into_epoch: int,
                   timeout: float | None = None) -> int:
        """Open ``into`` as copies of ``session`` at ``epoch`` (``Worker.fork``); the
        position they continue at."""
        r = await self._unary("fork", self._stub.Fork, dgr_pb2.ForkRequest(
            session=session, epoch=epoch, into=list(into), into_epoch=into_epoch), timeout)
        return int(r.next_pos)

    async def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False,
                       timeout: float | None = None) -> np.ndarray:
        r = await self._unary("tokenize", self._stub.Tokenize, dgr_pb2.TokenizeRequest(
            text=text, add_special=add_special, parse_special=parse_special), timeout)
        return np.asarray(r.tokens, dtype=np.int32)

    async def encode_media(self, prompt: str, media: Sequence[bytes], *,
                           add_special: bool = True, parse_special: bool = True,
                           first_pos: int = 0, encode_from: int = 0, max_pixels: int = 0,
                           timeout: float | None = None) -> list[dict]:
        """``prompt``'s chunks by the first stage's projector (``Worker.encode_media``): a
        dict each (``kind``, ``tokens``, ``n_rows``, ``n_pos``, ``id``, ``non_causal``; a
        media chunk from ``encode_from`` on its ``rows`` float32 ``[n_rows, width]`` and
        ``positions`` int32 ``[n_rows]`` or ``[4, n_rows]``; an earlier one none)."""
        r = await self._unary("encode_media", self._stub.EncodeMedia, dgr_pb2.EncodeMediaRequest(
            prompt=prompt, media=[bytes(m) for m in media], add_special=add_special,
            parse_special=parse_special, first_pos=first_pos, encode_from=encode_from,
            max_pixels=max_pixels), timeout)
        out = []
        for c in r.chunks:
            d = {"kind": c.kind, "tokens": list(c.tokens), "n_rows": c.n_rows, "n_pos": c.n_pos,
                 "id": c.id, "non_causal": c.non_causal, "width": c.width}
            if c.kind != "text" and c.rows:
                rows = np.frombuffer(c.rows, dtype="<f4").astype(np.float32)
                if not c.width or rows.size != c.n_rows * c.width:
                    raise errors.FrameError(
                        f"EncodeMedia: a {c.kind} chunk of {c.n_rows} rows came with "
                        f"{rows.size} floats of width {c.width}")
                pos = np.asarray(c.positions, dtype=np.int32)
                d["rows"] = rows.reshape(c.n_rows, c.width)
                d["positions"] = (pos.reshape(-1, c.n_rows) if pos.size != c.n_rows else pos)
            out.append(d)
        return out

    async def detokenize(self, tokens: Sequence[int], remove_special: bool = False,
                         unparse_special: bool = False, timeout: float | None = None) -> str:
        r = await self._unary("detokenize", self._stub.Detokenize, dgr_pb2.DetokenizeRequest(
            tokens=[int(t) for t in tokens], remove_special=remove_special,
            unparse_special=unparse_special), timeout)
        return r.text

    async def token_pieces(self, first: int, count: int, special: bool = False,
                           timeout: float | None = None) -> list[bytes]:
        """The bytes of token ids ``first`` .. ``first + count - 1`` as llama.cpp renders
        each alone (``count`` at most ``MAX_PIECES``; fewer past the vocabulary's end)."""
        r = await self._unary("token_pieces", self._stub.TokenPieces,
                              dgr_pb2.TokenPiecesRequest(first=first, count=count,
                                                         special=special), timeout)
        return list(r.pieces)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        """``"SERVING"``, ``"NOT_SERVING"``, ... (standard gRPC health checking)."""
        r = await self._unary("health", self._health.Check,
                              health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def stream(self, timeout: float = DEFAULT_STREAM_TIMEOUT) -> StepStream:
        """Open a Step stream (its whole life is bounded by ``timeout`` seconds)."""
        return StepStream(self, timeout)

    async def close(self) -> None:
        await self._channel.close()
