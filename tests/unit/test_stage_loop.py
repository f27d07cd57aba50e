"""The stage loop (dgr.worker.scheduler) with a stand-in pipeline: which steps form a batch
(decode steps first, prefill where they leave room, the oldest always, one step per session,
solo steps alone), that a lone step runs on the caller's thread with no handoff, that steps
arriving while the engine computes run together as one batch, and that a failing compute
frees the loop for the next batch."""

from __future__ import annotations

import collections
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from dgr import errors
from dgr.worker.scheduler import RingLoad, StageLoop, take

WAIT = 10.0


def job(session: str, n: int = 1, solo: bool = False, pos: int = 0):
    h = SimpleNamespace(session=session, n_tokens=n, solo=solo, first_pos=pos, loop=None)
    return SimpleNamespace(step=SimpleNamespace(header=h, array=None, lease=None, batch=None))


def names(batch):
    return [(j.step.header.session, j.step.header.n_tokens) for j in batch]


def test_decode_steps_go_before_prefill_and_the_oldest_always_goes():
    q = collections.deque([job("p1", 40), job("d1"), job("p2", 40), job("d2"), job("d3")])
    # the oldest (a prefill chunk) goes first; then every decode step; then what fits
    # (40 + 3 + 40 > 64), in arrival order
    assert names(take(q, 64)) == [("p1", 40), ("d1", 1), ("d2", 1), ("d3", 1)]
    assert names(q) == [("p2", 40)]
    assert names(take(q, 64)) == [("p2", 40)] and not q
    q = collections.deque([job("p1", 30), job("d1"), job("p2", 30), job("d2")])
    assert names(take(q, 64)) == [("p1", 30), ("d1", 1), ("p2", 30), ("d2", 1)]


def test_a_prefill_chunk_goes_in_only_where_decode_leaves_room():
    q = collections.deque([job("d0")] + [job(f"d{i}") for i in range(1, 40)]
                          + [job("p", 32)])
    b = take(q, 64)
    assert len(b) == 40 and ("p", 32) not in names(b)  # 40 + 32 > 64
    assert names(q) == [("p", 32)]
    q = collections.deque([job("d0"), job("d1"), job("p", 32), job("p2", 31)])
    assert names(take(q, 64)) == [("d0", 1), ("d1", 1), ("p", 32)]  # 2 + 32 + 31 > 64
    assert names(q) == [("p2", 31)]


def test_one_step_per_session_in_order():
    q = collections.deque([job("a", pos=0), job("a", pos=1), job("b"), job("a", pos=2)])
    b = take(q, 64)
    assert names(b) == [("a", 1), ("b", 1)]
    assert [j.step.header.first_pos for j in q] == [1, 2]


def test_a_chunk_left_out_keeps_its_sessions_later_steps_behind_it():
    """A session's later chunk never overtakes an earlier one left out of a batch (too big
    for the room left, or one that runs alone): its first chunk must run first. Found by
    benches/soak.py: pipelined prefill of a 2-chunk prompt got UnknownSession/CacheMiss."""
    q = collections.deque([job("b", pos=40), job("a", 32, pos=0), job("a", 16, pos=32)])
    assert names(take(q, 32)) == [("b", 1)]  # a's 32 do not fit next to b's 1: nor do its 16
    assert [(j.step.header.session, j.step.header.first_pos) for j in q] == [("a", 0),
                                                                              ("a", 32)]
    q = collections.deque([job("d"), job("a", 64, pos=0), job("a", 8, pos=64)])
    assert names(take(q, 128)) == [("d", 1)] and names(q) == [("a", 64), ("a", 8)]
    q = collections.deque([job("d"), job("a", 8, pos=0), job("a", pos=8)])
    assert names(take(q, 64)) == [("d", 1), ("a", 8)]  # a's decode waits for its chunk
    assert names(q) == [("a", 1)]


def test_decode_steps_beyond_the_budget_wait():
    q = collections.deque(job(f"s{i}") for i in range(10))
    assert len(take(q, 4)) == 4 and len(q) == 6


def test_a_chunk_of_64_tokens_runs_alone():
    # ggml's flash attention takes 64 query rows of a sequence with its tiled kernel: split
    # into the smaller pieces of a batch, such a chunk would not give its rows alone
    q = collections.deque([job("p", 64), job("d")])
    assert names(take(q, 128)) == [("p", 64)]
    q = collections.deque([job("d"), job("p", 64), job("q", 63)])
    assert names(take(q, 128)) == [("d", 1), ("q", 63)] and names(q) == [("p", 64)]


