"""Direct relay over the fast data plane (docs/dataplane.md): real engines, loopback TCP."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.core.local import generate_local
from dgr.driver.route import AsyncRoute, Route
from dgr.protocol import wire
from dgr.protocol.sampling import SamplingParams
from dgr.testing.waits import WAIT_S
from dgr.testing.stages import threaded_stages
from dgr.testing.waits import wait_until as _wait_until
from dgr.transport import dataplane
from dgr.worker.frames import Frames
from dgr.worker.process import ThreadedWorker

pytestmark = pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the patched llama.cpp")

SETTINGS = dict(n_ctx=128, n_slots=4, n_threads=1, n_ubatch=8)
RANGES = ((0, 1), (1, 3), (3, 4))
PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 120, 37)]  # 5 chunks of <= 8


class _Positions:
    """Records the ``first_pos`` of each data-plane step once method ``name`` has returned
    for it, on whichever thread ran it: a worker's ``_data_done`` (handled: its reply, relay
    and loop step all sent) or its pipeline's ``finish`` (computed), for waits on a step
    instead of time."""

    def __init__(self, worker, name: str):
        self.positions: list[int] = []
        self._cond = threading.Condition()
        real = getattr(worker, name)

        def hook(*args):
            step = args[-2] if name == "_data_done" else args[0]
            try:
                real(*args)
            finally:
                with self._cond:
                    self.positions.append(step.header.first_pos)
                    self._cond.notify_all()

        setattr(worker, name, hook)

    def wait(self, pos: int, timeout: float = WAIT_S) -> bool:
        """Whether the stage got that far with position ``pos`` within ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: pos in self.positions, timeout)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return dgr.Engine(tiny_llama, **SETTINGS)


@pytest.fixture(scope="module")
def stages(tiny_llama):
    with threaded_stages(tiny_llama, RANGES, SETTINGS, evict_after=3600.0) as ws:
        yield ws


def test_relay_matches_the_whole_model_bit_for_bit(stages, reference):
    ref, rows = generate_local(reference, PROMPT, max_tokens=12, logits=True, stop_on_eog=False)
    with Route([w.address for w in stages], relay=True) as r:
        assert all(st.data_port for st in r.stages)
        s = r.session()
        g = s.complete(PROMPT, max_tokens=12, logits=True, stop_on_eog=False)
        assert g.tokens == ref
        assert len(g.logits) == len(rows) == 12
        assert all(x.tobytes() == y.tobytes() for x, y in zip(g.logits, rows))
        # each token's arrival, in order, within the generation's decode time
        ts = g.token_times
        assert len(ts) == 12 and ts == sorted(ts) and 0 < ts[-1] - ts[0] <= g.decode_s
        # 5 prompt chunks (pipelined, one reply each) + 11 decode steps, all relayed
        assert s.inner.steps[:5] == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 5)]
        assert r.aroute.relay_steps == 5 + 11
        s.close()
    # the workers computed every step; none came over gRPC
    assert all(w.worker.pipeline.steps_total >= 16 for w in stages)
    # every frame took the native path (C++ receive and decode; raw codec)
    assert all(w.worker.frames.native and w.worker.frames.decoded_native >= 16
               and w.worker.frames.decoded_python == 0 for w in stages)


def test_python_frame_path_gives_the_same_bits(tiny_llama, reference):
    """Workers with the Python frame path (``--frames python``) serve the same tokens and
    logits as the whole model, and decoded every frame with ``wire.decode``."""
    ref, rows = generate_local(reference, PROMPT, max_tokens=6, logits=True, stop_on_eog=False)
    ws = [ThreadedWorker(dgr.Engine(tiny_llama, layers=r, **SETTINGS), native_frames=False)
          for r in RANGES]
    try:
        with Route([w.address for w in ws], relay=True) as r:
            g = r.session().complete(PROMPT, max_tokens=6, logits=True, stop_on_eog=False)
            assert g.tokens == ref
            assert all(x.tobytes() == y.tobytes() for x, y in zip(g.logits, rows))
            assert r.aroute.relay_steps == 5 + 5
        assert all(not w.worker.frames.native and w.worker.frames.decoded_native == 0
                   and w.worker.frames.decoded_python >= 10 for w in ws)
    finally:
        for w in ws:
            w.stop()


