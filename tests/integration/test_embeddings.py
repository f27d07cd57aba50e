"""Embeddings on a split route (docs/serve.md "Embeddings"): the last stage returns every
row's final normed hidden state (``Engine.embed``, ``Forward.want`` "embedding"), the driver
pools them (``dgr.protocol.embeddings``), and a 3-stage route gives the whole model's vectors
bit for bit, by direct relay and hop by hop, over prompts longer than a chunk; the engine's
logits after an embedding are a fresh engine's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr.driver.route import AsyncRoute
from dgr.protocol.embeddings import POOLING, pool
from dgr.worker.process import ThreadedWorker

SETTINGS = dict(n_ctx=256, n_slots=2, n_threads=1, n_ubatch=8)
PROMPTS = [list(range(3, 23)), [5, 6, 7], list(range(40, 48)), [9]]


@pytest.fixture(scope="module")
def routes(tiny_llama):
    split = [ThreadedWorker(dgr.Engine(tiny_llama, layers=r, **SETTINGS))
             for r in [(0, 1), (1, 3), (3, 4)]]
    whole = [ThreadedWorker(dgr.Engine(tiny_llama, **SETTINGS))]
    yield split, whole
    for w in split + whole:
        w.stop()


def _rows(workers, relay):
    async def go():
        r = await AsyncRoute([w.address for w in workers], relay=relay).connect()
        try:
            s = r.session()
            out = [await s.embed(p) for p in PROMPTS]  # one session, one epoch each
            await s.close()
            return out
        finally:
            await r.close()
    return asyncio.run(go())


def test_a_split_route_gives_the_whole_models_rows_bit_for_bit(routes, tiny_llama):
    split, whole = routes
    ref = _rows(whole, None)
    for relay in (True, False):
        got = _rows(split, relay)
        for a, b, p in zip(got, ref, PROMPTS):
            assert a.shape == (len(p), 64) and a.dtype == np.float32
            assert a.tobytes() == b.tobytes()
            for kind in POOLING:
                assert pool(a, kind).tobytes() == pool(b, kind).tobytes()
    # and the engine alone, chunk by chunk as the route runs them
    e = dgr.Engine(tiny_llama, **SETTINGS)
    direct = np.concatenate([e.embed(0, a, PROMPTS[0][a:a + 8]) for a in range(0, 20, 8)])
    assert direct.tobytes() == ref[0].tobytes()


def test_logits_after_an_embedding_are_a_fresh_engines(tiny_llama):
    e = dgr.Engine(tiny_llama, **SETTINGS)
    e.embed(0, 0, [3, 4, 5])
    e.release(0)
    after = e.forward(0, 0, [3, 4, 5])
    fresh = dgr.Engine(tiny_llama, **SETTINGS).forward(0, 0, [3, 4, 5])
    assert after.tobytes() == fresh.tobytes()


def test_only_the_last_stage_embeds(tiny_llama):
    e = dgr.Engine(tiny_llama, layers=(0, 2), **SETTINGS)
    with pytest.raises(errors.InvalidArgument, match="last stage"):
        e.embed(0, 0, [3, 4])
