"""Nothing a client sends crashes the HTTP front or leaks a session: random request bodies
(any JSON, typed fields with values of any type, raw bytes) against ``create_app`` over a fake
route, through the ASGI interface itself. Every answer is a 200 or an OpenAI-shaped error with
a client status (never a 500), every streamed answer ends in ``[DONE]`` or an error event,
and after each request every session the front opened is closed and no slot is held. The
same for Anthropic's ``/v1/messages`` and ``count_tokens`` (in Anthropic's shapes), OpenAI's
``/v1/responses`` and ``/v1/embeddings``."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dgr import errors  # noqa: E402
from dgr.serve.app import create_app  # noqa: E402

N_VOCAB = 64
EOG = 0


class FakeSession:
    def __init__(self, route):
        self.route, self.logits, self.stop_reason = route, [], "length"
        self.trips = self.drafted = self.accepted = 0  # the decode loop's, as the real one
        route.opened += 1

    def _sampled(self, tok, logits):
        # as the real session: one logits row per sampled token, kept before it is yielded
        if logits:
            row = np.zeros(N_VOCAB, dtype=np.float32)
            row[tok] = 3.0
            self.logits.append(row)
        return tok

    async def generate(self, ids, *, max_tokens, sampling, stop=(), logits=False):
        if any(t == 7 for t in ids):  # a prompt with token 7: the route fails mid-way
            yield self._sampled(9, logits)
            raise errors.WorkerUnavailable("stage 1 went away")
        for i in range(max_tokens):
            self.trips += i > 0  # every token after the prefill's: one loop trip
            yield self._sampled(1 + (sum(ids) + i) % (N_VOCAB - 1), logits)
            await asyncio.sleep(0)

    async def embed(self, ids):
        if any(t == 7 for t in ids):  # as generate: the route fails
            raise errors.WorkerUnavailable("stage 1 went away")
        rows = np.zeros((len(ids), 4), dtype=np.float32)
        for i, t in enumerate(ids):
            rows[i] = [t, i + 1, sum(ids[:i + 1]), 1.0]
        return rows

    async def close(self):
        self.route.closed += 1


class FakeRoute:
    relay, loop = True, True
    n_ubatch = 64  # n choices of a prompt shorter than a chunk: each prefills alone

    def __init__(self):
        self.opened = self.closed = 0
        self.stages = [SimpleNamespace(endpoint=f"s{i}:1", layers=(i, i + 1), n_vocab=N_VOCAB,
                                       settings={"n_slots": 2, "n_ctx": 64}, n_ctx=64, n_ctx_train=64)
                       for i in range(2)]
        self.clients = []

    async def connect(self):
        pass

    async def close(self):
        pass

    async def tokenize(self, text, add_special=True, parse_special=False):
        return [1] + [ord(c) % N_VOCAB for c in text]

    async def detokenize(self, tokens):
        return "".join(chr(ord("a") + t % 26) for t in tokens)

    async def pieces(self):  # each token's bytes, as detokenize renders it
        return [bytes([ord("a") + t % 26]) for t in range(N_VOCAB)]

    def session(self):
        return FakeSession(self)

    async def describe(self):
        return []


class Template:
    def render_prompt(self, messages, add_generation_prompt=True, **extra):
        # (extra: the request's template variables, as dgr.serve.templates.ChatTemplate takes
        # them; a name the template sets itself is refused there)
        if set(extra) & {"messages", "tools", "add_generation_prompt"}:
            raise errors.InvalidArgument(f"template variables {sorted(extra)} clash")
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            raise errors.ChatTemplateError("a message needs a string content")
        return "".join(m["content"] for m in messages), True


async def _call(app, path: str, body: bytes, method: str = "POST",
                headers=()) -> tuple[int, dict, bytes]:
    """One HTTP request through the ASGI interface: (status, headers, body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "server": ("test", 80),
             "client": ("test", 1), "headers": [(b"content-type", b"application/json"),
                                                (b"content-length", str(len(body)).encode()),
                                                *headers]}
    sent = False
    out: dict = {"status": None, "headers": {}, "body": b""}

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)

    async def send(msg):
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
            out["headers"] = {k.decode(): v.decode() for k, v in msg["headers"]}
        elif msg["type"] == "http.response.body":
            out["body"] += msg.get("body", b"")

    await asyncio.wait_for(app(scope, receive, send), 30)
    return out["status"], out["headers"], out["body"]


FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "seed", "stop", "n", "stream", "stream_options", "logprobs",
          "top_logprobs", "reasoning_effort", "chat_template_kwargs", "reasoning_budget"]
EFFORTS = st.sampled_from(["none", "minimal", "low", "medium", "high", "xhigh", "maximal"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=10)
good_messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=20)}),
    min_size=1, max_size=3)
common = dict(max_tokens=st.integers(1, 40), stream=st.booleans(),
              temperature=st.floats(0, 2), top_p=st.floats(0.01, 1),
              stop=st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=4),
              stream_options=st.fixed_dictionaries({"include_usage": st.booleans()}),
              seed=st.integers(-2**63, 2**63 - 1), n=st.just(1), model=st.just("m"))
#: in-range requests (most answered 200), with or without each optional field
valid_chat = st.fixed_dictionaries({"messages": good_messages}, optional={
    **common, "max_completion_tokens": st.integers(1, 40), "logprobs": st.booleans(),
    "reasoning_effort": EFFORTS, "reasoning_budget": st.integers(-2, 64),
    "chat_template_kwargs": st.fixed_dictionaries({}, optional={
        "enable_thinking": st.booleans() | st.text(max_size=3)})})
valid_completion = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=20) | st.lists(st.integers(0, 100), min_size=1,
                                                            max_size=5)},
    optional={**common, "logprobs": st.integers(0, 5)})
#: any field with a value of any type
random_fields = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8)
requests = st.one_of(
    st.tuples(st.sampled_from([True, False]), random_fields),
    st.tuples(st.just(True), valid_chat),
    st.tuples(st.just(False), valid_completion),
    # an in-range request with one field replaced by anything
    st.tuples(st.booleans(), st.tuples(valid_chat | valid_completion, st.sampled_from(FIELDS),
                                       json_values).map(lambda x: {**x[0], x[1]: x[2]})))


