"""The shard service in this process on loopback (port 0): real engine, real gRPC."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading

import grpc
import numpy as np
import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.core.local import generate_local
from dgr.driver.route import AsyncRoute, Route, check_route
from dgr.protocol import wire
from dgr.protocol.describe import StageInfo
from dgr.protocol.sampling import SamplingParams
from dgr.protocol.settings import stage_identity
from dgr.testing.waits import wait_until as _wait_until
from dgr.transport.client import ShardClient
from dgr.transport.server import ShardServer
from dgr.worker.process import ThreadedWorker

SETTINGS = dict(n_ctx=64, n_slots=2, n_threads=1, n_ubatch=8)
PROMPT = list(range(3, 23))  # 20 tokens: three prefill chunks of <= 8


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return dgr.Engine(tiny_llama, **SETTINGS)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return dgr.Engine(tiny_llama, **SETTINGS)


@pytest.fixture(scope="module")
def served(engine):
    with ThreadedWorker(engine, evict_after=3600.0) as tw:
        yield tw


@pytest.fixture
def route(served):
    with Route(served.address, step_timeout=30) as r:
        yield r
    for s in list(served.worker.pipeline.table.snapshot()):
        served.worker.pipeline.table.release(s.session)


def run(coro):
    return asyncio.run(coro)


async def with_client(address, fn):
    c = ShardClient(address)
    try:
        return await fn(c)
    finally:
        await c.close()


# -- control plane ------------------------------------------------------------------------


def test_describe_health_tokenizer(served, engine):
    async def go(c):
        return (await c.describe(), await c.health(), await c.health("dgr.v1.Shard"),
                await c.tokenize("tok_1 tok_2"), await c.detokenize([5, 6]))

    info, h1, h2, toks, text = run(with_client(served.address, go))
    assert info.layers == (0, 4) and info.n_layer == 4 and info.is_first and info.is_last
    assert info.model_identity == engine.identity and info.identity == stage_identity(
        engine.identity, engine.settings)
    assert info.settings == {**SETTINGS, "flash_attn": True, "type_k": "f16", "type_v": "f16",
                             "batch_invariant": False}
    assert info.boundary_width == 64 and info.boundary_dtype == "f32" and info.n_vocab == 128
    assert info.free_slots == 2 and not info.draining and info.arch == "llama"
    assert info.wire_format_version == wire.FORMAT_VERSION
    assert h1 == h2 == "SERVING"
    assert list(toks) == list(engine.tokenize("tok_1 tok_2"))
    assert text == engine.detokenize([5, 6])


def test_a_prompt_is_tokenized_while_a_forward_holds_the_engine(served, engine):
    """The tokenizer's RPCs neither wait for the engine's lock (held by every forward) nor
    hold the worker's event loop: here the lock is held throughout, and they answer."""
    async def go(c):
        return await asyncio.gather(c.tokenize("tok_1 tok_2", timeout=20),
                                    c.detokenize([5, 6], timeout=20),
                                    c.token_pieces(0, 8, timeout=20), c.describe())

    with engine.lock:
        toks, text, pieces, info = run(with_client(served.address, go))
    assert list(toks) == list(engine.tokenize("tok_1 tok_2")) and text == "56"
    assert pieces == engine.token_pieces(0, 8) and info.n_vocab == 128


def test_token_pieces_over_grpc_in_pages(served, engine, monkeypatch):
    """The route fetches the vocabulary's pieces in pages (at most MAX_PIECES ids a call;
    50 here: 3 pages), and they are the engine's; a page too large is refused with
    InvalidArgument."""
    from dgr.driver import async_route
    from dgr.driver.async_route import AsyncRoute
    from dgr.transport.common import MAX_PIECES

    monkeypatch.setattr(async_route, "MAX_PIECES", 50)

    async def go(c):
        with pytest.raises(errors.InvalidArgument, match="count"):
            await c.token_pieces(0, MAX_PIECES + 1)
        page = await c.token_pieces(120, 50)  # past the end: the ids there are
        async with AsyncRoute([served.address]) as r:
            return page, await r.token_pieces(), await r.pieces(), await r.token_pieces(3, 4)

    page, every, kept, some = run(with_client(served.address, go))
    assert every == kept == engine.token_pieces() and len(every) == 128
    assert page == every[120:] and some == every[3:7]


def test_unary_error_travels_as_typed_status(served):
    async def go(c):
        with pytest.raises(errors.InvalidToken, match="outside the vocabulary"):
            await c.detokenize([1000])

    run(with_client(served.address, go))


def test_a_worker_behind_a_300_ms_round_trip_connects(served):
    """The HTTP/2 handshake of a long link takes more than a round trip: the channel's minimum
    connect timeout must allow it (it was 100 ms: no link with a larger round trip, nor a
    worker on a loaded machine, could connect at all)."""
    from dgr.testing.linkemu import LinkEmulator

    with LinkEmulator(served.address, delay_ms=150) as link:  # 150 ms each way
        async def go(c):
            info = await c.describe()
            assert info.layers == (0, 4)
            await c.describe()  # and the connection stays up for the next call

        run(with_client(link.endpoint, go))


