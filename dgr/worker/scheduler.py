"""The stage loop: admitted steps of many sessions run on the engine as one forward.

Steps reach a stage from several connections (drivers, the previous stage's link, the decode
loop's link from the last stage). ``StageLoop.submit`` queues an admitted step; whenever the
engine is free, the loop's thread takes every step that is ready and runs them as one batch
(``StagePipeline.compute_batch``: one ``Engine.forward_batch``), then finishes them and hands
each to its ``done`` callback (the relay frame to the next stage, the reply, the decode
loop's next step). The next batch may compute while one hands its steps on, but batches hand
on in the order they computed, and a batch's steps in arrival order: a session's frames
leave a stage in the order its steps ran (its next chunk cannot overtake this one to the
next stage).

A batch (``take``), from the queue in arrival order:

1. the oldest step, whatever it is (nothing waits longer than the batches ahead of it);
2. then every decode step (one token) of another session, while the batch has fewer than
   ``max_tokens`` tokens;
3. then prefill chunks of other sessions, while they fit in ``max_tokens`` tokens.

So a long prefill cannot starve decode steps: a chunk goes in only where the decode steps
leave room, or when it is the oldest step waiting. At most one step of a session goes in a
batch (its steps run in order). A step marked ``solo`` (the route's parity mode) runs alone,
and so does a chunk of ``solo_rows`` tokens or more (64: ggml's flash attention computes 64
query rows of a sequence with its tiled kernel, fewer with another, so such a chunk split into
smaller pieces of a batch would not give its rows alone; see docs/batching.md).

No added wait for a lone step: ``submit(..., inline=True)`` computes on the calling thread
when the engine is idle and nothing is queued, as a stage without batching does. A data-plane
reader asks for it only when no further frame is already waiting on its connection; when one
is, the step queues, the reader reads on, and the frames that arrived together run together.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dgr.worker.step import Step
from dgr.worker.profile import Profile

__all__ = ["StageLoop", "RingLoad", "take", "SOLO_ROWS", "HOLD_S", "GROUP_WAIT_S"]

log = logging.getLogger("dgr.worker")

#: done(step, failure): called once per submitted step, after ``finish``
Done = Callable[[Step, "BaseException | None"], None]


@dataclass(eq=False)
class _Job:
    step: Step
    done: Done
    t: float = field(default_factory=time.monotonic)  # when it was queued


#: a chunk of this many tokens or more runs alone (the flash-attention tile, GGML_FA_TILE_Q)
SOLO_ROWS = 64
#: the longest a held step (``StageLoop.submit(hold=True)``) waits for the rest of its burst
HOLD_S = 0.05
#: the longest a ring step waits for a lagging piece of its group (``RingLoad.group_wait``;
#: a third of the ring's round bounds it too)
GROUP_WAIT_S = 0.25


def take(queue: collections.deque, max_tokens: int, solo_rows: int = SOLO_ROWS,
         max_steps: int | None = None, group_of: dict[str, int] | None = None) -> list:
    """Remove and return the next batch from ``queue`` (items with ``.step``; the rules in
    the module docstring), of at most ``max_steps`` steps (None: no limit). With
    ``group_of`` (session -> ring group, ``RingLoad.plan``), ``max_steps`` counts the steps
    of those sessions only, and the decode steps of a batch whose oldest step is in a group
    are all of that group: a group computes as one run of slots."""
    if not queue:
        return []
    items = list(queue)
    head = items[0]
    batch = [head]

    def alone(h) -> bool:
        return getattr(h, "solo", False) or h.n_tokens >= solo_rows

    if alone(head.step.header):
        queue.popleft()
        return batch
    seen = {head.step.header.session}
    tokens = head.step.header.n_tokens
    picked = {0}
    group = group_of.get(head.step.header.session) if group_of else None
    # with ring groups, the cap counts the ring sessions' steps only: the other sessions'
    # steps (a route without the decode loop, prefill chunks) fill the batch as before
    def capped(h) -> bool:
        return group_of is None or h.session in group_of

    ring_steps = 1 if capped(head.step.header) else 0
    for want_decode in (True, False):
        blocked: set[str] = set()  # sessions with an earlier step left in the queue
        for i, it in enumerate(items):
            if i in picked:
                continue
            h = it.step.header
            if h.session in seen or h.session in blocked:
                continue
            if max_steps is not None and ring_steps >= max_steps and capped(h):
                blocked.add(h.session)  # over the cap: its later steps wait behind it
                continue
            fits = tokens + h.n_tokens <= max_tokens
            if group is not None and want_decode and h.n_tokens == 1 \
                    and group_of.get(h.session, group) != group:
                blocked.add(h.session)  # another group's: it leaves with its own
                continue
            if alone(h) or (h.n_tokens == 1) != want_decode or not fits:
                blocked.add(h.session)  # its later steps must not overtake this one
                if want_decode and not fits and h.n_tokens == 1:
                    break
                continue
            picked.add(i)
            seen.add(h.session)
            tokens += h.n_tokens
            ring_steps += capped(h)
            batch.append(it)
    # the later steps of a session in the batch stay queued, in order, behind it
    queue.clear()
    queue.extend(it for i, it in enumerate(items) if i not in picked)
    # the batch runs in arrival order: done callbacks (sends) keep the order frames came in
    order = {id(it): i for i, it in enumerate(items)}
    batch.sort(key=lambda it: order[id(it)])
    return batch


class RingLoad:
    """The decode-loop sessions a stage sees, how many of their steps one batch takes, and
    which of them go together.

    A ring of ``n`` stages (``Forward.loop``) decoding ``k`` sessions keeps its stages
    computing at the same time only when the sessions travel in about ``n`` groups. A batch
    of all ``k`` would go from stage to stage as one, and only one stage would compute at a
    time (a convoy: the route then serves ``k`` sessions at the speed of one stage's forward
    of ``k``). So a batch takes at most ``ceil(k / n)`` steps while ring sessions are active:
    a convoy splits into ``n`` groups at the first stage it reaches, and the groups stay
    apart. One session gets batches of one, as before.

    The groups are runs of slots: the sessions in slot order, ``ceil(k / n)`` to a group
    (``plan``). llama.cpp computes a batch's sequences as one ubatch only where their slots
    are consecutive (its equal split, one KV stream per slot); a batch of slots 0, 2, 4, 6
    costs four forwards of one. Grouped by slot, a group's batch is one ubatch wherever the
    sessions' slots are dense, and every stage forms the same groups where the stages number
    the sessions alike (each gives a new session its lowest free slot, in the order the
    sessions' first steps reach it).

    ``k`` counts the sessions whose decode step reached this stage within two of their
    rounds (a round: the time between two steps of one session here), within two rounds of
    the ring (the rounds of all sessions, averaged) before a session's own is known, or
    within ``horizon`` seconds before any round is known. A session's entry outlives that
    (``retain`` seconds), so its next step gives its round even after a pause longer than
    the ring's last round.
    """

    def __init__(self, horizon: float = 1.0, retain: float = 30.0,
                 wait_bound: float = GROUP_WAIT_S):
        self.horizon = float(horizon)
        self.retain = float(retain)
        #: the longest a ring step waits for the rest of its group (``group_wait``)
        self.wait_bound = float(wait_bound)
        self.round_s = 0.0  # EWMA of the interval between a session's steps
        #: session -> (last step, ring stages, its slot here or None, its round or 0)
        self._seen: dict[str, tuple[float, int, int | None, float]] = {}
        #: session -> its step before the last one (the last round's arrival here)
        self._prev: dict[str, float] = {}

    def see(self, session: str, ring: int, now: float, slot: int | None = None) -> None:
        """A decode step of ``session`` (on ``slot`` here, when known) on a ring of ``ring``
        stages arrived at ``now``."""
        prev = self._seen.get(session)
        own = 0.0
        if prev is not None:
            own = now - prev[0]
            self.round_s = own if not self.round_s else 0.9 * self.round_s + 0.1 * own
            self._prev[session] = prev[0]
        self._seen[session] = (now, ring, slot, own)

    def _window(self, own: float) -> float:
        return 2.0 * (own or self.round_s) if (own or self.round_s) else self.horizon

    def plan(self, now: float) -> tuple[int | None, dict[str, int] | None]:
        """``(max_steps, group_of)``: the most steps one batch takes now (None: no ring
        session is active) and each active session's group (its rank in slot order, or in
        the order first seen where no slot is known, divided by ``max_steps``; None without a
        cap)."""
        active: list[tuple[int, str]] = []
        n = 0
        for session, (t, ring, slot, own) in list(self._seen.items()):
            if now - t > self.retain:
                del self._seen[session]
                self._prev.pop(session, None)
                continue
            if now - t > self._window(own):
                continue
            active.append((-1 if slot is None else slot, session))
            n = max(n, ring)
        if n < 2:
            return None, None
        m = -(-len(active) // n)
        active.sort(key=lambda a: a[0])  # stable: sessions without a slot as first seen
        return m, {session: i // m for i, (_, session) in enumerate(active)}

    def max_steps(self, now: float) -> int | None:
        """The most steps one batch takes now (None: no ring session is active)."""
        return self.plan(now)[0]

    def group_wait(self, session: str, queued: Container[str], group_of: dict[str, int],
                   bound: float | None = None) -> float:
        """How long after its arrival a ring step of ``session`` waits for the rest of its
        group (0: it does not wait), when the sessions of ``queued`` wait here with it.

        A group split at some stage travels as two pieces, the second one forward behind.
        A member missing from the queue that arrived here last round ``lag`` seconds after
        ``session`` did (0 < lag <= ``bound``, default ``wait_bound``, and at most a third of
        a round) is expected ``lag`` after it this round: the step waits that long, so the
        pieces compute together again. Members that were ahead (they came and went already),
        or further behind, are not waited for.
        """
        g = group_of.get(session)
        prev = self._prev.get(session)
        # a member "behind" by more than a third of a round is as well one ahead of it (a
        # ring): the pieces are not waited for then
        own = self._seen[session][3] if session in self._seen else 0.0
        bound = min(self.wait_bound if bound is None else bound, (own or self.round_s) / 3.0)
        if g is None or prev is None or bound <= 0.0:
            return 0.0
        lag = 0.0
        for other, og in group_of.items():
            if og != g or other == session or other in queued:
                continue
            seen = self._seen.get(other)
            if seen is None:
                continue
            d = seen[0] - prev
            if 0.0 < d <= bound:
                lag = max(lag, d)
        return lag


class StageLoop:
    """The scheduler of one stage (``pipeline``: a ``StagePipeline``).

    Parameters
    ----------
    max_tokens : int
        Tokens in one batch at most (the engine's ``n_ubatch``: one llama.cpp ubatch).
    batching : bool
        False: one step per forward, in arrival order (the loop still serializes them).
    burst : callable, optional
        A context the steps of a batch of several are handed on in (the worker's: their
        relay and loop frames leave as one write per next stage).
    ring_groups : bool
        Cap a batch so that decode-loop sessions travel their ring in as many groups as it
        has stages (``RingLoad``).
    profile : dgr.worker.profile.Profile, optional
        Where the loop adds its waits, commits and hand-ons (the stage's; default: its own).
    slot_of : callable, optional
        ``slot_of(session)``: the session's engine slot (None: unknown); ring groups are runs
        of slots when given (``RingLoad``), else the sessions in arrival order.
    """

    def __init__(self, pipeline, *, max_tokens: int, batching: bool = True,
                 burst: Callable[[], contextlib.AbstractContextManager] | None = None,
                 ring_groups: bool = True, profile: Profile | None = None,
                 slot_of: Callable[[str], int | None] | None = None):
        self.p = pipeline
        #: a session's slot on this stage (None: unknown), which ring groups follow
        self.slot_of = slot_of
        #: where the loop's waits, commits and hand-ons are counted (``dgr.worker.profile``)
        self.profile = profile if profile is not None else Profile()
        #: split decode-loop sessions into as many groups as their ring has stages
        #: (``RingLoad``); False: a batch takes every ready step (up to ``max_tokens``)
        self.ring_groups = bool(ring_groups)
        #: ``burst()``: a context a batch of several steps is handed on in (its relay and
        #: loop frames then leave as one write per next stage: they arrive together and
        #: batch together there)
        self.burst = burst
        self.max_tokens = max(1, int(max_tokens))
        self.batching = bool(batching)
        self._cv = threading.Condition(threading.Lock())
        self._queue: collections.deque[_Job] = collections.deque()
        self._busy = False  # a compute is running (the loop's thread or an inline caller)
        # batches hand their steps on in the order they computed, even when the next batch
        # computes on another thread meanwhile: a session's frames leave in order
        self._order = itertools.count()
        self._turn = 0
        self._turn_cv = threading.Condition(threading.Lock())
        self._stop = False
        self._ids = itertools.count(1)
        #: batches run and steps in them (``batch_sizes[k]``: batches of k steps)
        self.batches = 0
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        #: steps computed on the submitting thread (the engine idle, nothing queued)
        self.inline_runs = 0
        #: decode-loop sessions and the batch size that keeps their ring's stages busy
        self.ring = RingLoad()
        self._thread = threading.Thread(target=self._run, name="dgr-stage-loop", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(self, step: Step, done: Done, *, inline: bool = False,
               hold: bool = False) -> bool:
        """Run ``step`` (admitted) and call ``done(step, failure)`` once it finished.

        ``inline``: compute on this thread if the engine is idle and nothing is queued (the
        caller then returns after ``done``; True); else the step queues (False), and the
        frame buffer its boundary views is copied (the caller's buffer is reused for its
        next frame).

        ``hold``: queue without waking the loop's thread, because the caller is about to
        submit more (further frames of a burst already wait on its connection): the loop
        then takes them as one batch, not the first alone. The next submit without
        ``hold`` wakes it; so does ``HOLD_S`` passing (a burst cut short).
        """
        h = step.header
        slot = self.slot_of(h.session) if self.slot_of is not None and h.loop else None
        with self._cv:
            ring = bool(h.loop) and h.n_tokens == 1
            if ring:
                self.ring.see(h.session, len(h.loop), time.monotonic(), slot)
            run_here = inline and not self._busy and not self._queue and not self._stop
            if run_here and ring and self.ring_groups and self.batching:
                # its group's other members are expected soon: the loop waits for them
                _, groups = self.ring.plan(time.monotonic())
                run_here = not (groups and self.ring.group_wait(h.session, (), groups))
            if run_here:
                self._busy = True
                self.inline_runs += 1
                turn = next(self._order)
            else:
                if step.array is not None and not step.array.flags.owndata:
                    step.array = np.array(step.array)
                self._queue.append(_Job(step, done))
                if not hold:
                    self._cv.notify()
        if run_here:
            self._compute([_Job(step, done)], turn)
        return run_here

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._queue and not self._busy):
                    if self._stop and not self._queue:
                        return
                    # the timeout bounds how long a held step (submit(hold=True)) waits
                    t0 = time.perf_counter()
                    held = bool(self._queue)
                    self._cv.wait(HOLD_S)
                    self.profile.add("held" if held else "idle", time.perf_counter() - t0)
                now = time.monotonic()
                cap, groups = self.ring.plan(now) if self.ring_groups else (None, None)
                # the head waits for the rest of its group, unless steps outside its group
                # are queued too (they would wait behind it: the stage has work now)
                head = (self._queue[0] if groups and self.batching and not self._stop
                        else None)
                if head is not None and head.step.header.loop \
                        and head.step.header.n_tokens == 1:
                    hh = head.step.header
                    g = groups.get(hh.session)
                    if g is not None and all(groups.get(j.step.header.session) == g
                                             for j in self._queue):
                        wait = self.ring.group_wait(
                            hh.session, {j.step.header.session for j in self._queue}, groups)
                        left = head.t + wait - now
                        if left > 0:
                            t0 = time.perf_counter()
                            self._cv.wait(left)
                            self.profile.add("held", time.perf_counter() - t0)
                            continue
                batch = (take(self._queue, self.max_tokens, max_steps=cap, group_of=groups)
                         if self.batching else [self._queue.popleft()])
                self._busy = True
                turn = next(self._order)
            self._compute(batch, turn)

    def _compute(self, batch: list[_Job], turn: int) -> None:
        """Compute a batch (``_busy`` held), let the next one start, then hand each step on
        once every batch computed before it has (``turn``: its place in that order)."""
        steps = [j.step for j in batch]
        fails: list[BaseException | None] = [None] * len(steps)
        run = 0
        try:
            fails = self.p.compute_batch(steps, batch_id=next(self._ids))
            run = sum(1 for s in steps if s.batch is not None)
        except BaseException as e:  # noqa: BLE001 - every step gets its failure
            fails = [e] * len(steps)
        finally:
            t0 = time.perf_counter()
            for s, f in zip(steps, fails):
                self.p.finish(s, f)
            profile = self.profile
            t1 = time.perf_counter()
            profile.add("commit", t1 - t0)
            with self._cv:  # the engine is free: the next batch may start
                self._busy = False
                if run:
                    self.batches += 1
                    self.batch_sizes[run] += 1
                if self._queue:
                    self._cv.notify()
        with self._turn_cv:
            self._turn_cv.wait_for(lambda: self._turn == turn)
        t2 = time.perf_counter()
        profile.add("turn_wait", t2 - t1)
        try:
            with (self.burst() if self.burst is not None and len(batch) > 1
                  else contextlib.nullcontext()):
                for j, f in zip(batch, fails):
                    try:
                        j.done(j.step, f)
                    except Exception:  # noqa: BLE001 - one step's send must not stop the loop
                        log.exception("handing on a computed step failed")
        except Exception:  # noqa: BLE001 - a burst's flush reports to each step itself
            log.exception("handing on a batch failed")
        finally:
            profile.add("hand_on", time.perf_counter() - t2)
            with self._turn_cv:
                self._turn += 1
                self._turn_cv.notify_all()

    def stop(self, timeout: float | None = None) -> None:
        """Run what is queued (a stopped pipeline refuses it, counted as not run), then end
        the loop's thread; waits for the compute running now (None: however long)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)
