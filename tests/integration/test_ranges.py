"""Layer-range engines: bit-exact split parity, per-stage memory, and the range errors."""

from __future__ import annotations

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.control.parity import compare
from dgr.core.local import LocalChain
from dgr.protocol.ranges import split_layers

needs_ranges = pytest.mark.skipif(not HAS_LAYER_RANGES,
                                  reason="the built llama.cpp carries no layer-range patches")

TINY = dict(n_ctx=256, n_threads=1, n_ubatch=8, flash_attn=True)
SMOL = dict(n_ctx=1024, n_threads=1, n_ubatch=64, flash_attn=True)


def _all_splits(n_layer):
    """Every way to cut at one boundary, plus all single-layer stages."""
    out = [[(0, k), (k, n_layer)] for k in range(1, n_layer)]
    out.append([(i, i + 1) for i in range(n_layer)])
    return out


@needs_ranges
@pytest.mark.parametrize("ranges", _all_splits(4), ids=lambda r: "-".join(f"{a}:{b}" for a, b in r))
def test_tiny_llama_split_parity(tiny_llama, ranges):
    prompt = (np.arange(37, dtype=np.int32) * 7) % 128  # 37 tokens = 5 chunks of ubatch 8
    rep = compare(tiny_llama, ranges, prompt, decode_steps=16, **TINY)
    assert rep.prompt_rows_identical
    assert rep.bit_identical, [(s.step, s.max_abs_diff) for s in rep.steps if not s.bit_identical]
    assert len(rep.steps) == 17


@needs_ranges
def test_stage_shapes_and_describe(tiny_llama):
    a = dgr.Engine(tiny_llama, layers=(0, 1), **TINY)
    m = dgr.Engine(tiny_llama, layers=(1, 3), **TINY)
    z = dgr.Engine(tiny_llama, layers=(3, 4), **TINY)
    assert (a.is_first, a.is_last, m.is_first, m.is_last, z.is_first, z.is_last) == (
        True, False, False, False, False, True)
    b = a.forward(0, 0, [1, 2, 3])
    assert b.shape == (3, 64) and b.dtype == np.float32
    b2 = m.forward(0, 0, boundary=b)
    assert b2.shape == (3, 64)
    lg = z.forward(0, 0, boundary=b2, logits="all")
    assert lg.shape == (3, 128)
    d = m.describe()
    assert d["layers"] == [1, 3] and d["boundary_width"] == 64 and d["boundary_dtype"] == "float32"
    assert d["layer_start"] == 1 and d["layer_end"] == 3 and d["n_layer"] == 4


@needs_ranges
def test_interleaved_sessions_match_solo_runs(tiny_llama):
    chain = LocalChain(tiny_llama, [(0, 2), (2, 3), (3, 4)], n_slots=3, **TINY)
    prompts = [np.array(p, dtype=np.int32) for p in ([5, 9, 2, 7, 1, 8, 8, 3, 6, 4, 11],
                                                     [100, 3, 3], [42] * 19)]

    def solo(p, slot):
        chain.release(slot)
        out = [chain.forward(slot, 0, p)[0].copy()]
        pos = len(p)
        for _ in range(6):
            out.append(chain.forward(slot, pos, [int(np.argmax(out[-1]))])[0].copy())
            pos += 1
        return np.stack(out)

    alone = [solo(p, 0) for p in prompts]
    # all three at once, steps interleaved across slots
    for s in range(3):
        chain.release(s)
    rows = [[chain.forward(s, 0, p)[0].copy()] for s, p in enumerate(prompts)]
    for k in range(6):
        for s, p in enumerate(prompts):
            rows[s].append(chain.forward(s, len(p) + k, [int(np.argmax(rows[s][-1]))])[0].copy())
    for s in range(3):
        assert np.stack(rows[s]).tobytes() == alone[s].tobytes()


# ---- memory: a stage allocates only what it owns ----------------------------------------------


def _tensor_bytes(path):
    from dgr.testing.fixtures import gguf_module

    gguf = gguf_module()
    r = gguf.GGUFReader(str(path))
    return {t.name: int(t.n_bytes) for t in r.tensors}


def _owned_bytes(sizes, a, b, n_layer):
    total = 0
    for name, n in sizes.items():
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            total += n if a <= il < b else 0
        elif name == "token_embd.weight":
            # input embeddings on the first stage; the tied head on the last stage
            total += n if (a == 0 or (b == n_layer and "output.weight" not in sizes)) else 0
        elif name.startswith("output"):
            total += n if b == n_layer else 0
    return total


