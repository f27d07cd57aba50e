"""Tools and reasoning on the chat endpoint, as llama-server does them.

The model's own chat template renders the tools, and the model's own format is parsed back
out of its text, by llama.cpp's chat code in the pinned tree (``common/chat``, through the
binding ``dgr._chat``): Hermes/Qwen, Llama 3.x, Mistral, DeepSeek, gpt-oss harmony, and every
other format llama-server knows, with a generic JSON format for templates that know no tools.

- ``tool_choice`` ``auto``: the model may call a tool; its text is parsed after each piece.
  llama.cpp's grammar for ``auto`` is lazy (it starts at a trigger word); dgr does not apply
  it, so a call the model writes badly comes back as content rather than as a call.
- ``required``, and a named function (the tools cut to that one, then ``required``): the
  output follows the tool-call grammar llama.cpp makes for the template, from its first
  token (the template's generation prompt, which it starts with, cut off), calls only.
  Where that grammar does not fit llguidance (gpt-oss's starts past special tokens), or
  llama.cpp makes none, the generic format below forces the call instead.
- A template that knows no tools (SmolLM2's; llama.cpp's chat code would drop the tools):
  llama.cpp's former generic format. The tools and an instruction go into the system
  message and the reply is JSON under a schema: ``{"tool_call": ...}`` or
  ``{"tool_calls": [...]}``, or with ``auto`` ``{"response": "..."}``.
- ``parallel_tool_calls`` (default true, OpenAI's): whether the grammar and the template
  allow more than one call.
- A template that thinks (``<think>`` ...): the reasoning comes back apart, in
  ``message.reasoning_content`` (llama-server's ``reasoning_format`` ``auto``; ``none``
  leaves it in the content). Whether it thinks is the template's reasoning switch
  (``enable_thinking``), set by OpenAI's ``reasoning_effort`` (``none`` off; ``minimal``,
  ``low`` and ``medium`` cap the reasoning at ``EFFORT_BUDGETS`` tokens, ``high`` and
  ``xhigh`` do not), by llama-server's ``chat_template_kwargs`` (passed to the template as
  they are), and by ``reasoning_budget`` (the most tokens the reasoning takes: the front
  then closes it itself, ``dgr.serve.generation``). A template with no reasoning refuses a
  request to think, or to cap it, with a 400.

A template the binding cannot read, or messages it refuses, is a 400 naming ``messages``.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

from dgr import errors
from dgr.protocol.grammar import compile_grammar
from dgr.serve.api_errors import ApiError

__all__ = ["ToolAsk", "NativeChat", "Rendered", "Reply", "ThinkingCap", "tool_ask",
           "REASONING_FORMATS", "EFFORT_BUDGETS"]

log = logging.getLogger("dgr.serve")

#: llama-server's ``reasoning_format`` values
REASONING_FORMATS = ("auto", "none", "deepseek", "deepseek-legacy")
#: OpenAI's ``reasoning_effort`` values: each one's cap on the reasoning's tokens (None: none;
#: 0: no reasoning). A template that reads ``reasoning_effort`` itself (gpt-oss's harmony)
#: is given the value too.
EFFORT_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": None,
                  "xhigh": None}
#: OpenAI's rule for a function's name
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolAsk:
    """What a chat request asks about tools and reasoning (``tool_ask``)."""

    tools: tuple = ()
    #: "auto", "none" or "required" (a named function is "required" over that one tool)
    choice: str = "none"
    parallel: bool = True
    reasoning_format: str = "auto"
    #: the template's reasoning switch (``enable_thinking``): None leaves it at the
    #: template's default (on)
    thinking: bool | None = None
    #: the most tokens the reasoning may take (None: no cap)
    reasoning_budget: int | None = None
    #: further template variables (llama-server's ``chat_template_kwargs``), as pairs
    template_kwargs: tuple = ()

    @property
    def asks_reasoning(self) -> bool:
        """Whether the request asks the template to think, or caps its thinking (a template
        that has no reasoning refuses either)."""
        return self.thinking is True or self.reasoning_budget is not None

    @property
    def calls(self) -> bool:
        """Whether the model may call a tool."""
        return bool(self.tools) and self.choice != "none"


def _tool(i: int, t: Any) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function" or \
            not isinstance(t.get("function"), dict):
        raise ApiError(400, f"'{where}' must be {{'type': 'function', 'function': {{...}}}}",
                       param="tools")
    f = t["function"]
    name = f.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(400, f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or "
                            f"'-', got {name!r}", param="tools")
    if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
        raise ApiError(400, f"'{where}.function.parameters' must be a JSON schema object",
                       param="tools")
    if f.get("description") is not None and not isinstance(f["description"], str):
        raise ApiError(400, f"'{where}.function.description' must be a string", param="tools")
    unknown = set(f) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise ApiError(400, f"'{where}.function' has unknown keys {sorted(unknown)}",
                       param="tools")
    return t


def tool_ask(body: dict) -> ToolAsk:
    """The request's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
    ``reasoning_format``, checked (each bad value a 400 naming it)."""
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of tools", param="tools")
    tools = [_tool(i, t) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ApiError(400, f"'tools' names the function '{dup}' twice", param="tools")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        f = choice.get("function")
        if choice.get("type") != "function" or not isinstance(f, dict) or \
                not isinstance(f.get("name"), str):
            raise ApiError(400, "'tool_choice' must be 'none', 'auto', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}",
                           param="tool_choice")
        if f["name"] not in names:
            raise ApiError(400, f"'tool_choice' names the function '{f['name']}', which is "
                                "not in 'tools'", param="tool_choice")
        tools = [t for t in tools if t["function"]["name"] == f["name"]]
        choice = "required"
    elif choice not in ("none", "auto", "required"):
        raise ApiError(400, "'tool_choice' must be 'none', 'auto', 'required' or "
                            "{'type': 'function', 'function': {'name': ...}}",
                       param="tool_choice")
    if choice != "none" and not tools:
        raise ApiError(400, "'tool_choice' is only allowed when 'tools' are specified",
                       param="tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean",
                       param="parallel_tool_calls")
    rf = body.get("reasoning_format")
    if rf is None:
        rf = "auto"
    if rf not in REASONING_FORMATS:
        raise ApiError(400, f"'reasoning_format' must be one of {list(REASONING_FORMATS)}, "
                            f"got {rf!r}", param="reasoning_format")
    thinking, budget, kwargs = _reasoning(body)
    return ToolAsk(tools=tuple(tools), choice=choice,
                   parallel=True if parallel is None else parallel, reasoning_format=rf,
                   thinking=thinking, reasoning_budget=budget,
                   template_kwargs=tuple(sorted(kwargs.items())))


def _reasoning(body: dict) -> tuple[bool | None, int | None, dict]:
    """``(thinking, reasoning budget, template variables)`` of a chat request's
    ``reasoning_effort``, ``chat_template_kwargs`` and ``reasoning_budget``."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ApiError(400, "'chat_template_kwargs' must be an object of template variables",
                       param="chat_template_kwargs")
    kwargs = dict(kwargs)
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise ApiError(400, "'chat_template_kwargs.enable_thinking' must be a boolean",
                       param="chat_template_kwargs")
    budget = body.get("reasoning_budget")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)
                               or budget < 1):
        raise ApiError(400, f"'reasoning_budget' must be a positive integer, got {budget!r}",
                       param="reasoning_budget")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str) or effort not in EFFORT_BUDGETS:
            raise ApiError(400, f"'reasoning_effort' must be one of {list(EFFORT_BUDGETS)}, "
                                f"got {effort!r}", param="reasoning_effort")
        cap = EFFORT_BUDGETS[effort]
        if thinking is not None and thinking != (cap != 0):
            raise ApiError(400, f"'reasoning_effort' {effort!r} and "
                                f"'chat_template_kwargs.enable_thinking' {thinking} disagree",
                           param="reasoning_effort")
        thinking = cap != 0
        if cap:
            budget = cap if budget is None else min(budget, cap)
        kwargs.setdefault("reasoning_effort", effort)
    if thinking is False and budget is not None:
        raise ApiError(400, "a reasoning budget is for a request that thinks; this one turns "
                            "thinking off", param="reasoning_budget")
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    return thinking, budget, kwargs


