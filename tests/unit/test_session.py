"""dgr.worker.sessions.SessionTable against a fake engine and a fake clock."""

from __future__ import annotations

import pytest

from dgr import errors
from dgr.worker.sessions import SessionTable


class FakeEngine:
    def __init__(self):
        self.released: list[int] = []

    def release(self, slot: int) -> None:
        self.released.append(slot)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def env():
    eng, clock, events = FakeEngine(), Clock(), []
    table = SessionTable(eng, n_slots=2, n_ctx=100, ttl=60.0, evict_after=5.0, clock=clock,
                         listener=lambda *a: events.append(a))
    return table, eng, clock, events


def step(table, session, epoch, first, n):
    lease = table.acquire(session, epoch, first, n)
    table.commit(lease)
    return lease


def test_new_session_starts_at_zero_and_continues(env):
    table, eng, _, events = env
    lease = step(table, "a", 1, 0, 10)
    assert lease.new and lease.slot == 0 and eng.released == [0]
    assert table.get("a").next_pos == 10
    lease = step(table, "a", 1, 10, 1)
    assert not lease.new and lease.slot == 0
    assert table.get("a").next_pos == 11
    assert events == [("open", "a", 1, 0, "")]
    assert table.free_slots == 1 and table.free_context == 200 - 11


def test_unknown_session_past_zero(env):
    table, *_ = env
    with pytest.raises(errors.UnknownSession, match=r"session 'x' is unknown.*position 7"):
        table.acquire("x", 1, 7, 1)
    assert "x" not in table and table.free_slots == 2


def test_gap_is_a_cache_miss_and_changes_nothing(env):
    table, *_ = env
    step(table, "a", 1, 0, 10)
    with pytest.raises(errors.CacheMiss, match=r"position 12 .* continues at 10"):
        table.acquire("a", 1, 12, 1)
    with pytest.raises(errors.CacheMiss):
        table.acquire("a", 1, 9, 1)  # a repeat is a miss too: never compute twice
    step(table, "a", 1, 10, 1)  # the session is intact


def test_stale_epoch(env):
    table, *_ = env
    step(table, "a", 5, 0, 3)
    with pytest.raises(errors.StaleEpoch, match=r"epoch 4 is stale.*epoch 5"):
        table.acquire("a", 4, 3, 1)
    assert table.get("a").epoch == 5 and table.get("a").next_pos == 3


def test_higher_epoch_drops_state_and_needs_position_zero(env):
    table, eng, _, events = env
    step(table, "a", 1, 0, 20)
    with pytest.raises(errors.CacheMiss, match="a new epoch starts at position 0"):
        table.acquire("a", 2, 20, 1)
    assert table.get("a").epoch == 1  # unchanged by the refused step
    eng.released.clear()
    lease = step(table, "a", 2, 0, 5)
    assert lease.new and eng.released == [lease.slot]
    assert table.get("a").epoch == 2 and table.get("a").next_pos == 5
    assert events[-1][:3] == ("epoch", "a", 2)


def test_context_full(env):
    table, *_ = env
    step(table, "a", 1, 0, 99)
    with pytest.raises(errors.ContextFull, match="context of 100"):
        table.acquire("a", 1, 99, 2)
    step(table, "a", 1, 99, 1)
    with pytest.raises(errors.ContextFull):
        table.acquire("b", 1, 0, 101)


def test_busy_session_refuses_a_second_step(env):
    table, *_ = env
    lease = table.acquire("a", 1, 0, 4)
    with pytest.raises(errors.SessionError, match="in flight"):
        table.acquire("a", 1, 4, 1)
    table.commit(lease)
    step(table, "a", 1, 4, 1)


def test_abort_drops_the_session(env):
    table, eng, _, events = env
    step(table, "a", 1, 0, 4)
    lease = table.acquire("a", 1, 4, 1)
    table.abort(lease, "engine failed")
    assert "a" not in table and table.free_slots == 2
    assert events[-1] == ("abort", "a", 1, 0, "engine failed")
    with pytest.raises(errors.UnknownSession):
        table.acquire("a", 1, 5, 1)


def test_full_gives_resource_exhausted_with_retry_hint(env):
    table, _, clock, _ = env
    step(table, "a", 1, 0, 1)
    clock.t += 2.0
    step(table, "b", 1, 0, 1)
    clock.t += 1.0
    # a idle 3 s, b idle 1 s: a becomes evictable in 2 s
    with pytest.raises(errors.ResourceExhausted, match="all 2 slots are in use") as ei:
        table.acquire("c", 1, 0, 1)
    assert ei.value.retry_after == pytest.approx(2.0)
    assert "c" not in table and len(table) == 2


