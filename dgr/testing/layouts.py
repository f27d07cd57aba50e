"""Random layer-split layouts for parity tests: different each run, seeded, replayable.

``split_seed()`` reads the seed from ``$DGR_SPLIT_SEED`` (to replay a failure) or draws a
fresh one; ``random_layouts(seed, n_layer, count)`` turns it into layouts. Tests put the seed
in their ids and assertion messages, so a failing layout can be run again with
``DGR_SPLIT_SEED=<seed> python -m pytest ...``.
"""

from __future__ import annotations

import os
import random

from dgr.errors import InvalidArgument
from dgr.protocol.ranges import split_layers

__all__ = ["SEED_ENV", "split_seed", "random_layouts", "layout_id"]

#: environment variable that fixes the seed (unset: a new random seed per run)
SEED_ENV = "DGR_SPLIT_SEED"


_drawn: dict[str, int] = {}


def split_seed(env: str = SEED_ENV) -> int:
    """The seed in ``$env`` (an integer), else a random one drawn once per process (so
    every test module of one pytest run uses the same seed, and one replay repeats all)."""
    text = os.environ.get(env, "").strip()
    if text:
        try:
            return int(text, 0)
        except ValueError:
            raise InvalidArgument(f"${env} must be an integer, got {text!r}") from None
    if env not in _drawn:
        _drawn[env] = random.SystemRandom().randrange(2**32)
    return _drawn[env]


def _ranges(cuts: set[int], n_layer: int) -> list[tuple[int, int]]:
    pts = [0, *sorted(cuts), n_layer]
    return list(zip(pts, pts[1:]))


def random_layouts(seed: int, n_layer: int, count: int, *, min_stages: int = 2,
                   max_stages: int = 5, stream: str = "") -> list[list[tuple[int, int]]]:
    """``count`` uneven layouts of ``[0, n_layer)``, each of ``min_stages..max_stages``
    contiguous stages, drawn from ``seed`` (and ``stream``, which gives a caller its own
    independent draw from the same seed).

    The first layout always has a stage of exactly one layer (anywhere, the first or last
    layer included); every layout differs from the even split of its stage count
    (``dgr.protocol.ranges.split_layers``), which the fixed parity tests cover already. The same
    arguments give the same layouts on every machine and Python version.
    """
    if not 2 <= min_stages <= max_stages < n_layer or count < 1:
        # (n_layer stages of one layer each are the even split: never uneven)
        raise InvalidArgument(f"cannot draw {count} uneven layouts of {min_stages}.."
                              f"{max_stages} stages over {n_layer} layers")
    rng = random.Random(f"dgr-split-layouts:{seed}:{stream}")  # str seeds hash with sha512
    out: list[list[tuple[int, int]]] = []
    while len(out) < count:
        k = rng.randint(min_stages, max_stages)
        cuts: set[int] = set()
        if not out:  # a one-layer stage [l, l + 1)
            # in the middle it takes 3 stages; with at most 2, at an end
            layer = rng.randrange(n_layer) if max_stages > 2 else rng.choice((0, n_layer - 1))
            cuts |= {c for c in (layer, layer + 1) if 0 < c < n_layer}
            k = max(k, len(cuts) + 1)
        while len(cuts) < k - 1:
            cuts.add(rng.randrange(1, n_layer))
        ranges = _ranges(cuts, n_layer)
        if ranges == split_layers(n_layer, len(ranges)):
            continue  # even: draw again
        out.append(ranges)
    return out


def layout_id(ranges) -> str:
    """``[(0, 4), (4, 30)]`` -> ``"0:4-4:30"`` (for test ids)."""
    return "-".join(f"{a}:{b}" for a, b in ranges)
