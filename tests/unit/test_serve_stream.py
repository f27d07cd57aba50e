"""The front builds a generation's text per token from the vocabulary's pieces: it never
detokenizes the token list (an RPC to the first stage per token, over a list that grows)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("starlette")
from test_serve_fuzz import N_VOCAB, FakeRoute, Template, _call  # noqa: E402  (its fakes)

from dgr.serve.app import create_app  # noqa: E402


class CountingRoute(FakeRoute):
    def __init__(self):
        super().__init__()
        self.detokenized = 0
        self.fetched = 0

    async def detokenize(self, tokens):
        self.detokenized += 1
        return await super().detokenize(tokens)

    async def pieces(self):
        self.fetched += 1
        return await super().pieces()


def _events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines()
            if line.startswith("data: {")]


@pytest.mark.parametrize("stream", [False, True])
def test_a_long_generation_never_detokenizes_and_gives_the_pieces_text(stream):
    route = CountingRoute()
    app = create_app(route, model="m", template=Template())
    body = {"prompt": [1, 2], "max_tokens": 60, "stream": stream, "logprobs": 2}

    async def go():
        async with app.router.lifespan_context(app):
            return [await _call(app, "/v1/completions", json.dumps(body).encode())
                    for _ in range(2)]

    for status, _, raw in asyncio.run(go()):
        assert status == 200, raw
        if stream:
            ev = _events(raw)
            text = "".join(e["choices"][0]["text"] for e in ev)
            lp = [t for e in ev for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]
        else:
            c = json.loads(raw)["choices"][0]
            text, lp = c["text"], c["logprobs"]["tokens"]
        # the fake session's tokens: 1 + (sum(ids) + i) % (N_VOCAB - 1), each rendered as a
        # letter; the text is their pieces, and so are the log probabilities' tokens
        want = asyncio.run(FakeRoute().detokenize([1 + (3 + i) % (N_VOCAB - 1) for i in range(60)]))
        assert text == want and "".join(lp) == want
    assert route.detokenized == 0
    assert route.fetched == 1  # the vocabulary, once at startup


def test_a_stop_string_split_over_tokens_ends_the_stream_and_is_never_sent():
    route = CountingRoute()
    app = create_app(route, model="m", template=Template())
    # tokens 4, 5, 6, ... render "efgh...": stop at "ghi"
    body = {"prompt": [1, 2], "max_tokens": 20, "stream": True, "stop": ["ghi"]}

    async def go():
        async with app.router.lifespan_context(app):
            return await _call(app, "/v1/completions", json.dumps(body).encode())

    status, _, raw = asyncio.run(go())
    ev = _events(raw)
    assert status == 200 and "".join(e["choices"][0]["text"] for e in ev) == "ef"
    assert ev[-1]["choices"][0]["finish_reason"] == "stop"
    assert route.detokenized == 0
