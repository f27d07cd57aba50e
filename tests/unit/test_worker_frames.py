"""The worker's per-frame data-plane work (dgr.worker.frames): the native path (C++ receive,
decode, encode of the head, gather send) puts the same bytes on the wire as the Python path
(dgr.protocol.wire), reads what a Python ``FrameSocket`` sends and the other way round, and
fails the same way on a broken stream."""

from __future__ import annotations

import socket
import threading

import msgspec
import numpy as np
import pytest

from dgr import errors
from dgr.protocol import wire
from dgr.transport.dataplane import LEN, MAX_FRAME, FrameSocket, Links
from dgr.worker import frames as frames_mod
from dgr.worker.frames import Frames, NativeFrameSocket

pytestmark = pytest.mark.skipif(not frames_mod.HAVE_NATIVE,
                                reason="the compiled core is not built")

HOPS = [wire.Hop(endpoint="127.0.0.1:40002", tokens=True), wire.Hop(endpoint="127.0.0.1:40003")]


def forward(n: int = 2, **kw) -> wire.Forward:
    base = dict(model="m:0123", session="s1", epoch=4, first_pos=7, n_tokens=n, layer=10,
                tokens=list(range(100, 100 + n)), want="token",
                sampling=wire.Sampling(temperature=0.7, top_k=40, top_p=0.9, seed=3),
                relay=HOPS, reply_to="route-1", loop=[wire.Hop(endpoint="127.0.0.1:40001")],
                steps=5, stop_tokens=[2], codec="raw")
    return wire.Forward(**{**base, **kw})


def boundary(n: int = 2, width: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width), dtype=np.float32)


def joined(pieces) -> bytes:
    head, payload = pieces
    return bytes(head) + (b"" if payload is None else np.ascontiguousarray(payload).tobytes())


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("hop_tokens", [True, False])
def test_relayed_forward_has_the_bytes_wire_encode_gives(native, hop_tokens):
    relay = [wire.Hop(endpoint="127.0.0.1:40002", tokens=hop_tokens), HOPS[1]]
    h, x = forward(relay=relay), boundary()
    got = joined(Frames(native).relay(h, x, 20, "raw", bytearray()))
    want = wire.encode(msgspec.structs.replace(h, layer=20, relay=relay[1:],
                                               tokens=h.tokens if hop_tokens else None), x)
    assert got == want
    back = wire.decode(got).header
    assert back.layer == 20 and back.relay == relay[1:]
    assert (back.tokens is not None) == hop_tokens


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("codec", ["raw", "f16"])
def test_a_relayed_step_keeps_its_speculative_fields(native, codec):
    """A verify step (Forward.drafts) of a speculating loop relayed on: rollback, drafts,
    speculate and max_draft reach the next stage unchanged, on the native path (relay_head)
    and the Python one, with the same bytes; a Result with drafted leaves alike."""
    h, x = forward(4, rollback=2, drafts=3, speculate="mtp", max_draft=5), boundary(4)
    f = Frames(native)
    got = joined(f.relay(h, x, 20, codec, bytearray()))
    nh = msgspec.structs.replace(h, layer=20, relay=h.relay[1:])
    assert got == wire.encode(nh, x, codec=codec)
    back = f.decode(memoryview(got)).header  # native for raw, wire.decode for f16
    assert (back.rollback, back.drafts, back.speculate, back.max_draft) == (2, 3, "mtp", 5)
    r = wire.Result(session="s1", epoch=4, first_pos=7, n_tokens=4, tokens=[9, 8, 7], drafted=3)
    sent = joined(f.result(r, None, "raw", False, bytearray()))
    assert sent == wire.encode(r) and f.decode(memoryview(sent)).header.drafted == 3


def test_relay_of_a_row_slice_sends_those_rows_uncopied():
    """The relayed payload is the engine's output rows themselves (a view, not a copy)."""
    out = boundary(8)
    head, payload = Frames(True).relay(forward(3), out[:3], 20, "raw", bytearray())
    assert np.shares_memory(payload, out)
    assert wire.decode(bytes(head) + payload.tobytes()).array.tobytes() == out[:3].tobytes()


