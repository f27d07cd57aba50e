"""Anthropic's Messages API through the HTTP front with the official ``anthropic`` client, on
a 2-stage SmolLM2 route (SmolLM2's own template): a conversation, streamed and not, the same
text both ways; every stream's events in the order Anthropic documents; a tool-use round trip
whose call is grammar-forced (``tool_choice`` any), so its structure is asserted, not the
model's judgement, streamed as ``input_json_delta``s that add up to the same input; and
``count_tokens`` equal to the prompt's own token count."""

from __future__ import annotations

import json

import pytest

from dgr.driver.route import AsyncRoute
from dgr.testing.serving import Served


anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("dgr._chat._chat")

pytestmark = pytest.mark.slow

NAME = "smollm2"
SETTINGS = dict(n_ctx=2048, n_slots=2, n_threads=1, n_ubatch=64)  # stages (conftest)

WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "description": "The city, e.g. Paris"},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city"], "additionalProperties": False}}
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
# this client's create() has no temperature (the API's newer models take none); the field is
# still the API's, and dgr honours it
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(stages, smollm2):
    from dgr.serve.app import create_app
    from dgr.serve.templates import ChatTemplate

    template = ChatTemplate.from_gguf(smollm2)
    served = Served(create_app(AsyncRoute([w.address for w in stages]), model=NAME,
                               template=template))
    client = served.anthropic(timeout=120)
    yield client, template, stages
    served.stop()


def _order(kinds: list[str]) -> None:
    """Anthropic's documented order: message_start, pings anywhere, then per content block
    start, deltas, stop, then message_delta and message_stop."""
    kinds = [k for k in kinds if k != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    open_block = False
    for k in kinds[1:-2]:
        if k == "content_block_start":
            assert not open_block
            open_block = True
        elif k == "content_block_delta":
            assert open_block
        else:
            assert k == "content_block_stop" and open_block, kinds
            open_block = False
    assert not open_block


def test_a_conversation_streamed_and_not(claude):
    client, _, _ = claude
    m = client.messages.create(model=NAME, max_tokens=24, system=SYSTEM, messages=ASK,
                               extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.output_tokens <= 24 and m.usage.input_tokens > 10
    raw = list(client.messages.create(model=NAME, max_tokens=24, system=SYSTEM, messages=ASK,
                                      extra_body=GREEDY, stream=True))
    _order([e.type for e in raw])
    assert "".join(e.delta.text for e in raw if e.type == "content_block_delta") == \
        m.content[0].text
    with client.messages.stream(model=NAME, max_tokens=24, system=SYSTEM, messages=ASK,
                                extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    # the next turn, with the answer in the history
    turn = ASK + [{"role": "assistant", "content": m.content[0].text},
                  {"role": "user", "content": "And of Italy?"}]
    m2 = client.messages.create(model=NAME, max_tokens=16, system=SYSTEM, messages=turn,
                                extra_body=GREEDY)
    # Anthropic's usage: input_tokens leaves out what was read from a cache (the stages'
    # prefix stores may hold the first turn's prompt), so the prompt is the sum
    def prompt(u):
        return u.input_tokens + (u.cache_read_input_tokens or 0)

    assert m2.content[0].text.strip() and prompt(m2.usage) > prompt(m.usage)


def test_a_stop_sequence_ends_the_text(claude):
    client, _, _ = claude
    m = client.messages.create(model=NAME, max_tokens=24, system=SYSTEM, messages=ASK,
                               extra_body=GREEDY)
    text = m.content[0].text
    stop = text.split()[1]  # a word of the answer
    cut = client.messages.create(model=NAME, max_tokens=24, system=SYSTEM, messages=ASK,
                                 extra_body=GREEDY, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_a_forced_tool_use_round_trip(claude):
    client, _, _ = claude
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    m = client.messages.create(model=NAME, max_tokens=96, messages=ask, tools=[WEATHER],
                               tool_choice={"type": "any"}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    assert uses[0].id.startswith("toolu_")  # Anthropic's spelling, not OpenAI's call_
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    # the same call streamed: its input as partial JSON that adds up to the same object
    events = list(client.messages.create(model=NAME, max_tokens=96, messages=ask,
                                         tools=[WEATHER], tool_choice={"type": "any"},
                                         extra_body=GREEDY, stream=True))
    _order([e.type for e in events])
    assert [e.content_block.id[:6] for e in events if e.type == "content_block_start"
            and e.content_block.type == "tool_use"] == ["toolu_"]
    with client.messages.stream(model=NAME, max_tokens=96, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY) as s:
        final = s.get_final_message()
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta")
    assert json.loads(partial) == uses[0].input
    assert [b.input for b in final.content if b.type == "tool_use"] == [uses[0].input]
    # the result goes back; the answer is text
    history = ask + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": uses[0].id,
                                                   "content": "22 degrees and sunny"}]}]
    answer = client.messages.create(model=NAME, max_tokens=32, messages=history,
                                    tools=[WEATHER], tool_choice={"type": "none"},
                                    extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text.strip()


def test_count_tokens_is_the_prompts_token_count(claude):
    client, template, stages = claude
    n = client.messages.count_tokens(model=NAME, system=SYSTEM, messages=ASK).input_tokens
    text, add_bos = template.render_prompt([{"role": "system", "content": SYSTEM}, *ASK],
                                           add_generation_prompt=True)
    engine = stages[0].worker.pipeline.engine
    assert n == len(engine.tokenize(text, add_bos, True))
    m = client.messages.create(model=NAME, max_tokens=1, system=SYSTEM, messages=ASK)
    assert m.usage.input_tokens == n


def test_errors_reach_the_client_as_anthropics_errors(claude):
    client, _, _ = claude
    # SmolLM2's template does not think: asked to, it says so
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=NAME, max_tokens=2048, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert "has no reasoning in its chat template" in str(e.value)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=NAME, max_tokens=8, messages=ASK,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert "budget_tokens" in str(e.value) and "max_tokens" in str(e.value)
    # disabled: nothing to turn off, served
    m = client.messages.create(model=NAME, max_tokens=4, messages=ASK,
                               thinking={"type": "disabled"})
    assert [b.type for b in m.content] == ["text"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="another-model", max_tokens=8, messages=ASK)


def test_structured_output_follows_the_schema(claude):
    client, _, _ = claude
    schema = {"type": "object", "properties": {
        "city": {"type": "string"}, "country": {"type": "string"},
        "population_millions": {"type": "number"}},
        "required": ["city", "country"], "additionalProperties": False}
    m = client.messages.create(model=NAME, max_tokens=96, messages=ASK, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema",
                                                         "schema": schema}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_cache_control_is_a_hint_top_level_and_per_block(claude):
    """Client 2.x sends ``cache_control`` for automatic caching, top-level and on blocks: it
    is accepted (the prefix cache is automatic), and the answer is the one without it."""
    client, _, _ = claude
    plain = client.messages.create(model=NAME, max_tokens=12, system=SYSTEM, messages=ASK,
                                   extra_body=GREEDY)
    eph = {"type": "ephemeral"}
    m = client.messages.create(
        model=NAME, max_tokens=12, extra_body={**GREEDY, "cache_control": eph},
        system=[{"type": "text", "text": SYSTEM, "cache_control": eph}],
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"],
                                                "cache_control": {**eph, "ttl": "1h"}}]}])
    assert m.content[0].text == plain.content[0].text
    # usage says what the prefix cache read (the stages' prefix stores, here): the prompt is
    # the same, however much of it was read
    u, v = m.usage, plain.usage
    assert u.input_tokens + u.cache_read_input_tokens == v.input_tokens + v.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=NAME, max_tokens=4, messages=ASK,
                               extra_body={"cache_control": {"type": "forever"}})
    assert "cache_control" in str(e.value)


