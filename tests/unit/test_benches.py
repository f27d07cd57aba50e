"""The pure parts of benches/compare.py, timeline.py, process_floor.py and tls_seams.py (no
workers, no model; tls_seams: a tiny link micro over loopback, TLS with a throwaway CA)."""

from __future__ import annotations

import json
import os

import pytest

BENCHES = os.path.join(os.path.dirname(__file__), "..", "..", "benches")

compare = pytest.importorskip("compare")
clusters = pytest.importorskip("harness.clusters")
common = pytest.importorskip("harness.common")
llama_tools = pytest.importorskip("harness.llama")
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
    # relay: n/2 a token, plus one link (half a round trip) per loop window, the first one
    # included: 64 steps in windows of 32 -> 2 windows
    assert clusters.seams_model("relay", 3, 64, 32) == pytest.approx(1.5 + 2 / 128)
    assert clusters.seams_model("relay", 3, 32, 32) == pytest.approx(1.5 + 1 / 64)
    assert clusters.seams_model("relay", 4, 1, 32) == pytest.approx(2.5)
    assert clusters.seams_model("dgr", 3, 64) == 3.0
    with pytest.raises(ValueError):
        clusters.seams_model("relay", 3, 0)


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
    s = 1.5 + 1 / 64  # 32 steps: one loop window
    assert m["S"] == pytest.approx(s)
    assert m["model_tpot_ms"] == pytest.approx(10 + s * 20)  # C + S * RTT
    assert m["tpot_ms"] == pytest.approx(50.0)
    assert m["ratio"] == pytest.approx(50 / (10 + s * 20))
    assert out["configs"]["relay3"]["parity"] is True
    assert out["configs"]["relay3"]["seam_bytes_per_token"] == [2000, 2000]
    assert "tokens" not in out["configs"]["relay3"]["samples"][0]


def test_summarize_each_family_against_its_own_whole_model():
    # llama-bench's whole model and dgr.Engine's differ: rpc must be taken against the
    # former, dgr/relay against the latter
    samples = {"whole": [_row(100.0)], "llama-bench": [_row(125.0)],
               "dgr3": [_row(50.0, parity=True, tokens=[1])], "rpc3": [_row(100.0)],
               "rpc3@20ms": [_row(50.0)]}
    out = compare.summarize(samples, [3], 1, 32, (128,), ["3@20ms"], model="m.gguf")
    r = out["ratios"]
    assert r["rpc3/llama-bench"]["decode_tps"] == pytest.approx(0.8)
    assert r["rpc3@20ms/llama-bench"]["decode_tps"] == pytest.approx(0.4)
    assert not any(k.startswith("rpc") and k.endswith("/whole") for k in r)
    assert r["dgr3/whole"]["decode_tps"] == pytest.approx(0.5)
    assert r["dgr3/rpc3"]["decode_tps"] == pytest.approx(0.5)
    assert r["whole/llama-bench"]["decode_tps"] == pytest.approx(0.8)
    added = out["added_ms_per_stage"]
    assert added["rpc3"] == pytest.approx((1000 / 100 - 1000 / 125) / 3)  # 2/3 ms
    assert added["rpc3@20ms"] == pytest.approx((1000 / 50 - 1000 / 125) / 3)
    assert added["dgr3"] == pytest.approx((1000 / 50 - 1000 / 100) / 3)
    assert "rtt_model" in out and "rpc3@20ms" not in out["rtt_model"]


def test_summarize_without_llama_bench_reports_no_rpc_baseline():
    samples = {"whole": [_row(100.0)], "rpc3": [_row(100.0)]}
    out = compare.summarize(samples, [3], 1, 32, (128,), model="m.gguf")
    assert "rpc3/llama-bench" not in out["ratios"]
    assert "rpc3" not in out["added_ms_per_stage"]  # never against dgr.Engine's whole


def _flag(cmd, name):
    assert cmd.count(name) == 1, f"{name} appears {cmd.count(name)} times in {cmd}"
    return cmd[cmd.index(name) + 1]


