"""The stages' prefix stores along a route: a session closed with ``keep`` leaves its whole
chunks' caches on every stage; a later session of the same tenant whose prompt begins with
them adopts them in one round trip and gives a fresh prefill's tokens and logits, bit for bit
(penalties included: the last stage keeps the token record with the entry); another tenant,
or a route where one stage lacks the entry, prefills in full; and under eviction pressure
every output equals its run without the store."""

from __future__ import annotations

import asyncio
import random

import pytest

from dgr.control.metrics import MetricsServer
from dgr.driver.route import AsyncRoute
from dgr.protocol.sampling import SamplingParams
from dgr.testing.stages import threaded_stages

UB = 8
SETTINGS = dict(n_ctx=128, n_slots=3, n_threads=1, n_ubatch=UB)
RANGES = [(0, 1), (1, 3), (3, 4)]
PENALTIES = SamplingParams(temperature=0.9, seed=11, repeat_penalty=1.3,
                           frequency_penalty=0.4, presence_penalty=0.2, penalty_last_n=64)


async def run(r, prompt, *, tenant="t", adopt=True, sampling=None, n=6):
    """(tokens, logits rows as bytes, positions adopted) of one request in a new session,
    closed with ``keep``."""
    s = r.session(tenant=tenant)
    m = await s.adopt(prompt) if adopt else 0
    toks = [t async for t in s.generate(prompt, max_tokens=n, stop_on_eog=False, logits=True,
                                        sampling=sampling, **({"reuse": m} if m else {}))]
    logits = [row.tobytes() for row in s.logits]
    await s.close(keep=True)
    return toks, logits, m


@pytest.mark.parametrize("relay", [True, False])
def test_an_adopted_prefix_gives_a_fresh_prefills_bits(tiny_llama, relay):
    with threaded_stages(tiny_llama, RANGES, SETTINGS) as ws:
        async def go():
            async with AsyncRoute([w.address for w in ws], relay=relay) as r:
                assert r.prefix_store
                first = list(range(3, 33))  # three whole chunks and a partial one
                await run(r, first, adopt=False)
                infos = await r.describe()
                # the whole chunks prefilled from 0 are kept, on every stage, and the partial
                # chunk's rows after them (every stage computes them as any partial chunk)
                assert all(st.prefix_rows_exact for st in r.stages)
                assert [i.prefix_store["positions"] for i in infos] == [30] * 3
                assert all(i.prefix_store["entries"] == 1 and i.prefix_store["bytes"] > 0
                           for i in infos)
                nxt = first[:20] + list(range(70, 82))
                for sampling, shared in ((None, 16), (PENALTIES, 24)):
                    want = await run(r, nxt, adopt=False, sampling=sampling, tenant="ref")
                    got = await run(r, nxt, sampling=sampling)
                    # the two whole chunks both prompts share; then the three of nxt's run
                    assert got[2] == shared
                    assert got[:2] == want[:2]
                infos = await r.describe()
                assert all(i.prefix_store["hits"] == 2 for i in infos)
                # the capability record carries the same figures for a tracker
                cap = await r.clients[0].capability()
                assert cap.prefix_store.hits == 2 and cap.prefix_store.size == 3
                # another tenant never adopts this one's prefix
                assert (await run(r, nxt, tenant="u"))[2] == 0

        asyncio.run(go())


def test_a_stage_without_the_entry_means_a_full_prefill(tiny_llama):
    with threaded_stages(tiny_llama, RANGES, SETTINGS) as ws:
        async def go():
            async with AsyncRoute([w.address for w in ws]) as r:
                prompt = list(range(3, 40))
                want = await run(r, prompt, adopt=False)
                w = ws[1].worker.pipeline
                with w.lock:  # the middle stage lost its entries (restarted, evicted)
                    w.table.clear()
                got = await run(r, prompt)
                assert got[2] == 0 and got[:2] == want[:2]
                infos = await r.describe()
                assert [i.prefix_store["hits"] for i in infos] == [1, 0, 1]
                assert infos[1].prefix_store["misses"] == 1
                # and the next one finds the entry that run left on every stage
                # (four whole chunks and three rows of the partial one: two rows are left to
                # prefill, as a fresh prefill's partial chunk of two rows or more computes them)
                assert await run(r, prompt) == (want[0], want[1], 35)
                return await r.describe()

        infos = asyncio.run(go())
        # the worker's /metrics say the same as its describe record
        text = MetricsServer(ws[1].worker, port=0, loop=ws[1].event_loop).render()
        ps = infos[1].prefix_store
        assert (ps["hits"], ps["misses"], ps["entries"]) == (1, 1, 1)
        for name, kind, key in (("hits_total", "counter", "hits"),
                                ("misses_total", "counter", "misses"),
                                ("entries", "gauge", "entries"),
                                ("bytes", "gauge", "bytes"), ("size", "gauge", "size")):
            assert f"dgr_worker_prefix_store_{name} {float(ps[key])}" in text
            assert f"# TYPE dgr_worker_prefix_store_{name} {kind}" in text


