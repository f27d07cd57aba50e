"""A real worker's lifecycle and limits (python -m dgr.worker on loopback, generated models).

Drain on SIGTERM with sessions in flight and its timeout, session TTL expiry and LRU eviction,
a stale-epoch frame on the data plane, and the ``--max-data-connections`` / ``--max-streams``
limits. Every wait is bounded; state changes are awaited by polling with a deadline.
"""

from __future__ import annotations

import asyncio
import re
import signal
import uuid

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr.driver.route import Route
from dgr.protocol import wire
from dgr.testing.fixtures import TinyLlama, write_tiny_llama
from dgr.testing.waits import poll_until
from dgr.transport import dataplane
from dgr.transport.client import ShardClient
from dgr.transport.common import HEALTH_SERVICE
from dgr.worker.process import WorkerProcess

pytestmark = [pytest.mark.system]

#: Settings of the workers on the 4-layer tiny llama (tests/conftest.py ``tiny_llama``).
SMALL = dict(n_ctx=256, n_slots=2, n_threads=1, n_ubatch=32, flash_attn=True)
#: A larger random llama for the drain tests: a step of BIG tokens computes for a long time
#: next to the control RPCs a test makes meanwhile (1.8 s on the 2-core reference machine
#: under load; the RPCs take milliseconds), so the drain has work in flight to wait for.
MEDIUM = TinyLlama(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=1024, seed=1)
DRAIN = dict(n_ctx=2048, n_slots=4, n_threads=1, n_ubatch=32, flash_attn=True)
BIG = 2000
#: Bound of every wait on a worker (a start, an exit, a reply, a polled state).
WAIT = 60.0
#: Deadline of one step on a gRPC stream (a BIG step under load included).
STEP_TIMEOUT = 120.0


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 128, n)]


# -- workers, frames, references -------------------------------------------------------------


@pytest.fixture
def reaper():
    """Every worker process a test starts; all are killed and reaped at its end."""
    procs: list[WorkerProcess] = []
    yield procs
    for p in procs:
        p.kill()


def spawn(reaper, model, settings, args=()) -> WorkerProcess:
    w = WorkerProcess(str(model), None, settings=settings, args=list(args))
    reaper.append(w)
    w.start()
    w.wait_listening(WAIT)
    return w


def found(pattern: str, log: str) -> tuple[int, ...]:
    """The integers a worker's log line matching ``pattern`` reports (the line must exist)."""
    m = re.search(pattern, log)
    assert m is not None, f"no line matching {pattern!r} in the worker's log:\n{log}"
    return tuple(int(g) for g in m.groups())


def log_of(w: WorkerProcess) -> str:
    with open(w.log_path, "rb") as f:
        return f.read().decode("utf-8", "replace")


def forward(info, session: str, epoch: int, pos: int, toks, reply_to: str = "") -> bytes:
    """A whole-model worker's step: ``toks`` at ``pos``, the greedy next token wanted."""
    return wire.encode(wire.Forward(
        model=info.identity, session=session, epoch=epoch, first_pos=pos, n_tokens=len(toks),
        layer=0, tokens=list(toks), want="token", reply_to=reply_to,
        relay=[] if reply_to else None))


def describe(endpoint: str):
    """The worker's describe record, over a client of its own."""
    async def go():
        c = ShardClient(endpoint)
        try:
            return await c.describe()
        finally:
            await c.close()
    return asyncio.run(go())


def header(data):
    return wire.decode(data).header


def result(data) -> wire.Result:
    h = header(data)
    assert type(h) is wire.Result, h.to_exception() if type(h) is wire.ErrorReply else h
    return h


def refusal(data) -> tuple[errors.DgrError, wire.ErrorReply]:
    h = header(data)
    assert type(h) is wire.ErrorReply, h
    return h.to_exception(), h


def token_of(data, session: str, epoch: int, pos: int, n: int) -> int:
    r = result(data)
    assert (r.session, r.epoch, r.first_pos, r.n_tokens) == (session, epoch, pos, n), r
    assert r.tokens is not None and len(r.tokens) == 1, r
    return r.tokens[0]


