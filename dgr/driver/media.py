"""A media step of a route session: an encoded image or audio chunk (``dgr.Media``) that the
first stage takes as embedding rows instead of token ids, with its positions (on an M-RoPE
model mtmd's (t, y, x, z) per row) and causality, which every stage takes (docs/media.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from dgr import errors
from dgr.protocol import wire

__all__ = ["MediaKey", "MediaRef", "MediaStep", "prompt_cells", "prompt_keys", "uncarried"]


class MediaKey(NamedTuple):
    """What ``AsyncRouteSession.history`` holds at the ``j``-th position a media step advances:
    its media's id (mtmd's bitmap id, the SHA-256 of the file's bytes) and ``j``. Equal keys at
    equal positions are the same rows, so a later prompt with the same image there reuses
    them (``AsyncRouteSession.reusable``) as it reuses equal token ids."""

    id: str
    j: int


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


@dataclass(frozen=True)
class MediaRef:
    """A media chunk of a prompt as the projector cut it, not encoded
    (``AsyncRoute.encode_media``'s ``encode_from``): its kind, id, rows, the positions it
    advances and its rows' width. Enough to say which positions a kept session may reuse (``prompt_keys``) and
    how many cache cells the prompt fills; a step to prefill needs its rows (``MediaStep``)."""

    kind: str
    id: str
    n_rows: int
    span: int
    causal: bool = True
    #: its rows' width (the first stage's ``n_embd_inp``; 0: not said)
    width: int = 0


def prompt_keys(chunks: Sequence) -> list:
    """Each position's key of a prompt's ``chunks`` (token id lists, ``MediaStep`` or
    ``MediaRef``): a text position's token id, a media position's ``MediaKey``, as
    ``AsyncRouteSession.history`` holds them."""
    out: list = []
    for c in chunks:
        if isinstance(c, (MediaStep, MediaRef)):
            out.extend(MediaKey(c.id, j) for j in range(c.span))
        else:
            out.extend(int(t) for t in c)
    return out


def prompt_cells(chunks: Sequence) -> int:
    """The cache cells a prompt's ``chunks`` fill on every stage: a token each, a media
    chunk's rows (an M-RoPE image advances fewer positions than it has rows)."""
    return sum(c.n_rows if isinstance(c, (MediaStep, MediaRef)) else len(c) for c in chunks)


def uncarried(stages: Sequence, width: int) -> str:
    """Why a route of ``stages`` cannot take media rows ``width`` wide ("" where it can).

    Rows wider than the boundary carry deepstack features (Qwen3-VL: ``n_embd * (1 + D)``,
    the slice ``d + 1`` added to layer ``d``'s output for ``d < D``). The first stage adds the
    ones of its own layers; a later stage would add zeros where the image's features belong
    (a seam does not carry them yet), so a split is refused unless the first stage owns every
    deepstack layer."""
    first = stages[0]
    n = int(first.boundary_width)
    if len(stages) == 1 or width <= n or width % n:
        return ""
    d = width // n - 1
    if int(first.layers[1]) >= d:
        return ""
    return (f"this model's media rows carry deepstack features for its first {d} layers "
            f"({width} = {d + 1} x {n} wide), and its first stage ends at layer "
            f"{first.layers[1]}: a seam does not carry them yet; split at layer {d} or later, "
            "or serve it on one stage")