@dataclass(frozen=True)
class Rendered:
    """A chat request rendered by llama.cpp's chat code."""

    prompt: str
    #: tokenize ``prompt`` with ``add_special`` (the vocabulary adds BOS itself)
    add_bos: bool
    #: llguidance's grammar the output follows ("": none)
    grammar: str
    #: text that ends the generation besides the request's ``stop`` (the format's own)
    stops: tuple[str, ...]
    #: the parser's settings (``Reply``)
    parser: dict
    format_name: str
    #: the request's cap on the reasoning (``ThinkingCap``; None: none)
    cap: ThinkingCap | None = None


@dataclass(frozen=True)
class ThinkingCap:
    """A reasoning budget: once a reply has made ``budget`` tokens and its reasoning is still
    open, the front ends the reasoning itself, with the template's own end tag
    (``close_text``), and generates the answer after it (``dgr.serve.generation``)."""

    budget: int
    start: str            # the template's thinking start tag
    ends: tuple           # its end tags
    opened: bool          # the generation prompt opened the reasoning (R1's "<think>\n")

    def over(self, text: str, n_tokens: int) -> bool:
        """Whether a reply of ``n_tokens`` tokens, ``text`` so far, is past the budget with
        its reasoning open."""
        if n_tokens < self.budget:
            return False
        return (self.opened or self.start in text) and not any(e in text for e in self.ends)

    @property
    def close_text(self) -> str:
        return "\n" + self.ends[0] + "\n\n"


