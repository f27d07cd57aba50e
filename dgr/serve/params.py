"""What a completion request asks for, parsed and checked: every field of the API
references honoured or refused (``dgr.serve.fields``), every bad value a 400 naming it."""

from __future__ import annotations

import copy
import dataclasses
import uuid
from typing import Any

from dgr import errors
from dgr.protocol.grammar import compile_grammar
from dgr.protocol.sampling import SamplingParams
from dgr.serve import fields
from dgr.serve.api_errors import ApiError
from dgr.serve.logprobs import MAX_TOP_CHAT, MAX_TOP_COMPLETIONS

__all__ = ["Params", "MAX_STOP_CHARS", "MAX_CHOICES", "PENALTY_LAST_N"]

#: the longest stop string (characters): each token's text is checked against every prefix
#: of every stop string, so a longer one would hold the event loop of every request
MAX_STOP_CHARS = 256
#: the most choices (``n``) one request may ask for
MAX_CHOICES = 16


def _field(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds:
        raise ApiError(400, f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}",
                       param=name)
    if not isinstance(v, kinds):
        raise ApiError(400, f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got "
                            f"{type(v).__name__}", param=name)
    return v


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys) to a bias in [-100, 100],
    added to the token's logit before sampling (greedy included), as llama-server does."""
    bias = _field(body, "logit_bias", (dict,), {})
    out = []
    for k, v in bias.items():
        try:
            tid = int(k)
        except ValueError:
            tid = -1
        if tid < 0 or str(tid) != k.strip():
            raise ApiError(400, f"'logit_bias' keys are token ids, got {k!r}",
                           param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise ApiError(400, f"'logit_bias' values are numbers in [-100, 100], got {v!r} "
                                f"for token {k}", param="logit_bias")
        out.append((tid, float(v)))
    return tuple(sorted(out))


def _grammar(body: dict) -> str:
    """The grammar the output follows ("": none): chat's ``response_format`` (``json_object``:
    any JSON object; ``json_schema``: its ``schema``), or llama-server's ``json_schema`` (a
    schema) or ``grammar`` (GBNF); one of them at most. A schema or grammar llguidance
    rejects is a 400 naming the field."""
    asked = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object",
                                                             "json_schema"):
            raise ApiError(400, "'response_format' must be {'type': 'text'}, {'type': "
                                "'json_object'} or {'type': 'json_schema', 'json_schema': {...}}",
                           param="response_format")
        if rf["type"] == "json_object":
            asked.append(("response_format", "json_schema", {"type": "object"}))
        elif rf["type"] == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("name"), str):
                raise ApiError(400, "'response_format.json_schema' must be an object with a "
                                    "'name'", param="response_format")
            schema = js.get("schema", {"type": "object"})
            if not isinstance(schema, dict):
                raise ApiError(400, "'response_format.json_schema.schema' must be an object",
                               param="response_format")
            asked.append(("response_format", "json_schema", schema))
    if body.get("json_schema") is not None:
        if not isinstance(body["json_schema"], dict):
            raise ApiError(400, "'json_schema' must be a JSON schema object",
                           param="json_schema")
        asked.append(("json_schema", "json_schema", body["json_schema"]))
    if body.get("grammar") is not None and body.get("grammar") != "":
        if not isinstance(body["grammar"], str):
            raise ApiError(400, "'grammar' must be a GBNF grammar string", param="grammar")
        asked.append(("grammar", "gbnf", body["grammar"]))
    if len(asked) > 1:
        raise ApiError(400, f"only one of {', '.join(a[0] for a in asked)} may be given",
                       param=asked[1][0])
    if not asked:
        return ""
    name, fmt, text = asked[0]
    try:
        return compile_grammar(fmt, text)
    except errors.InvalidArgument as e:
        raise ApiError(400, f"'{name}': {e}", param=name, code="invalid_grammar") from None


#: llama-server's default penalty window (``repeat_last_n``)
PENALTY_LAST_N = 64


def _number(body: dict, name: str, lo: float, hi: float, default: float,
            integer: bool = False) -> float:
    v = _field(body, name, (int,) if integer else (int, float), default)
    if not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must be in [{lo:g}, {hi:g}], got {v}", param=name)
    return v


def _llama_sampling(body: dict) -> dict:
    """The penalties (OpenAI's ``presence_penalty`` and ``frequency_penalty`` in [-2, 2],
    llama-server's ``repeat_penalty`` and ``repeat_last_n``), ``top_k`` and ``min_p``, with
    llama-server's meanings and defaults (a window of the last 64 tokens, the prompt's
    included; ``repeat_last_n`` -1: the whole context; 0: no penalties)."""
    last_n = int(_number(body, "repeat_last_n", -1, 2**31 - 1, PENALTY_LAST_N, integer=True))
    return dict(
        presence_penalty=float(_number(body, "presence_penalty", -2.0, 2.0, 0.0)),
        frequency_penalty=float(_number(body, "frequency_penalty", -2.0, 2.0, 0.0)),
        repeat_penalty=float(_number(body, "repeat_penalty", 1e-6, 1e6, 1.0)),
        penalty_last_n=2**31 - 1 if last_n == -1 else last_n,
        top_k=int(_number(body, "top_k", 0, 2**31 - 1, 0, integer=True)),
        min_p=float(_number(body, "min_p", 0.0, 1.0, 0.0)))


