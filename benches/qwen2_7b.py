"""A random-weight GGUF with the shape of a 7B ``qwen2`` (Qwen2.5-7B), written once into the cache.

    python benches/qwen2_7b.py [--out PATH] [--force]     # prints the path

No real 7B GGUF is complete on the package registry, so real scale is measured on random
weights of the real shape: 28 layers, n_embd 3584, 28 query heads over 4 KV heads (GQA 7:1,
head 128), n_ff 18944, vocabulary 152064, q/k/v biases, untied output; every matrix Q4_0 (the
token embedding and the head included), norms and biases f32: 4.4 GB, about 7.6 B weights.
The weights are seeded pseudo-random Q4_0 blocks (a finite f16 scale per 32 weights, random
nibbles), so the file is the same bytes on every machine and the compute per token is what
a real 7B Q4_0 costs; the tokens it picks mean nothing (parity is what is checked).

The file goes to ``$DGR_CACHE/models/`` (default ``~/.cache/dgr``), never into the repository,
written to a temporary name and renamed when complete, so an interrupted run leaves nothing
half-written behind. Used by ``benches/compare.py --model`` and ``benches/stage_memory.py
--model`` (docs/performance.md, "Real scale").
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

from harness import cli

NAME = "random-qwen2-7b-shape-q4_0.gguf"
N_LAYER, N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_VOCAB = 28, 3584, 28, 4, 18944, 152064
HEAD_DIM = N_EMBD // N_HEAD
N_KV = N_HEAD_KV * HEAD_DIM
SEED = 7
QK = 32          # weights per Q4_0 block
BLOCK_BYTES = 18  # f16 scale + 16 bytes of nibbles


def default_path() -> Path:
    from dgr.vendor import cache_root

    return cache_root() / "models" / NAME


def tensors() -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape = reversed ggml ne, "q4_0" | "f32") of every tensor, in file order."""
    out = [("token_embd.weight", (N_VOCAB, N_EMBD), "q4_0"),
           ("output_norm.weight", (N_EMBD,), "f32"),
           ("output.weight", (N_VOCAB, N_EMBD), "q4_0")]
    for il in range(N_LAYER):
        b = f"blk.{il}."
        out += [(b + "attn_norm.weight", (N_EMBD,), "f32"),
                (b + "attn_q.weight", (N_EMBD, N_EMBD), "q4_0"),
                (b + "attn_q.bias", (N_EMBD,), "f32"),
                (b + "attn_k.weight", (N_KV, N_EMBD), "q4_0"),
                (b + "attn_k.bias", (N_KV,), "f32"),
                (b + "attn_v.weight", (N_KV, N_EMBD), "q4_0"),
                (b + "attn_v.bias", (N_KV,), "f32"),
                (b + "attn_output.weight", (N_EMBD, N_EMBD), "q4_0"),
                (b + "ffn_norm.weight", (N_EMBD,), "f32"),
                (b + "ffn_gate.weight", (N_FF, N_EMBD), "q4_0"),
                (b + "ffn_up.weight", (N_FF, N_EMBD), "q4_0"),
                (b + "ffn_down.weight", (N_EMBD, N_FF), "q4_0")]
    return out


def _q4_0(rng: np.random.Generator, shape: tuple[int, int], std: float) -> np.ndarray:
    """Random Q4_0 bytes for a [rows, cols] matrix: uint8 [rows, cols / 32 * 18]."""
    rows, cols = shape
    n = rows * cols // QK
    # (q - 8) * d with q uniform on 0..15 has a standard deviation of about 4.6 d
    d = (std / 4.6 * (0.5 + rng.random(n, dtype=np.float32))).astype(np.float16)
    blocks = np.empty((n, BLOCK_BYTES), np.uint8)
    blocks[:, :2] = d.view(np.uint8).reshape(n, 2)
    blocks[:, 2:] = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    return blocks.reshape(rows, cols // QK * BLOCK_BYTES)


def write(path: str | os.PathLike | None = None, *, force: bool = False, log=None) -> Path:
    """Write the model at ``path`` (default: the cache) unless it is already there; its path."""
    from dgr.testing.fixtures import gguf_module

    gguf = gguf_module()
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    path = Path(path) if path else default_path()
    if path.exists() and not force:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.part")
    rng = np.random.default_rng(SEED)
    t0 = time.monotonic()
    w = gguf.GGUFWriter(str(tmp), "qwen2")
    w.add_name("dgr-random-qwen2-7b-shape")
    w.add_context_length(32768)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(2)  # MOSTLY_Q4_0
    w.add_tokenizer_model("test")
    w.add_token_list([f"tok_{i}" for i in range(N_VOCAB)])
    w.add_token_scores([0.0] * N_VOCAB)
    w.add_token_types([1] * N_VOCAB)
    q4 = gguf.GGMLQuantizationType.Q4_0
    specs = tensors()
    for name, shape, kind in specs:
        if kind == "q4_0":
            nbytes = shape[0] * shape[1] // QK * BLOCK_BYTES
            w.add_tensor_info(name, (shape[0], shape[1] // QK * BLOCK_BYTES), np.dtype(np.uint8),
                              nbytes, raw_dtype=q4)
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        done = 0
        for i, (name, shape, kind) in enumerate(specs):
            if kind == "q4_0":
                data = _q4_0(rng, shape, std=0.02)
            elif name.endswith("norm.weight"):
                data = (1.0 + 0.05 * rng.standard_normal(shape[0])).astype(np.float32)
            else:  # biases
                data = (0.02 * rng.standard_normal(shape[0])).astype(np.float32)
            w.write_tensor_data(data)
            done += data.nbytes
            if i % 24 == 0 or i == len(specs) - 1:
                log(f"[qwen2_7b] {i + 1}/{len(specs)} tensors, {done / 2**30:.2f} GiB, "
                    f"{time.monotonic() - t0:.0f} s")
        w.close()
        tmp.replace(path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    log(f"[qwen2_7b] wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in "
        f"{time.monotonic() - t0:.0f} s")
    return path


def main(argv=None) -> int:
    ap = cli.parser(__doc__)
    ap.add_argument("--out", help=f"where to write it (default $DGR_CACHE/models/{NAME})")
    ap.add_argument("--force", action="store_true", help="write it again even if present")
    args = ap.parse_args(argv)
    print(write(args.out, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
