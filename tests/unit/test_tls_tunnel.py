"""The TLS tunnel's two sides (dgr.transport.tls._Pipe), driven event by event: the order in
which a refused connection's events arrive decides whether the client reads its answer."""

import asyncio

from dgr.transport.tls import _Pipe


class _Transport:
    def __init__(self):
        self.written: list[bytes] = []
        self.closed_at: float | None = None

    def write(self, data: bytes) -> None:
        assert self.closed_at is None, "written after the close"
        self.written.append(data)

    def close(self) -> None:
        if self.closed_at is None:
            self.closed_at = asyncio.get_running_loop().time()

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _pair(linger: float):
    frames, tls = _Pipe(on_lost=lambda: None), _Pipe()  # the frame I/O side, the TLS side
    frames.other, tls.other = tls, frames
    frames.linger = linger
    frames.connection_made(_Transport())
    return frames, tls


def _refused_before_the_handshake_ends(linger: float):
    """The refusal (answer, then EOF) reaches the tunnel while the TLS handshake runs; the
    handshake ends between the EOF and the close of the frame side."""

    async def go():
        loop = asyncio.get_running_loop()
        frames, tls = _pair(linger)
        frames.data_received(b"answer")
        assert frames.eof_received() is False
        tls.connection_made(out := _Transport())  # the handshake ends here
        frames.connection_lost(None)
        assert out.closed_at is None, "the TLS side closed before the answer was sent"
        t0 = loop.time()
        frames.flush()  # what the tunnel does once the handshake is over
        assert out.written == [b"answer"]
        tls.data_received(b"what the client sent")  # dropped, no error
        await asyncio.sleep(linger + 0.2)
        assert out.closed_at is not None, "the TLS side never closed"
        return out.closed_at - t0

    return asyncio.run(go())


def test_a_refusal_that_ends_during_the_handshake_lingers_once_it_is_over():
    assert _refused_before_the_handshake_ends(0.3) >= 0.3


def test_a_side_that_ends_during_the_handshake_without_a_linger_closes_the_other_after_it():
    assert _refused_before_the_handshake_ends(0.0) < 0.1


def test_a_refusal_after_the_handshake_lingers_then_closes():
    async def go():
        loop = asyncio.get_running_loop()
        frames, tls = _pair(0.3)
        tls.connection_made(out := _Transport())
        frames.flush()
        t0 = loop.time()
        frames.data_received(b"answer")
        frames.eof_received()
        frames.connection_lost(None)
        tls.data_received(b"late")
        assert out.closed_at is None
        await asyncio.sleep(0.5)
        assert out.written == [b"answer"] and out.closed_at - t0 >= 0.3

    asyncio.run(go())


def test_a_client_whose_server_closed_before_its_side_was_up_reads_then_sees_the_end():
    """The client's TLS side ends (the server closed) before the frame side is connected:
    once it is, the frame side gets what arrived, then the close (not an open socket that
    never answers)."""

    async def go():
        tls, frames = _Pipe(), _Pipe()
        tls.other, frames.other = frames, tls
        tls.connection_made(_Transport())
        tls.data_received(b"answer")
        tls.eof_received()
        tls.connection_lost(None)
        frames.connection_made(inner := _Transport())
        tls.flush()
        assert inner.written == [b"answer"] and inner.closed_at is not None

    asyncio.run(go())


def test_what_arrives_between_the_other_side_coming_up_and_the_flush_keeps_its_order():
    async def go():
        frames, tls = _pair(0.0)
        frames.data_received(b"1")
        tls.connection_made(out := _Transport())
        frames.data_received(b"2")  # the tunnel has not flushed yet
        frames.flush()
        frames.data_received(b"3")
        assert out.written == [b"1", b"2", b"3"]

    asyncio.run(go())
