"""Credentials and TLS on both planes, and the abuse cases of docs/security.md: real engines,
loopback only. Each refusal is checked together with what it protects: the worker computed
nothing for the refused caller, and still serves the right tokens to the others."""

from __future__ import annotations

import asyncio
import random
import socket
import ssl
import threading
import time

import grpc
import numpy as np
import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.core.local import generate_local
from dgr.driver.route import AsyncRoute, Route
from dgr.protocol import wire
from dgr.testing.waits import wait_until
from dgr.testing.wirefuzz import mutate
from dgr.transport import dataplane
from dgr.transport.client import ShardClient
from dgr.transport.security import (
    AUTH_MAGIC,
    METADATA_KEY,
    Credential,
    KeyRing,
    Security,
    TLSConfig,
    sign,
)
from dgr.worker.process import ThreadedWorker

pytestmark = pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the patched llama.cpp")

SETTINGS = dict(n_ctx=128, n_slots=4, n_threads=1, n_ubatch=8)
RANGES = ((0, 1), (1, 3), (3, 4))
PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, 120, 21)]

PEER = Credential("workers", b"peer-secret-0123456789", peer=True)
ACME = Credential("acme", b"acme-secret-0123456789", max_sessions=2)
BETA = Credential("beta", b"beta-secret-0123456789")
WRONG = Credential("acme", b"not-the-acme-secret-000")  # right name, wrong secret
STRANGER = Credential("mallory", b"mallory-secret-0123456")


@pytest.fixture(scope="module")
def reference(tiny_llama):
    eng = dgr.Engine(tiny_llama, **SETTINGS)
    return generate_local(eng, PROMPT, max_tokens=8, stop_on_eog=False)[0]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    trustme = pytest.importorskip("trustme")
    d = tmp_path_factory.mktemp("tls")
    ca, other_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("driver.example")
    stranger = other_ca.issue_cert("127.0.0.1")
    paths = {}
    for name, blob in (("ca", ca.cert_pem), ("cert", server.cert_chain_pems[0]),
                       ("key", server.private_key_pem), ("ccert", client.cert_chain_pems[0]),
                       ("ckey", client.private_key_pem), ("other_ca", other_ca.cert_pem),
                       ("scert", stranger.cert_chain_pems[0]),
                       ("skey", stranger.private_key_pem)):
        blob.write_to_path(str(d / f"{name}.pem"))
        paths[name] = str(d / f"{name}.pem")
    return paths


def _stages(model, tls=None, **kw):
    return [ThreadedWorker(dgr.Engine(model, layers=r, **SETTINGS), evict_after=3600.0,
                           security=Security(PEER, KeyRing([PEER, ACME, BETA]), tls), **kw)
            for r in RANGES]


@pytest.fixture(scope="module")
def stages(tiny_llama):
    ws = _stages(tiny_llama)
    yield ws
    for w in ws:
        w.stop()


def _idle(ws) -> None:
    """Every worker holds no session and no step: what the refused callers held is free."""
    for w in ws:
        wait_until(lambda p=w.worker.pipeline: p.inflight == 0 and len(p.table) == 0,
                   f"{w.address} idle")


def _conns(w) -> set:
    """The worker's open data connections, a snapshot."""
    srv = w.worker.data_server
    with srv._lock:
        return set(srv._conns)


def _freed(w, before: set, what: str) -> None:
    """Wait until every data connection the worker holds is one it held at ``before``:
    those the test opened are freed. (Not a count: one an earlier test left may close
    meanwhile.)"""
    wait_until(lambda: _conns(w) <= before, what)


def _conn(ep: str, first: bytes | None = None) -> dataplane.FrameSocket:
    s = dataplane.connect(ep, 5.0)
    s.settimeout(10.0)
    c = dataplane.FrameSocket(s)
    if first is not None:
        c.send(first)
    return c


def _refused(c: dataplane.FrameSocket) -> errors.DgrError:
    """The one ErrorReply a refused connection gets, then EOF."""
    e = wire.decode(bytes(c.recv())).header.to_exception()
    assert c.recv() is None
    return e


def _forward(w, session="s", pos=0, n=4) -> bytes:
    h = wire.Forward(session=session, epoch=1, first_pos=pos, n_tokens=n, layer=0,
                     model=w.worker.pipeline.identity, tokens=list(range(5, 5 + n)),
                     want="boundary")
    return wire.encode(h)


