"""DeepSeek V4 layer ranges: hc boundary, token-id sideband, per-stage compressed state, errors."""

from __future__ import annotations

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.control.parity import compare
from dgr.core.local import LocalChain
from dgr.protocol import wire
from dgr.testing.fixtures import TinyDeepseek4, write_tiny_deepseek4

needs_ranges = pytest.mark.skipif(not HAS_LAYER_RANGES,
                                  reason="the built llama.cpp carries no layer-range patches")

CFG = TinyDeepseek4()  # 6 layers; hash-routed 0..2; compress ratios 0 0 4 128 0 4
N = CFG.n_layer
W = CFG.hc * CFG.n_embd  # boundary width: the 4-stream residual
# Identical everywhere (they decide numerics). DeepSeek V4 decode depends on the thread
# count even at small contexts (split-KV flash attention over raw + compressed K): 1 thread.
SETTINGS = dict(n_ctx=512, n_threads=1, n_ubatch=64, flash_attn=True)
# Longer than the 128-token HCA block (two HCA commits), 75 CSA entries > indexer top-k 16.
PROMPT = np.random.default_rng(7).integers(0, CFG.n_vocab, 300).astype(np.int32)
DECODE_STEPS = 16


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    return write_tiny_deepseek4(tmp_path_factory.mktemp("models") / "tiny-dsv4.gguf", CFG)


@pytest.fixture(scope="module")
def dsv4_mtp(tmp_path_factory):
    # same seed: the trunk tensors are drawn first, so they equal dsv4's
    return write_tiny_deepseek4(tmp_path_factory.mktemp("models") / "tiny-dsv4-mtp.gguf",
                                TinyDeepseek4(mtp=True))


@pytest.fixture(scope="module")
def whole(dsv4):
    return dgr.Engine(dsv4, **SETTINGS)


def _splits():
    """Every single cut (inside the hash-routed prefix too) and every layer its own stage."""
    out = [[(0, k), (k, N)] for k in range(1, N)]
    out.append([(i, i + 1) for i in range(N)])
    return out


def _owns_compressed(a, b):
    return any(CFG.compress_ratios[i] for i in range(a, b))


def test_fixture_mixes_every_kind_of_stage():
    # the splits above include stages without any compressed layer, stages that start inside
    # the hash-routed prefix, and hash-routed stages that own compressed state
    stages = {r for s in _splits() for r in s}
    assert any(not _owns_compressed(a, b) and a > 0 for a, b in stages)
    assert any(0 < a < CFG.hash_layer_count for a, b in stages)
    assert any(0 < a < CFG.hash_layer_count and _owns_compressed(a, b) for a, b in stages)
    assert {4, 128, 0} <= set(CFG.compress_ratios)


@needs_ranges
@pytest.mark.parametrize("ranges", _splits(), ids=lambda r: "-".join(f"{a}:{b}" for a, b in r))
def test_split_parity(dsv4, whole, ranges):
    rep = compare(dsv4, ranges, PROMPT, decode_steps=DECODE_STEPS, whole=whole, **SETTINGS)
    assert rep.prompt_rows_identical  # all 300 prompt rows
    assert rep.bit_identical, [(s.step, s.max_abs_diff) for s in rep.steps if not s.bit_identical]
    assert len(rep.steps) == DECODE_STEPS + 1


@needs_ranges
def test_stage_facts(dsv4, whole):
    assert whole.n_embd_boundary == W and whole.needs_token_ids
    for a, b in [(0, 2), (1, 3), (2, 6), (3, 4), (4, 6)]:
        e = dgr.Engine(dsv4, layers=(a, b), **SETTINGS)
        d = e.describe()
        assert d["arch"] == "deepseek4" and d["boundary_width"] == W and d["n_layer"] == N
        assert d["hash_layer_count"] == CFG.hash_layer_count
        # token ids: the first stage, and any stage owning a hash-routed layer
        assert e.needs_token_ids == (a == 0 or a < CFG.hash_layer_count)
        out = e.forward(0, 0, PROMPT[:5], boundary=None if a == 0 else
                        np.zeros((5, W), np.float32), logits="all")
        assert out.shape == ((5, W) if b < N else (5, CFG.n_vocab)) and np.isfinite(out).all()


