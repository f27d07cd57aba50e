"""The CLI's report (``dgr.cli._report``): each stage's compute per decode token comes from the
deltas of its worker's exact compute totals between a describe before the generation and one
after it, never from the moving average ``recent_step_ms``, so compute and transport add up
to the measured time per token and the transport is never printed negative (stubbed describe
records, exact arithmetic; no model needed). Also: the totals' presence on the wire (an older
worker's reply leaves them unset)."""

from __future__ import annotations

import argparse
import re
import types

from dgr._proto import dgr_pb2
from dgr.cli import commands as cli
from dgr.driver.route import StageStats
from dgr.protocol.describe import StageInfo

LAYERS = ((0, 10), (10, 20), (20, 30))
# the EWMA of the last few steps, far above what the stages computed over the generation:
# the old report subtracted it and printed "22.000 ms/token = 44.724 ms compute + -22.724 ms"
EWMA_MS = 44.724 / 3
NEGATIVE = re.compile(r"(?<![\w.])-\d")  # a negative number (not an endpoint's dash)


def info(i: int, steps: int | None, secs: float | None, *, uptime: float = 100.0,
         endpoint: str | None = None) -> StageInfo:
    """Stage ``i``'s describe record with compute totals ``steps`` / ``secs`` (None: unset)."""
    a, b = LAYERS[i]
    return StageInfo(
        endpoint=endpoint or f"127.0.0.1:{5000 + i}", model_identity="sha256:00",
        model_name="m.gguf", arch="llama", n_layer=30, layers=(a, b), is_first=i == 0,
        is_last=i == len(LAYERS) - 1, needs_token_ids=False, boundary_width=576,
        boundary_dtype="f32", n_vocab=49152, settings={}, eog_tokens=frozenset(), add_bos=False,
        free_slots=3, sessions=1, free_context=3000, queue_depth=0, recent_tokens_per_s=0.0,
        recent_step_ms=EWMA_MS, draining=False, dgr_version="0.1.0", wire_format_version=1,
        wire_schema_version=1, weight_bytes=1, kv_bytes=1, steps_total=0, errors_total=0,
        uptime_s=uptime, data_port=6000 + i, decode_steps_total=steps,
        decode_compute_s_total=secs, tokens_computed_total=None if steps is None else steps,
        compute_s_total=secs)


class FakeRoute:
    def __init__(self, after: list[StageInfo], relay: bool, loop: bool = True):
        self.after = after
        self.stages = after
        self.aroute = types.SimpleNamespace(relay=relay, loop=loop)

    def describe(self) -> list[StageInfo]:
        return self.after


def report(capsys, before, after, *, relay: bool, tokens: int = 11, dec_s: float = 0.22,
           stats=None) -> list[str]:
    """Run ``_report`` over ``tokens`` tokens whose decode took ``dec_s`` s; its lines."""
    session = types.SimpleNamespace(stop_reason="length", recoveries=0, logits=[],
                                    stats=stats if stats is not None else [],
                                    speculation=(0, 0, 0))
    args = argparse.Namespace(max_tokens=tokens, parity=False, stop=[])
    rc = cli._report(FakeRoute(after, relay), session, args, [1, 2, 3], list(range(tokens)),
                     0.0, 1.0, 1.0 + dec_s, None, before)
    assert rc == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines, "the report printed nothing"
    for ln in lines:
        assert not NEGATIVE.search(ln), f"a negative figure: {ln!r}"
    return lines


BEFORE = [info(i, 1000 * (i + 1), 10.0 * (i + 1)) for i in range(3)]


def after(deltas, **kw) -> list[StageInfo]:
    return [info(i, b.decode_steps_total + n, b.decode_compute_s_total + s, **kw)
            for i, (b, (n, s)) in enumerate(zip(BEFORE, deltas, strict=True))]


def test_relay_compute_is_the_delta_mean_and_adds_up_to_the_measured_time(capsys):
    # 10 decode tokens in 0.22 s: 22 ms/token; the stages computed 5, 6 and 4 ms per step
    lines = report(capsys, BEFORE, after([(10, 0.05), (10, 0.06), (10, 0.04)]), relay=True)
    rows = [ln for ln in lines if re.match(r"\[dgr\]\s+\d\s+\[", ln)]
    assert len(rows) == 3
    for row, ms in zip(rows, ("5.000", "6.000", "4.000"), strict=True):
        assert row.split()[-2:] == ["10", ms]
    assert any("22.000 ms/token = 15.000 ms compute + 7.000 ms transport over 3 links "
               "(2.333 ms per link)" in ln for ln in lines), lines


