"""OpenAI's Responses API through the HTTP front with the official ``openai`` client's
``responses.create``, on a 2-stage SmolLM2 route (SmolLM2's own template): text, streamed and
not (the same text, the events in order), a JSON-schema output that validates, and a function
call round trip whose call is grammar-forced (``tool_choice`` required), so its structure is
asserted, not the model's judgement; stateless: ``store`` and ``previous_response_id`` are
refused."""

from __future__ import annotations

import json

import pytest

from dgr.driver.route import AsyncRoute
from dgr.testing.serving import Served


openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("dgr._chat._chat")

pytestmark = pytest.mark.slow

NAME = "smollm2"
SETTINGS = dict(n_ctx=2048, n_slots=2, n_threads=1, n_ubatch=64)  # stages (conftest)

WEATHER = {"type": "function", "name": "get_weather",
           "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "description": "The city, e.g. Paris"},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city"], "additionalProperties": False}}
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
ASK = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(stages, smollm2):
    from dgr.serve.app import create_app
    from dgr.serve.templates import ChatTemplate

    served = Served(create_app(AsyncRoute([w.address for w in stages]), model=NAME,
                               template=ChatTemplate.from_gguf(smollm2)))
    yield served.openai(timeout=120)
    served.stop()


def test_text_streamed_and_not(client):
    r = client.responses.create(model=NAME, instructions=INSTRUCTIONS, input=ASK,
                                max_output_tokens=24, temperature=0, store=False)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output_text.strip() and [o.type for o in r.output] == ["message"]
    assert r.usage.output_tokens <= 24 and r.usage.input_tokens > 10
    stream = client.responses.create(model=NAME, instructions=INSTRUCTIONS, input=ASK,
                                     max_output_tokens=24, temperature=0, store=False,
                                     stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.completed" if r.status == "completed"
                         else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text


def test_a_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {
        "city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"], "additionalProperties": False}
    r = client.responses.create(model=NAME, input=ASK, max_output_tokens=96, temperature=0,
                                store=False,
                                text={"format": {"type": "json_schema", "name": "place",
                                                 "schema": schema, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)


def test_a_forced_function_call_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    r = client.responses.create(model=NAME, input=ask, tools=[WEATHER],
                                tool_choice="required", max_output_tokens=96,
                                temperature=0, store=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    # streamed: the arguments' deltas add up to the same call
    events = list(client.responses.create(model=NAME, input=ask, tools=[WEATHER],
                                          tool_choice="required", max_output_tokens=96,
                                          temperature=0, store=False, stream=True))
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert json.loads(deltas) == args
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [args]
    # the output goes back: the answer is text
    history = ask + [o.model_dump(exclude_none=True) for o in r.output] + [
        {"type": "function_call_output", "call_id": calls[0].call_id,
         "output": "22 degrees and sunny"}]
    answer = client.responses.create(model=NAME, input=history, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=32,
                                     temperature=0, store=False)
    assert [o.type for o in answer.output] == ["message"] and answer.output_text.strip()


def test_nothing_is_stored(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAME, input=ASK, max_output_tokens=8, store=True)
    assert "store" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=NAME, input=ASK, max_output_tokens=8, store=False,
                                previous_response_id="resp_123")
    assert "previous_response_id" in str(e.value)