def test_document_blocks_of_plain_text_are_text(claude):
    import base64

    client, _, _ = claude
    doc = "Paris is the capital of France. Its river is the Seine."
    ask = "What is the river of the capital?"
    want = client.messages.create(model=NAME, max_tokens=12, extra_body=GREEDY, messages=[
        {"role": "user", "content": [{"type": "text", "text": "notes\n\n" + doc},
                                     {"type": "text", "text": ask}]}])
    for source in ({"type": "text", "media_type": "text/plain", "data": doc},
                   {"type": "base64", "media_type": "text/plain",
                    "data": base64.b64encode(doc.encode()).decode()}):
        m = client.messages.create(model=NAME, max_tokens=12, extra_body=GREEDY, messages=[
            {"role": "user", "content": [{"type": "document", "source": source,
                                          "title": "notes"},
                                         {"type": "text", "text": ask}]}])
        assert m.content[0].text == want.content[0].text
        u, v = m.usage, want.usage  # the same prompt (however much the prefix cache read)
        assert u.input_tokens + u.cache_read_input_tokens == \
            v.input_tokens + v.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=NAME, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "document", "source": {
                "type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}]}])
    assert "plain text" in str(e.value)


@pytest.fixture(scope="module")
def r1(stages, smollm2):
    """The same route, its front given DeepSeek R1's template, which thinks (it opens
    <think> itself and closes it at once without enable_thinking)."""
    import dataclasses
    import pathlib

    from dgr.serve.app import create_app
    from dgr.serve.templates import ChatTemplate

    src = (pathlib.Path(__file__).parents[1] / "data" / "chat_templates"
           / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    t = dataclasses.replace(ChatTemplate.from_gguf(smollm2), source=src, tool_use=None,
                            name="r1")
    served = Served(create_app(AsyncRoute([w.address for w in stages]), model=NAME,
                               template=t))
    yield served.anthropic(timeout=120)
    served.stop()


def _thinking_of(m) -> str:
    return "".join(b.thinking for b in m.content if b.type == "thinking")


def test_thinking_on_a_reasoning_template_adaptive_capped_disabled_and_streamed(r1, stages):
    engine = stages[0].worker.pipeline.engine
    kw = dict(model=NAME, max_tokens=40, messages=ASK, extra_body=GREEDY)
    free = r1.messages.create(thinking={"type": "adaptive"}, **kw)
    reasoning = _thinking_of(free)
    assert reasoning.strip() and free.content[0].type == "thinking"
    # a budget of 8 tokens: the front ends the reasoning with the template's </think> after
    # the model's first 8, which are the uncapped reply's own (greedy), then the answer
    capped = r1.messages.create(thinking={"type": "enabled", "budget_tokens": 8}, **kw)
    short = _thinking_of(capped)
    assert short.strip() and reasoning.strip().startswith(short.strip())
    assert len(engine.tokenize(short, False, False)) <= 8 + 2
    assert len(short) < len(reasoning)
    assert capped.usage.output_tokens <= 40
    # streamed: thinking_delta events that add up to the same reasoning
    events = list(r1.messages.create(thinking={"type": "enabled", "budget_tokens": 8},
                                     stream=True, **kw))
    _order([e.type for e in events])
    streamed = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                       and e.delta.type == "thinking_delta")
    assert streamed == short
    # disabled: the template closes the reasoning in the prompt; no thinking block
    off = r1.messages.create(thinking={"type": "disabled"}, **kw)
    assert not _thinking_of(off).strip()
    u, v = off.usage, free.usage  # its prompt holds </think> too
    assert u.input_tokens + u.cache_read_input_tokens > v.input_tokens + v.cache_read_input_tokens