def test_max_steps_caps_a_batch_oldest_first():
    q = collections.deque([job("p", 8), job("d1"), job("d2"), job("d3"), job("d4")])
    assert names(take(q, 64, max_steps=3)) == [("p", 8), ("d1", 1), ("d2", 1)]
    assert names(take(q, 64, max_steps=3)) == [("d3", 1), ("d4", 1)] and not q
    q = collections.deque([job("a"), job("b")])
    assert names(take(q, 64, max_steps=1)) == [("a", 1)] and names(q) == [("b", 1)]


def test_ring_load_splits_a_ring_into_as_many_groups_as_stages():
    r = RingLoad(horizon=1.0)
    assert r.max_steps(0.0) is None  # no ring session: no cap
    for i in range(16):
        r.see(f"s{i}", 3, 0.0)
    assert r.max_steps(0.1) == 6  # ceil(16 / 3)
    r.see("s0", 3, 0.2)  # a round is known: 0.2 s; a session unseen for 2 rounds is gone
    assert r.round_s == pytest.approx(0.2)
    assert r.max_steps(0.3) == 6
    assert r.max_steps(0.5) == 1  # only s0 (seen at 0.2) is within 0.4 s
    r2 = RingLoad()
    r2.see("a", 3, 0.0)
    assert r2.max_steps(0.0) == 1  # one session: batches of one, no wait
    r2.see("b", 1, 0.0)  # rings of different lengths: the longest counts
    assert r2.max_steps(0.0) == 1  # ceil(2 / 3)
    r3 = RingLoad()  # a one-stage ring has no other stage to keep busy: no cap
    r3.see("x", 1, 0.0)
    assert r3.max_steps(0.0) is None


def test_a_short_round_of_earlier_sessions_does_not_hide_the_sessions_of_a_slower_ring():
    """One session circled a 2-stage ring at 20 ms a round; then 16 sessions circle it at
    170 ms. Each session's own round decides whether it still counts: after their second
    steps all 16 count (batches of 8), though the ring's average round was 20 ms when they
    came (before: they expired between their steps and never counted, batches stayed small)."""
    r = RingLoad(horizon=1.0)
    for i in range(20):
        r.see("solo", 2, 0.02 * i)
    assert r.round_s == pytest.approx(0.02)
    t0 = 10.0
    for rnd in range(3):
        for i in range(16):
            now = t0 + 0.17 * rnd + 0.001 * i
            r.see(f"s{i}", 2, now)
            r.plan(now + 0.05)  # the stage loop plans every batch between the steps
    assert r.plan(t0 + 0.35)[0] == 8
    assert r.plan(t0 + 0.35 + 0.4)[0] is None  # two of their rounds passed: gone


def test_ring_groups_are_runs_of_slots_not_of_arrival():
    """llama.cpp computes a batch's sequences as one ubatch only where their slots are
    consecutive (its equal split), so the ring groups are runs of slots: ranks in slot order
    divided by the cap. Sessions without a known slot keep the order they were first seen."""
    r = RingLoad(horizon=1.0)
    assert r.plan(0.0) == (None, None)
    slots = [0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11]  # arrival order interleaves two runs
    for i, sl in enumerate(slots):
        r.see(f"s{sl}", 2, 0.0, sl)
    cap, groups = r.plan(0.1)
    assert cap == 6
    assert {s for s, g in groups.items() if g == 0} == {f"s{i}" for i in range(6)}
    assert {s for s, g in groups.items() if g == 1} == {f"s{i}" for i in range(6, 12)}
    r2 = RingLoad()
    for name in ("c", "a", "b", "d"):
        r2.see(name, 2, 0.0)  # no slots known
    assert r2.plan(0.0) == (2, {"c": 0, "a": 0, "b": 1, "d": 1})


def test_a_batch_led_by_a_ring_step_takes_only_its_groups_decode_steps():
    q = collections.deque([job("a"), job("x"), job("b"), job("p", 8), job("y"), job("c"),
                           job("d")])
    groups = {"a": 0, "b": 0, "c": 0, "d": 0, "x": 1, "y": 1}
    # the cap counts the ring sessions' steps: a prefill chunk of another session still goes
    assert names(take(q, 64, max_steps=3, group_of=groups)) == [("a", 1), ("b", 1), ("p", 8),
                                                                ("c", 1)]
    assert names(q) == [("x", 1), ("y", 1), ("d", 1)]
    # led by another group's step: that group's
    assert names(take(q, 64, max_steps=3, group_of=groups)) == [("x", 1), ("y", 1)]
    # a decode step of a session outside the ring (no decode loop) is not capped either
    q = collections.deque([job("a"), job("b"), job("z"), job("c")])
    assert names(take(q, 64, max_steps=2, group_of=groups)) == [("a", 1), ("b", 1), ("z", 1)]
    # a step of no group (not a ring session) leads a batch of any decode steps
    q = collections.deque([job("z"), job("a"), job("x")])
    assert names(take(q, 64, group_of=groups)) == [("z", 1), ("a", 1), ("x", 1)]
    # a session's later step never overtakes its earlier one left out
    q = collections.deque([job("a"), job("x", 70, pos=0), job("x", pos=70), job("b")])
    assert names(take(q, 128, group_of=groups)) == [("a", 1), ("b", 1)]


