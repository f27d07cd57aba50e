"""A stage's slots outside its steps: a session released or kept as a prefix entry, a new
session opened on an entry (``adopt``) or as copies of another (``fork``), the prefix store's
figures, and the slots released but not yet cleared from the engine.

The step pipeline (``dgr.worker.pipeline.StagePipeline``) owns one ``Slots`` over its engine
and session table; the worker's Shard calls (``Release``, ``Reuse``, ``Fork``) reach it with
the caller's credential.
"""

from __future__ import annotations

import threading

from dgr import errors
from dgr.protocol import prefix
from dgr.worker.history import Histories
from dgr.worker.sessions import SessionTable

__all__ = ["DeferredReleases", "Slots"]


class DeferredReleases:
    """The session table's view of the engine: a released slot is queued (``pending``) and
    dropped from the engine by the next compute, fork or adoption, before it runs (so a slot
    handed to a new session is always empty when that session's first step runs, and table
    calls never wait for compute)."""

    def __init__(self):
        self.pending: list[int] = []

    def release(self, slot: int) -> None:
        self.pending.append(slot)  # the caller holds the table lock

    def take(self) -> list[int]:
        """The pending slots, now the caller's to clear (it holds the table's lock, and the
        engine's)."""
        taken, self.pending = self.pending, []
        return taken


class Slots:
    """Release, keep, adopt and fork sessions' slots (see the module docstring).

    Parameters
    ----------
    engine : dgr.Engine
        Its ``lock`` is held while slots are cleared, copied or cut back.
    table : dgr.worker.sessions.SessionTable
        The sessions and prefix entries (under ``lock``).
    lock : threading.RLock
        The table's lock.
    releases : DeferredReleases
        The slots the table released, not yet cleared from the engine.
    history : dgr.worker.history.Histories or None
        The last stage's token records (None on other stages).
    n_ctx, kv_bytes : int
        Context cells per slot and the KV bytes of all slots (the store's bytes figure).
    """

    def __init__(self, engine, table: SessionTable, lock: threading.RLock,
                 releases: DeferredReleases, history: Histories | None, *, n_ctx: int,
                 kv_bytes: int):
        self.engine, self.table, self.lock = engine, table, lock
        self.releases, self.history = releases, history
        self.n_ctx, self.kv_bytes = int(n_ctx), int(kv_bytes)

    def release(self, session: str, who=None, keep=(), chunk: int = 0,
                whole: int | None = None) -> tuple[bool, bool]:
        """Release ``session`` for ``who`` (the caller's credential: another's is not):
        ``(released, kept)``. With ``keep`` (a hash chain of its first positions: ``whole``
        keys of one ``chunk`` each, all by default, then one key per position:
        ``dgr.protocol.prefix.chain``), its caches stay on its slot as a prefix entry that
        later sessions of the caller adopt (``adopt``), where the store takes it; the last
        stage keeps the token record with it, and keeps nothing without one."""
        with self.lock:
            if not keep:
                return self.table.release(session, who), False
            whole = len(keep) if whole is None else min(whole, len(keep))
            held = prefix.end_of(len(keep) - 1, whole, chunk)
            tokens = None
            if self.history is not None:
                tokens = self.history.record(session)
                if tokens is None or len(tokens) < held:
                    return self.table.release(session, who), False
                del tokens[held:]
            known = session in self.table
            kept = self.table.keep(session, keep, chunk, who, tokens, whole)
            return known and session not in self.table, kept

    def adopt(self, session: str, epoch: int, keys, chunk: int, who=None) -> int:
        """Open ``session`` (at ``epoch``) on ``who``'s prefix entry that holds the most of
        ``keys`` (a hash chain of the new prompt's first positions, one key per ``chunk``):
        the positions it continues at (0: a miss, nothing opened). Runs under the engine's
        lock, as ``fork`` does: the entry's slot is copied (or taken over) and cut back to
        the match before any step of the session runs.

        Raises
        ------
        The table's refusals (``SessionTable.adopt``): the session exists, draining, the
        tenant's cap.
        """
        with self.engine.lock:
            with self.lock:
                got = self.table.adopt(session, epoch, keys, chunk, who)
                if got is None:
                    return 0
                entry, info, copy = got
                releases = self.releases.take()
            try:
                for slot in releases:
                    self.engine.release(slot)
                if copy:
                    self.engine.copy_slot(entry.slot, info.slot)
                self.engine.truncate(info.slot, info.next_pos)
                if self.history is not None:
                    self.history.install(session, epoch, entry.tokens[:info.next_pos])
            except BaseException:
                with self.lock:
                    self.table.release(session)
                raise
        return info.next_pos

    def fork(self, session: str, epoch: int, into: list[str], into_epoch: int,
             who=None) -> int:
        """Open each session of ``into`` (at ``into_epoch``) as a copy of ``session`` at
        ``epoch`` (its caches, bit for bit, and on the last stage its token record): a route's
        ``n`` choices share one prefill. Returns the position they continue at. Runs under
        the engine's lock, after the slots the table released are cleared, so no step comes
        between a new entry and its copy; a failure drops the new entries.

        Raises
        ------
        dgr.errors.InvalidArgument
            ``into`` is empty; an engine that copies no slot (MTP, deepseek4).
        The table's refusals (``SessionTable.fork``).
        """
        if not into:
            raise errors.InvalidArgument("a fork needs at least one new session")
        made = []
        with self.engine.lock:
            try:
                with self.lock:
                    for name in into:
                        src, new = self.table.fork(session, epoch, name, into_epoch, who)
                        made.append(new)
                    releases = self.releases.take()
                for slot in releases:
                    self.engine.release(slot)
                for new in made:
                    self.engine.copy_slot(src.slot, new.slot)
                    if self.history is not None:
                        self.history.fork(session, epoch, new.session, into_epoch)
            except BaseException:
                with self.lock:
                    for new in made:
                        self.table.release(new.session)
                raise
        return src.next_pos

    def prefix_store(self) -> dict[str, int]:
        """The prefix store's figures (``Describe.prefix_store``, the capability record):
        size, entries, positions and bytes they hold, hits, misses and evictions."""
        t = self.table
        with self.lock:
            n, positions = len(t.entries), t.prefix_positions()
            hits, misses, evictions = t.prefix_hits, t.prefix_misses, t.prefix_evictions
        cells = self.n_ctx * int(self.engine.n_slots)
        per = self.kv_bytes / cells if cells else 0.0
        return {"size": t.prefix_entries, "entries": n, "positions": positions,
                "bytes": int(round(positions * per)), "hits": hits, "misses": misses,
                "evictions": evictions}
