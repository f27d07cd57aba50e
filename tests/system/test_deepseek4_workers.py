"""DeepSeek V4 over worker processes (python -m dgr.worker) and gRPC: hc boundaries, token-id sideband."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.core.local import generate_local
from dgr.driver.route import Route
from dgr.protocol import wire
from dgr.testing.fixtures import TinyDeepseek4, write_tiny_deepseek4
from dgr.transport.client import ShardClient
from dgr.worker.process import LocalCluster

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(not HAS_LAYER_RANGES,
                       reason="multi-stage routes need the llama.cpp layer-range patches: "
                              "dgr._core.HAS_LAYER_RANGES is False in this build"),
]

CFG = TinyDeepseek4()  # 6 layers; hash-routed 0..2; compress ratios 0 0 4 128 0 4
W = CFG.hc * CFG.n_embd
# one thread everywhere: DeepSeek V4 decode depends on the thread count
SETTINGS = dict(n_ctx=512, n_slots=2, n_threads=1, n_ubatch=64, flash_attn=True)
# stage 0: no compressed layer; stage 1 starts inside the hash-routed prefix (needs the token
# ids) and owns CSA + indexer + HCA; stage 2: past the prefix, a plain and a CSA layer
RANGES = [(0, 1), (1, 4), (4, CFG.n_layer)]
PROMPT = [int(t) for t in np.random.default_rng(11).integers(0, CFG.n_vocab, 300)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_deepseek4(tmp_path_factory.mktemp("models") / "tiny-dsv4.gguf", CFG)


@pytest.fixture(scope="module")
def cluster(model):
    c = LocalCluster(str(model), RANGES, settings=SETTINGS)
    try:
        c.start(timeout=120)
        yield c
    finally:
        codes = c.stop()
    assert codes == [0] * len(codes), [w.log_tail() for w in c.workers]


@pytest.mark.parametrize("relay", [False, True], ids=["driver-relay", "direct-relay"])
def test_three_workers_match_the_whole_model(model, cluster, monkeypatch, relay):
    whole = dgr.Engine(model, **SETTINGS)
    ref, rows = generate_local(whole, PROMPT, max_tokens=16, stop_on_eog=False, logits=True)
    # what the route driver puts in each Forward header: token ids exactly for the receivers
    # that need them (the first stage, the hash-routed one, and the last stage, which keeps
    # the session's tokens for the penalties and grammars: dgr.worker.history); with direct
    # relay the driver sends stage 0 only, and the hops tell each stage whether to pass the
    # ids on
    sent = set()
    hops = set()
    encode = wire.encode

    def spy(header, *a, **kw):
        if type(header) is wire.Forward:
            sent.add((header.layer, header.tokens is not None))
            if header.relay:
                hops.add(tuple(h.tokens for h in header.relay))
        return encode(header, *a, **kw)

    monkeypatch.setattr(wire, "encode", spy)
    with Route(cluster.endpoints, relay=relay) as r:
        assert [s.layers for s in r.stages] == RANGES
        assert [s.needs_token_ids for s in r.stages] == [True, True, False]
        assert {s.boundary_width for s in r.stages} == {W}
        s = r.session()
        g = s.complete(PROMPT, max_tokens=16, stop_on_eog=False, logits=True)
        s.close()  # frees its slot on every stage for the next test
        n_chunks = len(range(0, len(PROMPT), SETTINGS["n_ubatch"]))
        assert r.aroute.relay_steps == (n_chunks + 15 if relay else 0)  # 16 tokens
    assert g.tokens == ref and len(ref) == 16
    if relay:
        assert sent == {(0, True)} and hops == {(True, True)}
    else:
        assert sent == {(0, True), (1, True), (4, True)}
    assert len(g.logits) == len(rows)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(g.logits, rows))


def test_worker_refuses_a_boundary_without_token_ids(cluster):
    ep = cluster.endpoints[1]  # layers [1, 4): hash-routed

    async def go():
        c = ShardClient(ep)
        try:
            info = await c.describe()
            st = c.stream()
            x = np.zeros((3, W), np.float32)

            def fwd(tokens, epoch):
                return wire.encode(wire.Forward(
                    model=info.identity, session="t", epoch=epoch, first_pos=0, n_tokens=3,
                    layer=info.layers[0], tokens=tokens, want="boundary"), x)

            bad = wire.decode(await st.step(fwd(None, 1))).header
            good = wire.decode(await st.step(fwd([1, 2, 3], 2))).header
            await c.release("t")
            await st.close()
            return bad, good
        finally:
            await c.close()

    bad, good = asyncio.run(go())
    assert type(bad) is wire.ErrorReply and isinstance(bad.to_exception(), errors.MissingTokenIds)
    assert type(good) is wire.Result and good.kind == "boundary" and good.cols == W
