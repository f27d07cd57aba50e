"""One request's generation: its route session, its text as it grows, its log
probabilities, and the server-sent events of a streamed response."""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

import anyio
from starlette.responses import StreamingResponse

from dgr.driver.media import prompt_keys
from dgr.driver.text import TextStream
from dgr.serve.admission import Admission
from dgr.serve.api_errors import mid_stream
from dgr.serve.logprobs import chat_logprobs, completion_logprobs, token_logprob
from dgr.serve.params import Params

__all__ = ["Generation", "Stream", "close_all", "deltas", "merged", "sse", "usage_of"]


class Generation:
    """One request's generation on its own route session: the text as it grows (held back
    while it may still become a stop string or ends inside a UTF-8 sequence)."""

    def __init__(self, route, ids: list[int], max_tokens: int, params: Params, *, metrics,
                 t0: float, admission: Admission, vocab: list[bytes], rid: str,
                 endpoint: str, traffic, on_close=None, reply=None, session=None,
                 reuse: int = 0, pool=None, key: str | None = None, media=None):
        self.route, self.ids, self.max_tokens, self.params = route, ids, max_tokens, params
        self.rid, self.endpoint, self.traffic = rid, endpoint, traffic
        self.ttft_s: float | None = None
        self._t_last = 0.0  # when the previous token came
        # the request holds one of the route's slots (acquired before): close() gives it back
        self.admission, self.vocab = admission, vocab
        admission.started(rid, self)
        #: a session the prompt cache kept, and how many of its positions this request
        #: reuses (``dgr.serve.prefix``); else a new one
        self.session = session if session is not None else route.session()
        self.session.tenant = key  # whose prefixes it adopts and keeps (the same key's)
        self.reuse = reuse
        #: the prompt cache this request's session goes to when it ends well, under ``key``
        self.pool, self.key = pool, key
        self.completed = False
        self.tokens: list[int] = []
        self.finish_reason = "length"
        #: the stop string that ended the text (None: another reason)
        self.stop_string: str | None = None
        self.metrics, self.t0 = metrics, t0
        self._closed = False
        self._on_close = on_close  # called once by close(): the request's API key count
        #: log probabilities of ``tokens`` (with ``params.logprobs``), and how many were sent
        self.logprobs: list = []
        self._lp_sent = 0
        self._lp_offset = 0
        #: completions' ``echo``: the prompt's text, sent before the completion's
        self.echo = ""
        #: whether this choice counts its prompt in the request's usage (the first choice of
        #: each prompt)
        self.counts_prompt = True
        #: chat with tools or a thinking template: the text parsed in the model's format
        #: (``dgr.serve.chat.Reply``; None: the text is the content)
        self.reply = reply
        #: the prompt's media (``dgr.serve.media.MediaPrompt``; ``ids`` are then its
        #: positions' keys), encoded when the generation starts; None: a text prompt
        self.media = media

    @property
    def n_prompt(self) -> int:
        """The prompt's tokens as ``usage`` counts them: a token each, an image's rows."""
        return len(self.ids) if self.media is None else self.media.cells

    @property
    def cached(self) -> int:
        """Of them, those a kept session or a prefix store held (``cached_tokens``)."""
        return self.reuse if self.media is None else self.media.cells_before(self.reuse)

    @property
    def finish(self) -> str:
        """The choice's ``finish_reason``: ``tool_calls`` when the reply called a tool and
        ended (cut at the token limit it is ``length``, as OpenAI says of a cut call)."""
        if self.reply is not None and self.reply.called and self.finish_reason != "length":
            return "tool_calls"
        return self.finish_reason

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
        text = TextStream(self.vocab, self.params.stop)
        if self.echo:
            yield self.echo
        s = self.session
        spec0 = (s.trips, s.drafted, s.accepted)  # the session's, before this request
        if not self.reuse and self.pool is not None and self.pool.stores(self.route) and \
                self.media is None:
            # a new session: the stages' prefix stores may hold this prompt's first chunks
            self.reuse = await s.adopt(self.ids)
            self.pool.adopted(self.reuse)
        cap = getattr(self.reply, "cap", None)
        prompt, reuse, seen, full = self.ids, self.reuse, "", False
        if self.media is not None:  # encoded now, past what the session keeps
            prompt = await self.media.encoded(self.route, reuse)
        while True:
            left = self.max_tokens - len(self.tokens)
            tokens = s.generate(prompt, max_tokens=left, sampling=self.params.sampling,
                                logits=self.params.logprobs,
                                **({"reuse": reuse} if reuse else {})) if self.media is None \
                else s.generate_media(prompt, max_tokens=left, sampling=self.params.sampling,
                                      logits=self.params.logprobs, reuse=reuse)
            capped = False
            try:
                async for tok in tokens:
                    self._took(tok)
                    piece = text.push(tok)
                    if piece:
                        if cap is not None:  # the text so far, for the budget only
                            seen += piece
                        yield piece
                    if text.stopped:
                        break
                    if cap is not None and cap.over(seen, len(self.tokens)):
                        capped = True
                        break
            finally:
                await tokens.aclose()  # a stop string (or the client) ended it: the loop stops
            if not capped:
                break
            # the reasoning ran to its budget: end it with the template's own tag, as input,
            # and generate the answer after it (a prefill of the text so far, from the
            # session's reusable positions: the bits of a fresh prefill of that text)
            close = [int(t) for t in await self.route.tokenize(cap.close_text, False, True)]
            cap = None  # once
            if len(self.tokens) + len(close) >= self.max_tokens:
                full = True  # no room for the answer: the reply is cut, as at the limit
                break
            for t in close:
                self.tokens.append(t)
                piece = text.push(t)
                if piece:
                    yield piece
            if self.media is None:
                prompt = self.ids + self.tokens
                reuse = s.reusable(prompt)  # (a recurrent route: its latest state snapshot)
            else:  # the reply so far as text after the prompt's chunks (its last run)
                chunks = self.media.chunks
                tail = [*chunks[-1], *self.tokens] if isinstance(chunks[-1], list) else None
                whole = [*chunks[:-1], tail] if tail else [*chunks, list(self.tokens)]
                reuse = s.reusable(prompt_keys(whole))
                encoded = await self.media.encoded(self.route, reuse)
                prompt = [*encoded[:-1], tail] if tail else [*encoded, list(self.tokens)]
        reason = "stop" if text.stopped else "length" if full else getattr(s, "stop_reason",
                                                                             "length")
        self.finish_reason = "length" if reason == "length" else "stop"
        self.stop_string = text.matched
        piece = text.finish()
        if piece:
            yield piece
        self.metrics.tokens(len(self.tokens))
        t0, d0, a0 = spec0
        self.metrics.speculation(s.trips - t0, s.drafted - d0, s.accepted - a0)
        self.traffic.speculation(s.trips - t0, s.drafted - d0, s.accepted - a0)
        self.completed = True

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
        pieces = {t: self.vocab[t].decode("utf-8", "replace")
                  for it in items for t in (it.token, *(a for a, _ in it.top))}
        if chat:
            return chat_logprobs(items, pieces)
        out = completion_logprobs(items, pieces, self._lp_offset)
        self._lp_offset = out["text_offset"][-1] + len(out["tokens"][-1]) if items \
            else self._lp_offset
        return out

    def usage(self) -> dict:
        return {"prompt_tokens": self.n_prompt, "completion_tokens": len(self.tokens),
                "total_tokens": self.n_prompt + len(self.tokens)}

    async def close(self) -> None:
        """Release the session on every stage, the request's slot and its API key's count,
        once (also when the request was cancelled, or its stream never started)."""
        if self._closed:
            return
        self._closed = True
        # a generation that ended well keeps its session for the prompt cache (slot and
        # all), and the sessions it closes keep their caches in the stages' prefix stores;
        # every session closed gives its slot back
        keep = self.pool is not None and self.completed
        if keep and self.admission.waiting:
            # a queued request needs the slot more than the prompt cache does: the session
            # closes (into the stages' prefix stores, where they keep it)
            closing, store = [self.session], self.pool.stores(self.route)
        else:
            closing = self.pool.put(self.key, self.session) if keep else [self.session]
            store = keep and self.pool.stores(self.route)
        self.admission.ended(self.rid, release=False)
        if self._on_close is not None:
            self._on_close()
        with anyio.CancelScope(shield=True):
            for s in closing:
                try:
                    await (s.close(keep=True) if store else s.close())
                finally:
                    self.admission.release()