def test_llama_bench_commands_run_dgrs_settings():
    s = common.SETTINGS
    cmds = llama_tools.llama_bench_commands(s, 64, (128, 512), "m.gguf", exe="lb")
    assert sorted(cmds) == ["decode", "prefill"]
    for cmd in cmds.values():
        assert cmd[0] == "lb" and _flag(cmd, "-m") == "m.gguf"
        assert _flag(cmd, "-t") == str(s["n_threads"]) == "1"
        assert _flag(cmd, "-ub") == str(s["n_ubatch"]) == "64"
        assert _flag(cmd, "-b") == "64"  # dgr's n_batch is its n_ubatch
        assert _flag(cmd, "-fa") == "1"
        assert _flag(cmd, "-ctk") == "f16" and _flag(cmd, "-ctv") == "f16"
        assert _flag(cmd, "-ngl") == "0" and "--rpc" not in cmd
        assert _flag(cmd, "-r") == "1" and _flag(cmd, "-o") == "json"
    pre, dec = cmds["prefill"], cmds["decode"]
    assert (_flag(pre, "-p"), _flag(pre, "-n"), _flag(pre, "-d")) == ("128,512", "0", "0")
    # decode at the same depth after the same prompt length as dgr
    assert (_flag(dec, "-p"), _flag(dec, "-n"), _flag(dec, "-d")) == (
        "0", "64", str(common.N_PROMPT_DECODE))
    assert common.N_PROMPT_DECODE == 16


def test_llama_bench_commands_follow_the_settings_and_rpc():
    s = {**common.SETTINGS, "n_ubatch": 32, "flash_attn": False, "n_threads": 2,
         "type_k": "q8_0"}
    cmds = llama_tools.llama_bench_commands(s, 8, (), "m.gguf", rpc=["127.0.0.1:1", "127.0.0.1:2"],
                                        extra=["--repack", "0"])
    assert list(cmds) == ["decode"]  # no prefill lengths: no prefill run
    dec = cmds["decode"]
    assert (_flag(dec, "-ub"), _flag(dec, "-b"), _flag(dec, "-fa"), _flag(dec, "-t"),
            _flag(dec, "-ctk")) == ("32", "32", "0", "2", "q8_0")
    assert _flag(dec, "--rpc") == "127.0.0.1:1,127.0.0.1:2" and _flag(dec, "-ngl") == "99"
    assert dec[dec.index("--repack"):dec.index("--repack") + 2] == ["--repack", "0"]


def test_llama_bench_commands_refuse_what_they_cannot_mirror():
    s = common.SETTINGS
    with pytest.raises(ValueError, match="n_ctx"):  # llama-bench's context would be larger
        llama_tools.llama_bench_commands({**s, "n_ctx": 256}, 250, (), "m.gguf")
    with pytest.raises(ValueError, match="n_ctx"):
        llama_tools.llama_bench_commands({**s, "n_ctx": 256}, 8, (512,), "m.gguf")
    llama_tools.llama_bench_commands({**s, "n_ctx": 256}, 240, (256,), "m.gguf")  # fits exactly
    with pytest.raises(ValueError, match="n_slots"):
        llama_tools.llama_bench_commands({**s, "n_slots": 4}, 8, (), "m.gguf")
    with pytest.raises(ValueError, match="mirror"):
        llama_tools.llama_bench_commands({**s, "mtp": True}, 8, (), "m.gguf")
    with pytest.raises(ValueError, match="batch_invariant"):
        llama_tools.llama_bench_commands({**s, "batch_invariant": True}, 8, (), "m.gguf")


def test_llama_bench_commands_take_every_engine_setting_at_its_default():
    """compare.py passes the engine's own settings (every numeric setting dgr has): one added
    to dgr without the bench knowing it failed compare.py at its start (batch_invariant did)."""
    from dgr.protocol import settings as engine_settings

    s = {k: engine_settings.DEFAULTS[k] for k in engine_settings.NUMERIC_SETTINGS}
    cmds = llama_tools.llama_bench_commands({**s, "n_slots": 1}, 8, (), "m.gguf")
    assert _flag(cmds["decode"], "-ub") == str(s["n_ubatch"])


