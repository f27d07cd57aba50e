"""Tiny random-weight vision-language fixtures: a multimodal projector ("mmproj") GGUF, as the
pinned llama.cpp's ``tools/mtmd`` (``clip.cpp``) loads it, and a text model it fits.

Like :mod:`dgr.testing.fixtures`, everything is written with the pinned tree's own gguf-py,
f32 weights from a seeded numpy generator, so the same config writes the same bytes.

Projectors (:data:`PROJECTORS`) and the text architecture each one pairs with:

- ``qwen25vl`` (``clip.projector_type`` ``qwen2.5vl_merger``, Qwen2.5-VL): RMS-norm ViT with a
  SwiGLU FFN, 2-D M-RoPE inside the tower, window attention in all but every
  ``n_wa_pattern``-th block, a 2x2 patch merger MLP. Text arch ``qwen2vl`` (M-RoPE,
  ``rope.dimension_sections``), so mtmd decodes the image with M-RoPE positions.
- ``qwen2vl`` (``qwen2vl_merger``, Qwen2-VL): the same tower with LayerNorm, a quick-GELU
  FFN and no window attention. Text arch ``qwen2vl``.
- ``gemma3`` (``gemma3``): SigLIP ViT (learned position embeddings, LayerNorm, GELU), an
  average pool of ``scale_factor`` x ``scale_factor`` patches, RMS norm and a projection.
  Text arch ``gemma3``; mtmd decodes its image tokens non-causally.

Audio: ``qwen2a`` (Qwen2-Audio: a Whisper encoder, two 1-D convolutions and a LayerNorm
transformer over mtmd's 30-second window of 128 mel bins, then a linear projection; 750 rows
for any clip up to 30 s) beside the tiny ``qwen2vl`` text model (:func:`write_tiny_alm`), and
:func:`write_wav`, a sine tone for it.

Image sizes: Qwen-VL resizes an image to multiples of ``2 * patch_size`` (one output token per
2x2 patches, between 8 and 4096 tokens: fixed in ``clip.cpp``), so the token count follows from
the patch size: the default 40 makes ``tools/mtmd/test-1.jpeg`` (640x488) 8 x 6 = 48 tokens.
Gemma 3 resizes every image to ``image_size`` square: 96 / 8 / 2 = 6 x 6 = 36 tokens.
:func:`image_tokens` gives the count for any image size.

Note: for the Qwen projectors ``clip.cpp`` reserves its compute buffers for a 46 x 46-token
image at load (warmup; for ``qwen25vl`` that includes a 2116*4-square f32 window mask, about
0.3 GB); pass ``--no-warmup`` (``mtmd_context_params.warmup = false``) to skip it.

The text fixtures use llama.cpp's ``test`` tokenizer (text is hashed in 5-byte chunks, tokens
print as hex ids, as :func:`dgr.testing.fixtures.write_tiny_llama`) with the image markers
mtmd inserts (``<|vision_start|>`` / ``<|vision_end|>``, ``<start_of_image>`` /
``<end_of_image>``) and the chat-turn tokens as control tokens, so each marker is one token,
and a small chat template (``llama-mtmd-cli`` needs one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dgr.artifacts.gguf import gguf_module, read_header

__all__ = ["PROJECTORS", "TinyQwen2VL", "write_tiny_qwen2vl", "TinyGemma3", "write_tiny_gemma3",
           "TinyMmproj", "write_mmproj", "image_tokens", "write_tiny_vlm", "TinyAudioProj",
           "write_audio_mmproj", "write_tiny_alm", "write_wav"]

#: projector name -> (``clip.projector_type`` value, text architecture it pairs with)
PROJECTORS = {
    "qwen25vl": ("qwen2.5vl_merger", "qwen2vl"),
    "qwen2vl": ("qwen2vl_merger", "qwen2vl"),
    "gemma3": ("gemma3", "gemma3"),
}

# special tokens of each text fixture (control tokens, after the plain ones)
_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>")
_GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
                   "<start_of_image>", "<end_of_image>")
_CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
           "{{ message['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_GEMMA_TEMPLATE = ("{% for message in messages %}<start_of_turn>"
                   "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
                   "{{ message['content'] }}<end_of_turn>\n{% endfor %}"
                   "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


class _Writer:
    """A GGUFWriter with seeded random tensors (numpy shapes: reversed ggml ``ne`` order)."""

    def __init__(self, path: Path, arch: str, seed: int):
        self.gguf = gguf_module()
        self.w = self.gguf.GGUFWriter(str(path), arch)
        self.rng = np.random.default_rng(seed)

    def mat(self, name: str, *shape: int, scale: float | None = None) -> None:
        """Random matrix, by default scaled 1/sqrt(fan in) so activations stay O(1)."""
        if scale is None:
            scale = 1.0 / math.sqrt(int(np.prod(shape[1:])) or 1)
        self.w.add_tensor(name, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def bias(self, name: str, *shape: int, scale: float = 0.02) -> None:
        self.w.add_tensor(name, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def ln_block(self, p: str, c: int, ff: int, *, k_bias: bool = True) -> None:
        """One pre-LayerNorm transformer block ``p`` (a SigLIP or Whisper encoder's): both
        norms, the attention with biases (the key's only with ``k_bias``), a 2-matrix FFN."""
        for ln in ("ln1", "ln2"):
            self.norm(f"{p}.{ln}.weight", c)
            self.bias(f"{p}.{ln}.bias", c)
        for m in ("attn_q", "attn_k", "attn_v", "attn_out"):
            self.mat(f"{p}.{m}.weight", c, c)
            if k_bias or m != "attn_k":
                self.bias(f"{p}.{m}.bias", c)
        self.mat(f"{p}.ffn_up.weight", ff, c)
        self.bias(f"{p}.ffn_up.bias", ff)
        self.mat(f"{p}.ffn_down.weight", c, ff)
        self.bias(f"{p}.ffn_down.bias", c)

    def norm(self, name: str, n: int) -> None:
        self.w.add_tensor(name, (1.0 + 0.05 * self.rng.standard_normal(n)).astype(np.float32))

    def vocab(self, n_vocab: int, specials: tuple[str, ...]) -> dict[str, int]:
        """'test' tokenizer: ``tok_<i>`` plain tokens, then ``specials`` as control tokens."""
        n_plain = n_vocab - len(specials)
        if n_plain < 1:
            raise ValueError(f"n_vocab {n_vocab} leaves no room beside "
                             f"{len(specials)} special tokens")
        self.w.add_tokenizer_model("test")
        self.w.add_token_list([f"tok_{i}" for i in range(n_plain)] + list(specials))
        self.w.add_token_scores([0.0] * n_vocab)
        self.w.add_token_types([1] * n_plain + [3] * len(specials))  # NORMAL, CONTROL
        return {s: n_plain + i for i, s in enumerate(specials)}

    def trunk(self, name: str, cfg) -> None:
        """The keys every text fixture's transformer has, from its config (f32 file)."""
        w = self.w
        w.add_name(name)
        w.add_file_type(0)
        w.add_context_length(cfg.n_ctx_train)
        w.add_embedding_length(cfg.n_embd)
        w.add_block_count(cfg.n_layer)
        w.add_feed_forward_length(cfg.n_ff)
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv(cfg.n_head_kv)

    def close(self) -> None:
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()


# -- text models -----------------------------------------------------------------------


@dataclass(frozen=True)
class TinyQwen2VL:
    """A tiny Qwen2-VL / Qwen2.5-VL text model (llama.cpp arch ``qwen2vl``: Qwen2 with
    M-RoPE; ``rope_sections`` (t, h, w, unused) count rotary pairs, at most ``head_dim / 2``)."""

    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_vocab: int = 256
    rope_sections: tuple[int, int, int, int] = (2, 3, 3, 0)
    n_ctx_train: int = 4096
    seed: int = 0


def write_tiny_qwen2vl(path: str | Path, cfg: TinyQwen2VL = TinyQwen2VL()) -> Path:
    """Write a random-weight ``qwen2vl`` GGUF (f32, q/k/v biases, tied output, 'test'
    tokenizer with the Qwen-VL special tokens and a ChatML template)."""
    head_dim = cfg.n_embd // cfg.n_head
    if cfg.n_embd % cfg.n_head or cfg.n_head % cfg.n_head_kv:
        raise ValueError("n_embd must divide by n_head and n_head by n_head_kv")
    if len(cfg.rope_sections) != 4 or sum(cfg.rope_sections) > head_dim // 2:
        raise ValueError(f"rope_sections {cfg.rope_sections} must be 4 counts summing to at most "
                         f"head_dim / 2 = {head_dim // 2}")
    path = Path(path)
    g = _Writer(path, "qwen2vl", cfg.seed)
    w = g.w
    g.trunk("dgr-tiny-qwen2vl", cfg)
    w.add_rope_freq_base(1000000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_dimension_sections(list(cfg.rope_sections))
    w.add_layer_norm_rms_eps(1e-6)
    ids = g.vocab(cfg.n_vocab, _QWEN_SPECIALS)
    w.add_eos_token_id(ids["<|im_end|>"])
    w.add_pad_token_id(ids["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(_CHATML)

    kv = cfg.n_head_kv * head_dim
    g.mat("token_embd.weight", cfg.n_vocab, cfg.n_embd, scale=1.0)
    g.norm("output_norm.weight", cfg.n_embd)
    for il in range(cfg.n_layer):
        p = f"blk.{il}"
        g.norm(f"{p}.attn_norm.weight", cfg.n_embd)
        g.mat(f"{p}.attn_q.weight", cfg.n_embd, cfg.n_embd)
        g.bias(f"{p}.attn_q.bias", cfg.n_embd)
        g.mat(f"{p}.attn_k.weight", kv, cfg.n_embd)
        g.bias(f"{p}.attn_k.bias", kv)
        g.mat(f"{p}.attn_v.weight", kv, cfg.n_embd)
        g.bias(f"{p}.attn_v.bias", kv)
        g.mat(f"{p}.attn_output.weight", cfg.n_embd, cfg.n_embd)
        g.norm(f"{p}.ffn_norm.weight", cfg.n_embd)
        g.mat(f"{p}.ffn_gate.weight", cfg.n_ff, cfg.n_embd)
        g.mat(f"{p}.ffn_up.weight", cfg.n_ff, cfg.n_embd)
        g.mat(f"{p}.ffn_down.weight", cfg.n_embd, cfg.n_ff)
    g.close()
    return path


@dataclass(frozen=True)
class TinyGemma3:
    """A tiny Gemma 3 text model (arch ``gemma3``: q/k norms, post-attention and post-FFN
    norms, GELU FFN). ``sliding_window`` > 0 makes the layers interleaved-SWA, every
    ``swa_pattern``-th layer global (0: all global)."""

    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 16
    n_ff: int = 128
    n_vocab: int = 256
    sliding_window: int = 64
    swa_pattern: int = 2
    n_ctx_train: int = 4096
    seed: int = 0


def write_tiny_gemma3(path: str | Path, cfg: TinyGemma3 = TinyGemma3()) -> Path:
    """Write a random-weight ``gemma3`` GGUF (f32, tied output, 'test' tokenizer with the
    Gemma special tokens and a Gemma chat template)."""
    if cfg.n_head % cfg.n_head_kv:
        raise ValueError("n_head must divide by n_head_kv")
    path = Path(path)
    g = _Writer(path, "gemma3", cfg.seed)
    w = g.w
    g.trunk("dgr-tiny-gemma3", cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if cfg.sliding_window > 0:
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern(cfg.swa_pattern)
        w.add_rope_freq_base_swa(10000.0)
    ids = g.vocab(cfg.n_vocab, _GEMMA_SPECIALS)
    w.add_bos_token_id(ids["<bos>"])
    w.add_eos_token_id(ids["<eos>"])
    w.add_pad_token_id(ids["<pad>"])
    w.add_add_bos_token(True)
    w.add_chat_template(_GEMMA_TEMPLATE)

    q, kv = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    g.mat("token_embd.weight", cfg.n_vocab, cfg.n_embd, scale=1.0)
    g.norm("output_norm.weight", cfg.n_embd)
    for il in range(cfg.n_layer):
        p = f"blk.{il}"
        g.norm(f"{p}.attn_norm.weight", cfg.n_embd)
        g.mat(f"{p}.attn_q.weight", q, cfg.n_embd)
        g.mat(f"{p}.attn_k.weight", kv, cfg.n_embd)
        g.mat(f"{p}.attn_v.weight", kv, cfg.n_embd)
        g.norm(f"{p}.attn_q_norm.weight", cfg.head_dim)
        g.norm(f"{p}.attn_k_norm.weight", cfg.head_dim)
        g.mat(f"{p}.attn_output.weight", cfg.n_embd, q)
        g.norm(f"{p}.post_attention_norm.weight", cfg.n_embd)
        g.norm(f"{p}.ffn_norm.weight", cfg.n_embd)
        g.mat(f"{p}.ffn_gate.weight", cfg.n_ff, cfg.n_embd)
        g.mat(f"{p}.ffn_up.weight", cfg.n_ff, cfg.n_embd)
        g.mat(f"{p}.ffn_down.weight", cfg.n_embd, cfg.n_ff)
        g.norm(f"{p}.post_ffw_norm.weight", cfg.n_embd)
    g.close()
    return path


# -- projectors ------------------------------------------------------------------------

_QWEN_MEAN, _QWEN_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# per projector: patch_size, image_size
_DEFAULTS = {"qwen25vl": (40, 560), "qwen2vl": (40, 560), "gemma3": (8, 96)}
# Qwen-VL image token limits, fixed in clip.cpp (set_limit_image_tokens(8, 4096))
_QWEN_MIN_TOKENS, _QWEN_MAX_TOKENS = 8, 4096


@dataclass(frozen=True)
class TinyMmproj:
    """A tiny vision tower and projector. ``projector`` is a key of :data:`PROJECTORS`.

    ``patch_size`` / ``image_size`` of ``None`` take the projector's default (qwen: 40 / 560,
    where the image size is only the key's value, as Qwen-VL sizes images dynamically;
    gemma3: 8 / 96, every image is resized to that square). ``scale_factor`` is Gemma 3's pool
    kernel (written as ``clip.vision.projector.scale_factor``); ``n_wa_pattern`` makes every
    n-th Qwen2.5-VL block full attention, the others windowed."""

    projector: str = "qwen25vl"
    n_embd: int = 32
    n_head: int = 2
    n_ff: int = 64
    n_layer: int = 2
    patch_size: int | None = None
    image_size: int | None = None
    scale_factor: int = 2
    n_wa_pattern: int = 2
    seed: int = 0

    def resolved(self) -> "TinyMmproj":
        """This config with the projector's default patch and image size filled in."""
        if self.projector not in PROJECTORS:
            raise ValueError(f"projector must be one of {sorted(PROJECTORS)}, "
                             f"got {self.projector!r}")
        patch, image = _DEFAULTS[self.projector]
        return replace(self, patch_size=self.patch_size or patch,
                       image_size=self.image_size or image)


def _text_n_embd(text: int | str | Path) -> int:
    if isinstance(text, int):
        return text
    h = read_header(text)
    n = h.arch_int("embedding_length")
    if not n:
        raise ValueError(f"{text}: no {h.arch}.embedding_length")
    return n


def write_mmproj(path: str | Path, text: int | str | Path, cfg: TinyMmproj = TinyMmproj()) -> Path:
    """Write a random-weight mmproj GGUF whose output width (``clip.vision.projection_dim``,
    the projector's last matrix) is the text model's ``n_embd``: ``text`` is that width, or
    the path of the text GGUF to read it from."""
    cfg = cfg.resolved()
    n_text = _text_n_embd(text)
    c, ff, patch = cfg.n_embd, cfg.n_ff, cfg.patch_size
    d_head = c // cfg.n_head
    qwen = cfg.projector in ("qwen25vl", "qwen2vl")
    if c % cfg.n_head:
        raise ValueError("n_embd must divide by n_head")
    if ff == c:
        raise ValueError("n_ff must differ from n_embd (clip.cpp would take the FFN for a legacy "
                         "file with up and down swapped)")
    if qwen and d_head % 4:
        raise ValueError(f"the Qwen-VL tower's M-RoPE needs head_dim % 4 == 0, got {d_head}")
    side = cfg.image_size // patch
    if cfg.projector == "gemma3" and (cfg.image_size % patch or side % cfg.scale_factor):
        raise ValueError(f"image_size {cfg.image_size} must be a multiple of patch_size {patch} "
                         f"times scale_factor {cfg.scale_factor}")
    path = Path(path)
    g = _Writer(path, "clip", cfg.seed)
    w = g.w
    w.add_type("mmproj")
    w.add_name(f"dgr-tiny-mmproj-{cfg.projector}")
    w.add_file_type(0)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(PROJECTORS[cfg.projector][0])
    w.add_vision_projection_dim(n_text)
    w.add_vision_image_size(cfg.image_size)
    w.add_vision_patch_size(patch)
    w.add_vision_embedding_length(c)
    w.add_vision_feed_forward_length(ff)
    w.add_vision_block_count(cfg.n_layer)
    w.add_vision_head_count(cfg.n_head)
    w.add_vision_attention_layernorm_eps(1e-6)

    if qwen:
        w.add_vision_image_mean(_QWEN_MEAN)
        w.add_vision_image_std(_QWEN_STD)
        rms = cfg.projector == "qwen25vl"
        if rms:
            w.add_vision_use_silu(True)
            w.add_vision_n_wa_pattern(cfg.n_wa_pattern)
        # Conv3D (temporal patch 2) split into two Conv2D kernels, no bias
        g.mat("v.patch_embd.weight", c, 3, patch, patch)
        g.mat("v.patch_embd.weight.1", c, 3, patch, patch)
        for il in range(cfg.n_layer):
            p = f"v.blk.{il}"
            for ln in ("ln1", "ln2"):
                g.norm(f"{p}.{ln}.weight", c)
                if not rms:
                    g.bias(f"{p}.{ln}.bias", c)
            for m in ("attn_q", "attn_k", "attn_v", "attn_out"):
                g.mat(f"{p}.{m}.weight", c, c)
                g.bias(f"{p}.{m}.bias", c)
            if rms:  # SwiGLU
                g.mat(f"{p}.ffn_gate.weight", ff, c)
                g.bias(f"{p}.ffn_gate.bias", ff)
            g.mat(f"{p}.ffn_up.weight", ff, c)
            g.bias(f"{p}.ffn_up.bias", ff)
            g.mat(f"{p}.ffn_down.weight", c, ff)
            g.bias(f"{p}.ffn_down.bias", c)
        # merger: norm, then an MLP over each 2x2 group of patches
        g.norm("v.post_ln.weight", c)
        if not rms:
            g.bias("v.post_ln.bias", c)
        g.mat("mm.0.weight", 4 * c, 4 * c)
        g.bias("mm.0.bias", 4 * c)
        g.mat("mm.2.weight", n_text, 4 * c)
        g.bias("mm.2.bias", n_text)
    else:  # gemma3: SigLIP
        w.add_vision_image_mean([0.5, 0.5, 0.5])
        w.add_vision_image_std([0.5, 0.5, 0.5])
        w.add_vision_use_gelu(True)
        w.add_vision_projector_scale_factor(cfg.scale_factor)
        n_patches = (cfg.image_size // patch) ** 2
        g.mat("v.patch_embd.weight", c, 3, patch, patch)
        g.bias("v.patch_embd.bias", c)
        g.mat("v.position_embd.weight", n_patches, c, scale=0.02)
        for il in range(cfg.n_layer):
            g.ln_block(f"v.blk.{il}", c, ff)
        g.norm("v.post_ln.weight", c)
        g.bias("v.post_ln.bias", c)
        g.norm("mm.soft_emb_norm.weight", c)
        # ggml ne [n_text, n_embd]: clip.cpp multiplies by its transpose
        g.mat("mm.input_projection.weight", c, n_text, scale=1.0 / math.sqrt(c))
    g.close()
    return path


def image_tokens(cfg: TinyMmproj, width: int, height: int) -> int:
    """How many image tokens mtmd makes of a ``width`` x ``height`` image with this projector
    (its preprocessing as the pinned ``mtmd-image.cpp`` does it, with no token-count overrides;
    no begin/end marker tokens counted)."""
    cfg = cfg.resolved()
    if cfg.projector == "gemma3":
        return (cfg.image_size // cfg.patch_size // cfg.scale_factor) ** 2
    # calc_size_preserved_ratio: round to the alignment, then fit between min and max pixels
    align = cfg.patch_size * 2
    area = align * align  # one output token
    lo, hi = _QWEN_MIN_TOKENS * area, _QWEN_MAX_TOKENS * area

    def rnd(x: float) -> int:
        # std::round: halves away from zero
        return int(math.floor(x / align + 0.5)) * align

    w_bar, h_bar = max(align, rnd(width)), max(align, rnd(height))
    if w_bar * h_bar > hi:
        beta = math.sqrt(height * width / hi)
        h_bar = max(align, math.floor(height / beta / align) * align)
        w_bar = max(align, math.floor(width / beta / align) * align)
    elif w_bar * h_bar < lo:
        beta = math.sqrt(lo / (height * width))
        h_bar = math.ceil(height * beta / align) * align
        w_bar = math.ceil(width * beta / align) * align
    return (w_bar // align) * (h_bar // align)


def write_tiny_vlm(out_dir: str | Path, projector: str = "qwen25vl", *, seed: int = 0,
                   mmproj: TinyMmproj | None = None) -> tuple[Path, Path]:
    """Write a matching pair into ``out_dir``: the text model of the projector's architecture
    (default config, ``seed``) and the projector (``mmproj``, else the defaults with
    ``seed``). Returns ``(text_path, mmproj_path)``."""
    if projector not in PROJECTORS:
        raise ValueError(f"projector must be one of {sorted(PROJECTORS)}, got {projector!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arch = PROJECTORS[projector][1]
    if arch == "qwen2vl":
        text = write_tiny_qwen2vl(out / f"{projector}-text.gguf", TinyQwen2VL(seed=seed))
    else:
        text = write_tiny_gemma3(out / f"{projector}-text.gguf", TinyGemma3(seed=seed))
    cfg = mmproj or TinyMmproj(projector=projector, seed=seed)
    if cfg.projector != projector:
        raise ValueError(f"mmproj config is for {cfg.projector!r}, not {projector!r}")
    return text, write_mmproj(out / f"{projector}-mmproj.gguf", text, cfg)


# -- audio -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyAudioProj:
    """A tiny Whisper-style audio encoder with Qwen2-Audio's projector (``clip.projector_type``
    ``qwen2a``): two 1-D convolutions (the second of stride 2), a LayerNorm transformer over
    the 1500 frames of a 30-second window (mtmd pads a shorter clip), a linear projection to
    the text model's width."""

    n_embd: int = 32
    n_head: int = 2
    n_ff: int = 64
    n_layer: int = 2
    n_mel: int = 128
    seed: int = 0


def write_audio_mmproj(path: str | Path, text: int | str | Path,
                       cfg: TinyAudioProj = TinyAudioProj()) -> Path:
    """Write a random-weight ``qwen2a`` audio projector GGUF whose output width is the text
    model's ``n_embd`` (``text``: that width, or the text GGUF's path)."""
    n_text = _text_n_embd(text)
    c, ff = cfg.n_embd, cfg.n_ff
    if c % cfg.n_head or ff == c:
        raise ValueError("n_embd must divide by n_head, and n_ff differ from n_embd")
    path = Path(path)
    g = _Writer(path, "clip", cfg.seed)
    w = g.w
    w.add_type("mmproj")
    w.add_name("dgr-tiny-mmproj-qwen2a")
    w.add_file_type(0)
    w.add_clip_has_audio_encoder(True)
    w.add_clip_projector_type("qwen2a")
    w.add_audio_projection_dim(n_text)
    w.add_audio_embedding_length(c)
    w.add_audio_feed_forward_length(ff)
    w.add_audio_block_count(cfg.n_layer)
    w.add_audio_head_count(cfg.n_head)
    w.add_audio_attention_layernorm_eps(1e-5)
    w.add_audio_num_mel_bins(cfg.n_mel)
    # numpy shapes: ggml's ne reversed (a conv kernel [c_out, c_in, k]; biases [c, 1])
    g.mat("a.conv1d.1.weight", c, cfg.n_mel, 3)
    g.bias("a.conv1d.1.bias", c, 1)
    g.mat("a.conv1d.2.weight", c, c, 3)
    g.bias("a.conv1d.2.bias", c, 1)
    g.mat("a.position_embd.weight", 1500, c, scale=0.02)
    for il in range(cfg.n_layer):
        g.ln_block(f"a.blk.{il}", c, ff, k_bias=False)  # Whisper's key has no bias
    g.norm("a.post_ln.weight", c)
    g.bias("a.post_ln.bias", c)
    g.mat("mm.a.fc.weight", n_text, c)
    g.bias("mm.a.fc.bias", n_text)
    g.close()
    return path


def write_tiny_alm(out_dir: str | Path, *, seed: int = 0) -> tuple[Path, Path]:
    """A text model (the tiny ``qwen2vl``) and a ``qwen2a`` audio projector of its width:
    ``(text_path, mmproj_path)``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = write_tiny_qwen2vl(out / "alm-text.gguf", TinyQwen2VL(seed=seed))
    return text, write_audio_mmproj(out / "qwen2a-mmproj.gguf", text, TinyAudioProj(seed=seed))


def write_wav(path: str | Path, seconds: float = 1.0, rate: int = 16000,
              freq: float = 440.0) -> Path:
    """A mono 16-bit PCM WAV of a sine tone (the standard library's ``wave``)."""
    import wave

    n = int(seconds * rate)
    t = np.arange(n) / rate
    pcm = (0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm.tobytes())
    return Path(path)
