"""Exact at long context: a 32k-token prompt through a 3-stage route computes the whole
model's bits, with f16 and with q8_0 KV, on a fixture whose trained context is 32k (its
context chosen by ``n_ctx=0``): every prompt row (each at its own KV length, 1 to 32k), the
decode steps at the far end, and a prompt-cache turn there that keeps 31k positions.

Long KV is where bits change (a flash-attention split-KV path past 512 cells was one such
defect), so the rows are compared at every length, not at one. The 128k-token check is
``benches/long_context.py`` (docs/performance.md "Long context")."""

from __future__ import annotations

import numpy as np
import pytest

from dgr.core.engine import Engine
from dgr.driver.route import Route
from dgr.testing.fixtures import TinyLlama, write_tiny_llama
from dgr.testing.stages import threaded_stages

pytestmark = pytest.mark.slow

N_CTX = 32768
RANGES = [(0, 1), (1, 3), (3, 4)]
UB = 512
PROMPT = N_CTX - 2 * UB      # room for the decode steps and the next turn's new tokens
STEPS = 12
KEEP = PROMPT - UB           # the next turn keeps this many positions (whole chunks)


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """The tiny llama trained for 32768 tokens, its heads 32 wide (q8_0 V rows need a
    multiple of q8_0's 32-value block)."""
    return write_tiny_llama(tmp_path_factory.mktemp("long") / "tiny-32k.gguf",
                            TinyLlama(n_ctx_train=N_CTX, n_head=2, n_head_kv=1))


def _greedy(engine, row, pos: int, steps: int) -> tuple[list[int], list[np.ndarray]]:
    """``steps`` greedy tokens after ``row`` (the logits at ``pos - 1``), each one's row."""
    toks, rows = [], []
    for i in range(steps):
        rows.append(np.array(row, copy=True))
        t = int(np.argmax(row))
        toks.append(t)
        if i + 1 < steps:
            row = engine.forward(0, pos, tokens=[t])[-1]
            pos += 1
    return toks, rows


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_a_32k_prompt_through_three_stages_is_the_whole_models_bits(long_llama, kv):
    settings = dict(n_ctx=0, n_slots=1, n_threads=2, n_ubatch=UB, type_k=kv, type_v=kv)
    prompt = np.random.default_rng(7).integers(1, 128, PROMPT, dtype=np.int32)
    whole = Engine(long_llama, **settings)
    assert whole.n_ctx == N_CTX

    # every prompt row, the three stages chained as a route chains them
    want = np.array(whole.forward(0, 0, tokens=prompt, logits="all"), copy=True)
    chain = [Engine(long_llama, layers=r, **settings) for r in RANGES]
    x = None
    for e in chain:
        x = e.forward(0, 0, tokens=prompt if e.is_first else None, boundary=x,
                      **({"logits": "all"} if e.is_last else {}))
    assert want.shape == x.shape == (PROMPT, 128)
    same = np.all(want == x, axis=1)
    assert same.all(), f"rows differ first at position {int(np.argmin(same))}"
    del chain, x

    # through a route of three workers: the decode steps at the far end ... (the route's last
    # stage computes the head over a chunk's last row only, another kernel than over all of
    # its rows: the reference's last chunk again, as a fresh prefill computes it)
    whole.truncate(0, PROMPT - UB)
    last = whole.forward(0, PROMPT - UB, tokens=prompt[-UB:])[-1]
    ref_toks, ref_rows = _greedy(whole, last, PROMPT, STEPS)
    turn2 = np.concatenate([prompt[:KEEP], np.random.default_rng(8).integers(
        1, 128, PROMPT + UB // 2 - KEEP, dtype=np.int32)])
    with threaded_stages(long_llama, RANGES, settings) as ws, \
            Route([w.address for w in ws]) as route:
        assert route.n_ctx == N_CTX
        s = route.session()
        got = list(s.generate(prompt, max_tokens=STEPS, logits=True, stop_on_eog=False))
        assert got == ref_toks
        differ = [i for i, (a, b) in enumerate(zip(s.logits, ref_rows))
                  if a.tobytes() != b.tobytes()]
        assert not differ, f"decode rows {differ} differ"
        assert len(s.logits) == STEPS
        # ... and a prompt-cache turn there: 31k positions kept, the rest prefilled anew
        assert s.reusable(turn2.tolist()) >= KEEP
        got2 = list(s.generate(turn2, max_tokens=STEPS, logits=True, stop_on_eog=False,
                               reuse=KEEP))
        rows2 = list(s.logits)
        s.close()
    whole.truncate(0, KEEP)
    last = whole.forward(0, KEEP, tokens=turn2[KEEP:])[-1]
    ref2, ref_rows2 = _greedy(whole, last, len(turn2), STEPS)
    assert got2 == ref2
    differ = [i for i, (a, b) in enumerate(zip(rows2, ref_rows2)) if a.tobytes() != b.tobytes()]
    assert not differ, f"the next turn's rows {differ} differ"