def test_unreachable_worker_is_worker_unavailable():
    async def go(c):
        with pytest.raises(errors.WorkerUnavailable, match="127.0.0.1:1"):
            await c.describe(timeout=2)

    run(with_client("127.0.0.1:1", go))


# -- generation through the route ----------------------------------------------------------


def test_greedy_route_equals_whole_model_bit_for_bit(route, reference):
    s = route.session()
    g = s.complete(PROMPT, max_tokens=12, logits=True, stop_on_eog=False)
    ref, rows = generate_local(reference, PROMPT, max_tokens=12, logits=True, stop_on_eog=False)
    assert g.tokens == ref and len(g.tokens) == 12
    assert len(g.logits) == len(rows) == 12
    for a, b in zip(g.logits, rows):
        assert a.tobytes() == b.tobytes()
    # three prefill chunks (8 + 8 + 4) and 11 decode steps
    assert s.inner.steps[:3] == [(0, 8), (8, 8), (16, 4)] and len(s.inner.steps) == 14
    s.close()


def _allowed(row: np.ndarray, sp: SamplingParams) -> set[int]:
    """The tokens ``sp`` may draw from ``row``, computed here from its definition: the
    ``top_k`` best logits, then the fewest of those (best first) whose softmax at
    ``temperature`` reaches ``top_p``."""
    best = sorted(range(len(row)), key=lambda t: (-float(row[t]), t))[:sp.top_k]
    z = np.array([float(row[t]) for t in best]) / sp.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    total, keep = 0.0, []
    for t, q in zip(best, p):
        keep.append(t)
        total += q
        if total >= sp.top_p:
            break
    return set(keep)


def test_streamed_tokens_and_sampling(route, reference):
    # hot: the random tiny model's logits are so peaked that at a usual temperature top-k
    # and top-p leave one or two tokens; at 8 both cut (a draw ignoring either one leaves
    # the allowed set below at least twice in these 10 tokens)
    sp = SamplingParams(temperature=8.0, top_k=10, top_p=0.8, seed=7)
    s = route.session()
    toks = list(s.generate(PROMPT, max_tokens=10, sampling=sp, stop_on_eog=False,
                           logits=True))
    rows = s.logits
    assert len(toks) == len(rows) == 10
    # independent of dgr's sampler: the whole model in this process, fed the route's
    # tokens, computes the very rows the route sampled from ...
    reference.release(0)
    want = [reference.forward(0, 0, PROMPT)[0].copy()]
    for pos, t in enumerate(toks[:-1], len(PROMPT)):
        want.append(reference.forward(0, pos, [t])[0].copy())
    reference.release(0)
    assert len(want) == len(rows) and all(a.tobytes() == b.tobytes() for a, b in zip(rows, want))
    # ... and each token is one that temperature, top-k and top-p allow from its row; the
    # temperature was applied (not all of them are the argmax)
    allowed = [_allowed(row, sp) for row in want]
    assert all(t in a for t, a in zip(toks, allowed)), (toks, allowed)
    assert any(t != int(np.argmax(row)) for t, row in zip(toks, want))
    # the same seed draws the same tokens in process (the route keys each draw by position)
    ref, _ = generate_local(reference, PROMPT, max_tokens=10, sampling=sp, stop_on_eog=False)
    assert toks == ref
    other = list(s.generate(PROMPT, max_tokens=10, sampling=dataclasses.replace(sp, seed=8),
                            stop_on_eog=False))
    assert other != toks  # the seed matters
    s.close()


def test_stop_string(route):
    s = route.session()
    full = s.complete(PROMPT, max_tokens=6, stop_on_eog=False)
    prefix = route.detokenize(full.tokens[:3])  # first complete after exactly 3 tokens
    g = s.complete(PROMPT, max_tokens=6, stop_on_eog=False, stop=["never", prefix])
    assert g.stop_reason == "stop" and g.tokens == full.tokens[:3]
    assert g.text == ""  # the text ends before the stop string
    s.close()


def test_async_api_concurrent_sessions(served, reference):
    async def go():
        async with AsyncRoute(served.address) as r:
            async def one(i):
                s = r.session()
                p = [t + i for t in PROMPT]
                try:
                    return p, await s.complete(p, max_tokens=6, stop_on_eog=False)
                finally:
                    await s.close()
            return await asyncio.gather(one(0), one(1))

    for p, g in run(go()):
        assert g.tokens == generate_local(reference, p, max_tokens=6, stop_on_eog=False)[0]


def test_recovery_after_the_worker_lost_the_session(served, reference):
    route = Route(served.address, loop=False)  # token by token: the loss lands mid-generation
    s = route.session()
    it = s.generate(PROMPT, max_tokens=10, stop_on_eog=False)
    toks = [next(it) for _ in range(4)]
    served.worker.pipeline.table.release(s.id)  # as if the worker restarted or evicted it
    toks += list(it)
    ref, _ = generate_local(reference, PROMPT, max_tokens=10, stop_on_eog=False)
    assert toks == ref and s.recoveries == 1 and s.epoch == 2
    s.close()
    route.close()


# -- raw frames: every refusal is an ErrorReply, and the stream keeps serving ---------------