def test_relay_sampling_and_concurrent_sessions(stages, reference):
    sp = SamplingParams(temperature=0.8, top_k=20, seed=7)
    ref, _ = generate_local(reference, PROMPT, max_tokens=10, sampling=sp, stop_on_eog=False)
    prompts = [PROMPT[i:] for i in range(4)]
    refs = [generate_local(reference, p, max_tokens=10, stop_on_eog=False)[0] for p in prompts]

    async def go():
        async with AsyncRoute([w.address for w in stages], relay=True) as r:
            g0 = await r.complete(PROMPT, max_tokens=10, sampling=sp, stop_on_eog=False)
            gs = await asyncio.gather(*(r.complete(p, max_tokens=10, stop_on_eog=False)
                                        for p in prompts))
            return g0, gs

    g0, gs = asyncio.run(go())
    assert g0.tokens == ref
    assert [g.tokens for g in gs] == refs


def test_relay_recovers_when_a_stage_loses_the_session(stages, reference):
    ref, _ = generate_local(reference, PROMPT, max_tokens=12, stop_on_eog=False)
    # token by token (loop=False), so the loss lands mid-generation
    with Route([w.address for w in stages], relay=True, loop=False) as r:
        s = r.session()
        it = s.generate(PROMPT, max_tokens=12, stop_on_eog=False)
        toks = [next(it) for _ in range(4)]
        with stages[1].worker.pipeline.lock:
            stages[1].worker.pipeline.table.release(s.id)
        toks += list(it)
        assert toks == ref and s.recoveries == 1
        s.close()


def test_decode_loop_matches_and_survives_a_broken_loop(stages, reference, monkeypatch):
    ref, rows = generate_local(reference, PROMPT, max_tokens=12, logits=True, stop_on_eog=False)
    last = stages[-1].worker
    with Route([w.address for w in stages]) as r:  # relay and loop are the defaults
        assert r.aroute.relay and r.aroute.loop
        s = r.session()
        g = s.complete(PROMPT, max_tokens=12, logits=True, stop_on_eog=False)
        assert g.tokens == ref and s.recoveries == 0
        assert len(g.logits) == len(rows) == 12
        assert all(x.tobytes() == y.tobytes() for x, y in zip(g.logits, rows))
        # the last stage cannot reach the first once: the driver hears it from the last
        # stage, repairs the route and finishes step by step with the same tokens
        calls = []
        real = type(last.forwarder).next_lap

        def flaky(self, h, *rest):
            calls.append(h.first_pos)
            if len(calls) == 3:
                raise errors.WorkerUnavailable("next stage: injected loop failure")
            return real(self, h, *rest)

        monkeypatch.setattr(type(last.forwarder), "next_lap", flaky)
        g = s.complete(PROMPT, max_tokens=12, stop_on_eog=False)
        assert g.tokens == ref and s.recoveries == 1 and len(calls) == 3
        monkeypatch.undo()
        # a consumer that stops early leaves the loop running ahead; the next generation
        # starts a new epoch and is exact
        it = s.generate(PROMPT, max_tokens=12, stop_on_eog=False)
        assert [next(it) for _ in range(3)] == ref[:3]
        it.close()
        assert s.complete(PROMPT, max_tokens=12, stop_on_eog=False).tokens == ref
        s.close()