class Params:
    """What a completion request asks for, checked (every bad field a 400 naming it)."""

    def __init__(self, body: dict, *, chat: bool):
        # every field is in the endpoint's API reference, and honoured at its value
        refused = fields.refusal(body, fields.CHAT if chat else fields.COMPLETIONS)
        if refused is not None:
            name, message, code = refused
            raise ApiError(400, message, param=name, code=code)
        self.stream = bool(_field(body, "stream", (bool,), False))
        #: the end user's identifiers (logged with the request's id)
        self.user = {k: body[k] for k in ("user", "safety_identifier")
                     if isinstance(body.get(k), str)}
        #: completions: the prompt's text comes before the completion's
        self.echo = bool(_field(body, "echo", (bool,), False)) if not chat else False
        opts = _field(body, "stream_options", (dict,), {})
        self.include_usage = bool(opts.get("include_usage", False))
        if self.include_usage and not self.stream:  # OpenAI refuses it too
            raise ApiError(400, "'stream_options.include_usage' needs 'stream': true",
                           param="stream_options")
        n = _field(body, "n", (int,), 1)
        if not 1 <= n <= MAX_CHOICES:
            raise ApiError(400, f"'n' must be from 1 to {MAX_CHOICES}, got {n}", param="n")
        #: choices: the prompt prefilled once, each choice on a fork of its session, choice
        #: ``i`` sampled with ``seed + i`` (``choice``)
        self.n = n
        self.max_tokens = _max_tokens(body, chat)
        self.sampling = _sampling(body)
        self.stop = _stop(body)
        self.logprobs, self.top_logprobs = _logprobs(body, chat)
        if self.echo and self.logprobs:
            raise ApiError(400, "Unsupported parameter: 'echo' with 'logprobs' (the prompt's "
                                "log probabilities) is not supported",
                           param="echo", code="unsupported_parameter")

    def choice(self, i: int) -> Params:
        """These parameters for choice ``i``: its own seed stream, ``seed + i`` (a request
        with ``n`` choices and seed ``s`` gives choice ``i`` as a request with seed
        ``s + i`` alone)."""
        if not i:
            return self
        out = copy.copy(self)
        out.sampling = dataclasses.replace(
            self.sampling, seed=(int(self.sampling.seed) + i) & 0xFFFFFFFFFFFFFFFF)
        return out


def _max_tokens(body: dict, chat: bool) -> int | None:
    """The completion's budget (None: chat's default, the rest of the context)."""
    for name in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        v = _field(body, name, (int,))
        if v is not None:
            if v < 1:  # OpenAI's answer to 0 or less
                raise ApiError(400, f"Invalid '{name}': integer below minimum value. "
                                    f"Expected a value >= 1, but got {v} instead.",
                               param=name, code="integer_below_min_value")
            return v
    return None if chat else 16  # the OpenAI completions default


def _sampling(body: dict) -> SamplingParams:
    temperature = float(_field(body, "temperature", (int, float), 1.0))
    top_p = float(_field(body, "top_p", (int, float), 1.0))
    seed = _field(body, "seed", (int,), None)
    if not 0.0 <= temperature <= 2.0:
        raise ApiError(400, f"'temperature' must be in [0, 2], got {temperature}",
                       param="temperature")
    if not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    return SamplingParams(
        temperature=temperature, top_p=top_p, logit_bias=_logit_bias(body),
        grammar=_grammar(body), **_llama_sampling(body),
        # OpenAI's seed is any int64; the wire's is a uint64 (two's complement kept)
        seed=(seed & 0xFFFFFFFFFFFFFFFF) if seed is not None
        else uuid.uuid4().int & 0x7FFFFFFF)


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        out: list[str] = []
    elif isinstance(stop, str):
        out = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        out = [s for s in stop if s]
    else:
        raise ApiError(400, "'stop' must be a string or a list of at most 4 strings",
                       param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in out):
        raise ApiError(400, f"a stop string is at most {MAX_STOP_CHARS} characters",
                       param="stop")
    return out


def _logprobs(body: dict, chat: bool) -> tuple[bool, int]:
    """(whether the log probabilities come back, how many alternatives per token)."""
    if chat:
        # chat: "logprobs": bool, "top_logprobs": 0..20 alternatives (needs logprobs)
        want = bool(_field(body, "logprobs", (bool,), False))
        top = _field(body, "top_logprobs", (int,), None)
        if top is not None and not want:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if top is not None and not 0 <= top <= MAX_TOP_CHAT:
            raise ApiError(400, f"'top_logprobs' must be in [0, {MAX_TOP_CHAT}], got {top}",
                           param="top_logprobs")
        return want, top or 0
    # completions: "logprobs": 0..5, the number of alternatives (null: none)
    top = _field(body, "logprobs", (int,), None)
    if top is not None and not 0 <= top <= MAX_TOP_COMPLETIONS:
        raise ApiError(400, f"'logprobs' must be in [0, {MAX_TOP_COMPLETIONS}], got {top}",
                       param="logprobs")
    return top is not None, top or 0
