"""Every request field of the OpenAI chat completions and completions API references is
either honoured, with a check of its effect here, or refused with a 400 naming it: none is
accepted and ignored (dgr.serve.fields)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

pytest.importorskip("starlette")
from test_serve_fuzz import FakeRoute, FakeSession, Template, _call  # noqa: E402  (its fakes)

from dgr.serve import fields  # noqa: E402
from dgr.serve.app import create_app  # noqa: E402

# The API references' request fields (platform.openai.com/docs/api-reference, 2026), written
# out here independently of dgr.serve.fields: a field missing there fails below.
CHAT_REFERENCE = [
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities",
    "n", "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key",
    "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier",
    "seed", "service_tier", "stop", "store", "stream", "stream_options", "temperature",
    "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options"]
COMPLETIONS_REFERENCE = [
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
    "suffix", "temperature", "top_p", "user"]

# a value of each refused field that asks for something dgr does not do
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
REFUSED = {
    "audio": {"voice": "alloy", "format": "wav"}, "function_call": "auto",
    "functions": [TOOL["function"]],
    "metadata": {"a": "b"}, "store": True, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "high",
    "verbosity": "low", "web_search_options": {}, "service_tier": "flex",
    "prompt_cache_key": "k", "prompt_cache_retention": "24h", "best_of": 3,
    "suffix": "tail", "n": 17, "stream_options": {"include_obfuscation": True}}
# the value of each refused field that asks for nothing: accepted
NEUTRAL = {
    "audio": None,
    "function_call": "none", "functions": [], "metadata": {},
    "store": False, "modalities": ["text"], "prediction": None, "reasoning_effort": None,
    "verbosity": None, "web_search_options": None, "service_tier": "auto",
    "prompt_cache_key": None, "prompt_cache_retention": None, "best_of": 1, "suffix": "",
    "n": 1, "stream_options": {"include_usage": False}}


class Recording(FakeRoute):
    def session(self):
        route = self

        class S(FakeSession):
            def generate(self, ids, **kw):
                route.asked = kw
                return super().generate(ids, **kw)

        return S(self)


def post(path: str, body: dict, route=None):
    route = route or Recording()
    app = create_app(route, model="m", template=Template())

    async def go():
        async with app.router.lifespan_context(app):
            return await _call(app, path, json.dumps(body).encode())

    status, _, raw = asyncio.run(go())
    return status, raw, route


def base(chat: bool) -> tuple[str, dict]:
    if chat:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 3}
    return "/v1/completions", {"prompt": "hi", "max_tokens": 3}


# llama-server's sampling fields dgr honours too
LLAMA_SERVER = ["top_k", "min_p", "repeat_penalty", "repeat_last_n", "grammar", "json_schema"]


@pytest.mark.parametrize("chat,reference", [(True, CHAT_REFERENCE),
                                            (False, COMPLETIONS_REFERENCE)])
def test_every_reference_field_is_classed(chat, reference):
    table = fields.CHAT if chat else fields.COMPLETIONS
    # and chat's reasoning_format and chat_template_kwargs (llama-server's), and its
    # reasoning_budget (dgr's: Anthropic's thinking.budget_tokens on the chat endpoint)
    extra = ["reasoning_format", "chat_template_kwargs", "reasoning_budget"] if chat else []
    assert sorted(table) == sorted(reference + LLAMA_SERVER + extra)


def _refused(chat: bool) -> list[str]:
    table = fields.CHAT if chat else fields.COMPLETIONS
    return [f for f in table if table[f] is not None] + ["n", "stream_options"]


@pytest.mark.parametrize("chat,name", [(c, f) for c in (True, False) for f in _refused(c)])
def test_a_field_not_honoured_is_refused_naming_it_and_accepted_when_it_asks_nothing(chat,
                                                                                      name):
    path, body = base(chat)
    status, raw, _ = post(path, {**body, name: REFUSED[name]})
    err = json.loads(raw)["error"]
    assert status == 400 and err["type"] == "invalid_request_error", raw
    assert err["param"].split(".")[0] == name and name in err["message"]
    status, raw, _ = post(path, {**body, name: NEUTRAL[name]})
    assert status == 200, raw


@pytest.mark.parametrize("chat", [True, False])
def test_a_field_in_no_reference_is_refused_as_openai_refuses_it(chat):
    path, body = base(chat)
    status, raw, _ = post(path, {**body, "mirostat": 2})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "mirostat"
    assert err["message"] == "Unrecognized request argument supplied: mirostat"
    status, raw, _ = post(path, {**body, "stream_options": {"include_usage": True, "x": 1}})
    assert status == 400 and json.loads(raw)["error"]["param"] == "stream_options.x"
    # the usage chunk is a stream's: asked without a stream, refused (as OpenAI does)
    status, raw, _ = post(path, {**body, "stream_options": {"include_usage": True}})
    assert status == 400 and json.loads(raw)["error"]["param"] == "stream_options"


@pytest.mark.parametrize("chat", [True, False])
def test_each_honoured_field_has_its_effect(chat, caplog):
    path, body = base(chat)
    # temperature, top_p, seed, the penalties, top_k, min_p: the session samples with them
    # (their effect on tokens, against llama.cpp's: tests/integration/test_penalties.py)
    _, _, route = post(path, {**body, "temperature": 0.5, "top_p": 0.25, "seed": 9,
                              "presence_penalty": 1.5, "frequency_penalty": -0.5,
                              "repeat_penalty": 1.2, "repeat_last_n": 16, "top_k": 7,
                              "min_p": 0.05})
    p = route.asked["sampling"]
    assert (p.temperature, p.top_p, p.seed, p.presence_penalty, p.frequency_penalty,
            p.repeat_penalty, p.penalty_last_n, p.top_k, p.min_p) == (
        0.5, 0.25, 9, 1.5, -0.5, 1.2, 16, 7, 0.05)
    _, _, route = post(path, {**body, "repeat_last_n": -1})
    assert route.asked["sampling"].penalty_last_n == 2**31 - 1
    _, _, route = post(path, body)  # llama-server's defaults: no penalty, a 64-token window
    p = route.asked["sampling"]
    assert (p.presence_penalty, p.frequency_penalty, p.repeat_penalty, p.penalty_last_n,
            p.top_k, p.min_p) == (0.0, 0.0, 1.0, 64, 0, 0.0) and not p.penalized
    for name, bad in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("top_k", -1),
                      ("min_p", 1.5), ("repeat_last_n", -2), ("repeat_penalty", 0)):
        status, raw, _ = post(path, {**body, name: bad})
        assert status == 400 and json.loads(raw)["error"]["param"] == name, name
    # logit_bias: the session samples with it (its effect on tokens: tests/system/test_serve.py)
    _, _, route = post(path, {**body, "logit_bias": {"5": -100, "12": 2.5}})
    assert route.asked["sampling"].logit_bias == ((5, -100.0), (12, 2.5))
    for bad in ({"x": 1}, {"5": 101}, {"5": True}, {"-1": 1}, {"64": 1}):  # N_VOCAB 64
        status, raw, _ = post(path, {**body, "logit_bias": bad})
        assert status == 400 and json.loads(raw)["error"]["param"] == "logit_bias", bad
    # grammars: chat's response_format, llama-server's json_schema and grammar (their effect
    # on the output: tests/integration/test_structured.py, tests/system/test_serve.py)
    asks = [{"json_schema": {"type": "object"}}, {"grammar": 'root ::= "yes" | "no"'}]
    if chat:
        asks += [{"response_format": {"type": "json_object"}},
                 {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "x", "strict": True,
                                                      "schema": {"type": "integer"}}}}]
    for ask in asks:
        status, raw, route = post(path, {**body, **ask})
        assert status == 200 and route.asked["sampling"].grammar, (ask, raw)
    _, _, route = post(path, body)
    assert route.asked["sampling"].grammar == ""
    if chat:
        _, _, route = post(path, {**body, "response_format": {"type": "text"}})
        assert route.asked["sampling"].grammar == ""
    bad = [({"json_schema": {"type": "nonsense"}}, "json_schema"),
           ({"grammar": "root ::= ("}, "grammar"),
           ({"grammar": "root ::= \"a\"", "json_schema": {}}, "grammar")]
    if chat:
        bad += [({"response_format": {"type": "xml"}}, "response_format"),
                ({"response_format": {"type": "json_schema"}}, "response_format")]
    for ask, name in bad:
        status, raw, _ = post(path, {**body, **ask})
        assert status == 400 and json.loads(raw)["error"]["param"] == name, (ask, raw)
    if chat:  # tools, tool_choice, parallel_tool_calls, reasoning_format: parsed and checked
        # here; their effect (calls rendered, forced, parsed and streamed; reasoning apart):
        # tests/unit/test_serve_chat.py, tests/system/test_serve_tools.py
        for name, bad in (("tools", [{"type": "retrieval"}]), ("tool_choice", "sometimes"),
                          ("parallel_tool_calls", "yes"), ("reasoning_format", "loud")):
            status, raw, _ = post(path, {**body, "tools": [TOOL], name: bad})
            assert status == 400 and json.loads(raw)["error"]["param"] == name, (name, raw)
        # a template that is not a model's (this test's) has no chat code: tools are a 400
        # that says why, never dropped
        status, raw, _ = post(path, {**body, "tools": [TOOL]})
        assert status == 400 and json.loads(raw)["error"]["param"] == "tools", raw
        status, raw, _ = post(path, {**body, "tools": [TOOL], "tool_choice": "none"})
        assert status == 400 and json.loads(raw)["error"]["param"] == "tools", raw
    # max_tokens (and chat's max_completion_tokens): the budget
    for name in ("max_tokens",) + (("max_completion_tokens",) if chat else ()):
        status, raw, route = post(path, {**{k: v for k, v in body.items() if k != "max_tokens"},
                                         name: 5})
        assert json.loads(raw)["usage"]["completion_tokens"] == 5
    # stop: the text is cut before it
    _, raw, _ = post(path, {**body, "max_tokens": 8})
    full = _text(raw, chat)
    _, raw, _ = post(path, {**body, "max_tokens": 8, "stop": full[3:5]})
    assert _text(raw, chat) == full[:3]
    # stream and stream_options.include_usage: server-sent events, the last with the usage
    _, raw, _ = post(path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(x[6:]) for x in raw.decode().splitlines() if x.startswith("data: {")]
    assert raw.endswith(b"data: [DONE]\n\n") and events[-1]["usage"]["completion_tokens"] == 3
    # logprobs (and chat's top_logprobs)
    lp = {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    _, raw, _ = post(path, {**body, **lp})
    got = json.loads(raw)["choices"][0]["logprobs"]
    assert (len(got["content"][0]["top_logprobs"]) if chat else len(got["top_logprobs"][0])) == 2
    # model: another model's name is a 404
    status, raw, _ = post(path, {**body, "model": "other"})
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"
    # user (and chat's safety_identifier): logged with the request's id
    ids = {"user": "u-17", **({"safety_identifier": "s-3"} if chat else {})}
    with caplog.at_level(logging.INFO, logger="dgr.serve"):
        _, raw, _ = post(path, {**body, **ids})
    rid = json.loads(raw)["id"]
    assert any(rid in r.getMessage() and all(v in r.getMessage() for v in ids.values())
               for r in caplog.records)
    if not chat:  # echo: the prompt's text comes first, streamed or not
        _, raw, _ = post(path, {**body, "echo": True})
        assert _text(raw, chat) == "hi" + full[:3]
        _, raw, _ = post(path, {**body, "echo": True, "stream": True})
        assert _text(raw, chat) == "hi" + full[:3]
        status, raw, _ = post(path, {**body, "echo": True, "logprobs": 1})
        assert status == 400 and json.loads(raw)["error"]["param"] == "echo"


def _text(raw: bytes, chat: bool) -> str:
    if raw.startswith(b"data: "):
        ev = [json.loads(x[6:]) for x in raw.decode().splitlines() if x.startswith("data: {")]
        return "".join((e["choices"][0]["delta"].get("content") or "") if chat
                       else e["choices"][0]["text"] for e in ev if e["choices"])
    c = json.loads(raw)["choices"][0]
    return c["message"]["content"] if chat else c["text"]


def test_a_model_is_retrieved_by_its_id():
    route = FakeRoute()
    app = create_app(route, model="org/m", template=Template())

    async def go():
        async with app.router.lifespan_context(app):
            return (await _call(app, "/v1/models/org/m", b"", method="GET"),
                    await _call(app, "/v1/models/x", b"", method="GET"))

    (s1, _, r1), (s2, _, r2) = asyncio.run(go())
    assert s1 == 200 and json.loads(r1)["id"] == "org/m" and json.loads(r1)["object"] == "model"
    assert s2 == 404 and json.loads(r2)["error"]["code"] == "model_not_found"


def test_the_models_list_advertises_the_routes_context():
    """/v1/models says how long a prompt may be, as vLLM (``max_model_len``) and llama-server
    (``meta.n_ctx``, ``meta.n_ctx_train``) do: the smallest of the route's stages' contexts."""
    route = FakeRoute()
    route.stages[1].n_ctx = 48  # a stage whose budget held less
    app = create_app(route, model="org/m", template=Template())

    async def go():
        async with app.router.lifespan_context(app):
            return (await _call(app, "/v1/models", b"", method="GET"),
                    await _call(app, "/v1/completions", json.dumps(
                        {"model": "org/m", "prompt": [1] * 49, "max_tokens": 1}).encode()))

    (s1, _, r1), (s2, _, r2) = asyncio.run(go())
    card = json.loads(r1)["data"][0]
    assert s1 == 200 and card["max_model_len"] == 48
    assert card["meta"] == {"n_ctx": 48, "n_ctx_train": 64, "n_vocab": route.stages[0].n_vocab,
                            "media": []}
    assert card["capabilities"] == ["completion"]  # no projector
    assert s2 == 400 and json.loads(r2)["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 48" in json.loads(r2)["error"]["message"]
