"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the
front's chat pipeline (docs/serve.md "Anthropic Messages").

A Messages request is translated into the chat completions body the front already serves
(``to_chat``): the same admission, API keys and per-key caps, metrics, sessions, prompt cache,
chat template, tools and grammar. Only the shapes differ: the answer as Anthropic's message
(``message``), its stream as Anthropic's typed events (``events``), and errors as Anthropic's
``{"type": "error", "error": {"type", "message"}}`` (``error_body``). A field the API
reference has and dgr does not honour is refused by name, never ignored.
"""

from __future__ import annotations

import json
import uuid
from typing import AsyncIterator

from starlette.responses import JSONResponse

from dgr.serve.api_errors import ApiError, mid_stream
from dgr.serve.generation import Generation, deltas

__all__ = ["to_chat", "message", "events", "error_body", "error_response", "HONOURED"]


#: the request fields dgr honours (anything else is a 400 naming it)
HONOURED = frozenset({"model", "max_tokens", "messages", "system", "stop_sequences", "stream",
                      "temperature", "top_p", "top_k", "tools", "tool_choice", "metadata",
                      "output_config", "thinking", "cache_control"})
#: the fields of a count_tokens request dgr honours
_COUNTED = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking",
                      "cache_control"})
#: Anthropic's error type of each HTTP status (docs.anthropic.com, "Errors")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"),
                                       "message": e.message}}


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


def _cache_control(value, where: str) -> None:
    """A ``cache_control`` breakpoint, checked and taken as a hint: the front's prompt cache
    and the stages' prefix stores reuse every prefix by themselves (``usage`` says what a
    request read: ``cache_read_input_tokens``)."""
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") != "ephemeral" or \
            set(value) - {"type", "ttl"} or value.get("ttl", "5m") not in ("5m", "1h"):
        raise _bad(f"'{where}' must be {{'type': 'ephemeral'}} (with 'ttl' '5m' or '1h')",
                   where)


def _document(b: dict, where: str) -> str:
    """A ``document`` block's text: a ``text`` source, a ``base64`` one of ``text/plain``
    (UTF-8), or a ``content`` one of text blocks; its ``title`` and ``context`` lines before
    it. Any other source (a PDF, a URL, a file id) is a 400."""
    import base64
    import binascii

    src = b.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "text" and isinstance(src.get("data"), str) and \
            src.get("media_type", "text/plain") == "text/plain":
        text = src["data"]
    elif kind == "base64" and src.get("media_type") == "text/plain" and \
            isinstance(src.get("data"), str):
        try:
            text = base64.b64decode(src["data"], validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            raise _bad(f"'{where}.source.data' is not base64 of UTF-8 text", "messages") from None
    elif kind == "content":
        text = _text_of(src.get("content"), f"{where}.source.content")
    else:
        what = kind if kind != "base64" else f"base64 {src.get('media_type')!r}"
        raise _bad(f"'{where}': a document's source must be plain text ('text', 'content', or "
                   f"'base64' of 'text/plain'); this server reads no {what or 'untyped'} "
                   "documents", "messages")
    _cache_control(b.get("cache_control"), f"{where}.cache_control")
    head = [v for v in (b.get("title"), b.get("context")) if isinstance(v, str) and v]
    return "\n\n".join([*head, text])


def _text_of(content, where: str) -> str:
    """The text of a string or a list of text blocks (``system``, a tool result)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        for j, b in enumerate(content):
            _cache_control(b.get("cache_control"), f"{where}[{j}].cache_control")
        return "".join(b["text"] for b in content)
    raise _bad(f"'{where}' must be a string or a list of text blocks", where)


