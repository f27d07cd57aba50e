"""Log probabilities of generated tokens, in the OpenAI API's two shapes.

A token's log probability is the log-softmax of the raw logits row that sampled it: the last
stage's output for that position, computed exactly as the whole model's (``dgr.Engine.forward
(..., logits="last")``), before temperature and top-p. The rows come from the route in its
parity mode (``generate(..., logits=True)``): each sampled token's row crosses the last seam,
``n_vocab`` float32, so a request asks for them only when it wants log probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TokenLogprob", "token_logprob", "chat_logprobs", "completion_logprobs",
           "MAX_TOP_CHAT", "MAX_TOP_COMPLETIONS"]

#: the most alternatives a request may ask for (the OpenAI API's bounds)
MAX_TOP_CHAT = 20
MAX_TOP_COMPLETIONS = 5


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id and log probability, and the ``k`` most likely tokens at
    its position, most likely first (``(id, logprob)``)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprob(row: np.ndarray, token: int, k: int) -> TokenLogprob:
    """``token``'s log probability under the logits ``row``, and the top ``k`` (float64)."""
    x = np.asarray(row, dtype=np.float64).reshape(-1)
    m = float(x.max())
    lse = m + float(np.log(np.exp(x - m).sum()))
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, x.size)
        idx = np.argpartition(-x, k - 1)[:k]
        # most likely first; equal logits by token id, so the order is reproducible
        idx = sorted(idx.tolist(), key=lambda i: (-x[i], i))
        top = tuple((int(i), float(x[i] - lse)) for i in idx)
    return TokenLogprob(int(token), float(x[int(token)] - lse), top)


def _entry(text: str, lp: float) -> dict:
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(items: list[TokenLogprob], text_of: dict[int, str]) -> dict:
    """A chat choice's ``logprobs`` (``{"content": [...], "refusal": None}``); ``text_of``
    maps every token id in ``items`` (generated and alternatives) to its text."""
    content = []
    for it in items:
        e = _entry(text_of[it.token], it.logprob)
        e["top_logprobs"] = [_entry(text_of[t], lp) for t, lp in it.top]
        content.append(e)
    return {"content": content, "refusal": None}


def completion_logprobs(items: list[TokenLogprob], text_of: dict[int, str],
                        offset: int = 0) -> dict:
    """A completion choice's ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``); ``offset``: the text offset of the first item (streamed chunks go on
    from the text sent before)."""
    tokens, lps, tops, offsets = [], [], [], []
    for it in items:
        t = text_of[it.token]
        tokens.append(t)
        lps.append(it.logprob)
        top: dict[str, float] = {}
        for tid, lp in it.top:
            top.setdefault(text_of[tid], lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}
