"""Limits of the data plane that hold under abuse (issue "Security"): a frame's deadline (a
peer that sends a length, or part of a frame, and stalls is cut off; an idle connection is
not), the cap on connections per remote address, and the relay allowlist's matching."""

from __future__ import annotations

import socket
import time

import pytest

from dgr import errors
from dgr.protocol import wire
from dgr.transport.dataplane import LEN, DataServer, FrameSocket
from dgr.worker.trust import RelayPolicy

try:
    from dgr.worker.frames import HAVE_NATIVE, NativeFrameSocket
except ImportError:  # pragma: no cover - the worker package always imports
    HAVE_NATIVE = False

CLASSES = [FrameSocket] + ([NativeFrameSocket] if HAVE_NATIVE else [])
WAIT = 10.0


def serve(conn: FrameSocket) -> None:
    """As a worker's data connection: echo frames; a bad stream gets an ErrorReply."""
    while True:
        try:
            view = conn.recv()
        except errors.FrameError as e:
            conn.send(wire.encode(wire.ErrorReply.from_exception(e)))
            return
        if view is None:
            return
        conn.send(bytes(view))


def client(server: DataServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
    return s


def read_frame(s: socket.socket) -> bytes | None:
    head = b""
    while len(head) < 4:
        got = s.recv(4 - len(head))
        if not got:
            return None
        head += got
    (n,) = LEN.unpack(head)
    body = b""
    while len(body) < n:
        got = s.recv(n - len(body))
        assert got, "closed inside a frame"
        body += got
    return body


@pytest.fixture(params=CLASSES, ids=lambda c: c.__name__)
def server(request):
    srv = DataServer(serve, conn_class=request.param, frame_timeout=0.3,
                     max_per_address=2).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("sent", [b"\x10\x00", LEN.pack(100) + b"x" * 10],
                         ids=["inside the length", "inside the frame"])
def test_a_stalled_frame_is_answered_and_cut_off(server, sent):
    s = client(server)
    try:
        s.sendall(sent)  # ... and nothing more, ever
        reply = read_frame(s)
        err = wire.decode(reply).header
        assert type(err) is wire.ErrorReply and err.code == errors.FrameTruncated.code
        assert "not completed within" in err.message
        assert read_frame(s) is None  # the server closed the connection
    finally:
        s.close()


def test_a_slow_drip_is_cut_off_too(server):
    """One byte at a time, each well within the deadline, the frame never whole in time."""
    s = client(server)
    try:
        s.sendall(LEN.pack(64))
        with pytest.raises(OSError):  # the server closes: a write fails, or the read says so
            for _ in range(200):
                s.sendall(b"x")
                time.sleep(0.01)
                s.settimeout(0)
                try:
                    if s.recv(65536) == b"":
                        raise ConnectionResetError("closed")
                except BlockingIOError:
                    pass
                finally:
                    s.settimeout(WAIT)
    finally:
        s.close()


def test_an_idle_connection_is_not_cut_off(server):
    s = client(server)
    try:
        time.sleep(0.8)  # longer than the frame deadline, between frames: allowed
        frame = wire.encode(wire.Hello(route="r"))
        s.sendall(LEN.pack(len(frame)) + frame)
        assert read_frame(s) == frame
    finally:
        s.close()


def test_a_refused_connection_that_already_sent_gets_the_answer_not_a_reset(server):
    # a client sends its first frame (an auth frame, a Hello) as soon as it connects: a
    # refusal that closed with those bytes unread would reset the connection, and the reset
    # discards the answer on the client's side before it reads it (the soak's flood saw one)
    held = [client(server), client(server)]
    frame = wire.encode(wire.Hello(route="r"))
    try:
        for s in held:
            s.sendall(LEN.pack(len(frame)) + frame)
            assert read_frame(s) == frame
        for _ in range(5):
            c = client(server)
            c.sendall(LEN.pack(len(frame)) + frame)
            time.sleep(0.2)  # the refusal and its close are in before the client reads
            err = wire.decode(read_frame(c)).header
            assert err.code == errors.ResourceExhausted.code
            assert read_frame(c) is None
            c.close()
    finally:
        for s in held:
            s.close()


def test_connections_per_address_are_capped_and_freed(server):
    a, b = client(server), client(server)
    frame = wire.encode(wire.Hello(route="r"))
    try:
        for s in (a, b):  # both served
            s.sendall(LEN.pack(len(frame)) + frame)
            assert read_frame(s) == frame
        c = client(server)
        err = wire.decode(read_frame(c)).header
        assert err.code == errors.ResourceExhausted.code and "one address" in err.message
        assert read_frame(c) is None
        c.close()
        a.close()  # frees its place once the server sees it go
        deadline = time.monotonic() + WAIT
        while True:
            d = client(server)
            d.sendall(LEN.pack(len(frame)) + frame)
            got = read_frame(d)
            if got == frame:
                d.close()
                break
            d.close()
            assert time.monotonic() < deadline, "a closed connection's place never came back"
            time.sleep(0.05)
    finally:
        a.close()
        b.close()


# --- the relay allowlist ---------------------------------------------------------------------

@pytest.mark.parametrize("allow,endpoint,ok", [
    (None, "127.0.0.1:7000", True),
    (None, "127.9.9.9:1", True),
    (None, "[::1]:7000", True),
    (None, "localhost:7000", True),
    (None, "10.0.0.5:7000", False),
    (None, "example.org:7000", False),
    (None, "[fd00::1]:7000", False),
    (["10.213.0.0/24"], "10.213.0.7:7000", True),
    (["10.213.0.0/24"], "10.213.1.7:7000", False),
    (["10.213.0.0/24"], "127.0.0.1:7000", False),  # an explicit list replaces loopback
    (["10.0.0.5:7001"], "10.0.0.5:7001", True),
    (["10.0.0.5:7001"], "10.0.0.5:7002", False),
    (["stage-2.internal"], "stage-2.internal:9", True),
    (["stage-2.internal"], "stage-2.internal.evil:9", False),
    (["Stage-2.Internal:9"], "stage-2.internal:9", True),
    (["[fd00::/8]:7000"], "[fd00::1]:7000", True),
    (["fd00::/8"], "[fd00::1]:1", True),
    (["fd00::/8"], "[fe80::1]:1", False),
    (["*"], "203.0.113.9:1", True),
    ([], "127.0.0.1:1", False),
])
def test_relay_policy_matches(allow, endpoint, ok):
    p = RelayPolicy(allow)
    assert p.allows(endpoint) is ok
    if not ok:
        with pytest.raises(errors.RelayRefused) as e:
            p.check(endpoint, "Forward.relay")
        assert endpoint in str(e.value) and "--relay-allow" in str(e.value)


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "host:port", "/8", "a/b:1"])
def test_relay_policy_refuses_bad_entries(bad):
    with pytest.raises(errors.InvalidArgument):
        RelayPolicy([bad])


def test_a_bad_relay_allowlist_stops_the_worker_before_it_loads_a_model(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "dgr.worker", "--model", str(tmp_path / "none.gguf"),
                        "--relay-allow", "10.0.0.0/24,10.0.0.0/33"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "relay allowlist entry '10.0.0.0/33'" in p.stderr
    assert "none.gguf" not in p.stderr  # it never got as far as the model


@pytest.mark.parametrize("args,words", [
    (["--busy-poll-us", "500", "--frames", "python"], "(--busy-poll-us) needs the native frame"),
    (["--busy-poll-us", "-1"], "busy_poll_s (--busy-poll-us) must be >= 0"),
    (["--prefix-entries", "-1"], "prefix_entries (--prefix-entries) must be >= 0"),
])
def test_busy_polling_the_worker_cannot_honour_is_refused_before_it_loads(tmp_path, capsys,
                                                                          args, words):
    from dgr.worker.main import main

    assert main(["--model", str(tmp_path / "none.gguf"), *args]) == 2
    err = capsys.readouterr().err
    assert words in err and "none.gguf" not in err  # it never got as far as the model