def _user(blocks: list, i: int) -> list[dict]:
    """A user turn's blocks as chat messages: each tool result a ``tool`` message (first, as
    Anthropic puts them), then the text."""
    out, text, parts = [], [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind is not None:
            _cache_control(b.get("cache_control"), f"messages[{i}].content[{j}].cache_control")
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "document":
            text.append(_document(b, f"messages[{i}].content[{j}]"))
        elif kind == "image":
            if text:  # the text before it, as one part
                parts.append({"type": "text", "text": "".join(text)})
                text = []
            parts.append(_image(b, f"messages[{i}].content[{j}]"))
        elif kind == "tool_result" and isinstance(b.get("tool_use_id"), str):
            content = _text_of(b.get("content", ""), f"messages[{i}].content[{j}].content")
            if b.get("is_error"):
                content = f"Error: {content}"
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": content})
        else:
            raise _bad(f"messages[{i}].content[{j}]: a user block is 'text', 'image', "
                       f"'document' or 'tool_result' (this server takes no "
                       f"{kind or 'untyped'} blocks)", "messages")
    if parts:  # with images: OpenAI content parts (dgr.serve.media takes them)
        out.append({"role": "user", "content": parts + (
            [{"type": "text", "text": "".join(text)}] if text else [])})
    elif text:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _image(b: dict, where: str) -> dict:
    """An ``image`` block as an OpenAI ``image_url`` part: a ``base64`` source as a data URL,
    a ``url`` one as its URL (fetched only from a host the operator allows)."""
    src = b.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64" and isinstance(src.get("data"), str) and \
            isinstance(src.get("media_type"), str):
        url = f"data:{src['media_type']};base64,{src['data']}"
    elif kind == "url" and isinstance(src.get("url"), str):
        url = src["url"]
    else:
        raise _bad(f"'{where}': an image's source is {{'type': 'base64', 'media_type': ..., "
                   "'data': ...}} or {'type': 'url', 'url': ...}", "messages")
    return {"type": "image_url", "image_url": {"url": url}}


def _assistant(blocks: list, i: int) -> dict:
    msg: dict = {"role": "assistant", "content": ""}
    calls, thinking = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind is not None:
            _cache_control(b.get("cache_control"), f"messages[{i}].content[{j}].cache_control")
        if kind == "text" and isinstance(b.get("text"), str):
            msg["content"] += b["text"]
        elif kind == "tool_use" and isinstance(b.get("id"), str) and \
                isinstance(b.get("name"), str) and isinstance(b.get("input"), dict):
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"])}})
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thinking.append(b["thinking"])
        else:
            raise _bad(f"messages[{i}].content[{j}]: an assistant block is 'text', 'tool_use' "
                       f"(with id, name and an input object) or 'thinking'", "messages")
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    return msg


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text_of(body["system"], "system")})
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise _bad(f"messages[{i}].role must be 'user' or 'assistant'", "messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += _user(content, i) if role == "user" else [_assistant(content, i)]
        else:
            raise _bad(f"messages[{i}].content must be a string or a list of blocks",
                       "messages")
    return out


def _tools(body: dict, chat: dict) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list", "tools")
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or \
                    not isinstance(t.get("input_schema"), dict) or \
                    t.get("type") not in (None, "custom"):
                raise _bad(f"tools[{i}] must be a client tool with a 'name' and an "
                           "'input_schema' object (this server runs no server tools)", "tools")
            _cache_control(t.get("cache_control"), f"tools[{i}].cache_control")
            fn = {"name": t["name"], "parameters": t["input_schema"]}
            if isinstance(t.get("description"), str):
                fn["description"] = t["description"]
            out.append({"type": "function", "function": fn})
        chat["tools"] = out
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise _bad("'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or "
                   "{'type': 'tool', 'name': ...}", "tool_choice")
    if choice.get("disable_parallel_tool_use") is not None:
        if not isinstance(choice["disable_parallel_tool_use"], bool):
            raise _bad("'tool_choice.disable_parallel_tool_use' must be a boolean",
                       "tool_choice")
        chat["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]


def _output_config(config, chat: dict) -> None:
    """Structured output: ``output_config.format`` (a JSON schema) as the chat body's
    ``response_format``, the text then valid JSON of that schema; ``effort`` is not honoured."""
    if config is None:
        return
    if not isinstance(config, dict) or set(config) - {"format", "effort"}:
        raise _bad("'output_config' takes 'format' (and 'effort', which this server does "
                   "not support)", "output_config")
    if config.get("effort") is not None:
        raise _bad("this server does not support 'output_config.effort'", "output_config")
    fmt = config.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or \
            not isinstance(fmt.get("schema"), dict) or set(fmt) - {"type", "schema"}:
        raise _bad("'output_config.format' must be {'type': 'json_schema', 'schema': {...}}",
                   "output_config")
    chat["response_format"] = {"type": "json_schema", "json_schema": {
        "name": "output", "schema": fmt["schema"], "strict": True}}


def _thinking(thinking, chat: dict, max_tokens: int | None) -> None:
    """``thinking`` as the template's reasoning switch: ``enabled`` (with ``budget_tokens``,
    the most tokens the reasoning takes, less than ``max_tokens``), ``adaptive`` (the model's
    own length) or ``disabled``. A template that does not think refuses the first two."""
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled" and set(thinking) == {"type"}:
        chat["chat_template_kwargs"] = {"enable_thinking": False}
        return
    if kind == "adaptive" and set(thinking) == {"type"}:
        chat["chat_template_kwargs"] = {"enable_thinking": True}
        return
    budget = thinking.get("budget_tokens") if kind == "enabled" else None
    if kind != "enabled" or set(thinking) - {"type", "budget_tokens"} or \
            not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise _bad("'thinking' must be {'type': 'enabled', 'budget_tokens': N}, "
                   "{'type': 'adaptive'} or {'type': 'disabled'}", "thinking")
    if max_tokens is not None and budget >= max_tokens:
        raise _bad(f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' "
                   f"({max_tokens})", "thinking")
    chat["chat_template_kwargs"] = {"enable_thinking": True}
    chat["reasoning_budget"] = budget


def to_chat(body: dict, *, count: bool = False) -> dict:
    """The chat completions body of a Messages request (``count``: a ``count_tokens`` request,
    which has no ``max_tokens``); an ``ApiError`` in the request's terms otherwise."""
    extra = sorted(set(body) - (_COUNTED if count else HONOURED))
    if extra:
        raise _bad(f"this server does not support the field '{extra[0]}'", extra[0])
    if not isinstance(body.get("model"), str):
        raise _bad("'model' is required", "model")
    chat: dict = {"model": body["model"], "messages": _messages(body)}
    _cache_control(body.get("cache_control"), "cache_control")
    _tools(body, chat)
    if count:
        _thinking(body.get("thinking"), chat, None)
        chat.pop("reasoning_budget", None)  # (nothing is generated)
        return chat
    mt = body.get("max_tokens")
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise _bad("'max_tokens' is required: a positive integer", "max_tokens")
    chat["max_tokens"] = mt
    _thinking(body.get("thinking"), chat, mt)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or \
                len(stops) > 4:
            raise _bad("'stop_sequences' must be a list of at most 4 strings",
                       "stop_sequences")
        chat["stop"] = stops
    for k in ("stream", "temperature", "top_p", "top_k"):
        if k in body:
            chat[k] = body[k]
    _output_config(body.get("output_config"), chat)
    meta = body.get("metadata")
    if meta is not None:
        if not isinstance(meta, dict) or set(meta) - {"user_id"} or \
                not isinstance(meta.get("user_id", ""), (str, type(None))):
            raise _bad("'metadata' takes only 'user_id', a string", "metadata")
        if meta.get("user_id"):
            chat["user"] = meta["user_id"]
    return chat


def _usage(gen: Generation) -> dict:
    return {"input_tokens": gen.n_prompt - gen.cached, "output_tokens": len(gen.tokens),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": gen.cached}


def _stop(gen: Generation, stops: list[str]) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence``: one of the request's ``stops`` that ended the
    text, else the generation's reason (a tool format's own stop strings end the turn)."""
    if gen.stop_string is not None and gen.stop_string in stops:
        return "stop_sequence", gen.stop_string
    return _STOP_REASONS[gen.finish], None


def _tool_id(call_id: str | None) -> str:
    """A ``tool_use`` block's id in Anthropic's spelling (``toolu_...``): the chat reply's
    call id with its OpenAI prefix (``call_``) replaced, the same in a stream's events and a
    whole message; a new one where the reply has none."""
    if not call_id:
        return "toolu_" + uuid.uuid4().hex[:24]
    if call_id.startswith("toolu_"):
        return call_id
    return "toolu_" + (call_id[5:] if call_id.startswith("call_") else call_id)


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def message(gen: Generation, text: str, mid: str, model: str, stops: list[str]) -> dict:
    """A whole answer as Anthropic's message (``stops``: the request's stop sequences)."""
    content: list[dict] = []
    if gen.reply is not None:
        gen.reply.feed(text, final=True)
        m = gen.reply.openai_message()
        if m.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": m["reasoning_content"],
                            "signature": ""})
        if m.get("content"):
            content.append({"type": "text", "text": m["content"]})
        for c in m.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": _tool_id(c.get("id")),
                            "name": c["function"]["name"],
                            "input": _input(c["function"]["arguments"])})
    elif text:
        content.append({"type": "text", "text": text})
    reason, seq = _stop(gen, stops)
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": _usage(gen)}


def _event(kind: str, data: dict) -> bytes:
    return (f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **data},
                                                          ensure_ascii=False).encode()
            + b"\n\n")


class _Blocks:
    """The content blocks of a streamed answer: OpenAI chat deltas in, Anthropic events out
    (a block starts when the kind of content changes, and stops before the next)."""

    def __init__(self):
        self.index, self.kind = -1, None

    def _open(self, kind: str, block: dict) -> list[bytes]:
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        return out + [_event("content_block_start", {"index": self.index,
                                                     "content_block": block})]

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def feed(self, piece: str | None, delta: dict | None) -> list[bytes]:
        out: list[bytes] = []
        if piece:
            delta = {"content": piece}
        for k, v in (delta or {}).items():
            if k == "content" and v:
                if self.kind != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(_event("content_block_delta", {
                    "index": self.index, "delta": {"type": "text_delta", "text": v}}))
            elif k == "reasoning_content" and v:
                if self.kind != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "",
                                                   "signature": ""})
                out.append(_event("content_block_delta", {
                    "index": self.index, "delta": {"type": "thinking_delta", "thinking": v}}))
            elif k == "tool_calls":
                for c in v:
                    fn = c.get("function") or {}
                    if fn.get("name"):  # a call's first delta: a new block
                        out += self._open("tool_use", {
                            "type": "tool_use", "id": _tool_id(c.get("id")),
                            "name": fn["name"], "input": {}})
                    if fn.get("arguments") and self.kind == "tool_use":
                        out.append(_event("content_block_delta", {
                            "index": self.index,
                            "delta": {"type": "input_json_delta",
                                      "partial_json": fn["arguments"]}}))
        return out


async def events(gen: Generation, mid: str, model: str, stops: list[str], endpoint: str, m
                 ) -> AsyncIterator[bytes]:
    """Anthropic's stream of one answer: ``message_start``, a ``ping``, each content block's
    ``content_block_start``, ``content_block_delta``s and ``content_block_stop``, then
    ``message_delta`` (stop reason, output tokens) and ``message_stop``; a failure mid-stream
    is an ``error`` event."""
    status = 200
    try:
        start = {"id": mid, "type": "message", "role": "assistant", "model": model,
                 "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {**_usage(gen), "output_tokens": 0}}
        yield _event("message_start", {"message": start})
        yield _event("ping", {})
        blocks = _Blocks()
        try:
            async for piece, delta in deltas(gen):
                for ev in blocks.feed(piece, delta):
                    yield ev
        except Exception as e:  # noqa: BLE001 - whatever failed, the client gets an error event
            err = mid_stream(e, mid)
            status = err.status
            yield _event("error", {"error": error_body(err)["error"]})
            return
        for ev in blocks.close():
            yield ev
        reason, seq = _stop(gen, stops)
        yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                       "usage": {"output_tokens": len(gen.tokens)}})
        yield _event("message_stop", {})
    finally:
        await gen.close()
        m.request(endpoint, status)
