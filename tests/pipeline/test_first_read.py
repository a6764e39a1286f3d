"""The small first read changes no cell, no order and no position: resume stays exact."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_counts, write_dense

from slafload import Loader, Tuning, open_dataset
from slafload.pipeline.first_read import reading, split_first
from slafload.pipeline.partition import Part
from slafload.samplers import BlockShuffle, ChunkShuffle, Fetch, Weighted

SAMPLERS = {
    "chunk": ChunkShuffle(chunk_cells=96),
    "block": BlockShuffle(block_size=4, fetch_factor=8, batch_size=8),
    "weighted": Weighted(np.linspace(0.5, 2.0, 400), block_size=3),
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    dense = random_counts(400, 30, seed=3, density=0.3, empty_every=17)
    path = tmp_path_factory.mktemp("first") / "f.slaf"
    return open_dataset(write_dense(path, dense, max_rows_per_file=211))


def run(ds, sampler, **settings):
    settings = {"batch_size": 8, "max_genes": 8, "seed": 2, **settings}
    with Loader(ds, sampler=sampler, **settings) as loader:
        return [{k: v.numpy() for k, v in b.items()} for b in loader]


def same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("first", [1, 5, 16])
def test_a_small_first_read_delivers_the_same_batches(dataset, name, first):
    sampler = SAMPLERS[name]
    same(run(dataset, sampler, tuning=Tuning(first_read_cells=first)),
         run(dataset, sampler, tuning=Tuning(first_read_cells=0)))  # fmt: skip


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("taken", [1, 2, 7])
def test_resuming_inside_or_after_the_first_read_is_exact(dataset, name, taken):
    sampler = SAMPLERS[name]
    settings = {"batch_size": 8, "max_genes": 8, "seed": 2, "tuning": Tuning(first_read_cells=12)}
    reference = run(dataset, sampler, tuning=Tuning(first_read_cells=0))
    with Loader(dataset, sampler=sampler, **settings) as loader:
        it = iter(loader)
        head = [{k: v.numpy() for k, v in next(it).items()} for _ in range(taken)]
        state = loader.state_dict()
    with Loader(dataset, sampler=sampler, **settings) as loader:
        loader.load_state_dict(state)
        tail = [{k: v.numpy() for k, v in b.items()} for b in loader]
    same(head + tail, reference)


def test_reading_positions_gives_their_cells_in_the_given_order():
    fetch = Fetch(3, np.array([[10, 14], [40, 42], [10, 12]]), shuffle_seed=None)
    cells = fetch.cell_ids()  # 10 11 12 13 40 41 10 11
    part = reading(fetch, np.array([6, 0, 5, 3, 7]))
    assert part.fetch.ranges.tolist() == [[10, 11], [13, 14], [41, 42], [10, 12]]
    read = part.fetch.cell_ids()
    np.testing.assert_array_equal(read[part.order], cells[[6, 0, 5, 3, 7]])


def test_split_first_splits_only_the_first_part():
    fetch = Fetch(0, np.array([[0, 50]]), shuffle_seed=9)
    parts = [Part(fetch, 3, 40), Part(Fetch(1, np.array([[50, 60]])), 0, 10)]
    out = list(split_first(parts, 5))
    assert [p.keep - p.skip for p in out] == [5, 32, 10]
    assert out[2] is parts[1]
    assert list(split_first(parts, 0)) == parts
