"""Real worker processes (python -m dgr.worker) on loopback, driven by dgr.Route, on SmolLM2."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.cli.commands import DEFAULT_PROMPT
from dgr.core.local import generate_local
from dgr.driver.route import Route
from dgr.protocol import wire
from dgr.protocol.sampling import SamplingParams, sample_rows
from dgr.testing.waits import read_until
from dgr.transport.client import ShardClient
from dgr.worker.process import LocalCluster, WorkerProcess

pytestmark = [pytest.mark.system, pytest.mark.slow]

SETTINGS = dict(n_ctx=512, n_slots=4, n_threads=1, n_ubatch=32, flash_attn=True)
THREE = [(0, 10), (10, 20), (20, 30)]
NEEDS_RANGES = pytest.mark.skipif(
    not HAS_LAYER_RANGES,
    reason="multi-stage routes need the llama.cpp layer-range patches: dgr._core."
           "HAS_LAYER_RANGES is False in this build (rebuild with pip install -e .)")
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = ["Why is the sky blue?", "Name three colours.", "What is 2 + 2?",
             "Say hello in French."]


@pytest.fixture(scope="module")
def reaper():
    """Every worker process a test starts; all are killed and reaped at the end."""
    procs: list[WorkerProcess] = []
    yield procs
    for p in procs:
        p.kill()


def spawn(reaper, model, layers=None, settings=SETTINGS, args=(), listen="127.0.0.1:0"):
    w = WorkerProcess(str(model), layers, settings=settings, args=list(args), listen=listen)
    reaper.append(w)
    w.start()
    w.wait_listening(120)
    return w


@pytest.fixture(scope="module")
def whole(smollm2):
    return dgr.Engine(smollm2, **SETTINGS)


@pytest.fixture(scope="module")
def cluster(smollm2, reaper):
    """Three workers when layer ranges exist, else one worker serving the whole model."""
    ranges = THREE if HAS_LAYER_RANGES else [None]
    c = LocalCluster(str(smollm2), ranges, settings=SETTINGS, args=["--evict-after", "3600"])
    reaper.extend(c.workers)
    c.start(timeout=120)
    yield c
    codes = c.stop()
    assert codes == [0] * len(codes), [w.log_tail() for w in c.workers]


def prompt_of(whole, q):
    return [int(t) for t in whole.tokenize(CHAT.format(q), True, True)]


def check_parity(endpoints, whole, n_tokens=24):
    with Route(endpoints) as r:
        s = r.session()
        p = prompt_of(whole, QUESTIONS[0])
        g = s.complete(p, max_tokens=n_tokens, logits=True)
        ref, rows = generate_local(whole, p, max_tokens=n_tokens, logits=True)
        assert g.tokens == ref and len(ref) > 8
        assert len(g.logits) == len(rows)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(g.logits, rows))
        # the fast path (token ids only) gives the same tokens
        assert list(s.generate(p, max_tokens=n_tokens)) == ref
        s.close()
        return r.stages


@NEEDS_RANGES
def test_three_workers_bit_identical_to_the_whole_model(cluster, whole):
    stages = check_parity(cluster.endpoints, whole)
    assert [s.layers for s in stages] == THREE


def test_one_worker_bit_identical_to_the_whole_model(cluster, whole, smollm2, reaper):
    if HAS_LAYER_RANGES:
        w = spawn(reaper, smollm2)
        check_parity([w.endpoint], whole)
        assert w.stop() == 0
    else:
        check_parity(cluster.endpoints, whole)


def whole_model_steps(whole, prompt, n_tokens, sampling):
    """The reference of a sampled generation, computed here step by step: the whole model's
    ``Engine.forward`` and ``dgr.protocol.sampling.sample_rows`` at each token's position (not
    ``generate_local``, not a route). Returns the tokens and the logits row each was drawn
    from (an end-of-generation token stops it, not kept)."""
    whole.release(0)
    row = whole.forward(0, 0, np.asarray(prompt, dtype=np.int32))
    pos = len(prompt)
    toks: list[int] = []
    rows: list[np.ndarray] = []
    while True:
        t = sample_rows(row, [pos], sampling)[0]
        if whole.is_eog(t):
            break
        toks.append(t)
        rows.append(np.array(row[-1]))
        if len(toks) == n_tokens:
            break
        row = whole.forward(0, pos, np.array([t], dtype=np.int32))
        pos += 1
    whole.release(0)
    return toks, rows


def test_four_concurrent_sessions(cluster, whole):
    prompts = [prompt_of(whole, q) for q in QUESTIONS]
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=3)
    refs = [generate_local(whole, p, max_tokens=16)[0] for p in prompts[:2]]
    for p in prompts[2:]:
        toks, rows = whole_model_steps(whole, p, 16, sp)
        # the reference really is sampled: every token among its row's 40 best, and not
        # the greedy sequence (so a route that ignored the sampling parameters would differ)
        assert len(toks) == len(rows) > 0
        assert all(t in np.argsort(-r, kind="stable")[:40] for t, r in zip(toks, rows))
        assert toks != whole_model_steps(whole, p, 16, None)[0]
        refs.append(toks)
    results: dict[int, object] = {}
    with Route(cluster.endpoints) as r:
        def one(i):
            try:
                with r.session() as s:
                    results[i] = s.complete(prompts[i], max_tokens=16,
                                            sampling=sp if i >= 2 else None).tokens
            except BaseException as e:  # noqa: BLE001 - reported below
                results[i] = e

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a session did not finish"
    assert sorted(results) == [0, 1, 2, 3]
    assert [results[i] for i in range(4)] == refs


# -- refusals, each with its status and message; the worker keeps serving -----------------


def frame(info, session, epoch, pos, toks, model=None):
    return wire.encode(wire.Forward(
        model=model or info.identity, session=session, epoch=epoch, first_pos=pos,
        n_tokens=len(toks), layer=info.layers[0], tokens=toks,
        want="token" if info.is_last else "boundary"))


def answer(data):
    h = wire.decode(data).header
    return h.to_exception() if type(h) is wire.ErrorReply else h


def test_refusals_then_still_serving(cluster, whole):
    ep = cluster.endpoints[0]
    p = prompt_of(whole, QUESTIONS[1])[:8]

    async def go():
        c = ShardClient(ep)
        try:
            info = await c.describe()
            st = c.stream()
            assert type(answer(await st.step(frame(info, "x", 5, 0, p)))) is wire.Result
            got = [answer(await st.step(f)) for f in (
                frame(info, "x", 4, 8, [p[0]]),                 # stale epoch
                frame(info, "x", 5, 11, [p[0]]),                # a gap
                frame(info, "ghost", 1, 40, [p[0]]),            # unknown session
                frame(info, "x", 5, 8, [p[0]], model="sha256:" + "ab" * 32 + "+" + "x"),
            )]
            r = answer(await st.step(frame(info, "x", 5, 8, [p[1]])))  # still serving x
            await c.release("x")
            await st.close()
            return got, r
        finally:
            await c.close()

    got, after = asyncio.run(go())
    assert [type(e) for e in got] == [errors.StaleEpoch, errors.CacheMiss,
                                      errors.UnknownSession, errors.ModelMismatch]
    assert "epoch 4 is stale: this worker serves epoch 5" in str(got[0])
    assert "step starts at position 11 but this worker's cache continues at 8" in str(got[1])
    assert "session 'ghost' is unknown to this worker" in str(got[2])
    assert "frame is for model sha256:abab" in str(got[3])
    assert type(after) is wire.Result
    # and a whole generation still works
    with Route(cluster.endpoints) as r:
        assert r.complete(p, max_tokens=4).tokens == generate_local(whole, p, max_tokens=4)[0]


def test_full_worker(smollm2, reaper, whole):
    w = spawn(reaper, smollm2, settings={**SETTINGS, "n_slots": 1},
              args=["--evict-after", "3600"])
    p = prompt_of(whole, QUESTIONS[2])[:8]

    async def go():
        c = ShardClient(w.endpoint)
        try:
            info = await c.describe()
            st = c.stream()
            assert type(answer(await st.step(frame(info, "a", 1, 0, p)))) is wire.Result
            full = answer(await st.step(frame(info, "b", 1, 0, p)))
            more = answer(await st.step(frame(info, "a", 1, 8, [p[0]])))  # a is still served
            await st.close()
            return full, more
        finally:
            await c.close()

    full, more = asyncio.run(go())
    assert type(full) is errors.ResourceExhausted
    assert "all 1 slots are in use" in str(full) and full.retry_after > 0
    assert type(more) is wire.Result
    assert w.stop() == 0


def test_route_with_an_overlap_or_a_gap(cluster, smollm2, reaper, whole):
    w = spawn(reaper, smollm2)  # the whole model: overlaps any first stage
    with pytest.raises(errors.RouteError, match=r"served twice: .* overlaps"):
        Route([cluster.endpoints[0], w.endpoint])
    if HAS_LAYER_RANGES:
        with pytest.raises(errors.RouteError, match=r"layers \[10, 20\) are not covered: gap"):
            Route([cluster.endpoints[0], cluster.endpoints[2]])
    p = prompt_of(whole, QUESTIONS[1])
    ref = generate_local(whole, p, max_tokens=4)[0]
    assert len(ref) == 4
    with Route(cluster.endpoints) as r:  # the workers serve on, and still compute right
        assert r.complete(p, max_tokens=4).tokens == ref
    assert w.stop() == 0


# -- failures during a generation ----------------------------------------------------------


@pytest.fixture
def fresh(smollm2, reaper):
    """A cluster of its own (tests below kill or stop its workers)."""
    ranges = THREE if HAS_LAYER_RANGES else [None]
    c = LocalCluster(str(smollm2), ranges, settings=SETTINGS)
    reaper.extend(c.workers)
    c.start(timeout=120)
    yield c
    c.stop()


def test_worker_restarted_mid_generation_gives_the_same_tokens(fresh, whole):
    p = prompt_of(whole, QUESTIONS[0])
    ref = generate_local(whole, p, max_tokens=24)[0]
    victim = fresh.workers[len(fresh.workers) // 2]
    # loop windows of 4: the decode loop runs at most 4 tokens ahead of the reader, so the
    # kill after 8 tokens lands before the generation's end (a 32-token window could finish)
    with Route(fresh.endpoints, connect_timeout=60, loop_window=4) as r:
        s = r.session()
        it = s.generate(p, max_tokens=24)
        toks = [next(it) for _ in range(8)]
        victim.kill()
        victim.restart(120)  # same address, empty caches
        toks += list(it)
        assert s.recoveries >= 1 and s.epoch >= 2
        s.close()
    assert toks == ref


def test_sigterm_during_a_generation_drains_and_exits_zero(fresh, whole):
    p = prompt_of(whole, QUESTIONS[3])
    victim = fresh.workers[-1]
    out: list = []
    started = threading.Event()

    def gen(r):
        try:
            for t in r.session().generate(p, max_tokens=400, stop_on_eog=False):
                out.append(t)
                if len(out) == 3:
                    started.set()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out.append(e)
        started.set()

    with Route(fresh.endpoints, connect_timeout=2, max_retries=1) as r:
        th = threading.Thread(target=gen, args=(r,))
        th.start()
        assert started.wait(60)
        victim.proc.send_signal(signal.SIGTERM)
        # a hang guard beyond the worker's --drain-timeout (30 s): a drain that times out
        # shows in its log (below), not as this wait expiring
        code = victim.proc.wait(90)
        th.join(60)
        assert not th.is_alive(), "the generation did not end"
    assert code == 0
    err = out[-1]
    assert isinstance(err, (errors.WorkerDraining, errors.WorkerUnavailable)), err
    assert 3 <= len(out) - 1 < 400
    log = victim.log_tail(50)
    assert "SIGTERM received" in log and "drained" in log
    assert "drain timeout" not in log  # the in-flight step finished: nothing was cut off


# -- the command line ------------------------------------------------------------------------


# the engine settings of SETTINGS, as command-line flags
CLI_SETTINGS = ["--ctx", str(SETTINGS["n_ctx"]), "--slots", str(SETTINGS["n_slots"]),
                "--threads", str(SETTINGS["n_threads"]), "--ubatch", str(SETTINGS["n_ubatch"]),
                "--flash-attn", "on"]


def test_cli_run_and_generate(cluster, smollm2, whole):
    # what the CLI must print, computed here (not the CLI's own "matches: yes"): the whole
    # model's greedy text for the default prompt in the chat format, with the same settings
    p = prompt_of(whole, DEFAULT_PROMPT)
    ref12, ref8 = (generate_local(whole, p, max_tokens=n)[0] for n in (12, 8))
    assert len(ref12) == 12 and ref12[:8] == ref8

    stages = "3" if HAS_LAYER_RANGES else "1"
    r = subprocess.run([sys.executable, "-m", "dgr", "run", "--stages", stages, "--max-tokens",
                        "12", "--model", str(smollm2), "--parity", *CLI_SETTINGS],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == whole.detokenize(ref12) + "\n", (r.stdout, r.stderr)
    assert "matches the whole model (in-process dgr.Engine, same settings): yes" in r.stderr
    assert "logits bit-identical over 12 steps: yes" in r.stderr and "tokens/s" in r.stderr
    assert "workers stopped (exit status " + ", ".join(["0"] * int(stages)) in r.stderr
    assert "direct relay with decode loop: " in r.stderr and f"over {stages} links" in r.stderr
    g = subprocess.run([sys.executable, "-m", "dgr", "generate", "--route",
                        ",".join(cluster.endpoints), "--max-tokens", "8", "--model",
                        str(smollm2), "--relay", "off"],
                       capture_output=True, text=True, timeout=300)
    assert g.returncode == 0, g.stderr
    assert g.stdout == whole.detokenize(ref8) + "\n", (g.stdout, g.stderr)
    assert "matches the whole model (in-process dgr.Engine, same settings): yes" in g.stderr
    assert "transport per token: " in g.stderr  # the gRPC path's per-hop report


@pytest.mark.skipif(HAS_LAYER_RANGES, reason="only meaningful without layer ranges")
def test_cli_run_explains_missing_ranges(smollm2):
    p = subprocess.run([sys.executable, "-m", "dgr", "run", "--model", str(smollm2)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--stages 1" in p.stderr


def read_within(stream, n: int, timeout: float) -> bytes:
    """At least ``n`` bytes from a pipe (fewer only at end of file), or fail after ``timeout``
    seconds: a child that never writes is a failure here, not a hang."""
    return read_until(stream, lambda got: len(got) >= n, timeout, f"{n} bytes")


# Runs the CLI (same process, by exec) with SIGINT set as given, as it would inherit it: a
# non-interactive shell starts background commands with SIGINT ignored, a terminal's
# foreground with the default. The test never depends on how pytest itself was started.
EXEC_WITH_SIGINT = ("import os, signal, sys; "
                    "signal.signal(signal.SIGINT, getattr(signal, sys.argv[1])); "
                    "os.execv(sys.executable, [sys.executable, '-m', 'dgr', *sys.argv[2:]])")


@pytest.mark.parametrize("inherited", ["SIG_IGN", "SIG_DFL"],
                         ids=["sigint-inherited-ignored", "sigint-inherited-default"])
def test_cli_ctrl_c_reaps_the_workers(smollm2, inherited):
    p = subprocess.Popen([sys.executable, "-c", EXEC_WITH_SIGINT, inherited, "run", "--stages",
                          "1", "--model", str(smollm2), "--max-tokens", "900", "--no-check",
                          "--no-chat", "--prompt", "1, 2, 3, 4, 5, 6,"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # it is streaming (the CLI's --start-timeout is 180 s: past that it has failed)
        assert read_within(p.stdout, 12, 240)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err = err.decode(errors="replace")
    assert p.returncode == 130, err
    assert "interrupted" in err and "workers stopped (exit status 0)" in err