class Reference:
    """Greedy next tokens of the same model and settings computed in this process."""

    def __init__(self, model, settings):
        self.engine = dgr.Engine(model, **{**settings, "n_slots": 1})

    def run(self, steps: list[list[int]]) -> list[int]:
        """The token after each step of one sequence (steps are consecutive chunks)."""
        out, pos = [], 0
        try:
            for toks in steps:
                logits = self.engine.forward(0, pos, np.asarray(toks, np.int32))
                out.append(int(np.argmax(logits[-1])))
                pos += len(toks)
        finally:
            self.engine.release(0)
        return out


class DataConn:
    """A blocking data-plane connection whose every read has a timeout."""

    def __init__(self, endpoint: str, timeout: float = WAIT):
        sock = dataplane.connect(endpoint, timeout)
        sock.settimeout(timeout)
        self.conn = dataplane.FrameSocket(sock, endpoint)

    def send(self, frame: bytes) -> None:
        self.conn.send(frame)

    def recv(self):
        """The next frame's header, or None at end of stream (a reset counts as one)."""
        try:
            view = self.conn.recv()
        except ConnectionResetError:
            return None
        return None if view is None else header(bytes(view))

    def ask(self, frame: bytes):
        self.send(frame)
        return self.recv()

    def hello(self, route: str):
        """Register as ``route``'s return connection, as a driver does; returns the answer
        (the echoed Hello when the worker serves this connection)."""
        return self.ask(wire.encode(wire.Hello(route=route)))

    def close(self) -> None:
        self.conn.close()


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "medium-llama.gguf", MEDIUM)


# -- 1. drain ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_drains_sessions_in_flight_refuses_new_work_and_exits_zero(medium, reaper):
    """Three sessions mid generation each have a long step in flight when SIGTERM arrives:
    every one finishes with the right token; meanwhile health says NOT_SERVING and new work
    (a new session, the next step of an idle one, on gRPC and on the data plane) is refused
    with WorkerDraining; then the worker exits 0, its held-open streams end."""
    sessions = [f"s{i}" for i in range(3)]
    prompts = [tokens(10 + i, 16) for i in range(3)]
    bigs = [tokens(20 + i, BIG) for i in range(3)]
    ref = Reference(medium, DRAIN)
    w = spawn(reaper, medium, DRAIN)

    async def go():
        c = ShardClient(w.endpoint)
        try:
            info = await c.describe()
            assert await c.health() == "SERVING"
            streams = [c.stream() for _ in sessions]
            made = []
            for s, st, p in zip(sessions, streams, prompts):  # prefill, then two decode steps
                a = token_of(await st.step(forward(info, s, 1, 0, p)), s, 1, 0, 16)
                b = token_of(await st.step(forward(info, s, 1, 16, [a])), s, 1, 16, 1)
                c_ = token_of(await st.step(forward(info, s, 1, 17, [b])), s, 1, 17, 1)
                made.append([a, b, c_])
            idle = c.stream()
            token_of(await idle.step(forward(info, "idle", 1, 0, prompts[0][:8])),
                     "idle", 1, 0, 8)
            long = [asyncio.create_task(st.step(forward(info, s, 1, 18, big), STEP_TIMEOUT))
                    for s, st, big in zip(sessions, streams, bigs)]
            await poll_until(lambda: _admitted(c, long, len(sessions)),
                             "the three long steps admitted")
            w.proc.send_signal(signal.SIGTERM)
            seen = {name: await poll_until(lambda: _health_is(c, name, "NOT_SERVING"),
                                           f"health({name!r}) NOT_SERVING")
                    for name in ("", HEALTH_SERVICE)}
            draining = (await c.describe()).draining
            late = c.stream()
            new = refusal(await late.step(forward(info, "late", 1, 0, prompts[1])))
            more = refusal(await late.step(forward(info, "idle", 1, 8, [prompts[0][8]])))
            dp = await asyncio.to_thread(_data_plane_refusal, info)
            replies = await asyncio.wait_for(asyncio.gather(*long), WAIT)
            code = await asyncio.to_thread(w.proc.wait, WAIT)
            with pytest.raises(errors.WorkerUnavailable):  # the held-open stream ended
                await idle.step(forward(info, "idle", 1, 8, [prompts[0][8]]), WAIT)
            return made, seen, draining, new, more, dp, replies, code
        finally:
            await c.close()

    made, seen, draining, new, more, dp, replies, code = asyncio.run(go())
    want = [ref.run([p, [m[0]], [m[1]], big]) for p, m, big in zip(prompts, made, bigs)]
    assert code == 0, log_of(w)
    assert seen == {"": True, HEALTH_SERVICE: True} and draining
    for (exc, h), session in ((new, "late"), (more, "idle"), (dp, "late-dp")):
        assert type(exc) is errors.WorkerDraining, exc
        assert "this worker is draining (shutting down): the step was not run" in str(exc)
        assert h.session == session
    assert len(made) == len(replies) == len(want) == len(sessions)
    assert [[*m, token_of(r, s, 1, 18, BIG)] for m, r, s in zip(made, replies, sessions)] \
        == want
    log = log_of(w)
    assert "SIGTERM received" in log and "drain timeout" not in log, log
    (k,) = found(r"draining: health NOT_SERVING, (\d+) step\(s\) in flight", log)
    assert 1 <= k <= len(sessions), log
    # every step that computed was served: 3 x 3 before, the idle one's, the 3 long ones
    assert f"drained; {3 * 3 + 1 + 3} steps served; 0 admitted step(s) not run" in log, log


