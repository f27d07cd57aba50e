"""The front's queue (``dgr.serve.admission.Admission``): requests beyond the free slots wait
in arrival order, a request of ``n`` slots takes them at once, a waiter's deadline is a 503
with ``Retry-After``, only a full queue is a 429, and a cancelled waiter loses no slot."""

from __future__ import annotations

import asyncio

import pytest

from dgr.serve.admission import Admission
from dgr.serve.api_errors import ApiError
from dgr.serve.metrics import ServeMetrics


def _admission(capacity=2, **kw) -> Admission:
    a = Admission(kw.pop("queue_timeout", 30.0), None, ServeMetrics(), **kw)
    a.open(capacity)
    return a


def _sample(a: Admission, name: str) -> float:
    return a.metrics.registry.get_sample_value(name) or 0.0


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_waiters_are_served_in_arrival_order_and_n_slots_at_once():
    async def go():
        a = _admission(2)
        await a.acquire_slot(2)  # a request of two choices takes both
        order = []

        async def want(name, n):
            await a.acquire_slot(n)
            order.append(name)

        tasks = [asyncio.create_task(want("two", 2)), asyncio.create_task(want("one", 1))]
        await _settle()
        assert a.waiting == 2 and not a.slot_free
        assert _sample(a, "dgr_serve_queue_length") == 2
        a.release()  # one slot: "two" needs both, and "one" may not pass it
        await _settle()
        assert order == [] and a.waiting == 2
        a.release()
        await _settle()
        assert order == ["two"] and a.waiting == 1
        a.release(2)
        await _settle()
        assert order == ["two", "one"] and a.waiting == 0 and a.free_slots() == 1
        await asyncio.gather(*tasks)
        assert _sample(a, "dgr_serve_queue_wait_seconds_count") == 3

    asyncio.run(go())


def test_only_a_full_queue_is_a_429_with_retry_after():
    async def go():
        a = _admission(1, max_queue=2)
        await a.acquire_slot()
        waiters = [asyncio.create_task(a.acquire_slot()) for _ in range(2)]
        await _settle()
        with pytest.raises(ApiError) as e:
            await a.acquire_slot()
        assert e.value.status == 429 and e.value.code == "queue_full"
        assert e.value.headers["Retry-After"] == "2"  # two waiting ahead of one slot
        assert _sample(a, "dgr_serve_queue_refused_total") == 1
        for _ in waiters:
            a.release()
            await _settle()
        await asyncio.gather(*waiters)
        a.release()
        assert a.free_slots() == 1

    asyncio.run(go())


def test_no_queue_refuses_at_once():
    async def go():
        a = _admission(1, max_queue=0)
        await a.acquire_slot()
        with pytest.raises(ApiError) as e:
            await a.acquire_slot()
        assert e.value.status == 429

    asyncio.run(go())


def test_a_waiter_past_its_deadline_is_a_503_and_the_next_one_is_served():
    async def go():
        a = _admission(1, queue_timeout=0.05)
        await a.acquire_slot()
        with pytest.raises(ApiError) as e:
            await a.acquire_slot()
        assert e.value.status == 503 and e.value.code == "queue_timeout"
        assert e.value.headers["Retry-After"] == "1"
        assert _sample(a, "dgr_serve_queue_timeouts_total") == 1
        assert a.waiting == 0
        a.release()
        await a.acquire_slot()  # the slot was never lost
        assert a.free_slots() == 0

    asyncio.run(go())


@pytest.mark.parametrize("granted", [False, True], ids=["waiting", "just-granted"])
def test_a_cancelled_waiter_gives_its_place_and_any_grant_back(granted):
    async def go():
        a = _admission(1)
        await a.acquire_slot()
        first = asyncio.create_task(a.acquire_slot())
        second = asyncio.create_task(a.acquire_slot())
        await _settle()
        if granted:
            a.release()  # the slot is handed to the first waiter, which is cancelled before
            # it runs again: the slot goes on to the second
        first.cancel()
        try:
            await first
        except asyncio.CancelledError:
            pass
        else:  # a grant that raced the cancel (3.11's wait_for keeps it): the waiter holds it
            assert granted
            a.release()
        if not granted:
            a.release()
        await asyncio.wait_for(second, 1)
        assert a.waiting == 0 and a.free_slots() == 0
        a.release()
        assert a.free_slots() == 1

    asyncio.run(go())
