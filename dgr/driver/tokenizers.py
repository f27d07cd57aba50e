"""Where a route tokenizes: the first stage over its control RPCs, or a local tokenizer."""

from __future__ import annotations

from typing import Any

import numpy as np

from dgr import errors

__all__ = ["LocalTokenizer", "RemoteTokenizer"]


class RemoteTokenizer:
    """The first stage's tokenizer; follows the route when that stage is replaced.

    ``route`` is the ``AsyncRoute``: its first client answers, and a first stage that is
    unavailable or too slow is replaced (``route.replace_stage``) and asked again, at most
    ``route.max_retries`` times.
    """

    def __init__(self, route: Any):
        self.route = route

    async def _call(self, fn):
        r = self.route
        for attempt in range(r.max_retries + 1):
            client = r.clients[0]
            try:
                return await fn(client)
            except (errors.WorkerUnavailable, errors.StepDeadlineExceeded) as e:
                if isinstance(e, errors.NoHealthyWorker) or attempt == r.max_retries:
                    raise
                await r.replace_stage(0, client, e)

    async def tokenize(self, text, add_special, parse_special):
        return await self._call(lambda c: c.tokenize(text, add_special, parse_special))

    async def detokenize(self, tokens):
        return await self._call(lambda c: c.detokenize(tokens))

    async def token_pieces(self, first, count):
        return await self._call(lambda c: c.token_pieces(first, count))


class LocalTokenizer:
    """A local tokenizer (anything with ``tokenize``/``detokenize``, e.g. a ``dgr.Engine``)."""

    def __init__(self, tok):
        self.tok = tok

    async def tokenize(self, text, add_special, parse_special):
        return np.asarray(self.tok.tokenize(text, add_special, parse_special), dtype=np.int32)

    async def detokenize(self, tokens):
        return self.tok.detokenize(tokens)

    async def token_pieces(self, first, count):
        return list(self.tok.token_pieces(first, count))