def fwd(ident, session, epoch, pos, toks, **kw):
    return wire.encode(wire.Forward(model=ident, session=session, epoch=epoch, first_pos=pos,
                                    n_tokens=len(toks), layer=kw.pop("layer", 0), tokens=toks,
                                    want=kw.pop("want", "token"), **kw))


def reply(data):
    return wire.decode(data).header


def test_session_errors_over_the_stream(served):
    ident = stage_identity(served.worker.pipeline.model_identity, served.worker.pipeline.settings)

    async def go(c):
        st = c.stream()
        ok = reply(await st.step(fwd(ident, "s1", 2, 0, [1, 2, 3])))
        assert type(ok) is wire.Result and len(ok.tokens) == 1
        cases = [
            (fwd(ident, "s1", 1, 3, [4]), errors.StaleEpoch, "epoch 1 is stale"),
            (fwd(ident, "s1", 2, 5, [4]), errors.CacheMiss, "continues at 3"),
            (fwd(ident, "nobody", 1, 9, [4]), errors.UnknownSession, "unknown to this worker"),
            (fwd("sha256:" + "0" * 64 + "+x", "s1", 2, 3, [4]), errors.ModelMismatch,
             "this worker serves"),
            (fwd(ident.split("+")[0] + "+ctx1.slots1", "s1", 2, 3, [4]), errors.ModelMismatch,
             "numeric settings"),
            (fwd(ident, "s1", 2, 3, [4], layer=2), errors.RouteError, "serves layers [0, 4)"),
            (fwd(ident, "s1", 2, 3, [999]), errors.InvalidToken, "vocabulary"),
            (b"DGRF garbage", errors.FrameTruncated, "frame truncated"),
            (b"NOPE" + bytes(60), errors.FrameError, "not a dgr frame"),
        ]
        for frame, cls, msg in cases:
            r = reply(await st.step(frame))
            assert type(r) is wire.ErrorReply, (cls, r)
            exc = r.to_exception()
            assert type(exc) is cls and msg in str(exc), (cls, exc)
        # the invalid token aborted s1 (its cache is suspect): it must be re-prefilled
        r = reply(await st.step(fwd(ident, "s1", 2, 3, [4])))
        assert r.to_exception().__class__ is errors.UnknownSession
        r = reply(await st.step(fwd(ident, "s1", 3, 0, [1, 2, 3, 4])))
        assert type(r) is wire.Result
        assert (await c.release("s1")) is True
        await st.close()

    run(with_client(served.address, go))


def test_full_worker(served):
    ident = stage_identity(served.worker.pipeline.model_identity, served.worker.pipeline.settings)

    async def go(c):
        st = c.stream()
        for name in ("f1", "f2"):
            assert type(reply(await st.step(fwd(ident, name, 1, 0, [1])))) is wire.Result
        r = reply(await st.step(fwd(ident, "f3", 1, 0, [1])))
        exc = r.to_exception()
        assert type(exc) is errors.ResourceExhausted and "all 2 slots are in use" in str(exc)
        assert exc.retry_after is not None and exc.retry_after > 0
        await c.release("f1")
        assert type(reply(await st.step(fwd(ident, "f3", 1, 0, [1])))) is wire.Result
        for name in ("f2", "f3"):
            await c.release(name)
        await st.close()

    run(with_client(served.address, go))


# -- transport alone: deadlines, limits, draining ------------------------------------------


class SlowBackend:
    def describe(self):
        raise errors.EngineError("no engine here")

    def release(self, session, keep=(), chunk=0, whole=None):
        return False, False

    def tokenize(self, text, add_special, parse_special):
        return []

    def detokenize(self, tokens, remove_special, unparse_special):
        return ""

    async def step(self, frame):
        await asyncio.sleep(float(frame.decode()))
        return frame


def test_step_deadline_and_message_limit():
    async def go():
        srv = ShardServer(SlowBackend(), "127.0.0.1:0", max_message=1 << 16)
        await srv.start()
        c = ShardClient(srv.address)
        try:
            st = c.stream()
            assert await st.step(b"0.0", timeout=5) == b"0.0"
            with pytest.raises(errors.StepDeadlineExceeded, match="no reply within 0.2 s"):
                await st.step(b"1.0", timeout=0.2)
            assert st.broken
            with pytest.raises(errors.EngineError, match="no engine here"):
                await c.describe()
            with pytest.raises(errors.FrameTooLarge):
                await c.stream().step(b"0" * (1 << 17), timeout=5)
        finally:
            await c.close()
            await srv.stop(None)

    run(go())


def test_drain_refuses_new_work(tiny_llama):
    eng = dgr.Engine(tiny_llama, **SETTINGS)
    tw = ThreadedWorker(eng)
    ident = stage_identity(tw.worker.pipeline.model_identity, tw.worker.pipeline.settings)
    try:
        async def before(c):
            st = c.stream()
            assert type(reply(await st.step(fwd(ident, "d", 1, 0, [1])))) is wire.Result
            return st

        async def go(c):
            st = await before(c)
            tw.worker.pipeline.draining = True  # the first thing drain() does
            r = reply(await st.step(fwd(ident, "d", 1, 1, [2])))
            assert type(r.to_exception()) is errors.WorkerDraining
            r = reply(await c.stream().step(fwd(ident, "e", 1, 0, [1])))
            assert type(r.to_exception()) is errors.WorkerDraining
            tw.worker.pipeline.draining = False
            await tw.server.set_serving(False)
            assert await c.health() == "NOT_SERVING"
        run(with_client(tw.address, go))
        tw.drain(5)
        assert tw.worker.pipeline.draining and len(tw.worker.pipeline.table) == 0
    finally:
        tw.stop()


