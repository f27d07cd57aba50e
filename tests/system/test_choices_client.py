"""``n`` choices through the front with the official ``openai`` client on a 3-stage route of
the tiny llama: the prompt is prefilled once and forked on every stage (the first stage
computes far fewer tokens than ``n`` prefills), and choice ``i`` is, token for token and log
probability for log probability, the single request with seed ``seed + i``, streamed and
not; a batch of prompts gives ``n`` choices of each."""

from __future__ import annotations

import asyncio

import pytest

import dgr
from dgr.driver.route import AsyncRoute
from dgr.testing.serving import Served
from dgr.transport.client import ShardClient
from dgr.worker.process import ThreadedWorker

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

TINY = dict(n_ctx=256, n_slots=6, n_threads=1, n_ubatch=8)
PROMPT = list(range(3, 23))  # 20 tokens: two whole chunks and a partial one


@pytest.fixture(scope="module")
def front(tiny_llama):
    from dgr.serve.app import create_app

    ws = [ThreadedWorker(dgr.Engine(tiny_llama, layers=r, **TINY))
          for r in [(0, 1), (1, 3), (3, 4)]]
    # without the stages' prefix stores: the single requests compared with the choices
    # prefill in full (what a fork saves is counted against them)
    served = Served(create_app(AsyncRoute([w.address for w in ws]), model="tiny",
                               prefix_store=False))
    yield served.openai(api_key="x"), ws
    served.stop()
    for w in ws:
        w.stop()


def _computed(w) -> int:
    async def go():
        c = ShardClient(w.address)
        try:
            return (await c.describe()).tokens_computed_total
        finally:
            await c.close()
    return asyncio.run(go())


def test_n_choices_fork_one_prefill_and_equal_single_requests(front):
    client, ws = front
    ask = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0.9, logprobs=2,
               presence_penalty=0.4)
    before = _computed(ws[0])
    r = client.completions.create(n=3, seed=1234, **ask)
    computed = _computed(ws[0]) - before
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == len(PROMPT)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    before = _computed(ws[0])
    for i, c in enumerate(r.choices):
        alone = client.completions.create(seed=1234 + i, **ask).choices[0]
        assert (c.text, c.logprobs.token_logprobs, c.finish_reason) == (
            alone.text, alone.logprobs.token_logprobs, alone.finish_reason)
    singles = _computed(ws[0]) - before
    # the same tokens made, but the prompt's first 18 prefilled once, not three times
    assert computed == singles - 2 * 18, (computed, singles)
    texts = {i: "" for i in range(3)}
    for chunk in client.completions.create(n=3, seed=1234, stream=True, **ask):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[i] for i in range(3)] == [c.text for c in r.choices]


def test_a_batch_of_prompts_with_n_choices_each(front):
    client, _ = front
    other = list(range(40, 51))
    ask = dict(model="tiny", max_tokens=5, temperature=0.9, seed=77)
    r = client.completions.create(prompt=[PROMPT, other], n=2, **ask)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(PROMPT) + len(other)
    for k, c in enumerate(r.choices):
        prompt, i = (PROMPT, other)[k // 2], k % 2
        alone = client.completions.create(prompt=prompt, **dict(ask, seed=77 + i))
        assert c.text == alone.choices[0].text
