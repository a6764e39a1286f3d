"""Mixtures that mix: every batch a weighted sample of the sources (slafload.samplers.interleave,
slafload.samplers.mixed), ``mix="batch"``, and exact resume of both on one and two ranks."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from conftest import run_cells
from resume_conformance import assert_resumes_exactly

from slafload import Loader, Mixture, MixtureError
from slafload.samplers import ChunkShuffle, Streaming
from slafload.samplers.interleave import MixedFetch
from slafload.samplers.mixed import SHARE_SLACK, MixtureSampler, quotas
from slafload.synthetic import write_atlas

SMALL = {"n_genes": 40, "mean_nnz": 6, "n_plates": 3}


@pytest.fixture(scope="module")
def atlases(tmp_path_factory):
    """The issue's two atlases (4,000 and 2,000 cells) and a third of 1,000."""
    tmp = tmp_path_factory.mktemp("interleave")
    sizes = {"big": 4000, "small": 2000, "third": 1000}
    return {
        name: write_atlas(tmp / f"{name}.slaf", n_cells=n, seed=i, **SMALL)
        for i, (name, n) in enumerate(sizes.items())
    }


def _sources(loader) -> list[np.ndarray]:
    return [b["source"].numpy() for b in loader]


def _assert_mixed(batches: list[np.ndarray], weights: list[float]) -> None:
    """>= 95% of batches hold every source; each source's share over every 1,000 consecutive
    cells (starting at any batch) is within 0.05 of its weight.
    """
    share = np.asarray(weights, dtype=np.float64) / sum(weights)
    full = [b for b in batches if len(b) == len(batches[0])]
    every = np.mean([len(np.unique(b)) == len(weights) for b in full])
    assert every >= 0.95, f"only {every:.1%} of batches hold every source"
    stream = np.concatenate(batches)
    onehot = np.eye(len(weights))[stream]
    csum = np.concatenate([np.zeros((1, len(weights))), np.cumsum(onehot, axis=0)])
    starts = np.arange(0, len(stream) - 1000 + 1, len(batches[0]))
    windows = (csum[starts + 1000] - csum[starts]) / 1000
    assert np.abs(windows - share).max() <= 0.05, np.abs(windows - share).max()


def test_every_batch_of_a_one_to_one_mixture_holds_both_sources_in_proportion(atlases):
    # The setting: 4,000 + 2,000 cells, weights 1:1, batch 32. Fixed-size epochs keep
    # 1:1 throughout; a one-pass epoch can only keep it until the small atlas runs out.
    mix = Mixture([atlases["big"], atlases["small"]], weights=[1, 1], epoch_cells=4000)
    with Loader(mix, batch_size=32, max_genes=8, n_epochs=2, seed=5) as loader:
        batches = _sources(loader)
    assert len(batches) == 250
    _assert_mixed(batches, [1, 1])
    # 24:8 at 3:1, per batch (the stratified schedule keeps every batch within a cell or two)
    mix = Mixture([atlases["big"], atlases["small"]], weights=[3, 1], epoch_cells=4000)
    with Loader(mix, batch_size=32, max_genes=8, n_epochs=1, seed=5) as loader:
        counts = np.array([np.bincount(b, minlength=2) for b in _sources(loader)])
    assert np.abs(counts[:, 0] - 24).max() <= 2


def test_a_one_pass_mixture_weighted_by_size_mixes_every_batch(atlases):
    # the default weights (the sources' sizes): every source lasts the whole epoch
    mix = Mixture([atlases["small"], atlases["big"]])
    with Loader(mix, batch_size=32, max_genes=8, n_epochs=1, seed=2) as loader:
        batches = _sources(loader)
    _assert_mixed(batches, [1, 2])


def test_every_batch_of_a_five_three_two_mixture_holds_all_three_sources(atlases):
    mix = Mixture(list(atlases.values()), weights=[5, 3, 2], epoch_cells=5000)
    with Loader(mix, batch_size=32, max_genes=8, n_epochs=2, seed=7) as loader:
        batches = _sources(loader)
    _assert_mixed(batches, [5, 3, 2])


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_of_two_gets_mixed_batches(atlases, rank):
    mix = Mixture([atlases["big"], atlases["small"]], weights=[1, 1], epoch_cells=4000)
    with Loader(mix, batch_size=32, max_genes=8, n_epochs=1, rank=rank, world_size=2) as loader:
        batches = _sources(loader)
    _assert_mixed(batches, [1, 1])


@pytest.mark.parametrize("world_size", [1, 2])
def test_mix_batch_gives_every_batch_from_one_source_by_weight(atlases, world_size):
    mix = Mixture([atlases["big"], atlases["small"]], weights=[3, 1], epoch_cells=4096,
                  mix="batch")  # fmt: skip
    with Loader(mix, batch_size=32, max_genes=8, n_epochs=2, seed=1, rank=world_size - 1,
                world_size=world_size) as loader:  # fmt: skip
        batches = _sources(loader)
    assert all(len(np.unique(b)) == 1 for b in batches)
    assert np.concatenate(batches).mean() == pytest.approx(0.25, abs=0.02)
    runs = np.flatnonzero(np.diff([b[0] for b in batches])) + 1
    assert len(runs) >= 4  # the sources take turns through the epoch, not one after the other
    with pytest.raises(MixtureError, match="mix must be one of"):
        Mixture([atlases["big"]], mix="fetch")