def test_drain_runs_a_step_admitted_before_it_that_opens_its_session(tiny_llama):
    # a step takes its session's lease only when it reaches the engine: one admitted before
    # the drain began that opens its session gets there during the drain, and is in flight
    # like any other (not refused as a new session)
    eng = dgr.Engine(tiny_llama, **SETTINGS)
    tw = ThreadedWorker(eng)
    w = tw.worker.pipeline
    try:
        async def go(c):
            with eng.lock:  # the engine is busy: the step is admitted, then waits for it
                step = asyncio.ensure_future(
                    c.stream().step(fwd(w.identity, "n", 1, 0, [1, 2, 3]), 30))
                await asyncio.to_thread(_wait_until, lambda: w.inflight == 1, "admitted", 10)
                assert "n" not in w.table  # no lease yet
                drain = asyncio.ensure_future(asyncio.to_thread(tw.drain, 10))
                await asyncio.to_thread(_wait_until, lambda: w.draining, "draining", 10)
            r = reply(await step)
            await drain
            return r

        r = run(with_client(tw.address, go))
        assert type(r) is wire.Result and r.session == "n" and len(r.tokens) == 1, r
        assert w.steps_total == 1 and w.not_run == 0
    finally:
        tw.stop()


# -- route checks -------------------------------------------------------------------------


def info(ep, a, b, n=30, ident="sha256:m", **settings):
    s = {"n_ctx": 1024, "n_slots": 4, "n_threads": 1, "n_ubatch": 64, "flash_attn": True,
         "type_k": "f16", "type_v": "f16", **settings}
    return StageInfo(
        endpoint=ep, model_identity=ident, model_name="m", arch="llama", n_layer=n,
        layers=(a, b), is_first=a == 0, is_last=b == n, needs_token_ids=False,
        boundary_width=576, boundary_dtype="f32", n_vocab=100, settings=s,
        eog_tokens=frozenset({2}), add_bos=False, free_slots=4, sessions=0, free_context=0,
        queue_depth=0, recent_tokens_per_s=0.0, recent_step_ms=0.0, draining=False,
        dgr_version="0", wire_format_version=wire.FORMAT_VERSION, wire_schema_version=1,
        weight_bytes=0, kv_bytes=0, steps_total=0, errors_total=0, uptime_s=0.0)


def test_check_route_orders_and_accepts_a_cover():
    order = check_route([info("c", 20, 30), info("a", 0, 10), info("b", 10, 20)])
    assert [s.endpoint for s in order] == ["a", "b", "c"]


@pytest.mark.parametrize("stages,cls,msg", [
    ([info("a", 0, 10), info("b", 12, 30)], errors.RouteError,
     r"layers \[10, 12\) are not covered: gap between a \[0, 10\) and b \[12, 30\)"),
    ([info("a", 0, 12), info("b", 10, 30)], errors.RouteError,
     r"layers \[10, 12\) are served twice: a \[0, 12\) overlaps b \[10, 30\)"),
    ([info("a", 2, 30)], errors.RouteError, r"layers \[0, 2\) are not covered"),
    ([info("a", 0, 20)], errors.RouteError, r"layers \[20, 30\) are not covered"),
    ([info("a", 0, 10), info("b", 10, 30, ident="sha256:other")], errors.ModelMismatch,
     "b serves model sha256:other"),
    ([info("a", 0, 10), info("b", 10, 30, n_threads=2)], errors.ModelMismatch,
     "n_threads=2 vs 1"),
])
def test_check_route_rejects(stages, cls, msg):
    with pytest.raises(cls, match=msg):
        check_route(stages)


async def _describe(address):
    c = ShardClient(address)
    try:
        return await c.describe()
    finally:
        await c.close()


def test_a_route_of_two_llama_cpp_pins_is_refused_by_name(served):
    """Every worker says its compiled core's pin (Describe ``llama_cpp_commit``,
    ``patch_stack_hash``: the build's own); a route whose stages say two pins, or one that
    does not say it (an older worker), is refused naming both."""
    from dgr.control.capability import build_info

    got = asyncio.run(_describe(served.address))
    b = build_info()
    assert (got.llama_cpp_commit, got.patch_stack_hash) == (b["llama_cpp_commit"],
                                                            b["patch_stack_hash"])
    assert len(got.llama_cpp_commit) == 40 and got.patch_stack_hash
    a = dataclasses.replace(info("a", 0, 10), llama_cpp_commit=got.llama_cpp_commit,
                            patch_stack_hash=got.patch_stack_hash)
    bumped = dataclasses.replace(info("b", 10, 30), llama_cpp_commit="f" * 40,
                                 patch_stack_hash=got.patch_stack_hash)
    want = (f"b computes with llama.cpp ffffffffffff + patch stack "
            f"{got.patch_stack_hash[:12]}, a with llama.cpp {got.llama_cpp_commit[:12]}")
    with pytest.raises(errors.ModelMismatch, match=re.escape(want)):
        check_route([a, bumped])
    with pytest.raises(errors.ModelMismatch, match="a llama.cpp pin it does not say"):
        check_route([a, info("b", 10, 30)])
    check_route([a, dataclasses.replace(bumped, llama_cpp_commit=got.llama_cpp_commit)])


