"""Weighted and class-balanced sampling: documented epoch semantics, block-level reads."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from conftest import random_counts, write_dense

from slafload import Loader, open_dataset
from slafload.samplers import ClassBalanced, Sampler, Weighted


def plan_cells(plan) -> np.ndarray:
    return np.concatenate([f.cell_ids() for f in plan])


@pytest.mark.parametrize("block_size", [1, 4, 7])
def test_without_replacement_every_positive_weight_cell_appears_exactly_once(block_size):
    weights = np.ones(203)
    weights[40:80] = 0  # whole blocks of zero weight are never read
    weights[100:110] = 5
    sampler = Weighted(weights, replacement=False, block_size=block_size, fetch_factor=2,
                       batch_size=8)  # fmt: skip
    assert isinstance(sampler, Sampler)
    plan = sampler.plan(203, seed=0, epoch=0)
    cells = plan_cells(plan)
    blocks_read = np.unique(cells // block_size)
    assert len(cells) == len(np.unique(cells)) == plan.n_cells
    block_weight = np.add.reduceat(weights, np.arange(0, 203, block_size))
    np.testing.assert_array_equal(blocks_read, np.flatnonzero(block_weight > 0))


def test_without_replacement_heavier_cells_tend_to_come_first():
    weights = np.ones(1000)
    weights[:100] = 50
    firsts = [plan_cells(Weighted(weights, replacement=False, batch_size=32).plan(1000, seed=s, epoch=0))[:100]
              for s in range(5)]  # fmt: skip
    assert np.mean([(f < 100).mean() for f in firsts]) > 0.6  # uniform order would give 0.1


@pytest.mark.parametrize("block_size", [1, 8])
def test_with_replacement_an_epoch_is_n_draws_cells_in_proportion_to_weight(block_size):
    n = 800
    weights = np.where(np.arange(n) < 400, 3.0, 1.0)  # constant within blocks
    sampler = Weighted(
        weights, block_size=block_size, n_draws=20_000, fetch_factor=4, batch_size=32
    )
    plan = sampler.plan(n, seed=1, epoch=0)
    cells = plan_cells(plan)
    assert len(cells) == plan.n_cells == 20_000
    assert abs((cells < 400).mean() - 0.75) < 0.03
    default = Weighted(weights, block_size=block_size, batch_size=32).plan(n, seed=1, epoch=0)
    assert default.n_cells == n  # default epoch: as many draws as cells
    assert len(np.unique(plan_cells(default))) < n  # some cells repeat, others are missed


@pytest.mark.parametrize("replacement", [True, False])
def test_weighted_plans_repeat_per_seed_and_differ_across_seeds_and_epochs(replacement):
    sampler = Weighted(np.arange(1.0, 301.0), replacement=replacement, block_size=2,
                       fetch_factor=1, batch_size=16)  # fmt: skip

    def key(seed, epoch):
        plan = sampler.plan(300, seed=seed, epoch=epoch)
        return plan_cells(plan).tolist(), [f.shuffle_seed for f in plan]

    assert key(0, 0) == key(0, 0)
    assert key(0, 0)[0] != key(0, 1)[0] and key(0, 0)[0] != key(1, 0)[0]
    assert key(0, 0)[1] != key(0, 1)[1]


def test_fetches_read_sorted_block_ranges_and_shuffle_in_memory():
    plan = Weighted(np.ones(1000), block_size=10, fetch_factor=2, batch_size=50).plan(
        1000, seed=0, epoch=0
    )
    for fetch in plan:
        assert (np.diff(fetch.ranges[:, 0]) >= 0).all() and fetch.shuffle_seed is not None
    assert plan[0].n_cells == 100
    np.testing.assert_array_equal(plan.fetch_sizes(), [f.n_cells for f in plan])


def test_class_balanced_draws_every_class_equally_often():
    labels = np.repeat([0, 1, 2], [900, 90, 10])
    plan = ClassBalanced(labels, n_draws=30_000, batch_size=32).plan(1000, seed=0, epoch=0)
    freq = np.bincount(labels[plan_cells(plan)], minlength=3) / 30_000
    np.testing.assert_allclose(freq, 1 / 3, atol=0.02)


def test_weights_from_categories_and_class_balance_from_obs(tmp_path):
    dense = random_counts(90, 8, seed=5)
    cell_type = np.repeat(["B", "T", "NK"], [60, 20, 10])
    ds = open_dataset(write_dense(tmp_path / "w.slaf", dense, obs={"ct": pa.array(cell_type)}))
    only_t = Weighted.from_categories(ds, "ct", {"T": 1.0}, replacement=False, batch_size=32)
    np.testing.assert_array_equal(
        np.sort(plan_cells(only_t.plan(90, seed=0, epoch=0))), np.flatnonzero(cell_type == "T")
    )
    with pytest.raises(ValueError, match="does not have"):
        Weighted.from_categories(ds, "ct", {"X": 1.0})
    balanced = ClassBalanced.from_obs(ds, "ct", n_draws=3000)
    with Loader(ds, sampler=balanced, batch_size=30, max_genes=4, obs_columns=["ct"]) as loader:
        codes = np.concatenate([b["ct"].numpy() for b in loader])
    assert len(codes) == 3000
    np.testing.assert_allclose(np.bincount(codes, minlength=3) / 3000, 1 / 3, atol=0.05)


@pytest.mark.parametrize(
    ("weights", "match"),
    [(np.zeros(5), "positive sum"), (np.array([1.0, -1.0]), "non-negative"),
     (np.array([1.0, np.nan]), "finite")],
)  # fmt: skip
def test_invalid_weights_are_rejected(weights, match):
    with pytest.raises(ValueError, match=match):
        Weighted(weights)
    with pytest.raises(ValueError, match="one weight per cell"):
        Weighted(np.ones(4)).plan(5, seed=0, epoch=0)


def test_the_repr_recorded_in_checkpoints_tells_different_weights_apart():
    a, b = Weighted(np.ones(6)), Weighted(np.r_[np.ones(5), 2.0])
    assert repr(a) == repr(Weighted(np.ones(6))) and repr(a) != repr(b)
    assert repr(ClassBalanced(np.array([0, 1, 1]))) != repr(ClassBalanced(np.array([1, 0, 0])))
