"""Speculative decoding across the ring (docs/speculative.md): SmolLM2 split in three, n-gram
drafts on the last stage, real engines over loopback.

The exactness contract: a split speculative run makes the same tokens as the whole model
running the same speculative schedule, and (SmolLM2's quantized weights at one thread, where
a multi-token step's rows are bit-identical to single-token steps: docs/speculative.md) the
same tokens as plain decoding, greedy and seeded sampling alike.
"""

from __future__ import annotations

import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.driver.route import Route
from dgr.protocol.sampling import SamplingParams
from dgr.worker.process import ThreadedWorker
from dgr.worker.speculation import FixedDraftPolicy

pytestmark = pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the patched llama.cpp")

SETTINGS = dict(n_ctx=512, n_slots=4, n_threads=1, n_ubatch=32)
RANGES = ((0, 10), (10, 20), (20, 30))
# repetition-heavy: rewriting a block of code with one change
CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def scale(xs, k):\n    return [x * k for x in xs]\n")
PROMPT = f"{CODE}\nThe same code again, unchanged:\n{CODE}\nAnd once more:\n"
N = 48


def _fixed(ws):
    """The last stage drafts what the tokens allow (``FixedDraftPolicy``): a schedule of the
    tokens alone. The adaptive policy learns, stage-wide, that drafts do not pay on loopback
    and stops drafting, so a later test would verify nothing (tests/unit has the policy)."""
    ws[-1].worker.pipeline.speculator.policy = FixedDraftPolicy()
    return ws


@pytest.fixture(scope="module", params=[True, False], ids=["native-frames", "python-frames"])
def split(smollm2, request):
    ws = _fixed([ThreadedWorker(dgr.Engine(smollm2, layers=r, **SETTINGS), evict_after=3600.0,
                                native_frames=request.param) for r in RANGES])
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture(scope="module")
def whole(smollm2):
    w = ThreadedWorker(dgr.Engine(smollm2, **SETTINGS), evict_after=3600.0)
    _fixed([w])
    yield w
    w.stop()


@pytest.fixture(scope="module")
def plain(split):
    with Route([w.address for w in split], relay=True) as r, r.session() as s:
        return s.complete(PROMPT, max_tokens=N, stop_on_eog=False)


def _run(ws, **kw):
    opts = dict(max_tokens=N, stop_on_eog=False)
    route_kw = {k: kw.pop(k) for k in list(kw) if k in ("loop_window", "max_draft")}
    opts.update(kw)
    with Route([w.address for w in ws], relay=True, speculate="ngram", **route_kw) as r, \
            r.session() as s:
        return s.complete(PROMPT, **opts)


def test_split_speculation_equals_the_whole_model_and_plain_decoding(split, whole, plain):
    g = _run(split)
    assert g.tokens == plain.tokens  # plain greedy decoding's tokens
    assert g.tokens == _run([whole]).tokens  # the whole model, the same schedule
    # the drafts paid: several tokens per trip on repeated text
    assert g.drafted > 0 and g.accepted > 0 and g.trips < N - 1
    assert g.tokens_per_trip > 1.5
    sp = split[-1].worker.pipeline.speculator
    assert sp.stats.accepted >= g.accepted > 0
    # every stage kept its cache exactly: no session left busy, nothing refused
    assert all(w.worker.pipeline.errors_total == 0 for w in split)


def test_seeded_sampling_makes_the_same_tokens_with_speculation(split):
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234)
    with Route([w.address for w in split], relay=True) as r, r.session() as s:
        ref = s.complete(PROMPT, max_tokens=N, stop_on_eog=False, sampling=sp)
    g = _run(split, sampling=sp)
    assert g.tokens == ref.tokens and g.drafted > 0


@pytest.mark.parametrize("window,max_draft", [(5, 8), (7, 3), (1, 8)])
def test_windows_and_draft_limits_keep_the_tokens(split, plain, window, max_draft):
    """A window ends a trip's run of drafts (the last stage drafts no more than the window
    has left); the next window's step rolls back what the last trip left in the caches."""
    g = _run(split, loop_window=window, max_draft=max_draft)
    assert g.tokens == plain.tokens and len(g.tokens) == N


def test_a_stage_that_cannot_roll_back_is_repaired_by_a_re_prefill(split, plain, monkeypatch):
    """A stage whose cache cannot drop the rejected tail refuses with RollbackUnsupported;
    the driver re-prefills under a new epoch and the tokens are still plain decoding's."""
    eng = split[1].worker.pipeline.engine
    real = eng.truncate
    calls = []

    def once(slot, pos):
        calls.append(pos)
        if len(calls) == 1:
            eng.release(slot)
            raise errors.RollbackUnsupported("this cache cannot drop that tail (test)")
        return real(slot, pos)

    monkeypatch.setattr(eng, "truncate", once)
    with Route([w.address for w in split], relay=True, speculate="ngram") as r, \
            r.session() as s:
        g = s.complete(PROMPT, max_tokens=N, stop_on_eog=False)
    assert calls, "no step rolled back: the prompt gave no rejected drafts"
    assert g.recoveries == 1 and g.tokens == plain.tokens


def test_speculate_is_checked(split):
    assert split[-1].worker.pipeline.drafters == ["ngram"]
    assert split[0].worker.pipeline.drafters == []
    with pytest.raises(errors.RouteError, match="--mtp"):  # SmolLM2 has no NextN block
        Route([w.address for w in split], speculate="mtp")
    with pytest.raises(errors.InvalidArgument, match="speculate"):
        Route(["127.0.0.1:1"], speculate="medusa")
    with pytest.raises(errors.InvalidArgument, match="max_draft"):
        Route(["127.0.0.1:1"], speculate="ngram", max_draft=0)


def test_the_lane_measure_of_speculative_trips(smollm2, tiny_llama):
    """``dgr.control.speculation.measure``: trips of k+1 tokens with rollbacks against single
    steps. SmolLM2's quantized weights at one thread: bit-identical (what the tests above rely
    on); on any model the figures agree with each other."""
    from dgr.control.speculation import measure

    m = measure(dgr.Engine(smollm2, n_ctx=128, n_threads=1), max_draft=4)
    assert m.bit_identical and m.max_abs_diff == 0.0 and m.top1_agreement == 1.0
    assert m.rows == 32 and m.trips > 32 // 5
    t = measure(dgr.Engine(tiny_llama, n_ctx=128, n_threads=2), max_draft=6, decode_tokens=20)
    assert t.rows == 20 and t.bit_identical == (t.max_abs_diff == 0.0)
    assert 0.0 <= t.top1_agreement <= 1.0 and (t.top1_agreement == 1.0 or not t.bit_identical)


def test_penalties_and_logit_bias_make_the_same_tokens_with_speculation(split, whole):
    """The last stage counts the session's tokens (the prompt's, and each verified row's
    drafts before it): with penalties and a logit bias, the speculative split run makes the
    tokens of plain decoding and of the whole model, and not those of the unpenalized run."""
    sp = SamplingParams(repeat_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.1,
                        penalty_last_n=32, logit_bias=((1, 2.0), (29, -100.0)))
    with Route([w.address for w in split], relay=True) as r, r.session() as s:
        ref = s.complete(PROMPT, max_tokens=N, stop_on_eog=False, sampling=sp)
        unpenalized = s.complete(PROMPT, max_tokens=N, stop_on_eog=False)
    g = _run(split, sampling=sp)
    assert g.tokens == ref.tokens and g.drafted > 0
    assert _run([whole], sampling=sp).tokens == ref.tokens
    assert ref.tokens != unpenalized.tokens and 29 not in ref.tokens