def test_a_route_of_two_cpu_variants_is_refused_unless_asked(served):
    """Describe says the stage's CPU code (``cpu_variant``: this build's); a native stage and
    a portable wheel's (x86-64-v3) run other kernels, so a route of both is refused as one of
    two kinds of device is, and taken with ``mixed_devices``."""
    got = asyncio.run(_describe(served.address))
    from dgr._core import BUILD_INFO

    assert got.cpu_variant == BUILD_INFO["cpu_variant"] == "native"
    a = dataclasses.replace(info("a", 0, 10), cpu_variant="native")
    b = dataclasses.replace(info("b", 10, 30), cpu_variant="x86-64-v3")
    with pytest.raises(errors.ModelMismatch,
                       match="b runs x86-64-v3 CPU code, a native: other kernels"):
        check_route([a, b])
    assert [s.endpoint for s in check_route([a, b], mixed_devices=True)] == ["a", "b"]
    check_route([a, dataclasses.replace(b, cpu_variant="")])  # an older worker: not said


def test_route_refuses_a_draining_stage():
    s = dataclasses.replace(info("a", 0, 30), draining=True)
    with pytest.raises(errors.WorkerDraining):
        check_route([s])


@pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the llama.cpp layer-range patches (dgr._core.HAS_LAYER_RANGES)")
def test_two_in_process_stages(tiny_llama, reference):
    a = ThreadedWorker(dgr.Engine(tiny_llama, layers=(0, 2), **SETTINGS))
    b = ThreadedWorker(dgr.Engine(tiny_llama, layers=(2, 4), **SETTINGS))
    try:
        with Route([b.address, a.address]) as r:
            assert [s.layers for s in r.stages] == [(0, 2), (2, 4)]
            g = r.complete(PROMPT, max_tokens=8, logits=True, stop_on_eog=False)
        ref, rows = generate_local(reference, PROMPT, max_tokens=8, logits=True,
                                   stop_on_eog=False)
        assert g.tokens == ref
        assert len(g.logits) == len(rows) == 8
        assert all(x.tobytes() == y.tobytes() for x, y in zip(g.logits, rows))
    finally:
        a.stop()
        b.stop()


def test_a_split_route_samples_with_logit_bias_as_the_whole_model(tiny_llama, reference):
    """logit_bias travels to the last stage (in the wire's Sampling, through the relay and
    the decode loop) and is applied there before the argmax or the draw, exactly as the
    whole model in this process applies it: the same tokens, greedy and sampled, and not
    the unbiased ones."""
    a = ThreadedWorker(dgr.Engine(tiny_llama, layers=(0, 2), **SETTINGS))
    b = ThreadedWorker(dgr.Engine(tiny_llama, layers=(2, 4), **SETTINGS))
    try:
        plain, _ = generate_local(reference, PROMPT, max_tokens=8, stop_on_eog=False)
        with Route([a.address, b.address]) as r:
            for temperature in (0.0, 3.0):
                # ban the plain run's first tokens, promote another
                sp = SamplingParams(temperature=temperature, seed=5, logit_bias=tuple(
                    sorted({(t, -100.0) for t in plain[:3]} | {(plain[3] ^ 1, 1.5)})))
                g = r.complete(PROMPT, max_tokens=8, sampling=sp, stop_on_eog=False)
                ref, _ = generate_local(reference, PROMPT, max_tokens=8, sampling=sp,
                                        stop_on_eog=False)
                assert g.tokens == ref and len(ref) == 8
                assert not set(ref) & set(plain[:3]) and ref != plain
    finally:
        a.stop()
        b.stop()


@pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the llama.cpp layer-range patches (dgr._core.HAS_LAYER_RANGES)")
def test_inputs_that_cannot_run_are_refused_before_they_take_a_slot(tiny_llama):
    # a frame whose boundary cannot run on this stage is refused at admission with the class
    # the engine would raise, before the session table gives it a slot: the session it names
    # keeps its state (a stranger's malformed frame must not drop or evict a session), and
    # the worker goes on serving
    a = ThreadedWorker(dgr.Engine(tiny_llama, layers=(0, 2), **SETTINGS), data_port=None)
    b = ThreadedWorker(dgr.Engine(tiny_llama, layers=(2, 4), **SETTINGS), data_port=None)
    x = np.random.default_rng(2).standard_normal((2, 64), dtype=np.float32)

    def frame(w, session, array, tokens=None, pos=0, **kw):
        return wire.encode(wire.Forward(model=w.worker.pipeline.identity, session=session, epoch=1,
                                        first_pos=pos, n_tokens=2,
                                        layer=w.worker.pipeline.layers[0],
                                        tokens=tokens, **kw), array)

    cases = [  # (stage, frame, class)
        (b, frame(b, "w", np.zeros((2, 63), np.float32), pos=2, want="token"),
         errors.InvalidBoundary),  # the boundary's width is not this stage's
        (b, frame(b, "t", None, tokens=[1, 2], want="token"),
         errors.InvalidBoundary),  # a later stage takes a boundary
        (a, frame(a, "f", x, tokens=[1, 2]), errors.InvalidBoundary),  # a first stage: ids
        (a, frame(a, "l", None, tokens=[1, 2], want="token"),
         errors.InvalidArgument),  # the worker's own: a middle stage returns a boundary
    ]

    async def go():
        clients = {w: ShardClient(w.address) for w in (a, b)}
        try:
            streams = {w: c.stream() for w, c in clients.items()}
            ok = reply(await streams[b].step(frame(b, "w", x, want="token")))
            got = [reply(await streams[w].step(f)) for w, f, _ in cases]
            kept = reply(await streams[b].step(frame(b, "w", x, pos=2, want="token")))
            return ok, got, kept
        finally:
            for c in clients.values():
                await c.close()

    try:
        ok, got, kept = run(go())
        sessions = (len(a.worker.pipeline.table), len(b.worker.pipeline.table))
    finally:
        a.stop()
        b.stop()
    assert len(got) == len(cases) == 4
    for (_, _, cls), r in zip(cases, got):
        assert type(r) is wire.ErrorReply and type(r.to_exception()) is cls, (cls, r)
    assert type(ok) is wire.Result and len(ok.tokens) == 1
    # "w" kept its two positions through the refused frame that named it: it continues at 2
    assert type(kept) is wire.Result and kept.first_pos == 2 and len(kept.tokens) == 1, kept
    assert sessions == (0, 1)  # no refused step opened a session