def test_decode_loop_stops_at_max_tokens_and_stop_tokens(stages, reference):
    ref, _ = generate_local(reference, PROMPT[:5], max_tokens=10, stop_on_eog=False)
    one = ThreadedWorker(dgr.Engine(reference.model_path, **SETTINGS))
    loops: list[int] = []  # positions after which the worker fed the loop's next step
    real_loop = one.worker.forwarder.next_lap
    one.worker.forwarder.next_lap = lambda h, *rest: (
        loops.append(h.first_pos), real_loop(h, *rest))[1]
    handled = _Positions(one.worker, "_data_done")
    try:
        ep = f"127.0.0.1:{one.worker.data_server.port}"
        c = _conn(ep)
        c.send(wire.encode(wire.Hello(route="loop")))
        assert type(wire.decode(bytes(c.recv())).header) is wire.Hello
        c.send(wire.encode(wire.Forward(model=one.worker.pipeline.identity, session="L", epoch=1,
                                        first_pos=0, n_tokens=5, layer=0, tokens=PROMPT[:5],
                                        want="token", reply_to="loop")))
        assert wire.decode(bytes(c.recv())).header.tokens == [ref[0]]
        # loop from ref[0]: stop at the first new token after it (sent, then no more)
        k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
        assert k < 9, "the stop token must come before the loop's own end (steps=9)"
        stop = ref[k]
        try:
            c.send(wire.encode(wire.Forward(
                model=one.worker.pipeline.identity, session="L", epoch=1, first_pos=5, n_tokens=1,
                layer=0, tokens=[ref[0]], want="token", reply_to="loop", relay=[],
                loop=[wire.Hop(endpoint=ep, tokens=True)], steps=9, stop_tokens=[stop])))
            got = [wire.decode(bytes(c.recv())).header for _ in range(k)]
            assert [h.tokens[0] for h in got] == ref[1:k + 1]
            assert [h.first_pos for h in got] == list(range(5, 5 + k))
            # once the worker has finished the step that sampled the stop token, it has fed
            # no further step: the loop ended there (fed after each earlier step only)
            assert handled.wait(5 + k - 1)
            assert loops == list(range(5, 5 + k - 1))
        finally:
            c.close()
        assert one.worker.pipeline.table.snapshot()[0].next_pos == 5 + k
    finally:
        one.stop()


def test_relay_refuses_lossy_codecs_and_workers_without_a_data_plane(tiny_llama):
    with pytest.raises(errors.InvalidArgument, match="raw f32"):
        AsyncRoute(["127.0.0.1:1"], relay=True, codec="f16")
    tw = ThreadedWorker(dgr.Engine(tiny_llama, **SETTINGS), data_port=None)
    try:
        with Route(tw.address, relay=True) as r:
            assert r.stages[0].data_port == 0
            with pytest.raises(errors.RouteError, match="serves no data plane"):
                r.complete([3, 4, 5], max_tokens=2)
        with Route(tw.address) as r:  # the gRPC path still serves it
            assert len(r.complete([3, 4, 5], max_tokens=2, stop_on_eog=False).tokens) == 2
    finally:
        tw.stop()


# -- the data plane itself, spoken by hand -----------------------------------------------


def _conn(ep: str) -> dataplane.FrameSocket:
    s = dataplane.connect(ep, 5.0)
    s.settimeout(10.0)
    return dataplane.FrameSocket(s)


