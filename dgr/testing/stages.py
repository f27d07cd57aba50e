"""A route's stages as threaded workers in this process, started and stopped as one.

    with threaded_stages(model, [(0, 15), (15, 30)], SETTINGS, evict_after=3600.0) as ws:
        route = Route([w.address for w in ws])

Every worker that started is stopped when the block ends, also when a later one fails to
start (a list comprehension of ``ThreadedWorker`` leaks the ones before it then)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

__all__ = ["threaded_stages"]


@contextlib.contextmanager
def threaded_stages(model, ranges: Sequence[tuple[int, int] | None], settings: dict,
                    **worker_kw) -> Iterator[list]:
    """One ``ThreadedWorker`` per range of ``model`` (None: the whole model), each engine with
    ``settings``, each worker with ``worker_kw``; yields them in route order."""
    from dgr.core.engine import Engine
    from dgr.worker.process import ThreadedWorker

    ws: list[ThreadedWorker] = []
    try:
        for r in ranges:
            ws.append(ThreadedWorker(Engine(model, layers=r, **settings), **worker_kw))
        yield ws
    finally:
        for w in ws:
            w.stop()
