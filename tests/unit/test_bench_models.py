"""The pure parts of benches/wan.py (the delay model of each path) and benches/process_floor.py
(its summary, its pipe reads): no workers, no model."""

from __future__ import annotations

import os

import pytest

BENCHES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benches"))

import process_floor
import wan

# --- wan: S and P per path -------------------------------------------------------------------

def test_seams_grpc_is_one_round_trip_per_stage():
    for n in (2, 3, 4):
        assert wan.seams(n, relay=False, steps=64) == float(n)


def test_seams_relay_is_half_a_round_trip_per_link_plus_the_window_hops():
    # n one-way links of RTT/2 a token, and every window (the first too) starts from the
    # driver: n -> driver -> 1, half a round trip more per window
    assert wan.seams(3, relay=True, steps=32, window=32) == pytest.approx(1.5 + 0.5 / 32)
    assert wan.seams(4, relay=True, steps=10, window=32) == pytest.approx(2.0 + 0.5 / 10)
    assert wan.seams(3, relay=True, steps=64, window=32) == pytest.approx(1.5 + 1.0 / 64)
    assert wan.seams(3, relay=True, steps=33, window=32) == pytest.approx(1.5 + 1.0 / 33)
    assert wan.seams(3, relay=True, steps=96, window=32) == pytest.approx(1.5 + 1.5 / 96)
    with pytest.raises(ValueError):
        wan.seams(3, relay=True, steps=0)


def test_model_grpc_is_the_old_per_seam_formula():
    m = wan.model(tpot_ms=76.0, compute_ms=10.0, rtt_ms=20.0, n_stages=3, relay=False,
                  steps=64)
    assert m["S"] == 3.0
    assert m["model_tpot_ms"] == pytest.approx(10 + 3 * 20)
    assert m["excess_ms"] == pytest.approx(6.0)
    assert m["P_ms"] == pytest.approx((76 - 10) / 3 - 20)  # 2 ms per seam


def test_model_relay():
    m = wan.model(tpot_ms=43.3125, compute_ms=10.0, rtt_ms=20.0, n_stages=3, relay=True,
                  steps=32)
    assert m["S"] == pytest.approx(1.5 + 0.5 / 32)  # one window: one link more in 32 tokens
    assert m["model_tpot_ms"] == pytest.approx(40.3125)
    assert m["P_ms"] == pytest.approx(1.0)  # 3 ms over the model, 3 links


@pytest.mark.parametrize("relay", [True, False])
def test_model_p_does_not_drift_with_rtt(relay):
    # a route whose transport adds 0.4 ms per seam on top of the emulated delay: P must read
    # 0.4 at every RTT (with S = 3 for relay, the old figure fell by RTT/2 per ms of RTT)
    n, c, steps = 3, 12.0, 64
    s = 1.5 + 1.0 / 64 if relay else 3.0  # the delay a token really crosses (see above)
    for rtt in (0.0, 5.0, 20.0, 100.0):
        tpot = c + s * rtt + n * 0.4
        m = wan.model(tpot, c, rtt, n, relay, steps)
        assert m["P_ms"] == pytest.approx(0.4)
        assert m["excess_ms"] == pytest.approx(1.2)


def test_fit_recovers_slope_and_intercept():
    rows = [(0.0, 20.0), (5.0, 27.5), (20.0, 50.0), (100.0, 170.0)]
    icpt, slope = wan.fit(rows)
    assert icpt == pytest.approx(20.0) and slope == pytest.approx(1.5)
    assert wan.fit([(5.0, 27.5)]) is None
    assert wan.fit([(5.0, 27.5), (5.0, 28.0)]) is None  # one RTT: no slope


def test_n_tokens_scales_down_with_rtt_within_bounds():
    assert wan.n_tokens(20.0, 3, 3.0, 0.0) == wan.MAX_TOKENS
    assert wan.n_tokens(20.0, 3, 3.0, 100.0) == 21  # 20 s / (8 + 3 * 100 ms) / 3 rounds
    assert wan.n_tokens(20.0, 3, 1.5, 100.0) == 42  # 20 s / (8 + 1.5 * 100 ms) / 3 rounds
    assert wan.n_tokens(2.0, 3, 3.0, 100.0) == 6  # at least 6


