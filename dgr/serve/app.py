"""The OpenAI-compatible HTTP front of a route: an ASGI app (Starlette), docs/serve.md.

    from dgr.driver.route import AsyncRoute
    from dgr.serve.app import create_app
    app = create_app(AsyncRoute(["10.0.0.1:50051", "10.0.0.2:50051"]), model="smollm2")
    # uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints follow the OpenAI API reference: ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (``stream: true`` as server-sent events ending in ``data:
[DONE]``), ``GET /health`` and ``GET /metrics`` (Prometheus); Anthropic's ``POST /v1/messages``
and ``/v1/messages/count_tokens``, and OpenAI's ``POST /v1/responses`` (stateless), over the
same pipeline (``dgr.serve.anthropic``, ``dgr.serve.responses``). Every error
has the OpenAI shape ``{"error": {"message", "type", "param", "code"}}`` (Anthropic's on
``/v1/messages``) and its HTTP status: a malformed request
400, an unknown model 404, a prompt and completion longer than the context 400 naming both
lengths, a full queue of requests waiting for a slot 429 with ``Retry-After``, a request
that waited its ``queue_timeout`` seconds in the queue 503 with ``Retry-After``, the route
down 503. With API keys, a key with ``max_per_key`` generation requests in
flight gets a 429 for one more, without waiting and without holding anything.

An error a client sees names no path, endpoint or other internals: the route's and the
app's own failures answer a generic message with the request's id (also the ``X-Request-Id``
header), and the detail goes to the ``dgr.serve`` log under that id.

One route session per request, released on every stage when the request ends, however it
ends: a client that disconnects mid-stream cancels its generation, and the session is
released at once. Requests beyond the route's slots (the fewest any stage has) wait in a
queue of at most ``max_queue``, in arrival order, each at most ``queue_timeout`` seconds
(``dgr.serve.admission``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import time
import uuid
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount
from starlette.routing import Route as HttpRoute
from starlette.staticfiles import StaticFiles

from dgr import errors
from dgr.protocol.embeddings import pool
from dgr.serve import anthropic
from dgr.serve import metrics as serve_metrics
from dgr.serve import embeddings as embedding_fields
from dgr.serve import responses as oai_responses
from dgr.serve import status as serve_status
from dgr.serve.admission import Admission, per_key_default
from dgr.serve.api_errors import EXCEPTION_HANDLERS, ApiError, from_dgr
from dgr.serve.auth import KEY_SCOPE, ApiKeys
from dgr.serve.chat import NativeChat, Reply, tool_ask
from dgr.serve.generation import Generation, Stream, close_all, deltas, sse, usage_of
from dgr.serve.media import MediaPrompt
from dgr.serve.params import MAX_STOP_CHARS, Params
from dgr.serve.prefix import PrefixPool
from dgr.serve.prompts import MAX_BODY, RequestParts
from dgr.serve.settings import ServeSettings

__all__ = ["create_app", "ApiError", "MAX_BODY", "MAX_STOP_CHARS", "per_key_default"]

log = logging.getLogger("dgr.serve")

#: the status page's files (``GET /``, ``/static/...``), packaged with dgr
STATIC = pathlib.Path(__file__).with_name("static")


def create_app(route, *, model: str, template=None, settings: ServeSettings | None = None,
               metrics_registry=None, api_keys=None, **kw: Any) -> Starlette:
    """The ASGI app serving ``route`` (an ``AsyncRoute``) as the model named ``model``.

    ``settings``: the front's settings (``dgr.serve.settings.ServeSettings``: the slot queue's
    timeout, the per-key cap, the prompt cache, the prefix stores, the embeddings' pooling),
    each documented there; ``**kw`` changes some of them (``create_app(route, model=...,
    prompt_cache=2)``), and an unknown one is ``InvalidArgument``.

    ``api_keys``: keys a request must present as ``Authorization: Bearer`` (strings or
    ``dgr.serve.auth.ApiKey``; None or empty: no key needed).

    ``template``: a ``dgr.serve.templates.ChatTemplate`` for the chat endpoint (None: chat
    requests get a 400 saying the model has no chat template; completions still work). The
    route is connected at startup if it is not yet, and closed at shutdown.
    """
    f = _Front(route, model=model, template=template,
               settings=(settings or ServeSettings()).with_(**kw),
               metrics_registry=metrics_registry, api_keys=api_keys)
    return Starlette(
        routes=[HttpRoute("/", f.page, methods=["GET"]),
                HttpRoute("/status", f.status, methods=["GET"]),
                Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
                HttpRoute("/v1/models", f.models, methods=["GET"]),
                HttpRoute("/v1/models/{name:path}", f.model_card, methods=["GET"]),
                HttpRoute("/v1/chat/completions", f.chat_completions, methods=["POST"]),
                HttpRoute("/v1/completions", f.completions, methods=["POST"]),
                HttpRoute("/v1/messages", f.messages, methods=["POST"]),
                HttpRoute("/v1/responses", f.responses, methods=["POST"]),
                HttpRoute("/v1/embeddings", f.embeddings, methods=["POST"]),
                HttpRoute("/v1/messages/count_tokens", f.count_tokens, methods=["POST"]),
                HttpRoute("/health", f.health, methods=["GET"]),
                HttpRoute("/metrics", f.metrics, methods=["GET"])],
        exception_handlers=EXCEPTION_HANDLERS,
        middleware=[Middleware(ApiKeys, keys=list(api_keys))] if api_keys else None,
        lifespan=f.lifespan)


class _Front(RequestParts):
    """The app's parts and its endpoints (``create_app``'s arguments)."""

    def __init__(self, route, *, model: str, template, settings: ServeSettings,
                 metrics_registry, api_keys):
        self.route, self.model, self.template, self.api_keys = route, model, template, api_keys
        self.settings = settings
        self.m = serve_metrics.ServeMetrics(metrics_registry)
        #: the prompt cache: ended sessions kept for their prefixes
        self.pool = PrefixPool(settings.prompt_cache, settings.prompt_cache_ttl,
                               settings.prefix_store)
        #: how /v1/embeddings pools a prompt's rows, and whether it scales them to unit length
        self.pooling, self.normalize = settings.pooling, bool(settings.normalize)
        self.m.watch_prefix(self.pool)
        self.admission = Admission(settings.queue_timeout, settings.max_per_key, self.m,
                                   max_queue=settings.max_queue)
        self.traffic = serve_status.Traffic()
        self.watch = serve_status.StageWatch(route)
        self.history = serve_status.History()
        self.created = int(time.time())
        self._card = {"id": model, "object": "model", "created": self.created,
                      "owned_by": "dgr"}
        #: each token id's bytes (the route's pieces): the text of a generation and of its
        #: log probabilities
        self.vocab: list[bytes] = []
        #: the template in llama.cpp's chat code: tools and reasoning (None: no template, or
        #: no chat binding built; a request with tools is then a 400 saying why)
        self.native, self.native_error = None, ""
        if getattr(template, "source", None):  # a ChatTemplate with a template
            try:
                self.native = NativeChat(template)
            except errors.DgrError as e:
                self.native_error = str(e)
                log.warning("tools and reasoning are off: %s", e)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        r = self.route
        if not r.stages:
            await r.connect()
        self.admission.open(min(int(s.settings["n_slots"]) for s in r.stages))
        log.info(serve_status.context_line(r.stages))
        self.vocab = await r.pieces()
        sweep = asyncio.create_task(self._sweep()) if self.pool.size else None
        try:
            yield
        finally:
            if sweep is not None:
                sweep.cancel()
            await self._close_kept(self.pool.drain())
            await r.close()

    async def _sweep(self) -> None:
        """Close the prompt cache's sessions idle longer than its ttl."""
        while True:
            await asyncio.sleep(max(0.05, self.pool.ttl / 4))
            await self._close_kept(self.pool.expired())

    async def _close_kept(self, sessions: list) -> None:
        """Close sessions the prompt cache held; each gives its slot back."""
        with anyio.CancelScope(shield=True):
            for s in sessions:
                try:
                    if self.pool.stores(self.route):
                        await s.close(keep=True)
                    else:
                        await s.close()
                except Exception as e:  # noqa: BLE001 - a stage gone frees it by TTL
                    log.warning("closing a kept session failed: %s: %s", type(e).__name__, e)
                finally:
                    self.admission.release()

    def n_ctx(self) -> int:
        """Context tokens per session the route holds: the smallest of its stages'."""
        return min(int(s.n_ctx) for s in self.route.stages)

    @property
    def card(self) -> dict:
        """The model's ``/v1/models`` entry (``serve_status.model_card``)."""
        return serve_status.model_card(self._card, self.route.stages,
                                       getattr(self.route, "media_stage", None))

    # -- the completion endpoints ------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self.complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, chat=False)

    def _key_cap(self, rid: str) -> ApiError:
        return ApiError(
            429, f"this API key already has {self.admission.per_key_cap} request(s) in "
                 f"flight, its cap (--max-requests-per-key); retry when one ends (request "
                 f"{rid})", type="rate_limit_error", code="max_requests_per_key",
            headers={"Retry-After": "1"})

    async def _start(self, request: Request, body: dict, chat: bool, endpoint: str,
                     rid: str, t0: float) -> tuple[list[Generation], Params]:
        """Admit the request of ``body`` (a completions or chat completions body) under its
        API key's cap and start its generations, one per choice, each holding a slot, and
        together the key's count, until closed; an ``ApiError`` (nothing held) otherwise."""
        key = request.scope.get(KEY_SCOPE)
        if not self.admission.take_key(key):
            raise self._key_cap(rid)
        gens: list[Generation] = []
        try:
            try:
                params, prompts, replies, taken, media = await self._admit(body, chat, rid,
                                                                            key)
            except errors.DgrError as e:
                raise from_dgr(e, rid) from None
            # each prompt's choices: (sessions, positions they reuse)
            plan = [([taken[0] if taken else None], taken[1] if taken else 0)]
            if params.n > 1 or len(prompts) > 1:
                plan = []
                try:
                    for k, (ids, _, _) in enumerate(prompts):
                        plan.append(await self._choices(ids, params, rid, key, media))
                except BaseException:  # every choice's slot goes back, and what was opened
                    with anyio.CancelScope(shield=True):
                        try:
                            for sessions, _ in plan:
                                for s in sessions:
                                    await s.close()
                        finally:
                            for _ in range(params.n * len(prompts)):
                                self.admission.release()
                    raise
            left = [params.n * len(prompts)]

            def closed() -> None:  # the key's count goes back with the last choice
                left[0] -= 1
                if not left[0]:
                    self.admission.give_key(key)

            # from here on each gen.close() gives back its slot
            for (ids, text, max_tokens), (sessions, reuse) in zip(prompts, plan):
                for i, s in enumerate(sessions):
                    k = len(gens)
                    gens.append(Generation(
                        self.route, ids, max_tokens, params.choice(i), metrics=self.m, t0=t0,
                        admission=self.admission, vocab=self.vocab,
                        rid=rid if left[0] == 1 else f"{rid}-{k}", endpoint=endpoint,
                        traffic=self.traffic, on_close=closed,
                        reply=replies[i] if replies else None,
                        session=s, reuse=reuse, pool=self.pool, key=key, media=media))
                    gens[-1].counts_prompt = not i  # usage counts each prompt once
                    if params.echo:  # the prompt as sent, or its tokens' text
                        gens[-1].echo = text or b"".join(self.vocab[t] for t in ids).decode(
                            "utf-8", "replace")
        finally:
            if not gens:  # refused, failed or cancelled before the generations: the count
                self.admission.give_key(key)
        return gens, params

    def _session(self, key: str | None):
        """A new route session of the API key ``key``: the prefixes it adopts and keeps in
        the stages' stores are that key's (``AsyncRouteSession.tenant``)."""
        s = self.route.session()
        s.tenant = key
        return s

    async def _choices(self, ids: list[int], params: Params, rid: str, key: str | None,
                       media: MediaPrompt | None = None) -> tuple[list, int]:
        """``n`` sessions for ``n`` choices of the prompt ``ids`` (their slots taken): the
        prompt prefilled once up to where a fresh prefill's bits are kept
        (``AsyncRouteSession.reusable``'s rule: whole chunks, and rows of partial chunks
        where every stage computes them alike), then forked on every stage
        (``AsyncRouteSession.fork``); each choice prefills the rest. With a grammar (its
        state is a session's) every choice prefills alone. Returns the sessions and the
        positions they reuse; on failure closes what it opened (the slots are the
        caller's)."""
        r, n = self.route, params.n
        if n == 1:
            return [self._session(key)], 0
        ub, size = r.n_ubatch, len(ids)
        full = size - size % ub
        rows = all(getattr(st, "prefix_rows_exact", False) for st in r.stages)
        p = size - 2 if rows and size - 2 - full >= 2 else full if full < size else size - ub
        if params.sampling.grammar or p <= 0 or media is not None:
            return [self._session(key) for _ in range(n)], 0
        src = self._session(key)
        try:
            await src.prefill(ids[:p], sample=False)
            try:
                forks = await src.fork(n - 1)
            except (errors.SessionForbidden, errors.InvalidArgument) as e:
                # a stage that may not copy this session (a tenant's session that a peer
                # relayed, under cluster credentials) or cannot (an engine without copies):
                # every choice prefills alone
                log.info("request %s: no fork (%s: %s); each choice prefills alone", rid,
                         type(e).__name__, e)
                with anyio.CancelScope(shield=True):
                    await src.close()
                return [self._session(key) for _ in range(n)], 0
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await src.close()
            if isinstance(e, errors.DgrError):
                raise from_dgr(e, rid) from None
            raise
        return [src, *forks], p

    async def complete(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        t0 = time.perf_counter()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        ident = {"X-Request-Id": rid}

        def fail(e: ApiError) -> Response:
            self.m.request(endpoint, e.status)
            e.headers.update(ident)
            return e.response()

        try:
            gens, params = await self._start(request, await self.body_of(request), chat,
                                             endpoint, rid, t0)
        except ApiError as e:
            return fail(e)
        if params.stream:
            return Stream(sse(gens, rid, chat, self.model, self.created, params.include_usage,
                              endpoint, self.m),
                          gens, media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                   **ident})
        try:
            return await self._respond(gens, chat, endpoint, ident)
        except errors.DgrError as e:
            return fail(from_dgr(e, rid))

    async def _admit(self, body: dict, chat: bool, rid: str, key: str | None):
        """Parse and check the request's ``body``, then take a slot per choice of each prompt
        (completions may send several): ``(params, [(prompt ids, prompt text, max tokens)],
        each choice's reply parser or None, (kept session, positions it reuses) or None)``;
        nothing raises once the slots are taken. A slot is a kept session whose cache begins
        as the prompt does, or a free one, waited for (a kept session closed when none is
        free)."""
        params = Params(body, chat=chat)
        ask = tool_ask(body) if chat else None
        if ask is not None and ask.calls and params.sampling.grammar:
            raise ApiError(400, "a grammar or response_format cannot be combined with tools",
                           param="response_format" if body.get("response_format")
                           else "grammar" if body.get("grammar") else "json_schema",
                           code="unsupported_parameter")
        if ask is not None and ask.reasoning_budget is not None and params.logprobs:
            raise ApiError(400, "log probabilities are not given for a reply whose reasoning "
                                "has a budget (its end is the front's, not sampled)",
                           param="logprobs", code="unsupported_parameter")
        media = None
        if chat:
            ids, text, rendered, media = await self.prompt_tokens(body, chat, ask)
            prompts = [(ids, text)]
        else:
            prompts, rendered = await self._completion_prompts(body.get("prompt")), None
        if rendered is not None:
            self._with_tools(params, rendered)
        self._check_ids([t for t, _ in params.sampling.logit_bias], "logit_bias")
        if params.user:
            log.info("request %s from %s", rid, params.user)
        if media is not None and params.sampling.penalized:
            # the last stage's record of the session's tokens has a gap where the media's rows
            # are (docs/media.md): it would refuse them mid-generation
            raise ApiError(400, "repetition penalties (presence, frequency, repeat) are not "
                                "applied after an image or audio clip yet",
                           param="frequency_penalty", code="unsupported_parameter")
        prompts = [(ids, text, self.budget(len(ids) if media is None else media.cells, params))
                   for ids, text in prompts]
        slots = params.n * len(prompts)
        if slots > self.admission.capacity:
            cap = self.admission.capacity
            if len(prompts) == 1:
                raise ApiError(400, f"'n' is {params.n} but this route has {cap} slot(s), one "
                                    "per choice", param="n")
            raise ApiError(400, f"{len(prompts)} prompts of {params.n} choice(s) need {slots} "
                                f"slots; this route has {cap}, one per choice", param="prompt")
        # one parser per choice, made before a slot is taken
        replies = None if rendered is None else [Reply(rendered, stream=params.stream)
                                                 for _ in range(params.n)]
        # n choices fork one prefill instead. A grammar's state on the last stage starts
        # again with each request's reply (dgr.worker.grammar), so a constrained request (a
        # schema, tools) reuses a kept session as any other does
        taken = None if slots > 1 else self.pool.take(key, prompts[0][0])
        if taken is None:
            await self._take_slot(slots)
        return params, prompts, replies, taken, media

    async def _take_slot(self, n: int = 1) -> None:
        """``n`` free slots at once, waited for in the queue (``dgr.serve.admission``); the
        prompt cache's kept sessions are closed first while too few are free."""
        for _ in range(n - self.admission.free_slots()):
            kept = self.pool.evict()
            if kept is None:
                break
            await self._close_kept([kept])
        await self.admission.acquire_slot(n)

    async def _respond(self, gens: list[Generation], chat: bool, endpoint: str,
                       ident: dict) -> Response:
        """A whole (not streamed) completion's response, its choices made concurrently."""

        async def text_of(g: Generation) -> str:
            text = ""
            async for piece in g.pieces():
                text += piece
            return text

        try:
            texts = await asyncio.gather(*(text_of(g) for g in gens))
        finally:
            await close_all(gens)
        self.m.request(endpoint, 200)
        choices = []
        for i, (gen, text) in enumerate(zip(gens, texts)):
            lp = await gen.take_logprobs(chat)
            if chat:
                message = {"role": "assistant", "content": text}
                if gen.reply is not None:
                    gen.reply.feed(text, final=True)
                    message = gen.reply.openai_message()
                choices.append({"index": i, "message": message, "logprobs": lp,
                                "finish_reason": gen.finish})
            else:
                choices.append({"index": i, "text": text, "logprobs": lp,
                                "finish_reason": gen.finish_reason})
        return JSONResponse({"id": ident["X-Request-Id"],
                             "object": "chat.completion" if chat else "text_completion",
                             "created": self.created, "model": self.model,
                             "choices": choices, "usage": usage_of(gens),
                             "system_fingerprint": None}, headers=ident)

    # -- Anthropic's Messages API ------------------------------------------------------------

    async def messages(self, request: Request) -> Response:
        """``POST /v1/messages``: the chat pipeline in Anthropic's shapes
        (``dgr.serve.anthropic``)."""
        endpoint, t0 = "messages", time.perf_counter()
        rid = "msg_" + uuid.uuid4().hex
        ident = {"X-Request-Id": rid, "request-id": rid}

        def fail(e: ApiError) -> Response:
            self.m.request(endpoint, e.status)
            e.headers.update(ident)
            return anthropic.error_response(e)

        try:
            body = anthropic.to_chat(await self.body_of(request))
            (gen,), params = await self._start(request, body, True, endpoint, rid, t0)
        except ApiError as e:
            return fail(e)
        stops = list(body.get("stop") or [])
        if params.stream:
            return Stream(anthropic.events(gen, rid, self.model, stops, endpoint, self.m), gen,
                          media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                   **ident})
        try:
            text = ""
            async for piece in gen.pieces():
                text += piece
        except errors.DgrError as e:
            return fail(from_dgr(e, rid))
        finally:
            await gen.close()
        self.m.request(endpoint, 200)
        return JSONResponse(anthropic.message(gen, text, rid, self.model, stops),
                            headers=ident)

    async def count_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens``: the prompt's tokens as the model's template
        renders it (system, messages and tools), without a slot."""
        endpoint = "count_tokens"
        try:
            body = anthropic.to_chat(await self.body_of(request), count=True)
            ids, _, _, media = await self.prompt_tokens(body, True, tool_ask(body))
        except ApiError as e:
            self.m.request(endpoint, e.status)
            return anthropic.error_response(e)
        except errors.DgrError as e:
            err = from_dgr(e, "count_tokens-" + uuid.uuid4().hex)
            self.m.request(endpoint, err.status)
            return anthropic.error_response(err)
        self.m.request(endpoint, 200)
        return JSONResponse({"input_tokens": len(ids) if media is None else media.cells})

    # -- OpenAI's Responses API ---------------------------------------------------------------

    async def responses(self, request: Request) -> Response:
        """``POST /v1/responses``, stateless: the chat pipeline in the Responses API's shapes
        (``dgr.serve.responses``)."""
        endpoint, t0, created = "responses", time.perf_counter(), time.time()
        rid = "resp_" + uuid.uuid4().hex
        ident = {"X-Request-Id": rid}

        def fail(e: ApiError) -> Response:
            self.m.request(endpoint, e.status)
            e.headers.update(ident)
            return e.response()

        try:
            body = await self.body_of(request)
            chat = oai_responses.to_chat(body)
            (gen,), params = await self._start(request, chat, True, endpoint, rid, t0)
        except ApiError as e:
            return fail(e)
        if params.stream:
            return Stream(oai_responses.events(gen, rid, self.model, body, chat, endpoint,
                                               self.m), gen,
                          media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                   **ident})
        out = oai_responses.Output(gen)
        try:
            async for piece, delta in deltas(gen):
                out.feed(piece, delta)
            out.finish()
        except errors.DgrError as e:
            return fail(from_dgr(e, rid))
        finally:
            await gen.close()
        self.m.request(endpoint, 200)
        return JSONResponse(oai_responses.response(gen, out, rid, self.model, body, chat,
                                                   created), headers=ident)

    # -- embeddings ---------------------------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings``: each input prefilled on the route, its rows pooled
        (``dgr.protocol.embeddings``), one slot and one session for the whole request."""
        endpoint, rid = "embeddings", "embd-" + uuid.uuid4().hex
        ident = {"X-Request-Id": rid}
        key = request.scope.get(KEY_SCOPE)

        def fail(e: ApiError) -> Response:
            self.m.request(endpoint, e.status)
            e.headers.update(ident)
            return e.response()

        if not self.admission.take_key(key):
            return fail(self._key_cap(rid))
        try:
            req = await self._embedding_request(await self.body_of(request))
            vectors = await self._embed_all(req.inputs, rid)
        except ApiError as e:
            return fail(e)
        finally:
            self.admission.give_key(key)
        self.m.request(endpoint, 200)
        n = sum(len(i) for i in req.inputs)
        return JSONResponse({"object": "list", "model": self.model,
                             "data": [{"object": "embedding", "index": i,
                                       "embedding": req.encode(v)}
                                      for i, v in enumerate(vectors)],
                             "usage": {"prompt_tokens": n, "total_tokens": n}}, headers=ident)

    async def _embedding_request(self, body: dict) -> embedding_fields.EmbeddingRequest:
        req = embedding_fields.parse(body)
        inputs = []
        for i, x in enumerate(req.inputs):
            ids = ([int(t) for t in await self.route.tokenize(x, True, True)]
                   if isinstance(x, str) else x)
            self._check_ids(ids, "input")
            if len(ids) > self.n_ctx():
                raise ApiError(400, f"input {i} has {len(ids)} tokens; this model's maximum "
                                    f"context length is {self.n_ctx()}", param="input",
                               code="context_length_exceeded")
            inputs.append(ids)
        req.inputs = inputs
        return req

    async def _embed_all(self, inputs: list[list[int]], rid: str) -> list:
        """Each input's pooled vector, on one slot and one route session."""
        await self._take_slot()
        session = None
        try:
            session = self.route.session()
            return [pool(await session.embed(ids), self.pooling, normalize=self.normalize)
                    for ids in inputs]
        except errors.DgrError as e:
            raise from_dgr(e, rid) from None
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    if session is not None:
                        await session.close()
                finally:
                    self.admission.release()

    # -- the other endpoints -----------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.card]})

    async def model_card(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name != self.model:
            return ApiError(404, f"The model '{name}' does not exist; this route serves "
                                 f"'{self.model}'", param="model",
                            code="model_not_found").response()
        return JSONResponse(self.card)

    async def health(self, request: Request) -> Response:
        # with API keys, a probe without a valid key learns the status only: no endpoints
        detail = not self.api_keys or request.scope.get(KEY_SCOPE) is not None
        try:
            infos = await self.route.describe()
        except errors.DgrError as e:
            return JSONResponse({"status": "unavailable", "error": f"{type(e).__name__}: {e}"}
                                if detail else {"status": "unavailable"}, status_code=503)
        stages = [{"endpoint": s.endpoint, "layers": list(s.layers), "draining": s.draining,
                   "free_slots": s.free_slots, "sessions": s.sessions} for s in infos]
        ok = not any(s.draining for s in infos)
        status = "ok" if ok else "draining"
        return JSONResponse({"status": status, "model": self.model,
                             "in_flight": self.admission.in_flight,
                             "capacity": self.admission.capacity,
                             "stages": stages} if detail else {"status": status},
                            status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        body, ctype = self.m.exposition()
        return Response(body, media_type=ctype)

    async def status(self, request: Request) -> Response:
        r, a = self.route, self.admission
        stages = await self.watch.stages()
        t = self.traffic.snapshot()
        path = ("relay+loop" if r.loop else "relay") if r.relay else "hop-by-hop"
        now = time.perf_counter()
        reqs = [{"id": g.rid, "endpoint": g.endpoint, "prompt_tokens": g.n_prompt,
                 "completion_tokens": len(g.tokens), "age_s": now - g.t0,
                 "ttft_ms": None if g.ttft_s is None else 1e3 * g.ttft_s}
                for g in list(a.active.values())]
        seam = serve_status.seam_ms(t["tpot_ms"], stages,
                                    serve_status.links_of(path, len(stages)))
        self.history.add({**t, "waiting": a.waiting, "in_flight": a.in_flight,
                          "seam_ms": seam}, [s.get("compute_ms") for s in stages])
        return JSONResponse({
            "model": self.model, "path": path, "capacity": a.capacity, "n_ctx": self.n_ctx(),
            "in_flight": a.in_flight, "waiting": a.waiting,
            "queue": {"waiting": a.waiting, "max": a.max_queue, "timeout_s": a.queue_timeout},
            "healthy": all(s["health"] == "ok" for s in stages),
            "traffic": t, "stages": stages, "requests": reqs, "seam_ms": seam,
            "prompt_cache": self.pool.snapshot(),
            "history": self.history.series()},
            headers={"Cache-Control": "no-store"})

    async def page(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})
