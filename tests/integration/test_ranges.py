"""Layer-range engines: bit-exact split parity, per-stage memory, and the range errors."""

from __future__ import annotations

import re

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr._core import HAS_LAYER_RANGES, arch_supports_layer_range
from dgr.control.parity import compare
from dgr.core.local import LocalChain
from dgr.protocol.ranges import split_layers
from dgr.testing.archs import FAMILIES
from dgr.vendor import cpu_features

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
    # ggml repacks the matrices for its AMX kernels where the CPU has them: a q8_0 matrix (the
    # tied head) then takes 64 bytes of compensation per 16 rows of 32 columns more, 12 %
    slack = 0.125 if "amx_int8" in cpu_features()[2] else 0.05
    whole = dgr.Engine(smollm2, **SMOL).describe()
    n_layer = whole["n_layer"]
    for a, b in [(0, 10), (10, 20), (20, 30), (0, 29), (1, 30)]:
        d = dgr.Engine(smollm2, layers=(a, b), **SMOL).describe()
        want = _owned_bytes(sizes, a, b, n_layer)
        got = d["weight_bytes"] - want
        assert -0.05 * want <= got <= slack * want, (a, b, d["weight_bytes"], want)
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


def write_tiny_dense(path, arch: str, qk_norm: bool = False, loops: int = 0):
    """A random 4-layer dense GGUF of a llama-like ``arch`` (qwen2, qwen3, mistral3, nanbeige:
    their loaders take the tiny llama's tensors; ``qk_norm`` adds qwen3's per-layer
    ``attn_q_norm``/``attn_k_norm``; ``loops`` sets nanbeige's ``num_loops``), whose whole
    model llama.cpp loads."""
    from dgr.testing.fixtures import gguf_module

    gguf = gguf_module()
    rng = np.random.default_rng(0)
    n_layer, n_embd, n_ff, n_vocab, n_head = 4, 64, 128, 128, 4
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(0)
    if loops:
        w.add_uint32(f"{arch}.num_loops", loops)
    w.add_tokenizer_model("test")
    w.add_token_list([f"tok_{i}" for i in range(n_vocab)])
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types([1] * n_vocab)
    shapes = {"token_embd.weight": (n_vocab, n_embd), "output_norm.weight": (n_embd,),
              "output.weight": (n_vocab, n_embd)}
    layer = [("attn_norm", (n_embd,)), ("attn_q", (n_embd, n_embd)), ("attn_k", (n_embd, n_embd)),
             ("attn_v", (n_embd, n_embd)), ("attn_output", (n_embd, n_embd)),
             ("ffn_norm", (n_embd,)), ("ffn_gate", (n_ff, n_embd)), ("ffn_up", (n_ff, n_embd)),
             ("ffn_down", (n_embd, n_ff))]
    if qk_norm:
        layer += [("attn_q_norm", (n_embd // n_head,)), ("attn_k_norm", (n_embd // n_head,))]
    for il in range(n_layer):
        shapes.update({f"blk.{il}.{name}.weight": shape for name, shape in layer})
    for name, shape in shapes.items():  # gguf-py takes numpy shapes (reversed ggml ne)
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_partial_range_of_a_looped_nanbeige_is_refused(tmp_path):
    """nanbeige splits (0020), but a looped one (``num_loops`` > 1: its logical layers share the
    weights of its physical ones, and the loops read the output norm between them) loads whole
    only: a partial range is refused with the typed error before any weight is read, naming
    why; the whole model (implicit or explicit) loads and runs all 8 logical layers."""
    p = write_tiny_dense(tmp_path / "tiny-nanbeige-looped.gguf", "nanbeige", loops=2)
    assert arch_supports_layer_range("nanbeige")
    for layers in [(0, 2), (2, 4), (1, 3)]:
        with pytest.raises(errors.UnsupportedArchitecture,
                           match=r"looped nanbeige model \(nanbeige.num_loops = 2\).*load it whole"):
            dgr.Engine(p, layers=layers, **TINY)
    for layers in [None, (0, 4)]:
        whole = dgr.Engine(p, layers=layers, **TINY)
        assert (whole.arch, whole.layers, whole.is_first, whole.is_last) == (
            "nanbeige", (0, 4), True, True)
        row = whole.forward(0, 0, [1, 2, 3])
        assert row.shape == (1, 128) and np.isfinite(row).all()
    once = dgr.Engine(write_tiny_dense(tmp_path / "tiny-nanbeige.gguf", "nanbeige"), **TINY)
    assert not np.array_equal(once.forward(0, 0, [1, 2, 3]), row)  # the loops ran


def test_partial_range_on_unadapted_architecture(tmp_path):
    """An architecture outside llama.cpp's list (dream: a diffusion model, non-causal): a
    partial range is refused with the typed error naming the reason; the whole model runs."""
    from dgr.testing import archs

    (p,) = archs.write("^dream$").files
    assert not arch_supports_layer_range("dream")
    for layers in [(0, 2), (2, 4)]:
        with pytest.raises(errors.UnsupportedArchitecture,
                           match="dream.*refused because it is a non-causal, diffusion model"):
            dgr.Engine(p, layers=layers, **TINY)
    whole = dgr.Engine(p, **TINY)
    assert whole.arch == "dream" and np.isfinite(whole.forward(0, 0, [1, 2, 3])).all()


@needs_ranges
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral3", "nanbeige"])
@pytest.mark.parametrize("ranges", _all_splits(4), ids=lambda r: "-".join(f"{a}:{b}" for a, b in r))
def test_tiny_llama_like_split_parity(tmp_path, arch, ranges):
    """qwen2 and qwen3 (patch 0008), mistral3 (0011), nanbeige (0020): every interior cut and single-layer stages
    give every prompt row and every decode step's logits bit for bit as the whole model."""
    p = write_tiny_dense(tmp_path / f"tiny-{arch}.gguf", arch, qk_norm=arch == "qwen3")
    assert arch_supports_layer_range(arch)
    prompt = (np.arange(37, dtype=np.int32) * 7) % 128  # 37 tokens = 5 chunks of ubatch 8
    rep = compare(p, ranges, prompt, decode_steps=16, **TINY)
    assert rep.prompt_rows_identical
    assert rep.bit_identical, [(s.step, s.max_abs_diff) for s in rep.steps if not s.bit_identical]
    assert len(rep.steps) == 17
    first, last = dgr.Engine(p, layers=ranges[0], **TINY), dgr.Engine(p, layers=ranges[-1], **TINY)
    assert (first.arch, first.is_first, first.is_last, last.is_last) == (arch, True, False, True)


def _llama_cpp_archs() -> tuple[set[str], set[str]]:
    """The architecture names in the patched tree's llm_arch_supports_layer_range switch
    (src/llama-model.cpp), and all the names llama.cpp knows (src/llama-arch.cpp), read from
    the source dgr was built from."""
    from dgr.vendor import Vendor

    src = Vendor().src / "src"
    names = dict(re.findall(r'\{\s*(LLM_ARCH_\w+)\s*,\s*"([^"]+)"\s*\}',
                            (src / "llama-arch.cpp").read_text()))
    body = (src / "llama-model.cpp").read_text()
    m = re.search(r"static bool llm_arch_supports_layer_range\(llm_arch arch\) \{(.*?)\n\}",
                  body, re.S)
    assert m, "llm_arch_supports_layer_range is not in the patched llama-model.cpp"
    return {names[c] for c in re.findall(r"case (LLM_ARCH_\w+):", m.group(1))}, set(names.values())


@needs_ranges
def test_splittable_architectures_are_llama_cpps_list():
    """dgr keeps no list of its own: the binding's answer, for every architecture llama.cpp
    knows, is the switch the stage-graph patches fill in (llama 0005, deepseek4 0006, qwen2 and
    qwen3 0008, 76 more 0011, the recurrent and hybrid 15 of 0016, 11 more 0017, 4 of 0018, 1
    of 0019, 1 of 0020, 1 of 0021, 2 of 0022, 1 of 0023, 1 of 0024, 3 of 0025), and it holds every family the suite requires (issue 16's, the hybrid
    ones of issue 53)."""
    listed, known = _llama_cpp_archs()
    assert set(FAMILIES) <= listed and len(listed) == 120
    assert {a for a in known if arch_supports_layer_range(a)} == listed
    assert {"mamba", "qwen3next", "qwen35", "nemotron_h", "deepseek32", "bloom"} <= listed
    assert {"qwen3vl", "talkie", "cogvlm", "kimi-k3", "nanbeige", "glm-dsa", "hy_v4",
            "glm5-next", "qwen4exp", "hrm_text", "rwkv6", "rwkv7", "arwkv7"} <= listed
    for arch in ("dream", "llada-moe", "rnd1", "llada", "llama-embed", "gemma3n", "",
                 "no-such-arch", "rwkv6qwen2"):
        assert not arch_supports_layer_range(arch)


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


def test_layer_costs_count_each_layers_matrices_and_the_tied_head(tiny_llama):
    """``layer_costs`` reads what a token multiplies from the GGUF: each layer's matrices
    (norms left out) and the head (the token embedding, tied here)."""
    from dgr.artifacts.manifest import layer_costs

    costs, head = layer_costs(tiny_llama)
    per_layer = 64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3  # q, o; k, v; gate, up, down
    assert costs == [per_layer] * 4 and head == 128 * 64