def test_a_ring_step_waits_for_the_piece_of_its_group_that_lagged_last_round():
    """A group split in two pieces travels on as two; a step whose group-mate came here
    last round ``lag`` after it waits that long for it this round (at most a third of a
    round), so the pieces merge. Members ahead of it, or far behind, are not waited for."""
    r = RingLoad(horizon=10.0)
    groups = {"a": 0, "b": 0, "c": 0, "x": 1}
    r.see("a", 2, 0.000)  # round 1: a, then b 4 ms after it, c 90 ms after it
    r.see("b", 2, 0.004)
    r.see("c", 2, 0.110)  # 110 ms behind: more than a third of the round
    r.see("x", 2, 0.001)
    r.see("a", 2, 0.300)  # round 2: a arrives; the round is about 0.3 s
    assert r.group_wait("a", (), groups) == pytest.approx(0.004)  # b lagged 4 ms: wait
    assert r.group_wait("a", {"a", "b"}, groups) == 0.0  # b is here: no wait
    r.see("b", 2, 0.299)  # b came first this round: ahead, gone on
    assert r.group_wait("a", (), groups) == 0.0
    assert r.group_wait("x", (), groups) == 0.0  # x's first step here: no round known
    assert RingLoad().group_wait("a", (), groups) == 0.0


def test_the_loop_waits_for_the_lagging_piece_and_computes_the_group_as_one():
    """A ring step whose group-mate came here a while after it last round does not compute
    alone at an idle stage: it waits, and the group-mate that comes meanwhile joins it.
    (Rounds of 10 s and a lag of 2 s, the bound raised to match: the group-mate's submit
    comes well within the wait even on a loaded machine.)"""
    import time

    p = Pipeline()
    lp = StageLoop(p, max_tokens=64, slot_of=lambda s: {"a": 0, "b": 1, "c": 2}[s])
    lp.ring.wait_bound = 3.0
    try:
        now = time.monotonic()
        # 3 sessions on a 2-stage ring: groups of 2 by slot, a and b, then c; last round b
        # came 2 s after a; a round of 10 s
        lp.ring.see("a", 2, now - 10.0, 0)
        lp.ring.see("b", 2, now - 8.0, 1)
        lp.ring.see("c", 2, now - 5.0, 2)
        cb = Collect(2)
        assert not lp.submit(step("a", ring=2), cb, inline=True)  # not computed alone here
        lp.submit(step("b", ring=2), cb, inline=True)
        assert cb.all.wait(WAIT)
        assert p.batches == [["a", "b"]]
    finally:
        lp.stop(WAIT)


def test_a_convoy_of_ring_steps_leaves_in_groups_of_consecutive_slots():
    """Twelve decode-loop steps of a 2-stage ring that arrive together, in an order that
    interleaves their slots, compute as two batches of six consecutive slots each."""
    p = Pipeline()
    slots = [0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11]
    lp = StageLoop(p, max_tokens=64, slot_of=lambda s: int(s[1:]))
    try:
        p.gate = threading.Event()
        cb = Collect(13)
        assert not lp.submit(step("first"), cb)
        assert p.entered.wait(WAIT)
        for sl in slots:
            assert not lp.submit(step(f"s{sl}", ring=2), cb, inline=True)
        p.gate.set()
        assert cb.all.wait(WAIT)
        assert p.batches == [["first"], [f"s{i}" for i in (0, 1, 2, 3, 4, 5)],
                             [f"s{i}" for i in (6, 7, 8, 9, 10, 11)]]
    finally:
        lp.stop(WAIT)


def test_the_loop_counts_where_its_time_goes():
    """The stage's profile (dgr.worker.profile) gets the loop's commits, turn waits,
    hand-ons and waits."""
    from dgr.worker.profile import PARTS, Profile

    prof = Profile()
    p = Pipeline()
    lp = StageLoop(p, max_tokens=64, profile=prof)
    try:
        done = threading.Event()
        lp.submit(step("a"), lambda s, f: done.set())
        assert done.wait(WAIT)
        from dgr.testing.waits import wait_until

        wait_until(lambda: prof.totals()["idle"] > 0, "the loop idled")
        t = prof.totals()
        assert set(t) == set(PARTS)
        assert t["hand_on"] > 0 and t["commit"] > 0
    finally:
        lp.stop(WAIT)


