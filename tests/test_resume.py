"""Exact resume, ranks without communication, elastic resume, and the DataLoader face."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import append_cell, random_counts, write_dense
from resume_conformance import assert_resumes_exactly, assert_torch_dataset_resumes_exactly

from slafload import Loader, StateError, Tuning, open_dataset
from slafload.samplers import (
    BlockShuffle,
    ChunkShuffle,
    ClassBalanced,
    Streaming,
    Subset,
    Weighted,
)

pytestmark = pytest.mark.usefixtures("no_thread_leak")

N = 230
WEIGHTS = np.random.default_rng(0).random(N)
LABELS = np.arange(N) // 60
SAMPLERS = {  # every sampler slafload ships, at small sizes
    "streaming": lambda: Streaming(chunk_cells=40),
    "chunk_shuffle": lambda: ChunkShuffle(chunk_cells=40),
    "block_shuffle": lambda: BlockShuffle(block_size=4, fetch_factor=3),
    "random": lambda: BlockShuffle(block_size=1, fetch_factor=2),
    "weighted_replacement": lambda: Weighted(
        WEIGHTS, replacement=True, block_size=2, fetch_factor=2
    ),
    "weighted_no_replacement": lambda: Weighted(
        WEIGHTS, replacement=False, block_size=3, fetch_factor=2
    ),
    "class_balanced": lambda: ClassBalanced(LABELS, block_size=2, fetch_factor=2),
    "subset": lambda: Subset(ChunkShuffle(chunk_cells=25), np.arange(0, N, 3)),
}


@pytest.fixture(scope="module")
def atlas(tmp_path_factory):
    dense = random_counts(N, 30, seed=3, empty_every=17)
    return write_dense(tmp_path_factory.mktemp("resume") / "r.slaf", dense, max_rows_per_file=301)


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_at_random_midpoints_equals_an_uninterrupted_run(atlas, sampler, drop_last):
    ds = open_dataset(atlas)
    assert_resumes_exactly(
        lambda: Loader(
            ds,
            sampler=SAMPLERS[sampler](),
            batch_size=9,
            max_genes=8,
            n_epochs=2,
            drop_last=drop_last,
            tuning=Tuning(queue_depth=4),
        ),
        midpoints=20,
    )


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_the_dataset_face_resumed_adds_up_to_the_uninterrupted_run(atlas, sampler):
    ds = open_dataset(atlas)

    def make():
        with Loader(ds, sampler=SAMPLERS[sampler](), batch_size=9, max_genes=8, n_epochs=2) as ld:
            return ld.as_torch_dataset()

    assert_torch_dataset_resumes_exactly(make, n_epochs=2, midpoints=8)


def test_a_resumed_run_stops_where_the_uninterrupted_run_stops(atlas):
    """The reported case: n_epochs=2, a checkpoint in epoch 1; no extra epoch after it."""
    with Loader(atlas, batch_size=10, n_epochs=2, chunk_cells=40) as loader:
        n_full = sum(1 for _ in loader)
    with Loader(atlas, batch_size=10, n_epochs=2, chunk_cells=40) as loader:
        it = iter(loader)
        before = [next(it) for _ in range(n_full // 2 + 3)]
        state = loader.state_dict()
    assert state["epoch"] == 1
    with Loader(atlas, batch_size=10, n_epochs=2, chunk_cells=40) as resumed:
        resumed.load_state_dict(state)
        after = sum(1 for _ in resumed)
        assert sum(1 for _ in resumed) == 0  # the run is complete: nothing more
    assert len(before) + after == n_full


def test_resume_works_under_two_ranks(atlas):
    ds = open_dataset(atlas)
    for rank in range(2):
        assert_resumes_exactly(
            lambda rank=rank: Loader(
                ds, batch_size=8, max_genes=4, rank=rank, world_size=2, n_epochs=2, chunk_cells=30
            ),
            midpoints=8,
        )


def epoch_cells(loader) -> list[np.ndarray]:
    return [b["cell_integer_id"].numpy() for b in loader]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_get_equal_batches_and_disjoint_cells_without_communication(atlas, world_size):
    ds = open_dataset(atlas)
    shares = []
    for rank in range(world_size):
        with Loader(ds, batch_size=8, rank=rank, world_size=world_size, chunk_cells=30) as ld:
            batches = epoch_cells(ld)
            assert len(batches) == len(ld)
            shares.append(np.concatenate(batches))
    assert len({len(s) for s in shares}) == 1
    union = np.concatenate(shares)
    assert len(np.unique(union)) == len(union)
    assert 230 - len(union) <= 8  # the documented uneven tail: about one cell per fetch


def test_an_elastic_resume_from_two_to_three_ranks_covers_the_rest_once(atlas):
    ds = open_dataset(atlas)
    seen, state = [], None
    for rank in range(2):
        with Loader(ds, batch_size=6, rank=rank, world_size=2, chunk_cells=25) as loader:
            it = iter(loader)
            seen += [next(it)["cell_integer_id"].numpy() for _ in range(7)]
            state = json.loads(json.dumps(loader.state_dict()))
    assert state["segments"] == [[2, 42]]
    for rank in range(3):
        with Loader(ds, batch_size=6, rank=rank, world_size=3, chunk_cells=25) as loader:
            loader.load_state_dict(state)
            seen += epoch_cells(loader)
            assert loader.position.epoch == 1
    everything = np.concatenate(seen)
    assert len(np.unique(everything)) == len(everything)
    assert 230 - len(everything) <= 3 * 10  # tails only: never a repeated or lost middle


def test_loading_a_state_with_another_order_is_refused(atlas):
    with Loader(atlas, seed=1) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with Loader(atlas, seed=2) as other, pytest.raises(StateError, match="'seed': \\(1, 2\\)"):
        other.load_state_dict(state)
    with Loader(atlas, seed=1, chunk_cells=7) as other, pytest.raises(StateError, match="sampler"):
        other.load_state_dict(state)
    with Loader(atlas) as other, pytest.raises(StateError, match="not a slafload state"):
        other.load_state_dict({"epoch": 3})


def test_the_state_is_small_json_and_records_the_lance_versions(atlas):
    with Loader(atlas, batch_size=10) as loader:
        it = iter(loader)
        next(it), next(it)
        state = loader.state_dict()
    assert len(json.dumps(state)) < 1000
    assert state["dataset"]["versions"] == open_dataset(atlas).versions
    assert (state["epoch"], state["segments"]) == (0, [[1, 20]])


def test_an_append_mid_epoch_does_not_change_the_resumed_epoch(tmp_path):
    dense = random_counts(50, 6, seed=1)
    path = write_dense(tmp_path / "a.slaf", dense)
    with Loader(path, batch_size=10, shuffle=False) as loader:
        it = iter(loader)
        first = [next(it)["cell_integer_id"].numpy() for _ in range(2)]
        state = loader.state_dict()
    append_cell(path, [1, 4], [3, 9])
    with Loader(path, batch_size=10, shuffle=False) as loader:  # opens the newer versions
        assert loader.dataset.n_cells == 51
        loader.load_state_dict(state)
        assert loader.dataset.versions == state["dataset"]["versions"]
        assert loader.dataset.n_cells == 50
        rest = epoch_cells(loader)
    np.testing.assert_array_equal(np.concatenate(first + rest), np.arange(50))


def test_a_dataloader_with_two_workers_sees_each_cell_once_and_epochs_differ(atlas):
    with Loader(atlas, batch_size=16, chunk_cells=30, max_genes=8, n_epochs=2) as loader:
        ds = loader.as_torch_dataset()
    dl = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context="spawn"
    )
    orders = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        cells = np.concatenate([b["cell_integer_id"].numpy() for b in dl])
        np.testing.assert_array_equal(np.sort(cells), np.arange(230))
        orders.append(cells)
    assert not np.array_equal(orders[0], orders[1])


def test_the_torch_dataset_advances_epochs_by_itself_in_process(atlas):
    with Loader(atlas, batch_size=50, chunk_cells=30, n_epochs=2) as loader:
        ds = loader.as_torch_dataset()
    first = np.concatenate([b["cell_integer_id"].numpy() for b in ds])
    second = np.concatenate([b["cell_integer_id"].numpy() for b in ds])
    assert len(ds) == 5 and ds.epoch == 2
    np.testing.assert_array_equal(np.sort(second), np.arange(230))
    assert not np.array_equal(first, second)


def test_rank_settings_are_validated(atlas, monkeypatch):
    with pytest.raises(ValueError, match="pass both rank and world_size"):
        Loader(atlas, rank=1)
    with pytest.raises(ValueError, match="rank must be an integer in \\[0, 2\\)"):
        Loader(atlas, rank=2, world_size=2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with Loader(atlas) as loader:
        assert (loader.rank, loader.world_size) == (1, 3)


def test_one_state_schema_serves_both_front_ends(atlas):
    settings = {"batch_size": 10, "chunk_cells": 40, "seed": 3, "max_genes": 8}
    with Loader(atlas, **settings) as loader:
        full = [b["cell_integer_id"].numpy().copy() for b in loader]
    with Loader(atlas, **settings) as loader:
        it = iter(loader)
        head = [next(it)["cell_integer_id"].numpy().copy() for _ in range(4)]
        state = loader.state_dict()
        face = loader.as_torch_dataset()
    face.load_state_dict(state)  # a Loader's state resumes the DataLoader face in-process
    rest = [b["cell_integer_id"].numpy() for b in face]
    assert len(head) + len(rest) == len(full)
    np.testing.assert_array_equal(np.concatenate(head + rest), np.concatenate(full))
    worker_state = {**face.state_dict(), "worker": 1, "n_workers": 2}
    with Loader(atlas, **settings) as other, pytest.raises(StateError, match="DataLoader worker"):
        other.load_state_dict(worker_state)


def test_a_state_written_by_slafload_0_1_still_loads(atlas):
    settings = {"batch_size": 10, "chunk_cells": 40, "seed": 3, "max_genes": 8}
    with Loader(atlas, **settings) as loader:
        it = iter(loader)
        head = [next(it)["cell_integer_id"].numpy().copy() for _ in range(3)]
        state = loader.state_dict()
        rest_now = [b["cell_integer_id"].numpy().copy() for b in it]
    v1 = {k: v for k, v in state.items() if k not in ("version", "worker", "n_workers")}
    v1["format"] = "slafload.loader.v1"
    with Loader(atlas, **settings) as loader:
        loader.load_state_dict(v1)
        rest = [b["cell_integer_id"].numpy() for b in loader]
    np.testing.assert_array_equal(np.concatenate(rest), np.concatenate(rest_now))
    assert head
    with Loader(atlas, **settings) as loader, pytest.raises(StateError, match="version 3"):
        loader.load_state_dict({**state, "version": 3})