class Stream(StreamingResponse):
    """A streamed completion whose generations (one per choice) are closed when the ASGI call
    ends, however it ends: a client gone before the first event never starts the event
    generator, whose own ``finally`` would then never run."""

    def __init__(self, content, gen: Generation | list[Generation], **kw):
        super().__init__(content, **kw)
        self._gens = gen if isinstance(gen, list) else [gen]

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_all(self._gens)


async def close_all(gens: list[Generation]) -> None:
    """Close every generation, each once, whatever the others raise."""
    err = None
    for g in gens:
        try:
            await g.close()
        except BaseException as e:  # noqa: BLE001 - the others still close
            err = err or e
    if err is not None:
        raise err


async def deltas(gen: Generation) -> AsyncIterator[tuple[str | None, dict | None]]:
    """A generation's text as it grows: ``(content, None)`` per piece of text; with a parsed
    reply (tools, reasoning) ``(None, delta)`` per change of its content, reasoning or tool
    calls, as OpenAI's chat deltas."""
    if gen.reply is None:
        async for piece in gen.pieces():
            yield piece, None
        return
    async for piece in gen.pieces():
        for d in gen.reply.feed(piece):
            yield None, d
    for d in gen.reply.feed("", final=True):
        yield None, d


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, str | None, dict | None]]:
    """The ``deltas`` of several generations as they come, each as ``(its index, content,
    delta)``; the first failure is raised once every generation stopped."""
    if len(gens) == 1:
        async for piece, delta in deltas(gens[0]):
            yield 0, piece, delta
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def run(i: int, g: Generation) -> None:
        try:
            async for piece, delta in deltas(g):
                await q.put((i, piece, delta))
        except BaseException as e:  # noqa: BLE001 - raised by the consumer
            await q.put((i, e, done))
            return
        await q.put((i, None, done))

    tasks = [asyncio.create_task(run(i, g)) for i, g in enumerate(gens)]
    err, left = None, len(gens)
    try:
        while left:
            i, piece, delta = await q.get()
            if delta is done:
                left -= 1
                err = err or piece
                if piece is not None:  # a choice failed: stop the others
                    for t in tasks:
                        t.cancel()
                continue
            yield i, piece, delta
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if err is not None and not isinstance(err, asyncio.CancelledError):
        raise err


