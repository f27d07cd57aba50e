"""OpenAI's Responses API (``POST /v1/responses``), stateless, over the front's chat pipeline
(docs/serve.md "Responses").

A Responses request is translated into the chat completions body the front serves
(``to_chat``): the same admission, API keys and per-key caps, metrics, sessions, prompt cache,
chat template, tools and grammar. The answer is a ``response`` object whose ``output`` holds
reasoning, message and function-call items (``Output``), streamed as the API's typed events
(``events``). Nothing is stored: ``store: true`` and ``previous_response_id`` are refused with
a 400 that says so, as is every other field dgr does not honour.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from dgr.serve.api_errors import ApiError, mid_stream
from dgr.serve.generation import Generation, deltas

__all__ = ["to_chat", "Output", "response", "events", "HONOURED"]


#: the request fields dgr honours (anything else is a 400 naming it)
HONOURED = frozenset({"model", "input", "instructions", "tools", "tool_choice",
                      "parallel_tool_calls", "text", "max_output_tokens", "temperature",
                      "top_p", "stream", "store", "previous_response_id", "metadata", "user",
                      "reasoning"})


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _text(content, where: str) -> str:
    """A message's text: a string, or input/output text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
            and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _bad(f"{where}: content must be a string or a list of input_text/output_text parts "
               "(images as input_image parts of a user message; this server takes no "
               "files)", "input")


def _parts(content, where: str):
    """A user message's content: its text, or with ``input_image`` parts OpenAI chat content
    parts (``image_url``, which ``dgr.serve.media`` takes)."""
    if not (isinstance(content, list) and any(isinstance(p, dict) and
                                              p.get("type") == "input_image" for p in content)):
        return _text(content, where)
    out = []
    for j, p in enumerate(content):
        if isinstance(p, dict) and p.get("type") == "input_image":
            if not isinstance(p.get("image_url"), str) or p.get("file_id") is not None:
                raise _bad(f"{where}.content[{j}]: an input_image is {{'image_url': a data: URL "
                           "(or an http(s) URL of a host the server allows)}; this server "
                           "keeps no files (file_id)", "input")
            out.append({"type": "image_url", "image_url": {
                "url": p["image_url"], "detail": p.get("detail") or "auto"}})
        else:
            out.append({"type": "text", "text": _text([p], f"{where}.content[{j}]")})
    return out


class _Items:
    """Input items, in order, as chat messages."""

    def __init__(self):
        self.messages: list[dict] = []
        self._reasoning = ""  # a reasoning item's text, for the next assistant message

    def _assistant(self) -> dict:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        if self._reasoning:
            last["reasoning_content"], self._reasoning = self._reasoning, ""
        return last

    def add(self, item, i: int) -> None:
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in ("user", "system", "developer",
                                                      "assistant"):
            role = "system" if item["role"] == "developer" else item["role"]
            text = (_parts if role == "user" else _text)(item.get("content"), where)
            if role == "assistant":
                self._assistant()["content"] += text
            else:
                self.messages.append({"role": role, "content": text})
        elif kind == "function_call" and all(isinstance(item.get(k), str)
                                             for k in ("call_id", "name", "arguments")):
            self._assistant().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str) and \
                isinstance(item.get("output"), str):
            self.messages.append({"role": "tool", "tool_call_id": item["call_id"],
                                  "content": item["output"]})
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise _bad(f"{where}: a reasoning item's content must be a list", "input")
            self._reasoning += "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise _bad(f"{where}: an item is a message (role user, system, developer or "
                       "assistant), a function_call, a function_call_output or a reasoning "
                       "item", "input")


def _tools(body: dict, chat: dict) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list", "tools")
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function" or \
                    not isinstance(t.get("name"), str):
                raise _bad(f"tools[{i}] must be a function tool with a 'name' (this server "
                           "runs no built-in tools)", "tools")
            fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
            for k in ("description", "strict"):
                if t.get(k) is not None:
                    fn[k] = t[k]
            out.append({"type": "function", "function": fn})
        chat["tools"] = out
    choice = body.get("tool_choice")
    if choice is None:
        return
    if choice in ("auto", "none", "required"):
        chat["tool_choice"] = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise _bad("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', "
                   "'name': ...}", "tool_choice")


def _format(body: dict, chat: dict) -> None:
    """``text.format`` as the chat body's ``response_format``."""
    text = body.get("text")
    if text is None:
        return
    if not isinstance(text, dict) or set(text) - {"format"}:
        raise _bad("'text' takes only 'format' here", "text")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_schema" and \
            isinstance(fmt.get("schema"), dict):
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    else:
        raise _bad("'text.format' must be {'type': 'text'}, {'type': 'json_object'} or "
                   "{'type': 'json_schema', 'name': ..., 'schema': {...}}", "text")


