"""``n_ctx=0`` (``--ctx 0``, the worker's, serve's and run's default): the model's trained
context, capped by a measured KV budget; and a cache's size leaves every row's bits alone."""

from __future__ import annotations

import numpy as np
import pytest

import dgr
from dgr import errors
from dgr.testing.fixtures import TinyLlama, write_tiny_llama


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """The tiny llama trained (as its header says) for 32768 tokens."""
    return write_tiny_llama(tmp_path_factory.mktemp("ctx") / "tiny-32k.gguf",
                            TinyLlama(n_ctx_train=32768))


def test_ctx_0_is_the_trained_context_and_says_so(long_llama):
    e = dgr.Engine(long_llama, n_ctx=0, n_slots=2)
    d = e.describe()
    assert e.n_ctx == d["n_ctx"] == d["n_ctx_train"] == 32768
    assert d["n_ctx_alloc"] >= 32768
    assert "trained context" in d["n_ctx_source"] and "32768" in d["n_ctx_source"]
    assert e.settings["n_ctx"] == 0  # the identity spells it as asked
    assert dgr.Engine(long_llama, n_ctx=512).describe()["n_ctx_source"] == "set"


def test_the_kv_budget_caps_the_context_by_the_stages_own_layers(long_llama):
    # the tiny llama's KV: 4 layers x (K + V) x 2 heads x 16 dims x f16 = 512 bytes a token
    whole = dgr.Engine(long_llama, n_ctx=0, n_slots=2, kv_budget_mib=8)
    assert whole.n_ctx == 8 * 2**20 // (512 * 2)  # 8192: a multiple of 256
    assert "KV budget" in whole.describe()["n_ctx_source"]
    assert whole.describe()["kv_bytes"] <= 8 * 2**20
    # a stage of one layer of four holds four times the tokens in the same budget, up to the
    # trained context
    stage = dgr.Engine(long_llama, layers=(3, 4), n_ctx=0, n_slots=2, kv_budget_mib=8)
    assert stage.n_ctx == 32768
    half = dgr.Engine(long_llama, layers=(2, 4), n_ctx=0, n_slots=2, kv_budget_mib=8)
    assert half.n_ctx == 2 * whole.n_ctx


def test_a_budget_that_holds_too_little_is_refused_by_name(long_llama):
    with pytest.raises(errors.DeviceOutOfMemory, match=r"more than the 0\.1 MiB budget|budget"):
        dgr.Engine(long_llama, n_ctx=0, n_slots=256, n_ubatch=256, kv_budget_mib=1)
    with pytest.raises(errors.InvalidArgument, match="n_ctx=0 only"):
        dgr.Engine(long_llama, n_ctx=512, kv_budget_mib=64)
    with pytest.raises(errors.InvalidArgument, match="kv_budget_mib"):
        dgr.Engine(long_llama, n_ctx=0, kv_budget_mib=-1)


def _run(engine, tokens, steps):
    """Prompt rows (every row's logits) and greedy decode steps' logits."""
    rows = [np.array(engine.forward(0, 0, tokens=tokens, logits="all"), copy=True)]
    pos, tok = len(tokens), int(np.argmax(rows[0][-1]))
    for _ in range(steps):
        out = np.array(engine.forward(0, pos, tokens=[tok]), copy=True)
        rows.append(out)
        pos, tok = pos + 1, int(np.argmax(out[-1]))
    return rows


@pytest.mark.parametrize("fa", [True, False])
def test_a_larger_cache_leaves_the_bits_alone(long_llama, fa):
    """What makes ``--ctx 0`` safe to spell as asked in the identity: llama.cpp attends over
    the cells in use (padded to 256), not the cache's size, so a session computes the same
    bits in a 512-token cache and in a 32k one, at lengths on both sides of 256 and 512."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 128, size=470, dtype=np.int32)
    small = dgr.Engine(long_llama, n_ctx=512, n_threads=2, flash_attn=fa)
    large = dgr.Engine(long_llama, n_ctx=0, n_threads=2, flash_attn=fa)
    assert large.n_ctx == 32768
    a, b = _run(small, tokens, 30), _run(large, tokens, 30)
    for x, y in zip(a, b):
        assert x.tobytes() == y.tobytes()


def test_a_route_holds_the_smallest_of_its_stages_contexts(long_llama):
    from dgr.driver.route import Route
    from dgr.testing.stages import threaded_stages

    # the second stage's budget holds 2048 tokens of its two layers: the route holds those
    with threaded_stages(long_llama, [(0, 2)], dict(n_ctx=0, n_slots=1)) as a, \
            threaded_stages(long_llama, [(2, 4)], dict(n_ctx=0, n_slots=1, kv_budget_mib=1)) as b:
        with Route([w.address for w in a + b]) as route:
            infos = route.describe()
            assert [i.n_ctx for i in infos] == [32768, 4096]
            assert all(i.n_ctx_train == 32768 for i in infos)
            assert "trained context" in infos[0].n_ctx_source
            assert "KV budget" in infos[1].n_ctx_source
            assert route.n_ctx == 4096
            assert route.settings["n_ctx"] == 0
            session = route.session()
            with pytest.raises(errors.ContextFull):
                list(session.generate(list(range(1, 100)) * 42, max_tokens=1))  # 4158 tokens
            session.close()