def test_grpc_status_of_an_unknown_method(served):
    async def go():
        async with grpc.aio.insecure_channel(served.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await ch.unary_unary("/dgr.v1.Shard/Nope")(b"", timeout=5)
            return ei.value.code()

    assert run(go()) == grpc.StatusCode.UNIMPLEMENTED


# -- multi-stage relay and recovery, today, with a toy range engine -------------------------


class ToyEngine:
    """A toy 'model' with causal per-slot state, split into layer ranges like dgr.Engine.

    Layer l maps each row to ``tanh(x + w_l * mean of this layer's inputs so far)``; the head
    is the tied embedding. Row by row in float32, so any split computes the same bits as the
    whole, and a cache that is not continued raises InvalidPosition as the real engine does.
    """

    N_LAYER, N_EMBD, N_VOCAB = 4, 8, 16

    def __init__(self, layers=(0, 4), n_slots=2):
        rng = np.random.default_rng(0)
        self.emb = rng.standard_normal((self.N_VOCAB, self.N_EMBD)).astype(np.float32)
        self.w = np.float32([0.5, -0.3, 0.8, 0.2])
        self.layers = tuple(layers)
        self.n_slots = n_slots
        self.is_first, self.is_last = layers[0] == 0, layers[1] == self.N_LAYER
        self.n_embd_boundary, self.n_vocab, self.needs_token_ids = self.N_EMBD, self.N_VOCAB, False
        self.settings = {"n_ctx": 64, "n_slots": n_slots, "n_threads": 1, "n_ubatch": 4,
                         "flash_attn": True, "type_k": "f16", "type_v": "f16"}
        self.state = {}
        self.calls = 0
        self.lock = threading.RLock()  # the engine's one lock (dgr.Engine.lock)

    def describe(self):
        return {"identity": "sha256:toy", "model": "toy.gguf", "arch": "toy",
                "n_layer": self.N_LAYER, "add_bos": False, "weight_bytes": 1, "kv_bytes": 1}

    def is_eog(self, t):
        return t == 0

    def tokenize(self, text, add_special=True, parse_special=False):
        return np.array([int(x) for x in text.split()], dtype=np.int32)

    def detokenize(self, tokens, remove_special=False, unparse_special=False):
        return " ".join(str(int(t)) for t in tokens)

    def token_pieces(self, first=0, count=None, special=False):
        end = self.N_VOCAB if count is None else min(self.N_VOCAB, first + count)
        return [f"{t} ".encode() for t in range(first, end)]

    def release(self, slot):
        self.state.pop(slot, None)

    def forward(self, slot, positions, tokens=None, boundary=None, *, logits="last", out=None):
        self.calls += 1
        st = self.state.setdefault(slot, {"pos": 0, "sum": {}, "n": 0})
        n = len(tokens) if boundary is None else len(boundary)
        first = positions if isinstance(positions, int) else int(positions[0])
        if first != st["pos"]:
            raise errors.InvalidPosition(f"slot {slot} continues at {st['pos']}, not {first}")
        x = (self.emb[np.asarray(tokens)] if self.is_first else np.array(boundary)).copy()
        for i in range(n):
            for layer in range(*self.layers):
                s = st["sum"].get(layer, np.zeros(self.N_EMBD, np.float32)) + x[i]
                st["sum"][layer] = s
                x[i] = np.tanh(x[i] + self.w[layer] * s / np.float32(st["pos"] + i + 1))
        st["pos"] += n
        if not self.is_last:
            if out is not None:
                out[:n] = x
                return out[:n]
            return x
        if isinstance(logits, str):
            mask = np.zeros(n, bool)
            mask[-1 if logits == "last" else slice(None)] = True
        else:
            mask = np.asarray(logits, bool)
        return (x[mask] @ self.emb.T).astype(np.float32)


def test_toy_whole_equals_toy_split():
    whole, a, b = ToyEngine(), ToyEngine((0, 1)), ToyEngine((1, 4))
    toks = np.array([3, 5, 7, 9, 2], dtype=np.int32)
    ref = whole.forward(0, 0, toks, logits="all")
    got = b.forward(0, 0, boundary=a.forward(0, 0, toks), logits="all")
    assert ref.tobytes() == got.tobytes()


@pytest.mark.parametrize("loop", [False, True], ids=["token-by-token", "decode-loop"])
def test_three_toy_stages_relay_and_recover(loop):
    stages = [ThreadedWorker(ToyEngine(r), evict_after=3600.0) for r in ((2, 4), (0, 1), (1, 2))]
    try:
        prompt = [3, 5, 7, 9, 2, 4, 6, 8, 1, 11]  # three chunks of n_ubatch 4
        ref, rows = generate_local(ToyEngine(), prompt, max_tokens=12, logits=True,
                                   stop_on_eog=False)
        with Route([s.address for s in stages], loop=loop) as r:
            assert [st.layers for st in r.stages] == [(0, 1), (1, 2), (2, 4)]
            assert r.tokenize("3 5").tolist() == [3, 5]
            s = r.session()
            g = s.complete(prompt, max_tokens=12, logits=True, stop_on_eog=False)
            assert g.tokens == ref
            assert len(g.logits) == len(rows) == 12
            assert all(x.tobytes() == y.tobytes() for x, y in zip(g.logits, rows))
            # the last stage loses the session mid-generation: re-prefill, same tokens. The
            # decode loop runs ahead of the reader (here it may finish all 11 tokens before
            # a loss after the fifth), so with it the loss lands right after the prefill's
            # token, before the loop's first step
            it = s.generate(prompt, max_tokens=12, stop_on_eog=False)
            toks = [next(it) for _ in range(1 if loop else 5)]
            stages[2].worker.pipeline.table.release(s.id)
            toks += list(it)
            assert toks == ref and s.recoveries == 1
            # the replay repeated the original prompt chunks exactly
            assert s.inner.steps[:3] == [(0, 4), (4, 4), (8, 2)]
            s.close()
    finally:
        for s in stages:
            s.stop()


def test_route_waits_for_a_slot_when_the_worker_is_full():
    tw = ThreadedWorker(ToyEngine(n_slots=1), evict_after=0.3)
    try:
        ref, _ = generate_local(ToyEngine(), [3, 5, 7], max_tokens=2, stop_on_eog=False)
        with Route(tw.address) as r:
            a = r.session()
            a.complete([3, 5, 7], max_tokens=2, stop_on_eog=False)  # a holds the only slot
            b = r.session()
            # refused (all slots in use), b retries until a idles out and is evicted
            g = b.complete([3, 5, 7], max_tokens=2, stop_on_eog=False)
            assert g.tokens == ref and len(ref) == 2 and b.recoveries == 1
            assert [e.session for e in tw.worker.pipeline.table.snapshot()] == [b.id]
            with pytest.raises(errors.UnknownSession):  # a was evicted: its next step misses
                asyncio.run(_step_raw(tw.address, a.id))
            b.close()
    finally:
        tw.stop()


def test_a_step_released_while_it_waited_does_not_run_on_the_reused_slot():
    # x's step passed admission, then x was released (a driver's close, a drain) and its only
    # slot went to y before x's step reached the engine: x's step must not compute there
    from dgr.worker.pipeline import StagePipeline
    from dgr.worker.step import Step

    w = StagePipeline(ToyEngine(n_slots=1))
    eng = w.engine
    try:
        def step(session, pos, toks):
            h = wire.Forward(model=w.identity, session=session, epoch=1, first_pos=pos,
                             n_tokens=len(toks), layer=0, tokens=toks, want="token")
            return Step(h, None, w.table.acquire(session, 1, pos, len(toks)), 0.0)

        s = step("x", 0, [3, 5, 7])
        w.compute(s)
        w.table.commit(s.lease)
        sx = step("x", 3, [9])  # admitted, waiting for the engine
        assert w.slots.release("x") == (True, False)
        sy = step("y", 0, [3, 5, 7])  # the freed slot, at once
        assert sy.lease.slot == sx.lease.slot
        y0 = w.compute(sy).tokens
        w.table.commit(sy.lease)
        calls = eng.calls
        with pytest.raises(errors.CacheMiss, match="released while this step waited"):
            w.compute(sx)
        w.table.abort(sx.lease)  # what a failed step does: a no-op, x is gone
        assert eng.calls == calls and eng.state[sy.lease.slot]["pos"] == 3  # y's cache untouched
        sy = step("y", 3, [9])
        assert w.compute(sy).tokens  # y continues where it was
        w.table.commit(sy.lease)
        assert y0 is not None and w.table.get("y").next_pos == 4
    finally:
        w.scheduler.stop()


class WatchedLock:
    """A re-entrant lock that says whether the calling thread holds it, and in which of its
    holds (counted each time it is taken while free)."""

    def __init__(self):
        self._lock = threading.RLock()
        self._owner: int | None = None
        self._depth = 0
        self.holds = 0

    def __enter__(self) -> WatchedLock:
        self._lock.acquire()
        if self._depth == 0:
            self.holds += 1
            self._owner = threading.get_ident()
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
        self._lock.release()

    def hold(self) -> int | None:
        """The calling thread's hold, None when it does not hold the lock."""
        return self.holds if self._owner == threading.get_ident() else None


def test_the_worker_computes_in_one_hold_of_the_engines_lock():
    # the deferred releases, the check that the lease still holds its slot and the forward
    # run in one hold of engine.lock: no other thread's compute can come between them
    from dgr.worker.worker import Worker

    eng = ToyEngine(n_slots=1)
    eng.lock = WatchedLock()
    w = Worker(eng)
    seen: list[tuple[str, int | None]] = []

    def watch(obj, name):
        real = getattr(obj, name)

        def call(*a, **kw):
            seen.append((name, eng.lock.hold()))
            return real(*a, **kw)
        setattr(obj, name, call)

    for obj, name in ((eng, "release"), (eng, "forward"), (w.pipeline.table, "holds")):
        watch(obj, name)
    try:
        # each new session's slot is released before its first step (x's and y's), and y
        # takes x's, released when x was
        for session in ("x", "y"):
            r = reply(asyncio.run(w.step(fwd(w.pipeline.identity, session, 1, 0, [3, 5, 7]))))
            assert type(r) is wire.Result, r
            assert w.release(session) == (True, False)
    finally:
        w.pipeline.scheduler.stop()
    names = [n for n, _ in seen]
    assert names == ["holds", "release", "forward", "holds", "release", "release", "forward"]
    held = [h for _, h in seen]
    assert None not in held, seen
    assert held[:3] == [held[0]] * 3 and held[3:] == [held[3]] * 4 and held[0] != held[3]


async def _step_raw(address, session):
    c = ShardClient(address)
    try:
        info = await c.describe()
        r = reply(await c.stream().step(fwd(info.identity, session, 1, 4, [1])))
        raise r.to_exception()
    finally:
        await c.close()


def test_route_errors_name_the_stage(route, served):
    with pytest.raises(errors.InvalidToken, match=rf"{served.address} \[0, 4\): .*vocabulary"):
        route.complete([1, 999], max_tokens=2)


def test_inline_below_ms_keeps_results_and_order(tiny_llama, reference):
    tw = ThreadedWorker(dgr.Engine(tiny_llama, **SETTINGS), inline_below_ms=10_000)
    try:
        with Route(tw.address, relay=False) as r:  # inline compute is a gRPC-path option
            for _ in range(2):  # the second generation reuses the slot: release, then compute
                g = r.complete(PROMPT, max_tokens=10, logits=True, stop_on_eog=False)
                ref, rows = generate_local(reference, PROMPT, max_tokens=10, logits=True,
                                           stop_on_eog=False)
                assert g.tokens == ref
                assert len(g.logits) == len(rows) == 10
                assert all(a.tobytes() == b.tobytes() for a, b in zip(g.logits, rows))
        assert tw.worker.inline_steps >= 10  # decode steps ran on the loop thread
    finally:
        tw.stop()


def test_a_stage_replaced_by_the_same_worker_is_not_sent_a_release():
    # a step misses its deadline, the only worker of the range is chosen again: the route
    # must not Release the session there in the background (it would land on the session
    # the recovery is rebuilding there); the higher epoch supersedes the old state
    eng = ToyEngine()
    slow = {"left": 0}
    forward = eng.forward
    r = None

    def maybe_slow(*a, **k):
        if slow["left"]:  # this step ends only once the route has given up on it
            slow["left"] -= 1
            _wait_until(lambda: r.aroute.replacements, "the route replaces the slow stage")
        return forward(*a, **k)

    eng.forward = maybe_slow
    tw = ThreadedWorker(eng, evict_after=3600.0)
    released = []
    real_release = tw.worker.release
    tw.worker.release = lambda session, *a: (released.append(session),
                                             real_release(session, *a))[1]
    try:
        prompt = [3, 5, 7, 9, 2]
        ref, _ = generate_local(ToyEngine(), prompt, max_tokens=12, stop_on_eog=False)
        with Route(tw.address, deadline_floor=0.3, step_timeout=0.3, relay=False) as r:
            s = r.session()
            it = s.generate(prompt, max_tokens=12, stop_on_eog=False)
            toks = [next(it) for _ in range(4)]
            slow["left"] = 1
            toks += list(it)
            # the route's background work for the replaced stage (closing its stream, and a
            # Release were it sent one) has finished
            _wait_until(lambda: not s.inner._cleanup, "the replaced stage's cleanup ends")
            assert toks == ref and s.recoveries >= 1
            assert r.aroute.replacements and r.aroute.replacements[0][1:] == (tw.address,) * 2
            assert s.id not in released
            s.close()
        assert s.id in released  # closing releases as usual
    finally:
        tw.stop()
