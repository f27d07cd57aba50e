"""The fast data plane: ``dgr.protocol.wire`` frames over persistent TCP connections
(docs/dataplane.md).

gRPC stays the control plane (describe, release, health) and the portable data plane (the
``Step`` stream). This module carries the same frames over plain TCP, each preceded by its
length (u32, little endian), for the hot path:

- a worker serves a data port next to its gRPC port (``DataServer``); one thread per
  connection reads frames into a reused buffer and hands them to the worker as views (the
  boundary is never copied in Python on its way into the engine);
- with direct relay a stage sends its output straight to the next stage over a pooled
  connection (``Links``) and only the last stage (or a stage that fails) answers the driver,
  on the driver's return connection for that route (``wire.Hello``);
- the driver side (``AsyncLink``) is an asyncio protocol that parses replies as they arrive.

With a ``Security`` (``dgr.transport.security``) a connection starts with TLS
(``dgr.transport.tls``) and its first frame authenticates it: the data server reads nothing
else before that frame's token is accepted.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import select
import socket
import struct
import threading
import time
from typing import Callable

from dgr import errors
from dgr.protocol import wire
from dgr.transport.security import AUTH_MAGIC, DENIED, MAX_TOKEN, Security, default_security
from dgr.transport.tls import LINGER, tunnels

__all__ = ["LEN", "MAX_FRAME", "FrameSocket", "DataServer", "Links", "AsyncLink",
           "connect", "split_endpoint"]

log = logging.getLogger("dgr.transport")

#: Every frame on a data-plane connection is preceded by its length in bytes.
LEN = struct.Struct("<I")
#: Largest frame accepted: the wire's own payload and header limits plus prefix and padding.
MAX_FRAME = wire.MAX_PAYLOAD + wire.MAX_HEADER + 4096
#: Largest authentication frame (a connection's first, when credentials are on)
MAX_AUTH_FRAME = len(AUTH_MAGIC) + MAX_TOKEN
#: Receive buffers start at this size and grow to the largest frame seen on the connection.
_INITIAL_BUFFER = 1 << 16


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise errors.InvalidArgument(f"not a host:port endpoint: {endpoint!r}") from None


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def connect(endpoint: str, timeout: float, security: Security | None = None) -> socket.socket:
    """A connected, tuned, blocking socket to ``endpoint``: TCP, or the plaintext end of a
    TLS connection (``dgr.transport.tls``) when ``security`` has TLS.

    Raises
    ------
    dgr.errors.WorkerUnavailable
        Not reachable (or the TLS handshake failed) within ``timeout`` seconds.
    """
    host, port = split_endpoint(endpoint)
    ctx = security.client_context() if security is not None else None
    if ctx is not None:
        return tunnels().connect(host, port, ctx, timeout)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise errors.WorkerUnavailable(f"{endpoint}: data plane unreachable ({e})") from None
    sock.settimeout(None)
    _tune(sock)
    return sock


class FrameSocket:
    """A blocking socket carrying length-prefixed frames.

    ``recv`` belongs to one thread and returns a view into a buffer that the next ``recv``
    overwrites; ``send`` may be called from any thread (a lock keeps frames whole).
    """

    def __init__(self, sock: socket.socket, name: str = "", frame_timeout: float | None = None):
        self.sock = sock
        self.name = name
        #: seconds a frame may take from its first byte to its last (None: unbounded); the
        #: wait for a frame's first byte is always unbounded (a connection idles between
        #: frames). A data server sets it: a peer that stalls inside a frame is cut off.
        self.frame_timeout = frame_timeout
        self._send_lock = threading.Lock()
        self._buf = bytearray(_INITIAL_BUFFER)
        self._view = memoryview(self._buf)
        self._len = bytearray(LEN.size)
        self._len_view = memoryview(self._len)
        self.closed = False
        #: set by the owner: e.g. the route id a driver named in its ``Hello``
        self.route = ""
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    def _fill(self, view: memoryview, deadline: float | None = None) -> float | None | bool:
        """Read exactly ``len(view)`` bytes; returns the frame's deadline (set from
        ``frame_timeout`` once a byte has arrived; None: unbounded), or False on a clean EOF
        before the first byte.

        Raises ``FrameTruncated`` when the deadline passes (no byte is waited for past it)."""
        got, n = 0, len(view)
        recv_into = self.sock.recv_into
        while got < n:
            part = view[got:] if got else view
            if deadline is None:
                k = recv_into(part)
            else:
                try:
                    k = recv_into(part, 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._poll.poll(left * 1e3):
                        raise errors.FrameTruncated(
                            f"frame not completed within {self.frame_timeout:g} s of its first "
                            "byte: the connection is closed") from None
                    continue
            if not k:
                if got or deadline is not None:
                    raise ConnectionError(f"connection closed inside a frame ({got}/{n} bytes)")
                return False
            got += k
            if deadline is None and self.frame_timeout is not None:
                deadline = time.monotonic() + self.frame_timeout
        return deadline

    def recv(self) -> memoryview | None:
        """The next frame (a view valid until the next ``recv``), or None at end of stream.

        Raises
        ------
        dgr.errors.FrameTooLarge
            The length prefix claims more than ``MAX_FRAME`` bytes (the stream is unusable).
        dgr.errors.FrameTruncated
            The frame did not arrive whole within ``frame_timeout`` of its first byte (the
            stream is unusable).
        ConnectionError, OSError
            The connection broke.
        """
        deadline = self._fill(self._len_view)
        if deadline is False:
            return None
        (size,) = LEN.unpack(self._len)
        if size > MAX_FRAME:
            raise errors.FrameTooLarge(f"frame of {size} bytes exceeds the data plane's "
                                       f"{MAX_FRAME}")
        if size > len(self._buf):
            self._view.release()
            self._buf = bytearray(size)
            self._view = memoryview(self._buf)
        view = self._view[:size]
        if size and self._fill(view, deadline) is False:
            raise ConnectionError("connection closed after a frame length")
        return view

    def pending(self) -> bool:
        """Whether bytes of a further frame already wait to be read (a poll, no wait)."""
        try:
            return bool(self._poll.poll(0))
        except (OSError, ValueError):  # closed
            return False

    def send(self, frame) -> None:
        """Send one frame (bytes-like); thread-safe.

        Raises
        ------
        OSError
            The connection broke (it is closed then).
        """
        size = len(frame) if not isinstance(frame, memoryview) else frame.nbytes
        head = LEN.pack(size)
        with self._send_lock:
            try:
                sent = self.sock.sendmsg((head, frame))
                total = LEN.size + size
                if sent < total:  # rare: a large frame and a full socket buffer
                    rest = memoryview(head + bytes(frame))[sent:] if sent < LEN.size else \
                        memoryview(frame).cast("B")[sent - LEN.size:]
                    self.sock.sendall(rest)
            except OSError:
                self.close()
                raise

    def send_parts(self, head, payload=None) -> None:
        """Send one frame given as two pieces, ``head`` then ``payload`` (bytes-like; None:
        none), in one gather write: a payload that is an engine's output array goes out
        without being copied into a frame first. Thread-safe.

        Raises
        ------
        OSError
            The connection broke (it is closed then).
        """
        if payload is None:
            self.send(head)
            return
        pay = memoryview(payload).cast("B")
        size = len(head) + pay.nbytes
        pieces = (LEN.pack(size), head, pay)
        with self._send_lock:
            try:
                sent = self.sock.sendmsg(pieces)
                if sent < LEN.size + size:  # rare: a full socket buffer
                    self.sock.sendall(memoryview(b"".join(pieces))[sent:])
            except OSError:
                self.close()
                raise

    def send_many(self, frames: list) -> None:
        """Send several frames, each ``(head, payload)`` as ``send_parts`` takes them, in
        order, as one gather write. Thread-safe.

        Raises
        ------
        OSError
            The connection broke (it is closed then); its ``sent`` attribute is the bytes
            that went out before (0: none of the frames did).
        """
        pieces = []
        for head, payload in frames:
            pay = b"" if payload is None else memoryview(payload).cast("B")
            pieces += (LEN.pack(len(head) + len(pay)), head, pay)
        if len(pieces) > 1000:  # the kernel's IOV_MAX is 1024 pieces
            pieces = [b"".join(pieces)]
        sent = 0
        with self._send_lock:
            try:
                sent = self.sock.sendmsg(pieces)
                total = sum(len(p) for p in pieces)
                if sent < total:  # rare: a full socket buffer
                    self.sock.sendall(memoryview(b"".join(pieces))[sent:])
            except OSError as e:
                e.sent = sent
                self.close()
                raise

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _refuse(conn: FrameSocket, exc: BaseException, linger: float = LINGER) -> None:
    """Answer ``exc`` as one ``ErrorReply``, then close without a reset: stop writing, and
    read and drop what the peer already sent, for at most ``linger`` seconds (a close with
    unread bytes sends a TCP reset, which can cost the peer the answer)."""
    sock = conn.sock
    try:
        conn.send(wire.encode(wire.ErrorReply.from_exception(exc)))
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + linger
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(65536):
                break
    except (OSError, ValueError):
        pass


class DataServer:
    """Accepts data-plane connections; runs ``handler(conn)`` on a thread per connection.

    ``handler`` reads frames with ``conn.recv()`` until it returns None and must not raise
    for a bad frame (it answers with an ``ErrorReply``); the connection is closed after it
    returns.
    """

    def __init__(self, handler: Callable[[FrameSocket], None], host: str = "127.0.0.1",
                 port: int = 0, max_connections: int = 256,
                 conn_class: type[FrameSocket] | None = None,
                 max_per_address: int | None = 64, frame_timeout: float | None = 30.0,
                 security: Security | None = None, auth_timeout: float = 10.0):
        self.handler = handler
        #: credentials accepted (``security.keys``: every connection's first frame must
        #: authenticate it) and TLS (``security.tls``); None: neither
        self.security = security
        self._tls = security.server_context() if security is not None else None
        #: seconds from accept to the end of the authentication frame (and the handshake)
        self.auth_timeout = auth_timeout
        #: the class of the accepted connections (a ``FrameSocket`` with native I/O, say)
        self.conn_class = conn_class or FrameSocket
        #: connections beyond this many get an ``ErrorReply`` (ResourceExhausted) and are
        #: closed: each one holds a thread
        self.max_connections = max_connections
        #: the same, per remote address (None: no cap but the total): one peer cannot
        #: take every connection
        self.max_per_address = max_per_address
        #: seconds a frame may take from its first byte to its last on an accepted
        #: connection (``FrameSocket.frame_timeout``; None: unbounded): a peer that sends a
        #: length and stalls is answered ``FrameTruncated`` and cut off
        self.frame_timeout = frame_timeout
        self.refused = 0
        self._per_address: collections.Counter[str] = collections.Counter()
        #: refused connections being answered and closed without a reset (``_turn_away``)
        self._refusing = threading.BoundedSemaphore(32)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise errors.InvalidArgument(f"cannot listen on {host}:{port} (data plane): {e}") \
                from None
        self._sock.listen(128)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._conns: set[FrameSocket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="dgr-data-accept",
                                        daemon=True)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> DataServer:
        self._thread.start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return  # closed
            _tune(sock)
            t_accept = time.monotonic()
            if self._tls is not None:  # TLS ends on the tunnel thread; frames use the rest
                sock = tunnels().wrap_accepted(sock, self._tls, self.auth_timeout)
            conn = self.conn_class(sock, f"{peer[0]}:{peer[1]}", self.frame_timeout)
            conn.peer_address = addr = peer[0]
            conn.t_accept = t_accept
            conn.credential = None
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                why = ""
                if len(self._conns) >= self.max_connections:
                    why = f"this worker serves at most {self.max_connections} data connections"
                elif (self.max_per_address is not None
                      and self._per_address[addr] >= self.max_per_address):
                    why = (f"this worker serves at most {self.max_per_address} data "
                           "connections from one address")
                else:
                    self._conns.add(conn)
                    self._per_address[addr] += 1
            if why:
                self.refused += 1
                exc = errors.ResourceExhausted(why)
                if self._tls is not None:
                    tunnels().linger(conn.sock)
                # the answer, then a close without a reset (the peer may have sent its first
                # frame already: closing with it unread would reset the connection and could
                # cost the peer the answer), off the accept thread, a bounded few at a time
                if self._refusing.acquire(blocking=False):
                    threading.Thread(target=self._turn_away, args=(conn, exc),
                                     name="dgr-data-refuse", daemon=True).start()
                else:  # a flood of refusals: answer and close at once
                    try:
                        conn.send(wire.encode(wire.ErrorReply.from_exception(exc)))
                    except OSError:
                        pass
                    conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="dgr-data-conn",
                             daemon=True).start()

    def _turn_away(self, conn: FrameSocket, exc: BaseException) -> None:
        try:
            _refuse(conn, exc)
        finally:
            conn.close()
            self._refusing.release()

    def _serve(self, conn: FrameSocket) -> None:
        try:
            sec = self.security
            if sec is not None and sec.keys is not None:
                try:
                    conn.credential = sec.verify_auth_frame(self._first_frame(conn))
                except errors.Unauthenticated as e:
                    if self._tls is not None:
                        tunnels().linger(conn.sock)
                    _refuse(conn, e)
                    return
            self.handler(conn)
        except (ConnectionError, OSError) as e:
            if not conn.closed:
                log.debug("data connection %s broke: %s", conn.name, e)
        except Exception:  # noqa: BLE001 - a handler bug must not go unnoticed
            log.exception("data connection %s failed", conn.name)
        finally:
            conn.close()
            with self._lock:
                if conn in self._conns:
                    self._conns.discard(conn)
                    self._per_address[conn.peer_address] -= 1
                    if not self._per_address[conn.peer_address]:
                        del self._per_address[conn.peer_address]

    def _first_frame(self, conn: FrameSocket) -> bytes:
        """The connection's first frame, read directly off its socket, which must be
        whole within ``auth_timeout`` of the accept and no longer than an authentication
        frame can be; nothing after it is read.

        Raises
        ------
        dgr.errors.Unauthenticated
            Too long, too late, or the connection ended first.
        """
        sock = conn.sock
        deadline = conn.t_accept + self.auth_timeout

        def read(n: int) -> bytes:
            buf = bytearray(n)
            view, got = memoryview(buf), 0
            while got < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise errors.Unauthenticated(DENIED)
                sock.settimeout(left)
                try:
                    k = sock.recv_into(view[got:])
                except (TimeoutError, OSError):
                    raise errors.Unauthenticated(DENIED) from None
                if not k:
                    raise errors.Unauthenticated(DENIED)
                got += k
            return bytes(buf)

        try:
            (size,) = LEN.unpack(read(LEN.size))
            if size > MAX_AUTH_FRAME:
                raise errors.Unauthenticated(DENIED)
            return read(size)
        finally:
            try:
                sock.settimeout(None)
            except OSError:
                pass

    def stop(self) -> None:
        """Stop accepting and close every connection."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for c in conns:
            c.close()


