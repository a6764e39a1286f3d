"""A mixed fetch: one contiguous block of cells per source, interleaved cell by cell.

A mixture's fetch (:class:`MixedFetch`) holds, for each source ``k``, a block of
``counts[k]`` cells read contiguously from that source (its ranges come first in read order
for source 0, then source 1, ...). Its output order is a seeded *stratified schedule*: the
``i``-th cell of source ``k``'s block gets the key ``(i + u_k) / counts[k]`` (``u_k`` uniform
from the fetch's seed) and output positions follow the keys, so every window of ``m`` output
positions holds ``m * counts[k] / n_cells`` cells of source ``k``, give or take one. Within its
block a source's cells are shuffled (seeded) unless that source's sampler keeps read order.

Cutting a mixed fetch among ranks (:meth:`MixedFetch.sliced`) cuts the *schedule*: output
positions ``[start, stop)`` of the schedule name, per source, a contiguous run of that
source's block, so every rank's part is itself a mixed fetch of the same proportions, read
contiguously per source, and consecutive slices hold every cell once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from slafload.pipeline.ranges import ranges_of, slice_ranges
from slafload.samplers.base import derive_seed
from slafload.types import Fetch


@dataclass(frozen=True, eq=False, repr=False)
class MixedFetch(Fetch):
    """A fetch made of one block per source, output in a seeded stratified schedule.

    Attributes:
        counts: ``int64[n_sources]`` cells of each source's block, in read order.
        runs: ``int64[n_runs]`` sizes of consecutive read-order runs (none crosses a block),
            each shuffled on its own: a run is a piece of one of its source's own fetches,
            so a source's passes and fetches stay in order.
        shuffled: ``bool[n_runs]`` whether each run is shuffled (its sampler shuffles).
        unit: The schedule places a source's cells ``unit`` at a time: ``1`` mixes cell by
            cell; the batch size (``mix="batch"``, block counts multiples of it) gives every
            batch one source.
    """

    counts: np.ndarray = field(kw_only=True)
    runs: np.ndarray = field(kw_only=True)
    shuffled: np.ndarray = field(kw_only=True)
    unit: int = field(default=1, kw_only=True)

    @property
    def _seed(self) -> int:
        return 0 if self.shuffle_seed is None else int(self.shuffle_seed)

    def _schedule(self) -> np.ndarray:
        """Read-order block positions (source 0's block, then source 1's, ...) in output
        order: the stratified schedule.
        """
        counts = np.asarray(self.counts, dtype=np.int64)
        u = np.random.default_rng(derive_seed(self._seed, 1)).random(len(counts))
        labels = np.repeat(np.arange(len(counts)), counts)
        within = np.arange(len(labels)) - np.repeat(np.cumsum(counts) - counts, counts)
        turns = -(-counts // self.unit)  # a source's cells come in turns of ``unit`` cells
        keys = (within // self.unit + u[labels]) / np.maximum(turns, 1)[labels]
        return np.lexsort((labels, keys)).astype(np.int64)

    def output_order(self) -> np.ndarray:
        """Read-order cell of each output position: the sources interleaved by schedule,
        each run of a source's block in its own seeded shuffle.
        """
        runs = np.asarray(self.runs, dtype=np.int64)
        starts = (np.cumsum(runs) - runs).tolist()
        pieces = [np.zeros(0, np.int64)] + [
            s + np.random.default_rng(derive_seed(self._seed, 2, r)).permutation(n)
            if shuffle
            else s + np.arange(n)
            for r, (s, n, shuffle) in enumerate(
                zip(starts, runs.tolist(), self.shuffled, strict=True)
            )
        ]
        return np.concatenate(pieces).astype(np.int64)[self._schedule()]

    def sliced(self, index: int, start: int, stop: int, seed: int | None) -> Fetch:
        """Schedule positions ``[start, stop)``: a contiguous run of each source's block."""
        lengths = self.ranges[:, 1] - self.ranges[:, 0]
        if (
            start == 0
            and stop == int(lengths.sum())
            and (lengths > 0).all()
            and (np.asarray(self.runs) > 0).all()
        ):
            # the whole fetch (one rank's part): the same blocks, no schedule to cut
            return dataclasses.replace(self, index=index, shuffle_seed=seed)
        return self._cut(index, start, stop, seed)

    def _cut(self, index: int, start: int, stop: int, seed: int | None) -> MixedFetch:
        counts = np.asarray(self.counts, dtype=np.int64)
        labels = np.repeat(np.arange(len(counts)), counts)[self._schedule()]
        before = np.bincount(labels[:start], minlength=len(counts))
        upto = np.bincount(labels[:stop], minlength=len(counts))
        lo = np.cumsum(counts) - counts + before
        hi = lo + (upto - before)
        edges = np.concatenate([[0], np.cumsum(self.runs)])
        cut = [np.clip(edges, a, b) for a, b in zip(lo.tolist(), hi.tolist(), strict=True)]
        runs = np.concatenate([np.diff(c) for c in cut]) if cut else np.zeros(0, np.int64)
        flags = np.tile(np.asarray(self.shuffled, dtype=bool), len(cut))
        ranges = [slice_ranges(self.ranges, a, b) for a, b in zip(lo, hi, strict=True)]
        return MixedFetch(
            index,
            np.concatenate([np.zeros((0, 2), np.int64), *ranges]),
            seed,
            counts=upto - before,
            runs=runs[runs > 0],
            shuffled=flags[runs > 0],
            unit=self.unit,
        )

    def without(self, taken: np.ndarray, seed: int | None) -> Fetch:
        """The cells not in ``taken`` (counted with multiplicity), each source's left in one
        sorted run.
        """
        counts = np.asarray(self.counts, dtype=np.int64)
        labels = np.repeat(np.arange(len(counts)), counts)
        cells = self.cell_ids()
        keep = _left_after(cells, np.asarray(taken, dtype=np.int64))
        left = np.bincount(labels[keep], minlength=len(counts)).astype(np.int64)
        run_source = labels[np.cumsum(self.runs, dtype=np.int64) - 1]  # each run's source
        shuffled = np.asarray(self.shuffled, dtype=bool)
        shuffle = np.array([bool(shuffled[run_source == k].any()) for k in range(len(counts))])
        pieces = [np.sort(cells[keep & (labels == k)]) for k in range(len(counts))]
        ranges = [ranges_of(p) if len(np.unique(p)) == len(p) else _single(p) for p in pieces]
        return MixedFetch(
            self.index,
            np.concatenate([np.zeros((0, 2), np.int64), *ranges]),
            seed,
            counts=left,
            runs=left[left > 0],
            shuffled=shuffle[left > 0],
            unit=self.unit,
        )

    def __repr__(self) -> str:
        return f"MixedFetch(index={self.index}, counts={np.asarray(self.counts).tolist()})"


def _left_after(cells: np.ndarray, taken: np.ndarray) -> np.ndarray:
    """``bool[len(cells)]``: the positions left once each id of ``taken`` has removed one
    copy of itself from ``cells`` (a multiset difference; repeats of a cell stay apart).
    """
    order = np.argsort(cells, kind="stable")
    ids = cells[order]
    first = np.searchsorted(ids, ids, side="left")
    copy = np.arange(len(ids)) - first  # 0 for an id's first copy, 1 for its second, ...
    values, removed = np.unique(taken, return_counts=True)
    at = np.clip(np.searchsorted(values, ids), 0, max(len(values) - 1, 0))
    gone = np.zeros(len(ids), dtype=np.int64)
    if len(values):
        gone = np.where(values[at] == ids, removed[at], 0)
    keep = np.empty(len(cells), dtype=bool)
    keep[order] = copy >= gone
    return keep


def _single(cells: np.ndarray) -> np.ndarray:
    """Sorted cells with repeats as one range per cell (repeats must stay apart)."""
    return np.stack([cells, cells + 1], axis=1).astype(np.int64).reshape(-1, 2)
