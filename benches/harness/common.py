"""Shared setup for dgr's benchmarks: models and the settings every run uses."""

from __future__ import annotations

import time

import numpy as np

# One thread per process, as in the project's reference measurements.
SETTINGS = dict(n_ctx=1024, n_threads=1, n_ubatch=64, flash_attn=True)
SEED = 1234
#: the decode benchmarks' prompt length (llama-bench's ``-d``, llama-batched-bench's ``-npp``)
N_PROMPT_DECODE = 16
#: SmolLM2's vocabulary: the seeded prompts draw from it
N_VOCAB = 49152


def smollm2_path() -> str:
    from dgr.artifacts import models

    return str(models.path(models.DEFAULT_MODEL))


def prompt_tokens(n: int, n_vocab: int, seed: int = SEED) -> np.ndarray:
    """Seeded pseudo-random prompt (avoids token 0..99 specials)."""
    rng = np.random.default_rng(seed)
    return rng.integers(100, n_vocab, size=n, dtype=np.int32)


def prefill_tps(model, n_prompt: int, slot: int = 0) -> float:
    """Tokens/s of one prompt of n_prompt tokens through ``model`` (Engine or LocalChain)."""
    toks = prompt_tokens(n_prompt, model.n_vocab if hasattr(model, "n_vocab") else 49152)
    model.release(slot)
    t0 = time.perf_counter()
    model.forward(slot, 0, toks)
    dt = time.perf_counter() - t0
    model.release(slot)
    return n_prompt / dt


def decode_tps(model, n_decode: int, n_prompt: int = 16, slot: int = 0) -> float:
    """Tokens/s of n_decode greedy single-token steps after a short prompt."""
    toks = prompt_tokens(n_prompt, model.n_vocab if hasattr(model, "n_vocab") else 49152)
    model.release(slot)
    logits = model.forward(slot, 0, toks)
    buf = np.empty(1, dtype=np.int32)
    pos = n_prompt
    t0 = time.perf_counter()
    for _ in range(n_decode):
        buf[0] = int(np.argmax(logits[-1]))
        logits = model.forward(slot, pos, buf)
        pos += 1
    dt = time.perf_counter() - t0
    model.release(slot)
    return n_decode / dt


def session_prompt(i: int) -> list[int]:
    """The 16-token prompt of concurrent session ``i`` (a different seed per session)."""
    return [int(t) for t in prompt_tokens(N_PROMPT_DECODE, N_VOCAB, seed=SEED + 1 + i)]
