"""A request's parts, as the front reads them (``RequestParts``, a part of
``dgr.serve.app``'s front): its body (capped), its prompt's token ids (chat: rendered by the
model's template or llama.cpp's chat code, with its media cut by the projector; completions:
strings or token ids), and the completion's token budget within the route's context."""

from __future__ import annotations

import dataclasses
import json

from starlette.requests import Request

from dgr import errors
from dgr.serve import media as serve_media
from dgr.serve.api_errors import ApiError
from dgr.serve.chat import Rendered, ToolAsk
from dgr.serve.media import MediaPrompt
from dgr.serve.params import Params

__all__ = ["MAX_BODY", "MAX_PROMPTS", "RequestParts"]

#: the most prompts one completions request may hold (each choice of each holds a slot)
MAX_PROMPTS = 16
#: the largest request body read (bytes); a larger one is a 413 before it is parsed
MAX_BODY = 8 << 20


class RequestParts:
    """How the front reads a request, over its ``route``, ``model``, ``template``,
    ``native`` (llama.cpp's chat code), ``settings`` and ``n_ctx()``."""

    def max_body(self) -> int:
        """The largest body read: ``MAX_BODY``, and on a route with a projector room for
        ``max_media`` clips of ``max_media_bytes`` each in base64."""
        by = getattr(self.route, "media_stage", None)
        if not getattr(by, "media_marker", ""):
            return MAX_BODY
        return MAX_BODY + self.settings.max_media * (self.settings.max_media_bytes * 4 // 3 + 64)

    async def body_of(self, request: Request) -> dict:
        raw, cap = bytearray(), self.max_body()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > cap:
                raise ApiError(413, f"the request body is larger than {cap} bytes",
                               code="request_too_large")
        try:
            body = json.loads(bytes(raw))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        name = body.get("model")
        if name is not None and name != self.model:
            raise ApiError(404, f"the model '{name}' does not exist; this route serves "
                                f"'{self.model}'", param="model", code="model_not_found")
        return body

    async def prompt_tokens(self, body: dict, chat: bool, ask: ToolAsk | None = None
                            ) -> tuple[list, str, Rendered | None, MediaPrompt | None]:
        """The prompt's token ids, its text (chat: the rendered messages; "" for a
        completions prompt of token ids), how llama.cpp's chat code rendered it (None:
        the plain template, or completions), and its media (``dgr.serve.media``; None:
        none). With media the ids are each position's key (``MediaPrompt.keys``)."""
        rendered = media = None
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "'messages' must be a non-empty list", param="messages")
            messages, media = serve_media.request_media(self.route, self.model, messages,
                                                        self.settings)
            if self.template is None:
                raise ApiError(400, f"the model '{self.model}' has no chat template: use "
                                    "/v1/completions", param="messages",
                               code="no_chat_template")
            ask = ask or ToolAsk()
            if ask.asks_reasoning and (self.native is None or not self.native.thinking):
                raise ApiError(400, f"the model '{self.model}' has no reasoning in its chat "
                                    "template (it does not think): a request to think, or a "
                                    "reasoning budget, cannot be honoured",
                               code="unsupported_parameter")
            if self.native is not None and self.native.wanted(ask):
                rendered = self.native.render(messages, ask)
                text, add_bos = rendered.prompt, rendered.add_bos
            elif ask.tools:
                raise ApiError(400, f"tools need llama.cpp's chat code, which is off on this "
                                    f"server: {self.native_error}", param="tools",
                               code="unsupported_parameter")
            else:
                try:
                    text, add_bos = self.template.render_prompt(
                        messages, add_generation_prompt=True, **dict(ask.template_kwargs))
                except errors.DgrError as e:
                    raise ApiError(400, str(e), param="messages",
                                   code=type(e).__name__) from None
            if media is not None:
                media = await MediaPrompt.cut(self.route, media, text, add_bos, self.settings)
                return media.keys, text, rendered, media
            ids = await self.route.tokenize(text, add_bos, True)
        else:
            ids, text = (await self._completion_prompts(body.get("prompt")))[0]
        ids = [int(t) for t in ids]
        if not ids:
            raise ApiError(400, "the prompt has no tokens", param="prompt")
        return ids, text, rendered, None

    def _with_tools(self, params: Params, rendered: Rendered) -> None:
        """``params`` with the format's grammar and stop strings (a request with tools or a
        thinking template)."""
        if rendered.grammar:
            params.sampling = dataclasses.replace(params.sampling, grammar=rendered.grammar)
        params.stop = params.stop + [s for s in rendered.stops if s not in params.stop]

    async def _completion_prompts(self, p) -> list[tuple[list[int], str]]:
        """The prompts of a completions request, each ``(token ids, text)`` (text "" for
        ids): a string, a list of token ids, or a list of either (a batch, at most
        ``MAX_PROMPTS``)."""
        def ids_(x) -> bool:
            return isinstance(x, list) and bool(x) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(p, str) or ids_(p):
            p = [p]
        if not (isinstance(p, list) and p and all(isinstance(x, str) or ids_(x) for x in p)):
            raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of "
                                "either", param="prompt")
        if len(p) > MAX_PROMPTS:
            raise ApiError(400, f"'prompt' holds {len(p)} prompts; at most {MAX_PROMPTS}",
                           param="prompt")
        out = []
        for x in p:
            if isinstance(x, str):
                ids = [int(t) for t in await self.route.tokenize(x, True, True)]
                text = x
            else:
                self._check_ids(x, "prompt")
                ids, text = list(x), ""
            if not ids:
                raise ApiError(400, "the prompt has no tokens", param="prompt")
            out.append((ids, text))
        return out

    def _check_ids(self, ids, param: str) -> None:
        n_vocab = int(self.route.stages[0].n_vocab)
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < n_vocab), None)
        if bad is not None:
            at = f"{param}[{bad}] = {ids[bad]}" if param == "prompt" else f"token {ids[bad]}"
            raise ApiError(400, f"'{param}' names {at}, not a token id of this model (0 to "
                                f"{n_vocab - 1})", param=param, code="invalid_token")

    def budget(self, n: int, params: Params) -> int:
        """The completion's token budget for a prompt of ``n`` tokens (cache cells: an
        image's rows count)."""
        ctx = self.n_ctx()
        if params.max_tokens is None:
            if n >= ctx:
                raise ApiError(400, f"this model's maximum context length is {ctx} tokens; the "
                                    f"prompt has {n}", code="context_length_exceeded")
            return ctx - n
        if n + params.max_tokens > ctx:
            raise ApiError(400, f"this model's maximum context length is {ctx} tokens, but "
                                f"{n + params.max_tokens} were requested ({n} in "
                                f"the prompt, {params.max_tokens} for the completion)",
                           param="max_tokens", code="context_length_exceeded")
        return params.max_tokens
