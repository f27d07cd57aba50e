"""The OpenAI-compatible HTTP front of a route: an ASGI app (Starlette), docs/serve.md.

    from dgr.driver.route import AsyncRoute
    from dgr.serve.app import create_app
    app = create_app(AsyncRoute(["10.0.0.1:50051", "10.0.0.2:50051"]), model="smollm2")
    # uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints follow the OpenAI API reference: ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (``stream: true`` as server-sent events ending in ``data:
[DONE]``), ``GET /health`` and ``GET /metrics`` (Prometheus). Every error has the OpenAI shape
``{"error": {"message", "type", "param", "code"}}`` and its HTTP status: a malformed request
400, an unknown model 404, a prompt and completion longer than the context 400 naming both
lengths, every slot busy 429 with ``Retry-After`` once a request waited ``queue_timeout``
seconds, the route down 503. With API keys, a key with ``max_per_key`` generation requests in
flight gets a 429 for one more, without waiting and without holding anything.

An error a client sees names no path, endpoint or other internals: the route's and the
app's own failures answer a generic message with the request's id (also the ``X-Request-Id``
header), and the detail goes to the ``dgr.serve`` log under that id.

One route session per request, released on every stage when the request ends, however it
ends: a client that disconnects mid-stream cancels its generation, and the session is
released at once. Requests beyond the route's slots (the fewest any stage has) wait, at most
``queue_timeout`` seconds, for one to free.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import pathlib
import time
import uuid
from typing import Any, AsyncIterator

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount
from starlette.routing import Route as HttpRoute
from starlette.staticfiles import StaticFiles

from dgr import errors
from dgr.driver.text import TextStream
from dgr.protocol.grammar import compile_grammar
from dgr.protocol.sampling import SamplingParams
from dgr.serve import fields
from dgr.serve.auth import KEY_SCOPE, ApiKeys
from dgr.serve.logprobs import (
    MAX_TOP_CHAT,
    MAX_TOP_COMPLETIONS,
    chat_logprobs,
    completion_logprobs,
    token_logprob,
)

__all__ = ["create_app", "ApiError", "MAX_BODY", "MAX_STOP_CHARS", "per_key_default"]

log = logging.getLogger("dgr.serve")

#: the largest request body read (bytes); a larger one is a 413 before it is parsed
MAX_BODY = 8 << 20
#: the longest stop string (characters): each token's text is checked against every prefix
#: of every stop string, so a longer one would hold the event loop of every request
MAX_STOP_CHARS = 256
#: the status page's files (``GET /``, ``/static/...``), packaged with dgr
STATIC = pathlib.Path(__file__).with_name("static")


def per_key_default(capacity: int) -> int:
    """The default cap on one API key's generation requests in flight: half the route's
    slots (at least 1), so one key never takes every slot of a route with two or more."""
    return max(1, capacity // 2)


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP ``status``, ``type``, ``param`` and ``code``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}},
                            status_code=self.status, headers=self.headers)


def _from_dgr(e: errors.DgrError, rid: str) -> ApiError:
    """The HTTP status of a dgr error met while serving request ``rid``. The route's message
    may name endpoints, sessions or paths: it goes to the log, and the client gets a generic
    message with ``rid`` and the error's class as the code."""
    name = type(e).__name__
    log.warning("request %s: %s: %s", rid, name, e)
    if isinstance(e, errors.ResourceExhausted):
        return ApiError(429, f"the route has no room for this request now; retry later "
                             f"(request {rid})", type="rate_limit_error", code=name,
                        headers={"Retry-After": "1"})
    if isinstance(e, (errors.WorkerUnavailable, errors.StepDeadlineExceeded,
                      errors.RouteError, errors.ModelMismatch)):
        return ApiError(503, f"the route is unavailable; retry later (request {rid})",
                        type="server_error", code=name)
    if isinstance(e, (errors.InvalidArgument, errors.InvalidToken, errors.ContextFull,
                      errors.InvalidPosition)) or isinstance(e, ValueError):
        return ApiError(400, f"the route refused this request: {name} (request {rid})",
                        code=name)
    return ApiError(500, f"internal error (request {rid})", type="server_error",
                    code="internal_error")