def test_a_convoy_of_ring_steps_leaves_in_groups(loop):
    """Twelve decode-loop steps of a 3-stage ring that arrive together (one batch of the
    stage before) compute as 3 batches of 4: the next stage can start on the first group
    while this one computes the second."""
    lp, p = loop
    p.gate = threading.Event()
    cb = Collect(13)
    all_done = cb.all
    assert not lp.submit(step("first"), cb)
    assert p.entered.wait(WAIT)
    for i in range(12):
        assert not lp.submit(step(f"s{i}", ring=3), cb, inline=True)
    p.gate.set()
    assert all_done.wait(WAIT)
    assert p.batches == [["first"], [f"s{i}" for i in range(4)],
                         [f"s{i}" for i in range(4, 8)], [f"s{i}" for i in range(8, 12)]]


def test_a_solo_step_runs_alone_and_is_not_taken_into_others():
    q = collections.deque([job("a", solo=True), job("b")])
    assert names(take(q, 64)) == [("a", 1)]
    q = collections.deque([job("b"), job("a", solo=True), job("c")])
    assert names(take(q, 64)) == [("b", 1), ("c", 1)]
    assert names(q) == [("a", 1)]


class Pipeline:
    """Computes a batch by waiting on ``gate`` (when set up) and recording it."""

    def __init__(self, fail=None):
        self.batches: list[list[str]] = []
        self.threads: list[str] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.finished: list[str] = []
        self.fail = fail

    def compute_batch(self, steps, batch_id=0):
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT)
        self.batches.append([s.header.session for s in steps])
        self.threads.append(threading.current_thread().name)
        if self.fail:
            raise self.fail
        for s in steps:
            s.batch = (batch_id, len(steps))
        return [None] * len(steps)

    def finish(self, step, failure=None):
        self.finished.append(step.header.session)


def step(session, n=1, ring=0):
    """A step of ``session``; ``ring``: a decode-loop step on a ring of that many stages."""
    loop = [f"stage{i}" for i in range(ring)] or None
    return SimpleNamespace(header=SimpleNamespace(session=session, n_tokens=n, solo=False,
                                                  loop=loop),
                           array=np.zeros((n, 4), np.float32)[:, :], lease=None, batch=None)


class Collect:
    """A done callback: records each step's session (and in ``also``, when given); ``all``
    is set once ``n`` steps were handed on."""

    def __init__(self, n: int, also: list | None = None):
        self.n, self.sessions, self.also = n, [], also
        self.all = threading.Event()

    def __call__(self, s, f) -> None:
        self.sessions.append(s.header.session)
        if self.also is not None:
            self.also.append(s.header.session)
        if len(self.sessions) == self.n:
            self.all.set()


@pytest.fixture()
def loop():
    p = Pipeline()
    lp = StageLoop(p, max_tokens=64)
    yield lp, p
    lp.stop(WAIT)


def test_a_lone_step_runs_on_the_callers_thread_at_once(loop):
    lp, p = loop
    done = []
    assert lp.submit(step("a"), lambda s, f: done.append((s.header.session, f)), inline=True)
    assert done == [("a", None)] and p.threads == [threading.current_thread().name]
    assert p.finished == ["a"] and lp.batch_sizes == {1: 1}


def test_steps_arriving_while_the_engine_computes_run_as_one_batch(loop):
    lp, p = loop
    p.gate = threading.Event()
    cb = Collect(5)
    all_done, done = cb.all, cb.sessions
    assert not lp.submit(step("first"), cb)  # queued: the loop's thread runs it
    assert p.entered.wait(WAIT)
    for i in range(4):  # the engine is busy: these queue, and are not inline
        assert not lp.submit(step(f"s{i}"), cb, inline=True)
    p.gate.set()
    assert all_done.wait(WAIT)
    assert p.batches == [["first"], ["s0", "s1", "s2", "s3"]]
    assert done == ["first", "s0", "s1", "s2", "s3"]  # handed on in arrival order
    assert set(p.threads) == {"dgr-stage-loop"} and lp.batch_sizes == {1: 1, 4: 1}


