"""The front's prompt cache: sessions kept, caches and all, after their request ends.

As llama-server keeps a slot's cache and reuses its common prefix (``cache_prompt``), the
front keeps up to ``size`` ended sessions open on every stage. A later request of the same API
key whose prompt begins as one of them did takes that session over: every stage drops the
cache past the common prefix and prefills the rest (``AsyncRouteSession.generate``'s
``reuse``). Only positions whose rows a fresh prefill of the new prompt would compute to the
same bits are reused (``AsyncRouteSession.reusable``): whole ``n_ubatch`` chunks prefilled
from position 0 and, where every stage measured that partial chunks compute rows alike
(``prefix_rows_exact``), the prompt rows after them, token by token, and where every stage
also measured that rows computed one per step are alike (``prefix_single_rows_exact``), the
reply's decoded rows a chat's next turn holds (tests/system/test_prefix_cache.py compares every
output with an uncached front's; tests/integration/test_prefix_rows.py a next turn's).

A kept session holds one of the route's slots: a request that finds no free slot closes the
least recently used kept session first, and a kept session idle ``ttl`` seconds is closed
(so a draining worker is not held). One tenant never reuses another's prefix: entries are
per API key. What the kept sessions hold is counted (``bytes_held``): each position a kept
session computed fills one KV cell on every stage, and on a recurrent or hybrid model's route
each stage holds its state and the snapshots of it a next turn may restore.

On such a route (a stage whose ``rollback_window`` is 0) a kept session's caches go back only
to a state snapshot: every stage keeps the state at the ends of the last few whole chunks
prefilled from position 0 (``state_snapshots``, llama-server's context checkpoints), and a
later prompt reuses the largest of them it shares (``AsyncRouteSession.reusable``).

Behind it, with ``store`` (the default), are the stages' own prefix stores
(``dgr.worker.sessions.SessionTable.keep``): a session the front closes after a request that
ended well (out of this pool, or never in it) leaves its caches on every stage (its whole
chunks, and the rows after them this pool's rule would reuse), named by a hash chain of its
tokens salted with its API key (``dgr.protocol.prefix``), and a
request this pool has no session for asks every stage for them in one round trip
(``AsyncRouteSession.adopt``) before it prefills. They outlive the front: another front on
the same workers (or this one restarted) reuses them, under the same API key.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PrefixPool", "session_bytes"]


def session_bytes(session) -> int:
    """The caches a session holds over its route's stages: on each stage, its KV cache over
    its cells (``kv_bytes`` less a recurrent state's, ``/ (n_ctx * n_slots)``) per position
    its steps forwarded (the last sampled token was never forwarded), and a recurrent or
    hybrid model's state (``state_bytes``) with the snapshots of it the stage keeps for the
    session (``snapshots``, host memory)."""
    positions = max((first + count for first, count in session.steps), default=0)
    per, fixed = 0.0, 0
    snaps = len(getattr(session, "snapshots", ()))
    for st in session.route.stages:
        slots = int(st.settings.get("n_slots", 0))
        cells = int(st.n_ctx) * slots
        state = int(getattr(st, "state_bytes", 0))
        if cells > 0:
            per += max(int(st.kv_bytes) - state * slots, 0) / cells
        fixed += state * (1 + snaps)
    return int(round(positions * per)) + fixed


@dataclass
class _Kept:
    key: str | None
    session: Any
    since: float = field(default_factory=time.monotonic)


class PrefixPool:
    """Up to ``size`` ended sessions kept for reuse (``size`` 0: none)."""

    def __init__(self, size: int, ttl: float = 30.0, store: bool = True):
        if size < 0:
            raise ValueError(f"the prompt cache's size must be >= 0, got {size}")
        self.size, self.ttl = size, ttl
        #: whether sessions closed keep their caches in the stages' prefix stores, and new
        #: ones adopt them (where every stage has a store)
        self.store = bool(store)
        #: requests that adopted a prefix from the stages' stores, and the tokens they reused
        self.store_hits = self.store_tokens_reused = 0
        self._kept: collections.OrderedDict[int, _Kept] = collections.OrderedDict()
        self._next = 0
        #: requests that reused a kept prefix, that found none, kept sessions closed to free
        #: a slot or by age, and prompt tokens not prefilled again
        self.hits = self.misses = self.evictions = self.tokens_reused = 0
        #: of those tokens, the ones past whole ``n_ubatch`` chunks (partial chunks' rows)
        self.rows_reused = 0

    def __len__(self) -> int:
        return len(self._kept)

    def take(self, key: str | None, prompt: list[int]) -> tuple[Any, int] | None:
        """The kept session of ``key`` whose cache serves ``prompt`` best, and how many of its
        positions to reuse (taken out of the pool: its slot is the request's); None when
        none reuses a chunk."""
        if not self.size:
            return None
        best, best_n = None, 0
        for i, k in self._kept.items():
            if k.key == key:
                n = k.session.reusable(prompt)
                if n > best_n:
                    best, best_n = i, n
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self.tokens_reused += best_n
        session = self._kept.pop(best).session
        self.rows_reused += best_n % session.route.n_ubatch
        return session, best_n

    def put(self, key: str | None, session) -> list:
        """Keep ``session`` (its request ended well; it holds its slot); returns the sessions
        to close: beyond ``size``, the least recently kept; ``session`` itself when no later
        prompt may reuse it (``reuses``: a recurrent or hybrid model's route)."""
        if not self.size or not getattr(session, "reuses", lambda: True)():
            return [session]
        self._kept[self._next] = _Kept(key, session)
        self._next += 1
        out = []
        while len(self._kept) > self.size:
            out.append(self._kept.popitem(last=False)[1].session)
            self.evictions += 1
        return out

    def evict(self) -> Any | None:
        """The least recently kept session, out of the pool (a request needs its slot)."""
        if not self._kept:
            return None
        self.evictions += 1
        return self._kept.popitem(last=False)[1].session

    def expired(self, now: float | None = None) -> list:
        """The sessions kept longer than ``ttl``, out of the pool."""
        now = time.monotonic() if now is None else now
        old = [i for i, k in self._kept.items() if now - k.since > self.ttl]
        self.evictions += len(old)
        return [self._kept.pop(i).session for i in old]

    def drain(self) -> list:
        """Every kept session, out of the pool (shutdown)."""
        out = [k.session for k in self._kept.values()]
        self._kept.clear()
        return out

    def stores(self, route) -> bool:
        """Whether this front's sessions on ``route`` keep and adopt prefixes in the stages'
        stores: the front uses them (``store``) and every stage has one."""
        return self.store and bool(getattr(route, "prefix_store", False))

    def adopted(self, tokens: int) -> None:
        """A request adopted ``tokens`` positions from the stages' stores (0: none)."""
        if tokens:
            self.store_hits += 1
            self.store_tokens_reused += tokens

    def bytes_held(self) -> int:
        """The KV cache the kept sessions' positions fill, over every stage."""
        return sum(session_bytes(k.session) for k in self._kept.values())

    def snapshot(self) -> dict:
        return {"size": self.size, "kept": len(self._kept), "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions,
                "tokens_reused": self.tokens_reused, "rows_reused": self.rows_reused,
                "bytes": self.bytes_held(), "store": self.store,
                "store_hits": self.store_hits,
                "store_tokens_reused": self.store_tokens_reused}
