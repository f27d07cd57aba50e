"""Sampling and layer-split helpers (no engine needed)."""

import numpy as np
import pytest

from dgr import errors
from dgr.protocol.ranges import (balance_layers, balance_stages, parse_splits, ranges_for,
                                 split_layers)
from dgr.protocol.sampling import Sampler, SamplingParams, sample_rows, top_k


def test_greedy_is_argmax_lowest_id_on_ties():
    row = np.array([0.1, 3.0, 3.0, -1.0], dtype=np.float32)
    assert Sampler()(row) == 1


def test_seeded_sampling_is_reproducible_and_respects_top_k():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((50, 100)).astype(np.float32)
    p = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=7)
    a = [Sampler(p)(r) for r in rows]
    s1, s2 = Sampler(p), Sampler(p)
    seq1 = [s1(r) for r in rows]
    seq2 = [s2(r) for r in rows]
    assert seq1 == seq2
    for r, t in zip(rows, seq1):
        assert t in set(np.argsort(-r)[:5])
    assert len(set(a)) > 1


def test_a_seeded_draw_is_the_same_on_any_numpy_release_and_host():
    """The draws are PCG64's stream through SeedSequence, which numpy keeps the same in every
    release (NEP 19), unlike Generator.choice's algorithm: a failover's replay on a host with
    another numpy draws the tokens a reference drew. These were drawn on numpy 2.4."""
    s, bits = Sampler(SamplingParams(temperature=1.0, seed=1234)), np.random.PCG64(1234)
    assert [s.uniform() for _ in range(4)] == [(int(bits.random_raw()) >> 11) / 2**53
                                               for _ in range(4)]
    rows = np.sin(np.arange(8 * 16, dtype=np.float32)).reshape(8, 16) * 2
    p = SamplingParams(temperature=1.0, top_k=6, top_p=0.95, seed=99)
    assert sample_rows(rows, range(8), p) == [14, 5, 7, 4, 1, 10, 0, 3]
    p = SamplingParams(temperature=1.5, seed=5)
    assert sample_rows(rows, range(100, 108), p) == [2, 11, 0, 15, 7, 15, 13, 15]


def test_top_k_keeps_the_lowest_ids_among_values_tied_at_the_cut():
    """argpartition keeps whichever tied ids its kernel meets first (numpy releases and CPUs
    differ); the cut is by value, and ties go to the lowest ids, as greedy's do."""
    row = np.zeros(10_000, dtype=np.float32)
    row[[7, 5000]] = 1.0
    assert top_k(row, 100).tolist() == [7, 5000, *range(7), *range(8, 99)]
    assert top_k(row, 2).tolist() == [7, 5000]
    assert top_k(row, 1).tolist() == [7]
    s = Sampler(SamplingParams(temperature=1.0, top_k=5, seed=3))
    assert {s(row) for _ in range(200)} <= {7, 5000, 0, 1, 2}


def test_top_p_tiny_keeps_only_the_best():
    row = np.array([0.0, 5.0, 1.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.01, seed=1))
    assert {s(row) for _ in range(20)} == {1}


def test_logit_bias_applies_before_greedy_and_sampling_alike_on_both_forms():
    """A bias moves the argmax (-100 bans, +2 promotes), for a SamplingParams and for the
    wire.Sampling a route's last stage receives: the same tokens either way."""
    from dgr.driver.headers import wire_sampling
    from dgr.protocol.sampling import sample_rows

    rows = np.random.default_rng(3).standard_normal((20, 50)).astype(np.float32)
    best = [int(np.argmax(r)) for r in rows]
    for temperature in (0.0, 0.7):
        p = SamplingParams(temperature=temperature, seed=4,
                           logit_bias=((best[0], -100.0), (7, 30.0)))
        w = wire_sampling(p)
        assert w is not None and w.bias_ids == (best[0], 7) and w.bias == (-100.0, 30.0)
        pos = list(range(20))
        assert sample_rows(rows, pos, p) == sample_rows(rows, pos, w) == [7] * 20
    p = SamplingParams(logit_bias=((best[0], -100.0),))
    got = sample_rows(rows[:1], [0], p)
    assert got == [int(np.argsort(-rows[0])[1])]  # the runner-up once the best is banned
    assert Sampler(p)(rows[0]) == got[0]
    with pytest.raises(errors.InvalidArgument, match="outside the vocabulary"):
        sample_rows(rows[:1], [0], SamplingParams(logit_bias=((50, 1.0),)))


