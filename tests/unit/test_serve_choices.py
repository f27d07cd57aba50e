"""``n`` choices on the front, over the fuzz test's fake route (a prompt shorter than a chunk:
each choice on its own session): ``n`` choices with their ``index``, choice ``i`` sampled with
``seed + i``, streamed interleaved with one finish per choice, usage counting the prompt once,
every session and slot given back; more choices than slots a 400."""

from __future__ import annotations

import asyncio
import json

from dgr.serve.app import create_app

from test_serve_fuzz import FakeRoute, FakeSession, Template, _call  # noqa: E402  (its fakes)


class Recording(FakeRoute):
    """Sessions whose every generation records ``what(session, keywords)`` in ``seen``."""

    def __init__(self, what):
        super().__init__()
        self.what, self.seen = what, []

    def session(self):
        route = self

        class S(FakeSession):
            def generate(self, ids, **kw):
                route.seen.append(route.what(self, kw))
                return super().generate(ids, **{k: v for k, v in kw.items() if k != "reuse"})

        return S(self)


class Seeds(Recording):
    """Sessions that record the seed they sample with."""

    def __init__(self):
        super().__init__(lambda session, kw: kw["sampling"].seed)

    @property
    def seeds(self):
        return self.seen


def _post(route, body):
    app = create_app(route, model="m", template=Template(), queue_timeout=0.05)

    async def go():
        async with app.router.lifespan_context(app):
            return await _call(app, "/v1/completions", json.dumps(body).encode())

    return asyncio.run(go())


def test_n_choices_each_with_its_seed():
    route = Seeds()
    status, _, raw = _post(route, {"prompt": [3, 4, 5], "n": 2, "max_tokens": 4, "seed": 41,
                                   "temperature": 0.7})
    assert status == 200, raw
    d = json.loads(raw)
    assert [c["index"] for c in d["choices"]] == [0, 1]
    assert all(len(c["text"]) == 4 and c["finish_reason"] == "length" for c in d["choices"])
    assert sorted(route.seeds) == [41, 42]
    assert d["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    assert route.opened == route.closed == 2


def test_n_choices_streamed():
    route = Seeds()
    status, _, raw = _post(route, {"prompt": [3, 4, 5], "n": 2, "max_tokens": 3, "seed": 7,
                                   "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    text = {0: "", 1: ""}
    finish = {}
    for ev in events:
        for c in ev["choices"]:
            text[c["index"]] += c["text"]
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    assert len(text[0]) == len(text[1]) == 3 and finish == {0: "length", 1: "length"}
    assert events[-1]["usage"]["completion_tokens"] == 6
    assert raw.decode().rstrip().endswith("data: [DONE]")
    assert sorted(route.seeds) == [7, 8] and route.opened == route.closed == 2


def test_a_choice_failing_ends_the_request_and_gives_everything_back():
    route = Seeds()
    status, _, raw = _post(route, {"prompt": [3, 7], "n": 2, "max_tokens": 3})
    assert status == 503 and route.opened == route.closed == 2


def test_a_batch_of_prompts_gives_a_choice_each_and_counts_every_prompt():
    route = Seeds()
    status, _, raw = _post(route, {"prompt": ["ab", [5, 6, 8, 9]], "max_tokens": 2, "seed": 9,
                                   "temperature": 0.7})
    assert status == 200, raw
    d = json.loads(raw)
    assert [c["index"] for c in d["choices"]] == [0, 1]
    assert d["usage"]["prompt_tokens"] == 3 + 4  # "ab" is BOS a b on the fake tokenizer
    assert sorted(route.seeds) == [9, 9]  # choice 0 of each prompt
    assert route.opened == route.closed == 2
    status, _, raw = _post(Seeds(), {"prompt": ["a", "b"], "n": 2})  # 4 slots, 2 here
    assert status == 400 and json.loads(raw)["error"]["param"] == "prompt"
    for bad in ([], [[]], ["a", 1], [[1, "a"]], ["x"] * 17):
        status, _, raw = _post(Seeds(), {"prompt": bad})
        assert status == 400 and json.loads(raw)["error"]["param"] == "prompt", bad


def test_a_stage_that_may_not_fork_leaves_each_choice_to_prefill_alone():
    from dgr import errors

    class NoFork(Seeds):
        n_ubatch = 2  # a prompt of whole chunks: its first ones are prefilled once, forked

        def session(self):
            s = super().session()

            async def prefill(ids, sample=False):
                self.prefilled = list(ids)

            async def fork(n):
                raise errors.SessionForbidden("a peer relayed this session")

            s.prefill, s.fork = prefill, fork
            return s

    route = NoFork()
    status, _, raw = _post(route, {"prompt": [3, 4, 5, 6, 8], "n": 2, "max_tokens": 2,
                                   "seed": 1})
    assert status == 200, raw
    assert route.prefilled == [3, 4, 5, 6] and len(json.loads(raw)["choices"]) == 2
    assert sorted(route.seeds) == [1, 2] and route.opened == route.closed == 3


def test_every_session_of_a_request_is_its_api_keys():
    """The sessions a request opens (one, or one per choice) carry its API key's name as
    their tenant: the prefixes they adopt and keep in the stages' stores are that key's."""

    from dgr.serve.auth import ApiKey

    route = Recording(lambda session, kw: session.tenant)
    app = create_app(route, model="m", template=Template(), queue_timeout=0.05,
                     api_keys=[ApiKey("alice", "sk-dgr-alice-0123456789"),
                               ApiKey("bob", "sk-dgr-bob-0123456789ab")])

    async def go(key, n):
        async with app.router.lifespan_context(app):
            return await _call(app, "/v1/completions", json.dumps(
                {"prompt": [3, 4, 5], "n": n, "max_tokens": 2}).encode(),
                headers=[(b"authorization", f"Bearer {key}".encode())])

    for key, n in (("sk-dgr-alice-0123456789", 1), ("sk-dgr-bob-0123456789ab", 2)):
        status, _, raw = asyncio.run(go(key, n))
        assert status == 200, raw
    assert route.seen == ["alice", "bob", "bob"]