def test_shared_prefixes_under_eviction_pressure_give_the_runs_without_the_store(tiny_llama):
    """200 requests whose prompts share prefixes of random lengths with earlier ones, or grow
    the last one by a few tokens (as a chat's turns do: the partial chunk's rows after the
    whole ones are reused), through a 3-stage route of 3 slots (every new session takes an
    entry's slot once the store is full): each request's tokens and logits equal its run
    without the store."""
    rng = random.Random(7)
    bases = [[rng.randrange(3, 128) for _ in range(60)] for _ in range(4)]
    prompts = []
    for _ in range(200):
        if prompts and len(prompts[-1]) < 60 and rng.random() < 0.4:
            prompts.append(prompts[-1] + [rng.randrange(3, 128)
                                          for _ in range(rng.randrange(1, 4))])
            continue
        base = rng.choice(bases)
        k = rng.randrange(1, 50)
        prompts.append(base[:k] + [rng.randrange(3, 128) for _ in range(rng.randrange(1, 12))])
    with threaded_stages(tiny_llama, RANGES, SETTINGS) as ws:
        async def go():
            async with AsyncRoute([w.address for w in ws]) as r:
                want = [await run(r, p, adopt=False, n=3, tenant="ref") for p in prompts]
                got = [await run(r, p, n=3) for p in prompts]
                return want, got

        want, got = asyncio.run(go())
    assert [g[:2] for g in got] == [w[:2] for w in want]
    adopted = [g[2] for g in got]
    # whole chunks, and rows of partial chunks past them (two left to prefill at least)
    assert sum(1 for a in adopted if a) > 50 and sum(1 for a in adopted if a % UB) > 10
    assert all(a % UB == 0 or a < len(p) - 1 for a, p in zip(adopted, prompts))


@pytest.mark.parametrize("when", ["before adopting", "after adopting"])
def test_a_stage_lost_around_an_adoption_still_gives_the_whole_models_tokens(tiny_llama, when):
    """The middle stage dies before the adoption (it answers nothing: a miss, a full prefill
    repaired on the spare) or after it (the first step fails: the route replays the adopted
    positions on the spare, from the tokens it holds): the whole model's tokens either way."""
    with threaded_stages(tiny_llama, [None, *RANGES, (1, 3)], SETTINGS) as ws:
        whole, stages, spare = ws[0], ws[1:4], ws[4]

        async def go():
            async with AsyncRoute([whole.address]) as ref:
                prompt = list(range(3, 40))
                want = await run(ref, prompt, adopt=False)
            async with AsyncRoute([w.address for w in stages], spares=[spare.address]) as r:
                await run(r, prompt, adopt=False)
                s = r.session(tenant="t")
                if when == "before adopting":
                    stages[1].stop()
                m = await s.adopt(prompt)
                assert m == (0 if when == "before adopting" else 35)
                if when == "after adopting":
                    stages[1].stop()
                toks = [t async for t in s.generate(prompt, max_tokens=6, stop_on_eog=False,
                                                    logits=True, **({"reuse": m} if m else {}))]
                assert s.recoveries >= 1
                assert (toks, [row.tobytes() for row in s.logits]) == want[:2]
                await s.close()

        asyncio.run(go())


def test_an_adoption_and_a_keep_take_effect_in_the_same_order_on_every_stage(tiny_llama):
    """A front sends each adoption and each keep to every stage at once, and each stage takes
    them in the order they came, whether or not its engine is busy: so every stage makes the
    same choice, and a session gets the same entry and slot on every stage (the stages form
    their ring groups from runs of slots). Here stage 0's engine is held, as by a forward,
    while an adoption comes and then the keep of a session that holds more of its prompt.
    (Before, the adoption waited on a pool thread while the keep ran at once: stage 0 gave
    the new session the kept entry, the other stages an older one, and the route, finding
    the stages apart, prefilled everything again.)"""
    with threaded_stages(tiny_llama, RANGES, {**SETTINGS, "n_slots": 6}) as ws:
        async def go():
            async with AsyncRoute([w.address for w in ws]) as r:
                shared = list(range(3, 23))
                for i in range(4):  # four entries holding the same 20 positions, and more
                    await run(r, shared + [40 + i] * 7, adopt=False, n=2)
                x = r.session(tenant="t")  # holds 27 positions of the next prompt
                [t async for t in x.generate(shared + [50] * 7, max_tokens=2,
                                             stop_on_eog=False)]
                a = r.session(tenant="t")
                lock = ws[0].worker.pipeline.slots.engine.lock
                lock.acquire()
                try:
                    adopting = asyncio.ensure_future(a.adopt(shared + [50] * 7 + [70] * 5))
                    await asyncio.sleep(0.1)  # it reached every stage
                    keeping = asyncio.ensure_future(x.close(keep=True))
                    await asyncio.sleep(0.1)
                finally:
                    lock.release()
                # before the keep, the entries hold two whole chunks of the prompt
                assert await adopting == 16
                await keeping
                slots = {w.worker.pipeline.table.get(a.id).slot for w in ws}
                assert len(slots) == 1, slots
                await a.close()

        asyncio.run(go())
