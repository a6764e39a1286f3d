"""Feistel permutation: a seeded bijection of [0, n) computed in O(1) memory."""

from __future__ import annotations

import numpy as np
import pytest

from slafload.samplers import FeistelPermutation


@pytest.mark.parametrize(
    "n", [1, 2, 3, 5, 7, 13, 97, 1021, 65_537, 2, 4, 16, 1024, 1 << 16, 10**6 - 1, 10**6]
)
def test_the_permutation_is_a_bijection_of_its_domain(n):
    values = FeistelPermutation(n, seed=n + 11)(np.arange(n))
    assert values.dtype == np.int64
    np.testing.assert_array_equal(np.sort(values), np.arange(n))


def test_the_same_seed_gives_the_same_permutation_and_other_seeds_differ():
    first = FeistelPermutation(1000, seed=1)(np.arange(1000))
    np.testing.assert_array_equal(first, FeistelPermutation(1000, seed=1)(np.arange(1000)))
    others = [FeistelPermutation(1000, seed=s)(np.arange(1000)) for s in range(2, 12)]
    assert all((o != first).mean() > 0.9 for o in others)


def test_slices_evaluate_to_the_same_values_as_the_whole_domain():
    perm = FeistelPermutation(10_007, seed=5)
    whole = perm(np.arange(10_007))
    np.testing.assert_array_equal(perm(np.arange(300, 1300)), whole[300:1300])
    assert perm(42) == whole[42] and perm(42).shape == ()


def test_each_element_lands_uniformly_across_seeds():
    n, seeds = 10, 4000
    counts = np.zeros((n, n))  # counts[element, position]
    for seed in range(seeds):
        counts[np.arange(n), FeistelPermutation(n, seed=seed)(np.arange(n))] += 1
    expected = seeds / n
    chi2 = ((counts - expected) ** 2 / expected).sum(axis=1)  # 9 degrees of freedom each
    assert chi2.max() < 40, chi2  # P(chi2_9 > 40) ~ 7e-6
    # Neighbours are not kept together: adjacent inputs land far apart on average.
    spread = np.abs(np.diff(FeistelPermutation(10**5, seed=3)(np.arange(10**5)))).mean()
    assert spread > 2 * 10**4


def test_large_domains_need_no_index_array():
    perm = FeistelPermutation(10**12, seed=0)
    values = perm(np.arange(10**4))
    assert len(np.unique(values)) == 10**4 and values.max() < 10**12


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"n": 0, "seed": 0}, "n must be"), ({"n": 5, "seed": -1}, "seed must be"),
     ({"n": 5, "seed": 0, "rounds": 2}, "rounds must be")],
)  # fmt: skip
def test_arguments_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FeistelPermutation(**kwargs)
    with pytest.raises(IndexError):
        FeistelPermutation(5, seed=0)(np.array([5]))


@pytest.mark.parametrize("n", [1, 6, 97, 4096, 100_003])
def test_the_inverse_undoes_the_permutation(n):
    perm = FeistelPermutation(n, seed=9)
    values = perm(np.arange(n))
    np.testing.assert_array_equal(perm.inverse(values), np.arange(n))
    assert perm.inverse(values[n // 2]) == n // 2