@pytest.mark.parametrize("codec,compress", [("f16", False), ("raw", True), ("q8", True)])
def test_other_codecs_take_the_python_path_with_the_same_bytes(codec, compress):
    h = forward(compression="zstd" if compress else "none")
    x = boundary()
    f = Frames(True)
    got = joined(f.relay(h, x, 20, codec, bytearray()))
    nh = msgspec.structs.replace(h, layer=20, relay=h.relay[1:])
    assert got == wire.encode(nh, x, codec=codec, compress=compress)
    r = wire.Result(session="s", epoch=1, first_pos=0, n_tokens=2, kind="boundary", layer=20)
    assert joined(f.result(r, x, codec, compress, bytearray())) == wire.encode(
        r, x, codec=codec, compress=compress)


@pytest.mark.parametrize("native", [True, False])
def test_results_and_loop_frames_have_wire_encode_bytes(native):
    f = Frames(native)
    logits = boundary(1, 50)
    r = wire.Result(session="s", epoch=1, first_pos=9, n_tokens=1, kind="logits", tokens=[7])
    assert joined(f.result(r, logits, "raw", False, bytearray())) == wire.encode(r, logits)
    r = wire.Result(session="s", epoch=1, first_pos=9, n_tokens=1, tokens=[7])
    assert joined(f.result(r, None, "raw", False, bytearray())) == wire.encode(r)
    step = forward(1, layer=0, relay=HOPS[1:], tokens=[5])
    assert f.encode(step) == wire.encode(step)
    assert f.encode(wire.Hello(route="r")) == wire.encode(wire.Hello(route="r"))


def test_decode_is_native_for_raw_and_falls_back_for_codecs():
    f = Frames(True)
    h, x = forward(), boundary()
    frame = f.decode(memoryview(bytearray(wire.encode(h, x))))
    assert msgspec.structs.replace(frame.header, checksum=0, payload_len=0, width=0) == \
        msgspec.structs.replace(h, checksum=0, payload_len=0, width=0)
    assert frame.array.tobytes() == x.tobytes()
    assert (f.decoded_native, f.decoded_python) == (1, 0)
    frame = f.decode(wire.encode(h, x, codec="f16"))  # FrameNotNative: wire.decode
    assert frame.header.codec == "f16" and frame.array.shape == x.shape
    assert (f.decoded_native, f.decoded_python) == (1, 1)
    with pytest.raises(errors.FrameChecksumError):
        bad = bytearray(wire.encode(h, x))
        bad[-1] ^= 1
        f.decode(bad)
    off = Frames(False)
    off.decode(wire.encode(h, x))
    assert (off.decoded_native, off.decoded_python) == (0, 1)


def pair(a_class, b_class):
    a, b = socket.socketpair()
    return a_class(a, "a"), b_class(b, "b")


@pytest.mark.parametrize("sender,receiver", [(NativeFrameSocket, FrameSocket),
                                             (FrameSocket, NativeFrameSocket),
                                             (NativeFrameSocket, NativeFrameSocket)])
def test_sockets_interoperate_and_grow_their_buffer(sender, receiver):
    tx, rx = pair(sender, receiver)
    big = boundary(64, 576)  # 147 KB: more than the 64 KB a receive buffer starts with
    frames = [wire.encode(forward(1), boundary(1)), wire.encode(forward(64), big), b"",
              wire.encode(wire.Hello(route="r"))]

    def send():
        tx.send(frames[0])
        head, payload = Frames(True).relay(forward(64), big, 20, "raw", bytearray())
        tx.send_parts(head, payload)
        tx.send(frames[2])
        tx.send_parts(frames[3], None)
        tx.close()

    t = threading.Thread(target=send)
    t.start()
    got = []
    while (v := rx.recv()) is not None:
        got.append(bytes(v))
    t.join(10)
    relayed = wire.encode(msgspec.structs.replace(forward(64), layer=20, relay=HOPS[1:]), big)
    assert got == [frames[0], relayed, b"", frames[3]]
    rx.close()


@pytest.mark.parametrize("receiver", [NativeFrameSocket, FrameSocket])
@pytest.mark.parametrize("sent,error", [
    (LEN.pack(100) + b"x" * 10, ConnectionError),  # closed inside the frame
    (LEN.pack(MAX_FRAME + 1), errors.FrameTooLarge),  # a length past the limit
    (b"\x01\x00", ConnectionError),  # closed inside the length prefix
])
def test_a_broken_stream_fails_alike(receiver, sent, error):
    a, b = socket.socketpair()
    rx = receiver(b, "b")
    try:
        a.sendall(sent)
        a.close()
        with pytest.raises(error):
            rx.recv()
    finally:
        a.close()
        rx.close()