# -- request fields ----------------------------------------------------------------------------

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
        self.include_usage = bool(opts.get("include_usage", False)) if self.stream else False
        n = _field(body, "n", (int,), 1)
        if n != 1:
            raise ApiError(400, f"'n' must be 1 (one choice per request), got {n}", param="n")
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        self.max_tokens = None
        for name in names:
            v = _field(body, name, (int,))
            if v is not None:
                if v < 1:  # OpenAI's answer to 0 or less
                    raise ApiError(400, f"Invalid '{name}': integer below minimum value. "
                                        f"Expected a value >= 1, but got {v} instead.",
                                   param=name, code="integer_below_min_value")
                self.max_tokens = v
                break
        if self.max_tokens is None and not chat:
            self.max_tokens = 16  # the OpenAI completions default
        temperature = float(_field(body, "temperature", (int, float), 1.0))
        top_p = float(_field(body, "top_p", (int, float), 1.0))
        seed = _field(body, "seed", (int,), None)
        if not 0.0 <= temperature <= 2.0:
            raise ApiError(400, f"'temperature' must be in [0, 2], got {temperature}",
                           param="temperature")
        if not 0.0 < top_p <= 1.0:
            raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
        self.sampling = SamplingParams(
            temperature=temperature, top_p=top_p, logit_bias=_logit_bias(body),
            grammar=_grammar(body),
            **_llama_sampling(body),
            # OpenAI's seed is any int64; the wire's is a uint64 (two's complement kept)
            seed=(seed & 0xFFFFFFFFFFFFFFFF) if seed is not None
            else uuid.uuid4().int & 0x7FFFFFFF)
        stop = body.get("stop")
        if stop is None:
            self.stop: list[str] = []
        elif isinstance(stop, str):
            self.stop = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
            self.stop = [s for s in stop if s]
        else:
            raise ApiError(400, "'stop' must be a string or a list of at most 4 strings",
                           param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ApiError(400, f"a stop string is at most {MAX_STOP_CHARS} characters",
                           param="stop")
        if chat:
            # chat: "logprobs": bool, "top_logprobs": 0..20 alternatives (needs logprobs)
            self.logprobs = bool(_field(body, "logprobs", (bool,), False))
            top = _field(body, "top_logprobs", (int,), None)
            if top is not None and not self.logprobs:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true",
                               param="top_logprobs")
            if top is not None and not 0 <= top <= MAX_TOP_CHAT:
                raise ApiError(400, f"'top_logprobs' must be in [0, {MAX_TOP_CHAT}], got {top}",
                               param="top_logprobs")
            self.top_logprobs = top or 0
        else:
            # completions: "logprobs": 0..5, the number of alternatives (null: none)
            top = _field(body, "logprobs", (int,), None)
            if top is not None and not 0 <= top <= MAX_TOP_COMPLETIONS:
                raise ApiError(400, f"'logprobs' must be in [0, {MAX_TOP_COMPLETIONS}], got "
                                    f"{top}", param="logprobs")
            self.logprobs = top is not None
            self.top_logprobs = top or 0
            if self.echo and self.logprobs:
                raise ApiError(400, "Unsupported parameter: 'echo' with 'logprobs' (the "
                                    "prompt's log probabilities) is not supported",
                               param="echo", code="unsupported_parameter")


# -- the app -----------------------------------------------------------------------------------

