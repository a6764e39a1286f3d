"""Batcher: fixed-size batches across chunk boundaries, short or dropped last batch."""

from __future__ import annotations

import numpy as np
import pytest

from slafload.batcher import Batcher


def feed(batcher, sizes):
    out, start = [], 0
    for n in sizes:
        ids = np.arange(start, start + n)
        out += list(batcher.add({"id": ids, "x": np.stack([ids, ids], axis=1)}))
        start += n
    return out + list(batcher.finish())


@pytest.mark.parametrize("sizes", [[10], [3, 3, 3, 1], [0, 7, 0, 3], [25]])
def test_rows_carry_over_chunk_boundaries_in_order(sizes):
    batches = feed(Batcher(4), sizes)
    lengths = [len(b["id"]) for b in batches]
    total = sum(sizes)
    assert lengths == [4] * (total // 4) + ([total % 4] if total % 4 else [])
    np.testing.assert_array_equal(np.concatenate([b["id"] for b in batches]), np.arange(total))
    for b in batches:
        np.testing.assert_array_equal(b["x"][:, 0], b["id"])


def test_drop_last_drops_only_the_short_tail_and_resets():
    batcher = Batcher(4, drop_last=True)
    assert [len(b["id"]) for b in feed(batcher, [6, 5])] == [4, 4]
    assert [len(b["id"]) for b in feed(batcher, [4])] == [4]


def test_unequal_columns_and_bad_batch_size_are_rejected():
    with pytest.raises(ValueError, match="equal lengths"):
        list(Batcher(2).add({"a": np.zeros(3), "b": np.zeros(2)}))
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        Batcher(0)
