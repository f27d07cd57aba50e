"""MTP speculation across the ring on the tiny DeepSeek V4 fixture with one NextN block
(docs/speculative.md): the last stage loads the NextN block (``mtp=True``) and drafts with it;
the other stages only verify and roll back their own caches (hash-routed layers, compressed
and indexer state).

A split route speculating with MTP makes the tokens of the whole model (one worker, MTP
loaded) running the same speculative schedule, for several split points; and where the
lane's speculative trips are bit-identical to single steps (``dgr.control.speculation``,
measured here), the tokens of plain greedy decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.control.speculation import measure
from dgr.driver.route import Route
from dgr.testing.fixtures import TinyDeepseek4, write_tiny_deepseek4
from dgr.worker.process import ThreadedWorker
from dgr.worker.speculation import FixedDraftPolicy

pytestmark = pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the patched llama.cpp")

CFG = TinyDeepseek4(mtp=True)
N = CFG.n_layer
SETTINGS = dict(n_ctx=256, n_slots=2, n_threads=1, n_ubatch=64, flash_attn=True)
PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, CFG.n_vocab, 40)]
STEPS = 40
LAYOUTS = {"whole": [None], "split-3": [(0, 3), (3, N)], "split-1-5": [(0, 1), (1, 5), (5, N)]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_deepseek4(tmp_path_factory.mktemp("models") / "tiny-dsv4-mtp.gguf", CFG)


def _workers(model, layout):
    ws = []
    for i, r in enumerate(layout):
        last = i == len(layout) - 1
        ws.append(ThreadedWorker(dgr.Engine(model, layers=r, mtp=last, **SETTINGS),
                                 evict_after=3600.0))
    # the schedule from the tokens alone (the adaptive policy's depends on measured times)
    ws[-1].worker.pipeline.speculator.policy = FixedDraftPolicy()
    return ws


def _complete(ws, **kw):
    with Route([w.address for w in ws], relay=True, **kw) as r, r.session() as s:
        return s.complete(PROMPT, max_tokens=STEPS, stop_on_eog=False)


@pytest.fixture(scope="module")
def runs(model):
    """Every layout's MTP-speculative generation, and the whole model's plain one."""
    out = {}
    for name, layout in LAYOUTS.items():
        ws = _workers(model, layout)
        try:
            assert ws[-1].worker.pipeline.drafters == ["ngram", "mtp"]
            out[name] = _complete(ws, speculate="mtp", max_draft=4)
            out[name + "/ngram"] = _complete(ws, speculate="ngram", max_draft=6)
            if name == "whole":
                out["plain"] = _complete(ws)
        finally:
            for w in ws:
                w.stop()
    return out


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "whole"])
def test_split_mtp_speculation_equals_the_whole_model_running_the_same_schedule(runs, layout):
    whole, split = runs["whole"], runs[layout]
    assert split.tokens == whole.tokens and len(split.tokens) == STEPS
    # the same schedule: the same trips, drafts and acceptances
    assert (split.trips, split.drafted, split.accepted) == (
        whole.trips, whole.drafted, whole.accepted)
    assert whole.drafted > 0 and whole.recoveries == 0 == split.recoveries


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "whole"])
def test_ngram_speculation_rolls_back_deepseek_v4_caches_within_the_epoch(runs, layout):
    """n-gram drafts on the same routes: drafts accepted in part, the rest rolled back on
    every stage's DeepSeek V4 caches (compressed and indexer state included), no re-prefill."""
    whole, split = runs["whole/ngram"], runs[layout + "/ngram"]
    assert split.tokens == whole.tokens == runs["plain"].tokens
    assert (split.trips, split.drafted, split.accepted) == (
        whole.trips, whole.drafted, whole.accepted)
    assert 0 < split.accepted < split.drafted and split.recoveries == 0


def test_mtp_speculation_against_plain_decoding_as_the_lane_measures_it(model, runs):
    m = measure(dgr.Engine(model, mtp=True, **SETTINGS), max_draft=4)
    spec, plain = runs["whole"].tokens, runs["plain"].tokens
    if m.bit_identical:
        assert spec == plain
    else:  # a near tie may go the other way in a multi-row step: report, do not require
        agree = np.mean([a == b for a, b in zip(spec, plain)])
        print(f"\nspeculative trips not bit-identical (max |diff| {m.max_abs_diff:.3g}, top-1 "
              f"{m.top1_agreement:.3f}); tokens agree at {agree:.3f} of positions")
        assert spec[:1] == plain[:1]  # the prefill's token is the same step in both


def test_mtp_is_refused_where_it_cannot_draft(model):
    with pytest.raises(errors.MtpNotSupported, match="last stage"):
        dgr.Engine(model, layers=(0, 3), mtp=True, **SETTINGS)


def test_the_rings_mtp_drafts_come_from_the_accepted_tokens(model):
    """Every draft the last stage made in the ring is what the NextN block drafts from the
    tokens accepted so far: a fresh whole model fed exactly those tokens drafts the same (the
    rejected drafts of the trip before left nothing behind)."""
    ws = _workers(model, LAYOUTS["split-3"])
    sp = ws[-1].worker.pipeline.speculator
    real, log = sp.mtp.draft, []

    def logged(session, epoch, slot, pos, token, k):
        out = real(session, epoch, slot, pos, token, k)
        log.append((pos, token, k, out))
        return out

    sp.mtp.draft = logged
    try:
        g = _complete(ws, speculate="mtp", max_draft=4)
    finally:
        for w in ws:
            w.stop()
    seq = PROMPT + g.tokens
    assert len(log) >= 10 and any(pos > len(PROMPT) + 2 for pos, *_ in log)
    fresh = dgr.Engine(model, mtp=True, **SETTINGS)
    for pos, token, k, out in log:
        assert seq[pos] == token
        fresh.release(0)
        fresh.forward(0, 0, np.asarray(seq[:pos], np.int32))
        assert fresh.mtp_draft(0, token, k) == out, f"drafts at position {pos}"
