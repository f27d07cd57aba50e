"""Tool calls and reasoning through the HTTP front with the official ``openai`` client, on a
2-stage SmolLM2 route: with SmolLM2's own template (which knows no tools: llama.cpp's generic
JSON format) and with a Hermes template given to the front (``<tool_call>`` markup).
``required`` and a named function are grammar-forced, so the calls' structure is asserted,
not the model's judgement: a round trip (call, ``tool`` message, final answer), and streamed
deltas that add up to the non-streamed calls. With DeepSeek R1's template, the reasoning comes
back apart (``reasoning_content``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dgr.driver.route import AsyncRoute
from dgr.testing.serving import Served

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("dgr._chat._chat")

pytestmark = pytest.mark.slow

SETTINGS = dict(n_ctx=2048, n_slots=2, n_threads=1, n_ubatch=64)
NAME = "smollm2"
HERMES = Path(__file__).resolve().parents[1] / "data" / "chat_templates" / \
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                   "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _client(stages, template):
    from dgr.serve.app import create_app

    served = Served(create_app(AsyncRoute([w.address for w in stages]), model=NAME,
                               template=template))
    return served, served.openai(timeout=120)


@pytest.fixture(scope="module")
def smol(stages, smollm2):
    from dgr.serve.templates import ChatTemplate

    served, client = _client(stages, ChatTemplate.from_gguf(smollm2))
    yield client
    served.stop()


@pytest.fixture(scope="module")
def hermes(stages, smollm2):
    """The same route, its front given a Hermes/Qwen-style template (SmolLM2's BOS/EOS)."""
    import dataclasses

    from dgr.serve.templates import ChatTemplate

    t = dataclasses.replace(ChatTemplate.from_gguf(smollm2), source=HERMES.read_text(),
                            tool_use=None, name="hermes")
    served, client = _client(stages, t)
    yield client
    served.stop()


def _check_calls(choice, tools=(WEATHER,)) -> list[tuple[str, dict]]:
    """The calls of a choice, each naming a tool of ``tools`` with arguments its schema
    validates."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls, choice.message
    out = []
    for c in calls:
        assert c.type == "function" and c.id
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, schemas[c.function.name])
        out.append((c.function.name, args))
    return out


def test_a_round_trip_with_smollm2s_own_template(smol):
    """required: a call comes back; its result as a ``tool`` message gets a final answer."""
    r = smol.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                     tool_choice="required", temperature=0, max_tokens=64)
    calls = _check_calls(r.choices[0])
    assert calls[0][0] == "get_weather"
    call = r.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, sunny"}]
    final = smol.chat.completions.create(model=NAME, messages=history, tools=[WEATHER],
                                         tool_choice="none", temperature=0, max_tokens=24)
    c = final.choices[0]
    assert c.finish_reason in ("stop", "length") and not c.message.tool_calls
    assert isinstance(c.message.content, str) and c.message.content.strip()
    plain = smol.chat.completions.create(model=NAME, messages=ASK, max_tokens=1)
    # the call and its result are in the prompt
    assert final.usage.prompt_tokens > plain.usage.prompt_tokens + 10


def test_a_named_function_with_a_hermes_template(hermes):
    """A named function forces that call, in Hermes's <tool_call> markup, parsed into its
    structure."""
    r = hermes.chat.completions.create(
        model=NAME, messages=ASK, tools=[TIME, WEATHER], temperature=0, max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False)
    calls = _check_calls(r.choices[0], (TIME, WEATHER))
    assert [n for n, _ in calls] == ["get_weather"]
    assert r.choices[0].message.content is None


@pytest.mark.parametrize("which", ["smol", "hermes"])
def test_streamed_tool_call_deltas_add_up_to_the_calls(which, request):
    client = request.getfixturevalue(which)
    kw = dict(model=NAME, messages=ASK, tools=[WEATHER], tool_choice="required",
              temperature=0, max_tokens=64, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw)
    calls: list[dict] = []
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        for d in ch.delta.tool_calls or []:
            if d.index == len(calls):
                assert d.id and d.function.name and d.type == "function"
                calls.append({"name": d.function.name, "arguments": ""})
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        _check_calls(whole.choices[0])


def test_tools_with_a_response_format_is_refused(smol):
    with pytest.raises(openai.BadRequestError) as e:
        smol.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                     tool_choice="required", max_tokens=4,
                                     response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        smol.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=4,
                                     tool_choice={"type": "function",
                                                  "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"


@pytest.fixture(scope="module")
def thinking(stages, smollm2):
    """The same route, its front given DeepSeek R1's template (which opens <think> itself)."""
    import dataclasses

    from dgr.serve.templates import ChatTemplate

    src = HERMES.with_name("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    t = dataclasses.replace(ChatTemplate.from_gguf(smollm2), source=src, tool_use=None,
                            name="r1")
    served, client = _client(stages, t)
    yield client
    served.stop()


def test_a_thinking_templates_reasoning_comes_apart_streamed_and_not(thinking):
    """R1's template opens <think>: what the model writes up to </think> is
    ``reasoning_content``, the rest ``content``; the streamed deltas add up to the same, and
    ``reasoning_format: none`` gives it all as content."""
    kw = dict(model=NAME, messages=ASK, temperature=0, max_tokens=24)
    m = thinking.chat.completions.create(**kw).choices[0].message
    reasoning = (m.model_extra or {}).get("reasoning_content") or ""
    assert reasoning.strip()
    got = {"content": "", "reasoning_content": ""}
    for chunk in thinking.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        got["content"] += d.content or ""
        got["reasoning_content"] += (d.model_extra or {}).get("reasoning_content") or ""
    assert got == {"content": m.content or "", "reasoning_content": reasoning}
    inline = thinking.chat.completions.create(extra_body={"reasoning_format": "none"}, **kw)
    im = inline.choices[0].message
    assert not (im.model_extra or {}).get("reasoning_content")
    assert reasoning.strip() in im.content


def test_reasoning_effort_and_a_budget_on_a_thinking_template(thinking, smol):
    """OpenAI's reasoning_effort through the official client: ``none`` turns R1's thinking
    off (its template closes <think> in the prompt), a budget ends the reasoning after that
    many tokens (the uncapped reasoning's first ones, greedy); SmolLM2's template, which does
    not think, refuses a request to think with a 400 that says so."""
    kw = dict(model=NAME, messages=ASK, temperature=0, max_tokens=24)

    def reasoning_of(r):
        return (r.choices[0].message.model_extra or {}).get("reasoning_content") or ""

    free = reasoning_of(thinking.chat.completions.create(**kw))
    off = thinking.chat.completions.create(reasoning_effort="none", **kw)
    assert free.strip() and not reasoning_of(off).strip()
    capped = thinking.chat.completions.create(extra_body={"reasoning_budget": 4}, **kw)
    short = reasoning_of(capped)
    assert short.strip() and free.strip().startswith(short.strip()) and len(short) < len(free)
    assert capped.usage.completion_tokens <= 24
    # a Responses request's reasoning.effort is the same switch
    r = thinking.responses.create(model=NAME, input=ASK[0]["content"], temperature=0,
                                  max_output_tokens=24, reasoning={"effort": "none"})
    assert not [i for i in r.output if i.type == "reasoning"]
    with pytest.raises(openai.BadRequestError) as e:
        smol.chat.completions.create(reasoning_effort="high", **kw)
    assert "has no reasoning in its chat template" in str(e.value)
    assert smol.chat.completions.create(reasoning_effort="none", **kw).choices[0].message


def test_an_agent_loops_turns_reuse_the_prompt_cache_under_the_tools_grammar(stages, smollm2,
                                                                            smol):
    """SmolLM2's template knows no tools: llama.cpp's generic format constrains every reply
    with a grammar, ``tool_choice`` auto included. An agent loop's turns (tools in every
    request, the history growing) through a front with the prompt cache take over the kept
    session (hits, tokens not prefilled again) and give the replies of the front without it."""
    import json as _json
    import urllib.request

    from dgr.serve.app import create_app
    from dgr.serve.templates import ChatTemplate

    served = Served(create_app(AsyncRoute([w.address for w in stages]), model=NAME,
                               template=ChatTemplate.from_gguf(smollm2), prompt_cache=1,
                               prompt_cache_ttl=600))
    cached = served.openai(timeout=120)

    def said(r):
        c = r.choices[0]
        return (c.finish_reason, c.message.content, r.usage.completion_tokens,
                [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []])

    try:
        history = list(ASK)
        kw = dict(model=NAME, tools=[WEATHER, TIME], tool_choice="auto", temperature=0,
                  max_tokens=40)
        for obs in ("The weather service is slow today.", "Paris: 18 degrees, sunny.",
                    "Thank you."):
            a = cached.chat.completions.create(messages=history, **kw)
            b = smol.chat.completions.create(messages=history, **kw)
            assert said(a) == said(b)
            history += [{"role": "assistant", "content": a.choices[0].message.content or ""},
                        {"role": "user", "content": obs}]
        with urllib.request.urlopen(served.base + "/status") as r:
            pc = _json.load(r)["prompt_cache"]
        assert pc["hits"] >= 2 and pc["tokens_reused"] > 64, pc
    finally:
        served.stop()