class NativeChat:
    """A model's chat template (``dgr.serve.templates.ChatTemplate``) in llama.cpp's chat
    code. Raises ``dgr.errors.CoreNotBuilt`` without the binding, and ``ChatTemplateError``
    for a template it cannot read."""

    def __init__(self, template):
        from dgr._chat import ChatTemplate as _Native

        try:
            self._t = _Native(template.source, template.tool_use, template.bos_token,
                              template.eos_token, template.add_bos, template.add_eos)
            probe = self._t.apply({"messages": [{"role": "user", "content": "Hi"}]})
        except (RuntimeError, ValueError) as e:
            raise errors.ChatTemplateError(
                f"llama.cpp's chat code cannot use the chat template of {template.name}: "
                f"{e}") from None
        self.template = template
        self.add_bos = bool(template.add_bos)
        #: the template thinks (its reasoning is parsed apart from the content)
        self.thinking = bool(probe.get("supports_thinking"))
        self.caps: dict = self._t.caps()

    def wanted(self, ask: ToolAsk) -> bool:
        """Whether a request renders here (tools, or a thinking template) rather than with
        the plain template (``ChatTemplate.render_prompt``)."""
        return bool(ask.tools) or self.thinking

    def render(self, messages: list, ask: ToolAsk) -> Rendered:
        if ask.tools and not (self.caps.get("supports_tools") or
                              self.caps.get("supports_tool_calls")):
            return self._generic(messages, ask)
        req = {"messages": messages, "tools": list(ask.tools), "tool_choice": ask.choice,
               "parallel_tool_calls": ask.parallel and ask.choice != "none",
               "reasoning_format": ask.reasoning_format, "add_generation_prompt": True,
               "enable_thinking": ask.thinking is not False,
               "chat_template_kwargs": dict(ask.template_kwargs)}
        try:
            out = self._t.apply(req)
        except (RuntimeError, ValueError) as e:
            raise ApiError(400, f"the messages could not be rendered with the model's chat "
                                f"template: {e}", param="messages",
                           code="ChatTemplateError") from None
        grammar = ""
        if out["grammar"] and ask.calls and not out["grammar_lazy"]:
            grammar = _llguidance_of(out["grammar"], out["generation_prompt"], ask.parallel)
            if not grammar:
                log.info("the tool-call grammar of %s does not fit llguidance: the generic "
                         "format forces the call", self.template.name)
        if ask.choice == "required" and not grammar:
            # llama.cpp forces no call here (its grammar is lazy or none), or its grammar
            # does not fit llguidance (it starts past the prompt's special tokens, or does
            # not compile): the generic format's schema forces it, rather than a required
            # call left to chance
            return self._generic(messages, ask)
        parser = {"format": out["format"], "reasoning_format": ask.reasoning_format,
                  "generation_prompt": out["generation_prompt"], "parser": out["parser"],
                  "parse_tool_calls": ask.calls, "parallel": ask.parallel}
        return Rendered(prompt=out["prompt"], add_bos=self.add_bos, grammar=grammar,
                        stops=tuple(s for s in out["additional_stops"] if s),
                        parser=parser,
                        format_name=out["format_name"], cap=_cap(out, ask))

    def _generic(self, messages: list, ask: ToolAsk) -> Rendered:
        """A template that knows no tools (SmolLM2's): llama.cpp's former generic format.
        The tools and the instruction to answer in JSON go into the system message, the
        history's calls and results into JSON text, and the output follows a JSON schema:
        ``{"tool_call": ...}`` (``{"tool_calls": [...]}`` with ``parallel_tool_calls``) or,
        unless a call is required, ``{"response": "..."}``."""
        if ask.reasoning_budget is not None:
            # the reply is one JSON object under a schema: no reasoning to end at a budget
            raise ApiError(400, "a reasoning budget cannot be kept with tools on this model: "
                                "its template renders no tools, and the generic tool format's "
                                "JSON reply has no reasoning", param="reasoning_budget",
                           code="unsupported_parameter")
        msgs = _generic_messages(messages, ask)
        try:
            text, add_bos = self.template.render_prompt(msgs, add_generation_prompt=True,
                                                        **dict(ask.template_kwargs))
        except errors.DgrError as e:
            raise ApiError(400, str(e), param="messages", code=type(e).__name__) from None
        try:
            grammar = compile_grammar("json_schema", _generic_schema(ask)) if ask.calls else ""
        except errors.InvalidArgument as e:  # a tool's parameters: the client's schema
            raise ApiError(400, f"'tools': a function's parameters are not a schema the "
                                f"output can follow: {e}", param="tools",
                           code="invalid_grammar") from None
        return Rendered(prompt=text, add_bos=add_bos, grammar=grammar, stops=(),
                        parser={"generic": ask.calls},
                        format_name="generic")


