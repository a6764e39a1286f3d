"""A byte budget bounds what is read at once without changing a single delivered cell."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_counts, write_dense

import slafload.pipeline.budget
from slafload import Loader, Tuning, open_dataset
from slafload.pipeline.budget import (
    GROUP_RANGES,
    SCATTERED_ROWS,
    cost,
    groups,
    read_rows,
    scattered,
)
from slafload.pipeline.read import RetryingReader
from slafload.samplers import BlockShuffle, ChunkShuffle, Fetch


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    dense = random_counts(300, 25, seed=5, density=0.4, empty_every=19)
    path = tmp_path_factory.mktemp("budget") / "b.slaf"
    return open_dataset(write_dense(path, dense, max_rows_per_file=150))


def cells_and_tokens(ds, sampler, **settings):
    with Loader(ds, sampler=sampler, batch_size=8, max_genes=8, seed=1, **settings) as loader:
        batches = [{k: v.numpy() for k, v in b.items()} for b in loader]
    return (np.concatenate([b["cell_integer_id"] for b in batches]),
            np.concatenate([b["input_ids"] for b in batches]))  # fmt: skip


@pytest.mark.parametrize(
    "sampler",
    [ChunkShuffle(chunk_cells=120), BlockShuffle(block_size=4, fetch_factor=6, batch_size=8)],
)
@pytest.mark.parametrize("budget", [1, 600, 5000])
def test_a_tiny_budget_still_delivers_every_cell_exactly_once_in_the_same_order(
    dataset, sampler, budget
):
    cells, tokens = cells_and_tokens(
        dataset, sampler, tuning=Tuning(memory_budget=budget, read_ahead=2)
    )
    assert sorted(cells.tolist()) == list(range(300))
    ref_cells, ref_tokens = cells_and_tokens(dataset, sampler)
    np.testing.assert_array_equal(cells, ref_cells)
    np.testing.assert_array_equal(tokens, ref_tokens)


def test_groups_keep_the_read_order_and_cut_large_ranges_at_cells(dataset):
    start = dataset.cell_start
    fetch = Fetch(4, np.array([[200, 300], [0, 5], [7, 9], [7, 9], [120, 121]]), shuffle_seed=3)
    parts = groups(fetch, start, width=8, max_bytes=8 * 3 * 40, max_gap=0)
    assert all(g.index == 4 and g.shuffle_seed is None for g in parts)
    joined = np.concatenate([g.cell_ids() for g in parts])
    np.testing.assert_array_equal(joined, fetch.cell_ids())
    assert len(parts) > 5
    for g in parts:  # about max_bytes each: over it only by one cell or one short range
        rows = start[g.ranges[:, 1]] - start[g.ranges[:, 0]]
        assert rows[:-1].sum() <= 40


def test_cost_counts_the_gaps_the_reader_scans_through(dataset):
    start = dataset.cell_start
    fetch = Fetch(0, np.array([[0, 2], [5, 6]]))
    own = int((start[[2, 6]] - start[[0, 5]]).sum())
    gap = int(start[5] - start[2])
    assert cost(fetch, start, width=8, max_gap=0) == own * 8 * 3
    assert cost(fetch, start, width=8, max_gap=10**9) == (own + gap) * 8 * 3


def test_groups_charge_the_gaps_read_through_so_sparse_cells_stay_in_budget(dataset):
    start = dataset.cell_start
    cells = np.arange(0, 300, 3)  # single cells, two cells apart: the reader spans the gaps
    fetch = Fetch(0, np.stack([cells, cells + 1], axis=1))
    max_rows = 60
    parts = groups(fetch, start, width=8, max_bytes=8 * 3 * max_rows, max_gap=10**9)
    np.testing.assert_array_equal(np.concatenate([g.cell_ids() for g in parts]), cells)
    assert len(parts) > 3
    for g in parts:  # what the reader reads for the group: first row to last, gaps included,
        spanned = int(start[g.ranges[-1, 1]] - start[g.ranges[0, 0]])  # over the budget only
        last = int(read_rows(g, start, 10**9)[-1])  # by the last cell and its gap
        assert spanned - last <= max_rows


def test_groups_hold_at_most_max_ranges_and_still_keep_the_byte_bound(dataset):
    start = dataset.cell_start
    cells = np.arange(0, 300, 2)
    fetch = Fetch(2, np.stack([cells, cells + 1], axis=1))
    for max_rows in (10**9, 25):
        parts = groups(fetch, start, width=8, max_bytes=8 * 3 * max_rows, max_gap=0, max_ranges=16)
        np.testing.assert_array_equal(np.concatenate([g.cell_ids() for g in parts]), cells)
        assert all(len(g.ranges) <= 16 for g in parts)
        assert len(parts) >= -(-len(cells) // 16)
        for g in parts:
            assert int(read_rows(g, start, 0)[:-1].sum()) <= max_rows
    for n, sizes in ((17, [8, 9]), (33, [11, 11, 11]), (16, [16])):  # equal parts, not 16 + rest
        some = Fetch(0, fetch.ranges[:n])
        parts = groups(some, start, width=8, max_bytes=10**12, max_gap=0, max_ranges=16)
        assert sorted(len(g.ranges) for g in parts) == sizes


def test_scattered_means_more_than_group_ranges_ranges_of_few_rows_each():
    short = np.arange(0, 100 * (GROUP_RANGES + 10) + 1, 100)  # cells of 100 rows
    long = np.arange(0, SCATTERED_ROWS * (GROUP_RANGES + 10) + 1, SCATTERED_ROWS)
    many = np.stack([np.arange(GROUP_RANGES + 1), np.arange(1, GROUP_RANGES + 2)], axis=1)
    assert scattered(Fetch(0, many), short)
    assert not scattered(Fetch(0, many[:GROUP_RANGES]), short)  # few ranges: read whole
    assert not scattered(Fetch(0, many), long)  # ranges of SCATTERED_ROWS rows or more
    assert scattered(Fetch(0, many), long - np.arange(len(long)))  # a row fewer each


def test_fetches_of_single_cells_are_read_in_groups_of_at_most_group_ranges(tmp_path, monkeypatch):
    dense = random_counts(3000, 20, seed=11, density=0.3, empty_every=23)
    ds = open_dataset(write_dense(tmp_path / "single.slaf", dense, max_rows_per_file=5000))
    started: list[int] = []
    start = RetryingReader.start

    def recorded(self, fetch, **kw):
        started.append(len(fetch.ranges))
        return start(self, fetch, **kw)

    monkeypatch.setattr(RetryingReader, "start", recorded)
    sampler = BlockShuffle(block_size=1, fetch_factor=64, batch_size=8)  # 512 cells a fetch
    cells, tokens = cells_and_tokens(ds, sampler)
    assert max(started) <= GROUP_RANGES
    assert sum(n > GROUP_RANGES // 2 for n in started) >= 5  # full fetches (~430 ranges), cut
    assert sorted(cells.tolist()) == list(range(3000))
    monkeypatch.setattr(RetryingReader, "start", start)  # the same fetches, each read whole:
    monkeypatch.setattr(
        slafload.pipeline.budget, "GROUP_RANGES", 10**9
    )  # the same cells, same order
    ref_cells, ref_tokens = cells_and_tokens(ds, sampler)
    np.testing.assert_array_equal(cells, ref_cells)
    np.testing.assert_array_equal(tokens, ref_tokens)