#: hypothesis' settings of every fuzz test here (each sets its own ``max_examples``)
FUZZ = settings(deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _post(served, path: str, body) -> tuple[int, dict, bytes]:
    """POST ``body`` (bytes, or JSON to encode) to ``path`` of the served app."""
    app, _, loop = served
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return loop.run_until_complete(_call(app, path, raw))


def _answered(status, headers, raw) -> str:
    """The status is one an OpenAI client expects, with OpenAI's error shape when it is not
    200; which answer it is: "error", "stream" (server-sent events) or "json"."""
    assert status in (200, 400, 404, 413, 429, 503), (status, raw[:300])
    if status != 200:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        return "error"
    return ("stream" if headers.get("content-type", "").startswith("text/event-stream")
            else "json")


def _check(status, headers, raw, route):
    kind = _answered(status, headers, raw)
    if kind == "stream":
        events = [e for e in raw.decode().split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events)
        last = events[-1][6:]
        assert last == "[DONE]" or "error" in json.loads(last)
    elif kind == "json":
        d = json.loads(raw)
        assert d["choices"] and {"prompt_tokens", "completion_tokens"} <= set(d["usage"])
    assert route.opened == route.closed, "a session was not closed"


@pytest.fixture(scope="module")
def served():
    route = FakeRoute()
    app = create_app(route, model="m", template=Template(), queue_timeout=0.05)
    loop = asyncio.new_event_loop()
    lifespan = app.router.lifespan_context(app)
    loop.run_until_complete(lifespan.__aenter__())
    yield app, route, loop
    loop.run_until_complete(lifespan.__aexit__(None, None, None))
    loop.close()


@settings(FUZZ, max_examples=400)
@given(req=requests)
def test_any_json_body_is_answered_and_leaks_nothing(served, req):
    chat, body = req
    path = "/v1/chat/completions" if chat else "/v1/completions"
    _check(*_post(served, path, body), served[1])


@settings(FUZZ, max_examples=100)
@given(raw=st.binary(max_size=64), chat=st.booleans())
def test_any_bytes_are_answered(served, raw, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    _check(*_post(served, path, raw), served[1])


def test_a_route_failing_mid_stream_ends_the_stream_with_an_error_and_closes(served):
    route = served[1]
    body = {"prompt": [1, 7, 3], "max_tokens": 5, "stream": True}
    status, headers, raw = _post(served, "/v1/completions", body)
    assert status == 200
    last = json.loads(raw.decode().strip().split("\n\n")[-1][6:])
    assert last["error"]["code"] == "WorkerUnavailable"
    assert route.opened == route.closed
    status, _, raw = _post(served, "/v1/completions", {**body, "stream": False})
    assert status == 503 and route.opened == route.closed


# -- Anthropic's Messages API (dgr.serve.anthropic) ------------------------------------------

A_FIELDS = ["model", "max_tokens", "messages", "system", "stop_sequences", "stream",
            "temperature", "top_p", "top_k", "tools", "tool_choice", "metadata", "thinking",
            "cache_control"]
cache_controls = st.sampled_from([{"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"},
                                  {"type": "ephemeral", "ttl": "1d"}, {"type": "other"}, None])
doc_sources = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "media_type": st.just("text/plain"),
                           "data": st.text(max_size=10)}),
    st.fixed_dictionaries({"type": st.just("base64"),
                           "media_type": st.sampled_from(["text/plain", "application/pdf"]),
                           "data": st.sampled_from(["aGk=", "//4=", "not base64", ""])}),
    st.fixed_dictionaries({"type": st.sampled_from(["url", "file", "content"])}),
    json_values)
blocks = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)},
                          optional={"cache_control": cache_controls}),
    st.fixed_dictionaries({"type": st.just("document"), "source": doc_sources},
                          optional={"title": st.text(max_size=5),
                                    "cache_control": cache_controls}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.text(max_size=5),
                           "content": st.text(max_size=10)}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.text(max_size=5),
                           "name": st.text(max_size=5), "input": st.just({"a": 1})}),
    json_values), max_size=3)
a_messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant"]),
     "content": st.text(max_size=20) | blocks}), min_size=1, max_size=3)
valid_message = st.fixed_dictionaries(
    {"model": st.just("m"), "max_tokens": st.integers(1, 40), "messages": a_messages},
    optional={"system": st.text(max_size=10), "stream": st.booleans(),
              "temperature": st.floats(0, 1), "top_p": st.floats(0.01, 1),
              "top_k": st.integers(0, 50),
              "stop_sequences": st.lists(st.text(max_size=3), max_size=4),
              "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "none"}]),
              "cache_control": cache_controls,
              "thinking": st.one_of(
                  st.sampled_from([{"type": "adaptive"}, {"type": "disabled"}]),
                  st.fixed_dictionaries({"type": st.just("enabled"),
                                         "budget_tokens": st.integers(-1, 50)}))})
a_requests = st.one_of(
    st.dictionaries(st.sampled_from(A_FIELDS), json_values, max_size=8),
    valid_message,
    st.tuples(valid_message, st.sampled_from(A_FIELDS), json_values).map(
        lambda x: {**x[0], x[1]: x[2]}))


