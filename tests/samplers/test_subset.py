"""Subset: any sampler restricted to chosen cells, mapped back to real cell ranges."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from conftest import random_counts, write_dense

from slafload import Loader, open_dataset
from slafload.samplers import BlockShuffle, ChunkShuffle, Streaming, Subset


def plan_cells(plan) -> np.ndarray:
    return np.concatenate([f.cell_ids() for f in plan])


SAMPLERS = [Streaming(chunk_cells=7), ChunkShuffle(chunk_cells=5),
            BlockShuffle(block_size=3, fetch_factor=2, batch_size=4)]  # fmt: skip


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_subset_cell_is_planned_once_and_no_other_cell(sampler):
    rng = np.random.default_rng(0)
    ids = np.unique(np.concatenate([rng.choice(1000, 150, replace=False), np.arange(500, 560)]))
    plan = Subset(sampler, rng.permutation(ids)).plan(1000, seed=2, epoch=1)
    np.testing.assert_array_equal(np.sort(plan_cells(plan)), ids)
    assert plan.n_cells == len(ids)
    np.testing.assert_array_equal(plan.fetch_sizes(), [f.n_cells for f in plan])
    for fetch in plan:
        assert (fetch.ranges[:, 1] > fetch.ranges[:, 0]).all()


def test_position_ranges_split_at_gaps_and_keep_the_inner_order():
    subset = Subset(Streaming(chunk_cells=4), [0, 1, 2, 5, 6, 9, 10, 11])
    plan = subset.plan(12, seed=0, epoch=0)
    assert [f.ranges.tolist() for f in plan] == [[[0, 3], [5, 6]], [[6, 7], [9, 12]]]
    inner = BlockShuffle(block_size=2, fetch_factor=1, batch_size=8).plan(8, seed=3, epoch=0)
    mapped = Subset(BlockShuffle(block_size=2, fetch_factor=1, batch_size=8), subset.cell_ids())
    outer = mapped.plan(12, seed=3, epoch=0)
    np.testing.assert_array_equal(subset.cell_ids()[plan_cells(inner)], plan_cells(outer))
    assert [f.shuffle_seed for f in inner] == [f.shuffle_seed for f in outer]


def test_a_contiguous_subset_is_stored_as_one_run():
    subset = Subset(Streaming(), np.arange(10**6, 3 * 10**6))
    assert "in 1 runs" in repr(subset) and subset.n_cells == 2 * 10**6
    assert repr(Subset(Streaming(), [1, 2, 5])) != repr(Subset(Streaming(), [1, 2, 6]))


def test_subset_ids_are_validated():
    with pytest.raises(ValueError, match="only 10 cells"):
        Subset(Streaming(), [3, 10]).plan(10, seed=0, epoch=0)
    with pytest.raises(ValueError, match="non-negative"):
        Subset(Streaming(), [-1, 2])
    with pytest.raises(ValueError, match="integers"):
        Subset(Streaming(), [0.5])
    with pytest.raises(TypeError, match="plan"):
        Subset(object(), [1])


def test_an_obs_predicate_selects_cells_and_the_loader_honours_it(tmp_path):
    dense = random_counts(120, 12, seed=3, empty_every=13)
    plates = np.repeat([f"plate_{p:02d}" for p in range(4)], 30)
    path = write_dense(tmp_path / "s.slaf", dense, obs={"plate": pa.array(plates)})
    ds = open_dataset(path)
    subset = Subset.where(
        BlockShuffle(block_size=4, batch_size=8), ds, pl.col("plate") != "plate_02"
    )
    np.testing.assert_array_equal(subset.cell_ids(), np.flatnonzero(plates != "plate_02"))
    with Loader(ds, sampler=subset, batch_size=8, max_genes=6, obs_columns=["plate"]) as loader:
        batches = list(loader)
    cells = np.concatenate([b["cell_integer_id"].numpy() for b in batches])
    np.testing.assert_array_equal(np.sort(cells), np.flatnonzero(plates != "plate_02"))
    codes = np.concatenate([b["plate"].numpy() for b in batches])
    assert "plate_02" not in {loader.obs_categories["plate"][c] for c in codes}
