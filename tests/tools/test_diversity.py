"""Minibatch label entropy and the scDataset paper's bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from slafload.samplers import BlockShuffle, ChunkShuffle
from slafload.tools.diversity import batch_entropy, entropy, entropy_bounds, mean_batch_entropy


def test_entropy_of_simple_batches_in_bits():
    assert batch_entropy(np.zeros(32, dtype=int)) == 0.0
    assert batch_entropy(np.array([0, 1, 0, 1])) == 1.0
    assert batch_entropy(np.array(["a", "b", "c", "d"])) == 2.0
    assert math.isclose(entropy(np.array([1, 1, 2])), 1.5)
    assert mean_batch_entropy([np.array([0, 0]), np.array([0, 1])]) == 0.5


def test_empty_input_is_rejected():
    with pytest.raises(ValueError, match="at least one label"):
        batch_entropy(np.array([]))
    with pytest.raises(ValueError, match="at least one minibatch"):
        mean_batch_entropy([])
    with pytest.raises(ValueError, match="positive sum"):
        entropy(np.zeros(3))


def test_bounds_follow_the_paper_formula():
    p = np.full(14, 1 / 14)
    lo, hi = entropy_bounds(p, block_size=16, batch_size=64)
    bias = 13 / (2 * 64 * math.log(2))
    assert math.isclose(hi, math.log2(14) - bias) and math.isclose(lo, math.log2(14) - 16 * bias)
    assert entropy_bounds(p, block_size=1, batch_size=64) == (hi, hi)
    with pytest.raises(ValueError, match="block_size"):
        entropy_bounds(p, block_size=0, batch_size=4)


def minibatch_entropy(sampler, labels, m):
    plan = sampler.plan(len(labels), seed=0, epoch=0)
    out = []
    for fetch in plan:
        cells = fetch.cell_ids()[
            np.random.default_rng(fetch.shuffle_seed).permutation(fetch.n_cells)
        ]
        out += [labels[cells[i : i + m]] for i in range(0, len(cells) - m + 1, m)]
    return mean_batch_entropy(out)


def test_block_sampling_on_plate_ordered_labels_lies_within_the_bounds():
    labels = np.repeat(np.arange(8), 4096)  # 8 plates stored one after another
    m = 32
    p = np.bincount(labels) / len(labels)
    chunk = minibatch_entropy(ChunkShuffle(chunk_cells=1024), labels, m)
    assert chunk < 0.1  # contiguous chunks: one plate per minibatch
    for b, f in [(1, 4), (4, 16), (16, 64)]:
        lo, hi = entropy_bounds(p, block_size=b, batch_size=m)
        h = minibatch_entropy(BlockShuffle(block_size=b, fetch_factor=f, batch_size=m), labels, m)
        assert lo - 0.02 <= h <= hi + 0.02, (b, f, lo, h, hi)
