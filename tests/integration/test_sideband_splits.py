"""Graphs that need more than the residual at a seam, split by layer range (patches 0018-0020):

- talkie's layers each add the normed token embeddings again (a skip): every stage embeds the
  token ids it takes with the boundary (the token-id sideband of DeepSeek V4's hash layers);
  qwen4exp's stages gather their per-layer embeddings (an n-gram hash of the token ids) from
  them too, and its seams carry the hyper-connection streams;
- cogvlm's layers take their text weights for a batch of token ids: a later stage takes them;
- Kimi-K3's cross-layer residual attention mixes every residual checkpoint banked so far (one
  per block of 12 layers): a seam carries them in a wider boundary row, [residual | checkpoint
  0 | ...] (``n_embd_boundary``);
- qwen3vl and qwen3tts add deepstack features to early layers' outputs: on token input those
  are zeros, which a later stage adds too;
- nanbeige is llama's graph (a looped one loads whole only: tests/integration/test_ranges.py);
- GLM-5.2's shared-indexer layers reuse the top-k of the last full-indexer layer: a seam carries
  it in a wider row, [residual | top-k] (the generator's fixture indexes every layer, as GLM 5
  and 5.1 do: it is rewritten here with shared layers); hy_v4 carries its hc residual streams
  and the top-k (its fixture shares every odd layer's indexer), glm5-next its hc streams and
  the pooled selection's cells (its fixture rewritten with shared layers too);
- RWKV-7's layers (and ARWKV-7's) each mix in the first layer's value (``v_first``): a seam
  carries it, [residual | v_first];
- HRM-Text's layers are the cache slots of its unrolled cycles (a low and a high stack of
  ``layers_per_stack`` layers, reused): a seam carries the cycle state, [the running input of
  a pass it cuts | the high state | the low state]; its fixture (one layer a stack) is also
  rewritten with two, so seams cut passes.

Each is compared with the whole model, bit for bit, at every cut and in single-layer stages
(prompt rows in several ubatch chunks, then decode), and through three stages.
"""

from __future__ import annotations

import numpy as np
import pytest

from dgr import errors
from dgr._core import HAS_LAYER_RANGES
from dgr.control.parity import compare
from dgr.core.engine import Engine
from dgr.protocol.ranges import split_layers
from dgr.testing import archs

pytestmark = pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the patched llama.cpp")

SETTINGS = dict(n_ctx=128, n_threads=1, n_ubatch=8, flash_attn=True)
ARCHS = ("talkie", "cogvlm", "qwen3vl", "qwen3tts", "nanbeige", "kimi-k3", "glm-dsa", "hy_v4",
         "glm5-next", "qwen4exp", "hrm_text", "rwkv7", "arwkv7")


@pytest.fixture(scope="module")
def models():
    written = archs.write("^(" + "|".join(ARCHS) + ")$")
    got = {archs.arch_of(f): f for f in written.files}
    assert sorted(got) == sorted(ARCHS), (sorted(got), written.failed)
    return got


@pytest.fixture(scope="module")
def kimi_k3_26():
    """Kimi-K3 at 26 layers: residual checkpoints at layers 0, 12 and 24, so seams carry one,
    two or three."""
    (path,) = archs.write("^kimi-k3$", n_layer=26).files
    return path


