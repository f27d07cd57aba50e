"""The pure parts of benches/compare.py's concurrent-session rows and llama-batched-bench
reference, and of benches/harness/bench_batching.py (no workers, no model)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

compare = pytest.importorskip("compare")
common = pytest.importorskip("harness.common")
llama_tools = pytest.importorskip("harness.llama")

SETTINGS = {"n_ctx": 1024, "n_slots": 32, "n_threads": 1, "n_ubatch": 64, "flash_attn": True,
            "type_k": "f16", "type_v": "f16"}


def _flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_batched_bench_threads_is_the_routes_total_capped_at_the_cores():
    assert llama_tools.batched_bench_threads(3, 1, 2) == (1, 2)
    assert llama_tools.batched_bench_threads(3, 1, 16) == (1, 3)
    assert llama_tools.batched_bench_threads(2, 2, 16) == (2, 4)
    assert llama_tools.batched_bench_threads(1, 1, 8) == (1, 1)
    with pytest.raises(ValueError):
        llama_tools.batched_bench_threads(0, 1, 2)


def test_batched_bench_command_mirrors_the_session_clusters_settings():
    cmd = llama_tools.batched_bench_command(SETTINGS, [16, 1, 4, 32, 4], 64, 2, "m.gguf", exe="bb")
    assert cmd[0] == "bb" and _flag(cmd, "-m") == "m.gguf"
    assert _flag(cmd, "-c") == str(1024 * 32)  # n_ctx per sequence x the most sequences
    assert "-no-kvu" in cmd  # one KV stream per sequence, as dgr's slots
    assert _flag(cmd, "-b") == "64" and _flag(cmd, "-ub") == "64"
    assert _flag(cmd, "-t") == "2" and _flag(cmd, "-fa") == "on"
    assert _flag(cmd, "-ctk") == "f16" and _flag(cmd, "-ctv") == "f16"
    assert _flag(cmd, "-lm") == "auto" and _flag(cmd, "-ngl") == "0"
    assert _flag(cmd, "-npp") == str(common.N_PROMPT_DECODE) and _flag(cmd, "-ntg") == "64"
    assert _flag(cmd, "-npl") == "1,4,16,32"  # sorted, once each
    assert _flag(cmd, "--output-format") == "jsonl"


def test_batched_bench_command_follows_other_settings():
    s = {**SETTINGS, "n_ctx": 256, "n_slots": 8, "n_ubatch": 32, "flash_attn": False,
         "type_k": "q8_0", "use_mmap": False}
    cmd = llama_tools.batched_bench_command(s, [2, 8], 16, 1, "m.gguf", n_prompt=8)
    assert cmd[0] == "llama-batched-bench"
    assert _flag(cmd, "-c") == str(256 * 8) and _flag(cmd, "-b") == "32"
    assert _flag(cmd, "-ub") == "32" and _flag(cmd, "-fa") == "off"
    assert _flag(cmd, "-ctk") == "q8_0" and _flag(cmd, "-lm") == "none"
    assert _flag(cmd, "-npp") == "8" and _flag(cmd, "-ntg") == "16"


def test_batched_bench_command_refuses_what_it_cannot_mirror():
    with pytest.raises(ValueError, match="mtp"):
        llama_tools.batched_bench_command({**SETTINGS, "mtp": True}, [4], 8, 1, "m.gguf")
    with pytest.raises(ValueError, match="batch_invariant"):
        llama_tools.batched_bench_command({**SETTINGS, "batch_invariant": True}, [4], 8, 1,
                                          "m.gguf")
    llama_tools.batched_bench_command({**SETTINGS, "batch_invariant": False}, [4], 8, 1,
                                      "m.gguf")
    with pytest.raises(ValueError, match="slots"):
        llama_tools.batched_bench_command({**SETTINGS, "n_slots": 16}, [4, 32], 8, 1, "m.gguf")
    with pytest.raises(ValueError, match="n_ctx"):
        llama_tools.batched_bench_command({**SETTINGS, "n_ctx": 64}, [4], 49, 1, "m.gguf")
    llama_tools.batched_bench_command({**SETTINGS, "n_ctx": 64}, [4], 48, 1, "m.gguf")  # fits
    with pytest.raises(ValueError):
        llama_tools.batched_bench_command(SETTINGS, [], 8, 1, "m.gguf")


def _record(pl, threads=2, tg=64, **over):
    rec = {"n_kv_max": 32768, "n_batch": 64, "n_ubatch": 64, "flash_attn": 1,
           "is_pp_shared": 0, "n_gpu_layers": 0, "n_threads": threads,
           "n_threads_batch": threads, "pp": 16, "tg": tg, "pl": pl, "n_kv": pl * (16 + tg),
           "t_pp": 0.1, "speed_pp": 160.0 * pl, "t_tg": 0.01 * tg * (1 + pl / 8),
           "speed_tg": pl * tg / (0.01 * tg * (1 + pl / 8)), "t": 1.0, "speed": 1.0}
    return rec | over


def _jsonl(*recs):
    return "\n".join(["main: n_kv_max = 32768", "", *(json.dumps(r) for r in recs), ""])


def test_parse_batched_bench_reads_s_tg_and_the_time_per_step():
    text = _jsonl(_record(1), _record(4), _record(16), _record(32))
    out = llama_tools.parse_batched_bench(text, SETTINGS, [1, 4, 16, 32], 64, 2)
    assert sorted(out) == [1, 4, 16, 32]
    assert out[16]["aggregate_tps"] == pytest.approx(16 * 64 / (0.64 * 3))
    assert out[16]["tpot_ms"] == pytest.approx(1e3 * 0.64 * 3 / 64)  # one token a sequence
    assert out[4]["prefill_tps"] == 640.0 and out[4]["record"]["pl"] == 4


def test_parse_batched_bench_refuses_other_settings_and_missing_counts():
    ok = [_record(1), _record(4)]
    llama_tools.parse_batched_bench(_jsonl(*ok), SETTINGS, [1, 4], 64, 2)
    for bad in (_record(4, threads=1), _record(4, tg=32), _record(4, n_ubatch=32),
                _record(4, flash_attn=0), _record(4, is_pp_shared=1),
                _record(4, n_gpu_layers=99)):
        with pytest.raises(RuntimeError, match="ran"):
            llama_tools.parse_batched_bench(_jsonl(ok[0], bad), SETTINGS, [1, 4], 64, 2)
    with pytest.raises(RuntimeError, match=r"\[16\]"):  # batched-bench skipped a count
        llama_tools.parse_batched_bench(_jsonl(*ok), SETTINGS, [1, 4, 16], 64, 2)
    with pytest.raises(RuntimeError, match="context"):  # a smaller KV than dgr's slots
        llama_tools.parse_batched_bench(_jsonl(_record(1, n_kv_max=1024), ok[1]), SETTINGS,
                                    [1, 4], 64, 2)


def test_session_tpot_ms():
    gens = [SimpleNamespace(tokens=[1] * 65, decode_s=1.28),
            SimpleNamespace(tokens=[1] * 33, decode_s=0.32)]
    assert compare.session_tpot_ms(gens) == pytest.approx([20.0, 10.0])
    with pytest.raises(ValueError):
        compare.session_tpot_ms([SimpleNamespace(tokens=[1], decode_s=0.0)])


def test_summarize_batched_bench_takes_medians_over_rounds():
    def r(tps):
        return {4: {"aggregate_tps": tps, "tpot_ms": 4000 / tps, "prefill_tps": 1.0}}

    out = compare.summarize_batched_bench({2: [r(100.0), r(140.0), r(120.0)], 1: [r(50.0)]})
    assert list(out) == ["t1", "t2"]
    assert out["t2"][4]["aggregate_tps"] == 120.0
    assert out["t2"][4]["tpot_ms"] == pytest.approx(4000 / 120)
    assert out["t2"][4]["rounds"] == 3 and out["t1"][4]["rounds"] == 1


def test_session_ratios_over_batched_bench_at_each_k():
    sess = {"relay3": {1: {"aggregate_tps": 50.0}, 16: {"aggregate_tps": 150.0}},
            "dgr3": {16: {"aggregate_tps": 75.0}}}
    bb = {"t1": {1: {"aggregate_tps": 50.0}, 16: {"aggregate_tps": 100.0}},
          "t2": {16: {"aggregate_tps": 200.0}}}
    out = compare.session_ratios(sess, bb)
    assert out["relay3/batched-bench-t1"] == {1: 1.0, 16: 1.5}
    assert out["relay3/batched-bench-t2"] == {16: 0.75}  # no k=1 at -t 2: no ratio
    assert out["dgr3/batched-bench-t2"] == {16: 0.375}
    assert compare.session_ratios(sess, {}) == {}


def _res():
    # k=16 has the decode phase's rate (the ratios take it), k=1 not (older results: aggr)
    sess = {"relay3": {k: {"aggregate_tps": 10.0 * k, "tpot_ms_p50": 20.0, "tpot_ms_max": 25.5,
                           "ttft_ms": 30.0, "parity": k != 16, "parity_checked": k,
                           **({"decode_tps": 180.0} if k == 16 else {})}
                       for k in (1, 16)}}
    bb = {"t1": {1: {"aggregate_tps": 40.0, "tpot_ms": 25.0}},
          "t2": {1: {"aggregate_tps": 50.0, "tpot_ms": 20.0},
                 16: {"aggregate_tps": 200.0, "tpot_ms": 80.0}}}
    return {"sessions": sess, "batched_bench": bb, "batched_bench_same_threads": {"relay3": 2},
            "sessions_ratios": compare.session_ratios(sess, bb)}


def test_sessions_table():
    text = compare.sessions_table(_res())
    lines = text.splitlines()
    hdr = next(line for line in lines if "configuration" in line)
    assert "/bb-t1" in hdr and "/bb-t2 same-thr" in hdr and "/bb-t1 same" not in hdr
    assert "TPOT p50 ms" in hdr and "TPOT max ms" in hdr
    assert any("-t2 for relay3" in line for line in lines)
    row = {tuple(line.split()[:2]): line.split() for line in lines
           if line.startswith("  ") and len(line.split()) > 2}
    assert "S_TG-like" in hdr
    assert row[("relay3", "1")][2:9] == ["10.0", "-", "20.0", "25.5", "30.0", "0.25", "0.20"]
    assert row[("relay3", "1")][9:] == ["yes", "(1)"]
    assert row[("relay3", "16")][2:9] == ["160.0", "180.0", "20.0", "25.5", "30.0", "-", "0.90"]
    assert row[("relay3", "16")][9:] == ["NO", "(16)"]  # no t1 record at k=16: no ratio
    assert row[("batched-bench-t2", "16")][2:6] == ["-", "200.0", "80.0", "80.0"]
    assert row[("batched-bench-t1", "1")][2:6] == ["-", "40.0", "25.0", "25.0"]
    assert ("batched-bench-t1", "16") not in row


def test_print_table_of_sessions_only():
    import io

    res = {**_res(), "settings": SETTINGS, "n_decode": 64, "prefills": [], "ran": {},
           "configs": {}, "ratios": {}, "loadavg": (1.0, 1.0, 1.0), "model": "m.gguf",
           "rounds": 1}
    f = io.StringIO()
    compare.print_table(res, file=f)
    out = f.getvalue()
    assert compare.sessions_table(res) in out
    assert "decode t/s" not in out  # no empty whole-model table


def test_run_compare_refuses_sessions_only_with_other_rows():
    with pytest.raises(ValueError, match="whole"):
        compare.run_compare([3], 1, whole=False, sessions=[1])


def test_main_only_sessions_runs_the_session_rows_and_batched_bench(monkeypatch):
    calls = []

    def fake_run(*a, **kw):
        calls.append((a, kw))
        return {}

    monkeypatch.setattr(compare, "run_compare", fake_run)
    monkeypatch.setattr(compare, "print_table", lambda res: None)
    assert compare.main(["--only-sessions", "--sessions", "1,4,16,32", "--rtt-ms", "5"]) == 0
    (a, kw), = calls
    assert a[0] == [] and kw["rtts"] == [] and kw["sessions"] == [1, 4, 16, 32]
    assert kw["whole"] is False and kw["rpc"] is False and kw["llama"] is False
    assert kw["batched"] is True
    calls.clear()
    compare.main(["--only-sessions", "--sessions", "4", "--no-llama-bench"])
    assert calls[0][1]["batched"] is False
    calls.clear()
    compare.main(["--sessions", "4", "--no-batched-bench", "--stages", "3"])
    (a, kw), = calls
    assert a[0] == [3] and kw["whole"] is True and kw["llama"] is True
    assert kw["batched"] is False
    with pytest.raises(SystemExit):
        compare.main(["--only-sessions"])


# --- benches/harness/bench_batching.py ---------------------------------------------------

def test_bench_batching_tracks_read_the_summary_rows():
    from harness import bench_batching as bb

    cache = {4: {"sessions": 4, "batched": {"aggregate_tps": 120.0, "parity": True,
                                            "tpot_ms_p50": 30.0, "tpot_ms_max": 33.0},
                 "solo": {"aggregate_tps": 60.0, "parity": False},
                 "batched_over_solo": 2.0, "bb_t1": 100.0, "batched_over_bb_t1": 1.2,
                 "bb_t2": None, "pipeline_tps": 150.0, "batched_over_pipeline": 0.8}}
    b = bb.BatchingSmolLM2()
    assert b.track_batched4_tokens_per_s(cache) == 120.0
    assert b.track_solo4_tokens_per_s(cache) == 60.0
    assert b.track_batched4_over_solo_ratio(cache) == 2.0
    assert b.track_batched4_over_bb_t1_ratio(cache) == 1.2
    assert math.isnan(b.track_batched4_over_bb_t2_ratio(cache))  # batched-bench not built
    assert b.track_batched4_over_pipeline_ratio(cache) == 0.8
    assert math.isnan(b.track_batched16_over_pipeline_ratio(cache))
    assert b.track_batched4_parity(cache) == 1.0 and b.track_solo4_parity(cache) == 0.0
    assert b.track_batched4_tpot_ms_p50(cache) == 30.0
    assert b.track_batched4_tpot_ms_max(cache) == 33.0
    assert math.isnan(b.track_batched16_tokens_per_s(cache))  # no k=16 row
    assert bb.BatchingSmolLM2.track_batched4_tokens_per_s.unit == "tokens/s"
    assert bb.BatchingSmolLM2.track_batched4_parity.unit == "bool"
    for k in bb.SESSIONS:
        for t in bb.THREADS:
            assert hasattr(bb.BatchingSmolLM2, f"track_batched{k}_over_bb_t{t}_ratio")