def test_data_plane_hop_by_hop_and_errors(stages, reference):
    first = stages[0]
    ident = first.worker.pipeline.identity
    ep = f"127.0.0.1:{first.worker.data_server.port}"
    c = _conn(ep)
    try:
        # a Forward without reply_to is answered on the same connection, like a gRPC Step
        c.send(wire.encode(wire.Forward(model=ident, session="hand", epoch=1, first_pos=0,
                                        n_tokens=3, layer=0, tokens=[5, 6, 7])))
        f = wire.decode(bytes(c.recv()))
        assert type(f.header) is wire.Result and f.header.kind == "boundary"
        assert f.array.shape == (3, 64) and f.header.layer == 1
        # a bad frame gets an ErrorReply and the connection keeps working
        c.send(b"garbage!" * 4)
        e = wire.decode(bytes(c.recv())).header
        assert type(e) is wire.ErrorReply and type(e.to_exception()) is errors.FrameError
        # a step out of order: typed error, still serving
        c.send(wire.encode(wire.Forward(model=ident, session="hand", epoch=1, first_pos=9,
                                        n_tokens=1, layer=0, tokens=[5])))
        e = wire.decode(bytes(c.recv())).header
        assert isinstance(e.to_exception(), errors.CacheMiss)
        # a relayed frame whose next hop is unreachable: the error comes back to the sender
        # (no Hello: no return connection registered)
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))
        dead_ep = f"127.0.0.1:{dead.getsockname()[1]}"
        dead.close()
        c.send(wire.encode(wire.Forward(
            model=ident, session="hand", epoch=1, first_pos=3, n_tokens=1, layer=0, tokens=[8],
            relay=[wire.Hop(endpoint=dead_ep)], reply_to="nobody")))
        e = wire.decode(bytes(c.recv())).header
        assert isinstance(e.to_exception(), errors.WorkerUnavailable) and dead_ep in e.message
        # Hello is echoed (the return path is registered before the echo)
        c.send(wire.encode(wire.Hello(route="r-hand")))
        assert wire.decode(bytes(c.recv())).header == wire.Hello(route="r-hand")
        assert "r-hand" in first.worker.forwarder
    finally:
        c.close()
    with first.worker.pipeline.lock:
        first.worker.pipeline.table.release("hand")


def test_data_plane_refuses_an_oversized_length_prefix(stages):
    ep = f"127.0.0.1:{stages[0].worker.data_server.port}"
    c = _conn(ep)
    try:
        c.sock.sendall(dataplane.LEN.pack(dataplane.MAX_FRAME + 1))
        e = wire.decode(bytes(c.recv())).header
        assert type(e.to_exception()) is errors.FrameTooLarge
        assert c.recv() is None  # and hangs up: the stream cannot be resynchronized
    finally:
        c.close()
    # the worker still serves new connections
    c = _conn(ep)
    try:
        c.send(wire.encode(wire.Hello(route="again")))
        assert type(wire.decode(bytes(c.recv())).header) is wire.Hello
    finally:
        c.close()


def test_frame_socket_carries_large_frames_whole():
    a, b = socket.socketpair()
    fa, fb = dataplane.FrameSocket(a), dataplane.FrameSocket(b)
    big = np.random.default_rng(0).standard_normal((64, 4096), dtype=np.float32)
    frame = wire.encode(wire.Result(session="s", epoch=1, first_pos=0, n_tokens=64,
                                    kind="boundary", layer=2), big)
    t = threading.Thread(target=lambda: [fa.send(frame) for _ in range(3)])
    t.start()
    for _ in range(3):
        got = wire.decode(fb.recv())
        assert np.array_equal(got.array, big)
    t.join()
    fa.close()
    assert fb.recv() is None
    fb.close()


@pytest.mark.parametrize("native", [False, True])
def test_boundary_is_read_in_place_and_buffers_are_reused(native):
    frames = Frames(native)
    a, b = socket.socketpair()
    fa, fb = frames.conn_class(a), frames.conn_class(b)
    try:
        x = np.random.default_rng(1).standard_normal((2, 576), dtype=np.float32)
        h = wire.Forward(model="m", session="s", epoch=1, first_pos=0, n_tokens=2, layer=3)
        out = bytearray()
        first = None
        for pos in range(3):
            n = wire.encode_into(wire.Forward(**{**{f: getattr(h, f) for f in
                                                    ("model", "session", "epoch", "n_tokens",
                                                     "layer")}, "first_pos": pos}), x, out)
            assert n == len(out)
            fa.send(out)
            view = fb.recv()
            f = frames.decode(view)
            # the engine reads the boundary where the socket wrote it: no copy in Python
            assert np.shares_memory(f.array, np.frombuffer(fb._buf, np.uint8))
            assert np.array_equal(f.array, x) and f.header.first_pos == pos
            first = first or fb._buf
            assert fb._buf is first  # one receive buffer per connection, reused
            del f, view
    finally:
        fa.close()
        fb.close()


