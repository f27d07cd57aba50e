"""Whether a stage computes a partial prefill chunk's rows as any partial chunk does, and rows
one per step (decode steps) as a partial chunk does (dgr.control.prefix): measured on every
range of a split, refused where the kernels differ
(a one-row product of f32 matrices; a lone row's split-KV flash attention past 512 cells with
two threads or more), remembered per build and stage,
and served in Describe, where a route reads it before reusing kept rows."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import dgr
from dgr.control import prefix
from dgr.driver.route import AsyncRoute
from dgr.testing.stages import threaded_stages
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


@pytest.mark.parametrize("layers", [None, (0, 1), (1, 3), (3, 4)])
def test_rows_one_per_step_are_a_partial_chunks_rows_on_every_range(tiny_q8, tiny_llama, layers):
    assert prefix.single_rows_exact(dgr.Engine(tiny_q8, layers=layers, n_ubatch=32, **SMALL))
    # f32 matrices: a one-row product takes another kernel than a chunk's, so not claimed
    assert not prefix.single_rows_exact(dgr.Engine(tiny_llama, layers=layers, n_ubatch=32,
                                                   **SMALL))


def test_single_rows_are_a_long_chunks_rows(tiny_q8):
    # 127 rows as one chunk and one row per step take the same tiled flash attention, which
    # computes a row alike whatever its batch's length (patch 0026; without it a batch of 64
    # rows or more took the tiled path and fewer the one-row path, so these differed)
    e = dgr.Engine(tiny_q8, n_ubatch=128, **SMALL)
    assert prefix.single_rows_exact(e)
    assert not prefix.single_rows_exact(dgr.Engine(tiny_q8, n_ubatch=3, **SMALL))


@pytest.mark.parametrize("weights", ["q8_0", "f32"])
def test_a_next_turn_keeps_the_replys_decoded_rows_with_a_fresh_prefills_bits(
        tiny_q8, tiny_llama, weights):
    """A chat's next turn holds the previous reply: where every stage computes single rows
    as a partial chunk does, the reply's decoded rows are kept too, and the next reply's
    tokens and logits are a fresh prefill's, bit for bit; elsewhere only the prompt's rows."""
    model = tiny_q8 if weights == "q8_0" else tiny_llama
    ws = [ThreadedWorker(dgr.Engine(model, layers=r, n_ubatch=32, **SMALL))
          for r in [(0, 1), (1, 3), (3, 4)]]

    async def go():
        async with AsyncRoute([w.address for w in ws]) as r:
            assert all(st.prefix_single_rows_exact is (weights == "q8_0") for st in r.stages)
            s = r.session("kept")
            prompt = list(range(3, 43))  # a whole chunk of 32 and a partial one of 8
            reply = [t async for t in s.generate(prompt, max_tokens=12, stop_on_eog=False)]
            nxt = prompt + reply + [5, 6, 7]
            keep = s.reusable(nxt)
            # every row but the last reply token's (sampled, never forwarded); or the prompt's
            assert keep == (len(prompt) + len(reply) - 1 if weights == "q8_0" else len(prompt))
            got = [t async for t in s.generate(nxt, max_tokens=8, stop_on_eog=False,
                                               logits=True, reuse=keep)]
            fresh = r.session("fresh")
            want = [t async for t in fresh.generate(nxt, max_tokens=8, stop_on_eog=False,
                                                    logits=True)]
            assert got == want and len(s.logits) == len(fresh.logits) == 8
            assert all(a.tobytes() == b.tobytes() for a, b in zip(s.logits, fresh.logits))

    try:
        asyncio.run(go())
    finally:
        for w in ws:
            w.stop()


def test_partial_chunks_either_side_of_64_rows_are_alike(tiny_llama):
    # 127 rows as one chunk, as 63 + 64 and as 125 + 2: the same rows (patch 0026; before it
    # the 127, the 64 and the 125 took the tiled flash attention, the 63 and the 2 the one-row
    # path)
    e = dgr.Engine(tiny_llama, n_ubatch=128, **SMALL)
    assert prefix.rows_exact(e)
    # too small a chunk to hold two partial chunks of two rows: not claimed
    assert not prefix.rows_exact(dgr.Engine(tiny_llama, n_ubatch=3, **SMALL))


def test_the_measurement_is_remembered_per_stage(tiny_q8, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("DGR_CACHE", str(tmp_path))
    e = dgr.Engine(tiny_q8, layers=(1, 3), n_ubatch=16, **SMALL)
    assert prefix.rows_exact_cached(e) is True
    assert (tmp_path / "prefix-rows.json").exists()

    def measured_again(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(prefix, "rows_exact", measured_again)
    assert prefix.rows_exact_cached(e) is True
    # the single-row measurement is its own entry: measured once, then remembered too
    assert prefix.single_rows_exact_cached(e) is True
    monkeypatch.setattr(prefix, "single_rows_exact", measured_again)
    assert prefix.single_rows_exact_cached(e) is True
    # another range is another stage: measured (here: the check fails, so not claimed)
    assert prefix.rows_exact_cached(dgr.Engine(tiny_llama, layers=(0, 1), n_ubatch=16,
                                               **SMALL)) is False


# n_ubatch 3: too short a chunk to hold two partial chunks of two rows, so not claimed
@pytest.mark.parametrize("ub,exact", [(16, True), (128, True), (3, False)])
def test_a_worker_serves_its_measurement_in_describe(tiny_q8, ub, exact):
    w = ThreadedWorker(dgr.Engine(tiny_q8, layers=(0, 2), n_ubatch=ub, **SMALL))

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
    assert info.prefix_single_rows_exact is exact
    assert info.to_dict()["prefix_single_rows_exact"] is exact


LONG = dict(n_ctx=2048, n_slots=2, n_threads=2, n_ubatch=32)


def test_rows_far_into_a_context_are_measured_too(tiny_q8):
    """With two threads ggml's CPU flash attention splits a lone single-row step's KV of 512
    cells or more over the threads: rows alike at the start of a context differ further on.
    The checks measure there too; the batch-invariant kernels make every kind of row alike."""
    e = dgr.Engine(tiny_q8, layers=(1, 3), **LONG)
    assert prefix.FAR >= 512 + 32
    assert prefix.rows_exact(e)
    assert not prefix.single_rows_exact(e)
    # the same engine with a context too short to reach 512 cells: alike everywhere
    assert prefix.single_rows_exact(dgr.Engine(tiny_q8, layers=(1, 3), **{**LONG, "n_ctx": 256}))
    bi = dgr.Engine(tiny_q8, layers=(1, 3), batch_invariant=True, **LONG)
    assert bi.settings["batch_invariant"] and bi.describe()["settings"]["batch_invariant"]
    assert prefix.rows_exact(bi) and prefix.single_rows_exact(bi) and prefix.chunk_rows_exact(bi)


def test_a_whole_chunk_computes_its_rows_as_partial_chunks_do(tiny_q8):
    # 128 rows as one chunk, as 64 + 64 and as 126 + 2: the same rows, with ggml's kernels
    # (patch 0026: before it 126 + 2 took the one-row flash attention) and with the reference
    # ones
    assert prefix.chunk_rows_exact(dgr.Engine(tiny_q8, **{**SMALL, "n_ubatch": 128}))
    assert prefix.chunk_rows_exact(dgr.Engine(tiny_q8, batch_invariant=True,
                                              **{**SMALL, "n_ubatch": 128}))


def test_batch_invariant_kernels_need_the_cpu_device(tiny_q8):
    with pytest.raises(dgr.errors.InvalidArgument, match="batch_invariant"):
        dgr.Engine(tiny_q8, device="Vulkan0", batch_invariant=True, **SMALL)


@pytest.mark.parametrize("invariant", [False, True])
def test_a_long_chats_next_turn_keeps_what_the_kernels_allow_with_a_fresh_prefills_bits(
        tiny_q8, invariant):
    """A next turn past 512 positions, growing across a chunk boundary, on a 3-stage route
    with two threads per stage. By default the reply's decoded rows (split-KV single rows) are
    recomputed and every prompt row is kept (a whole chunk's rows are partial chunks': the
    next turn's rest starts inside one of its whole chunks); with batch-invariant kernels every
    shared row is kept, by the front's kind of kept session and by the stages' prefix stores.
    Either way the next reply's tokens and logits are a fresh prefill's, bit for bit."""
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(3, 120, 600)]  # 18 whole chunks of 32 and 24 rows

    async def go(ws):
        async with AsyncRoute([w.address for w in ws]) as r:
            # a whole chunk's rows are partial chunks' with ggml's own kernels too (patch 0026)
            assert all(st.prefix_chunk_rows_exact for st in r.stages)
            assert all(st.prefix_single_rows_exact is invariant for st in r.stages)
            s = r.session("kept")
            reply = [t async for t in s.generate(prompt, max_tokens=12, stop_on_eog=False)]
            nxt = prompt + reply + [int(t) for t in rng.integers(3, 120, 20)]
            keep = s.reusable(nxt)
            # every forwarded row (not the last reply token: sampled, never forwarded), or
            # every prompt row (the decoded ones are split-KV single rows), whole chunks or not
            assert keep == (len(prompt) + len(reply) - 1 if invariant else len(prompt))
            got = [t async for t in s.generate(nxt, max_tokens=8, stop_on_eog=False,
                                               logits=True, reuse=keep)]
            await s.close(keep=True)
            fresh = r.session("fresh")
            want = [t async for t in fresh.generate(nxt, max_tokens=8, stop_on_eog=False,
                                                    logits=True)]
            await fresh.close()
            assert got == want and len(s.logits) == len(fresh.logits) == 8
            assert all(a.tobytes() == b.tobytes() for a, b in zip(s.logits, fresh.logits))
            # a later session adopts the kept session's rows from the stages' stores
            later = nxt + got + [7, 8, 9]
            a = r.session("adopting")
            held = await a.adopt(later)
            total = len(nxt) + len(got) - 1
            # all of it, or whole chunks (the rows after them are hashed apart from chunks)
            assert held == total if invariant else held and held % 32 == 0
            again = [t async for t in a.generate(later, max_tokens=6, stop_on_eog=False,
                                                 logits=True, reuse=held)]
            await a.close()
            b = r.session("fresh-2")
            want = [t async for t in b.generate(later, max_tokens=6, stop_on_eog=False,
                                                logits=True)]
            await b.close()
            assert again == want
            assert all(x.tobytes() == y.tobytes() for x, y in zip(a.logits, b.logits))

    with threaded_stages(tiny_q8, [(0, 1), (1, 3), (3, 4)],
                         {**LONG, "batch_invariant": invariant}) as ws:
        asyncio.run(go(ws))


def test_a_next_turn_that_edits_inside_a_whole_chunk_keeps_the_rows_before_the_edit(tiny_q8):
    """Where every stage computes a prompt's rows alike however it was cut into chunks, a
    later prompt that departs from the kept one inside a whole chunk keeps the rows before
    it (not only the whole chunks before it), prefills up to the chunk's end and then in a
    fresh prefill's chunks, and gets a fresh prefill's tokens and logits, bit for bit."""
    rng = np.random.default_rng(9)
    prompt = [int(t) for t in rng.integers(3, 120, 100)]  # 3 whole chunks of 32 and 4 rows

    async def go(ws):
        async with AsyncRoute([w.address for w in ws]) as r:
            # split-KV single rows (two threads, FAR positions in): not a chunk's
            assert all(st.prefix_chunk_rows_exact and not st.prefix_single_rows_exact
                       for st in r.stages)
            s = r.session("kept")
            [t async for t in s.generate(prompt, max_tokens=4, stop_on_eog=False)]
            for cut, grow in ((70, 50), (97, 60), (45, 3), (33, 40)):
                new = [int(t) for t in rng.integers(3, 120, grow)]
                new[0] = 120 + cut % 8  # departs at ``cut`` (no prompt token is 120 or more)
                nxt = prompt[:cut] + new
                keep = s.reusable(nxt)
                # every shared row, but never a kept chunk cut to one row (97: the chunk
                # [96, 120) would keep one; 33: [32, 45)), nor a one-row first chunk of the rest
                assert keep == {97: 96, 33: 32}.get(cut, cut)
                got = [t async for t in s.generate(nxt, max_tokens=4, stop_on_eog=False,
                                                   logits=True, reuse=keep)]
                fresh = r.session("fresh")
                want = [t async for t in fresh.generate(nxt, max_tokens=4, stop_on_eog=False,
                                                        logits=True)]
                await fresh.close()
                assert got == want
                assert all(a.tobytes() == b.tobytes() for a, b in zip(s.logits, fresh.logits))
                prompt[:] = nxt  # the session now holds ``nxt`` and its reply
            await s.close()

    with threaded_stages(tiny_q8, [(0, 1), (1, 3), (3, 4)], LONG) as ws:
        asyncio.run(go(ws))