class Links:
    """Outgoing data-plane connections of a worker, one per next-hop endpoint, reused.

    A reader thread per link notices when the peer goes away (EOF), so the next send
    reconnects instead of writing into a dead connection.
    """

    def __init__(self, connect_timeout: float = 2.0, conn_class: type[FrameSocket] | None = None,
                 security: Security | None = None):
        self.connect_timeout = connect_timeout
        self.conn_class = conn_class or FrameSocket
        #: the credential presented (the first frame of every link) and TLS to the next
        #: stages; None: ``default_security()``
        self.security = security if security is not None else default_security()
        self._tls = threading.local()  # .pending: a burst's frames per endpoint, or None
        self._links: dict[str, FrameSocket] = {}
        self._lock = threading.Lock()

    def get(self, endpoint: str) -> FrameSocket:
        link = self._links.get(endpoint)
        if link is not None and not link.closed:
            return link
        with self._lock:
            link = self._links.get(endpoint)
            if link is not None and not link.closed:
                return link
            link = self.conn_class(connect(endpoint, self.connect_timeout, self.security),
                                   endpoint)
            auth = self.security.auth_frame()
            if auth is not None:
                try:
                    link.send(auth)
                except OSError as e:
                    link.close()
                    raise errors.WorkerUnavailable(
                        f"{endpoint}: data plane send failed ({e})") from None
            self._links[endpoint] = link
        threading.Thread(target=self._watch, args=(link,), name="dgr-data-link",
                         daemon=True).start()
        return link

    @staticmethod
    def _watch(link: FrameSocket) -> None:
        try:
            while link.recv() is not None:
                pass  # a next stage never writes on a relay link; drop whatever comes
        except (ConnectionError, OSError, errors.DgrError):
            pass
        link.close()

    @contextlib.contextmanager
    def burst(self):
        """Frames this thread sends inside the block wait and leave at its end as one write
        per endpoint, in order (``FrameSocket.send_many``), so the next stage receives them
        together. A frame that then cannot be sent gets its ``on_error`` called with the
        ``WorkerUnavailable``; the payloads must stay valid until the block ends."""
        if getattr(self._tls, "pending", None) is not None:  # nested: the outer one sends
            yield
            return
        self._tls.pending = pending = {}
        try:
            yield
        finally:
            self._tls.pending = None
            for endpoint, items in pending.items():
                self._flush(endpoint, items)

    def _flush(self, endpoint: str, items: list) -> None:
        err: Exception | None = None
        for attempt in (0, 1):
            try:
                self.get(endpoint).send_many([(h, p) for h, p, _ in items])
                return
            except errors.WorkerUnavailable as e:
                err = e
                break
            except OSError as e:
                err = errors.WorkerUnavailable(
                    f"next stage {endpoint}: data plane send failed ({e})")
                if getattr(e, "sent", 0):  # some frames went out: resending could repeat them
                    break
        for _, _, on_error in items:
            if on_error is not None:
                try:
                    on_error(err)
                except Exception:  # noqa: BLE001 - every frame hears of the failure
                    log.exception("reporting a failed send")

    def send(self, endpoint: str, frame, payload=None, on_error=None) -> None:
        """Send ``frame`` (or the pieces ``frame`` + ``payload``, ``FrameSocket.send_parts``)
        to ``endpoint``; reconnects once if the pooled link broke. Inside ``burst`` the
        frame waits for the end of the block (``frame`` is copied when it is a reused
        bytearray), and a failure then goes to ``on_error(exc)`` instead.

        Raises
        ------
        dgr.errors.WorkerUnavailable
            The endpoint cannot be reached.
        """
        pending = getattr(self._tls, "pending", None)
        if pending is not None:
            head = bytes(frame) if isinstance(frame, bytearray) else frame
            pending.setdefault(endpoint, []).append((head, payload, on_error))
            return
        for attempt in (0, 1):
            link = self.get(endpoint)
            try:
                link.send_parts(frame, payload)
                return
            except OSError as e:
                if attempt:
                    raise errors.WorkerUnavailable(
                        f"next stage {endpoint}: data plane send failed ({e})") from None

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()


