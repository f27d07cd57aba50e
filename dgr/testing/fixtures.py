"""Tiny random-weight GGUF models for fast tests, written with the pinned tree's gguf-py.

The pinned llama.cpp's own ``gguf-py`` is used (not a PyPI ``gguf`` release) so the written
metadata keys and tensor names always match the loader that reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dgr.artifacts.gguf import gguf_module

__all__ = ["gguf_module", "TinyLlama", "write_tiny_llama", "TinyDeepseek4", "write_tiny_deepseek4"]


@dataclass(frozen=True)
class TinyLlama:
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_vocab: int = 128
    n_ctx_train: int = 4096
    tied: bool = True
    seed: int = 0
    # type of the matrices (token embedding, attention, FFN): "f32", "f16", "q8_0" or "q4_0";
    # norms stay f32
    weight_type: str = "f32"


# weight_type -> (gguf.GGMLQuantizationType name, general.file_type / llama_ftype)
_WEIGHT_TYPES = {"f32": ("F32", 0), "f16": ("F16", 1), "q4_0": ("Q4_0", 2), "q8_0": ("Q8_0", 7)}


def write_tiny_llama(path: str | Path, cfg: TinyLlama = TinyLlama()) -> Path:
    """Write a random-weight llama-architecture GGUF ('test' tokenizer; matrices of
    ``cfg.weight_type``, f32 by default)."""
    gguf = gguf_module()
    if cfg.weight_type not in _WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {sorted(_WEIGHT_TYPES)}, got {cfg.weight_type!r}")
    qname, ftype = _WEIGHT_TYPES[cfg.weight_type]
    qtype = gguf.GGMLQuantizationType[qname]
    path = Path(path)
    rng = np.random.default_rng(cfg.seed)
    head_dim = cfg.n_embd // cfg.n_head
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("dgr-tiny-llama")
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(ftype)
    w.add_tokenizer_model("test")
    w.add_token_list([f"tok_{i}" for i in range(cfg.n_vocab)])
    w.add_token_scores([0.0] * cfg.n_vocab)
    w.add_token_types([1] * cfg.n_vocab)

    def t(name: str, *shape: int, scale: float = 0.2) -> None:
        # gguf-py takes numpy shapes (reversed ggml ne order)
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if cfg.weight_type == "f32":
            w.add_tensor(name, data)
        elif cfg.weight_type == "f16":
            w.add_tensor(name, data.astype(np.float16))
        else:
            from gguf.quants import quantize

            w.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32))

    t("token_embd.weight", cfg.n_vocab, cfg.n_embd, scale=1.0)
    ones("output_norm.weight", cfg.n_embd)
    if not cfg.tied:
        t("output.weight", cfg.n_vocab, cfg.n_embd)
    kv = cfg.n_head_kv * head_dim
    for il in range(cfg.n_layer):
        p = f"blk.{il}"
        ones(f"{p}.attn_norm.weight", cfg.n_embd)
        t(f"{p}.attn_q.weight", cfg.n_embd, cfg.n_embd)
        t(f"{p}.attn_k.weight", kv, cfg.n_embd)
        t(f"{p}.attn_v.weight", kv, cfg.n_embd)
        t(f"{p}.attn_output.weight", cfg.n_embd, cfg.n_embd)
        ones(f"{p}.ffn_norm.weight", cfg.n_embd)
        t(f"{p}.ffn_gate.weight", cfg.n_ff, cfg.n_embd)
        t(f"{p}.ffn_up.weight", cfg.n_ff, cfg.n_embd)
        t(f"{p}.ffn_down.weight", cfg.n_embd, cfg.n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@dataclass(frozen=True)
class TinyDeepseek4:
    """A tiny DeepSeek V4 (``deepseek4``): hyper-connection residual, hash-routed and
    compressed-attention layers (tensor shapes as the pinned llama.cpp's deepseek4 loader
    expects them, ``src/llama-model.cpp``).

    The defaults mix every kind of layer a stage can own: layers ``0..hash_layer_count-1``
    route experts by token id, ``compress_ratios`` puts CSA + lightning indexer (4), HCA
    (128) and plain sliding-window (0) layers side by side, so some stages own no
    compressed layer at all. ``mtp`` appends one NextN block (``blk.<n_layer>``) that
    ``block_count`` counts and ``nextn_predict_layers`` names.
    """

    n_layer: int = 6
    n_embd: int = 64
    n_head: int = 2
    head_dim: int = 64
    n_rot: int = 32
    q_lora: int = 64
    o_groups: int = 2
    o_lora: int = 16
    n_expert: int = 4
    n_expert_used: int = 2
    n_expert_shared: int = 1
    n_ff_exp: int = 64
    n_vocab: int = 128
    hash_layer_count: int = 3
    compress_ratios: tuple[int, ...] = (0, 0, 4, 128, 0, 4)
    sliding_window: int = 32
    # upstream's own fixture values (tests/test-llama-archs.cpp)
    indexer_heads: int = 64
    indexer_dim: int = 128
    indexer_top_k: int = 16
    hc: int = 4  # the loader asserts 4
    n_ctx_train: int = 4096
    mtp: bool = False
    #: name a NextN block (``nextn_predict_layers`` 1) the file does not hold (``block_count``
    #: counts the trunk only), as a conversion that drops the MTP weights writes it
    nextn_metadata_only: bool = False
    seed: int = 0


def write_tiny_deepseek4(path: str | Path, cfg: TinyDeepseek4 = TinyDeepseek4()) -> Path:
    """Write a random-weight DeepSeek V4 GGUF (f32 weights, I32 ``tid2eid``, 'test' tokenizer)."""
    if len(cfg.compress_ratios) != cfg.n_layer or any(r not in (0, 4, 128) for r in cfg.compress_ratios):
        raise ValueError(f"compress_ratios must give 0, 4 or 128 for each of the {cfg.n_layer} layers, "
                         f"got {cfg.compress_ratios}")
    if not 0 <= cfg.hash_layer_count <= cfg.n_layer:
        raise ValueError(f"hash_layer_count {cfg.hash_layer_count} is outside [0, {cfg.n_layer}]")
    gguf = gguf_module()
    path = Path(path)
    rng = np.random.default_rng(cfg.seed)
    arch = "deepseek4"
    hc, n_embd = cfg.hc, cfg.n_embd
    hc_dim, mix = hc * n_embd, (2 + hc) * hc
    n_mtp = 1 if cfg.mtp else 0
    n_blocks = cfg.n_layer + n_mtp
    ratios = list(cfg.compress_ratios) + [0] * n_mtp

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("dgr-tiny-deepseek4" + ("-mtp" if cfg.mtp else ""))
    w.add_file_type(0)  # all f32 (tid2eid is I32)

    def u32(key: str, v: int) -> None:
        w.add_uint32(f"{arch}.{key}", int(v))

    def f32(key: str, v: float) -> None:
        w.add_float32(f"{arch}.{key}", float(v))

    # required by the base loader (block_count counts the NextN blocks too)
    u32("context_length", cfg.n_ctx_train)
    u32("embedding_length", n_embd)
    u32("block_count", n_blocks)
    if cfg.mtp or cfg.nextn_metadata_only:
        u32("nextn_predict_layers", 1)
    u32("attention.head_count", cfg.n_head)
    u32("attention.head_count_kv", 1)
    u32("attention.key_length", cfg.head_dim)
    u32("attention.value_length", cfg.head_dim)
    u32("rope.dimension_count", cfg.n_rot)
    f32("rope.freq_base", 10000.0)
    u32("expert_count", cfg.n_expert)
    u32("expert_used_count", cfg.n_expert_used)
    u32("feed_forward_length", cfg.n_ff_exp)
    u32("vocab_size", cfg.n_vocab)
    # required by llama_model_deepseek4::load_arch_hparams
    f32("attention.layer_norm_rms_epsilon", 1e-6)
    u32("attention.q_lora_rank", cfg.q_lora)
    u32("attention.sliding_window", cfg.sliding_window)
    u32("expert_feed_forward_length", cfg.n_ff_exp)
    u32("expert_shared_count", cfg.n_expert_shared)
    f32("expert_weights_scale", 1.5)
    w.add_bool(f"{arch}.expert_weights_norm", True)
    f32("swiglu_clamp_exp", 10.0)
    u32("attention.indexer.head_count", cfg.indexer_heads)
    u32("attention.indexer.key_length", cfg.indexer_dim)
    u32("attention.indexer.top_k", cfg.indexer_top_k)
    u32("attention.output_group_count", cfg.o_groups)
    u32("attention.output_lora_rank", cfg.o_lora)
    f32("attention.compress_rope_freq_base", 10000.0)
    u32("hyper_connection.count", hc)
    u32("hyper_connection.sinkhorn_iterations", 3)
    f32("hyper_connection.epsilon", 1e-6)
    u32("hash_layer_count", cfg.hash_layer_count)
    w.add_array(f"{arch}.attention.compress_ratios", ratios)
    u32("expert_gating_func", 4)  # sqrtsoftplus, the only one the loader takes
    w.add_tokenizer_model("test")
    w.add_token_list([f"tok_{i}" for i in range(cfg.n_vocab)])
    w.add_token_scores([0.0] * cfg.n_vocab)
    w.add_token_types([1] * cfg.n_vocab)

    def t(name: str, *shape: int, scale: float = 0.1) -> None:
        # gguf-py takes numpy shapes (reversed ggml ne order)
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.05 * rng.standard_normal(n)).astype(np.float32))

    t("token_embd.weight", cfg.n_vocab, n_embd, scale=1.0)
    ones("output_norm.weight", n_embd)
    t("output.weight", cfg.n_vocab, n_embd)
    t("output_hc_fn.weight", hc, hc_dim)
    t("output_hc_base.weight", hc)
    ones("output_hc_scale.weight", 1)
    hd, n_ff, n_sh = cfg.head_dim, cfg.n_ff_exp, cfg.n_ff_exp * cfg.n_expert_shared
    for il in range(n_blocks):
        p = f"blk.{il}."
        ones(p + "attn_norm.weight", n_embd)
        t(p + "attn_sinks.weight", cfg.n_head)
        t(p + "attn_q_a.weight", cfg.q_lora, n_embd)
        ones(p + "attn_q_a_norm.weight", cfg.q_lora)
        t(p + "attn_q_b.weight", cfg.n_head * hd, cfg.q_lora)
        t(p + "attn_kv.weight", hd, n_embd)
        ones(p + "attn_kv_a_norm.weight", hd)
        # 2-D in the file; the loader reshapes it per output group
        t(p + "attn_output_a.weight", cfg.o_lora * cfg.o_groups, cfg.n_head * hd // cfg.o_groups)
        t(p + "attn_output_b.weight", n_embd, cfg.o_groups * cfg.o_lora)
        for s in ("attn", "ffn"):
            t(p + f"hc_{s}_fn.weight", mix, hc_dim)
            t(p + f"hc_{s}_base.weight", mix)
            ones(p + f"hc_{s}_scale.weight", 3)
        r = ratios[il]
        if r:
            coff = 2 if r == 4 else 1
            t(p + "attn_compressor_kv.weight", coff * hd, n_embd)
            t(p + "attn_compressor_gate.weight", coff * hd, n_embd)
            t(p + "attn_compressor_ape.weight", r, coff * hd)
            ones(p + "attn_compressor_norm.weight", hd)
            if r == 4:
                idx = cfg.indexer_dim
                t(p + "indexer.proj.weight", cfg.indexer_heads, n_embd)
                t(p + "indexer.attn_q_b.weight", cfg.indexer_heads * idx, cfg.q_lora)
                t(p + "indexer_compressor_kv.weight", 2 * idx, n_embd)
                t(p + "indexer_compressor_gate.weight", 2 * idx, n_embd)
                t(p + "indexer_compressor_ape.weight", r, 2 * idx)
                ones(p + "indexer_compressor_norm.weight", idx)
        t(p + "ffn_gate_inp.weight", cfg.n_expert, n_embd)
        if il < cfg.hash_layer_count:
            # hash routing: token id -> n_expert_used distinct experts
            tid2eid = np.stack([rng.permutation(cfg.n_expert)[:cfg.n_expert_used]
                                for _ in range(cfg.n_vocab)]).astype(np.int32)
            w.add_tensor(p + "ffn_gate_tid2eid.weight", tid2eid)
        else:
            t(p + "exp_probs_b.bias", cfg.n_expert)
        ones(p + "ffn_norm.weight", n_embd)
        t(p + "ffn_gate_exps.weight", cfg.n_expert, n_ff, n_embd)
        t(p + "ffn_down_exps.weight", cfg.n_expert, n_embd, n_ff)
        t(p + "ffn_up_exps.weight", cfg.n_expert, n_ff, n_embd)
        t(p + "ffn_gate_shexp.weight", n_sh, n_embd)
        t(p + "ffn_down_shexp.weight", n_embd, n_sh)
        t(p + "ffn_up_shexp.weight", n_sh, n_embd)
        if il >= cfg.n_layer:  # the NextN (MTP) block
            t(p + "nextn.eh_proj.weight", n_embd, 2 * n_embd)
            ones(p + "nextn.enorm.weight", n_embd)
            ones(p + "nextn.hnorm.weight", n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
