"""What the status page (``GET /``) shows, as JSON (``GET /status``): the route's stages and
the front's recent traffic.

Per stage, from a fresh describe of its worker (each asked alone, so one stage down does not
hide the others): layers, endpoint, health, slots in use, sessions, queued steps, and its
compute per decode token. That figure is the mean over the single-token steps the worker
computed since the page's previous poll, from the worker's exact totals
(``decode_compute_s_total`` / ``decode_steps_total``). Without new steps the last figure is
kept, with its age.

For the front, over the last ``WINDOW_S`` seconds: output tokens/s summed over requests, the
median time to first token, and the mean time per output token (the gaps between a request's
consecutive tokens). The seam figure is that time per output token, minus every stage's
compute, spread over the links a token crosses (``dgr.cli.costs`` explains the links of each
step path). With several requests in flight it also holds their waits for each other, and the
page says so.
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Traffic", "StageWatch", "History", "WINDOW_S", "links_of"]

#: the span of the "recent" figures, seconds
WINDOW_S = 10.0
#: how long a stage's describe may take before the page shows it as down, seconds
DESCRIBE_TIMEOUT_S = 2.0


class Traffic:
    """The front's recent tokens and first-token times (a ``WINDOW_S`` sliding window)."""

    def __init__(self, window_s: float = WINDOW_S, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._tokens: collections.deque[tuple[float, float | None]] = collections.deque()
        self._ttft: collections.deque[tuple[float, float]] = collections.deque()
        #: (when, trips, drafted, accepted) of each generation that ended
        self._spec: collections.deque[tuple[float, int, int, int]] = collections.deque()
        self.started = clock()

    def _trim(self, now: float) -> None:
        for q in (self._tokens, self._ttft, self._spec):
            while q and q[0][0] < now - self.window_s:
                q.popleft()

    def token(self, gap_s: float | None) -> None:
        """One output token; ``gap_s``: the time since the request's previous token (None for
        its first)."""
        now = self.clock()
        self._tokens.append((now, gap_s))
        self._trim(now)

    def first_token(self, seconds: float) -> None:
        now = self.clock()
        self._ttft.append((now, seconds))
        self._trim(now)

    def speculation(self, trips: int, drafted: int, accepted: int) -> None:
        """A generation ended: its decode-loop trips, drafts sent and drafts accepted."""
        now = self.clock()
        self._spec.append((now, trips, drafted, accepted))
        self._trim(now)

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        self._trim(now)
        span = min(self.window_s, max(now - self.started, 1e-9))
        gaps = [g for _, g in self._tokens if g is not None]
        ttft = [s for _, s in self._ttft]
        trips, drafted, accepted = (sum(x[i] for x in self._spec) for i in (1, 2, 3))
        return {"window_s": self.window_s,
                "tokens_per_s": len(self._tokens) / span,
                "ttft_ms": 1e3 * statistics.median(ttft) if ttft else None,
                "tpot_ms": 1e3 * statistics.fmean(gaps) if gaps else None,
                # speculation of the generations that ended in the window (None: no drafts)
                "drafted": drafted, "accepted": accepted,
                "acceptance": accepted / drafted if drafted else None,
                "tokens_per_trip": (trips + accepted) / trips if trips and drafted else None}


class History:
    """The status figures of the last ``span_s`` seconds, one sample per ``every_s`` at most:
    what the page's charts draw. A sample is taken when the status is asked for (the page
    polls it), so the charts cover the time a page (or any poller) watched."""

    FIELDS = ("tokens_per_s", "ttft_ms", "waiting", "in_flight", "seam_ms", "acceptance")

    def __init__(self, span_s: float = 300.0, every_s: float = 2.0, clock=time.monotonic):
        self.span_s, self.every_s, self.clock = span_s, every_s, clock
        self._samples: collections.deque[tuple[float, dict[str, Any]]] = collections.deque()

    def add(self, figures: dict[str, Any], compute_ms: list[float | None]) -> None:
        """A sample of ``figures`` (``FIELDS``) and each stage's compute per token, unless
        the last one is younger than ``every_s``."""
        now = self.clock()
        if self._samples and now - self._samples[-1][0] < self.every_s:
            return
        self._samples.append((now, {**{k: figures.get(k) for k in self.FIELDS},
                                    "compute_ms": list(compute_ms)}))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._samples and self._samples[0][0] <= now - self.span_s:
            self._samples.popleft()

    def series(self) -> dict[str, Any]:
        """``{"span_s", "age_s": [...], field: [...], "compute_ms": [[per stage], ...]}``,
        oldest first (``age_s``: seconds before now)."""
        now = self.clock()
        self._trim(now)
        out: dict[str, Any] = {"span_s": self.span_s,
                               "age_s": [now - t for t, _ in self._samples]}
        for k in (*self.FIELDS, "compute_ms"):
            out[k] = [s[k] for _, s in self._samples]
        return out


def links_of(path: str, n_stages: int) -> int:
    """Transport links one decode token crosses on a step path (``dgr.cli.costs``)."""
    return n_stages + 1 if path == "relay" else n_stages


@dataclass
class _Compute:
    steps: int
    compute_s: float
    ms: float | None = None
    at: float | None = None  # monotonic time of the figure


class StageWatch:
    """Each stage's describe, and its compute per decode token between two polls."""

    def __init__(self, route, clock=time.monotonic):
        self.route, self.clock = route, clock
        self._last: dict[str, _Compute] = {}

    async def _describe(self, client):
        return await asyncio.wait_for(client.describe(), DESCRIBE_TIMEOUT_S)

    async def stages(self) -> list[dict[str, Any]]:
        route = self.route
        by_ep = {c.endpoint: c for c in route.clients}
        order = [s.endpoint for s in route.stages]
        known = {s.endpoint: s for s in route.stages}
        got = await asyncio.gather(*(self._describe(by_ep[e]) for e in order),
                                   return_exceptions=True)
        now = self.clock()
        out = []
        for i, (ep, info) in enumerate(zip(order, got)):
            static = known[ep]
            d: dict[str, Any] = {"index": i, "endpoint": ep, "layers": list(static.layers),
                                 "n_slots": int(static.settings["n_slots"]),
                                 "n_ctx": int(static.n_ctx)}
            if isinstance(info, BaseException):
                d.update(health="down", error=f"{type(info).__name__}: {info}"[:300])
                out.append(d)
                continue
            d.update(health="draining" if info.draining else "ok", error=None,
                     slots_used=d["n_slots"] - info.free_slots, sessions=info.sessions,
                     queue_depth=info.queue_depth, free_context=info.free_context,
                     recent_tokens_per_s=info.recent_tokens_per_s,
                     steps_total=info.steps_total, errors_total=info.errors_total)
            d.update(self._compute(ep, info, now))
            out.append(d)
        return out

    def _compute(self, ep: str, info, now: float) -> dict[str, Any]:
        if info.decode_steps_total is None:  # a worker older than the totals
            return {"compute_ms": info.recent_step_ms or None, "compute_age_s": None}
        prev = self._last.get(ep)
        cur = _Compute(info.decode_steps_total, info.decode_compute_s_total)
        if prev is not None and cur.steps >= prev.steps:
            if cur.steps > prev.steps:
                cur.ms = 1e3 * (cur.compute_s - prev.compute_s) / (cur.steps - prev.steps)
                cur.at = now
            else:
                cur.ms, cur.at = prev.ms, prev.at
        self._last[ep] = cur
        return {"compute_ms": cur.ms,
                "compute_age_s": None if cur.at is None else now - cur.at}


def seam_ms(tpot_ms: float | None, stages: list[dict[str, Any]], links: int
            ) -> float | None:
    """Time per output token minus every stage's compute, per link (None: no figure)."""
    comp = [s.get("compute_ms") for s in stages]
    if tpot_ms is None or not links or any(c is None for c in comp):
        return None
    rest = tpot_ms - sum(comp)
    return rest / links if rest >= 0 else None


def model_card(card: dict, stages, media=None) -> dict:
    """``card`` (the model's ``/v1/models`` entry) with the route's context, the smallest of
    its ``stages``', as vLLM spells it (``max_model_len``) and llama-server (``meta``:
    ``n_ctx``, ``n_ctx_train``), and what the projector takes (``capabilities``
    ``multimodal``, ``meta.media``; ``media``: the worker that encodes, default the first
    stage); ``card`` alone before the route is connected."""
    if not stages:
        return dict(card)
    n_ctx = min(int(s.n_ctx) for s in stages)
    train = min(int(getattr(s, "n_ctx_train", 0)) for s in stages)
    first, by = stages[0], media or stages[0]  # ``media``: the worker that encodes
    # llama-server's words: "multimodal" where a projector is loaded
    caps = ["completion"] + (["multimodal"] if getattr(by, "media_marker", "") else [])
    kinds = [k for k, on in (("image", getattr(by, "media_vision", False)),
                             ("audio", getattr(by, "media_audio", False))) if on]
    return {**card, "max_model_len": n_ctx, "capabilities": caps,
            "meta": {"n_ctx": n_ctx, "n_ctx_train": train, "n_vocab": int(first.n_vocab),
                     "media": kinds}}


def context_line(stages) -> str:
    """What the front logs at start: the route's context and the stage that set it."""
    least = min(stages, key=lambda s: int(s.n_ctx))
    why = getattr(least, "n_ctx_source", "")
    return (f"context: {int(least.n_ctx)} tokens per session (the least of the {len(stages)} "
            f"stage(s)': {least.endpoint}, {why if why not in ('', 'set') else '--ctx as set'})")