def test_one_pass_still_delivers_every_cell_once_with_cell_mixing(atlases):
    mix = Mixture(list(atlases.values()), weights=[1, 1, 1])
    with Loader(mix, batch_size=32, max_genes=8, n_epochs=1, drop_last=False) as loader:
        cells = run_cells(loader)
    want = [(k, c) for k, n in enumerate([4000, 2000, 1000]) for c in range(n)]
    assert sorted(cells) == want


def _fetch(counts, runs=None, seed=9) -> MixedFetch:
    counts = np.asarray(counts, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]) * 10  # blocks far apart
    ranges = np.array([[o, o + c] for o, c in zip(offsets[:-1], counts, strict=True)])
    runs = counts if runs is None else np.asarray(runs, dtype=np.int64)
    return MixedFetch(3, ranges, seed, counts=counts, runs=runs,
                      shuffled=np.ones(len(runs), dtype=bool))  # fmt: skip


def test_a_mixed_fetch_cut_among_ranks_keeps_every_cell_once_in_proportion():
    fetch = _fetch([500, 300, 200])
    order = fetch.output_order()
    assert sorted(order.tolist()) == list(range(1000))
    for world in (1, 2, 3, 7):
        edges = np.linspace(0, 1000, world + 1).astype(int)
        parts = [fetch.sliced(0, a, b, 1) for a, b in itertools.pairwise(edges)]
        cells = np.concatenate([p.cell_ids() for p in parts])
        assert sorted(cells.tolist()) == sorted(fetch.cell_ids().tolist())
        for p, (a, b) in zip(parts, itertools.pairwise(edges), strict=True):
            assert p.n_cells == b - a
            assert np.abs(p.counts - (b - a) * np.array([0.5, 0.3, 0.2])).max() < 2
            assert len(p.ranges) == 3  # one contiguous read per source


def test_a_whole_mixed_fetch_given_to_one_rank_is_the_fetch_cut_through_its_schedule():
    for counts, runs in (([500, 300, 200], None), ([100, 60], [40, 60, 60]), ([7, 0, 5], [7, 5])):
        fetch = _fetch(counts, runs)
        whole, cut = fetch.sliced(4, 0, fetch.n_cells, 11), fetch._cut(4, 0, fetch.n_cells, 11)
        for got, want in ((whole.ranges, cut.ranges), (whole.runs, cut.runs)):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(whole.output_order(), cut.output_order())
        np.testing.assert_array_equal(whole.cell_ids(), cut.cell_ids())


def test_a_mixed_fetch_keeps_the_order_of_its_sources_runs():
    # source 0's block is two runs (the end of one pass, the start of the next): every cell
    # of the first run comes out before any of the second
    fetch = _fetch([100, 60], runs=[40, 60, 60])
    order = fetch.output_order()
    first_run = np.flatnonzero(order < 40)
    second_run = np.flatnonzero((order >= 40) & (order < 100))
    assert first_run.max() < second_run.min()


def test_what_is_left_of_a_mixed_fetch_counts_repeated_cells_apart():
    counts = np.array([3, 2])
    ranges = np.array([[5, 7], [5, 6], [20, 22]])  # cell 5 twice in source 0's block
    fetch = MixedFetch(0, ranges, 4, counts=counts, runs=counts, shuffled=np.ones(2, bool))
    left = fetch.without(np.array([5, 21]), 8)
    assert sorted(left.cell_ids().tolist()) == [5, 6, 20]
    assert left.counts.tolist() == [2, 1]


def _mixture_sampler(sizes, weights, chunk_cells, **options) -> MixtureSampler:
    n = len(sizes)
    return MixtureSampler(names=tuple(f"s{k}" for k in range(n)), uris=("",) * n,
                          sizes=tuple(sizes), weights=tuple(weights),
                          samplers=(ChunkShuffle(chunk_cells=chunk_cells),) * n, **options)  # fmt: skip


@pytest.mark.parametrize("epoch_cells", [None, 3000])
def test_a_mixed_fetch_reads_one_range_per_source_after_a_short_fetch(epoch_cells):
    # 1,000 cells in 128-cell chunks: the last chunk (104 cells) shifts every later cut of a
    # source's stream off its chunks, which would read each block as two ranges
    sampler = _mixture_sampler([1000, 1000], [1, 1], 128, epoch_cells=epoch_cells)
    for epoch in range(3):
        plan = sampler.plan(2000, seed=epoch, epoch=epoch)
        for j in range(len(plan)):  # one span of cells per source (runs may touch)
            ranges = plan.fetch(j).ranges
            assert (ranges[1:, 0] != ranges[:-1, 1]).sum() == 1, ranges
        cells = np.concatenate([plan.fetch(j).cell_ids() for j in range(len(plan))])
        if epoch_cells is None:  # one pass: every cell once
            assert sorted(cells.tolist()) == list(range(2000))
        else:  # 1,500 cells of each source: its pass, then half of the next or the rest
            assert len(cells) == 3000 and np.bincount(cells).max() <= 2


