"""Batch-invariant kernels (``dgr.Engine(batch_invariant=True)``, ``--batch-invariant on``):
ggml's CPU reference kernels, whose rows do not depend on what else a forward computes. The
lane's batching and speculation checks measure far into a context too: there, by default, a
lone single-row step (two threads, 512 KV cells or more) is computed otherwise than the same
row batched with other sessions' or verified with drafts; with the invariant kernels it is
not."""

from __future__ import annotations

import pytest

import dgr
from dgr.control import batching, speculation
from dgr.protocol import settings as engine_settings

LONG = dict(n_ctx=2048, n_slots=4, n_threads=2, n_ubatch=32)


@pytest.mark.parametrize("invariant", [False, True])
def test_batching_and_speculation_are_measured_far_into_a_context(tiny_q8, invariant):
    e = dgr.Engine(tiny_q8, batch_invariant=invariant, **LONG)
    near_b, near_s = batching.measure(e), speculation.measure(e)
    far_b, far_s = batching.measure(e, far=1024), speculation.measure(e, far=1024)
    # near the start both are exact either way; far in, only with the invariant kernels
    assert near_b.bit_identical and near_s.bit_identical
    assert far_b.bit_identical is invariant and far_s.bit_identical is invariant
    assert far_b.rows == 2 * near_b.rows and far_s.rows == 2 * near_s.rows
    assert far_b.bit_identical == (far_b.max_abs_diff == 0.0)


def test_the_setting_is_a_numeric_setting_that_leaves_old_identities_alone():
    base = {k: v for k, v in engine_settings.DEFAULTS.items() if k != "device"}
    assert base["batch_invariant"] is False
    off = engine_settings.settings_tag(base)
    # a stage that leaves it off keeps the identity it had before the setting existed
    assert off == engine_settings.settings_tag(
        {k: v for k, v in base.items() if k != "batch_invariant"})
    assert engine_settings.settings_tag({**base, "batch_invariant": True}) == off + ".bi1"
    assert "batch_invariant" in engine_settings.NUMERIC_SETTINGS
    # records that outlive a build (lanes, capability) leave it out at its default
    assert "batch_invariant" not in engine_settings.canonical(base)
    assert engine_settings.canonical({**base, "batch_invariant": True})["batch_invariant"]
    assert engine_settings.to_argv({"batch_invariant": True}) == ["--batch-invariant", "on"]
    # an engine from before the setting (a stand-in) computes as its default does
    old = {k: v for k, v in base.items() if k != "batch_invariant"}
    assert engine_settings.complete(old) == base
    assert engine_settings.complete({**base, "batch_invariant": True})["batch_invariant"]


def test_a_route_refuses_stages_that_disagree_on_it(tiny_q8):
    from dgr.driver.route import Route
    from dgr.testing.stages import threaded_stages

    small = dict(n_ctx=256, n_slots=2, n_threads=1, n_ubatch=32)
    with threaded_stages(tiny_q8, [(0, 2)], small) as a, \
            threaded_stages(tiny_q8, [(2, 4)], {**small, "batch_invariant": True}) as b:
        with pytest.raises(dgr.errors.DgrError, match="batch_invariant"):
            with Route([w.address for w in a + b]):
                pass