def _bench_rec(n_prompt, n_gen, n_depth, ts, **kw):
    return {"n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth, "avg_ts": ts,
            "n_threads": 1, "n_batch": 64, "n_ubatch": 64, "flash_attn": 1, "type_k": "f16",
            "type_v": "f16", "n_gpu_layers": 0, **kw}


def test_parse_bench_checks_every_record():
    s = common.SETTINGS
    recs = [_bench_rec(128, 0, 0, 300.0), _bench_rec(512, 0, 0, 250.0),
            _bench_rec(0, 64, 16, 60.0)]
    assert llama_tools.parse_bench(recs, s, 16) == {"prefill128_tps": 300.0,
                                                "prefill512_tps": 250.0, "decode_tps": 60.0}
    for bad in (_bench_rec(0, 64, 0, 60.0),                   # decoded from an empty cache
                _bench_rec(128, 0, 0, 1.0, n_ubatch=512),     # llama-bench's default ubatch
                _bench_rec(128, 0, 0, 1.0, n_batch=2048),
                _bench_rec(128, 0, 0, 1.0, flash_attn=-1),    # auto
                _bench_rec(128, 0, 0, 1.0, n_gpu_layers=99)):
        with pytest.raises(RuntimeError, match="llama-bench ran"):
            llama_tools.parse_bench([bad], s, 16)
    rpc = _bench_rec(0, 64, 16, 60.0, n_gpu_layers=99)
    assert llama_tools.parse_bench([rpc], s, 16, rpc=True) == {"decode_tps": 60.0}


SS = "\n".join([  # ss -tinpH state established: an address line, then its tcp_info line
    '0      0      127.0.0.1:40100 127.0.0.1:46937 users:(("python3",pid=6347,fd=4))',
    "\t bbr wscale:10,10 rto:204 rtt:0.551/0.323 mss:55296 bytes_sent:12345 "
    "bytes_acked:12346 segs_out:3 segs_in:2 bytes_received:77",
    '0      0      127.0.0.1:46937 127.0.0.1:40100 users:(("python3",pid=6347,fd=5))',
    "\t bbr wscale:10,10 rto:200 rtt:0.048/0.024 bytes_received:12345 segs_out:1",
    '0      0      [::1]:5000 [::1]:40100 users:(("w",pid=7,fd=3),("w",pid=8,fd=3))',
    "\t cubic bytes_sent:10 bytes_acked:11",
    '0      0      127.0.0.1:5001 127.0.0.1:40100 users:(("w",pid=7,fd=9))',
    "\t cubic bytes_sent:5 bytes_acked:6",
    ""])


def test_parse_ss_and_bytes_sent_to():
    socks = compare.parse_ss(SS)
    assert len(socks) == 4
    assert socks[0] == {"local": "127.0.0.1:40100", "peer": "127.0.0.1:46937",
                        "pids": [6347], "bytes_sent": 12345, "bytes_received": 77}
    assert socks[1]["bytes_sent"] == 0 and socks[1]["bytes_received"] == 12345
    assert socks[2]["pids"] == [7, 8] and socks[2]["peer"] == "[::1]:40100"
    assert compare.bytes_sent_to(socks, 6347, 46937) == 12345
    assert compare.bytes_sent_to(socks, 6347, 40100) == 0  # its other socket sent nothing
    assert compare.bytes_sent_to(socks, 7, 40100) == 15  # both of pid 7's sockets to 40100
    assert compare.bytes_sent_to(socks, 8, 40100) == 10
    assert compare.bytes_sent_to(socks, 9, 40100) == 0
    # with a State column (no ``state`` filter)
    stated = compare.parse_ss("ESTAB " + SS.splitlines()[0] + "\n" + SS.splitlines()[1])
    assert len(stated) == 1 and stated[0]["peer"] == "127.0.0.1:46937"


