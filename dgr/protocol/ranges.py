"""Layer ranges: how a model's layers split into the contiguous ranges of a route's stages."""

from __future__ import annotations

from typing import Sequence

from dgr.errors import InvalidLayerRange

__all__ = ["split_layers", "parse_splits", "ranges_for"]


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
