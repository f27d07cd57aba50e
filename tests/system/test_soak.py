"""The soak (``benches/soak.py --secure``) for two minutes: mixed load on a 3-stage SmolLM2
route of worker processes with cluster credentials and mutual TLS (relay with the decode loop,
relay, gRPC; early releases), random faults (dropped drivers, data connections cut or stalled
mid-frame, garbage frames and headers on both planes, a slowloris, a connection flood, a relay
to a stranger) and bad clients (authenticated abusers, and callers without the credential,
with a wrong one or replaying a captured authentication frame). No
legitimate session may be lost or wrong, every worker must live, every fault must get the
answer it was designed to get, the dropped drivers' sessions must expire, and the workers'
memory must not keep growing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dgr._core import HAS_LAYER_RANGES

pytestmark = [pytest.mark.system, pytest.mark.slow,
              pytest.mark.skipif(not HAS_LAYER_RANGES, reason="multi-stage routes need the "
                                 "llama.cpp layer-range patches (dgr._core.HAS_LAYER_RANGES)")]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SOAK = os.path.join(ROOT, "benches", "soak.py")
DURATION = 120
#: Bound of the whole run: startup (the workers load while the reference computes, ~16 s
#: here), the load, the settling (the TTL), the final checks, the workers' drain.
TIMEOUT = DURATION + 420
MB = 1024  # kB
#: RSS bounds per worker, from the measured runs. Plaintext (benches/results/soak-*-2026-12-01
#: .json): +3.6..+16 MB over the run, all but +0.2..+3.9 MB of it within the first 30 s, while
#: the allocator's arenas, the connection threads' stacks and the caches fill. --secure
#: (soak-secure-240s-2026-12-01.json and two 120-150 s runs): +21..+36 MB over the run,
#: +9.8..+22.3 MB of it after the first 30 s, in steps that flatten (stage [0, 10) was flat
#: from 90 s to 240 s). What grows there by design: each worker's store of seen token nonces,
#: one per gRPC call and data connection, kept for the --auth-skew window (300 s: longer than
#: this run), and TLS buffers of the tunnel thread and gRPC's core; a probe of 4000 TLS
#: connections to one data server grew 19 MB in its first 500 and nothing after. The total
#: bound catches a gross leak or an unbounded buffer; the steady one a leak of a few hundred
#: KB per second, without failing on a slower machine's larger start-up growth.
GROWTH_MB = 64
STEADY_GROWTH_MB = 32


@pytest.fixture(scope="module")
def soak(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("soak") / "soak.json"
    # --secure: credentials and mutual TLS on both planes, and the bad clients that try
    # without them (docs/security.md); the script imports this checkout's dgr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.run([sys.executable, SOAK, "--duration", str(DURATION), "--seed", "1",
                        "--secure", "--model", str(smollm2), "--json", str(out)],
                       capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)
    assert out.exists(), f"no figures (exit {p.returncode}):\n{p.stdout}\n{p.stderr[-4000:]}"
    with open(out) as f:
        return p.returncode, json.load(f), p.stdout


def test_no_session_is_lost_or_wrong(soak):
    rc, d, summary = soak
    s = d["sessions"]
    assert s.get("lost", 0) == 0 and s.get("wrong", 0) == 0, summary
    assert s["completed"] == s["started"] > 100, summary  # a real load ran
    for path, c in d["by_path"].items():
        assert c.get("completed", 0) > 10, (path, summary)


def test_every_worker_lives_and_drains_cleanly(soak):
    rc, d, summary = soak
    assert d["workers_died"] == {} and d["exit_codes"] == [0, 0, 0], summary


def test_every_fault_gets_its_designed_answer(soak):
    rc, d, summary = soak
    for kind, f in d["faults"].items():
        # the soak draws every kind once in each pass of its deck (27 faults with --secure);
        # two minutes make ~90
        assert f["count"] >= 1, (kind, summary)
        assert f["unexpected"] == 0, (kind, f["details"], summary)
    assert d["faults"]["flood"]["refused"] >= 8 * d["faults"]["flood"]["count"], summary


def test_dropped_drivers_sessions_expire_and_the_slots_come_back(soak):
    rc, d, summary = soak
    assert d["sessions_left"] == [0, 0, 0], summary
    assert d["free_slots_end"] == [d["settings"]["n_slots"]] * 3, summary
    n = d["dropped_sessions"]["count"]
    assert n >= 1, summary
    for stage, fate in d["dropped_sessions"]["on_workers"].items():
        dropped = sum(fate.get(k, 0) for k in ("expire", "evict", "release", "abort"))
        assert dropped == fate["opened"], (stage, fate, summary)


def test_worker_memory_does_not_keep_growing(soak):
    rc, d, summary = soak
    for w in d["rss"]["workers"]:
        assert w["growth_kb"] < GROWTH_MB * MB, (w, summary)
        assert w["steady_growth_kb"] < STEADY_GROWTH_MB * MB, (w, summary)


def test_the_exit_status_says_it_passed(soak):
    rc, d, summary = soak
    assert rc == 0 and d["ok"], summary
