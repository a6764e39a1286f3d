"""Global block sampling with a fetch factor (scDataset, Algorithm 1).

Cells are cut into blocks of ``block_size`` contiguous cells; a seeded Feistel permutation
orders the blocks of the whole dataset; fetch ``i`` takes the next ``ceil(fetch_factor *
batch_size / block_size)`` blocks in that order, sorted by position so neighbouring blocks
coalesce into one read, and the chunk is shuffled in memory before it is cut into minibatches.
Small blocks and a large fetch factor give minibatches close to uniform random sampling
(``block_size=1`` *is* random sampling); large blocks give long sequential reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slafload._validate import check_int
from slafload.pipeline.ranges import block_ranges
from slafload.samplers.base import Fetch, MinibatchFetches, Plan, derive_seed
from slafload.samplers.feistel import FeistelPermutation

__all__ = ["BlockShuffle"]


class _BlockPlan(Plan):
    """Fetch ``i`` reads the blocks at permuted positions ``[i * k, (i + 1) * k)``."""

    def __init__(self, n_cells: int, block_size: int, blocks_per_fetch: int, seed: int):
        self._n_cells = n_cells
        self._block_size = block_size
        self._per_fetch = blocks_per_fetch
        self._n_blocks = -(-n_cells // block_size)
        self._perm = FeistelPermutation(max(self._n_blocks, 1), seed=derive_seed(seed, 0))
        self._seed = seed

    def __len__(self) -> int:
        return -(-self._n_blocks // self._per_fetch)

    @property
    def n_cells(self) -> int:
        return self._n_cells

    def fetch_sizes(self) -> np.ndarray:
        blocks = np.full(len(self), self._per_fetch, dtype=np.int64)
        if len(blocks):
            blocks[-1] = self._n_blocks - self._per_fetch * (len(blocks) - 1)
        sizes = blocks * self._block_size
        if self._n_blocks:  # the fetch holding the short last block
            short = self._n_blocks * self._block_size - self._n_cells
            sizes[int(self._perm.inverse(self._n_blocks - 1)) // self._per_fetch] -= short
        return sizes

    def fetch(self, index: int) -> Fetch:
        first = index * self._per_fetch
        positions = np.arange(first, min(first + self._per_fetch, self._n_blocks))
        ranges = block_ranges(self._perm(positions), self._block_size, self._n_cells)
        return Fetch(index, ranges, derive_seed(self._seed, 1, index))


@dataclass(frozen=True)
class BlockShuffle(MinibatchFetches):
    """scDataset's block sampling: random blocks of contiguous cells, fetched in batches.

    Args:
        block_size: ``b``, contiguous cells per block; ``1`` is uniform random sampling.
        fetch_factor: ``f``, minibatches fetched (and shuffled together) per read.
        batch_size: ``m``, the minibatch size; a fetch holds ``ceil(f * m / b)`` blocks. Leave
            it unset under a :class:`~slafload.Loader`, which sets its own; give it only to
            plan without a loader.

    Every cell appears exactly once per epoch. Planning an epoch stores no per-cell or
    per-block array: fetch ``i`` is computed from ``(seed, epoch, i)`` when it is requested.

    >>> plan = BlockShuffle(block_size=4, fetch_factor=2, batch_size=4).plan(100, seed=0, epoch=0)
    >>> len(plan), plan[0].n_cells
    (13, 8)
    """

    block_size: int = 16
    fetch_factor: int = 64
    batch_size: int | None = None

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size)
        check_int("fetch_factor", self.fetch_factor)
        check_int("batch_size", self.batch_size, none_ok=True)

    @property
    def blocks_per_fetch(self) -> int:
        """Blocks read per fetch: enough for ``fetch_factor`` minibatches."""
        return -(-self.fetch_factor * self._minibatch() // self.block_size)

    def plan(self, n_cells: int, *, seed: int, epoch: int) -> Plan:
        """The epoch's fetches (see :class:`~slafload.samplers.base.Sampler`)."""
        return _BlockPlan(
            n_cells, self.block_size, self.blocks_per_fetch, derive_seed(seed, epoch, 2)
        )
