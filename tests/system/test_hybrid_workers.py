"""A hybrid model (Qwen3.5: gated delta net and attention layers) on a route of real worker
processes: the whole model's tokens, a stage SIGKILLed mid-generation (its recurrent state is
lost with it: the spare re-prefills), speculation refused by name (a recurrent state cannot
roll rejected drafts back), and ``python -m dgr run`` showing parity on it."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.core.local import generate_local
from dgr.driver.route import Route
from dgr.testing import archs
from dgr.worker.process import LocalCluster

pytestmark = [pytest.mark.system,
              pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the layer-range patches")]

SETTINGS = dict(n_ctx=160, n_slots=4, n_threads=1, n_ubatch=8, flash_attn=True)
RANGES = [(0, 3), (3, 6), (6, 8)]
N_TOKENS = 24


@pytest.fixture(scope="module")
def qwen35():
    written = archs.write("^qwen35$", n_layer=8)  # cached per vendor key
    (path,) = written.files
    return path


def prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(1, 128) for _ in range(70 + i)]  # 9+ ubatches of 8


@pytest.fixture(scope="module")
def refs(qwen35):
    whole = dgr.Engine(qwen35, **{**SETTINGS, "n_slots": 1})
    return [generate_local(whole, prompt(i), max_tokens=N_TOKENS, stop_on_eog=False)[0]
            for i in range(2)]


@pytest.fixture
def cluster(qwen35):
    """Workers for RANGES plus a spare for the middle range (index 3)."""
    c = LocalCluster(str(qwen35), RANGES + [(3, 6)], settings=SETTINGS)
    try:
        c.start(timeout=60)
        yield c
    finally:
        c.stop(timeout=10)


def test_the_route_generates_the_whole_models_tokens_and_survives_a_sigkill(cluster, refs):
    victim, spare = cluster.workers[1], cluster.workers[3]
    with Route(cluster.endpoints[:3], spares=[spare.endpoint], connect_timeout=10) as r:
        assert r.complete(prompt(0), max_tokens=N_TOKENS, stop_on_eog=False).tokens == refs[0]
        s = r.session()
        it = s.generate(prompt(1), max_tokens=N_TOKENS, stop_on_eog=False)
        toks = [next(it) for _ in range(8)]
        victim.kill()
        toks += list(it)
        assert s.recoveries == 1
        assert r.stages[1].endpoint == spare.endpoint
        s.close()
    assert toks == refs[1]


def test_speculation_on_a_hybrid_route_is_refused_by_name(cluster):
    with pytest.raises(errors.RouteError, match="drafts with nothing.*cannot roll a rejected "
                                                "draft back.*recurrent or hybrid"):
        with Route(cluster.endpoints[:3], speculate="ngram", connect_timeout=10) as r:
            r.complete(prompt(0), max_tokens=4)


def assert_cli_run_shows_parity(model) -> None:
    """``python -m dgr run --parity`` through three worker processes on ``model``: the whole
    model's tokens and logits, and every worker stopped cleanly."""
    r = subprocess.run([sys.executable, "-m", "dgr", "run", "--model", str(model), "--stages",
                        "3", "--max-tokens", "8", "--no-chat", "--prompt", "hello world",
                        "--parity"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "matches the whole model (in-process dgr.Engine, same settings): yes" in r.stderr
    assert "logits bit-identical over 8 steps: yes" in r.stderr, r.stderr
    assert "workers stopped (exit status 0, 0, 0)" in r.stderr


def test_cli_run_on_a_hybrid_model_shows_parity(qwen35):
    assert_cli_run_shows_parity(qwen35)


def test_a_caching_front_on_a_hybrid_route_gives_an_uncached_fronts_text(qwen35):
    """Chat-like turns (each prompt the last one grown) through a front with its prompt cache
    and the stages' prefix stores on, and through one with neither, greedy and seeded: the
    same text and log probabilities. A recurrent stage cuts a kept session back only to a state
    snapshot (the ends of its last whole chunks prefilled from 0), so every next turn reuses
    the prompt's whole chunks and prefills the rest; the stages keep no prefix entry."""
    from dgr.driver.route import AsyncRoute
    from dgr.serve.app import create_app
    from dgr.testing.serving import Served
    from dgr.worker.process import ThreadedWorker

    pytest.importorskip("openai")
    engine = dict(SETTINGS, n_slots=4)
    ws = [ThreadedWorker(dgr.Engine(qwen35, layers=r, **engine)) for r in RANGES]
    addrs = [w.address for w in ws]
    cached = Served(create_app(AsyncRoute(addrs), model="q", prompt_cache=2,
                               prompt_cache_ttl=600))
    plain = Served(create_app(AsyncRoute(addrs), model="q", prefix_store=False))
    try:
        rng = random.Random(53)
        prompt = [rng.randrange(3, 128) for _ in range(70)]
        for turn in range(6):
            req = dict(prompt=prompt, max_tokens=6, logprobs=2)
            req.update(dict(temperature=0.8, seed=turn) if turn % 2 else dict(temperature=0))
            got = [c.completions.create(model="q", **req).choices[0]
                   for c in (cached.openai(api_key="x"), plain.openai(api_key="x"))]
            assert got[0].text == got[1].text, turn
            assert got[0].logprobs.model_dump() == got[1].logprobs.model_dump(), turn
            prompt = prompt + [rng.randrange(3, 128) for _ in range(rng.randrange(1, 9))]
        import json
        import urllib.request

        with urllib.request.urlopen(cached.base + "/status") as r:
            pc = json.load(r)["prompt_cache"]
        # turns 1..5 each restored the snapshot at the end of the last whole chunk the turn
        # before prefilled (its prompt: 70 tokens and more, in chunks of 8)
        assert pc["hits"] == 5 and pc["tokens_reused"] >= 5 * 64 and pc["rows_reused"] == 0, pc
        assert pc["store_hits"] == 0, pc
    finally:
        for s in (cached, plain):
            s.stop()
        for w in ws:
            w.stop()


def test_certify_a_hybrid_lane_with_a_failover(qwen35, tmp_path):
    """``python -m dgr certify`` on the hybrid fixture: parity through worker processes, a
    stage SIGKILLed onto a spare, speculation recorded as refused (its state rolls nothing
    back), the prompt cache's next turn restoring a state snapshot with a fresh prefill's bits,
    and the lane written to the store."""
    import json

    r = subprocess.run([sys.executable, "-m", "dgr", "certify", "--model", str(qwen35),
                        "--stages", "3", "--failover", "--store", str(tmp_path), "--prompt",
                        "hello world", "--max-tokens", "8"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "speculative trips: refused: the lane's recurrent state rolls no rejected draft" \
        in r.stderr, r.stderr
    assert "a recurrent state is cut back to nothing shorter" in r.stderr, r.stderr
    assert "bit-identical to a fresh prefill" in r.stderr, r.stderr
    assert "keeping 0 of its" not in r.stderr, r.stderr
    (path,) = tmp_path.glob("*.json")
    rec = json.loads(path.read_text())
    assert rec["arch"] == "qwen35" and rec["rollback_window"] == 0
    assert rec["parity"]["passed"] and rec["speculation"] is None
    assert rec["scenario"]["failover"]["passed"], rec["scenario"]["failover"]


def test_the_describe_and_capability_records_give_the_state_bytes(qwen35):
    """The capacity inputs of a hybrid stage: its recurrent state bytes per session (its own
    layers'; inside kv_bytes) beside the KV bytes per context token of its attention layers,
    and the state snapshots it keeps per session, in Describe (as the driver reads it) and in
    the capability record."""
    from dgr.control import capability
    from dgr.worker.process import ThreadedWorker

    eng = dgr.Engine(qwen35, layers=(0, 3), **SETTINGS)
    per = eng.describe()["state_bytes"]
    assert per > 0
    async def describe(address):
        from dgr.transport.client import ShardClient

        c = ShardClient(address)
        try:
            return await c.describe()
        finally:
            await c.close()

    with ThreadedWorker(eng) as tw:
        st = asyncio.run(describe(tw.address))
        assert (st.state_bytes, st.state_snapshots, st.rollback_window) == (per, 4, 0)
        cap = tw.worker.capability().capacity
        assert cap.state_bytes_per_session == per and cap.state_snapshots == 4
        cells = SETTINGS["n_ctx"] * SETTINGS["n_slots"]
        assert cap.kv_bytes_per_token == (cap.kv_bytes - per * SETTINGS["n_slots"]) / cells > 0
    assert capability.record_for(eng).capacity.state_bytes_per_session == per
