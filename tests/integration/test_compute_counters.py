"""A worker's exact compute totals (``DescribeReply`` fields 33-36, docs/capability.md): the
deltas between two describes count exactly the steps a generation sent through it, on the
gRPC path and under direct relay with the decode loop, and Prometheus exposes the same
totals. Real engines (the tiny llama), in-process workers on loopback."""

from __future__ import annotations

import time

import numpy as np
import pytest

import dgr
from dgr._core import HAS_LAYER_RANGES
from dgr.control.metrics import MetricsServer
from dgr.driver.route import Route
from dgr.testing.stages import threaded_stages

pytestmark = pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the patched llama.cpp")

SETTINGS = dict(n_ctx=128, n_slots=2, n_threads=1, n_ubatch=8)
RANGES = ((0, 2), (2, 4))
PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, 120, 5)]  # one 5-token step
N = 6  # decode steps of a generation


@pytest.fixture(scope="module")
def stages(tiny_llama):
    with threaded_stages(tiny_llama, RANGES, SETTINGS, evict_after=3600.0) as ws:
        yield ws


def generate(stages, relay: bool, n_decode: int):
    """Describe, generate ``n_decode`` steps after the prompt, describe: (before, after,
    the driver's per-stage stats, wall seconds around the generation)."""
    with Route([w.address for w in stages], relay=relay) as route:
        assert route.aroute.relay is relay
        before = route.describe()
        s = route.session()
        try:
            t0 = time.perf_counter()
            toks = list(s.generate(PROMPT, max_tokens=n_decode + 1, stop_on_eog=False))
            wall = time.perf_counter() - t0
            after = route.describe()
        finally:
            s.close()
    assert len(toks) == n_decode + 1
    assert len(before) == len(after) == len(RANGES)
    return before, after, s.stats, wall


@pytest.mark.parametrize("relay", [False, True], ids=["grpc", "relay-loop"])
def test_totals_count_exactly_the_steps_computed(stages, relay):
    before, after, stats, wall = generate(stages, relay, N)
    decode_s = []
    for b, a in zip(before, after):
        assert a.endpoint == b.endpoint
        # every step of the generation, and nothing else: the prompt's, then N single-token
        assert a.decode_steps_total - b.decode_steps_total == N
        assert a.tokens_computed_total - b.tokens_computed_total == len(PROMPT) + N
        ds = a.decode_compute_s_total - b.decode_compute_s_total
        cs = a.compute_s_total - b.compute_s_total
        assert 0 < ds < cs  # the prompt's step computed too
        decode_s.append(ds)
    # one session: the stages compute one after another, so all of it fits in the wall time
    assert sum(a.compute_s_total - b.compute_s_total for b, a in zip(before, after)) <= wall
    if not relay:  # the driver sent each stage the same N single-token steps
        assert [st.decode_steps for st in stats] == [N] * len(RANGES)
        # and each round trip holds its step's compute
        for st, ds in zip(stats, decode_s):
            assert ds <= st.decode_rtt_s


def test_counters_are_monotonic_across_generations(stages):
    _, first, _, _ = generate(stages, False, 2)
    _, second, _, _ = generate(stages, True, 3)
    for a, b in zip(first, second):
        assert b.decode_steps_total == a.decode_steps_total + 3
        assert b.tokens_computed_total == a.tokens_computed_total + len(PROMPT) + 3
        assert b.decode_compute_s_total > a.decode_compute_s_total
        assert b.compute_s_total > a.compute_s_total


