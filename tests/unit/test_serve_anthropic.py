"""Anthropic's Messages API on the front (dgr.serve.anthropic), over the fuzz test's fake
route: a request becomes the chat body the front serves (system, blocks, tool use and
results, tool choice), the answer and its stream take Anthropic's shapes in Anthropic's order,
stop sequences are named, count_tokens counts the rendered prompt, x-api-key is a key, and
errors are Anthropic's."""

from __future__ import annotations

import asyncio
import json

import pytest

from dgr.serve.anthropic import to_chat
from dgr.serve.api_errors import ApiError
from dgr.serve.app import create_app

from test_serve_auth import KEYS  # noqa: E402  (the auth test's keys)
from test_serve_fuzz import FakeRoute, Template, _call  # noqa: E402  (its fakes)

ASK = {"model": "m", "max_tokens": 6, "system": "be brief",
       "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(params=[None])
def front(request):
    route = FakeRoute()
    app = create_app(route, model="m", template=Template(), queue_timeout=0.05,
                     api_keys=request.param)
    loop = asyncio.new_event_loop()
    lifespan = app.router.lifespan_context(app)
    loop.run_until_complete(lifespan.__aenter__())

    def call(path, body, headers=()):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return loop.run_until_complete(_call(app, path, raw, headers=headers))

    yield call, route
    loop.run_until_complete(lifespan.__aexit__(None, None, None))
    loop.close()


def _events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            assert kind.startswith("event: ") and data.startswith("data: ")
            d = json.loads(data[6:])
            assert d["type"] == kind[7:]
            out.append((kind[7:], d))
    return out


def test_a_request_becomes_the_chat_body_the_front_serves():
    body = {"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "sys"}],
            "stop_sequences": ["END"], "temperature": 0.2, "top_p": 0.9, "top_k": 5,
            "metadata": {"user_id": "u1"},
            "tools": [{"name": "w", "description": "weather",
                       "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "w", "disable_parallel_tool_use": True},
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "let me look"},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": "P"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "thanks"}]}]}
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "w", "arguments": '{"c": "P"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "thanks"}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "w", "parameters": {"type": "object"}, "description": "weather"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "w"}}
    assert chat["parallel_tool_calls"] is False
    assert (chat["stop"], chat["max_tokens"], chat["user"]) == (["END"], 9, "u1")
    assert (chat["temperature"], chat["top_p"], chat["top_k"]) == (0.2, 0.9, 5)
    for kind, want in (("auto", "auto"), ("any", "required"), ("none", "none")):
        assert to_chat({**ASK, "tool_choice": {"type": kind}})["tool_choice"] == want


@pytest.mark.parametrize("change,param", [
    ({"max_tokens": None}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"thinking": {"type": "enabled"}}, "thinking"), ({"model": None}, "model"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"tools": [{"type": "web_search_20250305", "name": "s"}]}, "tools"),
    ({"tool_choice": {"type": "maybe"}}, "tool_choice"),
    ({"stop_sequences": "END"}, "stop_sequences"),
    ({"metadata": {"tenant": "x"}}, "metadata")])
def test_what_is_not_honoured_is_refused_by_name(change, param):
    body = {k: v for k, v in {**ASK, **change}.items() if v is not None}
    with pytest.raises(ApiError) as e:
        to_chat(body)
    assert e.value.status == 400 and e.value.param == param


def test_an_answer_in_anthropics_shape(front):
    call, route = front
    status, headers, raw = call("/v1/messages", ASK)
    assert status == 200, raw
    d = json.loads(raw)
    assert d["type"] == "message" and d["role"] == "assistant" and d["model"] == "m"
    assert d["id"].startswith("msg_") and headers["request-id"] == d["id"]
    assert [b["type"] for b in d["content"]] == ["text"] and len(d["content"][0]["text"]) == 6
    assert d["stop_reason"] == "max_tokens" and d["stop_sequence"] is None
    # the prompt as the template renders it ("be brief" + "hello"), tokenized with a BOS
    assert d["usage"]["input_tokens"] == 1 + len("be briefhello")
    assert d["usage"]["output_tokens"] == 6 and d["usage"]["cache_read_input_tokens"] == 0
    assert route.opened == route.closed


def test_a_stop_sequence_is_named(front):
    call, _ = front
    text = json.loads(call("/v1/messages", ASK)[2])["content"][0]["text"]
    stop = text[2:4]
    d = json.loads(call("/v1/messages", {**ASK, "stop_sequences": ["zzz", stop]})[2])
    assert d["stop_reason"] == "stop_sequence" and d["stop_sequence"] == stop
    assert d["content"][0]["text"] == text[:text.index(stop)]


def test_the_stream_is_anthropics_events_in_order(front):
    call, route = front
    whole = json.loads(call("/v1/messages", ASK)[2])
    status, headers, raw = call("/v1/messages", {**ASK, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    ev = _events(raw)
    kinds = [k for k, _ in ev]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = ev[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert ev[2][1] == {"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}
    text = "".join(d["delta"]["text"] for k, d in ev if k == "content_block_delta")
    assert text == whole["content"][0]["text"]
    assert ev[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert ev[-2][1]["usage"] == {"output_tokens": 6}
    assert route.opened == route.closed


def test_a_route_failing_mid_stream_is_an_error_event(front):
    call, route = front
    body = {**ASK, "messages": [{"role": "user", "content": "\x07"}], "stream": True}
    status, _, raw = call("/v1/messages", body)
    ev = _events(raw)
    assert status == 200 and ev[-1][0] == "error"
    assert ev[-1][1]["error"]["type"] == "overloaded_error"
    status, _, raw = call("/v1/messages", {**body, "stream": False})
    assert status == 503 and json.loads(raw)["error"]["type"] == "overloaded_error"
    assert route.opened == route.closed


def test_count_tokens_counts_the_rendered_prompt_without_a_slot(front):
    call, route = front
    status, _, raw = call("/v1/messages/count_tokens",
                          {k: v for k, v in ASK.items() if k != "max_tokens"})
    assert status == 200 and json.loads(raw) == {"input_tokens": 1 + len("be briefhello")}
    assert route.opened == 0
    status, _, raw = call("/v1/messages/count_tokens", ASK)  # max_tokens: not its field
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,status,kind", [
    (b"{not json", 400, "invalid_request_error"),
    ({**ASK, "model": "other"}, 404, "not_found_error"),
    ({**ASK, "temperature": "hot"}, 400, "invalid_request_error")])
def test_errors_take_anthropics_shape(front, body, status, kind):
    call, _ = front
    got, _, raw = call("/v1/messages", body)
    d = json.loads(raw)
    assert got == status and d["type"] == "error" and d["error"]["type"] == kind
    assert set(d["error"]) == {"type", "message"} and d["error"]["message"]


@pytest.mark.parametrize("front", [KEYS], indirect=True)
def test_x_api_key_is_a_key(front):
    call, _ = front
    ok = call("/v1/messages", ASK, headers=[(b"x-api-key", KEYS[0].encode())])
    assert ok[0] == 200, ok[2]
    for headers in ([], [(b"x-api-key", b"wrong-key-123")]):
        status, _, raw = call("/v1/messages", ASK, headers=headers)
        assert status == 401
        assert json.loads(raw)["error"]["type"] == "authentication_error"


def test_thinking_maps_to_the_templates_reasoning_switch_and_budget():
    chat = to_chat({**ASK, "max_tokens": 64, "thinking": {"type": "enabled",
                                                          "budget_tokens": 16}})
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert chat["reasoning_budget"] == 16
    assert to_chat({**ASK, "thinking": {"type": "adaptive"}})["chat_template_kwargs"] == \
        {"enable_thinking": True}
    off = to_chat({**ASK, "thinking": {"type": "disabled"}})
    assert off["chat_template_kwargs"] == {"enable_thinking": False}
    assert "reasoning_budget" not in off
    for bad in ({"type": "enabled", "budget_tokens": 6}, {"type": "enabled", "budget_tokens": 0},
                {"type": "sometimes"}, {"type": "disabled", "budget_tokens": 4}, "on",
                {"type": "adaptive", "display": "omitted"}):
        with pytest.raises(ApiError) as e:
            to_chat({**ASK, "thinking": bad})  # max_tokens 6: a budget must be below it
        assert e.value.param == "thinking"


def test_cache_control_is_accepted_where_the_api_puts_it_and_checked():
    eph = {"type": "ephemeral"}
    body = {**ASK, "cache_control": eph,
            "system": [{"type": "text", "text": "sys", "cache_control": eph}],
            "tools": [{"name": "w", "input_schema": {"type": "object"}, "cache_control": eph}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hi", "cache_control": {**eph, "ttl": "1h"}}]}]}
    chat = to_chat(body)
    assert chat["messages"] == [{"role": "system", "content": "sys"},
                                {"role": "user", "content": "hi"}]
    assert to_chat({k: v for k, v in body.items() if k != "cache_control"}) == chat
    for where, bad in (("top", {"type": "persistent"}), ("top", {**eph, "ttl": "1d"}),
                       ("block", {"type": "ephemeral", "scope": "x"})):
        b = {**body, "cache_control": bad} if where == "top" else {**body, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": bad}]}]}
        with pytest.raises(ApiError) as e:
            to_chat(b)
        assert "cache_control" in e.value.message


def test_document_blocks_of_text_become_text_and_others_are_refused():
    import base64

    def user(*blocks):
        return to_chat({**ASK, "system": None, "messages": [
            {"role": "user", "content": list(blocks)}]})["messages"]

    doc = "line one\nline two"
    want = [{"role": "user", "content": "T\n\n" + doc + "question"}]
    for src in ({"type": "text", "media_type": "text/plain", "data": doc},
                {"type": "base64", "media_type": "text/plain",
                 "data": base64.b64encode(doc.encode()).decode()},
                {"type": "content", "content": [{"type": "text", "text": doc}]}):
        assert user({"type": "document", "source": src, "title": "T"},
                    {"type": "text", "text": "question"}) == want
    for src in ({"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
                {"type": "url", "url": "https://example.com/a.pdf"},
                {"type": "file", "file_id": "file_1"},
                {"type": "base64", "media_type": "text/plain", "data": "not base64!"},
                {"type": "base64", "media_type": "text/plain",
                 "data": base64.b64encode(b"\xff\xfe").decode()}):
        with pytest.raises(ApiError) as e:
            user({"type": "document", "source": src})
        assert e.value.status == 400 and e.value.param == "messages"


def test_tool_use_ids_are_anthropics():
    from dgr.serve.anthropic import _tool_id

    assert _tool_id("call_abc123") == "toolu_abc123"
    assert _tool_id("toolu_x") == "toolu_x"
    assert _tool_id("7") == "toolu_7"
    fresh = _tool_id(None)
    assert fresh.startswith("toolu_") and len(fresh) == 30 and fresh != _tool_id(None)
