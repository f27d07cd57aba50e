"""benches/qwen2_7b.py at a tiny shape: the file it writes is a qwen2 GGUF llama.cpp loads, with
the tensor types and sizes the 7B shape asks for, written atomically, reused when present, and
split bit-exact (the 7B run in docs/performance.md relies on all of it)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import dgr
from dgr.control.parity import compare

BENCHES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benches"))

import qwen2_7b

TINY = dict(n_ctx=128, n_threads=1, n_ubatch=8)


@pytest.fixture
def small(monkeypatch):
    # the 7B shape scaled down (every dimension a multiple of the 32-weight Q4_0 block)
    for k, v in dict(N_LAYER=3, N_EMBD=128, N_HEAD=4, N_HEAD_KV=2, N_FF=256, N_VOCAB=160).items():
        monkeypatch.setattr(qwen2_7b, k, v)
    monkeypatch.setattr(qwen2_7b, "HEAD_DIM", 32)
    monkeypatch.setattr(qwen2_7b, "N_KV", 64)
    return qwen2_7b


def test_writes_a_q4_0_qwen2_that_loads_and_splits(small, tmp_path):
    p = small.write(tmp_path / "m.gguf", log=lambda m: None)
    assert [f.name for f in tmp_path.iterdir()] == ["m.gguf"]  # no .part left behind
    whole = dgr.Engine(p, **TINY)
    d = whole.describe()
    assert (d["arch"], d["n_layer"], d["n_embd"], d["vocab_size"]) == ("qwen2", 3, 128, 160)
    q4_bytes = sum(s[0] * s[1] // 32 * 18 for _, s, k in small.tensors() if k == "q4_0")
    assert q4_bytes < p.stat().st_size < q4_bytes + 64 * 1024  # + f32 norms, biases, header
    row = whole.forward(0, 0, [1, 2, 3])
    assert row.shape == (1, 160) and np.isfinite(row).all()
    rep = compare(p, [(0, 1), (1, 3)], np.arange(11, dtype=np.int32) + 5, decode_steps=3,
                  whole=whole, **TINY)
    assert rep.bit_identical


def test_an_existing_file_is_reused_and_a_failed_write_leaves_nothing(small, tmp_path,
                                                                      monkeypatch):
    p = small.write(tmp_path / "m.gguf", log=lambda m: None)
    mtime = p.stat().st_mtime_ns
    assert small.write(p, log=lambda m: None) == p and p.stat().st_mtime_ns == mtime

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(small, "_q4_0", boom)
    with pytest.raises(OSError, match="disk full"):
        small.write(tmp_path / "other.gguf", log=lambda m: None)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["m.gguf"]
