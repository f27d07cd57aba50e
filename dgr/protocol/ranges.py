"""Layer ranges: how a model's layers split into the contiguous ranges of a route's stages."""

from __future__ import annotations

from typing import Sequence

from dgr.errors import InvalidLayerRange

__all__ = ["split_layers", "balance_layers", "balance_stages", "parse_splits", "ranges_for"]


def split_layers(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges covering ``[0, n_layer)``, as even as possible (earlier stages larger)."""
    if not 1 <= n_stages <= n_layer:
        raise InvalidLayerRange(f"cannot split {n_layer} layers into {n_stages} stages")
    base, extra = divmod(n_layer, n_stages)
    out, a = [], 0
    for i in range(n_stages):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


def balance_layers(costs: Sequence[float], n_stages: int, last: float = 0.0
                   ) -> list[tuple[int, int]]:
    """Contiguous ranges covering every layer whose costliest stage costs least: ``costs[i]``
    is layer ``i``'s cost per token, ``last`` what the last stage adds (the output head).

    A route's throughput is its slowest stage's, so an even split by layer count loses where
    the head weighs as several layers (SmolLM2's tied 49k-vocabulary head is as large as 8
    of its 30 layers). Of the splits as costly, the one nearest to even is taken.
    """
    if not 1 <= n_stages <= len(costs):
        raise InvalidLayerRange(f"cannot split {len(costs)} layers into {n_stages} stages")
    c = [float(x) for x in costs]
    if c:
        c[-1] += float(last)  # the head is always the last layer's stage's
    return balance_stages([c] * n_stages)


def balance_stages(stage_costs: Sequence[Sequence[float]],
                   overheads: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """:func:`balance_layers` where each stage has costs of its own: ``stage_costs[s][i]`` is
    layer ``i``'s cost on stage ``s``'s machine (its first layer's holding the embedding, its
    last the head: they go wherever layer 0 and the last layer go), ``overheads[s]`` what a
    forward costs stage ``s`` whatever its layers. A route across machines of different
    speeds gives the faster ones more layers. Of the splits as costly, the one nearest to
    even is taken (ties: the earlier stages larger)."""
    n_stages = len(stage_costs)
    n = len(stage_costs[0]) if stage_costs else 0
    if not 1 <= n_stages <= n:
        raise InvalidLayerRange(f"cannot split {n} layers into {n_stages} stages")
    if any(len(c) != n for c in stage_costs):
        raise ValueError("every stage's costs must name the same layers")
    over = [0.0] * n_stages if overheads is None else [float(o) for o in overheads]
    pres = []
    for costs in stage_costs:
        pre = [0.0]
        for c in costs:
            pre.append(pre[-1] + float(c))
        pres.append(pre)

    # best[s][b]: (costliest stage, sum of squared stage sizes) of layers [0, b) in s stages
    inf = (float("inf"), 0)
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0.0, 0)
    for s in range(1, n_stages + 1):
        pre, o = pres[s - 1], over[s - 1]
        for b in range(s, n + 1):
            for a in range(s - 1, b):
                prev = best[s - 1][a]
                if prev[0] == float("inf"):
                    continue
                cand = (max(prev[0], round(pre[b] - pre[a] + o, 9)), prev[1] + (b - a) ** 2)
                if cand <= best[s][b]:  # ties: the earlier stages larger, as split_layers
                    best[s][b], cut[s][b] = cand, a
    out, b = [], n
    for s in range(n_stages, 0, -1):
        a = cut[s][b]
        out.append((a, b))
        b = a
    return out[::-1]


def parse_splits(points: Sequence[int], n_layer: int) -> list[tuple[int, int]]:
    """Ranges from interior split points, e.g. ``[10, 20]`` of 30 layers -> 3 stages."""
    pts = [0, *sorted(int(p) for p in points), n_layer]
    if any(b <= a for a, b in zip(pts, pts[1:])) or pts[1] <= 0 or pts[-2] >= n_layer:
        raise InvalidLayerRange(f"split points {list(points)} must be distinct and inside "
                                f"(0, {n_layer})")
    return list(zip(pts, pts[1:]))


def ranges_for(splits: str | None, stages: int, n_layer: int) -> list[tuple[int, int]]:
    """The stage ranges a command line asks for: at the interior split points of ``splits``
    (``"10,20"``; empty items ignored) when given, else ``stages`` even ranges."""
    if not splits:
        return split_layers(n_layer, stages)
    try:
        points = [int(x) for x in splits.split(",") if x.strip()]
    except ValueError:
        raise InvalidLayerRange(f"split points must be integers, e.g. 10,20; got {splits!r}") \
            from None
    return parse_splits(points, n_layer)