async def _admitted(c: ShardClient, steps: list[asyncio.Task], n: int, left: int = 1) -> bool:
    """Whether the worker admitted all ``n`` of ``steps`` (tasks awaiting their replies) and
    still holds at least ``left`` of them: the ones in its queue (``queue_depth``) plus the
    ones already answered make ``n``. Not the queue depth alone: under load the first step
    may finish before the last one is admitted, and the depth never reaches ``n``. The
    answers are counted before the describe: a step answered left the queue before its reply
    was sent, so none is counted twice."""
    answered = sum(t.done() for t in steps)
    depth = (await c.describe()).queue_depth
    return depth >= left and depth + answered == n


async def _health_is(c: ShardClient, service: str, status: str) -> bool:
    return await c.health(service) == status


def _data_plane_refusal(info):
    """A driver's first relayed step on a draining worker (Hello, then a Forward)."""
    d = DataConn(info.data_endpoint)
    try:
        route = uuid.uuid4().hex
        assert d.hello(route) == wire.Hello(route=route)
        h = d.ask(forward(info, "late-dp", 1, 0, tokens(3, 8), reply_to=route))
        assert type(h) is wire.ErrorReply, h
        return h.to_exception(), h
    finally:
        d.close()


@pytest.mark.slow
@pytest.mark.parametrize("plane", ["grpc", "data"])
def test_drain_timeout_stops_waiting_for_steps_and_held_sessions(medium, reaper, plane):
    """With ``--drain-timeout 0.5`` and far more queued work than that (7 sessions x BIG
    tokens, on gRPC streams or on data-plane connections), the drain gives up at the timeout:
    the worker reports how many steps were still running, does not start the queued ones
    (it reports them as not run; their gRPC streams end with WorkerUnavailable), waits only
    for the step computing, exits 0 (not killed by a signal while a data connection's thread
    computes), and sessions held open on gRPC and on the data plane do not keep it alive."""
    n = 8
    w = spawn(reaper, medium, {**DRAIN, "n_slots": n}, ["--drain-timeout", "0.5"])

    async def go():
        c = ShardClient(w.endpoint)
        conns: list[DataConn] = []
        try:
            info = await c.describe()
            held = c.stream()  # a session held open, never closed by this client
            token_of(await held.step(forward(info, "held", 1, 0, tokens(1, 8))), "held", 1, 0, 8)
            d = await asyncio.to_thread(DataConn, info.data_endpoint)
            conns.append(d)
            route = uuid.uuid4().hex
            assert await asyncio.to_thread(d.hello, route) == wire.Hello(route=route)
            # "held" holds one slot: n - 1 long sessions fill the rest
            frames = [forward(info, f"q{i}", 1, 0, tokens(30 + i, BIG)) for i in range(n - 1)]
            if plane == "grpc":
                streams = [c.stream() for _ in frames]
                long = [asyncio.create_task(st.step(f, STEP_TIMEOUT))
                        for st, f in zip(streams, frames)]
            else:
                qs = [await asyncio.to_thread(DataConn, info.data_endpoint) for _ in frames]
                conns += qs
                for q, f in zip(qs, frames):
                    q.send(f)
                long = [asyncio.create_task(asyncio.to_thread(q.recv)) for q in qs]
            # one computing past the timeout, one queued behind it at least
            await poll_until(lambda: _admitted(c, long, n - 1, 2), "the long steps admitted")
            w.proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(w.proc.wait, WAIT)
            done = await asyncio.wait_for(asyncio.gather(*long, return_exceptions=True), WAIT)
            eof = await asyncio.to_thread(d.recv)  # the held data connection was closed
            return code, done, eof
        finally:
            for q in conns:
                q.close()
            await c.close()

    code, done, eof = asyncio.run(go())
    log = log_of(w)
    assert code == 0, log
    assert eof is None
    assert len(done) == n - 1
    (k,) = found(r"drain timeout: (\d+) step\(s\) still running", log)
    assert 1 <= k <= n - 1, log
    steps, not_run = found(r"drained; (\d+) steps served; (\d+) admitted step\(s\) not run", log)
    served = steps - 1  # less the held session's prefill
    if plane == "grpc":
        # a queued step is refused when the stage loop reaches it, once the step computing
        # at the timeout finished: if that happens within the server's stop grace, the
        # refusal is written on the step's still open stream, else the stream is cancelled
        # (WorkerUnavailable); which one depends on timing, both say the step was not run
        answered = [header(r) for r in done if isinstance(r, bytes)]
        results = [h for h in answered if type(h) is wire.Result]
        refused = [h for h in answered if type(h) is not wire.Result]
        for h in refused:
            assert type(h) is wire.ErrorReply and h.code == errors.WorkerDraining.code \
                and "(drain timeout): the step was not run" in h.message, h
        failed = [r for r in done if not isinstance(r, bytes)]
        assert all(isinstance(e, errors.WorkerUnavailable) for e in failed), failed
        assert len(results) <= served and len(refused) <= not_run, log
        # each long step was served, not run, or (at most one) computing when its stream
        # was cancelled; queued ones were left: the worker did not run them all
        assert n - 2 <= served + not_run <= n - 1 and not_run >= 1, log
    else:
        # a data connection is closed by the drain; a step that finished before that
        # answered, one refused before that says why
        for h in done:
            assert h is None or type(h) is wire.Result or (
                type(h) is wire.ErrorReply and h.code == errors.WorkerDraining.code), h
        # connection threads that were waiting for the engine may count after the log line
        assert served + not_run <= n - 1, log


