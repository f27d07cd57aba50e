"""Who may generate now: the route's slots (a request waits for one, at most
``queue_timeout`` seconds) and each API key's cap of requests in flight."""

from __future__ import annotations

import asyncio
import logging
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
    for one and in flight (``active``: request id -> its generation), and per API key."""

    def __init__(self, queue_timeout: float, max_per_key: int | None, metrics):
        if max_per_key is not None and max_per_key < 0:
            raise ValueError(f"max_per_key must be >= 0, got {max_per_key}")
        self.queue_timeout = queue_timeout
        self._max_per_key = max_per_key
        self.metrics = metrics
        self.capacity = 0
        self.per_key_cap = 0  # 0: no cap
        self.waiting = 0
        self.active: dict[str, Any] = {}
        self.per_key: dict[str, int] = {}
        self._slots: asyncio.Semaphore | None = None

    def open(self, capacity: int) -> None:
        """The route is connected: it has ``capacity`` slots."""
        self.capacity = capacity
        self._slots = asyncio.Semaphore(capacity)
        self.per_key_cap = (per_key_default(capacity) if self._max_per_key is None
                            else self._max_per_key)

    @property
    def in_flight(self) -> int:
        return len(self.active)

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

    async def acquire_slot(self) -> None:
        """Wait for one of the route's slots; a 429 after ``queue_timeout`` seconds."""
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), self.queue_timeout)
        except asyncio.TimeoutError:
            raise ApiError(429, f"every one of the route's {self.capacity} slot(s) is busy "
                                f"(waited {self.queue_timeout:g} s); retry later",
                           type="rate_limit_error", code="slots_busy",
                           headers={"Retry-After": "1"}) from None
        finally:
            self.waiting -= 1

    def started(self, rid: str, gen: Any) -> None:
        """Request ``rid`` holds a slot (acquired) and generates (``gen``)."""
        self.active[rid] = gen

    @property
    def slot_free(self) -> bool:
        """Whether a slot is free now (a request would not wait)."""
        return self._slots is not None and not self._slots.locked()

    def ended(self, rid: str, release: bool = True) -> None:
        """Request ``rid`` ended: its slot is free (``release``), or the prompt cache keeps
        its session, slot and all (``dgr.serve.prefix``)."""
        self.active.pop(rid, None)
        if release:
            self._slots.release()

    def release(self) -> None:
        """A slot the prompt cache held is free (its session closed)."""
        self._slots.release()