def test_data_server_refuses_connections_beyond_its_cap():
    seen = []

    def handler(conn):
        seen.append(conn)
        while conn.recv() is not None:
            pass

    srv = dataplane.DataServer(handler, "127.0.0.1", 0, max_connections=2).start()
    socks = []
    try:
        socks = [_conn(srv.address) for _ in range(2)]
        for c in socks:  # both served
            c.send(wire.encode(wire.Hello(route="x")))
        extra = _conn(srv.address)
        socks.append(extra)
        e = wire.decode(bytes(extra.recv())).header
        assert isinstance(e.to_exception(), errors.ResourceExhausted) and "at most 2" in e.message
        assert extra.recv() is None and srv.refused == 1
        socks[0].close()  # a slot frees up: the next connection is served
        _wait_until(lambda: len(srv._conns) < 2, "the closed connection's slot is free")
        again = _conn(srv.address)
        socks.append(again)
        again.send(wire.encode(wire.Hello(route="y")))
        _wait_until(lambda: len(seen) == 3, "the third connection is served")
        assert srv.refused == 1
    finally:
        for c in socks:
            c.close()
        srv.stop()


def test_auto_relay_falls_back_to_grpc_when_the_data_port_is_unreachable(tiny_llama, reference,
                                                                        caplog):
    tw = ThreadedWorker(dgr.Engine(tiny_llama, **SETTINGS))
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    tw.worker.advertise_data_port = dead.getsockname()[1]  # e.g. a firewalled data port
    dead.close()
    try:
        ref, _ = generate_local(reference, PROMPT, max_tokens=4, stop_on_eog=False)
        with Route(tw.address) as r:  # relay=None: auto
            assert not r.aroute.relay
            assert r.complete(PROMPT, max_tokens=4, stop_on_eog=False).tokens == ref
        assert "direct relay unavailable" in caplog.text
    finally:
        tw.stop()


def test_an_abandoned_decode_loop_never_touches_the_next_session(tiny_llama, reference):
    # one slot per stage: a session closed while its decode loop still runs frees the slot,
    # the next session takes it at once; the old loop's steps still in flight are refused
    # (unknown session; or released while they waited, which the toy-engine test in
    # test_transport.py pins down) and never disturb the new one
    one_slot = {**SETTINGS, "n_slots": 1}
    ws = [ThreadedWorker(dgr.Engine(tiny_llama, layers=r, **one_slot), evict_after=3600.0)
          for r in RANGES]
    try:
        ref, _ = generate_local(reference, PROMPT[:9], max_tokens=12, stop_on_eog=False)
        olds = [generate_local(reference, PROMPT[:20 + i], max_tokens=4, stop_on_eog=False)[0]
                for i in range(8)]
        with Route([w.address for w in ws], relay=True) as r:
            for i in range(8):
                old = r.session()
                it = old.generate(PROMPT[:20 + i], max_tokens=90, stop_on_eog=False)
                n = 2 + i % 3
                assert [next(it) for _ in range(n)] == olds[i][:n]
                it.close()
                old.close()  # releases on every stage while the loop goes on
                s = r.session()
                assert s.complete(PROMPT[:9], max_tokens=12, stop_on_eog=False).tokens == ref
                s.close()
    finally:
        for w in ws:
            w.stop()