def test_min_p_keeps_the_tokens_near_the_best_before_the_temperature():
    # logits 5, 4, 0: with min_p 0.2 only tokens with logit >= 5 + ln(0.2) = 3.39 stay
    row = np.array([0.0, 5.0, 4.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=5.0, min_p=0.2, seed=1))
    assert {s(row) for _ in range(200)} == {1, 2}
    s = Sampler(SamplingParams(temperature=5.0, seed=1))
    assert {s(row) for _ in range(200)} == {0, 1, 2}


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(temperature=float("nan")),
                                 dict(min_p=1.5), dict(logit_bias=((-1, 1.0),)),
                                 dict(logit_bias=((1, float("nan")),))])
def test_bad_sampling_params(bad):
    with pytest.raises(errors.InvalidArgument):
        SamplingParams(**bad)


def test_split_layers_even_and_contiguous():
    assert split_layers(30, 3) == [(0, 10), (10, 20), (20, 30)]
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(errors.InvalidLayerRange):
        split_layers(4, 5)
    with pytest.raises(errors.InvalidLayerRange):
        split_layers(4, 0)


def test_parse_splits():
    assert parse_splits([20, 10], 30) == [(0, 10), (10, 20), (20, 30)]
    for bad in ([0], [30], [10, 10], [-1]):
        with pytest.raises(errors.InvalidLayerRange):
            parse_splits(bad, 30)


def test_ranges_for_a_command_line():
    """--splits wins over --stages; empty items are ignored; a non-integer point is a typed
    error (the commands print it), not a traceback."""
    assert ranges_for("10,20", 5, 30) == [(0, 10), (10, 20), (20, 30)]
    assert ranges_for("10,,20,", 5, 30) == [(0, 10), (10, 20), (20, 30)]
    assert ranges_for(None, 3, 30) == split_layers(30, 3)
    assert ranges_for("", 2, 30) == split_layers(30, 2)
    with pytest.raises(errors.InvalidLayerRange, match="integers"):
        ranges_for("10,x", 3, 30)


def test_balanced_ranges_give_the_last_stage_fewer_layers_for_the_head():
    """A route serves at its slowest stage's speed: the output head weighs on the last stage
    (SmolLM2's tied head multiplies as many weights as 8 of its 30 layers)."""
    assert balance_layers([1.0] * 30, 2, last=8.0) == [(0, 19), (19, 30)]
    assert balance_layers([1.0] * 30, 3, last=8.0) == [(0, 13), (13, 25), (25, 30)]
    # no head: the even split (of equally costly splits, the one nearest to even)
    assert balance_layers([1.0] * 30, 3) == split_layers(30, 3)
    assert balance_layers([1.0] * 7, 2) == [(0, 4), (4, 7)]
    # an uneven layer (a dense layer among lighter ones) shifts the cut
    assert balance_layers([4.0, 1.0, 1.0, 1.0, 1.0], 2) == [(0, 1), (1, 5)]
    assert balance_layers([1.0, 1.0], 2, last=5.0) == [(0, 1), (1, 2)]  # one layer each at least
    for bad in (0, 3):
        with pytest.raises(errors.InvalidLayerRange):
            balance_layers([1.0, 1.0], bad)


def test_stages_on_machines_of_different_speeds_get_layers_by_their_own_costs():
    """Measured per machine: a stage twice as fast takes twice the layers; a forward's fixed
    cost (graph, dispatch) counts once per stage, whatever its layers."""
    assert balance_stages([[1.0] * 30] * 2) == [(0, 15), (15, 30)]
    assert balance_stages([[1.0] * 30, [2.0] * 30]) == [(0, 20), (20, 30)]
    assert balance_stages([[2.0] * 30, [1.0] * 30]) == [(0, 10), (10, 30)]
    # a stage with a costlier fixed part takes fewer layers
    assert balance_stages([[1.0] * 30] * 2, overheads=[0.0, 4.0]) == [(0, 17), (17, 30)]
    # the same as balance_layers where every machine is alike, the head in the last layer
    head = [1.0] * 29 + [9.0]
    assert balance_stages([head] * 3) == balance_layers([1.0] * 30, 3, last=8.0)
    with pytest.raises(ValueError, match="same layers"):
        balance_stages([[1.0] * 4, [1.0] * 5])
    with pytest.raises(errors.InvalidLayerRange):
        balance_stages([[1.0]] * 2)