# -- 2. TTL expiry and LRU eviction ------------------------------------------------------------


def test_idle_sessions_expire_after_the_ttl_and_the_route_re_prefills(tiny_llama, reaper):
    """``--ttl 3``: an idle session is dropped by the worker's housekeeping; its next step
    gets UnknownSession, which a route repairs by re-prefilling under a new epoch (the token
    is the whole model's)."""
    ref = Reference(tiny_llama, SMALL)
    w = spawn(reaper, tiny_llama, SMALL, ["--ttl", "3"])
    p0, p1, p2 = tokens(1, 12), tokens(2, 12), tokens(3, 5)

    async def raw_open():
        c = ShardClient(w.endpoint)
        try:
            info = await c.describe()
            st = c.stream()
            token_of(await st.step(forward(info, "raw", 1, 0, p0)), "raw", 1, 0, 12)
            await st.close()
            return info
        finally:
            await c.close()

    async def wait_expired():
        c = ShardClient(w.endpoint)
        try:
            async def empty():
                return (await c.describe()).sessions == 0
            await poll_until(empty, "both idle sessions expired")
            st = c.stream()
            miss = refusal(await st.step(forward(info, "raw", 1, 12, [p0[0]])))
            await st.close()
            return miss
        finally:
            await c.close()

    info = asyncio.run(raw_open())
    with Route([w.endpoint]) as r:
        s = r.session()
        first = s.prefill(p1)
        miss, _ = asyncio.run(wait_expired())
        second = s.prefill(p2)
        assert (s.recoveries, s.epoch) == (1, 2)
        sid = s.id
    assert type(miss) is errors.UnknownSession, miss
    assert "session 'raw' is unknown to this worker (expired, evicted" in str(miss)
    assert [first, second] == ref.run([p1, p2])
    log = log_of(w)
    assert "expire session=raw epoch=1" in log and f"expire session={sid} epoch=1" in log, log