def test_full_with_every_session_busy(env):
    table, *_ = env
    table.acquire("a", 1, 0, 1)
    table.acquire("b", 1, 0, 1)
    with pytest.raises(errors.ResourceExhausted, match="in flight") as ei:
        table.acquire("c", 1, 0, 1)
    assert ei.value.retry_after > 0


def test_lru_eviction_of_idle_sessions(env):
    table, eng, clock, events = env
    step(table, "a", 1, 0, 1)
    clock.t += 1
    step(table, "b", 1, 0, 1)
    clock.t += 1
    step(table, "a", 1, 1, 1)  # a is now the most recently used
    clock.t += 10
    lease = step(table, "c", 1, 0, 1)
    assert "b" not in table and "a" in table and "c" in table
    assert lease.slot == 1
    assert ("evict", "b", 1, 1) == events[-2][:4]
    with pytest.raises(errors.UnknownSession):
        table.acquire("b", 1, 1, 1)


def test_ttl_expiry(env):
    table, eng, clock, events = env
    step(table, "a", 1, 0, 1)
    clock.t += 59
    assert table.expire() == 0
    clock.t += 1
    assert table.expire() == 1
    assert "a" not in table and table.free_slots == 2
    assert events[-1][:2] == ("expire", "a")


def test_busy_sessions_never_expire_or_get_evicted(env):
    table, _, clock, _ = env
    lease = table.acquire("a", 1, 0, 1)
    step(table, "b", 1, 0, 1)
    clock.t += 1000
    assert table.expire() == 1  # only b
    assert "a" in table
    table.commit(lease)


def test_release(env):
    table, eng, *_ = env
    step(table, "a", 1, 0, 3)
    eng.released.clear()
    assert table.release("a") is True
    assert eng.released == [0] and table.free_slots == 2
    assert table.release("a") is False


def test_release_while_busy_then_commit_is_ignored(env):
    table, *_ = env
    lease = table.acquire("a", 1, 0, 3)
    table.release("a")
    table.commit(lease)
    assert "a" not in table and table.free_slots == 2


def test_closed_table_refuses_new_sessions_but_serves_known_ones(env):
    table, *_ = env
    step(table, "a", 1, 0, 3)
    table.closed = True
    with pytest.raises(errors.SessionError, match="draining"):
        table.acquire("b", 1, 0, 1)
    with pytest.raises(errors.SessionError, match="draining"):
        table.acquire("a", 2, 0, 1)
    step(table, "a", 1, 3, 1)


def test_bad_arguments():
    with pytest.raises(errors.InvalidArgument):
        SessionTable(FakeEngine(), 0, 10)
    t = SessionTable(FakeEngine(), 1, 10)
    with pytest.raises(errors.InvalidArgument):
        t.acquire("a", 1, 0, 0)


def test_a_released_step_no_longer_holds_even_when_its_session_comes_back(env):
    table, eng, clock, events = env
    step(table, "a", 1, 0, 4)
    old = table.acquire("a", 1, 4, 1)  # admitted, not computed yet
    assert table.holds(old)
    assert table.release("a")  # a Release while it waits
    assert not table.holds(old)
    new = table.acquire("a", 1, 0, 3)  # the same id and epoch, from 0, perhaps the same slot
    assert new.slot == old.slot and table.holds(new) and not table.holds(old)
    table.abort(old, "late failure")  # the old step's failure must not drop the new entry
    table.commit(old)  # nor may its commit move the new entry's position
    assert table.get("a").busy and table.get("a").next_pos == 0
    table.commit(new)
    assert table.get("a").next_pos == 3 and not table.holds(new)


def test_a_new_session_gets_the_lowest_free_slot():
    # sessions in use stay on consecutive slots: llama.cpp computes consecutive slots in one
    # ubatch when the stage loop batches them (docs/batching.md)
    eng, clock = FakeEngine(), Clock()
    table = SessionTable(eng, n_slots=4, n_ctx=100, ttl=60.0, evict_after=5.0, clock=clock)
    for s in "abcd":
        step(table, s, 1, 0, 1)
    assert [table.get(s).slot for s in "abcd"] == [0, 1, 2, 3]
    table.release("a")
    table.release("c")  # freed last, but not the lowest
    step(table, "e", 1, 0, 1)
    step(table, "f", 1, 0, 1)
    assert (table.get("e").slot, table.get("f").slot) == (0, 2)
