"""A mixture's per-cell lookups by global cell id (source codes, ids within a source, obs)."""

from __future__ import annotations

import numpy as np
import pytest

from slafload.data.sources import CellColumn


@pytest.mark.parametrize(
    "sizes", [(5, 7), (4, 0, 6), (3,), (2, 9, 1, 5)], ids=["two", "empty", "one", "four"]
)
def test_source_codes_and_ids_within_sources_of_interleaved_cells(sizes):
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    cells = np.random.default_rng(0).permutation(int(offsets[-1]))
    expected_source = np.array([np.flatnonzero(offsets[1:] > c)[0] for c in cells])
    n = len(sizes)
    source = CellColumn(offsets, list(range(n)))[cells]
    ids = CellColumn(offsets, [None] * n)[cells]
    np.testing.assert_array_equal(source, expected_source)
    np.testing.assert_array_equal(ids, cells - offsets[expected_source])
    assert source.dtype == ids.dtype == np.int64
    obs = [np.arange(size) * 10 + k for k, size in enumerate(sizes)]
    mixed = CellColumn(offsets, [obs[0], *[-1] * (n - 1)])[cells]  # arrays and constants
    want = [obs[0][c] if k == 0 else -1 for c, k in zip(ids, expected_source, strict=True)]
    np.testing.assert_array_equal(mixed, want)
    assert CellColumn(offsets, list(range(n)))[cells[:0]].shape == (0,)
