"""Route loss and recovery with real worker processes on loopback (tiny llama fixture).

A stage that dies (SIGKILL), hangs (SIGSTOP) or comes back empty on its old address during a
greedy generation: the driver detects it (gRPC status, sized deadline, cache miss), takes a
spare from its route provider (or waits for the restarted worker), raises the epoch,
re-prefills the whole history and carries on: the tokens are those of an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.provider import StaticPool
from dgr.route import AsyncRoute, Route, generate_local
from dgr.transport.client import ShardClient
from dgr.worker import LocalCluster

pytestmark = [pytest.mark.system,
              pytest.mark.skipif(not HAS_LAYER_RANGES, reason="multi-stage routes need the "
                                 "llama.cpp layer-range patches (dgr._core.HAS_LAYER_RANGES)")]

SETTINGS = dict(n_ctx=160, n_slots=24, n_threads=1, n_ubatch=32, flash_attn=True)
RANGES = [(0, 1), (1, 3), (3, 4)]
N_TOKENS = 64


def prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(1, 128) for _ in range(12 + i % 9)]


@pytest.fixture(scope="module")
def whole(tiny_llama):
    return dgr.Engine(tiny_llama, **{**SETTINGS, "n_slots": 1})


@pytest.fixture(scope="module")
def refs(whole):
    """Uninterrupted greedy tokens of prompts 0..19 (the in-process whole model)."""
    return [generate_local(whole, prompt(i), max_tokens=N_TOKENS, stop_on_eog=False)[0]
            for i in range(20)]


@pytest.fixture
def cluster(tiny_llama):
    """Workers for RANGES plus one spare for the middle range (index 3)."""
    c = LocalCluster(str(tiny_llama), RANGES + [(1, 3)], settings=SETTINGS)
    try:
        c.start(timeout=60)
        yield c
    finally:
        for w in c.workers:
            if w.proc is not None and w.proc.poll() is None:
                os.kill(w.proc.pid, signal.SIGCONT)  # a stopped one must be able to die
        c.stop(timeout=10)


def primaries(c):
    return c.endpoints[:3]


def test_uninterrupted_route_matches_the_whole_model(cluster, refs):
    with Route(primaries(cluster), spares=[cluster.endpoints[3]]) as r:
        assert r.complete(prompt(0), max_tokens=N_TOKENS, stop_on_eog=False).tokens == refs[0]
        assert r.aroute.replacements == []


def test_route_from_the_provider_alone(cluster, refs):
    pool = StaticPool(cluster.endpoints)  # the route is the provider's choice
    with Route(provider=pool, connect_timeout=10) as r:
        assert [s.endpoint for s in r.stages] == primaries(cluster)
        s = r.session()
        it = s.generate(prompt(7), max_tokens=N_TOKENS, stop_on_eog=False)
        toks = [next(it) for _ in range(5)]
        cluster.workers[1].kill()
        toks += list(it)
        s.close()
        assert r.stages[1].endpoint == cluster.endpoints[3]
    assert toks == refs[7]
    assert pool.failures()[cluster.endpoints[1]] >= 1


def test_sigkill_of_the_middle_worker_completes_on_the_spare(cluster, refs):
    victim, spare = cluster.workers[1], cluster.workers[3]
    with Route(primaries(cluster), spares=[spare.endpoint], connect_timeout=10) as r:
        s = r.session()
        it = s.generate(prompt(1), max_tokens=N_TOKENS, stop_on_eog=False)
        toks = [next(it) for _ in range(10)]
        victim.kill()
        toks += list(it)
        assert s.recoveries == 1 and s.epoch == 2
        assert r.aroute.replacements == [((1, 3), victim.endpoint, spare.endpoint)]
        assert r.stages[1].endpoint == spare.endpoint
        s.close()
    assert toks == refs[1]


def test_sigstop_hang_is_detected_by_the_deadline(cluster, refs):
    victim, spare = cluster.workers[1], cluster.workers[3]
    with Route(primaries(cluster), spares=[spare.endpoint], deadline_floor=0.5,
               connect_timeout=10) as r:
        s = r.session()
        it = s.generate(prompt(2), max_tokens=N_TOKENS, stop_on_eog=False)
        toks = [next(it) for _ in range(10)]
        assert r.aroute.deadline(1, 1) < 5  # sized from measured steps, not step_timeout
        os.kill(victim.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        toks.append(next(it))
        detected = time.monotonic() - t0
        toks += list(it)
        assert s.recoveries == 1 and detected < 5, detected
        assert r.aroute.replacements == [((1, 3), victim.endpoint, spare.endpoint)]
        s.close()
    assert toks == refs[2]


def test_worker_restarted_on_its_old_address_gets_a_new_epoch(cluster, refs):
    victim = cluster.workers[2]  # the last stage, no spare: the driver waits for it
    with Route(primaries(cluster), connect_timeout=30) as r:
        s = r.session()
        it = s.generate(prompt(3), max_tokens=N_TOKENS, stop_on_eog=False)
        toks = [next(it) for _ in range(10)]
        old = victim.endpoint
        victim.kill()
        th = threading.Thread(target=victim.restart, args=(60,))
        th.start()  # comes back while the driver is probing
        toks += list(it)
        th.join(60)
        assert victim.endpoint == old
        assert s.recoveries >= 1 and s.epoch >= 2
        assert r.aroute.replacements[-1] == ((3, 4), old, old)
        s.close()
    assert toks == refs[3]


@pytest.mark.parametrize("loop", [False, True], ids=["token-by-token", "decode-loop"])
def test_stale_epoch_answer_starts_over_under_a_new_epoch(cluster, refs, loop):
    from dgr import wire

    with Route(primaries(cluster), loop=loop) as r:
        s = r.session(f"dup-{loop}")
        it = s.generate(prompt(8), max_tokens=N_TOKENS, stop_on_eog=False)
        # between two tokens no step is in flight, except in a running decode loop (which may
        # even have finished): intrude there right after the prefill's token, before the
        # loop's first step
        toks = [next(it) for _ in range(10 if not loop else 1)]

        async def intrude():  # another writer of session "dup" at a far higher epoch
            c = ShardClient(cluster.endpoints[0])
            try:
                info = await c.describe()
                st = c.stream()
                h = wire.Forward(model=info.identity, session=s.id, epoch=100, first_pos=0,
                                 n_tokens=2, layer=0, tokens=[1, 2], want="boundary")
                reply = wire.decode(await st.step(wire.encode(h))).header
                await st.close()
                return reply
            finally:
                await c.close()

        assert type(asyncio.run(intrude())) is wire.Result
        toks += list(it)  # stage 0 answers StaleEpoch: released there, new epoch, replay
        assert s.recoveries == 1
        assert r.aroute.replacements == []
        s.close()
    assert toks == refs[8]


def test_no_healthy_worker_names_the_range(cluster):
    with Route(primaries(cluster), connect_timeout=1, probe_timeout=0.3) as r:
        s = r.session()
        it = s.generate(prompt(4), max_tokens=N_TOKENS, stop_on_eog=False)
        next(it)
        cluster.workers[1].kill()  # no spare given: the pool has only the dead one
        t0 = time.monotonic()
        with pytest.raises(errors.NoHealthyWorker, match=r"no healthy worker serves layers "
                                                          r"\[1, 3\)"):
            list(it)
        assert time.monotonic() - t0 < 10


def test_fatal_errors_are_not_retried():
    from dgr.route import retryable

    assert not retryable(errors.ModelMismatch("x"))
    assert not retryable(errors.InvalidArgument("x"))
    assert not retryable(errors.NoHealthyWorker("x"))
    assert not retryable(errors.FrameError("x"))
    assert retryable(errors.CacheMiss("x")) and retryable(errors.StepDeadlineExceeded("x"))
    assert retryable(errors.WorkerUnavailable("x")) and retryable(errors.StaleEpoch("x"))


# -- chaos: 20 sessions while workers are killed and restarted at random ---------------------

CHAOS_SECONDS = 20.0


def test_twenty_sessions_under_random_kills_and_restarts(tiny_llama, refs):
    ranges = RANGES + RANGES  # two workers per range
    c = LocalCluster(str(tiny_llama), ranges, settings=SETTINGS)
    c.start(timeout=60)
    stop = threading.Event()
    kills = []

    def chaos():
        rng = random.Random(6)
        while not stop.wait(rng.uniform(0.2, 0.8)):
            w = rng.choice(c.workers)
            if w.proc.poll() is not None:
                continue
            w.kill()
            kills.append(w.endpoint)
            if stop.wait(rng.uniform(0.1, 1.0)):
                break
            try:
                w.restart(30)
            except errors.DgrError:  # pragma: no cover - reported by the counts below
                pass

    outcome = {"ok": 0, "wrong": 0, "failed": 0, "hung": 0}
    failures: list[str] = []

    async def session_loop(route: AsyncRoute, i: int, until: float) -> None:
        k = i
        while time.monotonic() < until:
            p = k % 20
            s = route.session()
            try:
                g = await asyncio.wait_for(
                    s.complete(prompt(p), max_tokens=N_TOKENS, stop_on_eog=False), 60)
                outcome["ok" if g.tokens == refs[p] else "wrong"] += 1
            except asyncio.TimeoutError:
                outcome["hung"] += 1
            except errors.DgrError as e:  # only a failure recovery could not repair
                outcome["failed"] += 1
                failures.append(e)
            finally:
                await asyncio.wait_for(s.close(), 10)
            k += 20

    async def main():
        route = AsyncRoute(c.endpoints[:3], spares=c.endpoints[3:], connect_timeout=5,
                           probe_timeout=0.5, deadline_floor=1.0, max_retries=8)
        await route.connect()
        try:
            until = time.monotonic() + CHAOS_SECONDS
            await asyncio.gather(*(session_loop(route, i, until) for i in range(20)))
            return len(route.replacements)
        finally:
            await route.close()

    th = threading.Thread(target=chaos)
    try:
        th.start()
        replaced = asyncio.run(main())
    finally:
        stop.set()
        th.join(60)
        c.stop(timeout=10)
    print(f"\nchaos {CHAOS_SECONDS:g} s: {len(kills)} kills, {replaced} stage replacements, "
          f"generations {outcome}")
    for f in failures[:5]:
        print(f"  failed: {type(f).__name__}: {f}")
    assert outcome["wrong"] == 0 and outcome["hung"] == 0, (outcome, failures[:5])
    assert len(kills) >= 5 and outcome["ok"] >= 20
    # a clear error: no healthy worker for a range, or the last of the bounded attempts
    assert all(isinstance(f, (errors.WorkerUnavailable, errors.StepDeadlineExceeded,
                              errors.SessionError)) and str(f) for f in failures), failures[:5]


# -- a silently stalling link (the link emulator between the driver and a worker) -------------


def test_silently_stalling_link_fails_over_to_the_spare(cluster, refs):
    from dgr.testing.linkemu import LinkEmulator

    spare = cluster.workers[3]
    with LinkEmulator(cluster.endpoints[1]) as link:
        eps = [cluster.endpoints[0], link.endpoint, cluster.endpoints[2]]
        # the emulator fronts the gRPC port only: drive the hop-by-hop path through it
        with Route(eps, spares=[spare.endpoint], deadline_floor=0.5, connect_timeout=10,
                   relay=False) as r:
            s = r.session()
            it = s.generate(prompt(5), max_tokens=N_TOKENS, stop_on_eog=False)
            toks = [next(it) for _ in range(10)]
            link.stall()  # connections stay open, bytes are held: no error, only silence
            t0 = time.monotonic()
            toks += list(it)
            assert time.monotonic() - t0 < 8
            assert s.recoveries == 1
            assert r.aroute.replacements == [((1, 3), link.endpoint, spare.endpoint)]
            s.close()
        assert link.connections >= 1 and link.bytes[0] > 0
    assert toks == refs[5]


def test_link_emulator_delays_and_cuts(cluster, refs):
    from dgr.testing.linkemu import LinkEmulator

    with LinkEmulator(cluster.endpoints[1], delay_ms=5) as link:
        eps = [cluster.endpoints[0], link.endpoint, cluster.endpoints[2]]
        with Route(eps, spares=[cluster.endpoints[3]], connect_timeout=10, relay=False) as r:
            s = r.session()
            it = s.generate(prompt(6), max_tokens=N_TOKENS, stop_on_eog=False)
            toks = [next(it) for _ in range(10)]
            assert s.stats[1].decode_rtt_ms >= 10  # 5 ms each way
            link.cut()  # every connection reset: UNAVAILABLE, then the spare
            toks += list(it)
            assert s.recoveries >= 1
            assert r.stages[1].endpoint == cluster.endpoints[3]
            # the old worker is still reachable: the driver released the session there
            async def sessions_left():
                old = ShardClient(link.endpoint)
                try:
                    for _ in range(100):
                        if not (await old.describe()).sessions:
                            return 0
                        await asyncio.sleep(0.05)
                    return (await old.describe()).sessions
                finally:
                    await old.close()

            assert asyncio.run(sessions_left()) == 0
            s.close()
    assert toks == refs[6]


def test_link_emulator_stops_with_nothing_pending():
    import socket

    from dgr.testing.linkemu import LinkEmulator

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def echo_once():
        c, _ = srv.accept()
        with c:
            try:
                for d in iter(lambda: c.recv(100), b""):
                    c.sendall(d)
            except OSError:
                pass

    th = threading.Thread(target=echo_once, daemon=True)
    th.start()
    emu = LinkEmulator(f"127.0.0.1:{port}", delay_ms=1).start()
    loop = emu._loop
    host, p = emu.endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(p)), timeout=5) as s:
        s.sendall(b"hi")
        assert s.recv(10) == b"hi"
        emu.stall()
        s.sendall(b"held")  # a pump waits on the stall with these bytes
        time.sleep(0.2)
        emu.stop()  # with the connection still open and stalled: it is cut
    assert [t for t in asyncio.all_tasks(loop) if not t.done()] == []
    th.join(5)
    srv.close()
