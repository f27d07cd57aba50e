"""Fixtures the system tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def stages(smollm2, request):
    """SmolLM2 served by threaded workers, one per layer range: the module's ``RANGES``
    (default: two halves), each engine with the module's ``SETTINGS``."""
    from dgr.testing.stages import threaded_stages

    ranges = getattr(request.module, "RANGES", [(0, 15), (15, 30)])
    with threaded_stages(smollm2, ranges, request.module.SETTINGS) as ws:
        yield ws
