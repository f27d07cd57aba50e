"""Forking a session (``n`` choices): ``Engine.copy_slot`` copies a slot's caches bit for bit;
a worker's ``Fork`` opens new sessions on slots of their own at the source's position, and
refuses what it cannot do (an unknown or busy source, a stale epoch, an existing target, no
free slot) without leaving anything open; a route's forks continue as the source would."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr.driver.route import AsyncRoute
from dgr.protocol.sampling import SamplingParams
from dgr.transport.client import ShardClient
from dgr.worker.process import ThreadedWorker

SETTINGS = dict(n_ctx=128, n_slots=3, n_threads=1, n_ubatch=8)


def test_copy_slot_copies_the_caches_bit_for_bit(tiny_llama):
    e = dgr.Engine(tiny_llama, **SETTINGS)
    toks = np.arange(3, 23)
    e.forward(0, 0, toks[:8])
    e.forward(0, 8, toks[8:12])
    e.copy_slot(0, 2)
    forked = e.forward(2, 12, toks[12:20], logits="all")
    again = e.forward(0, 12, toks[12:20], logits="all")
    e.release(1)
    e.forward(1, 0, toks[:8])
    e.forward(1, 8, toks[8:12])
    fresh = e.forward(1, 12, toks[12:20], logits="all")
    assert forked.tobytes() == again.tobytes() == fresh.tobytes()
    with pytest.raises(errors.InvalidArgument):
        e.copy_slot(1, 1)
    with pytest.raises(errors.UnknownSlot):
        e.copy_slot(0, 3)


def test_a_workers_fork_and_its_refusals(tiny_llama):
    w = ThreadedWorker(dgr.Engine(tiny_llama, **SETTINGS))

    async def go():
        r = await AsyncRoute([w.address]).connect()
        c = ShardClient(w.address)
        try:
            src = r.session("src")
            await src.prefill(list(range(3, 15)), sample=False)
            assert await c.fork("src", src.epoch, ["a"], 1) == 12
            with pytest.raises(errors.UnknownSession):
                await c.fork("nope", 1, ["b"], 1)
            with pytest.raises(errors.StaleEpoch):
                await c.fork("src", src.epoch + 1, ["b"], 1)
            with pytest.raises(errors.SessionError):
                await c.fork("src", src.epoch, ["a"], 1)  # exists
            with pytest.raises(errors.ResourceExhausted):
                await c.fork("src", src.epoch, ["b", "c"], 1)  # one slot left, not two
            info = await c.describe()
            assert info.sessions == 2 and info.free_slots == 1  # nothing of b or c left
            # the fork continues as the source: its next step is the source's next step
            a = r.session("a")
            a.epoch, a.history, a.steps = 1, list(src.history), list(src.steps)
            sp = SamplingParams(temperature=0.8, seed=5)
            got = [t async for t in a.generate(list(range(3, 20)), max_tokens=5,
                                               sampling=sp, reuse=8)]
            want = [t async for t in src.generate(list(range(3, 20)), max_tokens=5,
                                                  sampling=sp, reuse=8)]
            assert got == want
        finally:
            await c.close()
            await r.close()

    try:
        asyncio.run(go())
    finally:
        w.stop()
