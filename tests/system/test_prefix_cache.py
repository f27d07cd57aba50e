"""The front's prompt cache (dgr.serve.prefix) and the stages' prefix stores are exact: 500
completions whose prompts share prefixes of random lengths (and grow, as a chat's turns do),
through a 3-stage route, greedy and seeded, with eviction pressure (a cache of 2 sessions over
4 prompt families; stores of 4 slots each, shared with the cached front's closed sessions)
give the text and the log probabilities of the same requests through a front that uses
neither, bit for bit; and both were used, whole chunks and partial chunks' rows (n_ubatch 8,
and 250 requests at 64, where the stages measure whether a whole chunk's rows are a partial
chunk's, and 250 at 64 on stages with the batch-invariant kernels, where every row is kept)."""

from __future__ import annotations

import random

import pytest

import dgr
from dgr.driver.route import AsyncRoute
from dgr.testing.serving import Served
from dgr.worker.process import ThreadedWorker

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

TINY = dict(n_ctx=256, n_slots=4, n_threads=1)


# n_ubatch 8: every chunk takes the same kernels, so rows are reused token by token; 64: each
# stage measures whether a whole chunk's rows are a partial chunk's (they are where its
# kernels take one path for every batch, as ggml's flash attention does since patch 0026), and
# the front reuses what it measured; 64 with the batch-invariant
# kernels (q8_0 matrices, whose one-row products are a chunk's): every row, however cut
@pytest.fixture(scope="module", params=[8, 64, "64bi"], ids=["ub8", "ub64", "ub64-invariant"])
def fronts(tiny_llama, tiny_q8, request):
    from dgr.serve.app import create_app

    invariant = request.param == "64bi"
    ub = 64 if invariant else request.param
    model = tiny_q8 if invariant else tiny_llama
    ws = [ThreadedWorker(dgr.Engine(model, layers=r, n_ubatch=ub, batch_invariant=invariant,
                                    **TINY))
          for r in [(0, 1), (1, 3), (3, 4)]]
    addrs = [w.address for w in ws]
    cached = Served(create_app(AsyncRoute(addrs), model="tiny", prompt_cache=2,
                               prompt_cache_ttl=600))
    plain = Served(create_app(AsyncRoute(addrs), model="tiny", prefix_store=False))
    stored = Served(create_app(AsyncRoute(addrs), model="tiny"))  # the stages' stores only
    clients = [s.openai(api_key="x") for s in (cached, plain, stored)]
    yield clients, (cached, stored), ub
    for s in (cached, plain, stored):
        s.stop()
    for w in ws:
        w.stop()


def _ask(client, req: dict):
    r = client.completions.create(model="tiny", **req)
    c = r.choices[0]
    return c.text, c.finish_reason, c.logprobs.model_dump(), r.usage.completion_tokens


