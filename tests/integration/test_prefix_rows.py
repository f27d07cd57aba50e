"""Whether a stage computes a partial prefill chunk's rows as any partial chunk does
(dgr.control.prefix): measured on every range of a split, refused where the kernels differ
(ggml's CPU flash attention tiles a chunk of 64 rows or more), remembered per build and stage,
and served in Describe, where a route reads it before reusing kept rows."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import dgr
from dgr.control import prefix
from dgr.transport.client import ShardClient
from dgr.worker.process import ThreadedWorker

SMALL = dict(n_ctx=256, n_slots=2, n_threads=1)


@pytest.mark.parametrize("layers", [None, (0, 1), (1, 3), (3, 4)])
def test_partial_chunks_compute_rows_alike_on_every_range(tiny_llama, layers):
    e = dgr.Engine(tiny_llama, layers=layers, n_ubatch=32, **SMALL)
    assert prefix.rows_exact(e)
    # the check leaves the slot empty: a session there starts at position 0
    assert e.forward(0, 0, np.arange(3) if e.is_first else None,
                     None if e.is_first else np.zeros((3, e.n_embd_boundary), np.float32)
                     ).shape[0] in (1, 3)


def test_chunks_past_the_tiling_threshold_are_not_alike(tiny_llama):
    # 127 rows as one chunk take the tiled flash attention; 125 + 2 do not, all of them
    e = dgr.Engine(tiny_llama, n_ubatch=128, **SMALL)
    assert not prefix.rows_exact(e)
    # too small a chunk to hold two partial chunks of two rows: not claimed
    assert not prefix.rows_exact(dgr.Engine(tiny_llama, n_ubatch=3, **SMALL))


def test_the_measurement_is_remembered_per_stage(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("DGR_CACHE", str(tmp_path))
    e = dgr.Engine(tiny_llama, layers=(1, 3), n_ubatch=16, **SMALL)
    assert prefix.rows_exact_cached(e) is True
    assert (tmp_path / "prefix-rows.json").exists()

    def measured_again(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(prefix, "rows_exact", measured_again)
    assert prefix.rows_exact_cached(e) is True
    # another range is another stage: measured (here: the check fails, so not claimed)
    assert prefix.rows_exact_cached(dgr.Engine(tiny_llama, layers=(0, 1), n_ubatch=16,
                                               **SMALL)) is False


@pytest.mark.parametrize("ub,exact", [(16, True), (128, False)])
def test_a_worker_serves_its_measurement_in_describe(tiny_llama, ub, exact):
    w = ThreadedWorker(dgr.Engine(tiny_llama, layers=(0, 2), n_ubatch=ub, **SMALL))

    async def go():
        c = ShardClient(w.address)
        try:
            return await c.describe()
        finally:
            await c.close()

    try:
        info = asyncio.run(go())
    finally:
        w.stop()
    assert info.prefix_rows_exact is exact
    assert info.to_dict()["prefix_rows_exact"] is exact