def _cap(out: dict, ask: ToolAsk) -> ThinkingCap | None:
    """The reasoning budget of a request rendered as ``out`` (None without one)."""
    ends = tuple(e for e in out.get("thinking_end_tags", ()) if e)
    start = out.get("thinking_start_tag") or ""
    if ask.reasoning_budget is None or not ends or not start:
        return None
    gp = out.get("generation_prompt") or ""
    opened = gp.rfind(start) > max(gp.rfind(e) for e in ends)
    return ThinkingCap(ask.reasoning_budget, start, ends, opened)


#: llama.cpp's instruction of its generic tool format (``{key}``: ``tool_call``, or
#: ``tool_calls`` with ``parallel_tool_calls``)
GENERIC_INSTRUCTION = ("Respond in JSON format, either with `{key}` (a request to call "
                       "tools) or with `response` reply to the user's request")


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _generic_call(c: dict) -> dict:
    f = c.get("function") or {}
    args = f.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass
    return {"name": f.get("name", ""), "arguments": args, "id": c.get("id", "")}


def _generic_messages(messages: list, ask: ToolAsk) -> list:
    """The history as a template without tools renders it (``NativeChat._generic``)."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise ApiError(400, "each message must be an object", param="messages")
        role = m.get("role")
        calls = [_generic_call(c) for c in m.get("tool_calls") or [] if isinstance(c, dict)] \
            if role == "assistant" and isinstance(m.get("tool_calls"), list) else []
        if calls:
            body = {"tool_calls": calls} if ask.parallel or len(calls) > 1 \
                else {"tool_call": calls[0]}
            out.append({"role": "assistant", "content": json.dumps(body, ensure_ascii=False)})
        elif role == "tool":
            out.append({"role": "user", "content": json.dumps(
                {"tool_response": {"tool_call_id": m.get("tool_call_id", ""),
                                   "content": _text_of(m.get("content"))}},
                ensure_ascii=False)})
        elif role == "assistant" and ask.calls:
            out.append({"role": "assistant", "content": json.dumps(
                {"response": _text_of(m.get("content"))}, ensure_ascii=False)})
        else:
            out.append(m)
    if ask.calls:
        tools = json.dumps([t["function"] for t in ask.tools], indent=2, ensure_ascii=False)
        key = "tool_calls" if ask.parallel else "tool_call"
        note = f"You can call these tools:\n{tools}\n\n{GENERIC_INSTRUCTION.format(key=key)}"
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": _text_of(out[0].get("content")) + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def _generic_schema(ask: ToolAsk) -> dict:
    calls = [{"type": "object", "additionalProperties": False,
              "properties": {"name": {"type": "string", "const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"]} for t in ask.tools]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if ask.parallel:
        call = {"type": "object", "additionalProperties": False, "required": ["tool_calls"],
                "properties": {"tool_calls": {"type": "array", "items": one, "minItems": 1}}}
    else:
        call = {"type": "object", "additionalProperties": False, "required": ["tool_call"],
                "properties": {"tool_call": one}}
    if ask.choice == "required":
        return call
    return {"anyOf": [call, {"type": "object", "additionalProperties": False,
                             "required": ["response"],
                             "properties": {"response": {"type": "string"}}}]}


def _gbnf_literal(text: str) -> str:
    return '"' + "".join({"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r",
                          "\t": "\\t"}.get(c, c) for c in text) + '"'


def _llguidance_of(gbnf: str, generation_prompt: str, parallel: bool) -> str:
    """llguidance's grammar of llama.cpp's tool-call grammar ``gbnf``, starting at the first
    sampled token; "" when it does not fit. llama.cpp's format grammars start with the
    generation prompt (``root ::= "<|im_start|>assistant\\n" ...``), which its sampler is fed
    first; here that literal is cut off the root rule instead, since the prompt's special
    tokens are not text to llguidance. A root that does not start so does not fit."""
    if generation_prompt:
        head = "root ::= " + _gbnf_literal(generation_prompt)
        lines = gbnf.split("\n")
        at = next((i for i, line in enumerate(lines) if line.startswith(head) and
                   line[len(head):len(head) + 1] in (" ", "")), None)
        if at is None:
            return ""
        lines[at] = "root ::= " + (lines[at][len(head):].strip() or '""')
        gbnf = "\n".join(lines)
    try:
        return compile_grammar("gbnf", _calls_only(gbnf, parallel=parallel))
    except errors.InvalidArgument as e:
        log.info("llguidance refuses a tool-call grammar: %s", e)
        return ""


#: an optional run of text before the calls in a root rule (llama.cpp's ``until`` rules)
_TEXT_FIRST = re.compile(r"\s+until-\d+\?(?=\s)")


#: a run of one or more calls (``tool-calls ::= (tool-call space)+``)
_MANY = re.compile(r"^tool-calls ::= (\(.*\))\+$")


def _calls_only(gbnf: str, parallel: bool) -> str:
    """llama.cpp's tool-call grammar without the optional text it lets come before the calls
    (``root ::= space until-161? tool-calls``): a required call is the reply's start, as
    OpenAI's ``required`` means (and as vLLM forces it). The ``until`` rules match text a
    byte at a time, which is too costly for llguidance's masks on a real vocabulary.
    Without ``parallel``, one call: llama.cpp's grammars let a format's call blocks repeat
    whatever ``parallel_tool_calls`` says."""
    lines = gbnf.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("root ::= "):
            lines[i] = _TEXT_FIRST.sub("", line + " ").rstrip()
        elif not parallel and _MANY.match(line):
            lines[i] = _MANY.sub(r"tool-calls ::= \1", line)
    return "\n".join(lines)


def _delta(d: dict) -> dict:
    """OpenAI's ``delta`` of one of llama.cpp's message diffs."""
    out: dict = {}
    if d["reasoning_content_delta"]:
        out["reasoning_content"] = d["reasoning_content_delta"]
    if d["content_delta"]:
        out["content"] = d["content_delta"]
    i = d["tool_call_index"]
    if i >= 0:
        c = d["tool_call"]
        call: dict = {"index": i}
        if c["name"]:  # the call's first delta: its id and name
            call.update(id=c["id"], type="function",
                        function={"name": c["name"], "arguments": c["arguments"]})
        else:
            call["function"] = {"arguments": c["arguments"]}
        out["tool_calls"] = [call]
    return out


#: the generic format's reply that is content: its string starts after this
_RESPONSE = re.compile(r'\s*\{\s*"response"\s*:\s*"')

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}


def _string_prefix(text: str) -> str:
    """What a JSON string's body ``text`` (after its opening quote) says so far: up to its
    closing quote, or its end less an escape not yet whole (a high surrogate waits for its
    pair)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            break
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= n:
            break
        e = text[i + 1]
        if e != "u":
            out.append(_ESCAPES.get(e, e))
            i += 2
            continue
        if i + 6 > n:
            break
        try:
            u = int(text[i + 2:i + 6], 16)
        except ValueError:
            break
        if 0xD800 <= u < 0xDC00:  # a high surrogate: its low half follows
            if i + 12 > n:
                break
            try:
                lo = int(text[i + 8:i + 12], 16) if text[i + 6:i + 8] == "\\u" else -1
            except ValueError:
                lo = -1
            if 0xDC00 <= lo < 0xE000:
                out.append(chr(0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00)))
                i += 12
                continue
        out.append(chr(u))
        i += 6
    return "".join(out)


