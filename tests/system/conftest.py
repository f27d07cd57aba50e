"""Fixtures the system tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def stages(smollm2, request):
    """SmolLM2 served by threaded workers, one per layer range: the module's ``RANGES``
    (default: two halves), each engine with the module's ``SETTINGS``."""
    import dgr
    from dgr.worker.process import ThreadedWorker

    settings = request.module.SETTINGS
    ranges = getattr(request.module, "RANGES", [(0, 15), (15, 30)])
    ws = []
    try:
        for r in ranges:
            ws.append(ThreadedWorker(dgr.Engine(smollm2, layers=r, **settings)))
        yield ws
    finally:
        for w in ws:
            w.stop()
