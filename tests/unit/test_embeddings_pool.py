"""dgr.protocol.embeddings.pool: mean, last and first row, unit length, float32; bad kinds and
shapes refused."""

from __future__ import annotations

import numpy as np
import pytest

from dgr.protocol.embeddings import pool

ROWS = np.array([[3.0, 4.0], [0.0, 2.0], [6.0, 8.0]], dtype=np.float32)


def test_each_kind_and_unit_length():
    assert pool(ROWS, "cls").tolist() == pytest.approx([0.6, 0.8])
    assert pool(ROWS, "last").tolist() == pytest.approx([0.6, 0.8])
    mean = np.array([3.0, 14 / 3])
    assert pool(ROWS, "mean").tolist() == pytest.approx((mean / np.linalg.norm(mean)).tolist())
    assert pool(ROWS, "mean", normalize=False).tolist() == pytest.approx([3.0, 14 / 3])
    assert pool(ROWS, "last", normalize=False).tolist() == [6.0, 8.0]
    assert pool(ROWS, "mean").dtype == np.float32
    assert pool(np.zeros((2, 3), np.float32), "mean").tolist() == [0, 0, 0]  # no division


@pytest.mark.parametrize("rows,kind", [(ROWS, "max"), (np.zeros((0, 2)), "mean"),
                                       (np.zeros(3), "last")])
def test_refusals(rows, kind):
    with pytest.raises(ValueError):
        pool(rows, kind)