# --- process_floor: the summary --------------------------------------------------------------

REF = [5, 6, 7, 8]


def _rnd(alone, pipes, relay, tokens=None):
    def row(ms):
        return {"token_ms": ms, "compute_ms": [ms / 2, ms / 2], "tokens": list(tokens or REF)}

    return {"alone": row(alone), "pipes": row(pipes), "relay": row(relay)}


def test_summary_medians_ratios_per_round():
    rounds = [_rnd(10, 11, 12), _rnd(20, 24, 25), _rnd(12, 12, 14)]
    s = process_floor.summarize(rounds, 2, REF)
    assert (s["alone"], s["pipes"], s["relay"]) == (12, 12, 14)
    assert s["pipes_over_alone"] == pytest.approx(1.1)  # of 1.1, 1.2, 1.0
    assert s["relay_over_pipes_ms_per_stage"] == pytest.approx(0.5)  # of 0.5, 0.5, 1.0
    assert s["relay_over_alone"] == pytest.approx(1.2)  # of 1.2, 1.25, 1.1667
    assert s["alone_stage_compute_ms"] == [6, 6]
    assert s["pipes_stage_compute_ms"] == [6, 6]
    assert s["relay_stage_compute_ms"] == [7, 7]
    assert s["parity"] == {"alone": True, "pipes": True, "relay": True}


def test_summary_parity_fails_on_one_bad_round_and_on_a_short_one():
    rounds = [_rnd(10, 11, 12), _rnd(10, 11, 12)]
    rounds[1]["pipes"]["tokens"] = [5, 6, 0, 8]
    rounds[0]["relay"]["tokens"] = REF[:3]  # a prefix: as many tokens as asked, or not equal
    s = process_floor.summarize(rounds, 2, REF)
    assert s["parity"] == {"alone": True, "pipes": False, "relay": False}


def test_summary_without_reference_or_compute():
    rounds = [_rnd(10, 11, 12)]
    del rounds[0]["relay"]["compute_ms"]
    s = process_floor.summarize(rounds, 2)
    assert "parity" not in s and "relay_stage_compute_ms" not in s
    assert s["pipes_stage_compute_ms"] == [5.5, 5.5]


# --- process_floor: pipe reads ---------------------------------------------------------------

def test_readn_reads_exactly_and_times_out_and_sees_eof():
    r, w = os.pipe()
    try:
        os.write(w, b"abcdef")
        assert process_floor._readn(r, 4, timeout=5) == b"abcd"
        with pytest.raises(TimeoutError):
            process_floor._readn(r, 4, timeout=0.05)  # 2 bytes there, 4 asked: no more come
        os.close(w)
        w = -1
        with pytest.raises(EOFError):
            process_floor._readn(r, 4, timeout=5)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_wire_structs_round_trip():
    h = process_floor.HDR.pack(16, 1, 31, 2)
    assert process_floor.HDR.unpack(h) == (16, 1, 31, 2)
    assert process_floor.REPLY.unpack(process_floor.REPLY.pack(17, 49151, 3)) == (17, 49151, 3)


def test_summary_compares_the_python_frame_path_per_round():
    rounds = [_rnd(10, 11, 12), _rnd(20, 24, 25)]
    rounds[0]["relay-py"] = {"token_ms": 15.0, "tokens": list(REF)}
    rounds[1]["relay-py"] = {"token_ms": 29.0, "tokens": [0]}
    s = process_floor.summarize(rounds, 2, REF)
    assert s["relay-py"] == 22.0
    assert s["relay_py_minus_relay_ms_per_stage"] == pytest.approx(1.75)  # of 1.5 and 2.0
    assert s["relay_py_over_alone"] == pytest.approx((1.5 + 1.45) / 2)
    assert s["parity"]["relay-py"] is False and s["parity"]["relay"] is True
    del rounds[1]["relay-py"]  # not in every round: not summarized
    assert "relay-py" not in process_floor.summarize(rounds, 2, REF)
