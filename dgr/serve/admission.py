"""Who may generate now: the route's slots (a request waits for them in a bounded queue, in
order, at most ``queue_timeout`` seconds) and each API key's cap of requests in flight."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from dgr.serve.api_errors import ApiError

__all__ = ["Admission", "per_key_default"]

log = logging.getLogger("dgr.serve")


def per_key_default(capacity: int) -> int:
    """The default cap on one API key's generation requests in flight: half the route's
    slots (at least 1), so one key never takes every slot of a route with two or more."""
    return max(1, capacity // 2)


class Admission:
    """The front's counts: slots (``capacity``, the fewest any stage has), requests waiting
    for them and in flight (``active``: request id -> its generation), and per API key.

    A request beyond the free slots waits in a queue, served in arrival order (a request of
    ``n`` slots takes them all at once, so two never hold part of what each needs), each for
    at most ``queue_timeout`` seconds (then a 503 with ``Retry-After``). Only a full queue
    (``max_queue`` requests waiting) answers at once: a 429 with ``Retry-After``."""

    def __init__(self, queue_timeout: float, max_per_key: int | None, metrics,
                 max_queue: int = 128):
        if max_per_key is not None and max_per_key < 0:
            raise ValueError(f"max_per_key must be >= 0, got {max_per_key}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.queue_timeout = queue_timeout
        self.max_queue = max_queue
        self._max_per_key = max_per_key
        self.metrics = metrics
        self.capacity = 0
        self.per_key_cap = 0  # 0: no cap
        self.active: dict[str, Any] = {}
        self.per_key: dict[str, int] = {}
        self._free = 0
        #: the waiting requests, oldest first: (slots wanted, the future their grant sets)
        self._queue: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    def open(self, capacity: int) -> None:
        """The route is connected: it has ``capacity`` slots."""
        self.capacity = capacity
        self._free = capacity
        self.per_key_cap = (per_key_default(capacity) if self._max_per_key is None
                            else self._max_per_key)

    @property
    def in_flight(self) -> int:
        return len(self.active)

    @property
    def waiting(self) -> int:
        """Requests in the queue now."""
        return len(self._queue)

    def take_key(self, key: str | None) -> bool:
        """Count one more request in flight for ``key``; False (nothing counted) at its cap."""
        cap = self.per_key_cap
        if key is None or not cap:
            return True
        held = self.per_key.get(key, 0)
        if held >= cap:
            self.metrics.key_refused(key)
            log.info("API key %r is at its cap of %d request(s) in flight: 429", key, cap)
            return False
        self.per_key[key] = held + 1
        self.metrics.key_in_flight(key, held + 1)
        return True

    def give_key(self, key: str | None) -> None:
        """Count one request of ``key`` (taken by ``take_key``) no longer in flight."""
        if key is None or key not in self.per_key:
            return
        held = self.per_key[key] - 1
        if held:
            self.per_key[key] = held
        else:
            del self.per_key[key]
        self.metrics.key_in_flight(key, held)

    def free_slots(self) -> int:
        """Slots no request holds and none waits for."""
        return self._free if not self._queue else 0

    async def acquire_slot(self, n: int = 1) -> None:
        """``n`` of the route's slots, at once: now if free and no one waits before, else in
        the queue's order within ``queue_timeout`` seconds (a 503 after); a 429 at once when
        ``max_queue`` requests wait already."""
        if n > self.capacity:
            raise ValueError(f"{n} slots asked of a route of {self.capacity}")
        if not self._queue and self._free >= n:
            self._free -= n
            self.metrics.queued(0.0)
            return
        if len(self._queue) >= self.max_queue:
            self.metrics.queue_refused()
            raise ApiError(429, f"every one of the route's {self.capacity} slot(s) is busy and "
                                f"{len(self._queue)} request(s) wait for one already (the "
                                f"queue holds {self.max_queue}); retry later",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self._retry_after())})
        fut = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._queue.append(entry)
        self.metrics.queue_length(len(self._queue))
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout)
        except asyncio.TimeoutError:
            if fut.done():  # granted as the deadline passed: it is this request's
                self.metrics.queued(time.monotonic() - t0)
                return
            fut.cancel()
            self.metrics.queue_timed_out()
            raise ApiError(503, f"every one of the route's {self.capacity} slot(s) stayed busy "
                                f"for the {self.queue_timeout:g} s this request may wait in the "
                                "queue (--queue-timeout); retry later", type="server_error",
                           code="queue_timeout",
                           headers={"Retry-After": str(self._retry_after())}) from None
        except BaseException:  # cancelled (the client went away): a grant goes back
            if fut.done() and not fut.cancelled():
                self._give(n)
            else:
                fut.cancel()
            raise
        finally:
            try:
                self._queue.remove(entry)
            except ValueError:
                pass  # granted: _grant took it off
            self.metrics.queue_length(len(self._queue))
            self._grant()
        self.metrics.queued(time.monotonic() - t0)

    def _retry_after(self) -> int:
        """Seconds a refused client should wait: one a queued request ahead of it per slot."""
        return max(1, len(self._queue) // max(self.capacity, 1))

    def _give(self, n: int) -> None:
        self._free += n
        self._grant()

    def _grant(self) -> None:
        """Hand free slots to the queue's oldest requests while they fit (in order: a request
        never passes an older one)."""
        while self._queue:
            n, fut = self._queue[0]
            if fut.done():  # timed out or cancelled: its waiter takes it off
                self._queue.popleft()
                continue
            if self._free < n:
                return
            self._free -= n
            self._queue.popleft()
            fut.set_result(None)

    def started(self, rid: str, gen: Any) -> None:
        """Request ``rid`` holds a slot (acquired) and generates (``gen``)."""
        self.active[rid] = gen

    @property
    def slot_free(self) -> bool:
        """Whether a slot is free now (a request would not wait)."""
        return self.free_slots() > 0

    def ended(self, rid: str, release: bool = True) -> None:
        """Request ``rid`` ended: its slot is free (``release``), or the prompt cache keeps
        its session, slot and all (``dgr.serve.prefix``)."""
        self.active.pop(rid, None)
        if release:
            self._give(1)

    def release(self, n: int = 1) -> None:
        """``n`` slots are free again (a request's, or a session's the prompt cache held)."""
        self._give(n)
