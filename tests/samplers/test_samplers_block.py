"""BlockShuffle: scDataset block sampling with a fetch factor, planned in O(1) memory."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from conftest import random_counts, write_dense

from slafload import Loader
from slafload.samplers import BlockShuffle, Sampler, Subset, Weighted


def plan_cells(plan) -> np.ndarray:
    return np.concatenate([f.cell_ids() for f in plan])


@pytest.mark.parametrize("block_size", [1, 3, 16, 1000])
@pytest.mark.parametrize("fetch_factor", [1, 4])
@pytest.mark.parametrize("n_cells", [1, 15, 16, 17, 257])
def test_every_cell_is_planned_exactly_once(block_size, fetch_factor, n_cells):
    sampler = BlockShuffle(block_size=block_size, fetch_factor=fetch_factor, batch_size=4)
    assert isinstance(sampler, Sampler)
    plan = sampler.plan(n_cells, seed=1, epoch=0)
    np.testing.assert_array_equal(np.sort(plan_cells(plan)), np.arange(n_cells))
    assert plan.n_cells == n_cells == sum(f.n_cells for f in plan)


def test_each_fetch_holds_whole_blocks_sorted_with_neighbours_merged():
    plan = BlockShuffle(block_size=4, fetch_factor=2, batch_size=8).plan(1000, seed=0, epoch=0)
    assert len(plan) == 250 // 4 + 1  # 4 blocks (2 minibatches of 8) per fetch
    for fetch in plan:
        starts, stops = fetch.ranges[:, 0], fetch.ranges[:, 1]
        assert (starts % 4 == 0).all() and ((stops % 4 == 0) | (stops == 1000)).all()
        assert (starts[1:] > stops[:-1]).all()  # sorted, and touching blocks were merged
    assert plan[-1].n_cells == 8  # 250 blocks: the last fetch has the 2 left over


def test_the_same_seed_repeats_and_seeds_and_epochs_differ():
    sampler = BlockShuffle(block_size=2, fetch_factor=2, batch_size=4)

    def key(seed, epoch):
        plan = sampler.plan(200, seed=seed, epoch=epoch)
        return plan_cells(plan).tolist(), [f.shuffle_seed for f in plan]

    assert key(0, 0) == key(0, 0)
    assert key(0, 0)[0] != key(0, 1)[0] and key(0, 0)[0] != key(1, 0)[0]
    assert key(0, 0)[1] != key(0, 1)[1]
    assert len(set(key(0, 0)[1])) == 25  # every fetch shuffles with its own seed


def test_block_size_one_samples_cells_from_the_whole_dataset():
    plan = BlockShuffle(block_size=1, fetch_factor=1, batch_size=100).plan(10_000, seed=0, epoch=0)
    first = plan[0].cell_ids()
    assert len(first) == 100 and first.max() - first.min() > 9000
    assert np.histogram(first, bins=10, range=(0, 10_000))[0].min() >= 3


def test_a_100m_cell_plan_starts_without_a_per_cell_or_per_block_array():
    sampler = BlockShuffle(block_size=1, fetch_factor=64, batch_size=32)
    tracemalloc.start()
    try:
        plan = sampler.plan(100_000_000, seed=0, epoch=0)
        first = plan[0]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first.n_cells == 2048 and len(plan) == -(-100_000_000 // 2048)
    assert plan.n_cells == 100_000_000
    assert peak < 2_000_000  # bytes; an index array of 100M cells would be 800 MB


@pytest.mark.parametrize("kwargs", [{"block_size": 0}, {"fetch_factor": -1}, {"batch_size": 1.5}])
def test_arguments_are_validated(kwargs):
    with pytest.raises(ValueError, match="must be a positive integer"):
        BlockShuffle(**kwargs)


def test_the_loader_delivers_every_cell_once_per_epoch_with_block_shuffle(tmp_path):
    dense = random_counts(500, 30, seed=4, empty_every=23)
    path = write_dense(tmp_path / "d.slaf", dense, max_rows_per_file=211)
    sampler = BlockShuffle(block_size=3, fetch_factor=4)  # the loader gives the batch size
    with Loader(path, sampler=sampler, batch_size=16, max_genes=8, n_epochs=2, seed=9) as loader:
        batches = list(loader)
    cells = np.concatenate([b["cell_integer_id"].numpy() for b in batches])
    for epoch in (cells[:500], cells[500:]):
        np.testing.assert_array_equal(np.sort(epoch), np.arange(500))
    assert not np.array_equal(cells[:500], cells[500:])
    assert np.abs(np.diff(cells[:16])).max() > 50  # a minibatch mixes distant blocks
    lengths = np.array([b["attention_mask"].sum(axis=1).numpy() for b in batches[:1]])[0]
    want = np.minimum((dense[batches[0]["cell_integer_id"].numpy()] > 0).sum(axis=1) + 2, 8)
    np.testing.assert_array_equal(lengths, want)


@pytest.mark.parametrize("n_cells", [0, 1, 17, 1000, 1001])
def test_fetch_sizes_match_the_fetches_without_building_them(n_cells):
    plan = BlockShuffle(block_size=7, fetch_factor=3, batch_size=5).plan(n_cells, seed=2, epoch=1)
    np.testing.assert_array_equal(plan.fetch_sizes(), [f.n_cells for f in plan])


def test_the_loader_tells_a_block_sampler_its_batch_size(tmp_path):
    path = write_dense(tmp_path / "b.slaf", random_counts(200, 10, seed=1))
    with Loader(path, sampler=BlockShuffle(block_size=4, fetch_factor=2), batch_size=8) as ld:
        assert ld.sampler.batch_size == 8 and ld.sampler.blocks_per_fetch == 4
        sizes = ld.sampler.plan(200, seed=0, epoch=0).fetch_sizes()
        assert sizes.max() == 2 * 8  # a fetch holds fetch_factor minibatches of the loader's
        assert len(ld.as_torch_dataset()) == 25
    same = BlockShuffle(block_size=4, fetch_factor=2, batch_size=8)
    with Loader(path, sampler=same, batch_size=8) as ld:
        assert ld.sampler == same
    subset = Subset(BlockShuffle(block_size=4, fetch_factor=2), np.arange(0, 200, 2))
    with Loader(path, sampler=subset, batch_size=5) as ld:
        assert ld.sampler.sampler.batch_size == 5
        assert sum(len(b["cell_integer_id"]) for b in ld) == 100


def test_a_second_different_batch_size_is_an_error_not_a_warning(tmp_path):
    path = write_dense(tmp_path / "b.slaf", random_counts(50, 10, seed=1))
    with pytest.raises(ValueError, match="batch_size=32 but the loader uses batch_size=8"):
        Loader(
            path, sampler=BlockShuffle(block_size=4, fetch_factor=2, batch_size=32), batch_size=8
        )
    with pytest.raises(ValueError, match="batch_size=32 but the loader uses batch_size=8"):
        Loader(path, sampler=Weighted(np.ones(50), batch_size=32), batch_size=8)


def test_planning_without_a_loader_needs_the_batch_size():
    with pytest.raises(ValueError, match=r"pass it to slafload.Loader\(batch_size=...\)"):
        BlockShuffle(block_size=4, fetch_factor=2).plan(100, seed=0, epoch=0)
    assert len(BlockShuffle(block_size=4, fetch_factor=2, batch_size=8).plan(100, seed=0, epoch=0))