def test_a_one_stage_decode_loop_delivers_tokens_in_order(tiny_llama, reference):
    # one worker is first and last: the loop's next step arrives on another connection
    # (another thread) of the same worker, which must not overtake this step's reply
    ref, _ = generate_local(reference, PROMPT[:5], max_tokens=6, stop_on_eog=False)
    one = ThreadedWorker(dgr.Engine(tiny_llama, **SETTINGS))
    w = one.worker
    real_loop = w.forwarder.next_lap
    handled = _Positions(w, "_data_done")
    computed = _Positions(w.pipeline, "finish")
    waited = []

    def slow_after_loop(h, *rest):
        # widen the window after the loop step: position 5's loop step goes out, then this
        # thread holds on until the worker has computed position 6 (on another thread)
        real_loop(h, *rest)
        if h.first_pos == 5:
            waited.append(computed.wait(6))

    w.forwarder.next_lap = slow_after_loop
    try:
        ep = f"127.0.0.1:{w.data_server.port}"
        c = _conn(ep)
        try:
            c.send(wire.encode(wire.Hello(route="one")))
            c.recv()
            c.send(wire.encode(wire.Forward(model=w.pipeline.identity, session="O", epoch=1,
                                            first_pos=0,
                                            n_tokens=5, layer=0, tokens=PROMPT[:5],
                                            want="token", reply_to="one")))
            assert wire.decode(bytes(c.recv())).header.tokens == [ref[0]]
            c.send(wire.encode(wire.Forward(
                model=w.pipeline.identity, session="O", epoch=1, first_pos=5, n_tokens=1, layer=0,
                tokens=[ref[0]], want="token", reply_to="one", relay=[],
                loop=[wire.Hop(endpoint=ep, tokens=True)], steps=5)))
            got = [wire.decode(bytes(c.recv())).header for _ in range(5)]
            # position 5's thread may still be waking from its wait when position 9's reply
            # is read: wait for that frame to finish before looking at what it recorded
            assert handled.wait(5)
            assert waited == [True]
            assert [h.first_pos for h in got] == [5, 6, 7, 8, 9]
            assert [h.tokens[0] for h in got] == ref[1:6]
        finally:
            c.close()
    finally:
        one.stop()


def test_a_decode_loop_reply_out_of_step_is_repaired_not_fatal(stages, reference):
    # the driver reads the loop's tokens in position order; a reply for another position
    # means the loop and the driver's history disagree: re-prefill and go on (CacheMiss)
    ref, _ = generate_local(reference, PROMPT[:9], max_tokens=10, stop_on_eog=False)

    class OneBogusReply(dict):
        done = False

        def __setitem__(self, key, q):
            super().__setitem__(key, q)
            if not self.done:
                self.done = True
                q.put_nowait(wire.decode(wire.encode(wire.Result(
                    session=key[0], epoch=key[1], first_pos=999, n_tokens=1, kind="none",
                    tokens=[1]))))

    with Route([w.address for w in stages], relay=True) as r:
        r.aroute.relay_links.rings = OneBogusReply()
        s = r.session()
        g = s.complete(PROMPT[:9], max_tokens=10, stop_on_eog=False)
        # the old loop may still hold a step at a stage when the replay reaches it
        # (SessionError, retried): one recovery or two
        assert r.aroute.relay_links.rings.done and g.tokens == ref and 1 <= g.recoveries <= 2
        s.close()