@needs_ranges
def test_state_bytes_only_for_owned_layers(dsv4, whole):
    kv = {}
    for r in [(i, i + 1) for i in range(N)] + [(0, 2), (2, 4), (4, 6), (0, 3), (3, 6)]:
        kv[r] = dgr.Engine(dsv4, layers=r, **SETTINGS).describe()["kv_bytes"]
    whole_kv = whole.describe()["kv_bytes"]
    single = [kv[(i, i + 1)] for i in range(N)]
    # each layer's state is allocated once, by its owner: stages add up to the whole model
    assert sum(single) == whole_kv, (single, whole_kv)
    assert kv[(0, 2)] + kv[(2, 4)] + kv[(4, 6)] == whole_kv
    assert kv[(0, 3)] + kv[(3, 6)] == whole_kv
    # layers of the same kind cost the same; compressed layers cost more than plain ones
    plain = {kv[(i, i + 1)] for i in range(N) if CFG.compress_ratios[i] == 0}
    assert len(plain) == 1
    csa = {kv[(i, i + 1)] for i in range(N) if CFG.compress_ratios[i] == 4}
    assert len(csa) == 1
    hca = kv[(3, 4)]
    (p,), (c,) = plain, csa
    # raw SWA < raw + compressed state (the HCA layer's 128-row compressor ring, kept with its
    # 32 rollback snapshots for Engine.truncate, now outweighs the CSA layer's)
    assert p < hca and p < c
    # a stage without compressed layers holds only its raw sliding-window cache
    assert kv[(0, 2)] == 2 * p
    assert kv[(0, 2)] < kv[(2, 4)]


# ---- the token-id sideband and the errors -------------------------------------------------------


@needs_ranges
def test_missing_token_ids(dsv4):
    for a in range(1, CFG.hash_layer_count):
        e = dgr.Engine(dsv4, layers=(a, N), **SETTINGS)
        with pytest.raises(errors.MissingTokenIds, match="hash"):
            e.forward(0, 0, boundary=np.zeros((3, W), np.float32))
        assert e.next_pos(0) == 0  # nothing was computed
        # with the ids it serves
        assert e.forward(0, 0, [1, 2, 3], boundary=np.zeros((3, W), np.float32)).shape == (1, 128)
    # past the hash-routed prefix the ids are not needed (and ignored when sent)
    e = dgr.Engine(dsv4, layers=(CFG.hash_layer_count, N), **SETTINGS)
    assert not e.needs_token_ids
    x = np.random.default_rng(1).standard_normal((4, W)).astype(np.float32)
    a = e.forward(0, 0, boundary=x, logits="all")
    e.release(0)
    b = e.forward(0, 0, [5, 6, 7, 8], boundary=x, logits="all")
    assert a.tobytes() == b.tobytes()


@needs_ranges
def test_boundary_width_is_the_hc_residual(dsv4):
    e = dgr.Engine(dsv4, layers=(4, N), **SETTINGS)
    # n_embd wide (one stream) is the classic mistake: the boundary carries all 4 streams
    with pytest.raises(errors.InvalidBoundary, match=rf"\[n_tokens, {W}\]"):
        e.forward(0, 0, boundary=np.zeros((2, CFG.n_embd), np.float32))
    with pytest.raises(errors.InvalidBoundary):
        e.forward(0, 0, boundary=np.zeros((2, W + 1), np.float32))
    assert e.forward(0, 0, boundary=np.zeros((2, W), np.float32)).shape == (1, 128)


def test_mtp_needs_a_nextn_block(dsv4):
    # MTP itself: tests/integration/test_mtp_engine.py
    with pytest.raises(errors.MtpNotSupported, match="no NextN"):
        dgr.Engine(dsv4, mtp=True, **SETTINGS)
    with pytest.raises(errors.MtpNotSupported, match="no NextN"):
        dgr.Engine(dsv4, layers=(3, N), mtp=True, **SETTINGS)


@needs_ranges
def test_mtp_variant_loads_with_mtp_off(dsv4, dsv4_mtp, whole):
    # block_count counts the NextN block; dgr's layers and ranges do not
    m = dgr.Engine(dsv4_mtp, **SETTINGS)
    assert m.n_layer == N and m.layers == (0, N)
    with pytest.raises(errors.InvalidLayerRange):
        dgr.Engine(dsv4_mtp, layers=(3, N + 1), **SETTINGS)
    # the MTP block is not loaded: same weights as the trunk-only file
    assert m.describe()["weight_bytes"] == whole.describe()["weight_bytes"]
    # Upstream's whole-model context still gives the NextN block a raw sliding-window cache (the
    # dsv4 cache has no filter there; the layer is never computed with MTP off). dgr keeps the
    # whole model exactly upstream; a last stage holds state for its own layers only.
    raw_layer = dgr.Engine(dsv4, layers=(0, 1), **SETTINGS).describe()["kv_bytes"]
    assert m.describe()["kv_bytes"] == whole.describe()["kv_bytes"] + raw_layer
    tail = dgr.Engine(dsv4_mtp, layers=(3, N), **SETTINGS).describe()
    tail_ref = dgr.Engine(dsv4, layers=(3, N), **SETTINGS).describe()
    assert tail["weight_bytes"] == tail_ref["weight_bytes"]
    assert tail["kv_bytes"] == tail_ref["kv_bytes"]
    # the trunk is the same tensors, so the whole MTP file computes what the trunk-only file does,
    # and a chain over it what the whole does
    p = PROMPT[:150]
    whole.release(0)
    assert m.forward(0, 0, p, logits="all").tobytes() == whole.forward(0, 0, p, logits="all").tobytes()
    whole.release(0)
    rep = compare(dsv4_mtp, [(0, 2), (2, 5), (5, N)], p, decode_steps=4, whole=m, **SETTINGS)
    assert rep.bit_identical


