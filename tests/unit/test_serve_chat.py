"""Tools and reasoning on the chat endpoint (dgr.serve.chat): llama.cpp's own chat code, through
the binding, renders real templates of the pinned tree (tests/data/chat_templates, copied from
its models/templates) and parses each family's tool calls and reasoning as its
tests/test-chat.cpp expects; streamed diffs add up to the whole message; bad tool fields are
400s naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dgr.serve.api_errors import ApiError
from dgr.serve.chat import NativeChat, Reply, ToolAsk, tool_ask
from dgr.serve.templates import ChatTemplate

pytest.importorskip("dgr._chat._chat")

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"

SPECIAL = {"type": "function", "function": {
    "name": "special_function", "description": "I'm special",
    "parameters": {"type": "object", "properties": {"arg1": {"type": "integer"}},
                   "required": ["arg1"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"]}}}
USER = [{"role": "user", "content": "Hey there!"}]


def _template(name: str, bos: str = "<s>", eos: str = "</s>") -> ChatTemplate:
    return ChatTemplate(source=(TEMPLATES / f"{name}.jinja").read_text(), bos_token=bos,
                        eos_token=eos, add_bos=False, name=name)


def _native(name: str, **kw) -> NativeChat:
    return NativeChat(_template(name, **kw))


def _parse(native: NativeChat, text: str, ask: ToolAsk, messages=USER) -> dict:
    r = Reply(native.render(messages, ask), stream=False)
    r.feed(text, final=True)
    return r.openai_message()


def _streamed(native: NativeChat, text: str, ask: ToolAsk, step: int = 1) -> dict:
    """The message the OpenAI deltas of ``text`` fed ``step`` characters at a time add up to,
    as a client reassembles them."""
    r = Reply(native.render(USER, ask), stream=True)
    out = {"content": "", "reasoning_content": "", "tool_calls": []}
    deltas = []
    for i in range(0, len(text), step):
        deltas += r.feed(text[i:i + step])
    deltas += r.feed("", final=True)
    for d in deltas:
        out["content"] += d.get("content", "")
        out["reasoning_content"] += d.get("reasoning_content", "")
        for c in d.get("tool_calls", []):
            if c["index"] == len(out["tool_calls"]):
                assert "id" in c and c["function"]["name"], c  # the first delta names it
                out["tool_calls"].append({"id": c["id"], "name": c["function"]["name"],
                                          "arguments": ""})
            out["tool_calls"][c["index"]]["arguments"] += c["function"]["arguments"]
    return out


def _calls(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []]


TOOLS = ToolAsk(tools=(SPECIAL,), choice="auto")


@pytest.mark.parametrize("name, text", [
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
     '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>'),
    ("Qwen-Qwen2.5-7B-Instruct",
     '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>'),
    ("mistralai-Mistral-Nemo-Instruct-2407",
     '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, '
     '"id": "123456789"}]'),
    ("meta-llama-Llama-3.1-8B-Instruct",
     '{"name": "special_function", "parameters": {"arg1": 1}}'),
])
def test_each_familys_tool_call_is_parsed_and_its_stream_adds_up(name, text):
    native = _native(name)
    m = _parse(native, text, TOOLS)
    assert _calls(m) == [("special_function", {"arg1": 1})]
    assert m["content"] is None and m["tool_calls"][0]["type"] == "function"
    assert m["tool_calls"][0]["id"]
    s = _streamed(native, text, TOOLS)
    assert [(c["name"], json.loads(c["arguments"])) for c in s["tool_calls"]] == _calls(m)
    assert s["content"] == ""


def test_the_template_renders_the_tools_and_the_tool_messages():
    """Hermes's template puts the tools' schemas in the prompt, and an assistant call and a
    tool result in the history, in its own markup."""
    native = _native("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use")
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    r = native.render(history, ToolAsk(tools=(WEATHER,), choice="auto"))
    assert "<tools>" in r.prompt and '"get_weather"' in r.prompt
    assert "<tool_call>" in r.prompt and "Paris" in r.prompt
    assert "<tool_response>" in r.prompt and "22 C, sunny" in r.prompt
    assert r.prompt.endswith("<|im_start|>assistant\n")
    plain = native.render(USER, ToolAsk())
    assert "get_weather" not in plain.prompt


def test_content_before_a_call_and_plain_content():
    native = _native("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use")
    text = ('Hello, world!\nWhat\'s up?<tool_call>\n'
            '{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>')
    m = _parse(native, text, TOOLS)
    assert m["content"] == "Hello, world!\nWhat's up?"
    assert _calls(m) == [("special_function", {"arg1": 1})]
    assert _streamed(native, text, TOOLS, step=3)["content"] == m["content"]
    plain = _parse(native, "Just words.", TOOLS)
    assert plain == {"role": "assistant", "content": "Just words."}


def test_two_calls_in_parallel():
    native = _native("Qwen-Qwen2.5-7B-Instruct")
    ask = ToolAsk(tools=(SPECIAL, WEATHER), choice="auto", parallel=True)
    text = ('<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    m = _parse(native, text, ask)
    assert _calls(m) == [("special_function", {"arg1": 1}), ("get_weather", {"city": "Oslo"})]
    assert len({c["id"] for c in m["tool_calls"]}) == 2
    s = _streamed(native, text, ask, step=2)
    assert [c["name"] for c in s["tool_calls"]] == ["special_function", "get_weather"]
    # parallel_tool_calls false: one call, streamed and not (auto has no grammar to stop a
    # second; it is not sent)
    one = ToolAsk(tools=(SPECIAL, WEATHER), choice="auto", parallel=False)
    assert _calls(_parse(native, text, one)) == [("special_function", {"arg1": 1})]
    assert [c["name"] for c in _streamed(native, text, one, step=2)["tool_calls"]] == \
        ["special_function"]


def test_reasoning_comes_apart_from_the_content():
    """A thinking template (DeepSeek R1, Qwen 3): <think>...</think> is the reasoning,
    streamed as reasoning_content deltas; reasoning_format none leaves it in the content."""
    # R1's template opens the <think> itself (its generation prompt ends with it)
    for name, opened in (("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", ""),
                         ("Qwen-Qwen3-0.6B", "<think>")):
        native = _native(name)
        assert native.thinking and native.wanted(ToolAsk())
        text = opened + "I'm\nthinking</think>Hello, world!\nWhat's up?"
        m = _parse(native, text, ToolAsk())
        assert m["content"] == "Hello, world!\nWhat's up?", name
        # (R1's parse keeps the newline its generation prompt leaves after <think>)
        assert m["reasoning_content"].strip() == "I'm\nthinking", name
        s = _streamed(native, text, ToolAsk(), step=4)
        assert (s["content"], s["reasoning_content"]) == (m["content"],
                                                          m["reasoning_content"])
        inline = _parse(native, text, ToolAsk(reasoning_format="none"))
        assert "thinking" in inline["content"] and "reasoning_content" not in inline
    assert not _native("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use").thinking


def test_gpt_oss_harmony_channels():
    native = _native("openai-gpt-oss-120b", bos="<|startoftext|>", eos="<|return|>")
    m = _parse(native, "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant"
                       "<|channel|>final<|message|>Hello, world!\nWhat's up?", ToolAsk())
    assert m["content"] == "Hello, world!\nWhat's up?"
    assert m["reasoning_content"] == "I'm\nthinking"


def _accepts(grammar: str, text: str) -> bool:
    """Whether llguidance's ``grammar`` takes ``text`` whole (on a byte vocabulary)."""
    import llguidance as llg

    class Bytes:
        eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
        tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]

        def __call__(self, text: bytes) -> list[int]:
            return list(text)

    m = llg.LLMatcher(llg.LLTokenizer(llg.TokenizerWrapper(Bytes())), grammar)
    b = list(text.encode())
    return m.try_consume_tokens(b) == len(b) and m.is_accepting()