@needs_ranges
@pytest.mark.slow
def test_smollm2_weight_and_kv_bytes_follow_the_range(smollm2):
    sizes = _tensor_bytes(smollm2)
    whole = dgr.Engine(smollm2, **SMOL).describe()
    n_layer = whole["n_layer"]
    for a, b in [(0, 10), (10, 20), (20, 30), (0, 29), (1, 30)]:
        d = dgr.Engine(smollm2, layers=(a, b), **SMOL).describe()
        want = _owned_bytes(sizes, a, b, n_layer)
        assert abs(d["weight_bytes"] - want) <= 0.05 * want, (a, b, d["weight_bytes"], want)
        assert d["kv_bytes"] == pytest.approx(whole["kv_bytes"] * (b - a) / n_layer, rel=0.01)
        if (a, b) == (10, 20):
            assert d["weight_bytes"] <= 0.40 * whole["weight_bytes"]


# ---- SmolLM2: 2, 3 and 4 stages, and a prompt past the split-KV threshold ---------------------


@needs_ranges
@pytest.mark.slow
@pytest.mark.parametrize("n_stages", [2, 3, 4])
def test_smollm2_split_parity(smollm2, n_stages):
    whole = dgr.Engine(smollm2, **SMOL)
    text = ("In a quiet village by the sea, the fishermen rose before dawn to mend their nets. "
            * (40 if n_stages == 3 else 4))
    prompt = whole.tokenize(text)
    if n_stages == 3:
        assert len(prompt) > 600, len(prompt)  # past flash attention's split-KV switch
    rep = compare(smollm2, split_layers(whole.n_layer, n_stages), prompt, decode_steps=16,
                  whole=whole, **SMOL)
    assert rep.prompt_rows_identical
    assert rep.bit_identical, [(s.step, s.max_abs_diff) for s in rep.steps if not s.bit_identical]


# ---- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [(0, 0), (2, 1), (0, 5), (4, 5), (-1, 2), (3, 3)])
def test_bad_ranges(tiny_llama, layers):
    with pytest.raises(errors.InvalidLayerRange):
        dgr.Engine(tiny_llama, layers=layers, **TINY)


def test_malformed_range_argument(tiny_llama):
    with pytest.raises(errors.InvalidLayerRange, match="pair"):
        dgr.Engine(tiny_llama, layers=(1,), **TINY)


def test_partial_range_on_unadapted_architecture(tmp_path):
    from dgr.testing.fixtures import gguf_module

    gguf = gguf_module()
    p = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(p), "qwen2")
    w.add_block_count(4)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(errors.UnsupportedArchitecture, match="qwen2"):
        dgr.Engine(p, layers=(0, 2))


@needs_ranges
def test_boundary_errors(tiny_llama):
    m = dgr.Engine(tiny_llama, layers=(2, 4), **TINY)
    with pytest.raises(errors.InvalidBoundary, match=r"\[n_tokens, 64\]"):
        m.forward(0, 0, boundary=np.zeros((2, 63), np.float32))
    with pytest.raises(errors.InvalidBoundary, match="float32"):
        m.forward(0, 0, boundary=np.zeros((2, 64), np.float64))
    with pytest.raises(errors.InvalidBoundary, match="takes a boundary"):
        m.forward(0, 0, [1, 2])
    with pytest.raises(errors.InvalidBoundary, match="rows"):
        m.forward(0, 0, [1, 2, 3], boundary=np.zeros((2, 64), np.float32))
    with pytest.raises(errors.InvalidPosition):
        m.forward(0, [0, 1, 2], boundary=np.zeros((2, 64), np.float32))
    # still serving
    assert m.forward(0, 0, boundary=np.zeros((2, 64), np.float32)).shape == (1, 128)


def test_single_stage_chain_is_the_whole_model(tiny_llama):
    """A one-stage LocalChain honours the same arguments as the engine it wraps."""
    chain = LocalChain(tiny_llama, [(0, 4)], **TINY)
    whole = dgr.Engine(tiny_llama, **TINY)
    got = chain.forward(0, 0, [1, 2, 3], logits="all")
    assert got.shape == (3, 128)
    assert got.tobytes() == whole.forward(0, 0, [1, 2, 3], logits="all").tobytes()