async def sse(gen: Generation | list[Generation], rid: str, chat: bool, model: str,
              created: int, include_usage: bool, endpoint: str, m) -> AsyncIterator[bytes]:
    """Server-sent events of one streamed completion (one generation per choice, each
    chunk naming its choice's ``index``), ending in ``data: [DONE]``."""
    gens = gen if isinstance(gen, list) else [gen]
    obj = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list, **extra) -> bytes:
        d = {"id": rid, "object": obj, "created": created, "model": model,
             "system_fingerprint": None, "choices": choices, **extra}
        return b"data: " + json.dumps(d, ensure_ascii=False).encode() + b"\n\n"

    def choice(piece: str | None, finish: str | None, role: bool = False,
               lp: dict | None = None, delta: dict | None = None, index: int = 0) -> dict:
        if chat:
            d: dict = {"role": "assistant", "content": ""} if role else {}
            if piece is not None:
                d["content"] = piece
            d.update(delta or {})
            return {"index": index, "delta": d, "logprobs": lp, "finish_reason": finish}
        return {"index": index, "text": piece or "", "logprobs": lp, "finish_reason": finish}

    status = 200
    try:
        if chat:
            for i in range(len(gens)):
                yield event([choice(None, None, role=True, index=i)])
        try:
            async for i, piece, delta in merged(gens):
                yield event([choice(piece, None, delta=delta, index=i,
                                    lp=await gens[i].take_logprobs(chat, chunk=True))])
        except Exception as e:  # noqa: BLE001 - whatever failed, the client gets an error event
            err = mid_stream(e, rid)
            status = err.status
            yield b"data: " + json.dumps({"error": {"message": err.message, "type": err.type,
                                                    "param": None, "code": err.code}}).encode() \
                + b"\n\n"
            return
        for i, g in enumerate(gens):
            yield event([choice(None if chat else "", g.finish, index=i,
                                lp=await g.take_logprobs(chat, chunk=True))])
        if include_usage:
            yield event([], usage=usage_of(gens))
        yield b"data: [DONE]\n\n"
    finally:
        await close_all(gens)
        m.request(endpoint, status)


def usage_of(gens: list[Generation]) -> dict:
    """A request's ``usage``: each prompt once (the first choice of each counts it), every
    choice's completion tokens."""
    prompt = sum(g.n_prompt for g in gens if g.counts_prompt)
    cached = sum(g.cached for g in gens if g.counts_prompt)
    out = sum(len(g.tokens) for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": cached}}
