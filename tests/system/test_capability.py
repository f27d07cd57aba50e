"""Tracker inputs: the capability record, certified lanes, Prometheus metrics (issue 9).

A test worker over the tiny llama fixture; certification runs ``python -m dgr certify`` (real
worker processes) into a temporary store.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.request

import msgspec
import numpy as np
import pytest

import dgr
from dgr import errors
from dgr.cli import certify
from dgr.control import capability, certificates
from dgr.protocol import capability as schema
from dgr.protocol import wire
from dgr.protocol.settings import canonical, stage_identity
from dgr.transport.client import ShardClient
from dgr.testing.waits import poll_until
from dgr.worker.process import ThreadedWorker

# six CLI runs (dgr certify, python -m dgr.worker) and worker processes
pytestmark = [pytest.mark.slow, pytest.mark.system]

SETTINGS = dict(n_ctx=128, n_slots=3, n_threads=1, n_ubatch=8)
WIDTH = 64  # tiny llama n_embd


def run(coro):
    return asyncio.run(coro)


async def with_client(address, fn):
    c = ShardClient(address)
    try:
        return await fn(c)
    finally:
        await c.close()


def fwd(w, session, pos, n, *, epoch=1, codec="raw"):
    """A Forward of ``n`` tokens at ``pos`` into worker ``w`` (a boundary of zeros)."""
    p = w.pipeline
    h = wire.Forward(model=stage_identity(p.model_identity, p.settings), session=session,
                     epoch=epoch, first_pos=pos, n_tokens=n, layer=p.layers[0], want="token")
    return wire.encode(h, np.zeros((n, p.width), np.float32), codec=codec)


class Gated:
    """An engine whose forward waits for ``gate`` (holds steps in compute)."""

    def __init__(self, engine):
        self._e = engine
        self.gate = threading.Event()

    def forward(self, *a, **kw):
        assert self.gate.wait(30)
        return self._e.forward(*a, **kw)

    def forward_batch(self, *a, **kw):  # the stage loop's forward of several steps
        assert self.gate.wait(30)
        return self._e.forward_batch(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._e, name)


@pytest.fixture(scope="module")
def last_stage(tiny_llama):
    with ThreadedWorker(dgr.Engine(tiny_llama, layers=(2, 4), **SETTINGS),
                        evict_after=3600.0) as tw:
        yield tw


def test_record_fields_on_a_test_worker(last_stage):
    w = last_stage.worker
    rec = run(with_client(last_stage.address, lambda c: c.capability()))
    assert isinstance(rec, schema.Capability) and rec.schema == schema.SCHEMA
    c, cap = rec.compatibility, rec.capacity
    p = w.pipeline
    assert c.model_identity == p.model_identity and c.model_identity.startswith("sha256:")
    assert c.stage_identity == stage_identity(p.model_identity, p.settings)
    # the records that outlive a build leave a later setting out at its default
    assert c.settings == canonical(p.engine.settings) and c.settings["n_slots"] == 3
    assert "batch_invariant" not in c.settings
    assert (c.boundary_width, c.boundary_schema_version) == (WIDTH, wire.SCHEMA_VERSION)
    assert c.quantisation == "F32" and c.backend == "cpu"
    assert len(c.llama_cpp_commit) == 40 and len(c.patch_stack_hash) == 64
    assert (cap.n_layer, cap.layer_start, cap.layer_end) == (4, 2, 4)
    assert (cap.is_first, cap.is_last) == (False, True)
    assert (cap.slots_total, cap.slots_free) == (3, 3)
    assert (cap.context_tokens_total, cap.context_tokens_free) == (384, 384)
    assert cap.memory_bytes == cap.weight_bytes + cap.kv_bytes > 0
    # an attention model: all of its KV is per context token, no recurrent state
    assert cap.kv_bytes_per_token == cap.kv_bytes / 384 and cap.state_bytes_per_session == 0
    assert cap.state_snapshots == cap.state_snapshot_bytes == 0
    # seam cost: payload_size per codec, [1, 64] floats
    assert rec.seam.accepts == "boundary"
    assert rec.seam.boundary_bytes_per_token == {"raw": 256, "f16": 128, "bf16": 128, "q8": 68}
    assert rec.seam.output_bytes_per_token == {}  # the last stage sends tokens, not a boundary
    assert rec.lanes == [] and rec.uncertified == [] and rec.cert_store is None
    # JSON round trip (the documented form); the SDK's in-process record of the idle engine
    assert schema.decode(schema.encode(rec)) == rec
    idle = capability.record_for(p.engine)
    assert idle.compatibility == c and idle.capacity.slots_free == 3 and idle.lanes == []

    async def open_two(cl):
        st = cl.stream()
        for name in ("a", "b"):
            r = wire.decode(await st.step(fwd(w, name, 0, 5))).header
            assert type(r) is wire.Result
        for i in range(4):  # single-token steps: hop latency samples
            assert type(wire.decode(await st.step(fwd(w, "a", 5 + i, 1))).header) is wire.Result
        bad = wire.decode(await st.step(fwd(w, "b", 0, 1, epoch=0))).header
        assert type(bad) is wire.ErrorReply
        rec2 = await cl.capability()
        await st.close()
        return rec2

    rec = run(with_client(last_stage.address, open_two))
    assert (rec.capacity.slots_free, rec.load.sessions) == (1, 2)
    assert rec.capacity.context_tokens_free == 384 - 9 - 5
    assert rec.health.steps_served == 6 and rec.health.steps_failed == 1
    assert rec.health.last_error.startswith("StaleEpoch") and rec.health.last_error_age_s >= 0
    assert rec.seam.hop_samples == 4
    assert 0 < rec.seam.hop_latency_ms_p50 <= rec.seam.hop_latency_ms_p99
    assert rec.load.tokens_per_s > 0 and rec.health.uptime_s > 0
    for s in ("a", "b"):
        w.release(s)
    assert w.capability().capacity.slots_free == 3


def test_queue_depth_under_load(last_stage):
    w = last_stage.worker
    gated = Gated(w.pipeline.engine)
    w.pipeline.engine = gated
    try:
        async def load(cl):
            streams = [cl.stream() for _ in range(3)]
            steps = [asyncio.ensure_future(s.step(fwd(w, f"q{i}", 0, 2)))
                     for i, s in enumerate(streams)]
            async def loaded():
                rec = await cl.capability()
                return rec if (rec.load.in_flight_steps, rec.load.queue_depth) == (3, 2) else None

            try:
                rec = await poll_until(loaded, "3 steps in flight, 2 of them queued", 10, 0.01)
            finally:
                gated.gate.set()
            for f in steps:
                assert type(wire.decode(await f).header) is wire.Result
            after = await cl.capability()
            for s in streams:
                await s.close()
            return rec, after

        rec, after = run(with_client(last_stage.address, load))
        assert (rec.load.in_flight_steps, rec.load.queue_depth) == (3, 2)  # one computes
        # a queued step leases its session's slot when the stage loop takes it: the one
        # computing holds one; a waiting one holds one once taken into the running batch
        assert rec.load.sessions >= 1
        assert rec.capacity.slots_free + rec.load.sessions == 3
        assert (after.load.in_flight_steps, after.load.queue_depth) == (0, 0)
    finally:
        w.pipeline.engine = gated._e
        for i in range(3):
            w.release(f"q{i}")


def test_metrics_exposition(last_stage):
    from dgr.control.metrics import MetricsServer

    ms = MetricsServer(last_stage.worker, port=0, loop=last_stage.event_loop).start()
    try:
        with urllib.request.urlopen(f"http://{ms.address}/metrics", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = r.read().decode()
    finally:
        ms.stop()
    lines = dict(ln.rsplit(" ", 1) for ln in text.splitlines() if not ln.startswith("#"))
    assert lines["dgr_worker_layer_start"] == "2.0" and lines["dgr_worker_layer_end"] == "4.0"
    assert lines["dgr_worker_slots"] == "3.0" and lines["dgr_worker_slots_free"] == "3.0"
    assert lines['dgr_worker_boundary_bytes_per_token{codec="q8",direction="in"}'] == "68.0"
    assert lines["dgr_worker_queue_depth"] == "0.0"
    assert "# TYPE dgr_worker_steps_total counter" in text
    assert 'dgr_worker_hop_latency_seconds{quantile="0.99"}' in lines


# -- certified lanes -------------------------------------------------------------------------

CERT_SETTINGS = dict(n_ctx=128, n_slots=2, n_threads=1, n_ubatch=8)


@pytest.fixture(scope="module")
def store(tiny_llama, tmp_path_factory):
    """A lane certified by ``python -m dgr certify`` (two worker processes, raw codec)."""
    d = tmp_path_factory.mktemp("certs")
    env = dict(os.environ, DGR_CERT_STORE=str(d))
    r = subprocess.run([sys.executable, "-m", "dgr", "certify", "--model", str(tiny_llama),
                        "--stages", "2", "--ctx", "128", "--slots", "2", "--ubatch", "8",
                        "--max-tokens", "8"], capture_output=True, text=True, env=env,
                       timeout=180)
    assert r.returncode == 0, r.stderr
    assert "logits bit-identical True" in r.stderr
    files = os.listdir(d)
    assert len(files) == 1 and r.stdout.strip() == str(d / files[0])
    ls = subprocess.run([sys.executable, "-m", "dgr", "lanes"], capture_output=True, text=True,
                        env=env, timeout=60)
    assert ls.returncode == 0 and "1 record(s)" in ls.stdout and "this build" in ls.stdout
    assert "stages=[0,2),[2,4)" in ls.stdout and "codec=raw" in ls.stdout
    return d


def lanes_of(model, store, layers=(0, 2), **changes):
    eng = dgr.Engine(model, layers=layers, **{**CERT_SETTINGS, **changes})
    with ThreadedWorker(eng, cert_store=str(store)) as tw:
        return run(with_client(tw.address, lambda c: c.capability()))


def test_certified_lane_is_advertised_only_while_it_matches(tiny_llama, store, monkeypatch):
    (name, cert), = certify.load_store(store)
    assert cert.parity.passed and cert.parity.logits_bit_identical
    assert cert.lane.stages == [[0, 2], [2, 4]] and cert.lane.codec == "raw"
    assert cert.cpu_isa and cert.certified_at and cert.lane.quantisation == "F32"
    for layers in ((0, 2), (2, 4)):
        rec = lanes_of(tiny_llama, store, layers)
        assert [ln.lane_id for ln in rec.lanes] == [cert.lane_id] and rec.uncertified == []
        assert rec.lanes[0].record == name and rec.lanes[0].parity["passed"]
    # a range that is not a stage of the layout
    rec = lanes_of(tiny_llama, store, (0, 4))
    assert rec.lanes == [] and "not a stage" in rec.uncertified[0].reasons[0]
    # one engine setting changed: uncertified, with the reason
    rec = lanes_of(tiny_llama, store, n_ubatch=16)
    assert rec.lanes == []
    assert [u.lane_id for u in rec.uncertified] == [cert.lane_id]
    assert rec.uncertified[0].reasons == ["setting n_ubatch=8 != 16"]
    # another patch stack (or commit): uncertified; restoring it brings the lane back
    commit, patches = capability._vendor_facts()
    monkeypatch.setattr(capability, "_vendor_facts", lambda: (commit, "0" * 64))
    rec = lanes_of(tiny_llama, store)
    assert rec.lanes == [] and rec.uncertified[0].reasons[0].startswith("patch-stack hash")
    monkeypatch.setattr(capability, "_vendor_facts", lambda: ("f" * 40, patches))
    rec = lanes_of(tiny_llama, store)
    assert rec.lanes == [] and rec.uncertified[0].reasons[0].startswith("llama.cpp commit")
    # another CPU variant (a portable wheel's x86-64-v3 kernels): another lane
    monkeypatch.undo()
    monkeypatch.setattr(capability, "cpu_variant", lambda: ("x86-64-v3", ("AVX2", "FMA")))
    rec = lanes_of(tiny_llama, store)
    assert rec.lanes == [] and rec.uncertified[0].reasons == ["CPU variant native != x86-64-v3"]
    assert rec.compatibility.cpu_variant == "x86-64-v3"
    monkeypatch.undo()
    rec = lanes_of(tiny_llama, store)
    assert [ln.lane_id for ln in rec.lanes] == [cert.lane_id]
    assert rec.compatibility.arch == cert.arch == "llama" and rec.compatibility.arch_splittable
    assert cert.cpu_variant == rec.compatibility.cpu_variant == "native"
    assert rec.compatibility.cpu_compiled == list(capability.cpu_variant()[1])


def test_a_split_lane_needs_an_architecture_this_build_splits(tiny_llama, store, monkeypatch):
    """Only architectures that pass the support table are advertised split: with llama off
    the build's list, the two-stage lane is uncertified (the reason names the arch) and
    ``dgr lanes`` flags it."""
    monkeypatch.setattr(capability, "arch_supports_layer_range", lambda arch: arch != "llama")
    rec = lanes_of(tiny_llama, store, (2, 4))
    assert not rec.compatibility.arch_splittable and rec.lanes == []
    assert rec.uncertified[0].reasons == [
        "architecture llama does not split in this build (its graph does not honour a layer "
        "range: docs/architectures.md)"]
    monkeypatch.undo()
    assert [ln.lane_id for ln in lanes_of(tiny_llama, store, (2, 4)).lanes] == [
        certify.load_store(store)[0][1].lane_id]
    # the listing: a record of a model whose arch does not split here is flagged
    (_, cert), = certify.load_store(store)
    other = store.parent / "certs-other-arch"
    certificates.write(msgspec.structs.replace(cert, arch="dream"), other)
    ls = subprocess.run([sys.executable, "-m", "dgr", "lanes", "--store", str(other)],
                        capture_output=True, text=True, timeout=60)
    assert ls.returncode == 0 and "  dream  " in ls.stdout
    assert "NOT SPLITTABLE here (dream)" in ls.stdout


def test_worker_process_serves_lanes_and_metrics(tiny_llama, store):
    from dgr.worker.process import WorkerProcess

    w = WorkerProcess(tiny_llama, (2, 4), settings=CERT_SETTINGS,
                      args=["--cert-store", str(store), "--metrics-port", "0"])
    try:
        ep = w.start().wait_listening(60)
        rec = run(with_client(ep, lambda c: c.capability()))
        assert [ln.codec for ln in rec.lanes] == ["raw"] and rec.endpoint == ep
        with open(w.log_path) as f:
            log = f.read()
        url = log.split("Prometheus metrics on ", 1)[1].split()[0]
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        lanes = [ln for ln in text.splitlines() if ln.startswith("dgr_worker_certified_lane{")]
        assert len(lanes) == 1, lanes
        labels, value = lanes[0][len("dgr_worker_certified_lane{"):].rsplit("} ", 1)
        assert value == "1.0"
        assert dict(re.findall(r'(\w+)="([^"]*)"', labels)) == {  # in any order
            "lane_id": rec.lanes[0].lane_id, "codec": "raw", "stages": "0:2,2:4"}
    finally:
        assert w.stop() == 0


def test_one_byte_different_model_advertises_nothing(tiny_llama, store, tmp_path):
    other = tmp_path / "tiny-llama-1byte.gguf"
    shutil.copyfile(tiny_llama, other)
    with open(other, "r+b") as f:  # the last byte is tensor data
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    rec = lanes_of(other, store)
    assert rec.lanes == []
    (u,) = rec.uncertified
    assert u.reasons == [f"model identity {certify.load_store(store)[0][1].lane.model_identity}"
                         f" != {rec.compatibility.model_identity}"]


def test_certify_refuses_an_unknown_codec(tiny_llama, tmp_path):
    with pytest.raises(errors.UnknownCodec):
        certify.certify(tiny_llama, [(0, 2), (2, 4)], codec="zip", store=tmp_path)
    assert certify.load_store(tmp_path) == []


def test_a_lane_that_fails_parity_is_not_written(tiny_llama, tmp_path, monkeypatch):
    import dgr.core.local

    real = dgr.core.local.generate_local

    def wrong(*a, **kw):  # a reference that disagrees in its last logits row
        toks, rows = real(*a, **kw)
        rows[-1] = rows[-1] + np.float32(1e-3)
        return toks, rows

    monkeypatch.setattr(dgr.core.local, "generate_local", wrong)
    rec, path = certify.certify(tiny_llama, [(0, 2), (2, 4)], settings=CERT_SETTINGS,
                                max_tokens=4, store=tmp_path)
    assert path is None and not rec.parity.passed and rec.parity.tokens_match
    assert not rec.parity.logits_bit_identical and 0 < rec.parity.max_abs_diff < 2e-3
    assert certify.load_store(tmp_path) == []


# -- certification scenarios: failover of the middle stage, per-stage costs ------------------

def test_failover_certification_records_its_scenario(tiny_llama, tmp_path):
    """``certify --failover`` over 4 single-layer stages: a spare serves stage 2's range, the
    second generation SIGKILLs stage 2's worker after half the tokens and still has the whole
    model's tokens on the spare; the record keeps the scenario and ``dgr lanes`` shows it."""
    d = tmp_path / "certs"
    env = dict(os.environ, DGR_CERT_STORE=str(d))
    r = subprocess.run([sys.executable, "-m", "dgr", "certify", "--model", str(tiny_llama),
                        "--stages", "4", "--ctx", "128", "--slots", "2", "--ubatch", "8",
                        "--max-tokens", "8", "--failover"], capture_output=True, text=True,
                       env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    (name,) = os.listdir(d)
    assert r.stdout.strip() == str(d / name)
    (_, rec), = certify.load_store(d)
    assert rec.parity.passed and rec.lane.stages == [[0, 1], [1, 2], [2, 3], [3, 4]]
    sc = rec.scenario
    assert (sc.workers, sc.stages, sc.path) == ("processes on loopback", 4, "relay+loop")
    assert sc.decode_tokens == 7 and sc.decode_ms_per_token > 0 and sc.links == 4
    assert [c.layers for c in sc.costs] == rec.lane.stages
    assert len({c.endpoint for c in sc.costs}) == 4
    for c in sc.costs:
        assert c.rss_bytes > 0 and c.decode_steps == 7 and c.compute_ms >= 0
    fo = sc.failover
    assert (fo.stage, fo.layers, fo.recoveries) == (2, [2, 3], 1)
    assert fo.how == "SIGKILL after 4 of 8 tokens"
    assert fo.killed == sc.costs[2].endpoint and fo.spare not in {c.endpoint for c in sc.costs}
    assert fo.replaced_by == fo.spare and fo.path == "relay"
    assert fo.tokens_match and fo.generated_tokens == 8 and fo.passed
    assert "scenario: 4 stages" in r.stderr
    # the lane id is the lane's alone: the scenario is not part of it
    assert rec.lane_id == certificates.lane_id(rec.lane)
    ls = subprocess.run([sys.executable, "-m", "dgr", "lanes"], capture_output=True, text=True,
                        env=env, timeout=60)
    assert ls.returncode == 0, ls.stderr
    line, = [ln for ln in ls.stdout.splitlines() if ln.startswith("  scenario: ")]
    assert line.startswith("  scenario: 4 stages (processes on loopback, relay+loop); "
                           "failover yes: stage 2 [2,3) SIGKILLed, 1 recovery, tokens match; "
                           "decode "), line
    rss = max(c.rss_bytes for c in sc.costs) / 2**20
    assert f"max RSS {rss:.1f} MiB/stage; seam " in line
    assert line.endswith(" ms" if sc.seam_ms is not None else "seam -"), line
    # batched against alone, measured on the whole model with the lane's settings (from
    # position 0 only: a context of 128 positions has no room for the second start)
    b = rec.batching
    assert (b.sessions, b.decode_steps, b.rows) == (4, 8, 4 * 9)
    assert b.bit_identical == (b.max_abs_diff == 0.0) and 0 <= b.top1_agreement <= 1
    bl, = [ln for ln in ls.stdout.splitlines() if ln.startswith("  batching: ")]
    assert ("bit-identical to alone" if b.bit_identical else "NOT bit-identical") in bl, bl
    # speculative trips against single steps, measured the same way
    sp = rec.speculation
    assert sp.max_draft == 4 and sp.rows > 0 and sp.trips > 0
    assert sp.bit_identical == (sp.max_abs_diff == 0.0) and 0 <= sp.top1_agreement <= 1
    sl, = [ln for ln in ls.stdout.splitlines() if ln.startswith("  speculation: ")]
    assert ("bit-identical to single steps" if sp.bit_identical
            else "NOT bit-identical") in sl, sl
    # a chat's next turn on a kept session through the lane's workers: a fresh prefill's bits
    pc = rec.prefix_cache
    assert pc.bit_identical and pc.tokens_match and pc.max_abs_diff == 0.0, pc
    assert 0 < pc.kept_positions < pc.prompt_tokens and pc.generated_tokens == 8
    assert pc.logits_rows == 8 and len(pc.partial_rows_exact) == len(pc.decoded_rows_exact) == 4
    pl, = [ln for ln in ls.stdout.splitlines() if ln.startswith("  prompt cache: ")]
    assert (f"keeping {pc.kept_positions} of its {pc.prompt_tokens} prompt positions" in pl
            and "bit-identical to a fresh prefill" in pl), pl
    assert "prompt cache: a next turn keeping" in r.stderr
    # a record written before scenarios were kept still decodes, and is listed as such
    old = msgspec.json.decode((d / name).read_bytes())
    del old["scenario"], old["batching"], old["speculation"], old["prefix_cache"]
    other = tmp_path / "old"
    other.mkdir()
    (other / name).write_bytes(msgspec.json.encode(old))
    (_, back), = certify.load_store(other)
    assert back.scenario is None and back.lane_id == rec.lane_id
    ls = subprocess.run([sys.executable, "-m", "dgr", "lanes", "--store", str(other)],
                        capture_output=True, text=True, timeout=60)
    assert "  scenario: not recorded" in ls.stdout, ls.stdout
    assert "  batching: not measured" in ls.stdout, ls.stdout
    assert "  speculation: not measured" in ls.stdout, ls.stdout
    assert "  prompt cache: not measured" in ls.stdout, ls.stdout


def test_a_failover_whose_tokens_differ_is_not_written(tiny_llama, tmp_path, monkeypatch):
    """The plain generation passes, the failover generation (the last generate, on a route of
    its own) yields a wrong first token: the lane fails, nothing is written, the record says
    why. Hop by hop, each stage's hop cost (round trip minus compute) is recorded."""
    from dgr.driver.sync import RouteSession

    real = RouteSession.generate
    calls = []

    def generate(self, *a, **kw):
        calls.append(self)
        toks = real(self, *a, **kw)
        if self.route is calls[0].route:  # the parity generation and the prompt-cache turns
            return toks
        return (t + (i == 0) for i, t in enumerate(toks))

    monkeypatch.setattr(RouteSession, "generate", generate)
    rec, path = certify.certify(tiny_llama, [(0, 2), (2, 3), (3, 4)], settings=CERT_SETTINGS,
                                max_tokens=6, store=tmp_path, failover=True, relay=False)
    assert len(calls) == 5 and calls[-1].route is not calls[0].route
    assert path is None and certify.load_store(tmp_path) == []
    assert rec.parity.passed and rec.parity.tokens_match
    fo = rec.scenario.failover
    assert not fo.passed and not fo.tokens_match
    assert (fo.stage, fo.layers, fo.recoveries, fo.generated_tokens) == (1, [2, 3], 1, 6)
    assert fo.replaced_by == fo.spare != fo.killed and fo.path == "hop-by-hop"
    sc = rec.scenario
    assert sc.path == "hop-by-hop" and sc.links == 3 and sc.notes == []
    for c in sc.costs:
        assert c.rtt_ms > 0 and c.hop_ms >= 0 and c.rtt_ms >= c.compute_ms >= 0
    assert sc.transport_ms_per_token == pytest.approx(sum(c.hop_ms for c in sc.costs))
    assert sc.seam_ms == pytest.approx(sc.transport_ms_per_token / 3)
    # a failover needs a middle stage between two others
    with pytest.raises(errors.InvalidArgument, match="3 or more stages"):
        certify.certify(tiny_llama, [(0, 2), (2, 4)], failover=True, store=tmp_path)