def test_native_pending_send_after_close_and_eof():
    tx, rx = pair(NativeFrameSocket, NativeFrameSocket)
    assert not rx.pending()
    tx.send(b"abc")
    deadline = threading.Event()
    for _ in range(100):  # the bytes are in the socket once send returned; poll says so
        if rx.pending():
            break
        deadline.wait(0.01)
    assert rx.pending()
    assert bytes(rx.recv()) == b"abc"
    tx.close()
    assert rx.recv() is None  # a clean end of stream
    with pytest.raises(OSError):
        tx.send(b"x")  # closed: no fd
    rx.close()
    assert not rx.pending()


def test_native_send_to_a_gone_peer_is_an_oserror_and_closes():
    tx, rx = pair(NativeFrameSocket, NativeFrameSocket)
    rx.sock.close()
    with pytest.raises(OSError):
        for _ in range(1000):  # the first writes may still be buffered: EPIPE follows
            tx.send_parts(b"h" * 1024, np.zeros(4096, np.float32))
    assert tx.closed


@pytest.mark.parametrize("conn_class", [FrameSocket, NativeFrameSocket])
def test_a_burst_leaves_at_its_end_as_one_write_in_order(conn_class, monkeypatch):
    srv = socket.create_server(("127.0.0.1", 0))
    links = Links(conn_class=conn_class)
    writes = []
    real = conn_class.send_many
    monkeypatch.setattr(conn_class, "send_many",
                        lambda self, frames: (writes.append(len(frames)), real(self, frames)))
    try:
        ep = f"127.0.0.1:{srv.getsockname()[1]}"
        links.get(ep)
        peer, _ = srv.accept()
        rx = FrameSocket(peer, "rx")
        x = boundary(2)
        reused = bytearray(b"first")
        with links.burst():
            links.send(ep, reused, None)
            reused[:] = b"XXXXX"  # a reused buffer: the burst kept a copy
            links.send(ep, b"head", x)
            links.send(ep, b"third")
            assert not rx.pending() and writes == []  # nothing left before the end
        assert writes == [3]
        assert [bytes(rx.recv()) for _ in range(3)] == [b"first", b"head" + x.tobytes(),
                                                        b"third"]
        rx.close()
    finally:
        links.close()
        srv.close()


@pytest.mark.parametrize("conn_class", [FrameSocket, NativeFrameSocket])
def test_a_burst_to_an_unreachable_stage_reports_each_frame(conn_class):
    srv = socket.create_server(("127.0.0.1", 0))
    ep = f"127.0.0.1:{srv.getsockname()[1]}"
    srv.close()  # nothing listens there now
    links = Links(connect_timeout=1.0, conn_class=conn_class)
    failed = []
    try:
        with links.burst():
            links.send(ep, b"a", None, failed.append)
            links.send(ep, b"b", None, failed.append)
        assert len(failed) == 2
        assert all(isinstance(e, errors.WorkerUnavailable) for e in failed)
        with pytest.raises(errors.WorkerUnavailable):  # outside a burst: raised as before
            links.send(ep, b"c")
    finally:
        links.close()


@pytest.mark.parametrize("conn_class", [FrameSocket, NativeFrameSocket])
def test_send_many_to_a_gone_peer_says_what_went_out(conn_class):
    a, b = socket.socketpair()
    tx = conn_class(a, "tx")
    b.close()
    with pytest.raises(OSError) as e:
        for _ in range(1000):
            tx.send_many([(b"h" * 1024, np.zeros(4096, np.float32)), (b"x", None)])
    assert e.value.sent == 0 and tx.closed


def test_a_busy_polling_receiver_gets_a_frame_sent_while_it_polls_and_after():
    """``spin``: the receiver polls for the first byte without sleeping, then blocks; a frame
    that comes while it polls, or only after it gave up polling, is read the same."""
    tx, rx = pair(NativeFrameSocket, NativeFrameSocket)
    rx.spin = 0.2
    frame = wire.encode(forward(1), boundary(1))
    try:
        for delay in (0.01, 0.4):  # within the 0.2 s of polling; after it
            t = threading.Timer(delay, lambda: tx.send(frame))
            t.start()
            assert bytes(rx.recv()) == frame
            t.join(10)
        tx.close()
        assert rx.recv() is None
    finally:
        rx.close()