def create_app(route, *, model: str, template=None, queue_timeout: float = 2.0,
               metrics_registry=None, api_keys=None,
               max_per_key: int | None = None) -> Starlette:
    """The ASGI app serving ``route`` (an ``AsyncRoute``) as the model named ``model``.

    ``api_keys``: keys a request must present as ``Authorization: Bearer`` (strings or
    ``dgr.serve.auth.ApiKey``; None or empty: no key needed).

    ``max_per_key``: the generation requests (``/v1/chat/completions``, ``/v1/completions``)
    one API key may have in flight, from arrival until the response or stream ends, however
    it ends; one more gets a 429 at once. None: ``per_key_default`` of the route's slots; 0:
    no cap. Without ``api_keys`` there is no key to count, and no cap.

    ``template``: a ``dgr.serve.templates.ChatTemplate`` for the chat endpoint (None: chat
    requests get a 400 saying the model has no chat template; completions still work). The
    route is connected at startup if it is not yet, and closed at shutdown.
    """
    from dgr.serve import metrics as serve_metrics
    from dgr.serve import status as serve_status

    if max_per_key is not None and max_per_key < 0:
        raise ValueError(f"max_per_key must be >= 0, got {max_per_key}")
    # "vocab": each token id's bytes (the route's pieces: the text of a generation and of
    # its log probabilities)
    # "active": the requests generating now (id -> _Generation); "waiting": those queued for
    # a slot
    # "per_key": generation requests in flight by API key name; "per_key_cap": their cap (0:
    # none)
    state: dict[str, Any] = {"slots": None, "capacity": 0, "in_flight": 0, "vocab": None,
                             "active": {}, "waiting": 0, "per_key": {}, "per_key_cap": 0}
    created = int(time.time())
    m = serve_metrics.ServeMetrics(metrics_registry)
    traffic = serve_status.Traffic()
    watch = serve_status.StageWatch(route)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not route.stages:
            await route.connect()
        cap = min(int(s.settings["n_slots"]) for s in route.stages)
        state["capacity"] = cap
        state["slots"] = asyncio.Semaphore(cap)
        state["per_key_cap"] = per_key_default(cap) if max_per_key is None else max_per_key
        state["vocab"] = await route.pieces()
        try:
            yield
        finally:
            await route.close()

    def n_ctx() -> int:
        return min(int(s.settings["n_ctx"]) for s in route.stages)

    def take_key(key: str | None) -> bool:
        """Count one more request in flight for ``key``; False (nothing counted) at its cap."""
        cap = state["per_key_cap"]
        if key is None or not cap:
            return True
        held = state["per_key"].get(key, 0)
        if held >= cap:
            m.key_refused(key)
            log.info("API key %r is at its cap of %d request(s) in flight: 429", key, cap)
            return False
        state["per_key"][key] = held + 1
        m.key_in_flight(key, held + 1)
        return True

    def give_key(key: str | None) -> None:
        """Count one request of ``key`` (taken by ``take_key``) no longer in flight."""
        if key is None or key not in state["per_key"]:
            return
        held = state["per_key"][key] - 1
        if held:
            state["per_key"][key] = held
        else:
            del state["per_key"][key]
        m.key_in_flight(key, held)

    async def body_of(request: Request) -> dict:
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY:
                raise ApiError(413, f"the request body is larger than {MAX_BODY} bytes",
                               code="request_too_large")
        try:
            body = json.loads(bytes(raw))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        name = body.get("model")
        if name is not None and name != model:
            raise ApiError(404, f"the model '{name}' does not exist; this route serves "
                                f"'{model}'", param="model", code="model_not_found")
        return body

    async def acquire_slot() -> None:
        state["waiting"] += 1
        try:
            await asyncio.wait_for(state["slots"].acquire(), queue_timeout)
        except asyncio.TimeoutError:
            raise ApiError(429, f"every one of the route's {state['capacity']} slot(s) is busy "
                                f"(waited {queue_timeout:g} s); retry later",
                           type="rate_limit_error", code="slots_busy",
                           headers={"Retry-After": "1"}) from None
        finally:
            state["waiting"] -= 1

    async def prompt_tokens(body: dict, chat: bool) -> tuple[list[int], str]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "'messages' must be a non-empty list", param="messages")
            if template is None:
                raise ApiError(400, f"the model '{model}' has no chat template: use "
                                    "/v1/completions", param="messages",
                               code="no_chat_template")
            try:
                text, add_bos = template.render_prompt(messages, add_generation_prompt=True)
            except errors.DgrError as e:
                raise ApiError(400, str(e), param="messages", code=type(e).__name__) from None
            ids = await route.tokenize(text, add_bos, True)
        else:
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
                p = p[0]
            if isinstance(p, str):
                text = p
                ids = await route.tokenize(p, True, True)
            elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in p):
                n_vocab = int(route.stages[0].n_vocab)
                bad = next((i for i, t in enumerate(p) if not 0 <= t < n_vocab), None)
                if bad is not None:
                    raise ApiError(400, f"prompt[{bad}] = {p[bad]} is not a token id of this "
                                        f"model (0 to {n_vocab - 1})", param="prompt",
                                   code="invalid_token")
                text, ids = "", p
            else:
                raise ApiError(400, "'prompt' must be a string or a list of token ids (one "
                                    "prompt per request)", param="prompt")
        ids = [int(t) for t in ids]
        if not ids:
            raise ApiError(400, "the prompt has no tokens", param="prompt")
        return ids, text

    def budget(ids: list[int], params: Params) -> int:
        ctx = n_ctx()
        if params.max_tokens is None:
            if len(ids) >= ctx:
                raise ApiError(400, f"this model's maximum context length is {ctx} tokens; the "
                                    f"prompt has {len(ids)}", code="context_length_exceeded")
            return ctx - len(ids)
        if len(ids) + params.max_tokens > ctx:
            raise ApiError(400, f"this model's maximum context length is {ctx} tokens, but "
                                f"{len(ids) + params.max_tokens} were requested ({len(ids)} in "
                                f"the prompt, {params.max_tokens} for the completion)",
                           param="max_tokens", code="context_length_exceeded")
        return params.max_tokens

    async def complete(request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        t0 = time.perf_counter()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        ident = {"X-Request-Id": rid}

        def fail(e: ApiError) -> Response:
            m.request(endpoint, e.status)
            e.headers.update(ident)
            return e.response()

        key = request.scope.get(KEY_SCOPE)
        if not take_key(key):
            return fail(ApiError(
                429, f"this API key already has {state['per_key_cap']} request(s) in flight, "
                     f"its cap (--max-requests-per-key); retry when one ends (request {rid})",
                type="rate_limit_error", code="max_requests_per_key",
                headers={"Retry-After": "1"}))
        gen = None
        try:
            try:
                body = await body_of(request)
                params = Params(body, chat=chat)
                ids, text = await prompt_tokens(body, chat)
                n_vocab = int(route.stages[0].n_vocab)
                bad = [t for t, _ in params.sampling.logit_bias if t >= n_vocab]
                if bad:
                    raise ApiError(400, f"'logit_bias' names token {bad[0]}, not a token id "
                                        f"of this model (0 to {n_vocab - 1})",
                                   param="logit_bias", code="invalid_token")
                if params.user:
                    log.info("request %s from %s", rid, params.user)
                max_tokens = budget(ids, params)
                await acquire_slot()
            except ApiError as e:
                return fail(e)
            except errors.DgrError as e:
                return fail(_from_dgr(e, rid))
            # from here on gen.close() gives back the slot and the key's count
            gen = _Generation(route, ids, max_tokens, params, metrics=m, t0=t0, state=state,
                              rid=rid, endpoint=endpoint, traffic=traffic,
                              on_close=lambda: give_key(key))
            if params.echo:  # the prompt as sent, or its tokens' text
                gen.echo = text or b"".join(state["vocab"][t] for t in ids).decode(
                    "utf-8", "replace")
        finally:
            if gen is None:  # refused, failed or cancelled before the generation: the count
                give_key(key)
        if params.stream:
            return _Stream(_sse(gen, rid, chat, model, created, params.include_usage, endpoint, m),
                           gen, media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                    **ident})
        try:
            text = ""
            async for piece in gen.pieces():
                text += piece
        except errors.DgrError as e:
            return fail(_from_dgr(e, rid))
        finally:
            await gen.close()
        m.request(endpoint, 200)
        usage = gen.usage()
        lp = await gen.take_logprobs(chat)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": lp, "finish_reason": gen.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": lp,
                      "finish_reason": gen.finish_reason}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model,
                             "choices": [choice], "usage": usage,
                             "system_fingerprint": None}, headers=ident)

    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    card = {"id": model, "object": "model", "created": created, "owned_by": "dgr"}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [card]})

    async def model_card(request: Request) -> Response:
        name = request.path_params["name"]
        if name != model:
            return ApiError(404, f"The model '{name}' does not exist; this route serves "
                                 f"'{model}'", param="model", code="model_not_found").response()
        return JSONResponse(card)

    async def health(request: Request) -> Response:
        # with API keys, a probe without a valid key learns the status only: no endpoints
        detail = not api_keys or request.scope.get(KEY_SCOPE) is not None
        try:
            infos = await route.describe()
        except errors.DgrError as e:
            return JSONResponse({"status": "unavailable", "error": f"{type(e).__name__}: {e}"}
                                if detail else {"status": "unavailable"}, status_code=503)
        stages = [{"endpoint": s.endpoint, "layers": list(s.layers), "draining": s.draining,
                   "free_slots": s.free_slots, "sessions": s.sessions} for s in infos]
        ok = not any(s.draining for s in infos)
        status = "ok" if ok else "draining"
        return JSONResponse({"status": status, "model": model,
                             "in_flight": state["in_flight"], "capacity": state["capacity"],
                             "stages": stages} if detail else {"status": status},
                            status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        body, ctype = m.exposition()
        return Response(body, media_type=ctype)

    async def status(request: Request) -> Response:
        stages = await watch.stages()
        t = traffic.snapshot()
        path = ("relay+loop" if route.loop else "relay") if route.relay else "hop-by-hop"
        now = time.perf_counter()
        reqs = [{"id": g.rid, "endpoint": g.endpoint, "prompt_tokens": len(g.ids),
                 "completion_tokens": len(g.tokens), "age_s": now - g.t0,
                 "ttft_ms": None if g.ttft_s is None else 1e3 * g.ttft_s}
                for g in list(state["active"].values())]
        return JSONResponse({
            "model": model, "path": path, "capacity": state["capacity"],
            "in_flight": state["in_flight"], "waiting": state["waiting"],
            "healthy": all(s["health"] == "ok" for s in stages),
            "traffic": t, "stages": stages, "requests": reqs,
            "seam_ms": serve_status.seam_ms(t["tpot_ms"], stages,
                                            serve_status.links_of(path, len(stages)))},
            headers={"Cache-Control": "no-store"})

    async def page(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def not_found(request: Request, exc) -> Response:
        return ApiError(404, f"no route {request.method} {request.url.path}",
                        code="not_found").response()

    async def method_not_allowed(request: Request, exc) -> Response:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                        code="method_not_allowed").response()

    async def server_error(request: Request, exc) -> Response:
        # the exception's class and text stay in the log (uvicorn logs the traceback after)
        rid = "req-" + uuid.uuid4().hex
        log.error("request %s (%s %s) failed: %s: %s", rid, request.method, request.url.path,
                  type(exc).__name__, exc)
        return ApiError(500, f"internal error (request {rid})", type="server_error",
                        code="internal_error", headers={"X-Request-Id": rid}).response()

    return Starlette(
        routes=[HttpRoute("/", page, methods=["GET"]),
                HttpRoute("/status", status, methods=["GET"]),
                Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
                HttpRoute("/v1/models", models, methods=["GET"]),
                HttpRoute("/v1/models/{name:path}", model_card, methods=["GET"]),
                HttpRoute("/v1/chat/completions", chat_completions, methods=["POST"]),
                HttpRoute("/v1/completions", completions, methods=["POST"]),
                HttpRoute("/health", health, methods=["GET"]),
                HttpRoute("/metrics", metrics, methods=["GET"])],
        exception_handlers={404: not_found, 405: method_not_allowed, 500: server_error},
        middleware=[Middleware(ApiKeys, keys=list(api_keys))] if api_keys else None,
        lifespan=lifespan)


class _Generation:
    """One request's generation on its own route session: the text as it grows (held back
    while it may still become a stop string or ends inside a UTF-8 sequence)."""

    def __init__(self, route, ids: list[int], max_tokens: int, params: Params, *, metrics,
                 t0: float, state: dict, rid: str, endpoint: str, traffic,
                 on_close=None):
        self.route, self.ids, self.max_tokens, self.params = route, ids, max_tokens, params
        self.rid, self.endpoint, self.traffic = rid, endpoint, traffic
        self.ttft_s: float | None = None
        self._t_last = 0.0  # when the previous token came
        # the request holds one of the route's slots (acquired before): close() gives it back
        self.state = state
        state["in_flight"] += 1
        state["active"][rid] = self
        self.session = route.session()
        self.tokens: list[int] = []
        self.finish_reason = "length"
        self.metrics, self.t0 = metrics, t0
        self._closed = False
        self._on_close = on_close  # called once by close(): the request's API key count
        #: log probabilities of ``tokens`` (with ``params.logprobs``), and how many were sent
        self.logprobs: list = []
        self._lp_sent = 0
        self._lp_offset = 0
        #: completions' ``echo``: the prompt's text, sent before the completion's
        self.echo = ""

    def _took(self, tok: int) -> None:
        """Count a token the session yielded: TTFT or the time since the last one, and its
        log probability (with ``params.logprobs``)."""
        now = time.perf_counter()
        if not self.tokens:
            self.ttft_s = now - self.t0
            self.metrics.first_token(self.ttft_s)
            self.traffic.first_token(self.ttft_s)
            self.traffic.token(None)
        else:
            self.traffic.token(now - self._t_last)
        self._t_last = now
        self.tokens.append(int(tok))
        if self.params.logprobs:
            # the row that sampled this token (the session keeps one per sampled token, in
            # order); dropped once read: a row is n_vocab floats
            rows = self.session.logits
            i = len(self.tokens) - 1
            self.logprobs.append(token_logprob(rows[i], tok, self.params.top_logprobs))
            rows[i] = None

    async def pieces(self) -> AsyncIterator[str]:
        """The completion's text, piece by piece (stop strings cut, never sent)."""
        # the text as llama-server builds it: each token's piece appended (no list is
        # detokenized again); the stop strings are found here, not by the session
        text = TextStream(self.state["vocab"], self.params.stop)
        if self.echo:
            yield self.echo
        s = self.session
        spec0 = (s.trips, s.drafted, s.accepted)  # the session's, before this request
        tokens = s.generate(self.ids, max_tokens=self.max_tokens,
                            sampling=self.params.sampling, logits=self.params.logprobs)
        try:
            async for tok in tokens:
                self._took(tok)
                piece = text.push(tok)
                if piece:
                    yield piece
                if text.stopped:
                    break
        finally:
            await tokens.aclose()  # a stop string (or the client) ended it: the loop stops
        reason = "stop" if text.stopped else getattr(s, "stop_reason", "length")
        self.finish_reason = "length" if reason == "length" else "stop"
        piece = text.finish()
        if piece:
            yield piece
        self.metrics.tokens(len(self.tokens))
        t0, d0, a0 = spec0
        self.metrics.speculation(s.trips - t0, s.drafted - d0, s.accepted - a0)

    async def take_logprobs(self, chat: bool, *, chunk: bool = False) -> dict | None:
        """The ``logprobs`` of the tokens generated since the last call, in the endpoint's
        shape (None when the request did not ask for them, or for a streamed ``chunk`` when
        no token is new)."""
        if not self.params.logprobs:
            return None
        items = self.logprobs[self._lp_sent:]
        if chunk and not items:
            return None
        self._lp_sent = len(self.logprobs)
        vocab = self.state["vocab"]
        pieces = {t: vocab[t].decode("utf-8", "replace")
                  for it in items for t in (it.token, *(a for a, _ in it.top))}
        if chat:
            return chat_logprobs(items, pieces)
        out = completion_logprobs(items, pieces, self._lp_offset)
        self._lp_offset = out["text_offset"][-1] + len(out["tokens"][-1]) if items \
            else self._lp_offset
        return out

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.ids), "completion_tokens": len(self.tokens),
                "total_tokens": len(self.ids) + len(self.tokens)}

    async def close(self) -> None:
        """Release the session on every stage, the request's slot and its API key's count,
        once (also when the request was cancelled, or its stream never started)."""
        if self._closed:
            return
        self._closed = True
        self.state["in_flight"] -= 1
        self.state["active"].pop(self.rid, None)
        self.state["slots"].release()
        if self._on_close is not None:
            self._on_close()
        with anyio.CancelScope(shield=True):
            await self.session.close()