def test_a_route_with_credentials_matches_the_whole_model(stages, reference):
    for relay in (True, False):
        with Route([w.address for w in stages], relay=relay,
                   security=Security(ACME)) as r:
            s = r.session()
            assert s.complete(PROMPT, max_tokens=8, stop_on_eog=False).tokens == reference
            assert (r.aroute.relay_steps > 0) == relay
            s.close()
    _idle(stages)


@pytest.mark.parametrize("cred", [None, WRONG, STRANGER], ids=["missing", "wrong", "unknown"])
def test_grpc_refuses_a_missing_wrong_or_unknown_credential(stages, cred):
    w = stages[0]
    steps = w.worker.pipeline.steps_total

    async def go():
        c = ShardClient(w.address, security=Security(cred))
        try:
            assert await c.health() == "SERVING"  # health stays public
            with pytest.raises(errors.Unauthenticated) as e:
                await c.describe()
            assert "mallory" not in str(e.value) and "acme" not in str(e.value)
            with pytest.raises(errors.Unauthenticated):
                await c.release("anything")
            st = c.stream()
            reply = await st.step(_forward(w))
            assert isinstance(wire.decode(reply).header.to_exception(), errors.Unauthenticated)
            await st.close()
        finally:
            await c.close()

    asyncio.run(go())
    assert w.worker.pipeline.steps_total == steps  # nothing computed for it
    _idle(stages)


@pytest.mark.parametrize("first", [None, "wrong", "unknown", "garbage"])
def test_the_data_plane_reads_nothing_before_the_first_frame_authenticates(stages, first):
    w = stages[0]
    ep = w.worker.data_server.address
    frame = {None: _forward(w), "wrong": AUTH_MAGIC + sign(WRONG, "data").encode(),
             "unknown": AUTH_MAGIC + sign(STRANGER, "data").encode(),
             "garbage": AUTH_MAGIC + b"x" * 40}[first]
    steps, conns = w.worker.pipeline.steps_total, _conns(w)
    c = _conn(ep, frame)
    if first is not None:  # a refused first frame: what follows is never read
        try:
            c.send(_forward(w))
        except OSError:
            pass
    try:
        assert isinstance(_refused(c), errors.Unauthenticated)
    finally:
        c.close()
    assert w.worker.pipeline.steps_total == steps
    _freed(w, conns, "the refused connection is freed")


