"""CellOffsets: a dataset's CSR offsets in 2.25 or 4 bytes a cell, indexed like the int64 array."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from slafload.data.offsets import BLOCK, NARROW_BLOCK, CellOffsets


def offsets(n: int, rng: np.random.Generator, high: int = 3_000) -> np.ndarray:
    counts = rng.integers(0, high, n - 1)
    counts[rng.random(n - 1) < 0.2] = 0  # empty cells: equal offsets, across blocks too
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


@pytest.mark.parametrize("high", [200, 8_000])  # narrow (uint16) and wide (uint32) offsets
@pytest.mark.parametrize("n", [1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17])
def test_it_indexes_like_the_int64_array(n, high):
    rng = np.random.default_rng(n)
    full = offsets(n, rng, high)
    cuts = np.unique(np.concatenate([[0, n], rng.integers(0, n, 6)]))  # parts of any length
    compact = CellOffsets.build([full[a:b] for a, b in itertools.pairwise(cuts)], n)
    narrow = n < NARROW_BLOCK or high == 200  # 32 cells of up to 200 rows fit 16 bits
    assert compact.width == (2 if narrow else 4)
    if narrow:
        assert len(compact) == n and compact.nbytes <= 2 * n + 8 * (n // NARROW_BLOCK + 1)
    else:
        assert len(compact) == n and compact.nbytes <= 4 * n + 8 * (n // BLOCK + 1)
    np.testing.assert_array_equal(np.asarray(compact), full)
    for i in [0, n - 1, -1, -n, n // 2]:
        assert compact[i] == full[i] and isinstance(compact[i], int)
    picks = rng.integers(-n, n, (9, 2))  # a fetch's ranges are [k, 2]; negatives count back
    np.testing.assert_array_equal(compact[picks], full[picks])
    assert compact[picks].dtype == np.int64
    for part in [slice(None), slice(3, 100), slice(n - 5, None), slice(0, n, 7), slice(5, 2)]:
        np.testing.assert_array_equal(compact[part], full[part])
    for bad in [n, -n - 1, np.array([n]), np.array([-n - 1]), np.array([0.5]), True]:
        with pytest.raises(IndexError):
            compact[bad]
    assert compact[[]].shape == (0,) and compact[np.array([], np.int64)].dtype == np.int64
    values = np.concatenate([full[rng.integers(0, n, 30)], full[rng.integers(0, n, 30)] + 1,
                             [-1, 0, full[-1], full[-1] + 5]])  # fmt: skip
    for side in ("left", "right"):
        np.testing.assert_array_equal(
            compact.searchsorted(values, side), np.searchsorted(full, values, side)
        )


@pytest.mark.parametrize("where", [5, NARROW_BLOCK + 1, BLOCK + 3, 3 * BLOCK - 1])
def test_a_block_too_wide_for_16_bits_widens_what_was_built(where):
    """The first 32-cell block spanning 65,536 rows comes in a later part than the narrow ones
    before them (just after a block's start, inside one, or at the last offset): everything
    is kept in the uint32 form, and reads the same.
    """
    n = 3 * BLOCK
    counts = np.full(n - 1, 3, dtype=np.int64)
    counts[where - 1] = 70_000  # cell `where - 1` alone overflows its 32-cell block
    full = np.concatenate([[0], np.cumsum(counts)])
    cuts = [0, where - 1, where + 2, n] if where > 1 else [0, where + 2, n]
    parts = [full[a:b] for a, b in itertools.pairwise(sorted(set(cuts))) if b > a]
    compact = CellOffsets.build(parts, n)
    assert compact.width == 4
    np.testing.assert_array_equal(np.asarray(compact), full)
    np.testing.assert_array_equal(
        compact[[where - 1, where, n - 1]], full[[where - 1, where, n - 1]]
    )
    assert CellOffsets.build([full[: where - 1]], where - 1).width == 2  # narrow before it


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


def test_a_mixtures_global_offsets_index_like_the_concatenated_array():
    from slafload.data.sources import GlobalOffsets
    from slafload.pipeline.budget import groups
    from slafload.types import Fetch

    rng = np.random.default_rng(5)
    parts = [offsets(n, rng) for n in (BLOCK + 3, 7, 2 * BLOCK)]
    first = np.concatenate([[0], np.cumsum([len(p) - 1 for p in parts])])  # global cell ids
    rows = np.concatenate([[0], np.cumsum([p[-1] for p in parts])])
    full = np.concatenate([p[:-1] + r for p, r in zip(parts, rows, strict=False)] + [rows[-1:]])
    mixed = GlobalOffsets(first, [CellOffsets.of(p) for p in parts])
    assert len(mixed) == len(full)
    picks = rng.integers(0, len(full), (50, 2))
    np.testing.assert_array_equal(mixed[picks], full[picks])
    for i in [0, BLOCK + 2, BLOCK + 3, len(full) - 1, -1]:
        assert mixed[i] == full[i]
    np.testing.assert_array_equal(mixed[10 : BLOCK + 9], full[10 : BLOCK + 9])
    # The budget cuts a large range at cell boundaries by slicing the offsets (a mixture's
    # large fetch, or a small memory_budget): the same groups as the plain array gives.
    fetch = Fetch(0, np.array([[5, BLOCK + 8], [BLOCK + 20, BLOCK + 900]]), None)
    want = groups(fetch, full, width=8, max_bytes=8 * 3 * 100_000, max_gap=0)
    got = groups(fetch, mixed, width=8, max_bytes=8 * 3 * 100_000, max_gap=0)
    assert len(got) == len(want) > 2
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.ranges, b.ranges)