def test_decode_loop_runs_at_most_a_window_ahead_of_the_reader(stages, reference,
                                                              monkeypatch):
    ref, _ = generate_local(reference, PROMPT[:9], max_tokens=20, stop_on_eog=False)
    last = stages[-1].worker
    with Route([w.address for w in stages], relay=True, loop_window=4) as r:
        s = r.session()
        assert s.complete(PROMPT[:9], max_tokens=20, stop_on_eog=False).tokens == ref  # 5 windows
        loops: list[int] = []  # positions after which the last stage fed the next step
        real_loop = last.forwarder.next_lap
        monkeypatch.setattr(last.forwarder, "next_lap", lambda h, *rest: (
            loops.append(h.first_pos), real_loop(h, *rest))[1])
        it = s.generate(PROMPT[:9], max_tokens=20, stop_on_eog=False)
        before = last.pipeline.steps_total
        toks = [next(it) for _ in range(3)]  # the prefill's token and 2 of the first window
        # a reader that pauses: the whole first window reaches the driver (the last stage
        # decides whether to loop on before it replies), then nothing more is started
        ring = r.aroute.relay_links.rings[(s.id, s.epoch)]
        _wait_until(lambda: ring.qsize() >= 2, "the first window's last two tokens arrive")
        ahead = last.pipeline.steps_total - before - 2  # decode steps the last stage ran (9 prompt
        assert ahead == 4, ahead  # tokens: 2 prefill chunks); the first window only
        assert loops == [9, 10, 11], loops  # fed on within the window, not past it
        assert ring.qsize() == 2
        toks += list(it)
        assert toks == ref
        s.close()
    with pytest.raises(errors.InvalidArgument, match="loop_window"):
        AsyncRoute([w.address for w in stages], loop_window=0)


def test_a_relay_off_the_allowlist_is_refused_and_nothing_connects(tiny_llama):
    """A stranger's frame that names a port of its choosing (Forward.relay on a middle stage,
    Forward.loop on the last) gets RelayRefused before any compute, and the worker opens no
    connection there; the default allowlist (loopback only) refuses other hosts the same."""
    trap = socket.create_server(("127.0.0.1", 0))
    trap_ep = f"127.0.0.1:{trap.getsockname()[1]}"
    trap.settimeout(0.5)
    first = ThreadedWorker(dgr.Engine(tiny_llama, layers=(0, 1), **SETTINGS),
                           relay_allow=["127.0.0.1:1"])
    last = ThreadedWorker(dgr.Engine(tiny_llama, layers=(3, 4), **SETTINGS),
                          relay_allow=["127.0.0.1:1"])
    plain = ThreadedWorker(dgr.Engine(tiny_llama, layers=(0, 1), **SETTINGS))  # the default
    x = np.zeros((1, last.worker.pipeline.width), np.float32)
    cases = [
        (first, wire.Forward(model=first.worker.pipeline.identity, session="a", epoch=1,
                             first_pos=0,
                             n_tokens=1, layer=0, tokens=[5], want="token", reply_to="r",
                             relay=[wire.Hop(endpoint=trap_ep)]), None, "Forward.relay"),
        (last, wire.Forward(model=last.worker.pipeline.identity, session="b", epoch=1, first_pos=0,
                            n_tokens=1, layer=3, tokens=[5], want="token", reply_to="r",
                            relay=[], loop=[wire.Hop(endpoint=trap_ep, tokens=True)],
                            steps=4), x, "Forward.loop"),
        (plain, wire.Forward(model=plain.worker.pipeline.identity, session="c", epoch=1,
                             first_pos=0,
                             n_tokens=1, layer=0, tokens=[5], want="token", reply_to="r",
                             relay=[wire.Hop(endpoint="10.255.255.1:9")]), None,
         "Forward.relay"),
    ]
    try:
        for w, h, arr, field in cases:
            c = _conn(f"127.0.0.1:{w.worker.data_server.port}")
            try:
                c.send(wire.encode(wire.Hello(route="r")))
                assert type(wire.decode(bytes(c.recv())).header) is wire.Hello
                c.send(wire.encode(h, arr))
                err = wire.decode(bytes(c.recv())).header
                assert type(err) is wire.ErrorReply and err.code == errors.RelayRefused.code
                assert field in err.message
            finally:
                c.close()
            assert w.worker.pipeline.steps_total == 0  # refused at admission: nothing computed
            assert not w.worker.forwarder.links._links  # and no connection was opened
        with pytest.raises(TimeoutError):
            trap.accept()  # nothing ever connected to the trap
    finally:
        trap.close()
        for w in (first, last, plain):
            w.stop()
