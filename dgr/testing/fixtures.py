"""Tiny random-weight GGUF models for fast tests, written with the pinned tree's gguf-py.

The pinned llama.cpp's own ``gguf-py`` is used (not a PyPI ``gguf`` release) so the written
metadata keys and tensor names always match the loader that reads them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["gguf_module", "TinyLlama", "write_tiny_llama"]


def gguf_module():
    """Import ``gguf`` from the pinned llama.cpp tree in the vendor cache."""
    from ..vendor import Vendor

    path = str(Vendor().gguf_py())
    if not Path(path).exists():
        from ..errors import VendorError

        raise VendorError(f"{path} is missing; run `python -m dgr.vendor fetch`")
    if path not in sys.path:
        sys.path.insert(0, path)
    import gguf  # noqa: E402

    return gguf


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


def write_tiny_llama(path: str | Path, cfg: TinyLlama = TinyLlama()) -> Path:
    """Write a random-weight llama-architecture GGUF (f32 weights, 'test' tokenizer)."""
    gguf = gguf_module()
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
    w.add_file_type(0)  # all f32
    w.add_tokenizer_model("test")
    w.add_token_list([f"tok_{i}" for i in range(cfg.n_vocab)])
    w.add_token_scores([0.0] * cfg.n_vocab)
    w.add_token_types([1] * cfg.n_vocab)

    def t(name: str, *shape: int, scale: float = 0.2) -> None:
        # gguf-py takes numpy shapes (reversed ggml ne order)
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

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