def test_a_new_session_evicts_the_least_recently_used(tiny_llama, reaper):
    """Two slots, ``--evict-after 0``: a third session evicts the session used least
    recently (not the oldest one): the evicted one gets UnknownSession, the others go on
    with the whole model's tokens."""
    ref = Reference(tiny_llama, SMALL)
    w = spawn(reaper, tiny_llama, SMALL, ["--evict-after", "0"])
    pa, pb, pc, pd = (tokens(i, 8) for i in range(4, 8))

    async def go():
        c = ShardClient(w.endpoint)
        try:
            info = await c.describe()
            st = c.stream()

            async def step(s, pos, toks):
                return await st.step(forward(info, s, 1, pos, toks))

            got = {}
            got["a"] = [token_of(await step("a", 0, pa), "a", 1, 0, 8)]
            got["b"] = [token_of(await step("b", 0, pb), "b", 1, 0, 8)]
            got["a"].append(token_of(await step("a", 8, [got["a"][0]]), "a", 1, 8, 1))
            got["c"] = [token_of(await step("c", 0, pc), "c", 1, 0, 8)]  # evicts b, not a
            gone_b = refusal(await step("b", 8, [got["b"][0]]))
            got["a"].append(token_of(await step("a", 9, [got["a"][1]]), "a", 1, 9, 1))
            got["c"].append(token_of(await step("c", 8, [got["c"][0]]), "c", 1, 8, 1))
            got["d"] = [token_of(await step("d", 0, pd), "d", 1, 0, 8)]  # evicts a now
            gone_a = refusal(await step("a", 10, [got["a"][2]]))
            got["c"].append(token_of(await step("c", 9, [got["c"][1]]), "c", 1, 9, 1))
            await st.close()
            return got, gone_b, gone_a
        finally:
            await c.close()

    got, (gone_b, hb), (gone_a, ha) = asyncio.run(go())
    for exc, h, s in ((gone_b, hb, "b"), (gone_a, ha, "a")):
        assert type(exc) is errors.UnknownSession, exc
        assert f"session {s!r} is unknown to this worker" in str(exc) and h.session == s
    assert got == {
        "a": ref.run([pa, [got["a"][0]], [got["a"][1]]]),
        "b": ref.run([pb]),
        "c": ref.run([pc, [got["c"][0]], [got["c"][1]]]),
        "d": ref.run([pd]),
    }
    evicted = re.findall(r"evict session=(\w+) epoch=1", log_of(w))
    assert evicted == ["b", "a"], log_of(w)


# -- 3. a stale epoch on the data plane ------------------------------------------------------


def test_stale_epoch_frame_on_the_data_plane(tiny_llama, reaper):
    """A driver's connection (Hello, relayed Forwards): after the session moved to epoch 2 a
    frame of epoch 1 gets an ErrorReply with StaleEpoch's code, naming the session and the
    stale epoch; the cache is untouched (the next epoch-2 step gives the whole model's token)
    and the connection and the worker keep serving."""
    ref = Reference(tiny_llama, SMALL)
    w = spawn(reaper, tiny_llama, SMALL)
    p = tokens(8, 10)

    info = describe(w.endpoint)
    d = DataConn(info.data_endpoint)
    try:
        route = uuid.uuid4().hex
        assert d.hello(route) == wire.Hello(route=route)

        def ask(epoch, pos, toks, session="x"):
            return d.ask(forward(info, session, epoch, pos, toks, reply_to=route))

        r1 = ask(1, 0, p)
        r2 = ask(2, 0, p)  # a new epoch: the slot starts over
        stale = ask(1, 10, [r1.tokens[0]])
        after = ask(2, 10, [r2.tokens[0]])
        other = ask(1, 0, p[:4], session="y")
    finally:
        d.close()
    assert [type(h) for h in (r1, r2, after, other)] == [wire.Result] * 4
    assert type(stale) is wire.ErrorReply, stale
    assert stale.code == errors.StaleEpoch.code
    assert type(stale.to_exception()) is errors.StaleEpoch
    assert (stale.session, stale.epoch) == ("x", 1)
    assert "session 'x' epoch 1 is stale: this worker serves epoch 2" in stale.message
    assert (after.epoch, after.first_pos) == (2, 10)
    want = ref.run([p, [r2.tokens[0]]])
    assert [r1.tokens, r2.tokens, after.tokens] == [[want[0]], [want[0]], [want[1]]]
    assert other.tokens == [ref.run([p[:4]])[0]]
    final = describe(w.endpoint)
    assert (final.errors_total, final.sessions) == (1, 2)