def _samples(text: str) -> dict[str, float]:
    out = {}
    for ln in text.splitlines():
        if ln and not ln.startswith("#"):
            name, value = ln.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_expose_the_describe_totals(stages):
    generate(stages, False, 2)  # something counted
    tw = stages[0]
    text = MetricsServer(tw.worker, port=0, loop=tw.event_loop).render()  # one scrape, not serving
    with Route([w.address for w in stages], relay=False) as route:
        info = route.describe()[0]
    for name in ("dgr_worker_decode_steps_total", "dgr_worker_decode_compute_seconds_total",
                 "dgr_worker_tokens_computed_total", "dgr_worker_compute_seconds_total"):
        assert f"# TYPE {name} counter" in text
    got = _samples(text)
    assert got["dgr_worker_decode_steps_total"] == info.decode_steps_total > 0
    assert got["dgr_worker_decode_compute_seconds_total"] == info.decode_compute_s_total > 0
    assert got["dgr_worker_tokens_computed_total"] == info.tokens_computed_total
    assert got["dgr_worker_compute_seconds_total"] == info.compute_s_total


def test_metrics_say_where_each_stages_time_went(stages):
    """Each stage's profile (docs/performance.md): wall seconds by part, the process's CPU,
    the engine's forwards, decodes and ubatches, and the stage loop's batches."""
    from dgr.worker.profile import PARTS

    tw = stages[1]
    before = tw.worker.profile_snapshot()
    generate(stages, True, N)
    after = tw.worker.profile_snapshot()
    d = {p: after["parts"][p] - before["parts"][p] for p in PARTS}
    assert d["engine"] > 0 and d["sample"] > 0 and d["hand_on"] > 0 and d["frame_in"] > 0
    eng = {k: after["engine"][k] - before["engine"][k] for k in after["engine"]}
    assert eng["forwards"] == N + 1 == eng["decodes"] == eng["ubatches"]  # one session
    assert 0 < eng["decode_s"] <= eng["forward_s"] <= d["engine"]
    assert after["cpu_s"] > before["cpu_s"] and after["batches"] - before["batches"] == N + 1
    got = _samples(MetricsServer(tw.worker, port=0, loop=tw.event_loop).render())
    for p in PARTS:
        assert got[f'dgr_worker_stage_seconds_total{{part="{p}"}}'] >= after["parts"][p]
    assert got["dgr_engine_forwards_total"] >= after["engine"]["forwards"]
    assert got["dgr_engine_ubatches_total"] >= after["engine"]["ubatches"]
    assert got["process_cpu_seconds_total"] >= after["cpu_s"]


def test_engine_counts_one_ubatch_per_run_of_consecutive_slots(tiny_llama):
    """llama.cpp's equal split computes a batch's sequences as one ubatch only where their
    slots are consecutive: slots 0, 1, 2, 3 are one ubatch, slots 0, 2 and 1, 3 two each
    (why the stage loop groups ring sessions by slot)."""
    e = dgr.Engine(tiny_llama, layers=(0, 2), n_ctx=64, n_slots=4, n_threads=1, n_ubatch=8)
    c0 = e.counters
    e.forward_batch(np.arange(4, dtype=np.int32), np.zeros(4, np.int32),
                    np.full(4, 5, np.int32))
    c1 = e.counters
    assert (c1["forwards"] - c0["forwards"], c1["decodes"] - c0["decodes"],
            c1["ubatches"] - c0["ubatches"]) == (1, 1, 1)
    e.forward_batch(np.array([0, 2], np.int32), np.ones(2, np.int32), np.full(2, 5, np.int32))
    e.forward_batch(np.array([1, 3], np.int32), np.ones(2, np.int32), np.full(2, 5, np.int32))
    c2 = e.counters
    assert (c2["forwards"] - c1["forwards"], c2["ubatches"] - c1["ubatches"]) == (2, 4)
    # 10 tokens of one slot with n_ubatch 8: two decodes
    e.forward_batch(np.zeros(10, np.int32), np.arange(2, 12, dtype=np.int32),
                    np.full(10, 5, np.int32))
    c3 = e.counters
    assert (c3["forwards"] - c2["forwards"], c3["decodes"] - c2["decodes"]) == (1, 2)
    assert c3["decode_s"] > c0["decode_s"] and c3["forward_s"] >= c3["decode_s"]
