"""Sharding among ranks: balanced parts, equal quotas, and exact elastic bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest

from slafload.pipeline.partition import (
    EpochFetches,
    RankShare,
    Segment,
    part_sizes,
    rank_share,
    remaining,
)
from slafload.pipeline.ranges import ranges_of, slice_ranges
from slafload.samplers import ChunkShuffle, Streaming
from slafload.samplers.base import shuffle_order


def delivered(stream: RankShare, skip: int = 0) -> np.ndarray:
    """The cells a rank delivers, in order (shuffles applied, quota respected)."""
    out = []
    for part in stream.parts(skip):
        cells = part.fetch.cell_ids()[shuffle_order(part.fetch.n_cells, part.fetch.shuffle_seed)]
        out.append(cells[part.skip : part.keep])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def test_part_sizes_are_balanced_and_rotate_the_remainder():
    sizes = part_sizes(np.array([10, 10, 10, 7]), 3)
    assert (sizes.sum(axis=1) == [10, 10, 10, 7]).all()
    assert (sizes.max(axis=1) - sizes.min(axis=1) <= 1).all()
    assert np.ptp(sizes.sum(axis=0)) <= 1  # rotation keeps rank totals within one cell


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("sampler", [Streaming(chunk_cells=13), ChunkShuffle(chunk_cells=13)])
def test_ranks_get_disjoint_equal_shares_covering_all_but_a_small_tail(sampler, world_size):
    plan = sampler.plan(200, seed=1, epoch=3)
    streams = [rank_share(plan, (), r, world_size) for r in range(world_size)]
    shares = [delivered(s) for s in streams]
    assert len({len(s) for s in shares}) == 1
    union = np.concatenate(shares)
    assert len(np.unique(union)) == len(union)
    assert 200 - len(union) < len(plan)  # at most about one cell per fetch is left out
    if world_size == 1:
        np.testing.assert_array_equal(np.sort(union), np.arange(200))


def test_slice_ranges_and_ranges_of_round_trip():
    ranges = np.array([[10, 14], [2, 3], [20, 25]])
    np.testing.assert_array_equal(slice_ranges(ranges, 2, 7), [[12, 14], [2, 3], [20, 22]])
    np.testing.assert_array_equal(
        ranges_of(np.array([5, 3, 4, 9, 10, 1])), [[1, 2], [3, 6], [9, 11]]
    )


@pytest.mark.parametrize(("w_old", "w_new"), [(2, 3), (3, 2), (2, 2), (4, 1)])
@pytest.mark.parametrize("cells", [0, 1, 17, 40, 66])
def test_an_elastic_resume_plans_exactly_the_cells_nobody_consumed(w_old, w_new, cells):
    plan = ChunkShuffle(chunk_cells=16).plan(150, seed=4, epoch=0)
    old = [rank_share(plan, (), r, w_old) for r in range(w_old)]
    cells = min(cells, old[0].quota)
    consumed = np.concatenate([delivered(s)[:cells] for s in old])
    rest = remaining(EpochFetches(plan), Segment(w_old, cells), 1)
    new = [delivered(RankShare(rest, r, w_new)) for r in range(w_new)]
    everything = np.concatenate([consumed, *new])
    assert len(np.unique(everything)) == len(everything)  # nothing twice
    assert 150 - len(everything) < 2 * len(plan)  # only the documented tails are missing
    left = np.setdiff1d(np.arange(150), consumed)
    planned = np.concatenate([delivered(RankShare(rest, 0, 1))])
    np.testing.assert_array_equal(np.sort(planned), left)  # one rank would take all the rest


def test_nested_elastic_segments_compose():
    plan = ChunkShuffle(chunk_cells=10).plan(120, seed=2, epoch=1)
    history = (Segment(2, 13), Segment(3, 7))
    seen = [delivered(rank_share(plan, (), r, 2))[:13] for r in range(2)]
    after_first = remaining(EpochFetches(plan), history[0], 1)
    seen += [delivered(RankShare(after_first, r, 3))[:7] for r in range(3)]
    final = delivered(rank_share(plan, history, 0, 1))
    everything = np.concatenate([*seen, final])
    np.testing.assert_array_equal(np.sort(everything), np.arange(120))