class Reply:
    """One reply's text parsed as it grows: content, reasoning and tool calls."""

    def __init__(self, rendered: Rendered, *, stream: bool):
        #: the request's reasoning budget (``ThinkingCap``; None: none)
        self.cap = rendered.cap
        self._text = ""
        self.message: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
        p = dict(rendered.parser)
        #: the generic format (a JSON reply, parsed whole); None: not generic
        self._generic = p.get("generic")
        if self._generic is not None:
            return
        from dgr._chat import ChatParser

        #: without parallel_tool_calls, one call at most (``auto`` has no grammar to stop a
        #: second; a forced call's grammar allows one)
        self._parallel = p.pop("parallel", True)
        # llama-server's: deepseek-legacy leaves the reasoning inline while streaming
        p["reasoning_in_content"] = stream and p["reasoning_format"] == "deepseek-legacy"
        self._p = ChatParser(p)

    def _content(self, content: str) -> list[dict]:
        """The message's content set to ``content``, which extends what was sent: the delta."""
        done = self.message["content"]
        self.message = {**self.message, "content": content}
        return [{"content": content[len(done):]}] if len(content) > len(done) else []

    def _feed_generic(self, final: bool) -> list[dict]:
        """The generic format: plain content, or (with tools) one JSON reply: a
        ``{"response": "..."}`` streams its string as it is written (as llama.cpp heals a
        partial reply), calls come whole; text that is not such JSON comes back as
        content."""
        if not self._generic:  # tools given but tool_choice none: the text is the content
            return self._content(self._text)
        head = _RESPONSE.match(self._text)
        if not final:
            return self._content(_string_prefix(self._text[head.end():])) if head else []
        try:
            body = json.loads(self._text)
        except json.JSONDecodeError:
            body = None
        if head and not (isinstance(body, dict) and isinstance(body.get("response"), str)):
            # cut short (max_tokens): the string written so far
            return self._content(_string_prefix(self._text[head.end():]))
        calls = body.get("tool_calls") if isinstance(body, dict) else None
        if isinstance(body, dict) and isinstance(body.get("tool_call"), dict):
            calls = [body["tool_call"]]
        if isinstance(calls, list) and calls and all(isinstance(c, dict) for c in calls):
            tc = [{"id": "call_" + uuid.uuid4().hex[:24], "name": str(c.get("name", "")),
                   "arguments": json.dumps(c.get("arguments", {}), ensure_ascii=False)}
                  for c in calls]
            self.message = {**self.message, "tool_calls": tc}
            return [{"tool_calls": [{"index": i, "id": c["id"], "type": "function",
                                     "function": {"name": c["name"],
                                                  "arguments": c["arguments"]}}]}
                    for i, c in enumerate(tc)]
        content = body["response"] if isinstance(body, dict) and \
            isinstance(body.get("response"), str) else self._text
        return self._content(content)

    def feed(self, text: str, *, final: bool = False) -> list[dict]:
        """Append ``text`` (``final``: the reply is whole) and return the OpenAI deltas of
        what changed. Text the format cannot parse when whole comes back as content."""
        self._text += text
        if self._generic is not None:
            return self._feed_generic(final)
        try:
            r = self._p.update(text, not final)
        except (RuntimeError, ValueError) as e:
            if not final:
                return []
            log.warning("the reply does not parse in its chat format (%s): sent as content", e)
            done = self.message["content"]
            self.message = {"content": self._text, "reasoning_content": "", "tool_calls": []}
            rest = self._text[len(done):] if self._text.startswith(done) else ""
            return [{"content": rest}] if rest else []
        m = r["message"]
        diffs = r["diffs"]
        if not self._parallel:  # one call: what the model writes past it is not sent
            m = {**m, "tool_calls": m["tool_calls"][:1]}
            diffs = [d for d in diffs if d["tool_call_index"] < 1]
        self.message = m
        return [d for d in map(_delta, diffs) if d]

    def openai_message(self) -> dict:
        """The whole reply as OpenAI's assistant ``message``."""
        m = self.message
        calls = [{"id": c["id"], "type": "function",
                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in m["tool_calls"]]
        out: dict = {"role": "assistant",
                     "content": m["content"] if m["content"] or not calls else None}
        if m["reasoning_content"]:
            out["reasoning_content"] = m["reasoning_content"]
        if calls:
            out["tool_calls"] = calls
        return out

    @property
    def called(self) -> bool:
        return bool(self.message["tool_calls"])