def test_penalties_are_llama_cpps_over_the_last_n_tokens():
    """llama.cpp's penalties sampler, written out: a token seen c times in the window gets
    its logit divided by repeat_penalty (multiplied when it is not positive), then
    c * frequency + presence subtracted; tokens outside the last n are not counted."""
    from dgr.protocol.sampling import adjusted, sample_rows

    row = np.array([2.0, -1.0, 0.5, 3.0, 0.0], dtype=np.float32)
    p = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.25, presence_penalty=1.0,
                       penalty_last_n=4)
    window = [3, 3, 0, 1, 1, 3]  # the last 4: 0, 1, 1, 3
    want = row.copy()
    want[0] = np.float32(2.0) / 2 - (1 * 0.25 + 1.0)
    want[1] = np.float32(-1.0) * 2 - (2 * 0.25 + 1.0)
    want[3] = np.float32(3.0) / 2 - (1 * 0.25 + 1.0)
    got = adjusted(row, p, window)
    assert got.tobytes() == want.astype(np.float32).tobytes()
    assert row[3] == 3.0  # the caller's row is left as it was
    # greedy takes the penalized argmax: 3 would win unpenalized, 2 now does
    assert sample_rows(row[None], [6], p, [window]) == [2]
    assert sample_rows(row[None], [6], SamplingParams(), [window]) == [3]
    # the penalties need the window: refused without it
    with pytest.raises(errors.InvalidArgument, match="tokens before each row"):
        sample_rows(row[None], [6], p)
    # off: penalty_last_n 0 or neutral values
    assert not SamplingParams(repeat_penalty=2.0, penalty_last_n=0).penalized
    assert not SamplingParams().penalized


def test_the_last_stage_keeps_each_sessions_tokens_for_the_penalties():
    """dgr.worker.history: the record follows commits (drafts rejected are cut by the next
    step's start), a new epoch starts over, and a gap is refused, not guessed."""
    from types import SimpleNamespace as H

    from dgr.worker.history import Histories

    def step(pos, toks, epoch=1, session="s"):
        return H(session=session, epoch=epoch, first_pos=pos, n_tokens=len(toks or [0]),
                 tokens=toks, positions=None)

    h = Histories()
    h.commit(step(0, [5, 6, 7]), 3)  # the prompt
    assert h.windows(step(3, [8, 9, 10]), [0, 2], 4) == [[5, 6, 7, 8], [7, 8, 9, 10]]
    h.commit(step(3, [8, 9, 10]), 2)  # a token and 2 drafts, 1 accepted: 10 is not kept
    assert h.windows(step(5, [11]), [0], 64) == [[5, 6, 7, 8, 9, 11]]
    h.commit(step(4, [20]), 1)  # a step that starts earlier (a rollback): cut there
    assert h.windows(step(5, [21]), [0], 3) == [[8, 20, 21]]
    with pytest.raises(errors.InvalidArgument, match="gap"):
        h.windows(step(9, [1]), [0], 4)  # positions 5..8 never came here
    with pytest.raises(errors.InvalidArgument, match="gap"):
        h.windows(step(3, [1], epoch=2), [0], 4)  # a new epoch that does not start at 0
    assert h.windows(step(0, [1, 2], epoch=2), [1], 4) == [[1, 2]]
    with pytest.raises(errors.InvalidArgument, match="token ids"):
        h.windows(step(0, None, epoch=2), [0], 4)
    h.commit(step(5, None), 1)  # a step without token ids: no record from here
    with pytest.raises(errors.InvalidArgument, match="gap"):
        h.windows(step(6, [1]), [0], 4)
    h.forget("s")
    assert len(h) == 0
