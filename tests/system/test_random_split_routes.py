"""Real worker routes (``python -m dgr.worker`` processes) over a random uneven layout of
SmolLM2: greedy tokens and logits bit-identical to the whole model, with equal settings.

The layout (3-5 stages, one of them a single layer) is drawn anew every run from a seed shown
in the test id and every assertion message; ``DGR_SPLIT_SEED=<seed>`` replays it (the
in-process test_random_splits.py draws its layouts from the same seed, another stream).
"""

from __future__ import annotations

import pytest

import dgr
from dgr._core import HAS_LAYER_RANGES
from dgr.core.local import generate_local
from dgr.driver.route import Route
from dgr.testing.layouts import SEED_ENV, layout_id, random_layouts, split_seed
from dgr.worker.process import LocalCluster

pytestmark = [pytest.mark.system, pytest.mark.slow,
              pytest.mark.skipif(not HAS_LAYER_RANGES, reason="multi-stage routes need the "
                                 "llama.cpp layer-range patches (dgr._core.HAS_LAYER_RANGES)")]

# every worker and the in-process reference: the same numeric settings, the same slots
SETTINGS = dict(n_ctx=512, n_slots=2, n_threads=1, n_ubatch=32, flash_attn=True)
SEED = split_seed()
(LAYOUT,) = random_layouts(SEED, 30, 1, min_stages=3, max_stages=5, stream="routes")
REPLAY = f"seed {SEED} ({SEED_ENV}={SEED} replays), layout {LAYOUT}"
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
N_TOKENS = 24


@pytest.fixture(scope="module")
def whole(smollm2):
    eng = dgr.Engine(smollm2, **SETTINGS)
    assert eng.n_layer == 30
    return eng


@pytest.fixture(scope="module")
def cluster(smollm2):
    c = LocalCluster(str(smollm2), LAYOUT, settings=SETTINGS)
    try:
        c.start(timeout=120)
        yield c
    finally:
        codes = c.stop()
    assert codes == [0] * len(LAYOUT), (REPLAY, [w.log_tail() for w in c.workers])


def _prompt(whole, question: str) -> list[int]:
    return [int(t) for t in whole.tokenize(CHAT.format(question), True, True)]


@pytest.mark.parametrize("relay", [None, False],
                         ids=[f"seed{SEED}-{layout_id(LAYOUT)}-{m}" for m in ("relay", "grpc")])
def test_random_layout_route_is_bit_identical_to_the_whole_model(cluster, whole, relay):
    print(REPLAY)
    # a prompt of two and a half ubatches: the prefill is chunked across every stage
    p = _prompt(whole, "A cyclist rides from the valley to a mountain pass. The road climbs "
                       "slowly at first, then turns steep for the last five kilometres, where "
                       "most riders shift to their lowest gear and stand on the pedals. "
                       "Describe, step by step, how the bicycle's gears change the effort "
                       "needed to climb that hill, and why riders shift before the slope.")
    assert len(p) > 2 * SETTINGS["n_ubatch"], len(p)
    ref, rows = generate_local(whole, p, max_tokens=N_TOKENS, logits=True)
    assert len(ref) > 8, ref  # a generation long enough to compare
    with Route(cluster.endpoints, relay=relay) as r:
        assert [tuple(s.layers) for s in r.stages] == LAYOUT, REPLAY
        # relay auto: every stage serves a data port, so the direct relay and decode loop run
        assert r.aroute.relay is (relay is None), REPLAY
        with r.session() as s:
            g = s.complete(p, max_tokens=N_TOKENS, logits=True)
            assert g.tokens == ref, (REPLAY, g.tokens, ref)
            assert len(g.logits) == len(rows), REPLAY
            bad = [i for i, (a, b) in enumerate(zip(g.logits, rows)) if a.tobytes() != b.tobytes()]
            assert not bad, f"{REPLAY}: logits of steps {bad} differ"
            # the fast path (token ids only, no logits) in the same session: a new epoch
            assert list(s.generate(p, max_tokens=N_TOKENS)) == ref, REPLAY
        assert [i.sessions for i in r.describe()] == [0] * len(LAYOUT), REPLAY