def test_required_and_a_named_function_get_a_grammar_auto_does_not():
    """required: llama.cpp's tool-call grammar, compiled by llguidance, starting where the
    template's generation prompt ends; it takes a call and refuses plain text. auto: its
    grammar is lazy, not applied (parsed only)."""
    native = _native("Qwen-Qwen2.5-7B-Instruct")
    req = native.render(USER, ToolAsk(tools=(SPECIAL, WEATHER), choice="required"))
    assert req.grammar and "special_function" in req.grammar and req.format_name != "generic"
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert _accepts(req.grammar, call)  # with the generation prompt first, it would not
    assert not _accepts(req.grammar, "Let me look.\n" + call)  # calls only
    assert not _accepts(req.grammar, "It is sunny.")
    assert _accepts(req.grammar, call + "\n" + call)  # parallel_tool_calls (the default)
    one = native.render(USER, ToolAsk(tools=(SPECIAL, WEATHER), choice="required",
                                      parallel=False))
    assert _accepts(one.grammar, call) and not _accepts(one.grammar, call + "\n" + call)
    assert not _accepts(req.grammar, call.replace("get_weather", "get_time"))
    auto = native.render(USER, ToolAsk(tools=(SPECIAL,), choice="auto"))
    assert auto.grammar == ""
    named = tool_ask({"tools": [SPECIAL, WEATHER],
                      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.choice == "required" and [t["function"]["name"] for t in named.tools] == \
        ["get_weather"]
    g = native.render(USER, named).grammar
    assert "get_weather" in g and "special_function" not in g


def test_a_required_call_the_native_grammar_cannot_force_gets_the_generic_format():
    """gpt-oss's tool-call grammar starts past the prompt's special tokens, which llguidance
    does not take as text: the generic format's schema forces the call instead (never a
    required call left to chance); a template that calls tools but does not describe them
    (DeepSeek R1's) keeps its own format where nothing is forced."""
    gpt = _native("openai-gpt-oss-120b", bos="<|startoftext|>", eos="<|return|>")
    r = gpt.render(USER, ToolAsk(tools=(SPECIAL,), choice="required"))
    assert r.format_name == "generic" and "special_function" in r.prompt
    assert _accepts(r.grammar, '{"tool_calls": [{"name": "special_function", '
                               '"arguments": {"arg1": 1}}]}')
    assert not _accepts(r.grammar, '{"response": "hi"}')
    r1 = _native("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")
    assert r1.render(USER, ToolAsk(tools=(SPECIAL,), choice="auto")).format_name != "generic"


def test_the_generic_formats_history_and_a_schema_it_cannot_follow():
    """A template without tools: the history's calls and results become JSON text (a
    malformed assistant ``tool_calls`` is not a 500), the instruction names the key the
    schema wants, and parameters llguidance cannot follow are a 400 naming tools."""
    native = NativeChat(ChatTemplate(source=CHATML, name="chatml"))
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "special_function", "arguments": '{"arg1": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
        {"role": "assistant", "content": "ok", "tool_calls": ["junk"]}]
    r = native.render(history, ToolAsk(tools=(SPECIAL,), choice="auto", parallel=False))
    assert r.format_name == "generic" and "`tool_call`" in r.prompt
    assert '{"tool_call": {"name": "special_function", "arguments": {"arg1": 1}' in r.prompt
    assert '"tool_response": {"tool_call_id": "c1", "content": "done"}' in r.prompt
    assert _accepts(r.grammar, '{"response": "hi"}')
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    with pytest.raises(ApiError) as e:
        native.render(USER, ToolAsk(tools=(bad,), choice="required"))
    assert e.value.status == 400 and e.value.param == "tools"


def test_the_generic_formats_response_streams_as_it_is_written():
    """The generic format's ``{"response": "..."}`` streams its string as the model writes it
    (llama.cpp heals the partial JSON the same way), an escape only once whole; the deltas
    add up to the whole reply's content; a reply cut by max_tokens keeps the string written
    so far; calls still come whole, and text that is no such JSON is content."""
    native = NativeChat(ChatTemplate(source=CHATML, name="chatml"))
    ask = ToolAsk(tools=(SPECIAL,), choice="auto")
    body = '{"response": "Hi \\"you\\",\\n caf\\u00e9 \\ud83d\\ude00 \\\\ done"}'
    want = json.loads(body)["response"]
    for step in (1, 2, 5):
        r = Reply(native.render(USER, ask), stream=True)
        deltas, at = [], []
        for i in range(0, len(body), step):
            got = r.feed(body[i:i + step])
            deltas += got
            at += [i] * len(got)
        deltas += r.feed("", final=True)
        assert "".join(d.get("content", "") for d in deltas) == want, step
        assert at and at[0] < 20 and r.openai_message()["content"] == want
    cut = Reply(native.render(USER, ask), stream=True)
    parts = cut.feed('{"response": "Hello wor') + cut.feed('ld\\', final=True)
    assert "".join(d["content"] for d in parts) == "Hello world"
    assert cut.openai_message()["content"] == "Hello world"
    call = '{"tool_calls": [{"name": "special_function", "arguments": {"arg1": 1}}]}'
    r = Reply(native.render(USER, ask), stream=True)
    assert [r.feed(c) for c in call] == [[]] * len(call)
    (d,) = r.feed("", final=True)
    assert d["tool_calls"][0]["function"]["name"] == "special_function"
    assert _parse(native, "plain words", ask)["content"] == "plain words"


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("body, param", [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "colour": 1}}]}, "tools"),
    ({"tools": [SPECIAL, SPECIAL]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [SPECIAL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [SPECIAL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [SPECIAL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"reasoning_format": "verbose"}, "reasoning_format"),
    ({"reasoning_effort": "maximal"}, "reasoning_effort"),
    ({"reasoning_effort": ["low"]}, "reasoning_effort"),  # (unhashable: a TypeError once)
    ({"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}},
     "reasoning_effort"),
    ({"reasoning_budget": 0}, "reasoning_budget"),
    ({"reasoning_budget": 8, "reasoning_effort": "none"}, "reasoning_budget"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs"),
])
def test_bad_tool_fields_are_400s_naming_them(body, param):
    with pytest.raises(ApiError) as e:
        tool_ask(body)
    assert e.value.status == 400 and e.value.param == param


def test_defaults():
    assert tool_ask({}) == ToolAsk()
    a = tool_ask({"tools": [SPECIAL]})
    assert (a.choice, a.parallel, a.calls) == ("auto", True, True)
    assert not tool_ask({"tools": [SPECIAL], "tool_choice": "none"}).calls


def test_a_template_llama_cpp_cannot_read_is_a_typed_error():
    from dgr import errors

    with pytest.raises(errors.ChatTemplateError):
        NativeChat(ChatTemplate(source="{% if %}", name="broken"))


def test_reasoning_effort_is_the_templates_switch_and_a_budget():
    """OpenAI's reasoning_effort: none turns the template's thinking off, minimal/low/medium
    cap it (EFFORT_BUDGETS), high does not; a template that reads reasoning_effort itself
    (gpt-oss) is given it; chat_template_kwargs and reasoning_budget set the same."""
    from dgr.serve.chat import EFFORT_BUDGETS

    off = tool_ask({"reasoning_effort": "none"})
    assert (off.thinking, off.reasoning_budget, not off.asks_reasoning) == (False, None, True)
    assert dict(off.template_kwargs) == {"enable_thinking": False, "reasoning_effort": "none"}
    for effort in ("minimal", "low", "medium"):
        a = tool_ask({"reasoning_effort": effort})
        assert (a.thinking, a.reasoning_budget) == (True, EFFORT_BUDGETS[effort])
    high = tool_ask({"reasoning_effort": "high"})
    assert (high.thinking, high.reasoning_budget, high.asks_reasoning) == (True, None, True)
    assert tool_ask({"reasoning_effort": "low", "reasoning_budget": 64}).reasoning_budget == 64
    kw = tool_ask({"chat_template_kwargs": {"enable_thinking": False, "x": 1}})
    assert kw.thinking is False and dict(kw.template_kwargs) == {"enable_thinking": False,
                                                                 "x": 1}
    assert tool_ask({}).thinking is None and not tool_ask({}).asks_reasoning


def test_a_reasoning_budget_closes_the_reasoning_with_the_templates_tag():
    """The cap (dgr.serve.chat.ThinkingCap) of R1's template, which opens <think> in its
    generation prompt, and of Qwen 3's, where the model opens it."""
    r1 = _native("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")
    qwen = _native("Qwen-Qwen3-0.6B")
    msgs = [{"role": "user", "content": "Hi"}]
    cap = r1.render(msgs, tool_ask({"reasoning_budget": 4})).cap
    assert (cap.budget, cap.start, cap.ends, cap.opened) == (4, "<think>", ("</think>",), True)
    assert cap.close_text == "\n</think>\n\n"
    assert not cap.over("I am", 3) and cap.over("I am thinking", 4)
    assert not cap.over("I am</think>Hello", 9)  # closed already
    q = qwen.render(msgs, tool_ask({"reasoning_budget": 4})).cap
    assert not q.opened and not q.over("Hello there, friend", 5)  # it never thought
    assert q.over("<think>hmm, well", 5)
    assert r1.render(msgs, tool_ask({})).cap is None
    # tools on R1 (its template renders none): the generic JSON format, which has no
    # reasoning to cap, so a budget is refused rather than ignored
    with pytest.raises(ApiError) as e:
        r1.render(msgs, tool_ask({"tools": [SPECIAL], "tool_choice": "required",
                                  "reasoning_budget": 4}))
    assert e.value.param == "reasoning_budget"
    # thinking off: the template closes the reasoning in the prompt
    off = r1.render(msgs, tool_ask({"reasoning_effort": "none"}))
    assert off.prompt.endswith("</think>") and off.cap is None
