"""Every request field of the OpenAI chat completions and completions API references, and
what the front does with it: honoured, or refused with a 400 that names it.

A field dgr does not honour is accepted only at the value that asks for nothing (absent,
``null``, its default, an empty list); any other value is refused, never silently ignored.
llama-server's ``top_k``, ``min_p``, ``repeat_penalty``, ``repeat_last_n``, ``grammar``,
``json_schema`` and ``reasoning_format`` are honoured as it means them. A field that is in none of these is refused
as OpenAI refuses it ("Unrecognized request argument supplied"). docs/serve.md has the
table; tests/unit/test_serve_fields.py walks it.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["CHAT", "COMPLETIONS", "HONOURED", "refusal"]

#: a field whose every valid value is honoured (its checks are the request parser's)
HONOURED = None


def _absent(v: Any) -> bool:
    return v is None


def _false(v: Any) -> bool:
    return v is None or v is False


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {} or v == ""


def _one_of(*ok: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == o and type(v) is type(o) for o in ok)


def _no_function_call(v: Any) -> bool:
    return v is None or v == "none"


# name -> None (honoured) or a test of the values accepted though not honoured, and why not
_COMMON: dict[str, tuple[Callable[[Any], bool], str] | None] = {
    "model": HONOURED, "max_tokens": HONOURED, "temperature": HONOURED, "top_p": HONOURED,
    "seed": HONOURED, "stop": HONOURED, "stream": HONOURED, "stream_options": HONOURED,
    "logprobs": HONOURED, "n": HONOURED,
    # identifiers of the end user: logged with the request's id
    "user": HONOURED,
    # added to the token's logit before sampling, greedy included (llama-server's meaning)
    "logit_bias": HONOURED,
    # llama-server's meaning: over the last repeat_last_n tokens (64), the prompt's included
    "frequency_penalty": HONOURED, "presence_penalty": HONOURED,
    # llama-server's own sampling fields (not in OpenAI's reference), as it means them
    "top_k": HONOURED, "min_p": HONOURED, "repeat_penalty": HONOURED, "repeat_last_n": HONOURED,
    # constrained output: llama-server's GBNF grammar and JSON schema fields
    "grammar": HONOURED, "json_schema": HONOURED,
}

#: POST /v1/chat/completions
CHAT: dict[str, tuple[Callable[[Any], bool], str] | None] = {
    **_COMMON, "messages": HONOURED, "max_completion_tokens": HONOURED,
    "top_logprobs": HONOURED, "safety_identifier": HONOURED,
    # tools, tool_choice (auto, none, required, a named function), parallel_tool_calls: the
    # model's own template renders them and its own format is parsed back (dgr.serve.chat)
    "tools": HONOURED, "tool_choice": HONOURED, "parallel_tool_calls": HONOURED,
    # llama-server's: whether the reasoning of a thinking model comes back apart
    # (message.reasoning_content) or inline in the content
    "reasoning_format": HONOURED,
    # the template's reasoning switch (dgr.serve.chat: none off, minimal/low/medium capped
    # at EFFORT_BUDGETS tokens), llama-server's template variables (enable_thinking, ...),
    # and the most tokens the reasoning takes (the front closes it: dgr.serve.generation)
    "reasoning_effort": HONOURED, "chat_template_kwargs": HONOURED, "reasoning_budget": HONOURED,
    "functions": (_empty, "functions (deprecated: tools) are not supported"),
    "function_call": (_no_function_call, "function_call (deprecated: tool_choice) is not "
                                       "supported"),
    # json_object and json_schema: the output follows the schema (dgr.protocol.grammar)
    "response_format": HONOURED,
    "modalities": (_one_of(["text"]), "this model answers in text only"),
    "audio": (_absent, "audio output is not supported"),
    "prediction": (_absent, "predicted outputs are not supported"),
    "verbosity": (_absent, "verbosity is not supported"),
    "web_search_options": (_absent, "web search is not supported"),
    "store": (_false, "stored completions are not supported"),
    "metadata": (_empty, "metadata is kept only with 'store', which is not supported"),
    "service_tier": (_one_of("auto", "default"), "this route serves one tier: 'auto' or "
                                                 "'default'"),
    "prompt_cache_key": (_absent, "prompt_cache_key is not supported yet"),
    "prompt_cache_retention": (_absent, "prompt_cache_retention is not supported yet"),
}

#: POST /v1/completions
COMPLETIONS: dict[str, tuple[Callable[[Any], bool], str] | None] = {
    **_COMMON, "prompt": HONOURED, "echo": HONOURED,
    "best_of": (_one_of(1), "best_of must be 1 (one choice per request)"),
    "suffix": (_empty, "suffix (insertion) is not supported"),
}

#: stream_options' keys
STREAM_OPTIONS: dict[str, tuple[Callable[[Any], bool], str] | None] = {
    "include_usage": HONOURED,
    "include_obfuscation": (_false, "stream obfuscation is not supported"),
}


def refusal(body: dict, table: dict, prefix: str = "") -> tuple[str, str, str] | None:
    """The first field of ``body`` ``table`` does not accept at its value, as ``(name,
    message, code)``; None when every field is accepted."""
    for key, value in body.items():
        name = prefix + str(key)
        if key not in table:
            return name, f"Unrecognized request argument supplied: {name}", \
                "unrecognized_argument"
        rule = table[key]
        if rule is not None and not rule[0](value):
            return name, f"Unsupported parameter: '{name}': {rule[1]}", "unsupported_parameter"
    opts = body.get("stream_options")
    if isinstance(opts, dict) and not prefix:
        return refusal(opts, STREAM_OPTIONS, "stream_options.")
    return None
