"""Restrict any sampler to a subset of cells (train/test splits without rewriting data).

The wrapped sampler plans over subset *positions* ``[0, len(subset))``; :class:`Subset` maps
each fetch's position ranges back to real cell ranges, splitting a range wherever the subset
has a gap. The subset is stored as runs of consecutive cell ids, so a contiguous split (e.g. all
plates but one, on plate-ordered data) costs a few integers however many cells it holds.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import numpy as np

from slafload.pipeline.ranges import expand_ranges
from slafload.samplers.base import Fetch, Plan, Sampler, array_digest, bind_batch_size

if TYPE_CHECKING:
    import polars as pl

    from slafload.data.dataset import SlafDataset

__all__ = ["Subset"]


class Subset:
    """``sampler`` restricted to the cells ``cell_ids`` (any order, duplicates ignored).

    Args:
        sampler: Any sampler; it plans over the subset's positions.
        cell_ids: Integer cell ids to keep.

    >>> from slafload.samplers import Streaming
    >>> plan = Subset(Streaming(chunk_cells=4), [0, 1, 2, 5, 6, 9]).plan(10, seed=0, epoch=0)
    >>> plan[0].ranges.tolist(), plan[1].ranges.tolist()
    ([[0, 3], [5, 6]], [[6, 7], [9, 10]])
    """

    def __init__(self, sampler: Sampler, cell_ids: np.ndarray | list[int]):
        if not isinstance(sampler, Sampler):
            raise TypeError(f"sampler must implement plan(), got {type(sampler).__name__}")
        ids = np.unique(np.asarray(cell_ids))
        if ids.dtype.kind not in "iu" and len(ids):
            raise ValueError(f"cell_ids must be integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64)
        if len(ids) and ids[0] < 0:
            raise ValueError(f"cell_ids must be non-negative, got {ids[0]}")
        self.sampler = sampler
        new_run = np.ones(len(ids), dtype=bool)
        new_run[1:] = np.diff(ids) != 1
        runs = np.flatnonzero(new_run)
        self._run_cell = ids[runs]  # first cell id of each run of consecutive ids
        self._run_pos = np.append(runs, len(ids))  # subset position of each run's start
        self.n_cells = len(ids)

    @classmethod
    def where(cls, sampler: Sampler, dataset: SlafDataset, predicate: pl.Expr) -> Subset:
        """The cells whose obs row satisfies a Polars predicate, e.g.
        ``Subset.where(BlockShuffle(), ds, pl.col("plate") != "plate_13")``.
        """
        obs = dataset.obs().with_row_index("_row")
        return cls(sampler, obs.filter(predicate).get_column("_row").to_numpy())

    def cell_ids(self) -> np.ndarray:
        """The subset's cell ids, ascending."""
        return expand_ranges(
            np.stack([self._run_cell, self._run_cell + np.diff(self._run_pos)], axis=1)
        )

    def __repr__(self) -> str:
        runs = array_digest(np.concatenate([self._run_cell, self._run_pos]))
        return (
            f"Subset({self.sampler!r}, {self.n_cells} cells in {len(self._run_cell)} runs, "
            f"digest={runs.split(':')[1]})"
        )

    def with_batch_size(self, batch_size: int) -> Subset:
        """This subset of the wrapped sampler bound to ``batch_size`` (see ``bind_batch_size``)."""
        bound = bind_batch_size(self.sampler, batch_size)
        if bound is self.sampler:
            return self
        out = copy.copy(self)
        out.sampler = bound
        return out

    def plan(self, n_cells: int, *, seed: int, epoch: int) -> Plan:
        """The wrapped sampler's plan, mapped onto the subset's cells."""
        if len(self._run_cell) and self._run_cell[-1] + np.diff(self._run_pos)[-1] > n_cells:
            raise ValueError(
                f"the subset holds cell ids up to {self.cell_ids()[-1]}, but the dataset has "
                f"only {n_cells} cells; build the subset from this dataset's cell ids"
            )
        return _SubsetPlan(self.sampler.plan(self.n_cells, seed=seed, epoch=epoch), self)


class _SubsetPlan(Plan):
    def __init__(self, inner: Plan, subset: Subset):
        self._inner = inner
        self._run_cell = subset._run_cell
        self._run_pos = subset._run_pos
        self._n_cells = subset.n_cells

    def __len__(self) -> int:
        return len(self._inner)

    @property
    def n_cells(self) -> int:
        return self._inner.n_cells

    def fetch_sizes(self) -> np.ndarray:
        return self._inner.fetch_sizes()

    def fetch(self, index: int) -> Fetch:
        inner = self._inner.fetch(index)
        return Fetch(inner.index, self.to_cells(inner.ranges), inner.shuffle_seed)

    def to_cells(self, ranges: np.ndarray) -> np.ndarray:
        """Map position ranges to cell ranges, in order, split at the subset's gaps."""
        ranges = ranges[ranges[:, 1] > ranges[:, 0]]
        first_run = np.searchsorted(self._run_pos, ranges[:, 0], side="right") - 1
        last_run = np.searchsorted(self._run_pos, ranges[:, 1] - 1, side="right") - 1
        pieces = last_run - first_run + 1
        which = np.repeat(np.arange(len(ranges)), pieces)
        run = expand_ranges(np.stack([first_run, first_run + pieces], axis=1))
        lo = np.maximum(ranges[which, 0], self._run_pos[run])
        hi = np.minimum(ranges[which, 1], self._run_pos[run + 1])
        shift = self._run_cell[run] - self._run_pos[run]
        return np.stack([lo + shift, hi + shift], axis=1).astype(np.int64)