def test_a_queued_step_owns_its_boundary():
    p = Pipeline()
    p.gate = threading.Event()
    lp = StageLoop(p, max_tokens=64)
    try:
        buf = np.ones((2, 4), np.float32)
        view = buf[:1]  # a view of the reader's buffer
        lp.submit(step("x"), lambda s, f: None)
        assert p.entered.wait(WAIT)
        s = step("y")
        s.array = view
        lp.submit(s, lambda s, f: None, inline=True)
        buf[:] = 7  # the reader reuses its buffer for the next frame
        assert s.array is not view and (s.array == 1).all()
        p.gate.set()
    finally:
        lp.stop(WAIT)


def test_a_failing_compute_fails_its_steps_and_frees_the_loop():
    p = Pipeline(fail=errors.EngineError("boom"))
    lp = StageLoop(p, max_tokens=64)
    try:
        got = []
        lp.submit(step("a"), lambda s, f: got.append(f), inline=True)
        assert isinstance(got[0], errors.EngineError) and p.finished == ["a"]
        p.fail = None
        ev = threading.Event()
        lp.submit(step("b"), lambda s, f: (got.append(f), ev.set()))
        assert ev.wait(WAIT) and got[1] is None  # the loop still runs
    finally:
        lp.stop(WAIT)


def test_without_batching_one_step_per_forward():
    p = Pipeline()
    p.gate = threading.Event()
    lp = StageLoop(p, max_tokens=64, batching=False)
    try:
        ev = threading.Event()
        n = []
        lp.submit(step("first"), lambda s, f: None)
        assert p.entered.wait(WAIT)
        for i in range(3):
            lp.submit(step(f"s{i}"), lambda s, f: (n.append(1), len(n) == 3 and ev.set()))
        p.gate.set()
        assert ev.wait(WAIT)
        assert p.batches == [["first"], ["s0"], ["s1"], ["s2"]]
    finally:
        lp.stop(WAIT)


def test_batches_hand_on_in_the_order_they_computed():
    # a session's next chunk may compute on another thread while this one's frame is still
    # being sent: it must not be sent first (the next stage would see it first)
    p = Pipeline()
    lp = StageLoop(p, max_tokens=64)
    try:
        order, release_a = [], threading.Event()
        a_in_done = threading.Event()

        def done_a(s, f):
            a_in_done.set()
            assert release_a.wait(WAIT)
            order.append("a")

        lp.submit(step("a"), done_a)  # the loop's thread computes it, then hands it on
        assert a_in_done.wait(WAIT)
        b_done = threading.Event()
        t = threading.Thread(target=lambda: lp.submit(
            step("b"), lambda s, f: (order.append("b"), b_done.set()), inline=True))
        t.start()
        # b computes at once (the engine is free) but waits for a's hand-on
        from dgr.testing.waits import wait_until

        wait_until(lambda: p.batches == [["a"], ["b"]], "b computed")
        assert not b_done.is_set() and order == []
        release_a.set()
        assert b_done.wait(WAIT)
        t.join(WAIT)
        assert order == ["a", "b"]
    finally:
        lp.stop(WAIT)


def test_held_steps_wait_for_the_rest_of_their_burst(loop):
    """Steps submitted with hold=True queue without waking the loop's thread; the first
    submit without it wakes it, and all of them run as one batch."""
    lp, p = loop
    cb = Collect(4)
    all_done = cb.all
    for i in range(3):
        assert not lp.submit(step(f"h{i}"), cb, inline=False, hold=True)
    assert not lp.submit(step("last"), cb, inline=True)  # queue not empty: not inline
    assert all_done.wait(WAIT)
    assert p.batches == [["h0", "h1", "h2", "last"]]


def test_a_held_step_whose_burst_never_ends_still_runs(loop):
    lp, p = loop
    done = threading.Event()
    assert not lp.submit(step("alone"), lambda s, f: done.set(), hold=True)
    assert done.wait(WAIT)  # woken by the loop's bounded wait (HOLD_S), not by a submit
    assert p.batches == [["alone"]]


def test_a_batch_of_several_is_handed_on_inside_one_burst():
    entered = []

    class Burst:
        def __enter__(self):
            entered.append("enter")

        def __exit__(self, *exc):
            entered.append("exit")

    p = Pipeline()
    p.gate = threading.Event()
    lp = StageLoop(p, max_tokens=64, burst=Burst)
    try:
        cb = Collect(4, also=entered)
        all_done = cb.all
        assert not lp.submit(step("first"), cb)
        assert p.entered.wait(WAIT)
        for i in range(3):
            lp.submit(step(f"s{i}"), cb)
        p.gate.set()
        assert all_done.wait(WAIT)
        # the lone first step is handed on without a burst; the batch of 3 inside one
        assert entered == ["first", "enter", "s0", "s1", "s2", "exit"]
    finally:
        lp.stop(WAIT)