class _FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class _FakeEngine:
    """forward() advances the clock: 100 s for the prompt, 1 s a decode step; the argmax
    of the row it returns is the position it was called at, mod 50."""

    def __init__(self, clock):
        self.clock, self.calls = clock, []

    def release(self, slot):
        self.calls.append(("release", slot))

    def forward(self, slot, pos, tokens):
        import numpy as np

        self.calls.append(("forward", pos, [int(t) for t in tokens]))
        self.clock.t += 100.0 if len(tokens) > 1 else 1.0
        row = np.zeros((1, 50), np.float32)
        row[0, (pos + len(tokens)) % 50] = 1.0
        return row


def test_timed_decode_counts_the_decode_steps_only(monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(compare.time, "perf_counter", clock)
    monkeypatch.setattr(compare.time, "process_time", clock)
    eng = _FakeEngine(clock)
    m = compare.timed_decode(eng, [5] * 16, 8)
    toks, dt, cpu = m["tokens"], 8 / m["decode_tps"], 8 * m["cpu_s_per_token"]
    assert dt == 8.0 and cpu == 8.0  # the prompt's 100 s are not in the decode figures
    assert toks == [16, 17, 18, 19, 20, 21, 22, 23, 24]  # the prompt's token + 8 steps
    fw = [c for c in eng.calls if c[0] == "forward"]
    assert len(fw) == 9 and fw[0] == ("forward", 0, [5] * 16)
    assert [c[1] for c in fw[1:]] == list(range(16, 24))
    assert [c[2] for c in fw[1:]] == [[t] for t in toks[:-1]]  # each feeds the last token


def test_session_parity_checks_every_session():
    refs = [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert compare.session_parity([[1, 2], [3, 4], [5, 6]], refs) == (True, 3)
    # a middle session that differs is caught (not only the first and the last)
    assert compare.session_parity([[1, 2], [3, 9], [5, 6]], refs) == (False, 3)
    assert compare.session_parity([[1, 2], [3, 4], [5]], refs) == (False, 3)
    with pytest.raises(ValueError):
        compare.session_parity(refs + [[9]], refs)


def test_summarize_sessions():
    rows = [{"aggregate_tps": a, "per_session_tps": a / 4, "per_session_tps_min": 1.0,
             "tpot_ms_p50": 4000 / a, "tpot_ms_max": 8000 / a,
             "ttft_ms": 5.0, "wall_s": 1.0, "parity": True, "parity_checked": 4,
             "tokens": 128} for a in (40.0, 60.0, 50.0)]
    out = compare.summarize_sessions({"relay3": {4: rows}})
    assert out["relay3"][4]["aggregate_tps"] == 50.0
    assert out["relay3"][4]["tpot_ms_p50"] == 80.0 and out["relay3"][4]["tpot_ms_max"] == 160.0
    assert out["relay3"][4]["parity"] is True
    assert out["relay3"][4]["parity_checked"] == 4
    rows[1] = {**rows[1], "parity": False}
    assert compare.summarize_sessions({"relay3": {4: rows}})["relay3"][4]["parity"] is False


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


def _decode_ms(tps, hop=1.0):
    return {"tokens_per_s": tps, "hop_ms": hop, "compute_ms": [1.0, 2.0, 3.0]}


def test_tls_seams_arguments_and_summaries():
    tls_seams = pytest.importorskip("tls_seams")
    a = tls_seams.parse_args(["--rounds", "2", "--modes", "tls", "--micro-n", "3"])
    assert (a.rounds, a.micro_n, a.modes) == (2, 3, ["plain", "tls"])  # plain: the baseline
    assert tls_seams.parse_args([]).modes == ["plain", "keys", "tls", "mtls"]
    for bad in (["--modes", "ssh"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            tls_seams.parse_args(bad)
    out = tls_seams.summarize_decode({
        ("plain", "relay"): [_decode_ms(100.0), _decode_ms(50.0), _decode_ms(200.0)],
        ("tls", "relay"): [_decode_ms(80.0, 2.0)] * 3,
        ("tls", "grpc"): [_decode_ms(40.0)],
        ("plain", "grpc"): [_decode_ms(50.0, 3.0)], ("keys", "grpc"): [_decode_ms(40.0, 4.0)]})
    p, t = out["plain"]["relay"], out["tls"]["relay"]
    assert p["tokens_per_s"] == 100.0 and p["ms_per_token"] == 10.0 and p["links"] == 3
    assert p["added_ms_per_seam"] == 0.0
    assert t["added_ms_per_seam"] == pytest.approx((12.5 - 10.0) / 3)  # over 3 links
    assert t["hop_ms"] == 2.0 and t["compute_ms"] == [1.0, 2.0, 3.0]
    assert t["added_hop_ms_per_link"] == 1.0  # relay: hop ms is per link
    # per round: (12.5 - 10) / 3, (12.5 - 20) / 3, (12.5 - 5) / 3 -> the median
    assert t["added_ms_per_seam_paired"] == pytest.approx(2.5 / 3)
    assert t["round_tokens_per_s"] == [80.0] * 3
    assert out["plain"]["relay"]["added_hop_ms_per_link"] == 0.0
    k = out["keys"]["grpc"]
    assert k["links"] == 6 and k["added_ms_per_seam"] == pytest.approx((25.0 - 20.0) / 6)
    assert k["added_hop_ms_per_link"] == 0.5  # gRPC: hop ms is a round trip, 2 links
    assert "added_ms_per_seam" in out["tls"]["grpc"]
    assert tls_seams.summarize_decode({("tls", "grpc"): [_decode_ms(40.0)]})["tls"]["grpc"][
        "added_ms_per_seam"] is None  # no plain run to compare with
    assert tls_seams.LINKS == {"relay": 3, "grpc": 6}
    assert tls_seams.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert tls_seams.percentile(list(range(101)), 99) == 99.0
    assert tls_seams.percentile([1.0, 2.0], 50) == 1.5


def test_tls_seams_link_micro_through_tls(tmp_path):
    """A tiny link micro in this process: plaintext and TLS echo servers, every frame size
    and frame I/O, the TLS client verifying the throwaway CA's certificate."""
    tls_seams = pytest.importorskip("tls_seams")
    pytest.importorskip("trustme")
    from dgr.worker.frames import HAVE_NATIVE

    if not HAVE_NATIVE:
        pytest.skip("no native frame I/O in this build")
    pki = tls_seams.write_pki(str(tmp_path))
    servers = {m: tls_seams.echo_servers(m, pki, tls_seams.micro_ios(m))
               for m in ("plain", "mtls")}
    try:
        out = tls_seams.run_micro({m: {io: s.address for io, s in ss.items()}
                                   for m, ss in servers.items()}, pki, rounds=1, n=3,
                                  sizes=(16, 4096), n_connect=1)
        with pytest.raises((RuntimeError, OSError)):  # plaintext to a TLS server: cut off
            tls_seams.EchoClient(servers["mtls"]["native"].address,
                                 tls_seams.driver_security("plain", pki), "native")
    finally:
        for ss in servers.values():
            for s in ss.values():
                s.stop()
    assert sorted(out) == ["mtls", "plain"]
    assert sorted(out["plain"]) == ["native", "python"]
    assert sorted(out["mtls"]) == ["native", "python", "sslsock"]
    for ios in out.values():
        for row in ios.values():
            assert row["connect_ms"] > 0
            assert {k: v["n"] for k, v in row.items() if k != "connect_ms"} == {"16": 3,
                                                                                "4096": 3}
    text = tls_seams.table({"args": {"micro_n": 3, "rounds": 1}, "micro": out,
                            "load_average": 1.0})
    assert "mtls   sslsock" in text


def test_decode_tps_counts_the_window_where_every_session_decodes():
    measure = pytest.importorskip("harness.measure")
    # one session: its tokens after the first over its decode time
    assert measure.decode_tps([[1.0, 1.5, 2.0, 3.0]]) == pytest.approx(3 / 2.0)
    # two sessions: b prefills until 2.0 and a finishes at 4.0; inside (2, 4]: a's 3.0 and
    # 4.0, b's 3.0 and 4.0 (b's first token at 2.0 and its 5.0 lie outside)
    a, b = [1.0, 2.0, 3.0, 4.0], [2.0, 3.0, 4.0, 5.0]
    assert measure.decode_tps([a, b]) == pytest.approx(4 / 2.0)
    # the prefill before the window does not count, as batched-bench's S_TG leaves its
    # prompt phase out: a slow first token changes nothing
    assert measure.decode_tps([[0.0, *a[1:]], b]) == pytest.approx(4 / 2.0)
    # no window: a session of one token, or sessions one after the other
    assert measure.decode_tps([[1.0]]) is None
    assert measure.decode_tps([[1.0, 2.0], [3.0, 4.0]]) is None
    assert measure.decode_tps([]) is None


def test_end_to_end_tps_of_a_batched_bench_record():
    measure = pytest.importorskip("harness.measure")
    rec = {"pl": 16, "tg": 64, "t_pp": 1.0, "t_tg": 7.0, "speed_tg": 16 * 64 / 7.0}
    assert measure.end_to_end_tps(rec) == pytest.approx(16 * 64 / 8.0)


def test_rate_is_the_decode_phase_else_the_wall():
    measure = pytest.importorskip("harness.measure")
    assert measure.rate({"decode_tps": 150.0, "aggregate_tps": 100.0}) == 150.0
    assert measure.rate({"decode_tps": None, "aggregate_tps": 100.0}) == 100.0  # no window
    assert measure.rate({"aggregate_tps": 100.0}) == 100.0  # results from before token times


def test_hot_path_sink_takes_what_the_relay_sends():
    # benches/hot_path.py stands a sink in for the worker's Links: the relay calls it as it
    # calls Links.send (a sink with older parameters made the bench fail with a TypeError)
    import inspect

    from dgr.transport.dataplane import Links

    hot_path = pytest.importorskip("hot_path")
    assert (list(inspect.signature(hot_path._Sink.send).parameters)
            == list(inspect.signature(Links.send).parameters))


def test_sampling_parity_refuses_too_few_tokens_before_starting_anything(monkeypatch, capsys):
    """Its logit_bias case biases the plain run's 6th token: fewer tokens were an IndexError
    after llama-server had started."""
    sampling_parity = pytest.importorskip("sampling_parity")
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: pytest.fail("started a server"))
    with pytest.raises(SystemExit) as e:
        sampling_parity.main(["--tokens", "4"])
    assert e.value.code == 2 and "at least 6" in capsys.readouterr().err


def test_device_lane_probe_builds_an_engine_after_grpc_and_the_chat_binding(tmp_path):
    """The lane checks first that an engine builds after the imports that crashed the first
    CUDA run (SIGSEGV in Engine.__new__ after importing grpc or dgr._chat)."""
    from dgr.testing.fixtures import write_tiny_llama

    device_lane = pytest.importorskip("device_lane")
    model = str(write_tiny_llama(tmp_path / "tiny.gguf"))
    r = device_lane.probe(model, "cpu")
    assert r["ok"] and r["returncode"] == 0, r
    assert "backtrace" not in r


def test_device_lane_probe_gives_a_crash_its_native_backtrace(tmp_path):
    """A probe process killed by a signal is reported with a backtrace from gdb, or says that
    the machine has none (the lane then stops before the runs that would crash the same)."""
    import shutil

    device_lane = pytest.importorskip("device_lane")
    crash = "import os, signal, sys\nos.kill(os.getpid(), signal.SIGSEGV)"
    r = device_lane.probe("model.gguf", "cpu", code=crash)
    assert not r["ok"] and r["returncode"] == -11, r
    if shutil.which("gdb") or shutil.which("cuda-gdb"):
        # gdb's run, unless the machine forbids tracing (a container without ptrace)
        assert "SIGSEGV" in r["backtrace"] or "ptrace" in r["backtrace"], r["backtrace"]
    else:
        assert r["backtrace"] == "no gdb on this machine"


@pytest.mark.parametrize("layers", [None, (2, 4)], ids=["whole", "a later range"])
def test_compute_gap_steps_a_first_or_later_range(tiny_llama, layers):
    """benches/compute_gap.py decodes one slot, tokens on a first stage and a boundary on a
    later one, each step followed by its pause (slept or spun)."""
    import dgr

    compute_gap = pytest.importorskip("compute_gap")
    e = dgr.Engine(tiny_llama, layers=layers, n_ctx=64, n_threads=1)
    for spin in (False, True):
        ms = compute_gap.step_ms(e, 0.001, spin, 3)
        assert ms > 0
        assert e.next_pos(0) == compute_gap.PROMPT + 3


def test_the_stage_bound_decodes_every_ring_group_over_the_sessions_contexts(tiny_llama,
                                                                               monkeypatch):
    """benches/batching.py's bound for each stage runs the route's decode steps: each group of
    b consecutive slots in turn, every step's position one further, from the prompt's end
    over the session's tokens (the contexts the route's sessions attend over), on a first
    and a later range."""
    import dgr

    batching = pytest.importorskip("batching")
    calls, real = [], dgr.Engine

    class Spy:
        def __init__(self, *a, **kw):
            self.e = real(*a, **kw)

        def __getattr__(self, name):
            return getattr(self.e, name)

        def forward_batch(self, slots, pos, *rest):
            calls.append((self.e.is_first, list(slots), list(pos)))
            return self.e.forward_batch(slots, pos, *rest)

    monkeypatch.setattr(dgr, "Engine", Spy)
    monkeypatch.setitem(batching.SETTINGS, "n_ctx", 64)
    p = batching.N_PROMPT
    # one session; 4 sessions in runs of 3, the last one shorter (as 5 sessions on 2 stages
    # are cut into 3 and 2)
    bounds = batching.stage_bounds(tiny_llama, [(0, 2), (2, 4)], 4, {1: 1, 3: 4}, 3)
    assert [sorted(b) for b in bounds] == [[1, 3], [1, 3]]
    assert all(ms > 0 for b in bounds for ms in b.values())
    for first in (True, False):
        steps = [(s, q) for f, s, q in calls if f is first and len(q) != p]
        assert steps == [([0], [p]), ([0], [p + 1]), ([0], [p + 2]),
                         ([0, 1, 2], [p] * 3), ([3], [p]), ([0, 1, 2], [p + 1] * 3),
                         ([3], [p + 1]), ([0, 1, 2], [p + 2] * 3), ([3], [p + 2])]


def test_the_agent_trace_is_the_same_each_run_and_shaped_as_the_issue_asks():
    agent_trace = pytest.importorskip("agent_trace")
    system, turns = agent_trace.trace(20, 12000, 200, 2000)
    assert (system, turns) == agent_trace.trace(20, 12000, 200, 2000)
    assert len(turns) == 20 and turns[0] == [{"role": "user", "content": agent_trace.TASK}]
    cpt = agent_trace.CHARS_PER_TOKEN
    assert 12000 <= len(system) / cpt < 12100
    for k, messages in enumerate(turns[1:], 2):
        assert len(messages) == 1 + 2 * (k - 1)  # each turn adds a call and its result
        call, result = messages[-2]["content"][1], messages[-1]["content"][0]
        assert call["type"] == "tool_use" and call["id"].startswith("toolu_")
        assert result["tool_use_id"] == call["id"]
        assert 200 <= len(result["content"]) / cpt < 2000 + 100
        assert messages[:-2] == turns[k - 2]  # the history only grows