# --- driver side (asyncio) --------------------------------------------------------------


class _Protocol(asyncio.Protocol):
    def __init__(self, link: AsyncLink):
        self.link = link
        self.buf = bytearray()

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                _tune(sock)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        n = len(buf)
        off = 0
        while n - off >= 4:
            (size,) = LEN.unpack_from(buf, off)
            if size > MAX_FRAME:
                self.link._lost(errors.FrameTooLarge(f"reply of {size} bytes"))
                self.link.transport.close()
                return
            if n - off - 4 < size:
                break
            frame = bytes(buf[off + 4:off + 4 + size])
            off += 4 + size
            self.link.on_frame(self.link, frame)
        if off:
            del buf[:off]

    def connection_lost(self, exc) -> None:
        self.link._lost(exc)
        self.link.gone.set()


class AsyncLink:
    """A driver's connection to one worker's data port (asyncio).

    ``on_frame(link, frame_bytes)`` is called for every frame the worker sends;
    ``on_lost(link, exc)`` once when the connection ends.
    """

    def __init__(self, endpoint: str, on_frame, on_lost, index: int = 0):
        self.endpoint = endpoint
        self.on_frame = on_frame
        self.on_lost = on_lost
        self.index = index
        self.transport: asyncio.Transport | None = None
        self.closed = False
        #: set once the connection is gone (its transport's ``connection_lost``)
        self.gone = asyncio.Event()

    async def open(self, timeout: float, hello: wire.Hello | None = None,
                   security: Security | None = None) -> AsyncLink:
        """Connect (TLS and the authentication frame first when ``security`` says so;
        None: ``default_security()``), then send ``hello``."""
        host, port = split_endpoint(self.endpoint)
        loop = asyncio.get_running_loop()
        sec = security if security is not None else default_security()
        ctx = sec.client_context()
        tls = {"ssl": ctx, "server_hostname": host} if ctx is not None else {}
        try:
            self.transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: _Protocol(self), host, port, **tls), timeout)
        except (OSError, asyncio.TimeoutError, TimeoutError) as e:
            self.closed = True
            raise errors.WorkerUnavailable(
                f"{self.endpoint}: data plane unreachable ({type(e).__name__}: {e})") from None
        auth = sec.auth_frame()
        if auth is not None:
            self.send(auth)
        if hello is not None:
            self.send(wire.encode(hello))
        return self

    def send(self, frame: bytes) -> None:
        if self.closed or self.transport is None:
            raise errors.WorkerUnavailable(f"{self.endpoint}: the data connection is closed")
        self.transport.writelines((LEN.pack(len(frame)), frame))

    def _lost(self, exc) -> None:
        if self.closed:
            return
        self.closed = True
        self.on_lost(self, exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def wait_closed(self, timeout: float = 1.0) -> None:
        """After ``close``: wait (at most ``timeout`` s) until the connection is gone. A TLS
        connection's close takes a few turns of the event loop (its close_notify), which a
        caller about to stop its loop must give it."""
        if self.transport is None:
            return
        try:
            await asyncio.wait_for(self.gone.wait(), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            self.transport.abort()