def to_chat(body: dict) -> dict:
    """The chat completions body of a Responses request; an ``ApiError`` otherwise."""
    extra = sorted(set(body) - HONOURED)
    if extra:
        raise _bad(f"this server does not support the field '{extra[0]}'", extra[0])
    if body.get("store"):
        raise _bad("this server stores no responses: send 'store': false (and the whole "
                   "conversation as 'input')", "store")
    if body.get("previous_response_id") is not None:
        raise _bad("this server stores no responses, so 'previous_response_id' names none: "
                   "send the whole conversation as 'input'", "previous_response_id")
    if not isinstance(body.get("model"), str):
        raise _bad("'model' is required", "model")
    items = _Items()
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise _bad("'instructions' must be a string", "instructions")
        items.messages.append({"role": "system", "content": body["instructions"]})
    inp = body.get("input")
    if isinstance(inp, str):
        items.messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list) and inp:
        for i, item in enumerate(inp):
            items.add(item, i)
    else:
        raise _bad("'input' must be a string or a non-empty list of items", "input")
    chat: dict = {"model": body["model"], "messages": items.messages}
    _tools(body, chat)
    _format(body, chat)
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("stream", "stream"), ("user", "user"),
                     ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    _reasoning(body.get("reasoning"), chat)
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or len(meta) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise _bad("'metadata' must be an object of at most 16 string values", "metadata")
    return chat


def _reasoning(r, chat: dict) -> None:
    """``reasoning``: its ``effort`` as the chat body's ``reasoning_effort`` (the template's
    reasoning switch and budget: ``dgr.serve.chat``). This server writes no reasoning
    summaries: ``summary`` may be ``auto`` (the server's choice: none) or absent."""
    if r is None:
        return
    if not isinstance(r, dict) or set(r) - {"effort", "summary", "generate_summary"}:
        raise _bad("'reasoning' takes 'effort' and 'summary'", "reasoning")
    for k in ("summary", "generate_summary"):
        if r.get(k) not in (None, "auto"):
            raise _bad(f"this server writes no reasoning summaries: 'reasoning.{k}' may be "
                       "'auto' or absent", "reasoning")
    if r.get("effort") is not None:
        chat["reasoning_effort"] = r["effort"]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Output:
    """A response's output items as the reply grows: OpenAI chat deltas in, Responses stream
    events out (``feed``), and the items themselves (``items``)."""

    def __init__(self, gen: Generation):
        self.gen = gen
        self.items: list[dict] = []
        self.reasoning_tokens: int | None = None  # tokens made before the first answer delta
        self._open: dict | None = None

    def _start(self, item: dict) -> list[tuple[str, dict]]:
        out = self._close()
        self.items.append(item)
        self._open = item
        i = len(self.items) - 1
        out.append(("response.output_item.added", {"output_index": i, "item": _view(item)}))
        if item["type"] == "message":
            out.append(("response.content_part.added", {
                "item_id": item["id"], "output_index": i, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}))
        return out

    def _close(self) -> list[tuple[str, dict]]:
        item, self._open = self._open, None
        if item is None:
            return []
        i, iid = len(self.items) - 1, item["id"]
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [("response.output_text.done", {"item_id": iid, "output_index": i,
                                                   "content_index": 0, "text": part["text"],
                                                   "logprobs": []}),
                    ("response.content_part.done", {"item_id": iid, "output_index": i,
                                                    "content_index": 0, "part": part})]
        elif item["type"] == "function_call":
            out.append(("response.function_call_arguments.done", {
                "item_id": iid, "output_index": i, "name": item["name"],
                "arguments": item["arguments"]}))
        else:
            out.append(("response.reasoning_text.done", {
                "item_id": iid, "output_index": i, "content_index": 0,
                "text": item["content"][0]["text"]}))
        return out + [("response.output_item.done", {"output_index": i, "item": _view(item)})]

    def feed(self, piece: str | None, delta: dict | None) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        for k, v in ({"content": piece} if piece else delta or {}).items():
            if not v:
                continue
            if k != "reasoning_content" and self.reasoning_tokens is None:
                self.reasoning_tokens = len(self.gen.tokens) if self.items else 0
            if k == "content":
                if self._open is None or self._open["type"] != "message":
                    out += self._start({"type": "message", "id": _id("msg"),
                                        "status": "in_progress", "role": "assistant",
                                        "content": [{"type": "output_text", "text": "",
                                                     "annotations": [], "logprobs": []}]})
                self._open["content"][0]["text"] += v
                out.append(("response.output_text.delta", {
                    "item_id": self._open["id"], "output_index": len(self.items) - 1,
                    "content_index": 0, "delta": v, "logprobs": []}))
            elif k == "reasoning_content":
                if self._open is None or self._open["type"] != "reasoning":
                    out += self._start({"type": "reasoning", "id": _id("rs"), "summary": [],
                                        "status": "in_progress",
                                        "content": [{"type": "reasoning_text", "text": ""}]})
                self._open["content"][0]["text"] += v
                out.append(("response.reasoning_text.delta", {
                    "item_id": self._open["id"], "output_index": len(self.items) - 1,
                    "content_index": 0, "delta": v}))
            elif k == "tool_calls":
                out += self._calls(v)
        return out

    def _calls(self, calls: list[dict]) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        for c in calls:
            fn = c.get("function") or {}
            if fn.get("name"):  # a call's first delta: a new item
                out += self._start({"type": "function_call", "id": _id("fc"),
                                    "call_id": c.get("id") or _id("call"),
                                    "name": fn["name"], "arguments": "",
                                    "status": "in_progress"})
            if fn.get("arguments") and self._open is not None and \
                    self._open["type"] == "function_call":
                self._open["arguments"] += fn["arguments"]
                out.append(("response.function_call_arguments.delta", {
                    "item_id": self._open["id"], "output_index": len(self.items) - 1,
                    "delta": fn["arguments"]}))
        return out

    def finish(self) -> list[tuple[str, dict]]:
        if self.reasoning_tokens is None:
            self.reasoning_tokens = len(self.gen.tokens) if self.items else 0
        return self._close()


