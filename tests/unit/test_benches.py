"""The pure parts of benches/compare.py, timeline.py and process_floor.py (no workers, no model)."""

from __future__ import annotations

import json
import os
import sys

import pytest

BENCHES = os.path.join(os.path.dirname(__file__), "..", "..", "benches")
sys.path.insert(0, os.path.abspath(BENCHES))

compare = pytest.importorskip("compare")
timeline = pytest.importorskip("timeline")
process_floor = pytest.importorskip("process_floor")


def _span(stage, pos, start, end, session="s"):
    return json.dumps({"stage": list(stage), "session": session, "epoch": 0, "pos": pos,
                       "n": 64, "arrive": start, "compute_end": end,
                       "compute_s": end - start, "sent": end})


def test_parse_config():
    assert compare.parse_config("relay3@20ms") == ("relay", 3, 20.0)
    assert compare.parse_config("dgr2") == ("dgr", 2, None)
    assert compare.parse_config("rpc4@5ms") == ("rpc", 4, 5.0)
    assert compare.parse_config("whole") == ("whole", None, None)
    assert compare.parse_config("llama-bench") == ("llama-bench", None, None)


def test_seams_model():
    assert compare.seams_model("relay", 3) == 1.5
    assert compare.seams_model("dgr", 3) == 3.0


def _row(tps, **kw):
    return {"decode_tps": tps, "prefill128_tps": 2 * tps, "ttft_ms": 100.0,
            "cpu_s_per_token": 0.01, **kw}


def test_summarize_ratios_added_ms_and_rtt_model():
    route = dict(parity=True, seam_bytes_per_token=[2000, 2000], tokens=[1, 2])
    samples = {"whole": [_row(100.0)], "dgr3": [_row(50.0, **route)],
               "relay3": [_row(80.0, **route)], "relay3@20ms": [_row(1000 / 50.0, **route)]}
    out = compare.summarize(samples, [3], 1, 32, (128,), ["3@20ms"],
                            model="m.gguf")
    r = out["ratios"]
    assert r["relay3/whole"]["decode_tps"] == pytest.approx(0.8)
    assert r["relay3/dgr3"]["decode_tps"] == pytest.approx(1.6)
    assert "relay3/rpc3" not in r  # no rpc run
    # (1000/50 - 1000/100) / 3 stages
    assert out["added_ms_per_stage"]["dgr3"] == pytest.approx(10 / 3)
    m = out["rtt_model"]["relay3@20ms"]
    assert m["model_tpot_ms"] == pytest.approx(10 + 1.5 * 20)  # C + n/2 * RTT
    assert m["tpot_ms"] == pytest.approx(50.0)
    assert m["ratio"] == pytest.approx(50 / 40)
    assert out["configs"]["relay3"]["parity"] is True
    assert "tokens" not in out["configs"]["relay3"]["samples"][0]


def test_summarize_sessions():
    rows = [{"aggregate_tps": a, "per_session_tps": a / 4, "per_session_tps_min": 1.0,
             "ttft_ms": 5.0, "wall_s": 1.0, "parity": True, "parity_checked": [0, 3],
             "tokens": 128} for a in (40.0, 60.0, 50.0)]
    out = compare.summarize_sessions({"relay3": {4: rows}})
    assert out["relay3"][4]["aggregate_tps"] == 50.0
    assert out["relay3"][4]["parity"] is True


def test_load_spans_filters_session_and_adds_start():
    lines = [_span((0, 10), 0, 1.0, 2.0), "", _span((0, 10), 0, 5.0, 6.0, session="other")]
    spans = timeline.load_spans(lines, session="s")
    assert len(spans) == 1
    assert spans[0]["start"] == pytest.approx(1.0) and spans[0]["stage"] == (0, 10)


