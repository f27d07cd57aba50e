"""The data plane's per-frame work of a worker, native or in Python (docs/dataplane.md).

A frame's way through a stage, with the native codec (``dgr._core._frame``, C++ in
``cpp/src/frame.cpp`` and ``cpp/src/frame_io.cpp``):

- **receive**: ``NativeFrameSocket.recv`` reads the length prefix and the frame into the
  connection's reused buffer in one call without the GIL;
- **validate and decode**: ``Frames.decode`` checks the frame in C++ (every rule of
  ``wire.decode``, the same error classes) and builds the same ``wire.Frame``; the boundary
  is a read-only view into the receive buffer, which the engine reads in place (a lone step:
  its batch rows point into the frame; a batch of several gathers them once);
- Python then admits the step against the session table (``StagePipeline.accept``, and
  ``lease`` when it runs) and commits it after the compute (``finish``): once each;
- **output and send**: ``Frames.relay`` / ``Frames.result`` encode a frame's bytes up to its
  payload in C++ (``relay_head`` reads the incoming header and writes the next stage's,
  without building a Python header), and ``send_parts`` sends them and the engine's output
  rows themselves as one gather write (``sendmsg`` of the length, the head and the rows): the
  output is never copied into a frame.

Codecs other than raw and zstd compression take the Python path (``dgr.protocol.wire``)
for that frame: ``FrameNotNative`` on decode, the codec named in the step on encode.
``Frames(native=False)`` takes it for every frame (``python -m dgr.worker --frames python``;
``benches/hot_path.py`` measures both). ``tests/unit/test_frame_native.py`` fuzzes the two
codecs against each other; ``tests/unit/test_worker_frames.py`` checks that both paths put
the same bytes on the wire.
"""

from __future__ import annotations

import threading

import msgspec
import numpy as np

from dgr import errors
from dgr.protocol import wire
from dgr.transport.dataplane import MAX_FRAME, FrameSocket

try:
    from dgr._core import _frame
except ImportError:  # a build without the compiled core: the Python codec only
    _frame = None

__all__ = ["Frames", "NativeFrameSocket", "HAVE_NATIVE"]

#: whether this build has the native frame codec and I/O
HAVE_NATIVE = _frame is not None


class NativeFrameSocket(FrameSocket):
    """A ``FrameSocket`` whose frame I/O runs in C++ without the GIL (one call per frame
    received or sent; the same framing, buffers and errors as ``FrameSocket``)."""

    #: seconds to poll for a frame's first byte before blocking (``Worker.busy_poll_s``)
    spin = 0.0

    def recv(self) -> memoryview | None:
        fd = self.sock.fileno()
        t = -1.0 if self.frame_timeout is None else self.frame_timeout
        n = _frame.recv_frame(fd, self._buf, MAX_FRAME, t, self.spin)
        if n < 0:
            return None
        if n > len(self._buf):  # larger than any frame before: grow, then read it
            self._view.release()
            self._buf = bytearray(n)
            self._view = memoryview(self._buf)
            _frame.recv_exact(fd, self._view[:n], t)
        return self._view[:n]

    def pending(self) -> bool:
        return _frame.readable(self.sock.fileno())

    def send(self, frame) -> None:
        self.send_parts(frame, None)

    def send_parts(self, head, payload=None) -> None:
        with self._send_lock:
            try:
                _frame.send_frame(self.sock.fileno(), head, payload)
            except OSError:
                self.close()
                raise

    def send_many(self, frames: list) -> None:
        with self._send_lock:
            try:
                _frame.send_frames(self.sock.fileno(), frames)
            except OSError as e:
                if not hasattr(e, "sent"):
                    e.sent = 0
                self.close()
                raise


class Frames:
    """A worker's frame codec: native (C++) where it can be, else ``dgr.protocol.wire``.

    Parameters
    ----------
    native : bool
        Use the native codec and I/O (when the build has them; ``HAVE_NATIVE``).
    max_payload : int
        Largest payload a frame may carry (``wire.decode``'s ``max_payload``).
    """

    def __init__(self, native: bool = True, max_payload: int = wire.MAX_PAYLOAD):
        self.native = bool(native) and HAVE_NATIVE
        self.max_payload = int(max_payload)
        #: the connection class of the data server and the relay links
        self.conn_class = NativeFrameSocket if self.native else FrameSocket
        #: frames decoded natively / by ``wire.decode`` (a non-raw codec, zstd, or native
        #: off), bad frames included; bumped under a lock (several connection threads)
        self.decoded_native = 0
        self.decoded_python = 0
        self._count = threading.Lock()

    def decode(self, view) -> wire.Frame:
        """Validate and decode a received frame (``wire.decode``'s result and errors)."""
        if self.native:
            try:
                frame = _frame.decode(view, max_payload=self.max_payload)
                with self._count:
                    self.decoded_native += 1
                return frame
            except errors.FrameNotNative:
                pass
            except errors.FrameError:
                with self._count:
                    self.decoded_native += 1
                raise
        with self._count:
            self.decoded_python += 1
        return wire.decode(view, max_payload=self.max_payload)

    def encode(self, header: wire.Message) -> bytes:
        """A frame without an array (``wire.encode(header)``'s bytes)."""
        if self.native and type(header) in (wire.Forward, wire.Result):
            return _frame.encode_frame(header)
        return wire.encode(header)

    def relay(self, h: wire.Forward, boundary: np.ndarray, layer: int, codec: str,
              buf: bytearray) -> tuple:
        """The ``Forward`` a stage relays: ``h`` for the next range (``layer``, the relay
        list without its first hop, token ids while a hop still to come needs them: one
        that routes by them, or a last stage that drafts from them) carrying ``boundary``.
        Returns the pieces to send, ``(head, payload)``; ``buf`` is the calling thread's
        reused frame buffer, for the Python path."""
        keep_tokens = any(hop.tokens for hop in h.relay)
        if self.native and codec == "raw" and h.compression != "zstd":
            return _frame.relay_head(h, boundary, layer, keep_tokens)
        nh = msgspec.structs.replace(h, layer=layer, relay=h.relay[1:],
                                     tokens=h.tokens if keep_tokens else None)
        wire.encode_into(nh, boundary, buf, codec=codec, compress=h.compression == "zstd")
        return buf, None

    def result(self, r: wire.Result, array: np.ndarray | None, codec: str, compress: bool,
               buf: bytearray) -> tuple:
        """A ``Result`` frame as the pieces to send, ``(head, payload)`` (see ``relay``)."""
        if self.native and codec == "raw" and not compress:
            return _frame.encode_head(r, array)
        wire.encode_into(r, array, buf, codec=codec, compress=compress)
        return buf, None