def test_a_replayed_or_stale_token_is_refused_on_both_planes(stages, reference):
    w = stages[0]
    # gRPC: the same token twice (captured on the wire, say): the second call is refused
    token = sign(ACME, "grpc:/dgr.v1.Shard/Describe")
    md = ((METADATA_KEY, token),)

    async def grpc_calls():
        ch = grpc.aio.insecure_channel(w.address)
        from dgr._proto import dgr_pb2, dgr_pb2_grpc

        stub = dgr_pb2_grpc.ShardStub(ch)
        try:
            await stub.Describe(dgr_pb2.DescribeRequest(), metadata=md, timeout=10)
            codes = []
            for bad in (md, ((METADATA_KEY, sign(ACME, "grpc:/dgr.v1.Shard/Describe",
                                                  now=time.time() - 3600)),),
                        ((METADATA_KEY, sign(ACME, "grpc:/dgr.v1.Shard/Release")),)):
                try:
                    await stub.Describe(dgr_pb2.DescribeRequest(), metadata=bad, timeout=10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
            return codes
        finally:
            await ch.close()

    # replayed, an hour old, signed for another method
    assert asyncio.run(grpc_calls()) == [grpc.StatusCode.UNAUTHENTICATED] * 3
    # data plane: a captured authentication frame replayed on a new connection
    auth = AUTH_MAGIC + sign(ACME, "data").encode()
    ok = _conn(w.worker.data_server.address, auth)
    ok.send(wire.encode(wire.Hello(route="r1")))
    assert isinstance(wire.decode(bytes(ok.recv())).header, wire.Hello)  # accepted
    ok.close()
    again = _conn(w.worker.data_server.address, auth)
    try:
        assert isinstance(_refused(again), errors.Unauthenticated)
    finally:
        again.close()
    # and the route still serves the right tokens
    with Route([s.address for s in stages], relay=True, security=Security(ACME)) as r:
        assert r.complete(PROMPT, max_tokens=8, stop_on_eog=False).tokens == reference
    _idle(stages)


def test_a_silent_first_frame_is_cut_off_at_the_auth_deadline(stages):
    w = stages[0]
    srv = w.worker.data_server
    t, conns = srv.auth_timeout, _conns(w)
    srv.auth_timeout = 0.5
    try:
        c = _conn(srv.address)
        c.sock.sendall(b"\x40\x00")  # half a length prefix, then nothing
        assert isinstance(_refused(c), errors.Unauthenticated)
        c.close()
    finally:
        srv.auth_timeout = t
    _freed(w, conns, "the stalled connection is freed")


def test_sessions_belong_to_the_credential_that_opened_them(stages, reference):
    async def go():
        async with AsyncRoute([w.address for w in stages], relay=False,
                              security=Security(ACME)) as a, \
                AsyncRoute([w.address for w in stages], relay=False, max_retries=0,
                           security=Security(BETA)) as b:
            s = a.session()
            await s.prefill(PROMPT)
            # beta names acme's session: neither a step nor a release touches it
            st = b.clients[0].stream()
            reply = wire.decode(await st.step(_forward(stages[0], s.id, 0, 3))).header
            await st.close()
            assert isinstance(reply.to_exception(), errors.SessionForbidden)
            assert await b.clients[0].release(s.id) is False
            assert stages[0].worker.pipeline.table.get(s.id) is not None
            g = await s.complete(PROMPT, max_tokens=8, stop_on_eog=False)
            await s.close()
            return g.tokens

    toks = asyncio.run(go())
    assert toks == reference
    _idle(stages)


def test_a_prefix_kept_by_one_credential_is_adopted_by_it_alone(stages, reference):
    """acme's session, relayed stage to stage (the later stages' sessions a peer opened),
    is kept in every stage's prefix store for acme: beta, with the same keys (the same
    tenant salt), adopts nothing; acme adopts its whole chunks and gets the whole model's
    tokens."""
    async def go():
        async with AsyncRoute([w.address for w in stages], relay=True,
                              security=Security(ACME)) as a, \
                AsyncRoute([w.address for w in stages], relay=True,
                           security=Security(BETA)) as b:
            s = a.session(tenant="t")
            await s.complete(PROMPT, max_tokens=2, stop_on_eog=False)
            await s.close(keep=True)
            assert [(await c.describe()).prefix_store["entries"] for c in a.clients] == [1] * 3
            other = b.session(tenant="t")
            assert await other.adopt(PROMPT) == 0
            await other.close()
            mine = a.session(tenant="t")
            m = await mine.adopt(PROMPT)
            assert m == 19  # two whole chunks of 8 and three rows, two left to prefill
            toks = [t async for t in mine.generate(PROMPT, max_tokens=8, stop_on_eog=False,
                                                   reuse=m)]
            await mine.close()
            return toks

    try:
        assert asyncio.run(go()) == reference
    finally:
        for w in stages:  # the entries hold slots the later tests count as free
            with w.worker.pipeline.lock:
                w.worker.pipeline.table.clear()
    _idle(stages)


def test_one_credential_cannot_take_every_slot(stages, reference):
    """acme (sessions=2) holds its two sessions; its third is refused with
    ResourceExhausted while beta's generation completes with the right tokens."""
    async def go():
        async with AsyncRoute([w.address for w in stages], relay=True, max_retries=0,
                              security=Security(ACME)) as a, \
                AsyncRoute([w.address for w in stages], relay=True,
                           security=Security(BETA)) as b:
            held = [a.session() for _ in range(2)]
            for s in held:
                await s.prefill(PROMPT[:5])
            third = a.session()
            with pytest.raises(errors.ResourceExhausted) as e:
                await third.prefill(PROMPT[:5])
            assert "acme" in str(e.value) and "cap" in str(e.value)
            g = await b.complete(PROMPT, max_tokens=8, stop_on_eog=False)
            for s in held:
                await s.close()
            # acme's sessions released: it may open one again
            s = a.session()
            await s.prefill(PROMPT[:5])
            await s.close()
            return g.tokens

    assert asyncio.run(go()) == reference
    _idle(stages)


def test_queued_steps_are_capped_per_credential(tiny_llama):
    tw = ThreadedWorker(dgr.Engine(tiny_llama, **SETTINGS), security=Security(
        PEER, KeyRing([PEER, ACME, BETA])), max_queued_per_credential=1)
    try:
        ep = tw.worker.data_server.address
        # two connections of one credential: a connection's thread may compute its own
        # step, so the second step comes on another one
        c1, c2 = (_conn(ep, AUTH_MAGIC + sign(ACME, "data").encode()) for _ in range(2))
        h = dict(epoch=1, first_pos=0, n_tokens=3, layer=0, model=tw.worker.pipeline.identity,
                 tokens=[5, 6, 7], want="token")
        with tw.worker.pipeline.engine.lock:  # the engine is busy: admitted steps wait
            c1.send(wire.encode(wire.Forward(session="a", **h)))
            wait_until(lambda: tw.worker.pipeline.inflight == 1, "the first step is admitted")
            c2.send(wire.encode(wire.Forward(session="b", **h)))
            e = wire.decode(bytes(c2.recv())).header
            assert e.session == "b" and isinstance(e.to_exception(), errors.ResourceExhausted)
            # another credential is not held back by acme's queue
            c3 = _conn(ep, AUTH_MAGIC + sign(BETA, "data").encode())
            c3.send(wire.encode(wire.Forward(session="c", **h)))
            wait_until(lambda: tw.worker.pipeline.inflight == 2, "beta's step is admitted")
        for c, name in ((c1, "a"), (c3, "c")):  # both ran once the engine was free
            r = wire.decode(bytes(c.recv())).header
            assert isinstance(r, wire.Result) and r.session == name
        for c in (c1, c2, c3):
            c.close()
        wait_until(lambda: tw.worker.pipeline.inflight == 0 and not tw.worker.pipeline._queued,
                   "nothing queued")
    finally:
        tw.stop()


# -- TLS ------------------------------------------------------------------------------------


def _tls(certs, client_auth=True, client=True) -> TLSConfig:
    if client:
        return TLSConfig(cert=certs["ccert"], key=certs["ckey"], ca=certs["ca"])
    return TLSConfig(cert=certs["cert"], key=certs["key"], ca=certs["ca"],
                     client_auth=client_auth)


@pytest.fixture(scope="module")
def tls_stages(tiny_llama, certs):
    ws = _stages(tiny_llama, _tls(certs, client=False))
    yield ws
    for w in ws:
        w.stop()


def test_mutual_tls_route_matches_the_whole_model(tls_stages, certs, reference):
    for relay in (True, False):
        with Route([w.address for w in tls_stages], relay=relay,
                   security=Security(ACME, None, _tls(certs))) as r:
            s = r.session()
            assert s.complete(PROMPT, max_tokens=8, stop_on_eog=False).tokens == reference
            assert (r.aroute.relay_steps > 0) == relay
            s.close()
    # the relayed frames went through the native frame I/O, over the TLS tunnels
    assert all(w.worker.frames.native and w.worker.frames.decoded_native > 0
               for w in tls_stages)
    _idle(tls_stages)


@pytest.mark.parametrize("how", ["plaintext", "no-client-cert", "untrusted-client-cert"])
def test_tls_refuses_plaintext_and_clients_without_a_trusted_certificate(tls_stages, certs,
                                                                         how):
    w = tls_stages[0]
    steps, conns = w.worker.pipeline.steps_total, _conns(w)
    tls = {"plaintext": None, "no-client-cert": TLSConfig(ca=certs["ca"]),
           "untrusted-client-cert": TLSConfig(cert=certs["scert"], key=certs["skey"],
                                              ca=certs["ca"])}[how]

    async def go():
        c = ShardClient(w.address, timeout=3, security=Security(ACME, None, tls))
        try:
            with pytest.raises(errors.WorkerUnavailable):
                await c.describe()
        finally:
            await c.close()

    asyncio.run(go())
    # the data plane: a plaintext frame, or a handshake without a trusted certificate
    raw = socket.create_connection(("127.0.0.1", w.worker.data_server.port), timeout=5)
    try:
        if tls is None:
            raw.sendall(dataplane.LEN.pack(8) + b"DGRAUTH1")
            assert raw.recv(4096)[:1] in (b"\x15", b"")  # a TLS alert or the close, no frame
        else:
            # TLS 1.3: the client's handshake ends before the server checks its
            # certificate, which it then refuses: an alert (SSLError) or the close
            try:
                with tls.client_context().wrap_socket(raw, server_hostname="127.0.0.1") as t:
                    t.sendall(dataplane.LEN.pack(8) + b"DGRAUTH1")
                    data = t.recv(4096)
            except (ssl.SSLError, ConnectionError, OSError):
                data = b""
            assert data == b""  # no frame, no ErrorReply: nothing was read
    finally:
        raw.close()
    assert w.worker.pipeline.steps_total == steps
    _freed(w, conns, "the refused connection is freed")


def test_the_wire_fuzzer_through_an_authenticated_tls_connection(tls_stages, certs, reference):
    """The wire fuzzer's mutated frames (``dgr.testing.wirefuzz``) on an authenticated
    mutual-TLS data connection: each is answered (an ErrorReply, or a Result for one that
    still parses as a valid step) or ends the connection; the worker keeps serving the right
    tokens."""
    rng = random.Random(20261201)
    w = tls_stages[0]
    sec = Security(ACME, None, _tls(certs))
    conns = _conns(w)
    answered = sent = 0
    deadline = time.monotonic() + 20
    while sent < 300 and time.monotonic() < deadline:
        c = dataplane.FrameSocket(dataplane.connect(w.worker.data_server.address, 5.0, sec))
        c.sock.settimeout(10.0)
        c.send(sec.auth_frame())
        try:
            for _ in range(50):
                c.send(mutate(rng))
                sent += 1
                if c.recv() is None:
                    break
                answered += 1
        except (ConnectionError, OSError):
            pass
        finally:
            c.close()
    assert sent >= 300 and answered > 0
    _freed(w, conns, "the fuzz connections are freed")
    with Route([s.address for s in tls_stages], relay=True, security=sec) as r:
        assert r.complete(PROMPT, max_tokens=8, stop_on_eog=False).tokens == reference
    _idle(tls_stages)


def test_tls_tunnels_carry_a_long_stream_both_ways(certs):
    """The tunnel (dgr.transport.tls) under load: 4 MiB each way, many frames, in order."""
    got: list[bytes] = []

    def handler(conn):
        while (v := conn.recv()) is not None:
            b = bytes(v)
            got.append(b)
            conn.send(b[::-1])

    srv = dataplane.DataServer(handler, "127.0.0.1", 0, security=Security(
        None, None, _tls(certs, client=False))).start()
    try:
        sec = Security(None, None, _tls(certs))
        c = dataplane.FrameSocket(dataplane.connect(srv.address, 5.0, sec))
        c.sock.settimeout(10.0)
        frames = [bytes([i % 251]) * (1 + (i * 7919) % 65536) for i in range(128)]
        sender = threading.Thread(target=lambda: [c.send(f) for f in frames])
        sender.start()
        back = [bytes(c.recv()) for _ in frames]
        sender.join(10)
        assert back == [f[::-1] for f in frames] and got == frames
        c.close()
    finally:
        srv.stop()


def test_a_refused_data_connection_tells_the_driver_why(stages):
    """A driver whose credential the data plane refuses (gRPC accepted it: the workers'
    files differ, say) learns Unauthenticated from the Hello, not a lost connection."""
    from dgr.driver.links import RelayLinks

    async def go():
        async with AsyncRoute([w.address for w in stages], relay=False,
                              security=Security(ACME)) as r:
            links = RelayLinks("r-x", lambda: r.stages, 1.0, Security(STRANGER))
            with pytest.raises(errors.Unauthenticated):
                await links.links()
            links.close()

    asyncio.run(go())
    _idle(stages)


def test_a_connection_over_the_cap_gets_its_answer_through_tls(certs):
    """A TLS client sends as soon as it connects; a connection refused over the per-address
    cap must still read the ResourceExhausted answer, not a reset (the tunnel lingers and the
    refusal closes after reading what came)."""
    frame = wire.encode(wire.Hello(route="r"))

    def handler(conn):
        while (v := conn.recv()) is not None:
            conn.send(bytes(v))

    srv = dataplane.DataServer(handler, "127.0.0.1", 0, max_per_address=1, security=Security(
        None, None, _tls(certs, client=False))).start()
    held = None
    try:
        sec = Security(None, None, _tls(certs))
        held = dataplane.FrameSocket(dataplane.connect(srv.address, 5.0, sec))
        held.sock.settimeout(10.0)
        held.send(frame)
        assert bytes(held.recv()) == frame
        for _ in range(5):
            c = dataplane.FrameSocket(dataplane.connect(srv.address, 5.0, sec))
            c.sock.settimeout(10.0)
            c.send(frame + frame)  # sent at once, before any answer
            time.sleep(0.2)
            err = wire.decode(bytes(c.recv())).header
            assert err.code == errors.ResourceExhausted.code
            c.close()
    finally:
        if held is not None:
            held.close()
        srv.stop()
