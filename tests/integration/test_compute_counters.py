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
from dgr.worker.process import ThreadedWorker

pytestmark = pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the patched llama.cpp")

SETTINGS = dict(n_ctx=128, n_slots=2, n_threads=1, n_ubatch=8)
RANGES = ((0, 2), (2, 4))
PROMPT = [int(t) for t in np.random.default_rng(5).integers(3, 120, 5)]  # one 5-token step
N = 6  # decode steps of a generation


@pytest.fixture(scope="module")
def stages(tiny_llama):
    ws = [ThreadedWorker(dgr.Engine(tiny_llama, layers=r, **SETTINGS), evict_after=3600.0)
          for r in RANGES]
    yield ws
    for w in ws:
        w.stop()


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
    text = MetricsServer(tw.worker, port=0, loop=tw.loop).render()  # one scrape, not serving
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
