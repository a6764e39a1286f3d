"""Samplers: plans are pure, deterministic index arithmetic covering each cell once."""

from __future__ import annotations

import numpy as np
import pytest

from slafload.samplers import ChunkShuffle, Fetch, Sampler, Streaming


def plan_cells(plan) -> np.ndarray:
    return np.concatenate([f.cell_ids() for f in plan])


@pytest.mark.parametrize(
    "sampler",
    [Streaming(chunk_cells=7), ChunkShuffle(chunk_cells=7), ChunkShuffle(chunk_cells=1000)],
)
@pytest.mark.parametrize("n_cells", [1, 7, 50, 101])
def test_every_cell_is_planned_exactly_once(sampler, n_cells):
    plan = sampler.plan(n_cells, seed=3, epoch=2)
    assert isinstance(sampler, Sampler)
    np.testing.assert_array_equal(np.sort(plan_cells(plan)), np.arange(n_cells))
    assert plan.n_cells == n_cells == sum(f.n_cells for f in plan)


def test_streaming_keeps_storage_order_and_never_shuffles():
    plan = Streaming(chunk_cells=10).plan(35, seed=0, epoch=0)
    np.testing.assert_array_equal(plan_cells(plan), np.arange(35))
    assert [f.shuffle_seed for f in plan] == [None] * 4


def test_chunk_shuffle_is_deterministic_and_changes_with_seed_and_epoch():
    s = ChunkShuffle(chunk_cells=5)

    def key(seed, epoch):
        plan = s.plan(100, seed=seed, epoch=epoch)
        return plan_cells(plan).tolist(), [f.shuffle_seed for f in plan]

    assert key(0, 0) == key(0, 0)
    assert key(0, 0) != key(0, 1)
    assert key(0, 0) != key(1, 0)
    assert len(set(key(0, 0)[1])) == 20  # each chunk shuffles with its own seed


def test_fetch_lists_cells_of_all_its_ranges_in_order():
    fetch = Fetch(3, np.array([[10, 13], [2, 4], [20, 21]]))
    np.testing.assert_array_equal(fetch.cell_ids(), [10, 11, 12, 2, 3, 20])
    assert fetch.n_cells == 6
    assert "Fetch(index=3, cells=6" in repr(fetch)


def test_plans_support_indexing_and_slicing():
    plan = Streaming(chunk_cells=10).plan(35, seed=0, epoch=0)
    assert len(plan) == 4 and plan[-1].n_cells == 5
    assert [f.index for f in plan[1:3]] == [1, 2]
    with pytest.raises(IndexError):
        plan[4]


def test_chunk_cells_is_validated():
    with pytest.raises(ValueError, match="chunk_cells must be a positive integer"):
        ChunkShuffle(chunk_cells=0)
