"""TLS for the blocking data plane: one event-loop thread terminates every TLS connection.

The data plane's frame I/O (``FrameSocket``, and the native one in C++) reads and writes a
socket's file descriptor from several threads at once: a connection's reader, and the
compute threads that send replies on it. An OpenSSL connection may not be used that way, so
TLS is not put on that socket. Instead each TLS connection is terminated by asyncio on one
thread per process (``Tunnels``), which owns the TLS state alone, and is paired with one end
of a local ``socketpair``; the frame I/O gets the other end and works on it exactly as on a
TCP connection. What TLS costs a seam is that thread's work and one local copy each way
(benches/tls_seams.py measures it; docs/performance.md and docs/security.md give the
figures).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading

from dgr import errors

__all__ = ["Tunnels", "tunnels"]

#: seconds a TLS handshake may take
HANDSHAKE_TIMEOUT = 10.0
#: seconds a refused connection keeps reading (and dropping) before it closes, on plain TCP
#: (``dgr.transport.dataplane``) and through a tunnel (``Tunnels.linger``)
LINGER = 1.0


class _Pipe(asyncio.Protocol):
    """One side of a tunnel: what it receives is written to the other side (flow control
    passes through: a full side pauses reading on the other)."""

    def __init__(self, on_lost=None):
        self.transport: asyncio.Transport | None = None
        self.other: _Pipe | None = None
        self.held: list[bytes] = []  # received before the other side was up
        self.closed = False
        #: on the frame I/O's side of a served connection, set by ``Tunnels.linger`` (a
        #: refusal: one ErrorReply, then the close): once that side stops writing, the TLS
        #: side stays open this long, reading and dropping what the client sends, so that
        #: the client reads the answer instead of a reset. 0: it closes at once
        self.linger = 0.0
        self._lingering = False
        self._timed = False  # the other side's close is timed
        self._on_lost = on_lost

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        o = self.other
        if o is None or o.transport is None or self.held:  # in order: after what is held
            self.held.append(data)
        elif not o.closed:
            o.transport.write(data)

    def flush(self) -> None:
        """The other side is up: send what was held for it, and when this side has ended
        meanwhile, close the other now (after what was held) or after the linger."""
        o = self.other
        for data in self.held:
            o.transport.write(data)
        self.held.clear()
        if self.closed:
            if self._lingering:
                self._close_other_later()
            else:
                o.transport.close()

    def eof_received(self):
        if self.linger:
            # the other side closes later (now if it is up, else once it is: ``flush``);
            # it drops what it reads meanwhile
            self._lingering = True
            self._close_other_later()
        return False  # close this side; connection_lost closes the other (or the timer)

    def _close_other_later(self) -> None:
        o = self.other
        if o is not None and o.transport is not None and not o.closed and not self._timed:
            self._timed = True
            asyncio.get_running_loop().call_later(self.linger, o.close)

    def pause_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self._on_lost is not None:
            self._on_lost()
        o = self.other
        if (o is not None and o.transport is not None and not o.closed and not self._lingering
                and not self.held):  # held: ``flush`` sends it, then closes the other
            o.transport.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()


class Tunnels:
    """TLS terminations of one process, on one event-loop thread (module docstring)."""

    def __init__(self):
        #: the frame I/O side of each served connection, by ``id`` of its plaintext socket
        self._served: dict[int, _Pipe] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dgr-tls",
                                        daemon=True)
        self._thread.start()

    def wrap_accepted(self, sock: socket.socket, ctx: ssl.SSLContext,
                      handshake_timeout: float = HANDSHAKE_TIMEOUT) -> socket.socket:
        """The server side of an accepted TCP connection ``sock``: returns the plaintext
        end at once; the handshake runs on the tunnel thread and, when it fails or times
        out, that end sees EOF."""
        plain, inner = socket.socketpair()
        sock.setblocking(False)
        key = id(plain)
        inner_p = _Pipe(on_lost=lambda: self._served.pop(key, None))
        self._served[key] = inner_p
        asyncio.run_coroutine_threadsafe(
            self._serve(sock, inner, inner_p, ctx, handshake_timeout), self._loop)
        return plain

    def linger(self, plain: socket.socket, seconds: float = LINGER) -> None:
        """The served connection of ``plain`` is being refused: once its frame I/O stops
        writing, keep the TLS side open ``seconds`` more, dropping what arrives, so that
        the client gets the answer rather than a reset."""
        p = self._served.get(id(plain))
        if p is not None:
            p.linger = seconds

    async def _serve(self, sock, inner, inner_p, ctx, handshake_timeout) -> None:
        loop = self._loop
        outer_p = _Pipe()
        outer_p.other, inner_p.other = inner_p, outer_p
        try:
            await loop.connect_accepted_socket(lambda: inner_p, inner)
        except OSError:
            sock.close()
            inner.close()
            inner_p.connection_lost(None)  # never made: forget it
            return
        try:
            await loop.connect_accepted_socket(lambda: outer_p, sock, ssl=ctx,
                                               ssl_handshake_timeout=handshake_timeout)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, TimeoutError,
                ConnectionError):
            sock.close()
            inner_p.close()
            return
        inner_p.flush()

    def connect(self, host: str, port: int, ctx: ssl.SSLContext, timeout: float,
                server_hostname: str | None = None) -> socket.socket:
        """A TLS connection to ``host:port``, verified by ``ctx``: returns the plaintext end.

        Raises
        ------
        dgr.errors.WorkerUnavailable
            Not connected, or the handshake failed (a certificate not trusted, say), within
            ``timeout`` seconds.
        """
        fut = asyncio.run_coroutine_threadsafe(
            self._connect(host, port, ctx, timeout, server_hostname or host), self._loop)
        try:
            return fut.result(timeout + 1.0)
        except errors.WorkerUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - the future's own timeout included
            fut.cancel()
            fut.add_done_callback(_close_late)  # a connection made just too late is closed
            raise errors.WorkerUnavailable(f"{host}:{port}: TLS connection failed "
                                           f"({type(e).__name__}: {e})") from None

    async def _connect(self, host, port, ctx, timeout, server_hostname) -> socket.socket:
        loop = self._loop
        outer_p, inner_p = _Pipe(), _Pipe()
        outer_p.other, inner_p.other = inner_p, outer_p
        try:
            transport, _ = await asyncio.wait_for(loop.create_connection(
                lambda: outer_p, host, port, ssl=ctx, server_hostname=server_hostname,
                ssl_handshake_timeout=timeout), timeout)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, TimeoutError) as e:
            raise errors.WorkerUnavailable(f"{host}:{port}: TLS connection failed "
                                           f"({type(e).__name__}: {e})") from None
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        plain, inner = socket.socketpair()
        try:
            await loop.connect_accepted_socket(lambda: inner_p, inner)
        except BaseException:
            transport.close()
            plain.close()
            inner.close()
            raise
        outer_p.flush()
        return plain

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def _close_late(fut) -> None:
    """Close the plaintext end of a tunnel whose caller stopped waiting for it."""
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()


_tunnels: Tunnels | None = None
_lock = threading.Lock()


def tunnels() -> Tunnels:
    """The process's tunnel thread (started on first use)."""
    global _tunnels
    with _lock:
        if _tunnels is None:
            _tunnels = Tunnels()
        return _tunnels
