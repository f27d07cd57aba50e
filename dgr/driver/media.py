"""A media step of a route session: an encoded image or audio chunk (``dgr.Media``) that the
first stage takes as embedding rows instead of token ids, with its positions (on an M-RoPE
model mtmd's (t, y, x, z) per row) and causality, which every stage takes (docs/media.md)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dgr import errors
from dgr.protocol import wire

__all__ = ["MediaStep"]


@dataclass(frozen=True, eq=False)
class MediaStep:
    """``rows``: float32 ``[n_rows, n_embd_inp]`` (``Media.encode``); ``positions``: int32
    ``[n_rows]`` (consecutive) or ``[wire.MROPE_SECTIONS, n_rows]`` (``Media.positions``);
    ``kind``: "image" or "audio"; ``causal``: False where the rows attend both ways
    (``Media.tokenize``'s ``non_causal``); ``id``: the media's SHA-256 (mtmd's bitmap id)."""

    rows: np.ndarray
    positions: np.ndarray
    kind: str = "image"
    causal: bool = True
    id: str = ""

    def __post_init__(self):
        rows = np.ascontiguousarray(self.rows, dtype=np.float32)
        pos = np.ascontiguousarray(self.positions, dtype=np.int32)
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "positions", pos)
        if self.kind not in wire.MEDIA or not self.kind:
            raise errors.InvalidArgument(f"a media step is an image or audio, not {self.kind!r}")
        if rows.ndim != 2 or not rows.shape[0]:
            raise errors.InvalidArgument(f"a media step's rows are [n_rows, width], got "
                                         f"{list(rows.shape)}")
        n = rows.shape[0]
        if pos.shape not in ((n,), (wire.MROPE_SECTIONS, n)):
            raise errors.InvalidPosition(
                f"{n} media rows take positions [{n}] or [{wire.MROPE_SECTIONS}, {n}], got "
                f"{list(pos.shape)}")
        if pos.ndim == 1 and np.any(np.diff(pos) != 1):
            raise errors.InvalidPosition("a media step's one-section positions are consecutive")

    @property
    def n_rows(self) -> int:
        return int(self.rows.shape[0])

    @property
    def first_pos(self) -> int:
        return int(self.positions.flat[0])

    @property
    def span(self) -> int:
        """The positions the step advances its session by (mtmd's ``n_pos``)."""
        return int(self.positions.max()) + 1 - self.first_pos

    def sections(self) -> list[int] | None:
        """``Forward.sections`` (section-major), or None for one position per row."""
        return [int(p) for p in self.positions.reshape(-1)] if self.positions.ndim == 2 else None
