"""The recovery policy: which failures the driver repairs, how a failed stage is replaced, and
the repair itself (a new epoch and a re-prefill of the session's history).

A route change is a cache miss plus a re-prefill (docs/failover.md). The session applies this
policy around whichever step path it runs (``dgr.driver.paths``): a step that fails with a
``retryable`` error is repaired by ``Recovery.recover`` and tried again, at most
``max_retries`` times.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from dgr import errors
from dgr.protocol.describe import StageInfo
from dgr.transport.client import ShardClient

__all__ = ["RECOVERABLE", "STAGE_FAILED", "Recovery", "release_quietly", "retryable"]

# Failures the driver repairs by re-prefilling under a new epoch (on the same route, or after
# replacing the stage that failed). Everything else (bad request, model mismatch, a route that
# does not fit, frame errors) is fatal and never retried.
RECOVERABLE = (errors.CacheMiss, errors.UnknownSession, errors.StaleEpoch,
               errors.StepDeadlineExceeded, errors.ResourceExhausted, errors.WorkerUnavailable)
# ... of which these mean the stage itself is suspect: ask the provider for a replacement.
STAGE_FAILED = (errors.StepDeadlineExceeded, errors.WorkerUnavailable)


def retryable(exc: BaseException) -> bool:
    """Whether the driver repairs ``exc`` by recovery (re-prefill, maybe on another worker)."""
    if isinstance(exc, errors.NoHealthyWorker):
        return False
    return isinstance(exc, RECOVERABLE) or type(exc) is errors.SessionError


async def release_quietly(client: ShardClient, session: str, timeout: float) -> None:
    """Ask ``client``'s worker to free ``session``; a worker that cannot be reached frees it
    by TTL."""
    try:
        await client.release(session, timeout=timeout)
    except Exception:  # noqa: BLE001 - the old worker is gone: its TTL frees the session
        pass


class Recovery:
    """The recovery policy of one route (``route`` is the ``AsyncRoute``).

    Replacing a stage is the route's (one session replaces it for every session: the others
    see the new client and re-prefill there); the epoch and the replay are the session's.
    """

    def __init__(self, route: Any):
        self.route = route
        self._locks: list[asyncio.Lock] = []
        #: clients of replaced stages (closed with the route)
        self.retired: list[ShardClient] = []
        #: stage replacements done by this route: (layers, old endpoint, new endpoint)
        self.replacements: list[tuple[tuple[int, int], str, str]] = []

    def reset(self, n_stages: int) -> None:
        """A route of ``n_stages`` was connected: one replacement lock per stage."""
        self._locks = [asyncio.Lock() for _ in range(n_stages)]

    # -- which stage, and its replacement ----------------------------------------------------

    async def unresponsive_stage(self) -> int | None:
        """The first stage that does not answer a describe within ``probe_timeout`` (None:
        all answer)."""
        r = self.route
        res = await asyncio.gather(*(c.describe(timeout=r.probe_timeout) for c in r.clients),
                                   return_exceptions=True)
        for i, x in enumerate(res):
            if isinstance(x, BaseException):
                return i
        return None

    async def replace_stage(self, i: int, failed: ShardClient, err: BaseException) -> bool:
        """Replace stage ``i`` (whose client ``failed`` failed with ``err``) by a healthy
        worker of the same range from the provider. Returns False when another session did it
        already. Raises ``NoHealthyWorker`` naming the range when none answers within
        ``connect_timeout``."""
        r = self.route
        async with self._locks[i]:
            if r.clients[i] is not failed:
                return False
            st = r.stages[i]
            r.provider.report_failure(st.endpoint, st.layers, err)
            client, info = await self._find(st)
            r.clients[i], r.stages[i] = client, info
            self.retired.append(failed)
            self.replacements.append((tuple(st.layers), st.endpoint, info.endpoint))
            return True

    async def _find(self, st: StageInfo) -> tuple[ShardClient, StageInfo]:
        """A vetted worker for ``st``'s range: connects and describes within
        ``probe_timeout``, same model identity, settings and range, not draining; candidates
        are asked again, with backoff, until ``connect_timeout`` runs out."""
        r = self.route
        a, b = st.layers
        deadline = time.monotonic() + r.connect_timeout
        tried: dict[str, str] = {}
        attempt = 0
        while True:
            for ep in await r.provider.candidates(st.layers):
                c = ShardClient(ep, timeout=r.timeout, security=r.security)
                try:
                    await c.wait_ready(r.probe_timeout)
                    info = await c.describe(timeout=r.probe_timeout)
                    if info.identity != st.identity or tuple(info.layers) != tuple(st.layers):
                        raise errors.ModelMismatch(
                            f"{ep} serves {info.identity} layers {list(info.layers)}, not "
                            f"{st.identity} layers [{a}, {b})")
                    if info.draining:
                        raise errors.WorkerDraining(f"{ep} is draining")
                except errors.DgrError as e:
                    tried[ep] = f"{type(e).__name__}: {e}"
                    r.provider.report_failure(ep, st.layers, e)
                    await c.close()
                    continue
                r.provider.report_success(ep, info.layers)
                return c, info
            left = deadline - time.monotonic()
            if left <= 0:
                why = "; ".join(f"{k}: {v}" for k, v in tried.items()) or \
                    "the route provider has no worker for it"
                raise errors.NoHealthyWorker(
                    f"no healthy worker serves layers [{a}, {b}) within "
                    f"{r.connect_timeout:g} s ({why})")
            await asyncio.sleep(min(left, r.backoff * 2 ** min(attempt, 5), 1.0))
            attempt += 1

    # -- the repair ----------------------------------------------------------------------

    async def recover(self, s: Any, err: BaseException, attempt: int = 1) -> None:
        """Repair session ``s`` after ``err`` (its ``attempt``-th repair of one step): wait
        (the retry hint, or backoff), replace the failed stage if it failed (deadline,
        unavailable), raise the epoch and replay the history hop by hop (over gRPC, so a
        stage that fails during the replay names itself), in the chunks it was first
        computed in: the caches are bit-identical."""
        r = self.route
        i = getattr(err, "stage_index", None)
        if isinstance(err, errors.ResourceExhausted):
            await asyncio.sleep(min(max(err.retry_after or 0.1, 0.01), 5.0))
        elif type(err) is errors.SessionError:
            await asyncio.sleep(0.05)
        elif attempt > 1:
            await asyncio.sleep(min(r.backoff * 2 ** (attempt - 2), 2.0))
        if i is None and r.relay and isinstance(err, STAGE_FAILED):
            i = await self.unresponsive_stage()  # a relayed step does not say where it stuck
        hops = s.hop_by_hop
        if i is not None and isinstance(err, STAGE_FAILED):
            await self.replace_stage(i, hops.client(i), err)
            hops.forget(i)
        elif i is not None and isinstance(err, errors.StaleEpoch):
            # the worker holds a newer epoch of this session id: free it, start over there
            await release_quietly(r.clients[i], s.id, r.probe_timeout)
        s.recoveries += 1
        s.epoch += 1
        s.rollback = 0  # the new epoch starts from empty caches
        hist = s.history
        for p, n in s.steps:
            await hops.forward(hist[p:p + n], p, "boundary", None, media=s.media.get(p))
