"""Samplers that read contiguous chunks of cells: storage order, or SLAF-style chunk shuffle."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slafload._validate import check_int
from slafload.samplers.base import Fetch, Plan, derive_seed


class _ChunkPlan(Plan):
    """Fetch ``i`` reads the contiguous cells of chunk ``chunk_order[i]``."""

    def __init__(
        self, n_cells: int, chunk_cells: int, chunk_order: np.ndarray, shuffle_seed: int | None
    ):
        self._n_cells = n_cells
        self._chunk_cells = chunk_cells
        self._order = chunk_order
        self._seed = shuffle_seed

    def __len__(self) -> int:
        return len(self._order)

    @property
    def n_cells(self) -> int:
        return self._n_cells

    def fetch_sizes(self) -> np.ndarray:
        starts = self._order * self._chunk_cells
        return np.minimum(starts + self._chunk_cells, self._n_cells) - starts

    def fetch(self, index: int) -> Fetch:
        start = int(self._order[index]) * self._chunk_cells
        stop = min(start + self._chunk_cells, self._n_cells)
        seed = None if self._seed is None else derive_seed(self._seed, index)
        return Fetch(index, np.array([[start, stop]], dtype=np.int64), seed)


def _n_chunks(n_cells: int, chunk_cells: int) -> int:
    return -(-n_cells // chunk_cells)


@dataclass(frozen=True)
class Streaming:
    """Storage order, no shuffling: chunks of ``chunk_cells`` consecutive cells, in order.

    The fastest plan and the one to use for inference or evaluation.
    """

    chunk_cells: int = 2048

    def __post_init__(self) -> None:
        check_int("chunk_cells", self.chunk_cells)

    def plan(self, n_cells: int, *, seed: int, epoch: int) -> Plan:
        """The epoch's fetches (see :class:`~slafload.samplers.base.Sampler`)."""
        order = np.arange(_n_chunks(n_cells, self.chunk_cells), dtype=np.int64)
        return _ChunkPlan(n_cells, self.chunk_cells, order, None)


@dataclass(frozen=True)
class ChunkShuffle:
    """SLAF's behaviour: contiguous chunks, visited in a seeded random order, each shuffled
    in memory.

    Reads stay long and sequential, so this runs at nearly the raw scan speed; but every
    minibatch comes from ``chunk_cells`` neighbouring cells, so on data stored plate by plate
    a minibatch sees one plate. Use a block sampler when that matters.
    """

    chunk_cells: int = 2048

    def __post_init__(self) -> None:
        check_int("chunk_cells", self.chunk_cells)

    def plan(self, n_cells: int, *, seed: int, epoch: int) -> Plan:
        """The epoch's fetches (see :class:`~slafload.samplers.base.Sampler`)."""
        rng = np.random.default_rng(derive_seed(seed, epoch, 0))
        order = rng.permutation(_n_chunks(n_cells, self.chunk_cells)).astype(np.int64)
        return _ChunkPlan(n_cells, self.chunk_cells, order, derive_seed(seed, epoch, 1))