def test_500_requests_with_shared_prefixes_equal_their_uncached_runs(fronts):
    (cached, plain, stored), (served, by_store), ub = fronts
    rng = random.Random(20261202)
    length = 70 if ub == 8 else 200
    families = [[rng.randrange(3, 128) for _ in range(length)] for _ in range(4)]
    prompt: list[int] = []
    for i in range(500 if ub == 8 else 250):
        if prompt and len(prompt) < length and rng.random() < 0.3:
            # the last prompt grown by a few tokens, as a chat's next turn is
            prompt = prompt + [rng.randrange(3, 128) for _ in range(rng.randrange(1, 6))]
        else:
            base = rng.choice(families)
            prompt = base[:rng.randrange(0, length)] + [rng.randrange(3, 128)
                                                       for _ in range(rng.randrange(1, 12))]
        req = dict(prompt=prompt, max_tokens=rng.randrange(1, 10), logprobs=3)
        if rng.random() < 0.5:
            req.update(temperature=0.9, seed=rng.randrange(1 << 30))
        else:
            req.update(temperature=0)
        want = _ask(plain, req)
        assert _ask(cached, req) == want, (i, req)
        assert _ask(stored, req) == want, (i, req)
    import json
    import urllib.request

    with urllib.request.urlopen(served.base + "/status") as r:
        pc = json.load(r)["prompt_cache"]
    # the cache was used, and evicted under pressure; a kept session holds a slot on every
    # stage and no more: the front's own count
    assert pc["hits"] > 100 and pc["tokens_reused"] > 1000 and pc["evictions"] > 50, pc
    # and past whole chunks: every stage measured partial chunks' rows alike
    assert pc["rows_reused"] > 50, pc
    assert pc["kept"] <= 2
    with urllib.request.urlopen(served.base + "/metrics") as r:
        text = r.read().decode()
    assert f"dgr_serve_prompt_cache_hits_total {float(pc['hits'])}" in text
    # what the kept sessions hold: one KV cell per position on every stage
    assert (pc["bytes"] > 0) == (pc["kept"] > 0), pc
    assert "dgr_serve_prompt_cache_bytes " in text
    # the front without a cache of its own adopted prefixes from the stages' stores
    with urllib.request.urlopen(by_store.base + "/status") as r:
        ps = json.load(r)["prompt_cache"]
    # (whole chunks only: at n_ubatch 64 fewer prompts hold one past the cache's sessions)
    assert ps["store_hits"] > (100 if ub == 8 else 40), ps
    assert ps["store_tokens_reused"] > 1000, ps
    with urllib.request.urlopen(by_store.base + "/metrics") as r:
        assert f"dgr_serve_prefix_store_hits_total {float(ps['store_hits'])}" in r.read().decode()


KEYS = ["sk-dgr-tenant-a-0123", "sk-dgr-tenant-b-4567"]


def _status(base: str, key: str) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(base + "/status", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)["prompt_cache"]


def test_one_tenant_never_reuses_anothers_prefix_and_a_lost_stage_still_gives_the_tokens(
        tiny_llama):
    """Per API key: B's request with A's prompt is a miss, A's again a hit. Then the kept
    session's middle stage dies: the next request that reuses it is repaired on a spare
    (the route replays its history there) and gives the whole model's tokens."""
    from dgr.serve.app import create_app

    settings = dict(TINY, n_ubatch=8)
    ws = [ThreadedWorker(dgr.Engine(tiny_llama, layers=r, **settings))
          for r in [(0, 1), (1, 3), (3, 4), (1, 3)]]
    whole = ThreadedWorker(dgr.Engine(tiny_llama, **settings))
    cached = Served(create_app(AsyncRoute([w.address for w in ws[:3]],
                                          spares=[ws[3].address]),
                               model="tiny", api_keys=KEYS, prompt_cache=2,
                               prompt_cache_ttl=600))
    plain = Served(create_app(AsyncRoute([whole.address]), model="tiny", prefix_store=False))
    try:
        a, b = (cached.openai(api_key=k) for k in KEYS)
        ref = plain.openai(api_key="x")
        prompt = list(range(3, 40))
        req = dict(prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
        first = _ask(a, req)
        assert _status(cached.base, KEYS[0])["hits"] == 0
        assert _ask(b, req) == first                     # B: a miss, computed anew
        assert _status(cached.base, KEYS[0])["hits"] == 0
        grown = dict(req, prompt=prompt + [5, 6, 7])
        assert _ask(a, grown) == _ask(ref, grown)        # A: its own prefix, a hit
        pc = _status(cached.base, KEYS[0])
        assert pc["hits"] == 1 and pc["tokens_reused"] >= 32
        ws[1].stop()  # the kept sessions' middle stage dies
        again = dict(req, prompt=prompt + [5, 6, 7, 8, 9])
        assert _ask(a, again) == _ask(ref, again)        # repaired on the spare, exact
        assert _status(cached.base, KEYS[0])["hits"] == 2
    finally:
        for s in (cached, plain):
            s.stop()
        for w in ws + [whole]:
            w.stop()
