"""The tiny vision-language fixtures (dgr.testing.mmproj): each projector names its type, its
output width is the text model's n_embd, and a seed always writes the same bytes."""

from __future__ import annotations

import pytest

from dgr.artifacts.gguf import read_header
from dgr.testing.mmproj import (PROJECTORS, TinyMmproj, TinyQwen2VL, image_tokens, write_mmproj,
                                write_tiny_qwen2vl, write_tiny_vlm)

#: the projector tensor whose width is the text model's n_embd, and its ggml axis
OUT_TENSOR = {"qwen25vl": ("mm.2.bias", 0), "qwen2vl": ("mm.2.bias", 0),
              "gemma3": ("mm.input_projection.weight", 0)}


@pytest.mark.parametrize("projector", sorted(PROJECTORS))
def test_projector_fits_its_text_model(tmp_path, projector):
    text, mmproj = write_tiny_vlm(tmp_path, projector)
    t, m = read_header(text), read_header(mmproj)
    proj_type, arch = PROJECTORS[projector]
    assert t.arch == arch
    assert m.arch == "clip" and m.kv["general.type"] == "mmproj"
    assert m.kv["clip.projector_type"] == proj_type
    assert m.kv["clip.has_vision_encoder"] is True
    n_embd = t.arch_int("embedding_length")
    assert m.kv["clip.vision.projection_dim"] == n_embd
    name, axis = OUT_TENSOR[projector]
    assert m.by_name[name].shape[axis] == n_embd
    # the image markers mtmd inserts are single control tokens of the text vocab
    tokens, types = t.kv["tokenizer.ggml.tokens"], t.kv["tokenizer.ggml.token_type"]
    markers = (("<start_of_image>", "<end_of_image>") if arch == "gemma3"
               else ("<|vision_start|>", "<|vision_end|>"))
    for s in markers:
        assert types[tokens.index(s)] == 3
    assert "tokenizer.chat_template" in t.kv
    if arch == "qwen2vl":
        sections = t.kv["qwen2vl.rope.dimension_sections"]
        head_dim = n_embd // t.arch_int("attention.head_count")
        assert len(sections) == 4 and sum(sections) <= head_dim // 2


def test_projection_width_follows_the_text_model(tmp_path):
    """A wider text model (given by path or by width) gets a wider projector output."""
    text = write_tiny_qwen2vl(tmp_path / "t.gguf", TinyQwen2VL(n_embd=96, n_head=4, n_head_kv=2))
    for src in (text, 96):
        m = read_header(write_mmproj(tmp_path / "m.gguf", src, TinyMmproj(projector="qwen25vl")))
        assert m.kv["clip.vision.projection_dim"] == 96
        assert m.by_name["mm.2.weight"].shape == (128, 96)  # ggml ne: [4 * n_embd, n_text]


@pytest.mark.parametrize("projector", sorted(PROJECTORS))
def test_same_seed_same_bytes(tmp_path, projector):
    a = write_tiny_vlm(tmp_path / "a", projector, seed=3)
    b = write_tiny_vlm(tmp_path / "b", projector, seed=3)
    c = write_tiny_vlm(tmp_path / "c", projector, seed=4)
    for x, y, z in zip(a, b, c):
        assert x.read_bytes() == y.read_bytes()
        assert x.read_bytes() != z.read_bytes()


def test_image_token_counts():
    """tools/mtmd/test-1.jpeg (640x488) as llama-mtmd-cli counted it with the defaults."""
    assert image_tokens(TinyMmproj(projector="qwen25vl"), 640, 488) == 48
    assert image_tokens(TinyMmproj(projector="qwen2vl"), 640, 488) == 48
    assert image_tokens(TinyMmproj(projector="gemma3"), 640, 488) == 36
    # a tiny image is scaled up to Qwen-VL's 8-token minimum; a huge one down to 4096
    assert image_tokens(TinyMmproj(projector="qwen25vl"), 20, 20) >= 8
    assert image_tokens(TinyMmproj(projector="qwen25vl"), 20000, 20000) <= 4096


def test_bad_configs_are_refused(tmp_path):
    with pytest.raises(ValueError):
        write_mmproj(tmp_path / "m.gguf", 64, TinyMmproj(projector="llava"))
    with pytest.raises(ValueError):
        write_mmproj(tmp_path / "m.gguf", 64, TinyMmproj(n_embd=32, n_ff=32))
    with pytest.raises(ValueError):
        write_tiny_qwen2vl(tmp_path / "t.gguf", TinyQwen2VL(rope_sections=(4, 4, 4, 0)))
