"""dgr.testing.layouts: the random split layouts the parity tests draw (no model needed)."""

from __future__ import annotations

import pytest

from dgr.errors import InvalidArgument
from dgr.protocol.ranges import split_layers
from dgr.testing import layouts
from dgr.testing.layouts import SEED_ENV, layout_id, random_layouts, split_seed


def test_layouts_are_uneven_contiguous_covers():
    for seed in range(200):
        layouts = random_layouts(seed, 30, 4, min_stages=2, max_stages=5)
        assert len(layouts) == 4
        for ranges in layouts:
            assert 2 <= len(ranges) <= 5, (seed, ranges)
            assert ranges[0][0] == 0 and ranges[-1][1] == 30, (seed, ranges)
            assert all(a < b for a, b in ranges), (seed, ranges)
            assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:])), (seed, ranges)
            assert ranges != split_layers(30, len(ranges)), (seed, ranges)
        assert any(b - a == 1 for a, b in layouts[0]), (seed, layouts[0])


def test_the_one_layer_stage_lands_everywhere_and_sizes_vary():
    firsts = [random_layouts(s, 30, 1)[0] for s in range(600)]
    singles = {a for r in firsts for a, b in r if b - a == 1}
    assert singles == set(range(30))  # layer 0 (with the embeddings) and 29 (the head) too
    sizes = {len(r) for s in range(100) for r in random_layouts(s, 30, 3)}
    assert sizes == {2, 3, 4, 5}


def test_same_seed_same_layouts_and_streams_are_independent():
    assert random_layouts(7, 30, 3) == random_layouts(7, 30, 3)
    assert random_layouts(7, 30, 5)[:3] == random_layouts(7, 30, 3)  # drawn one after another
    draws = {layout_id(random_layouts(s, 30, 1)[0]) for s in range(50)}
    assert len(draws) > 40  # different seeds, different layouts
    same_seed = [(random_layouts(s, 30, 2), random_layouts(s, 30, 2, stream="routes"))
                 for s in range(20)]
    assert sum(a != b for a, b in same_seed) >= 19


def test_at_most_two_stages_puts_the_one_layer_stage_at_an_end():
    for s in range(100):
        (ranges,) = random_layouts(s, 30, 1, min_stages=2, max_stages=2)
        assert ranges in ([(0, 1), (1, 30)], [(0, 29), (29, 30)]), ranges


@pytest.mark.parametrize("kw", [dict(n_layer=30, count=0), dict(n_layer=4, max_stages=4),
                                dict(n_layer=30, min_stages=1), dict(n_layer=30, min_stages=4,
                                                                     max_stages=3)])
def test_impossible_requests(kw):
    kw = {"seed": 1, "count": 2, **kw}
    with pytest.raises(InvalidArgument):
        random_layouts(**kw)


def test_seed_from_the_environment(monkeypatch):
    monkeypatch.setenv(SEED_ENV, "12345")
    assert split_seed() == 12345
    monkeypatch.setenv(SEED_ENV, "0x10")
    assert split_seed() == 16
    monkeypatch.setenv(SEED_ENV, "twelve")
    with pytest.raises(InvalidArgument, match=SEED_ENV):
        split_seed()
    monkeypatch.delenv(SEED_ENV)
    # unset: one random seed for the whole process (every module of a run shares it)
    assert split_seed() == split_seed() and 0 <= split_seed() < 2**32
    monkeypatch.setattr(layouts, "_drawn", {})
    seeds = set()
    for _ in range(8):
        layouts._drawn.clear()
        seeds.add(split_seed())
    assert len(seeds) > 1  # a new process draws a new seed


def test_layout_id():
    assert layout_id([(0, 4), (4, 5), (5, 30)]) == "0:4-4:5-5:30"
