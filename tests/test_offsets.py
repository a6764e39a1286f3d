"""CellOffsets: a dataset's CSR offsets in 4 bytes a cell, indexed like the int64 array."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from slafload.offsets import BLOCK, CellOffsets


def offsets(n: int, rng: np.random.Generator, high: int = 3_000) -> np.ndarray:
    counts = rng.integers(0, high, n - 1)
    counts[rng.random(n - 1) < 0.2] = 0  # empty cells: equal offsets, across blocks too
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


@pytest.mark.parametrize("n", [1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17])
def test_it_indexes_like_the_int64_array(n):
    rng = np.random.default_rng(n)
    full = offsets(n, rng)
    cuts = np.unique(np.concatenate([[0, n], rng.integers(0, n, 6)]))  # parts of any length
    compact = CellOffsets.build([full[a:b] for a, b in itertools.pairwise(cuts)], n)
    assert len(compact) == n and compact.nbytes <= 4 * n + 8 * (n // BLOCK + 1)
    np.testing.assert_array_equal(np.asarray(compact), full)
    for i in [0, n - 1, -1, -n, n // 2]:
        assert compact[i] == full[i] and isinstance(compact[i], int)
    picks = rng.integers(-n, n, (9, 2))  # a fetch's ranges are [k, 2]; negatives count back
    np.testing.assert_array_equal(compact[picks], full[picks])
    assert compact[picks].dtype == np.int64
    for part in [slice(None), slice(3, 100), slice(n - 5, None), slice(0, n, 7), slice(5, 2)]:
        np.testing.assert_array_equal(compact[part], full[part])
    with pytest.raises(IndexError):
        compact[n]
    with pytest.raises(IndexError):
        compact[np.array([0.5])]
    values = np.concatenate([full[rng.integers(0, n, 30)], full[rng.integers(0, n, 30)] + 1,
                             [-1, 0, full[-1], full[-1] + 5]])  # fmt: skip
    for side in ("left", "right"):
        np.testing.assert_array_equal(
            compact.searchsorted(values, side), np.searchsorted(full, values, side)
        )


def test_blocks_of_more_than_2_32_rows_keep_int64():
    full = np.array([0, 3, 2**33, 2**33, 2**34 + 1], dtype=np.int64)
    compact = CellOffsets.of(full)
    np.testing.assert_array_equal(np.asarray(compact), full)
    assert compact[2] == 2**33


def test_decreasing_or_miscounted_offsets_are_refused():
    with pytest.raises(ValueError, match="decrease"):
        CellOffsets.of([0, 5, 4])
    with pytest.raises(ValueError, match="expected"):
        CellOffsets.build([np.arange(3)], 4)
    with pytest.raises(ValueError, match="more than"):
        CellOffsets.build([np.arange(3), np.arange(3, 6)], 4)
