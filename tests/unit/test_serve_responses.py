"""OpenAI's Responses API on the front (dgr.serve.responses), over the fuzz test's fake route:
a request becomes the chat body the front serves (instructions, items, function calls and
their outputs, tools, text.format), the answer is a response object with output items, its
stream is the API's typed events in order, nothing is stored (store and previous_response_id
are refused, not ignored), and errors keep OpenAI's shape."""

from __future__ import annotations

import asyncio
import json

import pytest

from dgr.serve.api_errors import ApiError
from dgr.serve.app import create_app
from dgr.serve.responses import to_chat

from test_serve_fuzz import FakeRoute, Template, _call  # noqa: E402  (its fakes)

ASK = {"model": "m", "input": "hello", "instructions": "be brief", "max_output_tokens": 6}


@pytest.fixture
def front():
    route = FakeRoute()
    app = create_app(route, model="m", template=Template(), queue_timeout=0.05)
    loop = asyncio.new_event_loop()
    lifespan = app.router.lifespan_context(app)
    loop.run_until_complete(lifespan.__aenter__())

    def call(body):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return loop.run_until_complete(_call(app, "/v1/responses", raw))

    yield call, route
    loop.run_until_complete(lifespan.__aexit__(None, None, None))
    loop.close()


def test_a_request_becomes_the_chat_body_the_front_serves():
    body = {"model": "m", "instructions": "sys", "max_output_tokens": 9, "temperature": 0.5,
            "top_p": 0.9, "user": "u", "parallel_tool_calls": False, "store": False,
            "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"},
                       "strict": True}],
            "tool_choice": {"type": "function", "name": "w"},
            "text": {"format": {"type": "json_schema", "name": "out",
                                "schema": {"type": "object"}, "strict": True}},
            "input": [
                {"role": "developer", "content": "dev"},
                {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "think"}]},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": "It is sunny."}]}]}
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "system", "content": "dev"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "w", "parameters": {"type": "object"}, "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "w"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "out", "schema": {"type": "object"}, "strict": True}}
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"], chat["user"],
            chat["parallel_tool_calls"]) == (9, 0.5, 0.9, "u", False)
    assert to_chat({"model": "m", "input": "x", "text": {"format": {"type": "json_object"}}}
                   )["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize("change,param", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning"), ({"include": []}, "include"),
    ({"model": None}, "model"), ({"input": []}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"), ({"tool_choice": "maybe"}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text"), ({"text": {"verbosity": "low"}}, "text"),
    ({"metadata": {"k": 1}}, "metadata")])
def test_what_is_not_honoured_is_refused_by_name(change, param):
    body = {k: v for k, v in {**ASK, **change}.items() if v is not None}
    with pytest.raises(ApiError) as e:
        to_chat(body)
    assert e.value.status == 400 and e.value.param == param


def test_a_response_object(front):
    call, route = front
    status, headers, raw = call(ASK)
    assert status == 200, raw
    r = json.loads(raw)
    assert r["object"] == "response" and r["id"].startswith("resp_") and r["model"] == "m"
    assert r["status"] == "incomplete" and r["incomplete_details"] == {
        "reason": "max_output_tokens"}
    [msg] = r["output"]
    assert msg["type"] == "message" and msg["role"] == "assistant"
    assert msg["status"] == "completed" and len(msg["content"][0]["text"]) == 6
    assert r["usage"]["input_tokens"] == 1 + len("be briefhello")
    assert r["usage"]["output_tokens"] == 6 and r["store"] is False
    assert r["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert route.opened == route.closed


def _events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            kind, data = block.split("\n")
            d = json.loads(data[6:])
            assert kind == "event: " + d["type"]
            out.append((d["type"], d))
    assert [d["sequence_number"] for _, d in out] == list(range(len(out)))
    return out


def test_the_stream_is_the_apis_events_in_order(front):
    call, route = front
    whole = json.loads(call(ASK)[2])
    status, headers, raw = call({**ASK, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    ev = _events(raw)
    kinds = [k for k, _ in ev]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert ev[0][1]["response"]["status"] == "in_progress"
    text = "".join(d["delta"] for k, d in ev if k == "response.output_text.delta")
    assert text == whole["output"][0]["content"][0]["text"] == ev[-4][1]["text"]
    final = ev[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] == 6
    assert route.opened == route.closed


def test_a_route_failing_mid_stream_is_an_error_event(front):
    call, route = front
    status, _, raw = call({**ASK, "input": "\x07", "stream": True})
    ev = _events(raw)
    assert status == 200 and ev[-1][0] == "error"
    assert ev[-1][1]["code"] == "WorkerUnavailable"
    status, _, raw = call({**ASK, "input": "\x07"})
    assert status == 503 and json.loads(raw)["error"]["code"] == "WorkerUnavailable"
    assert route.opened == route.closed


@pytest.mark.parametrize("body,status", [
    (b"[1, 2]", 400), ({**ASK, "model": "other"}, 404), ({**ASK, "store": True}, 400),
    ({**ASK, "max_output_tokens": 0}, 400)])
def test_errors_keep_openais_shape(front, body, status):
    call, _ = front
    got, _, raw = call(body)
    err = json.loads(raw)["error"]
    assert got == status and set(err) == {"message", "type", "param", "code"}