def _check_anthropic(status, headers, raw, route):
    assert status in (200, 400, 404, 413, 429, 503), (status, raw[:300])
    if status != 200:
        d = json.loads(raw)
        assert d["type"] == "error" and set(d["error"]) == {"type", "message"}
        assert d["error"]["message"]
    elif headers.get("content-type", "").startswith("text/event-stream"):
        kinds = [e.split("\n")[0] for e in raw.decode().split("\n\n") if e]
        assert kinds[0] == "event: message_start"
        assert kinds[-1] in ("event: message_stop", "event: error")
    else:
        d = json.loads(raw)
        assert d["type"] == "message" and {"input_tokens", "output_tokens"} <= set(d["usage"])
    assert route.opened == route.closed, "a session was not closed"


@settings(FUZZ, max_examples=300)
@given(body=a_requests, count=st.booleans())
def test_any_messages_body_is_answered_in_anthropics_shape(served, body, count):
    path = "/v1/messages/count_tokens" if count else "/v1/messages"
    _check_anthropic(*_post(served, path, body), served[1])


# -- OpenAI's Responses API (dgr.serve.responses) --------------------------------------------

R_FIELDS = ["model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
            "text", "max_output_tokens", "temperature", "top_p", "stream", "store",
            "previous_response_id", "metadata", "user", "reasoning"]
r_items = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer",
                                                    "assistant"]),
                           "content": st.text(max_size=10)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=4),
                           "name": st.text(max_size=4), "arguments": st.text(max_size=8)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"),
                           "call_id": st.text(max_size=4), "output": st.text(max_size=8)}),
    json_values), min_size=1, max_size=3)
valid_response = st.fixed_dictionaries(
    {"model": st.just("m"), "input": st.text(min_size=1, max_size=20) | r_items},
    optional={"instructions": st.text(max_size=10), "stream": st.booleans(),
              "max_output_tokens": st.integers(1, 40), "temperature": st.floats(0, 2),
              "store": st.just(False),
              "text": st.sampled_from([{"format": {"type": "text"}}]),
              "reasoning": st.fixed_dictionaries({}, optional={
                  "effort": EFFORTS, "summary": st.sampled_from(["auto", "detailed", None])})})
r_requests = st.one_of(
    st.dictionaries(st.sampled_from(R_FIELDS), json_values, max_size=8),
    valid_response,
    st.tuples(valid_response, st.sampled_from(R_FIELDS), json_values).map(
        lambda x: {**x[0], x[1]: x[2]}))


@settings(FUZZ, max_examples=300)
@given(body=r_requests)
def test_any_responses_body_is_answered_and_leaks_nothing(served, body):
    route = served[1]
    status, headers, raw = _post(served, "/v1/responses", body)
    kind = _answered(status, headers, raw)
    if kind == "stream":
        kinds = [e.split("\n")[0] for e in raw.decode().split("\n\n") if e]
        assert kinds[0] == "event: response.created"
        assert kinds[-1] in ("event: response.completed", "event: response.incomplete",
                             "event: error")
    elif kind == "json":
        r = json.loads(raw)
        assert r["object"] == "response" and r["status"] in ("completed", "incomplete")
    assert route.opened == route.closed, "a session was not closed"


# -- /v1/embeddings ----------------------------------------------------------------------------

e_inputs = (st.text(max_size=12) | st.lists(st.text(max_size=6), max_size=3)
            | st.lists(st.integers(-5, 80), max_size=6)
            | st.lists(st.lists(st.integers(-5, 80), max_size=4), max_size=3) | json_values)
e_requests = st.dictionaries(
    st.sampled_from(["input", "model", "encoding_format", "user", "dimensions", "extra"]),
    e_inputs | st.sampled_from(["float", "base64", "m"]), max_size=5)


@settings(FUZZ, max_examples=300)
@given(body=e_requests)
def test_any_embeddings_body_is_answered_and_leaks_nothing(served, body):
    route = served[1]
    status, headers, raw = _post(served, "/v1/embeddings", body)
    if _answered(status, headers, raw) != "error":
        d = json.loads(raw)
        assert d["object"] == "list" and len(d["data"]) >= 1
    assert route.opened == route.closed, "a session was not closed"