def test_relay_compute_above_the_measured_time_prints_no_transport(capsys):
    # other sessions' steps on the workers: 30 steps of 10 ms each while 10 tokens took 22 ms
    lines = report(capsys, BEFORE, after([(30, 0.3)] * 3), relay=True)
    assert not any("transport over" in ln for ln in lines), lines
    assert any("no transport figure" in ln for ln in lines), lines


def test_relay_with_an_older_worker_says_so(capsys):
    old = after([(10, 0.05), (10, 0.06), (10, 0.04)])
    old[1] = info(1, None, None)
    lines = report(capsys, BEFORE[:1] + [info(1, None, None)] + BEFORE[2:], old, relay=True)
    assert any(f"{old[1].endpoint} reports no compute totals" in ln for ln in lines), lines
    assert not any("transport" in ln for ln in lines), lines
    assert not any(f"{EWMA_MS:.3f}" in ln for ln in lines), "the moving average was printed"


def test_a_restarted_or_replaced_stage_has_no_figure(capsys):
    restarted = after([(10, 0.05)] * 3)
    restarted[0] = info(0, 5, 0.01, uptime=1.0)  # a new process: counters from zero
    restarted[2] = info(2, BEFORE[2].decode_steps_total + 10, 30.05, endpoint="127.0.0.1:7777")
    lines = report(capsys, BEFORE, restarted, relay=True)
    assert any(f"{restarted[0].endpoint} restarted" in ln for ln in lines), lines
    assert any("moved from 127.0.0.1:5002 to 127.0.0.1:7777" in ln for ln in lines), lines
    assert not any("transport" in ln for ln in lines), lines


def grpc_stats(rtts_ms, steps: int = 10) -> list[StageStats]:
    return [StageStats(endpoint=f"127.0.0.1:{5000 + i}", layers=LAYERS[i], steps=steps + 1,
                       decode_steps=steps, decode_rtt_s=steps * ms / 1e3, bytes_sent=100,
                       bytes_received=100) for i, ms in enumerate(rtts_ms)]


def test_grpc_hop_is_round_trip_minus_the_delta_mean(capsys):
    lines = report(capsys, BEFORE, after([(10, 0.05), (10, 0.06), (10, 0.04)]), relay=False,
                   stats=grpc_stats([7.0, 8.5, 4.25]))
    rows = [ln for ln in lines if re.match(r"\[dgr\]\s+\d\s+\[", ln)]
    assert len(rows) == 3
    for row, want in zip(rows, (["7.000", "5.000", "2.000"], ["8.500", "6.000", "2.500"],
                                ["4.250", "4.000", "0.250"]), strict=True):
        assert row.split()[-4:-1] == want, row
    assert any("transport per token: 4.750 ms over 3 hop(s); per seam (a seam adds one "
               "hop): 1.583 ms" in ln for ln in lines), lines


def test_grpc_hop_needs_the_same_steps_on_both_sides(capsys):
    # stage 1 computed 25 single-token steps while this session sent it 10: other sessions
    lines = report(capsys, BEFORE, after([(10, 0.05), (25, 0.3), (10, 0.04)]), relay=False,
                   stats=grpc_stats([7.0, 8.5, 4.25]))
    assert any("computed 25 single-token steps, this session sent it 10" in ln
               for ln in lines), lines
    assert not any("transport per token" in ln for ln in lines), lines


def test_describe_reply_leaves_the_totals_unset_for_an_older_worker():
    base = dict(model_identity="sha256:00", n_layer=4, layer_start=0, layer_end=4,
                settings=dgr_pb2.EngineSettings(n_ctx=64))
    old = StageInfo.from_proto("h:1", dgr_pb2.DescribeReply(**base))
    assert (old.decode_steps_total, old.decode_compute_s_total, old.tokens_computed_total,
            old.compute_s_total) == (None, None, None, None)
    # a worker that computed nothing yet sends zeros, which are not "unset"
    new = dgr_pb2.DescribeReply.FromString(dgr_pb2.DescribeReply(
        **base, decode_steps_total=0, decode_compute_s_total=0.0, tokens_computed_total=7,
        compute_s_total=0.5).SerializeToString())
    got = StageInfo.from_proto("h:1", new)
    assert (got.decode_steps_total, got.decode_compute_s_total, got.tokens_computed_total,
            got.compute_s_total) == (0, 0.0, 7, 0.5)