def _pipeline():
    # 2 stages, 2 chunks: stage B works on chunk 0 while stage A works on chunk 1
    return timeline.load_spans([
        _span((0, 15), 0, 0.0, 1.0), _span((0, 15), 64, 1.0, 2.0),
        _span((15, 30), 0, 1.0, 2.0), _span((15, 30), 64, 2.0, 3.0)])


def test_overlap_stats():
    st = timeline.overlap_stats(_pipeline())
    assert st["window_s"] == pytest.approx(3.0)
    assert st["busy_s"] == {"0:15": pytest.approx(2.0), "15:30": pytest.approx(2.0)}
    assert st["any_s"] == pytest.approx(3.0)
    assert st["overlap2_s"] == pytest.approx(1.0)
    assert st["overlap2_frac"] == pytest.approx(1 / 3)
    assert timeline.overlap_stats([])["overlap2_s"] == 0.0


def test_overlap_merges_a_stages_own_spans():
    spans = timeline.load_spans([_span((0, 15), 0, 0.0, 2.0), _span((0, 15), 64, 1.0, 3.0)])
    assert timeline.overlap_stats(spans)["overlap2_s"] == 0.0


def test_render():
    rows = timeline.render(_pipeline(), width=6, chunk=64)
    assert len(rows) == 2
    assert rows[0].endswith("|0011..|")
    assert rows[1].endswith("|..0011|")
    assert timeline.render([], width=6) == []


def _decode_span(stage, pos, arrive, start, end):
    return json.dumps({"stage": list(stage), "session": "s", "epoch": 1, "pos": pos, "n": 1,
                       "arrive": arrive, "compute_end": end, "compute_s": end - start,
                       "sent": end + 0.0001})


def test_decode_breakdown_adds_up_to_the_token_period():
    # 2 stages, per token: A python 1, compute 4; hop 2; B python 1, compute 6; hop 3 back
    # to A: a period of 17 (ms as seconds, scaled below)
    lines = []
    for k in range(4):
        t = 17.0 * k
        lines += [_decode_span((0, 15), 10 + k, t, t + 1, t + 5),
                  _decode_span((15, 30), 10 + k, t + 7, t + 8, t + 14)]
    lines.append(_decode_span((0, 15), 0, 0.0, 0.1, 0.9).replace('"n": 1', '"n": 16'))
    b = timeline.decode_breakdown(timeline.load_spans(lines))
    a_, b_ = b["stages"]
    assert b["tokens"] == 4 and a_["stage"] == "0:15"
    assert a_["compute_ms"] == pytest.approx(4e3) and b_["compute_ms"] == pytest.approx(6e3)
    assert a_["python_ms"] == pytest.approx(1e3) and b_["python_ms"] == pytest.approx(1e3)
    assert b_["hop_in_ms"] == pytest.approx(2e3) and a_["hop_in_ms"] == pytest.approx(3e3)
    assert b["token_ms"] == pytest.approx(17e3) and b["sum_ms"] == pytest.approx(17e3)
    assert timeline.decode_breakdown([])["tokens"] == 0


def test_process_floor_summary():
    def rnd(alone, pipes, relay):
        return {"alone": {"token_ms": alone, "compute_ms": [alone / 2] * 2},
                "pipes": {"token_ms": pipes, "compute_ms": [pipes / 2] * 2},
                "relay": {"token_ms": relay}}

    s = process_floor.summarize([rnd(10, 11, 12), rnd(20, 24, 25), rnd(12, 12, 14)], 2)
    assert s["alone"] == 12 and s["pipes"] == 12 and s["relay"] == 14
    assert s["pipes_over_alone"] == pytest.approx(1.1)  # of 1.1, 1.2, 1.0: per round
    assert s["relay_over_pipes_ms_per_stage"] == pytest.approx(0.5)  # of 0.5, 0.5, 1.0
    assert s["relay_over_alone"] == pytest.approx(1.2)  # of 1.2, 1.25, 1.1667
    assert s["pipes_stage_compute_ms"] == [6, 6] and s["alone_stage_compute_ms"] == [6, 6]