# -- 4. connection and stream limits ---------------------------------------------------------


def test_max_data_connections(tiny_llama, reaper):
    """``--max-data-connections 2``: two connections are served, a third gets an ErrorReply
    (ResourceExhausted) and is closed; once one of the two closes, a new one is served."""
    w = spawn(reaper, tiny_llama, SMALL, ["--max-data-connections", "2"])

    info = describe(w.endpoint)
    ep = info.data_endpoint
    conns = [DataConn(ep), DataConn(ep)]
    try:
        for i, d in enumerate(conns):  # served: each echoes its Hello
            assert d.hello(f"r{i}") == wire.Hello(route=f"r{i}")
        third = DataConn(ep)
        try:  # refused at once, before it sends anything
            full, closed = third.recv(), third.recv()
        finally:
            third.close()
        assert type(full) is wire.ErrorReply and closed is None, (full, closed)
        assert type(full.to_exception()) is errors.ResourceExhausted
        assert "this worker serves at most 2 data connections" in full.message
        r = conns[1].ask(forward(info, "k", 1, 0, tokens(9, 6), reply_to="r1"))
        assert type(r) is wire.Result, r  # the served ones still work
        conns[0].close()
        fresh = asyncio.run(poll_until(_served_connection(ep), "a new connection served"))
        try:
            r = fresh.ask(forward(info, "k", 1, 6, [r.tokens[0]], reply_to="fresh"))
            assert type(r) is wire.Result and r.first_pos == 6, r
        finally:
            fresh.close()
    finally:
        for d in conns:
            d.close()


def _served_connection(ep: str):
    async def probe():
        d = DataConn(ep)
        h = d.hello("fresh")
        if h == wire.Hello(route="fresh"):
            return d
        d.close()
        assert h is None or (type(h) is wire.ErrorReply
                             and h.code == errors.ResourceExhausted.code), h
        return None
    return probe


def test_max_streams(tiny_llama, reaper):
    """``--max-streams 2`` caps concurrent RPCs (gRPC's maximum_concurrent_rpcs): with two
    step streams open a third stream, and any other RPC, gets RESOURCE_EXHAUSTED
    (ResourceExhausted); once one stream is closed, new RPCs are served again."""
    w = spawn(reaper, tiny_llama, SMALL, ["--max-streams", "2"])
    p = tokens(10, 6)

    async def go():
        c = ShardClient(w.endpoint)
        try:
            info = await c.describe()
            a, b = c.stream(), c.stream()
            ta = token_of(await a.step(forward(info, "a", 1, 0, p)), "a", 1, 0, 6)
            tb = token_of(await b.step(forward(info, "b", 1, 0, p)), "b", 1, 0, 6)
            third = c.stream()
            # gRPC refuses the stream with RESOURCE_EXHAUSTED; when the refusal crosses the
            # client's first write, grpc's aio client reports that write as INTERNAL
            # ("Internal error from Core") instead: the stream is refused either way
            with pytest.raises((errors.ResourceExhausted, errors.WorkerUnavailable)) as refused:
                await third.step(forward(info, "c", 1, 0, p), WAIT)
            assert type(refused.value) is errors.ResourceExhausted \
                or "Internal error from Core" in str(refused.value), refused.value
            with pytest.raises(errors.ResourceExhausted) as rpc_refused:
                await c.describe()
            # the open streams are unaffected
            token_of(await a.step(forward(info, "a", 1, 6, [ta])), "a", 1, 6, 1)
            await b.close()

            async def served():
                try:
                    return await c.describe()
                except errors.ResourceExhausted:
                    return None
            await poll_until(served, "an RPC served after a stream closed")
            fourth = c.stream()  # session b goes on, on a new stream
            token_of(await fourth.step(forward(info, "b", 1, 6, [tb])), "b", 1, 6, 1)
            await fourth.close()
            await a.close()
            return refused.value, rpc_refused.value
        finally:
            await c.close()

    stream_refused, rpc_refused = asyncio.run(go())
    for e in (stream_refused, rpc_refused):
        if type(e) is errors.ResourceExhausted:
            assert "Concurrent RPC limit" in str(e), e
    assert type(rpc_refused) is errors.ResourceExhausted  # a unary call has no such race
