"""Worker-side session state: (session, epoch) -> engine slot, positions, TTL and eviction."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from dgr.errors import (
    CacheMiss,
    ContextFull,
    InvalidArgument,
    ResourceExhausted,
    SessionError,
    SessionForbidden,
    StaleEpoch,
    UnknownSession,
)

__all__ = ["SessionTable", "Lease", "SessionInfo", "SlotEngine", "PrefixEntry"]


class SlotEngine(Protocol):
    """What the table needs of an engine: dropping a slot's state.

    ``release`` must take effect after any compute already started on that slot and before
    any compute started later (the worker defers it to its next compute, which applies it
    under the engine's lock before it runs).
    """

    def release(self, slot: int) -> None: ...


@dataclass
class SessionInfo:
    """One session's state on this worker (read-only outside the table)."""

    session: str
    epoch: int
    slot: int
    next_pos: int = 0
    last_used: float = 0.0
    created: float = 0.0
    busy: bool = False
    steps: int = 0
    ticket: int = 0  # the admitted step's lease (Lease.ticket) while busy
    owner: str = ""  # the name of the credential that opened it ("": no credentials)
    by_peer: bool = False  # opened by a peer credential (relayed from another stage)


@dataclass(frozen=True)
class Lease:
    """Permission to run one step of ``session`` on ``slot`` (see ``SessionTable.acquire``)."""

    session: str
    epoch: int
    slot: int
    first_pos: int
    n_tokens: int
    new: bool  # the step starts a fresh (session, epoch): the slot was just cleared
    ticket: int = 0  # unique per admitted step in its table: names this step exactly


@dataclass
class PrefixEntry:
    """An ended session's caches kept on its slot for later sessions (the stage's prefix
    store): ``keys[i]`` names positions ``0 .. end_of(i) - 1`` (a hash chain over their token
    ids, which the driver computes: ``dgr.protocol.prefix.chain``): the first ``whole`` one
    whole ``chunk`` each, the rest one position each. ``tokens``: what the worker keeps with
    it (the last stage's token record)."""

    keys: tuple[bytes, ...]
    chunk: int
    slot: int
    owner: str
    last_used: float
    tokens: object = None
    whole: int | None = None  # None: every key names a whole chunk

    def __post_init__(self):
        if self.whole is None or self.whole > len(self.keys):
            self.whole = len(self.keys)

    def end_of(self, i: int) -> int:
        """The positions keys ``0 .. i`` name."""
        return (i + 1) * self.chunk if i < self.whole else \
            self.whole * self.chunk + (i - self.whole + 1)

    @property
    def positions(self) -> int:
        return self.end_of(len(self.keys) - 1) if self.keys else 0

    def match(self, keys) -> int:
        """How many of ``keys``' first keys this entry holds."""
        n = 0
        for a, b in zip(self.keys, keys):
            if a != b:
                break
            n += 1
        return n


#: event callback: (event, session, epoch, slot, detail)
Listener = Callable[[str, str, int, int, str], None]


class SessionTable:
    """Maps route sessions to the sequence slots of one engine; never computes on a gap.

    Rules (for a step of ``n`` tokens of ``(session, epoch)`` starting at ``first_pos``):

    - a new session, or a higher epoch of a known one: its old state is dropped and the step
      must start at position 0 (otherwise ``UnknownSession`` for a new session, ``CacheMiss``
      for a higher epoch);
    - a lower epoch: ``StaleEpoch``;
    - the current epoch: ``first_pos`` must be the next expected position (``CacheMiss``),
      less the ``rollback`` the step states (rejected drafts it drops from the cache first;
      the stage truncates its caches before it computes);
    - ``first_pos + n`` must fit in the slot's context (``ContextFull``);
    - a new session needs a free slot: idle sessions past ``ttl`` are expired first, then the
      least recently used session idle for at least ``evict_after`` is evicted; when none
      qualifies, ``ResourceExhausted`` with ``retry_after`` (seconds until one would).

    With credentials (``who``: an object with ``name``, ``peer`` and ``max_sessions``, a
    ``dgr.transport.security.Credential``), a session belongs to the credential that opened
    it: a step of another non-peer credential gets ``SessionForbidden`` and its release is
    refused (False), except that a session a peer opened (relayed here by another stage, so
    this worker never saw its tenant) may be released by any credential (its id is the
    capability: the driver that made it releases it on every stage) and taken over by a
    tenant's step under a higher epoch (which starts from an empty cache: its driver moved
    it to the gRPC path, or recovered it), and a non-peer credential opens at most its
    ``max_sessions`` (else the table's ``max_sessions_per_owner``; None: no cap but the
    slots), beyond which its new session gets ``ResourceExhausted``. Peer credentials (the
    cluster's workers, relaying for every tenant) act on any session and are not capped.

    The table is not thread-safe: the worker calls it under its table lock. Compute happens
    between ``acquire`` and ``commit``/``abort``; a session is ``busy`` meanwhile and a second
    step for it is refused. An explicit release (or a drain) may drop a busy session: its
    slot is free at once, so the step must check ``holds`` right before it computes.

    Parameters
    ----------
    engine : object with ``release(slot)``
        The engine whose slots are managed.
    n_slots, n_ctx : int
        Slots and context tokens per slot (the engine's).
    ttl : float
        Seconds after which an idle session expires.
    evict_after : float
        Minimum idle seconds before a session may be evicted to make room (LRU first).
    clock : callable
        Monotonic clock (tests inject a fake one).
    listener : callable, optional
        Called as ``listener(event, session, epoch, slot, detail)`` for ``open``, ``epoch``,
        ``release``, ``expire``, ``evict``, ``abort``, ``keep``, ``adopt`` (the worker logs
        them).
    prefix_entries : int
        The prefix store's size (0: none): how many ended sessions' caches the table keeps,
        each on its own slot, for later sessions of the same credential that begin with the
        same tokens (``keep``, ``adopt``). An entry holds a slot no session holds: a new
        session that finds no free slot takes the least recently used entry's first, and an
        entry idle ``ttl`` seconds is dropped.
    """

    def __init__(self, engine: SlotEngine, n_slots: int, n_ctx: int, *, ttl: float = 600.0,
                 evict_after: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 listener: Listener | None = None, prefix_entries: int = 0):
        if n_slots < 1 or n_ctx < 1:
            raise InvalidArgument(f"n_slots and n_ctx must be >= 1, got {n_slots}, {n_ctx}")
        if ttl <= 0 or evict_after < 0:
            raise InvalidArgument(f"ttl must be > 0 and evict_after >= 0, got {ttl}, {evict_after}")
        self.engine = engine
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.ttl = ttl
        self.evict_after = evict_after
        self._clock = clock
        self._listener = listener
        self._sessions: dict[str, SessionInfo] = {}
        self._free: list[int] = list(range(n_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._tickets = 0
        #: no new sessions or epochs (``SessionError``). The worker's drain does not set it:
        #: it refuses new work at admission, and steps admitted before it began still open
        #: their sessions when they reach the engine
        self.closed = False
        #: sessions a non-peer credential may hold when its own ``max_sessions`` is unset
        self.max_sessions_per_owner: int | None = None
        self._owned: collections.Counter[str] = collections.Counter()
        if prefix_entries < 0:
            raise InvalidArgument(f"prefix_entries must be >= 0, got {prefix_entries}")
        self.prefix_entries = prefix_entries
        #: the prefix store, least recently used first, by slot
        self._entries: collections.OrderedDict[int, PrefixEntry] = collections.OrderedDict()
        #: adoptions that found an entry, that found none, entries dropped for a slot, by age
        #: or by a longer one of the same prefix
        self.prefix_hits = self.prefix_misses = self.prefix_evictions = 0

    # -- facts ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session: str) -> bool:
        return session in self._sessions

    def get(self, session: str) -> SessionInfo | None:
        return self._sessions.get(session)

    @property
    def free_slots(self) -> int:
        """Slots a new session may take now: the free ones and the prefix entries'."""
        return len(self._free) + len(self._entries)

    @property
    def entries(self) -> list[PrefixEntry]:
        """The prefix store's entries, least recently used first."""
        return list(self._entries.values())

    @property
    def free_context(self) -> int:
        """Context tokens not yet used, over all slots."""
        return self.n_slots * self.n_ctx - sum(s.next_pos for s in self._sessions.values())

    @property
    def busy(self) -> int:
        return sum(1 for s in self._sessions.values() if s.busy)

    # -- steps ---------------------------------------------------------------------------

    def acquire(self, session: str, epoch: int, first_pos: int, n_tokens: int,
                who=None, rollback: int = 0) -> Lease:
        """Check a step against the session's state and reserve its slot.

        Returns
        -------
        Lease
            Pass it to ``commit`` after a successful compute, or to ``abort`` after a failed
            one.

        Raises
        ------
        StaleEpoch, CacheMiss, UnknownSession, ContextFull, ResourceExhausted, SessionForbidden
            As described in the class docstring; the table is unchanged except for expired or
            evicted idle sessions.
        SessionError
            The session already has a step in flight.
        dgr.errors.WorkerDraining
            Not raised here: the worker checks draining itself (``closed`` only blocks new
            sessions and epochs, with ``SessionError``).
        """
        if n_tokens < 1:
            raise InvalidArgument(f"a step needs at least one token, got {n_tokens}")
        now = self._clock()
        s = self._sessions.get(session)
        tenant = who is not None and not who.peer
        if s is not None and tenant and s.owner != who.name:
            if not (s.by_peer and epoch > s.epoch and not s.busy):
                raise SessionForbidden(f"session {session!r} was opened by another credential")
            # a relayed session (a peer opened it) that its driver now steps directly, under
            # a new epoch (its recovery, or the gRPC path): the step drops the old cache, so
            # nothing of it is read; the session becomes the tenant's, within its cap
            self._check_cap(who)
            self._disown(s)
            s.owner, s.by_peer = who.name, False
            self._owned[s.owner] += 1
        if s is not None and s.busy:
            raise SessionError(f"session {session!r} already has a step in flight; send the "
                               "next step after its reply")
        if s is not None and epoch < s.epoch:
            raise StaleEpoch(f"session {session!r} epoch {epoch} is stale: this worker serves "
                             f"epoch {s.epoch}")
        if s is not None and epoch == s.epoch:
            if first_pos + rollback != s.next_pos:
                rb = f" after rolling back {rollback}" if rollback else ""
                raise CacheMiss(f"session {session!r} epoch {epoch}: step starts at position "
                                f"{first_pos}{rb} but this worker's cache continues at "
                                f"{s.next_pos}; re-prefill under a new epoch")
            self._check_ctx(session, first_pos, n_tokens)
            s.busy = True
            s.last_used = now
            s.ticket = self._next_ticket()
            return Lease(session, epoch, s.slot, first_pos, n_tokens, new=False, ticket=s.ticket)
        # a new session or a higher epoch: the step must start a sequence
        if first_pos != 0:
            if s is None:
                raise UnknownSession(f"session {session!r} is unknown to this worker (expired, "
                                     f"evicted or the worker restarted); step at position "
                                     f"{first_pos} needs its cache: re-prefill from 0")
            raise CacheMiss(f"session {session!r} moves to epoch {epoch} (from {s.epoch}) with a "
                            f"step at position {first_pos}; a new epoch starts at position 0")
        self._check_ctx(session, first_pos, n_tokens)
        if self.closed:
            raise SessionError("this worker takes no new sessions or epochs (draining)")
        if s is not None:  # higher epoch: reuse the slot, drop its state
            self.engine.release(s.slot)
            self._emit("epoch", session, epoch, s.slot, f"from epoch {s.epoch}")
            s.epoch, s.next_pos, s.busy, s.last_used = epoch, 0, True, now
            s.ticket = self._next_ticket()
            return Lease(session, epoch, s.slot, 0, n_tokens, new=True, ticket=s.ticket)
        owner = who.name if who is not None else ""
        if tenant:
            self._check_cap(who)
        slot = self._take_slot(now)
        self.engine.release(slot)  # whatever a previous owner left there
        t = self._next_ticket()
        self._sessions[session] = SessionInfo(session, epoch, slot, 0, now, now, busy=True,
                                              ticket=t, owner=owner,
                                              by_peer=who is not None and who.peer)
        self._owned[owner] += 1
        self._emit("open", session, epoch, slot, "")
        return Lease(session, epoch, slot, 0, n_tokens, new=True, ticket=t)

    def fork(self, session: str, epoch: int, into: str, into_epoch: int,
             who=None) -> tuple[SessionInfo, SessionInfo]:
        """Open session ``into`` (epoch ``into_epoch``) on a slot of its own, continuing at
        ``session``'s next position: ``(the source's entry, the new one)``. The caller copies
        the source slot's caches into the new one (``Engine.copy_slot``) before any step of
        ``into`` runs, and drops the new entry (``release``) if it cannot.

        Raises
        ------
        UnknownSession, StaleEpoch
            The source is not here, or not at ``epoch``.
        SessionForbidden
            Another credential's source (peers may fork any).
        SessionError
            The source has a step in flight, ``into`` exists already, or the table is closed.
        ResourceExhausted
            No slot, or the tenant's cap.
        """
        s = self._sessions.get(session)
        tenant = who is not None and not who.peer
        if s is None:
            raise UnknownSession(f"session {session!r} is unknown to this worker: nothing to "
                                 "fork")
        if tenant and s.owner != who.name:
            raise SessionForbidden(f"session {session!r} was opened by another credential")
        if s.epoch != epoch:
            raise StaleEpoch(f"session {session!r} is at epoch {s.epoch} here, not {epoch}")
        if s.busy:
            raise SessionError(f"session {session!r} has a step in flight: fork it after the "
                               "step's reply")
        if into in self._sessions:
            raise SessionError(f"session {into!r} exists already: a fork opens a new session")
        if self.closed:
            raise SessionError("this worker takes no new sessions or epochs (draining)")
        if tenant:
            self._check_cap(who)
        now = self._clock()
        slot = self._take_slot(now)
        self.engine.release(slot)  # whatever a previous owner left there
        owner = who.name if who is not None else ""
        new = SessionInfo(into, into_epoch, slot, s.next_pos, now, now, owner=owner,
                          by_peer=who is not None and who.peer)
        self._sessions[into] = new
        self._owned[owner] += 1
        s.last_used = now
        self._emit("fork", into, into_epoch, slot, f"from {session!r} at {s.next_pos}")
        return s, new

    def holds(self, lease: Lease) -> bool:
        """Whether ``lease`` still owns its slot: the session was not released (and its slot
        perhaps handed to another session) since ``acquire``. A step whose lease no longer
        holds must not compute: it would write into another session's cache."""
        return self._current(lease) is not None

    def _current(self, lease: Lease) -> SessionInfo | None:
        """The session entry ``lease`` was issued for, if it is still the admitted step's."""
        s = self._sessions.get(lease.session)
        if s is None or not s.busy or s.ticket != lease.ticket:
            return None
        return s

    def commit(self, lease: Lease) -> None:
        """The step of ``lease`` computed: the session now continues after it."""
        s = self._current(lease)
        if s is None:
            return  # released while computing (drain, explicit release): nothing to record
        s.next_pos = lease.first_pos + lease.n_tokens
        s.busy = False
        s.steps += 1
        s.last_used = self._clock()

    def abort(self, lease: Lease, reason: str = "") -> None:
        """The step of ``lease`` failed in compute: drop the session (its cache is suspect)."""
        s = self._current(lease)
        if s is None:
            return  # not this step's entry any more: someone else's state, leave it
        self._drop(s, "abort", reason)

    # -- housekeeping --------------------------------------------------------------------

    def release(self, session: str, who=None) -> bool:
        """Drop a session now (explicit release). False when it was unknown (or, with
        ``who`` a non-peer credential, another's)."""
        s = self._sessions.get(session)
        if s is None or (who is not None and not who.peer and s.owner != who.name
                         and not s.by_peer):
            return False
        self._drop(s, "release", "")
        return True

    def expire(self) -> int:
        """Drop idle sessions and prefix entries older than ``ttl``; returns how many
        sessions."""
        now = self._clock()
        old = [s for s in self._sessions.values() if not s.busy and now - s.last_used >= self.ttl]
        for s in old:
            self._drop(s, "expire", f"idle {now - s.last_used:.0f} s")
        for e in [e for e in self._entries.values() if now - e.last_used >= self.ttl]:
            self._forget(e, "expire", f"idle {now - e.last_used:.0f} s")
        return len(old)

    def clear(self) -> None:
        """Drop every idle session and prefix entry (shutdown)."""
        for s in [s for s in self._sessions.values() if not s.busy]:
            self._drop(s, "release", "shutdown")
        for e in list(self._entries.values()):
            self._forget(e, "release", "shutdown")

    # -- the prefix store ----------------------------------------------------------------

    def keep(self, session: str, keys, chunk: int, who=None, tokens=None,
             whole: int | None = None) -> bool:
        """End ``session`` as ``release`` does, but keep its slot's caches as a prefix entry
        named by ``keys`` (the first ``whole`` one per ``chunk`` positions from 0, the rest one
        per position after them: ``PrefixEntry``; the session holds at least that many). False,
        and the session released as usual, when the store is off, the keys name nothing or more
        than it holds, or the session has a step in flight; False without release when
        ``release`` refuses (unknown, another credential's).

        The entry belongs to the credential that keeps it (``who``'s name; "" without
        credentials): only that credential adopts it. A kept entry replaces the caller's
        entries whose keys it continues (it holds the same positions and more); beyond the
        store's size, the least recently used entry is dropped."""
        s = self._sessions.get(session)
        if s is None or (who is not None and not who.peer and s.owner != who.name
                         and not s.by_peer):
            return False
        keys = tuple(bytes(k) for k in keys)
        entry = PrefixEntry(keys, chunk, s.slot, "", 0.0, tokens, whole)
        if (not self.prefix_entries or not keys or chunk < 1 or s.busy
                or entry.positions > s.next_pos):
            self._drop(s, "release", "")
            return False
        owner = who.name if who is not None else s.owner
        now = self._clock()
        entry.owner, entry.last_used = owner, now
        del self._sessions[s.session]
        self._disown(s)
        for e in [e for e in self._entries.values()
                  if e.owner == owner and e.chunk == chunk and e.match(keys) == len(e.keys)]:
            self._forget(e, "evict", "a longer entry of the same prefix")
        self._entries[s.slot] = entry
        self._emit("keep", s.session, s.epoch, s.slot, f"{entry.positions} positions")
        while len(self._entries) > self.prefix_entries:
            self._forget(next(iter(self._entries.values())), "evict", "the store is full")
        return True

    def adopt(self, session: str, epoch: int, keys, chunk: int,
              who=None) -> tuple[PrefixEntry, SessionInfo, bool] | None:
        """Open ``session`` (at ``epoch``) on the credential's entry that holds the most of
        ``keys`` (a chain as the entries': whole chunks' keys, then rows' keys) in chunks of
        ``chunk``: ``(the entry, the new session, copy)``. With ``copy`` the session has a free
        slot of its own and the caller copies the entry's slot into it (``Engine.copy_slot``:
        the entry stays for others); else the entry's slot became the session's (the entry is
        gone). Either way the session continues where the matched keys end and the caller drops
        the slot's positions from there (``Engine.truncate``) before any step of it runs, or
        releases the session if it cannot. None when no entry holds the first key (a miss):
        nothing was opened.

        Raises
        ------
        SessionError
            ``session`` exists already, or the table is closed (draining).
        ResourceExhausted
            The tenant's cap.
        """
        if session in self._sessions:
            raise SessionError(f"session {session!r} exists already: only a new session "
                               "adopts a prefix")
        if self.closed:
            raise SessionError("this worker takes no new sessions or epochs (draining)")
        keys = tuple(bytes(k) for k in keys)
        owner = who.name if who is not None else ""
        best, n = None, 0
        for e in self._entries.values():
            if e.owner == owner and e.chunk == chunk:
                m = e.match(keys)
                if m > n:
                    best, n = e, m
        if best is None:
            self.prefix_misses += 1
            return None
        if who is not None and not who.peer:
            self._check_cap(who)
        now = self._clock()
        self.prefix_hits += 1
        best.last_used = now
        copy = bool(self._free)
        if copy:
            self._entries.move_to_end(best.slot)
            slot = self._free.pop()
            self.engine.release(slot)  # whatever a previous owner left there
        else:
            slot = best.slot
            del self._entries[slot]
        held = best.end_of(n - 1)
        info = SessionInfo(session, epoch, slot, held, now, now, owner=owner,
                           by_peer=who is not None and who.peer)
        self._sessions[session] = info
        self._owned[owner] += 1
        self._emit("adopt", session, epoch, slot,
                   f"{held} positions {'copied from' if copy else 'on'} slot {best.slot}")
        return best, info, copy

    def prefix_positions(self) -> int:
        """The positions the prefix store's entries hold, summed."""
        return sum(e.positions for e in self._entries.values())

    def _forget(self, e: PrefixEntry, event: str, detail: str) -> None:
        """Drop prefix entry ``e`` (its slot becomes free)."""
        del self._entries[e.slot]
        if event != "release":
            self.prefix_evictions += 1
        self.engine.release(e.slot)
        self._free.append(e.slot)
        self._free.sort(reverse=True)
        self._emit(event, "", 0, e.slot, f"prefix entry of {e.positions} positions; {detail}")

    def owned(self, owner: str) -> int:
        """Sessions held by the credential named ``owner``."""
        return self._owned.get(owner, 0)

    def snapshot(self) -> list[SessionInfo]:
        return [SessionInfo(**vars(s)) for s in self._sessions.values()]

    # -- internals -----------------------------------------------------------------------

    def _next_ticket(self) -> int:
        self._tickets += 1
        return self._tickets

    def _check_ctx(self, session: str, first_pos: int, n_tokens: int) -> None:
        if first_pos + n_tokens > self.n_ctx:
            raise ContextFull(f"session {session!r}: positions {first_pos}..{first_pos + n_tokens - 1} "
                              f"do not fit the context of {self.n_ctx} tokens per session")

    def _disown(self, s: SessionInfo) -> None:
        """``s`` no longer counts against its owner's sessions."""
        self._owned[s.owner] -= 1
        if not self._owned[s.owner]:
            del self._owned[s.owner]

    def _check_cap(self, who) -> None:
        """Raise ``ResourceExhausted`` when the tenant ``who`` holds its cap of sessions."""
        cap = who.max_sessions or self.max_sessions_per_owner
        if cap is not None and self._owned[who.name] >= cap:
            raise ResourceExhausted(
                f"credential {who.name!r} holds {self._owned[who.name]} sessions on this "
                "worker, its cap: release one (or let one expire) first",
                retry_after=max(self.evict_after, 0.1))

    def _take_slot(self, now: float) -> int:
        if not self._free:
            self.expire()
        if not self._free and self._entries:
            self._forget(next(iter(self._entries.values())), "evict", "a session needs its slot")
        if self._free:
            return self._free.pop()
        idle = [s for s in self._sessions.values() if not s.busy]
        ready = [s for s in idle if now - s.last_used >= self.evict_after]
        if ready:
            victim = min(ready, key=lambda s: s.last_used)
            self._drop(victim, "evict", f"idle {now - victim.last_used:.1f} s, least recently used")
            return self._free.pop()
        if idle:
            wait = max(min(self.evict_after - (now - s.last_used) for s in idle), 0.0)
            why = f"the least recently used idle session may be evicted in {wait:.2f} s"
        else:
            wait = 0.1
            why = "every session has a step in flight"
        raise ResourceExhausted(f"all {self.n_slots} slots are in use; {why}",
                                retry_after=round(max(wait, 0.01), 3))

    def _drop(self, s: SessionInfo, event: str, detail: str) -> None:
        del self._sessions[s.session]
        self._disown(s)
        # With a step in flight this must run after it: the worker's engine adapter defers
        # release() to the next compute, which holds the engine's lock, so it does.
        self.engine.release(s.slot)
        # the lowest free slot goes out next: the sessions in use stay on consecutive slots,
        # which llama.cpp computes in one ubatch when they are batched (docs/batching.md)
        self._free.append(s.slot)
        self._free.sort(reverse=True)
        self._emit(event, s.session, s.epoch, s.slot, detail)

    def _emit(self, event: str, session: str, epoch: int, slot: int, detail: str) -> None:
        if self._listener is not None:
            self._listener(event, session, epoch, slot, detail)