class _Stream(StreamingResponse):
    """A streamed completion whose generation is closed when the ASGI call ends, however it
    ends: a client gone before the first event never starts the event generator, whose own
    ``finally`` would then never run."""

    def __init__(self, content, gen: _Generation, **kw):
        super().__init__(content, **kw)
        self._gen = gen

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._gen.close()


async def _sse(gen: _Generation, rid: str, chat: bool, model: str, created: int,
               include_usage: bool, endpoint: str, m) -> AsyncIterator[bytes]:
    """Server-sent events of one streamed completion, ending in ``data: [DONE]``."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list, **extra) -> bytes:
        d = {"id": rid, "object": obj, "created": created, "model": model,
             "system_fingerprint": None, "choices": choices, **extra}
        return b"data: " + json.dumps(d, ensure_ascii=False).encode() + b"\n\n"

    def choice(piece: str | None, finish: str | None, role: bool = False,
               lp: dict | None = None) -> dict:
        if chat:
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if piece is not None:
                delta["content"] = piece
            return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": 0, "text": piece or "", "logprobs": lp, "finish_reason": finish}

    status = 200
    try:
        if chat:
            yield event([choice(None, None, role=True)])
        try:
            async for piece in gen.pieces():
                yield event([choice(piece, None, lp=await gen.take_logprobs(chat, chunk=True))])
        except Exception as e:  # noqa: BLE001 - whatever failed, the client gets an error event
            if isinstance(e, errors.DgrError):
                err = _from_dgr(e, rid)
            else:
                log.exception("request %s failed mid-stream: %s: %s", rid, type(e).__name__, e)
                err = ApiError(500, f"internal error (request {rid})", type="server_error",
                               code="internal_error")
            status = err.status
            yield b"data: " + json.dumps({"error": {"message": err.message, "type": err.type,
                                                    "param": None, "code": err.code}}).encode() \
                + b"\n\n"
            return
        yield event([choice(None if chat else "", gen.finish_reason,
                            lp=await gen.take_logprobs(chat, chunk=True))])
        if include_usage:
            yield event([], usage=gen.usage())
        yield b"data: [DONE]\n\n"
    finally:
        await gen.close()
        m.request(endpoint, status)
