"""Bit-exact split parity of SmolLM2 (30 layers) over random uneven layouts, in process.

The fixed parity tests (test_ranges.py) cover the even 2/3/4-stage splits; the README claims
any split. Here every run draws new layouts (2-5 stages, uneven, the first with a one-layer
stage) from a seed that is printed in the test ids and in every assertion message; replay a
failure with ``DGR_SPLIT_SEED=<seed> python -m pytest tests/integration/test_random_splits.py``.
"""

from __future__ import annotations

import pytest

import dgr
from dgr._core import HAS_LAYER_RANGES
from dgr.control.parity import compare
from dgr.core.local import LocalChain
from dgr.testing.layouts import SEED_ENV, layout_id, random_layouts, split_seed

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not HAS_LAYER_RANGES,
                                 reason="the built llama.cpp carries no layer-range patches")]

SMOL = dict(n_ctx=1024, n_threads=1, n_ubatch=64, flash_attn=True)
N_LAYER = 30  # SmolLM2-135M; checked against the loaded model below
SEED = split_seed()
LAYOUTS = random_layouts(SEED, N_LAYER, 3, min_stages=2, max_stages=5)


@pytest.fixture(scope="module")
def whole(smollm2):
    eng = dgr.Engine(smollm2, **SMOL)
    assert eng.n_layer == N_LAYER
    return eng


@pytest.mark.parametrize("ranges", LAYOUTS, ids=lambda r: f"seed{SEED}-{layout_id(r)}")
def test_smollm2_random_split_parity(smollm2, whole, ranges):
    # three ubatches and a ragged tail: the chain and the whole model chunk alike
    text = "The lighthouse keeper wrote every storm into his log, hour by hour. " * 10
    prompt = whole.tokenize(text)
    assert len(prompt) > 2 * SMOL["n_ubatch"], len(prompt)
    replay = f"seed {SEED} ({SEED_ENV}={SEED} replays), layout {ranges}"
    print(replay)
    chain = LocalChain(smollm2, ranges, **SMOL)
    assert [tuple(s.layers) for s in chain.stages] == ranges, replay
    rep = compare(smollm2, ranges, prompt, decode_steps=12, whole=whole, chain=chain, **SMOL)
    assert len(rep.steps) == 13, replay
    assert rep.prompt_rows_identical, f"{replay}: prompt logits differ"
    assert rep.bit_identical, (replay, [(s.step, s.max_abs_diff) for s in rep.steps
                                        if not s.bit_identical])
