"""The batching stage loop over real engines (a 3-stage SmolLM2 route on loopback, direct
relay with the decode loop): concurrent sessions really share forwards (every stage's loop
ran batches of several steps), and each session's tokens are the whole model's own greedy
tokens for its prompt computed alone (``benches/batch_exactness.py`` measured batched rows
bit-identical to solo rows on this build for SmolLM2's quantization); a lone session's steps
run on the receiving thread with no batch and no handoff; a route with ``batching=False``
(and the parity mode, logits) gets solo steps only."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import dgr
from dgr._core import HAS_LAYER_RANGES
from dgr.core.local import generate_local
from dgr.driver.route import AsyncRoute
from dgr.protocol.sampling import SamplingParams
from dgr.testing.stages import threaded_stages

pytestmark = [pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the patched llama.cpp"),
              pytest.mark.slow]

SETTINGS = dict(n_ctx=128, n_slots=8, n_threads=1, n_ubatch=32)
RANGES = ((0, 10), (10, 20), (20, 30))
N = 8  # sessions
TOKENS = 12


def prompt(i: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(100 + i).integers(3, 40000, 9 + i)]


@pytest.fixture(scope="module")
def refs(smollm2):
    e = dgr.Engine(smollm2, **SETTINGS)
    out = []
    for i in range(N):
        toks, _ = generate_local(e, prompt(i), max_tokens=TOKENS, stop_on_eog=False)
        out.append([int(t) for t in toks])
        e.release(0)
    return out


@pytest.fixture(scope="module")
def exact(smollm2):
    """Whether this build computes SmolLM2's batched rows bit-identical to alone (measured:
    the concurrent sessions' tokens must then be the whole model's own)."""
    from dgr.control.batching import measure

    m = measure(dgr.Engine(smollm2, **SETTINGS), sessions=4)
    assert m.rows == 4 * 9 and m.bit_identical == (m.max_abs_diff == 0.0)
    return m.bit_identical


@pytest.fixture(scope="module")
def stages(smollm2):
    with threaded_stages(smollm2, RANGES, SETTINGS) as ws:
        yield ws


def _reset(stages):
    for w in stages:
        lp = w.worker.pipeline.scheduler
        lp.batch_sizes.clear()
        lp.inline_runs = lp.batches = 0


async def _generate(stages, k: int, sampling=None, **kw):
    async with AsyncRoute([w.address for w in stages], **kw) as r:
        assert r.relay and r.loop
        gens = await asyncio.gather(*(r.complete(prompt(i), max_tokens=TOKENS,
                                                 stop_on_eog=False, sampling=sampling)
                                      for i in range(k)))
    return [list(g.tokens) for g in gens]


def test_batched_sessions_with_penalties_make_the_whole_models_tokens(smollm2, stages, exact):
    """Each session's penalties count its own tokens, in a batch of several sessions as
    alone: the concurrent sessions' tokens are the whole model's with the same penalties."""
    sp = SamplingParams(repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5,
                        penalty_last_n=16, logit_bias=((11, 3.0),))
    e = dgr.Engine(smollm2, **SETTINGS)
    refs = []
    for i in range(N):
        toks, _ = generate_local(e, prompt(i), max_tokens=TOKENS, stop_on_eog=False,
                                 sampling=sp)
        refs.append([int(t) for t in toks])
        e.release(0)
    _reset(stages)
    got = asyncio.run(_generate(stages, N, sampling=sp))
    if exact:
        assert got == refs
    else:
        assert [len(t) for t in got] == [TOKENS] * N
    assert max(stages[-1].worker.pipeline.scheduler.batch_sizes) >= 2


def test_concurrent_sessions_share_forwards_and_keep_their_tokens(stages, refs, exact):
    _reset(stages)
    got = asyncio.run(_generate(stages, N))
    if exact:  # the lane's measure says batched rows are the rows alone
        assert got == refs
    else:
        assert [len(t) for t in got] == [TOKENS] * N
    for w in stages:
        sizes = w.worker.pipeline.scheduler.batch_sizes
        assert max(sizes) >= 2, f"{w.address}: no batch of several steps formed: {sizes}"


def test_a_lone_session_runs_inline_in_batches_of_one(stages, refs):
    _reset(stages)
    before = [w.worker.pipeline.steps_total for w in stages]
    (got,) = asyncio.run(_generate(stages, 1))
    assert got == refs[0]
    for w, b in zip(stages, before):
        lp = w.worker.pipeline.scheduler
        steps = w.worker.pipeline.steps_total - b
        assert set(lp.batch_sizes) == {1} and lp.batches == steps
        assert lp.inline_runs == steps, "a lone session's step waited for the loop's thread"


def test_a_route_without_batching_sends_solo_steps(stages, refs):
    _reset(stages)
    got = asyncio.run(_generate(stages, 4, batching=False))
    assert got == refs[:4]
    for w in stages:
        assert set(w.worker.pipeline.scheduler.batch_sizes) == {1}