# ---- frames: the header carries token ids exactly when the receiver needs them -------------------


@needs_ranges
def test_chain_over_frames(dsv4, whole):
    """Each hop as a wire frame (raw f32 codec), token ids only for stages that need them."""
    ranges = [(0, 1), (1, 2), (2, 4), (4, N)]
    stages = [dgr.Engine(dsv4, layers=r, **SETTINGS) for r in ranges]
    sent_tokens = []

    def step(toks, pos, want):
        x = None
        for st in stages:
            h = wire.Forward(model="m", session="s", epoch=0, first_pos=pos, n_tokens=len(toks),
                             layer=st.layers[0],
                             tokens=[int(t) for t in toks] if st.needs_token_ids else None,
                             want="logits" if st.is_last else "boundary")
            f = wire.decode(wire.encode(h, x))
            sent_tokens.append((st.layers, f.header.tokens is not None))
            assert f.header.width == (0 if x is None else W)
            tok = None if f.header.tokens is None else np.asarray(f.header.tokens, np.int32)
            x = st.forward(0, pos, tok, boundary=f.array, **({"logits": want} if st.is_last else {}))
        return x

    p = PROMPT[:200]
    whole.release(0)
    ref = whole.forward(0, 0, p, logits="all")
    got = step(p, 0, "all")
    assert got.tobytes() == ref.tobytes()
    pos = len(p)
    for _ in range(4):
        t = np.array([np.argmax(ref[-1])], np.int32)
        ref = whole.forward(0, pos, t)
        got = step(t, pos, "last")
        assert got.tobytes() == ref.tobytes()
        pos += 1
    # hash-routed receivers got the ids, the others did not
    assert {r: has for r, has in sent_tokens} == {(0, 1): True, (1, 2): True, (2, 4): True,
                                                  (4, N): False}


@needs_ranges
def test_slots_keep_their_own_compressed_state(dsv4):
    """Interleaved sessions on a chain equal the same sessions run alone (state is per slot)."""
    chain = LocalChain(dsv4, [(0, 2), (2, 4), (4, N)], **{**SETTINGS, "n_slots": 2})
    prompts = [PROMPT[:140], PROMPT[100:240][::-1].copy()]

    def run(slot, p, k=3):
        out = [chain.forward(slot, 0, p)[0].copy()]
        for i in range(k):
            out.append(chain.forward(slot, len(p) + i, [int(np.argmax(out[-1]))])[0].copy())
        return np.stack(out)

    alone = []
    for p in prompts:
        chain.release(0)
        alone.append(run(0, p))
    chain.release(0)
    rows = [[chain.forward(s, 0, p)[0].copy()] for s, p in enumerate(prompts)]
    for i in range(3):
        for s, p in enumerate(prompts):
            rows[s].append(chain.forward(s, len(p) + i, [int(np.argmax(rows[s][-1]))])[0].copy())
    # slot 1 has the same numerics as slot 0 (one KV stream per slot)
    assert np.stack(rows[0]).tobytes() == alone[0].tobytes()
    assert np.stack(rows[1]).tobytes() == alone[1].tobytes()


def test_n_layer_has_one_definition_for_a_file_naming_a_nextn_block_it_lacks(tmp_path):
    """A V4 conversion that dropped the MTP weights keeps ``nextn_predict_layers`` and counts
    only the trunk in ``block_count``: the artifacts (manifest, precheck) count the layers as
    the engine and llama.cpp do, so both give the same layer ranges."""
    import dataclasses

    from dgr.artifacts import gguf as gguf_io
    from dgr.artifacts.manifest import model_facts
    from dgr.artifacts.verify import precheck

    for name, cfg in (("no-mtp-weights", dataclasses.replace(CFG, nextn_metadata_only=True)),
                      ("mtp", dataclasses.replace(CFG, mtp=True))):
        path = write_tiny_deepseek4(tmp_path / f"{name}.gguf", cfg)
        facts = model_facts([gguf_io.read_header(path, decode_arrays=False)])
        eng = dgr.Engine(path, n_ctx=64)
        assert facts["n_layer"] == eng.n_layer == CFG.n_layer, name
        assert precheck(path, (0, CFG.n_layer))["layers"] == (0, CFG.n_layer)
