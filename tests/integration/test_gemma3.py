"""Gemma 3 270M Q4_K_M, the registry's four-part model fetched for real from PyPI (cached in
the store's models/ after the first run): it loads whole in dgr.Engine and decodes greedily;
a partial layer range is refused until gemma3 has a stage graph."""

from __future__ import annotations

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr.vendor import sha256_file

pytestmark = pytest.mark.slow

MODEL = "gemma3-270m-q4_k_m"
PROMPT = "The capital of France is"
N_DECODE = 8


@pytest.fixture(scope="module")
def gemma3():
    from dgr.artifacts import models

    p = models.path(MODEL)
    e = models.REGISTRY[MODEL]
    assert p.stat().st_size == e.size and sha256_file(p) == e.sha256
    return p


@pytest.fixture(scope="module")
def eng(gemma3):
    return dgr.Engine(gemma3, n_ctx=128, n_slots=2, n_ubatch=32, n_threads=2)


def test_loads_whole(eng):
    d = eng.describe()
    assert d["arch"] == "gemma3"
    assert d["n_layer"] == 18 and d["n_embd"] == 640 and d["vocab_size"] == 262144
    assert d["layers"] == [0, 18] and d["is_first"] and d["is_last"]


def test_greedy_decode_agrees_with_prefill(eng):
    """Greedy decoding one token at a time in slot 0; then the prompt and the generated
    tokens prefilled at once in slot 1 must pick, at every row, the token decoding picked,
    and the text must continue the prompt about France."""
    prompt = eng.tokenize(PROMPT)
    logits = eng.forward(0, 0, prompt)
    assert logits.shape == (1, 262144) and np.isfinite(logits).all()
    generated = [int(logits[-1].argmax())]
    pos = len(prompt)
    for _ in range(N_DECODE - 1):
        logits = eng.forward(0, pos, [generated[-1]])
        assert np.isfinite(logits).all()
        generated.append(int(logits[-1].argmax()))
        pos += 1
    whole = np.concatenate([prompt, np.asarray(generated[:-1], dtype=np.int32)])
    rows = eng.forward(1, 0, whole, logits="all")
    assert rows.shape == (len(whole), 262144)
    assert rows[len(prompt) - 1:].argmax(axis=1).tolist() == generated
    text = eng.detokenize(generated)
    assert "France" in text or "Paris" in text, text
    eng.release(0)
    eng.release(1)


def test_partial_range_is_refused_naming_gemma3(gemma3):
    """gemma3 has no stage graph yet (issue 16 item 2): any partial range is refused."""
    for layers in [(0, 9), (9, 18), (3, 4)]:
        with pytest.raises(errors.UnsupportedArchitecture, match="gemma3"):
            dgr.Engine(gemma3, layers=layers, n_ctx=64)