def test_moving_cuts_to_fetch_ends_keeps_each_fetchs_mix_and_every_cell_once():
    # sources whose chunks end at different places, weights apart from their sizes, a cap
    for sizes, weights, chunk in (
        ([1000, 1300], [1000, 1300], 128),
        ([900, 700, 500], [5, 3, 2], 64),
    ):
        for cap in (None, 300):
            sampler = _mixture_sampler(sizes, weights, chunk, epoch_cells=2000, fetch_cells=cap)
            plan = sampler.plan(sum(sizes), seed=1, epoch=1)
            counts = np.array([plan.fetch(j).counts for j in range(len(plan))])
            want = np.asarray(weights) / sum(weights)
            shares = counts[:-1] / counts[:-1].sum(axis=1, keepdims=True)
            assert np.abs(shares - want).max() <= SHARE_SLACK + 0.02  # the schedule's rounding
            assert (counts.sum(axis=0) == quotas(2000, weights)).all()
            if cap is not None:
                assert plan.fetch_sizes().max() <= cap


SETTINGS = {"batch_size": 16, "max_genes": 6, "seed": 3, "n_epochs": 2}


@pytest.mark.parametrize("n_sources", [2, 3])
@pytest.mark.parametrize("epoch_cells", [None, 900])
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_mixing_mixture_resumes_exactly_at_20_random_midpoints(
    tmp_path_factory, n_sources, epoch_cells, world_size
):
    tmp = tmp_path_factory.mktemp("resume")
    paths = [
        write_atlas(tmp / f"s{k}.slaf", n_cells=n, seed=k, **SMALL)
        for k, n in enumerate([400, 250, 150][:n_sources])
    ]

    def make():
        mix = Mixture(paths, weights=[5, 3, 2][:n_sources], epoch_cells=epoch_cells)
        return Loader(mix, rank=world_size - 1, world_size=world_size, chunk_cells=64,
                      **SETTINGS)  # fmt: skip

    assert_resumes_exactly(make, midpoints=20)


def test_mix_batch_resumes_exactly_on_two_ranks(atlases):
    def make():
        mix = Mixture([atlases["small"], atlases["third"]], weights=[1, 1], epoch_cells=1024,
                      mix="batch")  # fmt: skip
        return Loader(mix, rank=1, world_size=2, chunk_cells=64, **SETTINGS)

    assert_resumes_exactly(make, midpoints=20)


def test_mixed_fetches_hold_one_fetch_per_source_within_the_memory_budget(atlases):
    mix = Mixture(list(atlases.values()), weights=[1, 1, 1])
    roomy = mix.sampler(Streaming(chunk_cells=500), batch_size=32, memory_budget=1 << 30)
    sizes = roomy.plan(mix.n_cells, seed=0, epoch=0).fetch_sizes()
    assert sizes.max() == 1500  # one 500-cell fetch of each source
    tight = mix.sampler(Streaming(chunk_cells=500), batch_size=32, memory_budget=1 << 18)
    assert tight.fetch_cells is not None and tight.fetch_cells < 1500
    plan = tight.plan(mix.n_cells, seed=0, epoch=0)
    assert plan.fetch_sizes().max() <= tight.fetch_cells
    assert plan.n_cells == mix.n_cells  # smaller fetches, the same cells
    counts = np.array([plan.fetch(j).counts for j in range(len(plan) // 2)])
    assert (counts.min(axis=1) > 0).all()  # every fetch still mixes all three sources


def test_a_mixing_mixture_of_three_resumes_elastically_from_two_ranks_onto_three(atlases):
    def make(rank, world_size):
        mix = Mixture(list(atlases.values()), weights=[5, 3, 2])
        return Loader(mix, rank=rank, world_size=world_size, n_epochs=1, batch_size=32,
                      max_genes=6, drop_last=False)  # fmt: skip

    before, states = [], []
    for rank in range(2):
        with make(rank, 2) as loader:
            it = iter(loader)
            before += run_cells([next(it) for _ in range(30)])
            states.append(json.loads(json.dumps(loader.state_dict())))
    after = []
    for rank in range(3):
        with make(rank, 3) as loader:
            loader.load_state_dict(states[rank % 2])
            after += run_cells(loader)
    seen = before + after
    assert len(set(seen)) == len(seen)  # nothing delivered twice across the resize
    assert 7000 - len(seen) < 2 * 10  # complete but for a cell per fetch of each segment