def _view(item: dict) -> dict:
    return json.loads(json.dumps(item))  # a copy: later deltas do not change a sent event


def response(gen: Generation, out: Output, rid: str, model: str, body: dict, chat: dict,
             created: float, *, done: bool = True) -> dict:
    """The ``response`` object: in progress (``done=False``) or finished."""
    incomplete = done and gen.finish == "length"
    usage = None
    if done:
        usage = {"input_tokens": gen.n_prompt,
                 "input_tokens_details": {"cached_tokens": gen.cached, "cache_write_tokens": 0},
                 "output_tokens": len(gen.tokens),
                 "output_tokens_details": {"reasoning_tokens": out.reasoning_tokens or 0},
                 "total_tokens": gen.n_prompt + len(gen.tokens)}
    choice = body.get("tool_choice", "auto")
    return {"id": rid, "object": "response", "created_at": created,
            "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
            "completed_at": time.time() if done else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
            "model": model, "output": [_view(i) for i in out.items] if done else [],
            "parallel_tool_calls": bool(chat.get("parallel_tool_calls", True)),
            # the values sampled with (the API's defaults where the request gave none)
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "tool_choice": choice, "tools": body.get("tools") or [],
            "max_output_tokens": body.get("max_output_tokens"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "previous_response_id": None, "store": False, "user": body.get("user"),
            "usage": usage}


def _event(kind: str, n: int, data: dict) -> bytes:
    return (f"event: {kind}\ndata: ".encode()
            + json.dumps({"type": kind, "sequence_number": n, **data},
                         ensure_ascii=False).encode() + b"\n\n")


async def events(gen: Generation, rid: str, model: str, body: dict, chat: dict,
                 endpoint: str, m) -> AsyncIterator[bytes]:
    """The Responses stream: ``response.created``, ``response.in_progress``, each item's
    events (added, deltas, done), then ``response.completed`` (``response.incomplete`` when
    cut at ``max_output_tokens``); a failure mid-stream is an ``error`` event."""
    status, n, created = 200, 0, time.time()
    out = Output(gen)
    try:
        for kind in ("response.created", "response.in_progress"):
            yield _event(kind, n, {"response": response(gen, out, rid, model, body, chat,
                                                        created, done=False)})
            n += 1
        try:
            async for piece, delta in deltas(gen):
                for kind, data in out.feed(piece, delta):
                    yield _event(kind, n, data)
                    n += 1
        except Exception as e:  # noqa: BLE001 - whatever failed, the client gets an error event
            err = mid_stream(e, rid)
            status = err.status
            yield _event("error", n, {"code": err.code, "message": err.message, "param": None})
            return
        for kind, data in out.finish():
            yield _event(kind, n, data)
            n += 1
        final = response(gen, out, rid, model, body, chat, created)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield _event(kind, n, {"response": final})
    finally:
        await gen.close()
        m.request(endpoint, status)