def _prompt(n: int, n_vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


def _cuts(n_layer: int) -> list[list[tuple[int, int]]]:
    """Every two-stage cut, single-layer stages, and a three-way split."""
    out = [[(0, c), (c, n_layer)] for c in range(1, n_layer)]
    out.append([(i, i + 1) for i in range(n_layer)])
    out.append(split_layers(n_layer, 3))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_every_cut_computes_the_whole_models_bits(models, arch):
    whole = Engine(models[arch], **SETTINGS)
    prompt = _prompt(29, whole.n_vocab, 7)
    for layout in _cuts(whole.n_layer):
        rep = compare(models[arch], layout, prompt, decode_steps=5, whole=whole, **SETTINGS)
        assert rep.prompt_rows_identical, (arch, layout)
        assert rep.bit_identical, (arch, layout, [(s.step, s.max_abs_diff) for s in rep.steps])


@pytest.mark.parametrize("arch", ("rwkv7", "arwkv7"))
def test_rwkv7_seams_carry_the_first_layers_value(models, arch):
    """A seam's row is [residual | v_first], twice the residual's width; a later stage given a
    row whose v_first half is changed computes other bits (it reads it), and the first stage,
    which computes v_first itself, takes tokens only."""
    whole = Engine(models[arch], **SETTINGS)
    d = whole.describe()
    assert d["n_embd_boundary"] == 2 * d["n_embd"]
    first = Engine(models[arch], layers=(0, 2), **SETTINGS)
    prompt = _prompt(9, whole.n_vocab, 5)
    row = first.forward(0, 0, prompt).copy()
    assert row.shape == (len(prompt), 2 * d["n_embd"])
    assert np.abs(row[:, d["n_embd"]:]).max() > 0  # the first layer's value, not padding
    outs = []
    for half in (1.0, 0.5):
        later = Engine(models[arch], layers=(2, whole.n_layer), **SETTINGS)
        x = row.copy()
        x[:, d["n_embd"]:] *= half
        outs.append(later.forward(0, 0, boundary=x).copy())
    assert outs[0].tobytes() != outs[1].tobytes()


def test_kimi_k3_seams_carry_the_banked_checkpoints(kimi_k3_26):
    """The boundary row holds the residual and as many checkpoints as any seam may have (3 at
    26 layers and blocks of 12: 4 rows of n_embd), the first stage takes tokens only; every
    seam, with one, two or three checkpoints banked before it, gives the whole model's bits."""
    whole = Engine(kimi_k3_26, **SETTINGS)
    d = whole.describe()
    assert d["n_embd_boundary"] == 4 * d["n_embd"] and whole.n_layer == 26
    prompt = _prompt(21, whole.n_vocab, 3)
    for cut in (1, 11, 12, 13, 23, 24, 25):
        rep = compare(kimi_k3_26, [(0, cut), (cut, 26)], prompt, decode_steps=3, whole=whole,
                      **SETTINGS)
        assert rep.prompt_rows_identical and rep.bit_identical, cut
    rep = compare(kimi_k3_26, [(0, 7), (7, 13), (13, 24), (24, 26)], prompt, decode_steps=3,
                  whole=whole, **SETTINGS)
    assert rep.prompt_rows_identical and rep.bit_identical


def test_a_later_talkie_or_cogvlm_stage_takes_the_token_ids(models):
    """Such a stage says it needs the token ids with the boundary (the driver sends them, as
    for DeepSeek V4's hash layers) and refuses a boundary without them, naming why."""
    for arch, why in (("talkie", "read the token embeddings"),
                      ("cogvlm", "text weights for rows of token ids"),
                      ("qwen4exp", "per-layer embeddings gathered by the token ids")):
        stage = Engine(models[arch], layers=(2, 4), **SETTINGS)
        assert stage.needs_token_ids and stage.describe()["needs_token_ids"]
        with pytest.raises(errors.MissingTokenIds, match=f"{why}.*needs the token ids"):
            stage.forward(0, 0, boundary=np.zeros((3, stage.n_embd_boundary), np.float32))
    assert not Engine(models["qwen3vl"], layers=(2, 4), **SETTINGS).needs_token_ids


def _with_shared_indexers(arch: str, out_dir, types=(1, 0, 0, 1, 0, 0, 1, 0)):
    """The generator's ``arch`` at 8 layers with ``attention.indexer.types`` full, shared,
    shared, full, ... (GLM-5.2's kind: the shared layers' indexer weights are in the file,
    unread)."""
    import struct

    from dgr.artifacts.gguf import _enc_str, read_header, write_gguf

    (src,) = archs.write(f"^{arch}$", n_layer=len(types)).files
    h = read_header(src)
    key = f"{arch}.attention.indexer.types"
    kv = [raw for k, raw in h.kv_raw.items() if k != key]
    kv.append(_enc_str(key) + struct.pack("<IIQ", 9, 4, len(types))
              + b"".join(struct.pack("<I", v) for v in types))
    out = out_dir / f"{arch}-shared.gguf"
    write_gguf(out, version=h.version, kv_pairs=kv, tensors=[(t, src) for t in h.tensors],
               alignment=int(h.kv.get("general.alignment", 32)))
    return out


@pytest.fixture(scope="module")
def glm_dsa_shared(tmp_path_factory):
    return _with_shared_indexers("glm-dsa", tmp_path_factory.mktemp("glm-dsa"))


def test_glm_dsa_seams_carry_the_last_full_layers_top_k(glm_dsa_shared):
    """Where some layer shares its indexer, the boundary row is the residual and the top-k
    (``indexer_top_k`` floats); every cut (before and after shared layers), single-layer stages
    and two sessions of different lengths batched in one forward give the whole model's bits.
    The fixture as written (every layer full) keeps the plain boundary."""
    whole = Engine(glm_dsa_shared, n_slots=2, **SETTINGS)
    d = whole.describe()
    assert d["n_embd_boundary"] > d["n_embd"]
    (plain,) = archs.write("^glm-dsa$", n_layer=8).files
    pd = Engine(plain, **SETTINGS).describe()
    assert pd["n_embd_boundary"] == pd["n_embd"]
    prompt = _prompt(19, whole.n_vocab, 5)
    one = Engine(glm_dsa_shared, **SETTINGS)
    for layout in _cuts(8):
        rep = compare(glm_dsa_shared, layout, prompt, decode_steps=3, whole=one, **SETTINGS)
        assert rep.prompt_rows_identical and rep.bit_identical, layout
    stages = [Engine(glm_dsa_shared, layers=r, n_slots=2, **SETTINGS) for r in ((0, 2), (2, 5), (5, 8))]
    a, b = _prompt(13, whole.n_vocab, 8), _prompt(6, whole.n_vocab, 9)
    slots = np.array([0] * len(a) + [1] * len(b), np.int32)
    pos = np.concatenate([np.arange(len(a)), np.arange(len(b))]).astype(np.int32)
    toks = np.concatenate([a, b])

    def run(engines):
        x = None
        for e in engines:
            x = e.forward_batch(slots, pos, toks, boundary=x).copy()
        return x

    assert run(stages).tobytes() == run([whole]).tobytes()


@pytest.mark.parametrize("arch", ["glm5-next", "hy_v4"])
def test_hc_models_carry_their_streams_and_the_shared_selection(tmp_path, arch):
    """hy_v4 and glm5-next keep hc residual streams and shared-indexer layers: a seam's row is
    hc * n_embd wide plus the last full-indexer layer's selection (hy_v4: its top-k; glm5-next:
    its pooled selection's cells); every cut of 8 layers with shared ones and single-layer
    stages give the whole model's bits."""
    path = (_with_shared_indexers(arch, tmp_path) if arch == "glm5-next"
            else archs.write("^hy_v4$", n_layer=8).files[0])
    whole = Engine(path, **SETTINGS)
    d = whole.describe()
    assert d["n_embd_boundary"] > 4 * d["n_embd"]  # hc = 4 streams and the selection
    prompt = _prompt(23, whole.n_vocab, 11)
    for layout in _cuts(8):
        rep = compare(path, layout, prompt, decode_steps=3, whole=whole, **SETTINGS)
        assert rep.prompt_rows_identical and rep.bit_identical, layout


def _hrm_two_layers_a_stack(src, out):
    """The generator's hrm_text (one layer a stack, 2 h-cycles, 2 l-cycles: 6 slots over 2
    physical blocks) rewritten with two layers a stack: 12 slots over 4 physical blocks (each
    stack's two layers copies of its one), every slot's per-weight scales those of its pass."""
    import dataclasses

    from dgr.artifacts.gguf import encode_kv, read_header, write_gguf

    h = read_header(src)
    arch = h.kv["general.architecture"]
    n_l, n_h, lps = int(h.kv[f"{arch}.hrm.l_cycles"]), int(h.kv[f"{arch}.hrm.h_cycles"]), 2
    over = {f"{arch}.hrm.layers_per_stack": lps, f"{arch}.block_count": lps * n_h * (n_l + 1)}
    kv = [raw for k, raw in h.kv_raw.items() if k not in over]
    kv += [encode_kv(k, 4, v) for k, v in over.items()]  # 4: uint32
    scale = (".scale", ".input_scale")
    by = {t.name: t for t in h.tensors}
    tensors = []
    for t in h.tensors:
        if not t.name.startswith("blk."):
            tensors.append((t, src))
        elif not t.name.endswith(scale):
            b, rest = t.name[4:].split(".", 1)
            for nb in ((0, 1) if b == "0" else (2, 3)):
                tensors.append((dataclasses.replace(t, name=f"blk.{nb}.{rest}"), src))
    rests = sorted({t.name.split(".", 2)[2] for t in h.tensors
                    if t.name.startswith("blk.0.") and t.name.endswith(scale)})
    for s in range(over[f"{arch}.block_count"]):
        old = (s // (lps * (n_l + 1))) * (n_l + 1) + (s // lps) % (n_l + 1)
        tensors += [(dataclasses.replace(by[f"blk.{old}.{r}"], name=f"blk.{s}.{r}"), src)
                    for r in rests]
    write_gguf(out, version=h.version, kv_pairs=kv, tensors=tensors,
               alignment=int(h.kv.get("general.alignment", 32)))
    return out


def test_hrm_text_seams_carry_the_cycle_state_and_may_cut_a_pass(models, tmp_path):
    """With two layers a stack, an odd cut falls inside a pass of a stack: the next stage goes on
    from the carried running input; every cut and single-layer stages give the whole model's
    bits. The seam's row is three states wide."""
    path = _hrm_two_layers_a_stack(models["hrm_text"], tmp_path / "hrm-text-2.gguf")
    whole = Engine(path, **SETTINGS)
    d = whole.describe()
    assert whole.n_layer == 12 and d["n_embd_boundary"] == 3 * d["n_embd"]
    prompt = _prompt(21, whole.n_vocab, 13)
    for layout in _cuts(12):
        rep = compare(path, layout, prompt, decode_steps=3, whole=whole, **SETTINGS)
        assert rep.prompt_rows_identical and rep.bit_identical, layout
