"""Weighted and class-balanced sampling, with block-level I/O.

Weights are given per cell (or per category of an obs column, expanded to cells). Cells are
grouped into blocks of ``block_size`` contiguous cells; a block's weight is the sum of its
cells' weights, blocks are drawn by weight, and a drawn block is read whole, so reads stay as
long as in :class:`~slafload.samplers.block.BlockShuffle`. With ``block_size=1`` the weights
apply to cells exactly; with larger blocks a cell's chance is its *block's* weight, which is
exact whenever weights are constant within blocks (e.g. per-category weights on data stored
category by category) and an approximation otherwise.

Epoch semantics:

- ``replacement=True``: an epoch is ``n_draws`` cells (default: the number of cells) made of
  independent block draws with probability proportional to block weight; the last draw is cut
  so the epoch holds exactly ``n_draws`` cells. A cell may appear several times per epoch, or
  never; over many epochs its frequency is proportional to its block's weight.
- ``replacement=False``: a weighted random order of the blocks with positive weight
  (Efraimidis-Spirakis keys ``log(u) / w``): every cell with positive block weight appears
  exactly once per epoch, heavier blocks tend to come first, and ``n_draws`` (default: all of
  them) keeps only the first ``n_draws`` cells of that order.

Unlike :class:`BlockShuffle`, a weighted plan holds one integer per drawn block (the weights
themselves are one float per cell already).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from slafload._validate import check_int
from slafload.pipeline.ranges import merge_ranges
from slafload.samplers.base import Fetch, MinibatchFetches, Plan, array_digest, derive_seed

if TYPE_CHECKING:
    from slafload.data.dataset import SlafDataset

__all__ = ["ClassBalanced", "Weighted"]


class _DrawPlan(Plan):
    """Fetch ``i`` reads drawn blocks ``[i * k, (i + 1) * k)``; ``stops`` trims the last one."""

    def __init__(self, starts: np.ndarray, stops: np.ndarray, per_fetch: int, seed: int):
        self._starts, self._stops = starts, stops
        self._per_fetch = per_fetch
        self._seed = seed

    def __len__(self) -> int:
        return -(-len(self._starts) // self._per_fetch)

    @property
    def n_cells(self) -> int:
        return int((self._stops - self._starts).sum())

    def fetch_sizes(self) -> np.ndarray:
        firsts = np.arange(0, len(self._starts), self._per_fetch)
        return np.add.reduceat(self._stops - self._starts, firsts) if len(firsts) else firsts

    def fetch(self, index: int) -> Fetch:
        part = slice(index * self._per_fetch, (index + 1) * self._per_fetch)
        ranges = merge_ranges(self._starts[part], self._stops[part])
        return Fetch(index, ranges, derive_seed(self._seed, 1, index))


@dataclass(frozen=True, eq=False)
class Weighted(MinibatchFetches):
    """Cells drawn by weight, block by block (see the module docstring for epoch semantics).

    Args:
        weights: ``float[n_cells]`` non-negative finite weights, not all zero.
        replacement: Draw blocks independently (True) or a weighted order without repeats.
        n_draws: Cells per epoch; default: all cells (with replacement) or all cells of
            positive-weight blocks (without).
        block_size: As in :class:`BlockShuffle`.
        fetch_factor: As in :class:`BlockShuffle`.
        batch_size: As in :class:`BlockShuffle`.
    """

    weights: np.ndarray = field(repr=False)
    digest: str = field(init=False, repr=True, compare=False)
    replacement: bool = True
    n_draws: int | None = None
    block_size: int = 1
    fetch_factor: int = 64
    batch_size: int | None = None

    def __post_init__(self) -> None:
        w = np.asarray(self.weights, dtype=np.float64)
        if w.ndim != 1 or not np.isfinite(w).all() or (w < 0).any() or not w.sum() > 0:
            raise ValueError(
                "weights must be a 1-d array of finite non-negative numbers, one per cell, "
                "with a positive sum"
            )
        object.__setattr__(self, "weights", w)
        object.__setattr__(self, "digest", array_digest(w))
        for name in ("block_size", "fetch_factor"):
            check_int(name, getattr(self, name))
        check_int("batch_size", self.batch_size, none_ok=True)
        check_int("n_draws", self.n_draws, none_ok=True)

    @classmethod
    def from_categories(
        cls, dataset: SlafDataset, column: str, weights: Mapping[Any, float], **options: Any
    ) -> Weighted:
        """Per-category weights of an obs column; categories not in ``weights`` get 0."""
        codes, categories = dataset.obs_codes(column)
        labels = categories if categories is not None else np.unique(codes).tolist()
        unknown = set(weights) - set(labels)
        if unknown:
            raise ValueError(
                f"weights name categories {sorted(map(str, unknown))} that obs column "
                f"{column!r} does not have; it has {labels[:20]}"
            )
        if categories is None:  # integer column: codes are the values themselves
            per_cell = np.array([float(weights.get(c, 0.0)) for c in labels])
            return cls(per_cell[np.searchsorted(labels, codes)], **options)
        table = np.array([float(weights.get(c, 0.0)) for c in categories])
        return cls(table[codes], **options)

    def plan(self, n_cells: int, *, seed: int, epoch: int) -> Plan:
        """The epoch's fetches (see :class:`~slafload.samplers.base.Sampler`)."""
        if n_cells != len(self.weights):
            raise ValueError(
                f"weights has {len(self.weights)} entries but the dataset has {n_cells} cells; "
                "give one weight per cell (wrap in Subset to sample a subset)"
            )
        b = self.block_size
        block_w = np.add.reduceat(self.weights, np.arange(0, n_cells, b))
        sizes = np.minimum(np.arange(len(block_w)) * b + b, n_cells) - np.arange(len(block_w)) * b
        rng = np.random.default_rng(derive_seed(seed, epoch, 3))
        if self.replacement:
            want = n_cells if self.n_draws is None else self.n_draws
            p = block_w / block_w.sum()
            blocks = rng.choice(len(block_w), size=-(-want // b), p=p)
            while sizes[blocks].sum() < want:  # the short last block was drawn
                blocks = np.append(blocks, rng.choice(len(block_w), size=1, p=p))
        else:
            positive = np.flatnonzero(block_w > 0)
            keys = np.log(rng.random(len(positive))) / block_w[positive]
            blocks = positive[np.argsort(-keys, kind="stable")]
            want = int(sizes[blocks].sum()) if self.n_draws is None else self.n_draws
        starts = blocks * b
        stops = starts + sizes[blocks]
        ends = np.cumsum(stops - starts)
        keep = int(np.searchsorted(ends, want)) + 1  # blocks needed to reach `want` cells
        starts, stops = starts[:keep], stops[:keep].copy()
        if len(stops):
            stops[-1] -= max(0, int(ends[keep - 1]) - want)
        per_fetch = -(-self.fetch_factor * self._minibatch() // b)
        return _DrawPlan(starts, stops, per_fetch, derive_seed(seed, epoch, 4))


@dataclass(frozen=True, eq=False)
class ClassBalanced(MinibatchFetches):
    """Every class of a label drawn equally often: cell weight ``1 / (cells of its class)``.

    Args:
        labels: ``int[n_cells]`` class code per cell (e.g. from ``dataset.obs_codes``).
        replacement: As in :class:`Weighted`; with replacement (the default) rare classes are
            repeated to match common ones.
        n_draws: As in :class:`Weighted`.
        block_size: As in :class:`Weighted`.
        fetch_factor: As in :class:`Weighted`.
        batch_size: As in :class:`Weighted`.

    Use :meth:`from_obs` to balance an obs column of a dataset.
    """

    labels: np.ndarray = field(repr=False)
    digest: str = field(init=False, repr=True, compare=False)
    replacement: bool = True
    n_draws: int | None = None
    block_size: int = 1
    fetch_factor: int = 64
    batch_size: int | None = None
    _weighted: Weighted = field(init=False, repr=False)

    def __post_init__(self) -> None:
        labels = np.asarray(self.labels)
        if labels.ndim != 1 or labels.dtype.kind not in "iu":
            raise ValueError("labels must be a 1-d integer array, one class code per cell")
        _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
        weighted = Weighted(
            1.0 / counts[inverse],
            replacement=self.replacement,
            n_draws=self.n_draws,
            block_size=self.block_size,
            fetch_factor=self.fetch_factor,
            batch_size=self.batch_size,
        )
        object.__setattr__(self, "_weighted", weighted)
        object.__setattr__(self, "digest", array_digest(labels))

    @classmethod
    def from_obs(cls, dataset: SlafDataset, column: str, **options: Any) -> ClassBalanced:
        """Balance the categories of obs column ``column`` of ``dataset``."""
        codes, _ = dataset.obs_codes(column)
        return cls(codes, **options)

    def plan(self, n_cells: int, *, seed: int, epoch: int) -> Plan:
        """The epoch's fetches (see :class:`~slafload.samplers.base.Sampler`)."""
        return self._weighted.plan(n_cells, seed=seed, epoch=epoch)
