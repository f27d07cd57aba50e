"""Each layer's time measured on this machine, cached per machine, and the ranges it balances
(``dgr.control.layercost``, ``python -m dgr layer-costs``, ``--splits cost``)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from dgr import errors
from dgr.control import layercost
from dgr.protocol.ranges import split_layers


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DGR_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_each_layer_is_timed_once_per_machine_then_read_from_the_cache(tiny_llama, cache):
    c = layercost.measure(tiny_llama, batch=2, context=8, steps=3, warmup=1, progress=False)
    assert (c.n_layer, c.batch, c.context, c.cached) == (4, 2, 8, False)
    assert len(c.layer_ms) == len(c.single_ms) == 4 and all(ms > 0 for ms in c.layer_ms)
    assert c.overhead_ms >= 0 and c.chunk == (0, 4) and c.chunk_ms > 0
    # a layer's own cost is its engine's time less a forward's fixed cost
    for own, alone in zip(c.layer_ms, c.single_ms):
        assert own == pytest.approx(max(alone - c.overhead_ms, 0.01 * alone))
    assert c.stage_ms(0, 4) == pytest.approx(sum(c.layer_ms) + c.overhead_ms)
    assert c.machine["cpu_variant"] and c.machine["device"] == "cpu"
    # the same inputs on this machine: the figures as they were, not timed again
    again = layercost.measure(tiny_llama, batch=2, context=8, steps=3, warmup=1,
                              progress=False)
    assert again.cached and again == c
    other = layercost.measure(tiny_llama, batch=1, context=8, steps=3, warmup=1,
                              progress=False)
    assert not other.cached and other.batch == 1
    assert [(m.batch, m.cached) for m in layercost.cached(tiny_llama)] == [(1, True), (2, True)]
    # other settings are other figures; a changed file invalidates them
    assert layercost.cached(tiny_llama, {"n_threads": 2}) == []
    st = os.stat(tiny_llama)
    os.utime(tiny_llama, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        assert layercost.cached(tiny_llama) == []
    finally:
        os.utime(tiny_llama, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert len(list((cache / "layer-costs").glob("*.json"))) == 2


def test_the_plan_gives_a_slower_machine_fewer_layers(tiny_llama, cache):
    c = layercost.measure(tiny_llama, batch=1, context=8, steps=3, warmup=1, progress=False)
    # alike machines: layers every stage's measured cost balances (the even split when alike)
    even = dataclasses.replace(c, layer_ms=[1.0] * 4, overhead_ms=0.5)
    assert layercost.plan([even, even]) == split_layers(4, 2)
    slow = dataclasses.replace(even, layer_ms=[3.0] * 4)
    assert layercost.plan([even, slow]) == [(0, 3), (3, 4)]
    assert layercost.plan([slow, even]) == [(0, 1), (1, 4)]
    rr = layercost.plan([c, c])
    assert rr[0][0] == 0 and rr[-1][1] == 4 and rr[0][1] == rr[1][0]
    with pytest.raises(ValueError, match="different models"):
        layercost.plan([c, dataclasses.replace(c, n_layer=5, layer_ms=[1.0] * 5)])
    # --splits cost: the plan of the measurement at the default context (made once, then read)
    got = layercost.ranges_of("cost", 2, 4, tiny_llama, {})
    c64 = layercost.measure(tiny_llama, batch=1, progress=False)
    assert c64.cached and c64.context == 64 and got == layercost.plan([c64, c64])
    assert layercost.ranges_of("cost", 1, 4, tiny_llama, {}) == [(0, 4)]
    assert layercost.ranges_of("1", 2, 4, tiny_llama, {}) == [(0, 1), (1, 4)]
    assert layercost.ranges_of(None, 2, 4, tiny_llama, {}) == split_layers(4, 2)


def test_the_command_prints_the_layers_and_the_balanced_ranges(tiny_llama, cache, capsys):
    argv = ["--model", str(tiny_llama), "--batch", "2", "--context", "8", "--steps", "2",
            "--stages", "2,3"]
    assert layercost.main(argv) == 0
    out = capsys.readouterr().out
    assert "4 layers at batch 2 after 8 tokens" in out and "(with the head)" in out
    assert "2 stages, measured: [0," in out and "3 stages, even: [0,2) [2,3) [3,4)" in out
    assert layercost.main(argv) == 0 and "[cached]" in capsys.readouterr().out
    # the stage's slots and context are the measured engines': too few for the rows is refused
    assert layercost.main([*argv, "--slots", "1"]) == 2
    assert "needs 2 slots of 14 tokens; the settings give 1 of" in capsys.readouterr().err
    assert layercost.main(["--model", str(cache / "missing.gguf")]) == 2
    with pytest.raises(errors.InvalidArgument):
        layercost.measure(tiny_llama, batch=1, settings={"n_threads": 0}, progress=False)


def test_the_capability_record_carries_this_machines_figures(tiny_llama, cache, capsys):
    """A tracker balances a route across machines by each one's own figures: a worker
    advertises what was measured on its machine for its model and settings."""
    import dgr
    from dgr.control.capability import record_for
    from dgr.protocol import capability as schema

    e = dgr.Engine(tiny_llama, layers=(2, 4), n_ctx=128, n_slots=3, n_threads=1, n_ubatch=8)
    assert record_for(e).layer_times == []
    # measured by the command with the worker's settings
    assert layercost.main(["--model", str(tiny_llama), "--batch", "2", "--context", "8",
                           "--steps", "2", "--threads", "1", "--ubatch", "8", "--ctx", "128",
                           "--slots", "3"]) == 0
    capsys.readouterr()
    (c,) = layercost.cached(tiny_llama, {**e.settings, "device": e.device})
    rec = record_for(e)
    assert [(t.batch, t.context, t.layer_ms, t.overhead_ms) for t in rec.layer_times] == [
        (2, 8, c.layer_ms, c.overhead_ms)]
    assert len(rec.layer_times[0].layer_ms) == 4  # every layer's, not the stage's range only
    # another setting's figures are not this worker's
    layercost.measure(tiny_llama, batch=1, context=8, steps=2, warmup=1,
                      settings={**e.settings, "device": e.device, "n_ubatch": 16},
                      progress=False)
    assert len(record_for(e).layer_times) == 1
    # a later measurement with the worker's settings shows at the next record
    layercost.measure(tiny_llama, batch=3, context=8, steps=2, warmup=1,
                      settings={**e.settings, "device": e.device}, progress=False)
    assert [t.batch for t in record_for(e).layer_times] == [2, 3]
    assert schema.decode(schema.encode(rec)).layer_times == rec.layer_times
