"""Mixing the plans of several sources into one epoch plan, by weight.

A mixture (:mod:`slafload.data.mixture`) reads several SLAF datasets as one: source ``k``'s cells
are the *global* cell ids ``[offsets[k], offsets[k + 1])``. Each source keeps its own sampler;
its plan's fetches, one after the other, make the source's *stream* for the epoch.
:class:`MixtureSampler` cuts the streams into mixed fetches
(:class:`~slafload.samplers.interleave.MixedFetch`): fetch ``j`` holds a contiguous block of
every source's stream, read as that source's own ranges, and outputs its cells in a seeded
stratified schedule, so every batch draws from the sources in proportion to their rates.
Everything is arithmetic on ``(seed, epoch)``, so partitioning among ranks
(:mod:`slafload.pipeline.partition`) and resume work on the mixed plan exactly as on a single source's.

Epoch semantics (``epoch_cells``):

``None`` (default): one pass over every source
    An epoch holds every cell of every source's plan for that epoch, so every cell of every
    source comes exactly once (for the built-in samplers). Weights shape the *mixing*: while
    every source still has cells left, source ``k`` supplies cells at a rate proportional to
    ``weights[k]``; a source that runs out leaves the rest of the epoch to the others. The
    default weights are the sources' sizes, so every source lasts the whole epoch.
``epoch_cells=M``: a fixed number of cells drawn by weight
    An epoch holds exactly ``M`` cells, ``quota[k] = M * weights[k] / sum(weights)`` of them
    from source ``k`` (largest-remainder rounding), mixed at those rates throughout. Each
    source's cells come from its own stream: its sampler's epochs 0, 1, 2, ... back to back,
    so mixture epoch ``e`` takes cells ``[e * quota[k], (e + 1) * quota[k])`` of that stream.
    A down-weighted source thus takes several mixture epochs to go through its cells once, an
    up-weighted one goes through its cells several times per mixture epoch, and within one
    pass of a source no cell repeats (sampling without replacement within a pass).

Sizes and memory: a mixed fetch holds one fetch's worth of every source (the sum of the
sources' largest fetches), capped at ``fetch_cells`` (the loader derives it from
``memory_budget``), and source ``k``'s block in it is that size times its share. Where the cap
binds (many sources), every source's contiguous read per fetch shrinks in proportion. Within its block a
source's cells are shuffled fetch by fetch of its own plan (a piece of one of its fetches is
shuffled on its own), so a source's fetches and passes keep their order.

``mix="batch"``: the same mixed fetches, in whole batches: each source's block is a multiple
of the batch size and the schedule places a source's cells a batch at a time, so every batch
comes from one source and the sources take turns by weight within every fetch. On
``world_size`` ranks this holds when a fetch's size is a multiple of
``batch_size * world_size`` (as with power-of-two sizes); the last cells of each source's
stream (less than a batch) end the epoch together, and the fetches left partly consumed by an
elastic resume may mix.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from slafload.pipeline.ranges import slice_ranges
from slafload.samplers.base import Fetch, Plan, derive_seed
from slafload.samplers.interleave import MixedFetch
from slafload.types import Sampler

_INTERLEAVE = 0x6D6978  # keys the interleaving's random stream apart from the samplers'


def quotas(total: int, weights: Sequence[float]) -> np.ndarray:
    """``int64`` cells per source summing to ``total``, proportional to ``weights``.

    Largest-remainder rounding; ties go to the earlier source.
    """
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    base = np.floor(exact).astype(np.int64)
    short = total - int(base.sum())
    order = np.lexsort((np.arange(len(w)), -(exact - base)))
    base[order[:short]] += 1
    return base


@dataclass(frozen=True, eq=False)
class MixtureSampler:
    """Mixes the plans of several sources' samplers (see the module docstring).

    Args:
        names: Source names (in checkpoints and refusals).
        uris: Source dataset URIs.
        sizes: Cells of each source.
        offsets: ``int64[k + 1]`` first global cell id of each source, then the total.
        weights: Positive weight of each source.
        samplers: Each source's sampler (already bound to the loader's batch size).
        epoch_cells: ``None``: one pass over every source; else cells per epoch.
        fetch_cells: At most this many cells per mixed fetch (the memory budget's share);
            ``None``: no cap.
        mix: ``"cell"``: cells interleaved within every fetch; ``"batch"``: one source per
            fetch, fetches a multiple of ``batch_size``.
        batch_size: The loader's batch size (``mix="batch"`` sizes fetches by it).
    """

    names: tuple[str, ...]
    uris: tuple[str, ...]
    sizes: tuple[int, ...]
    weights: tuple[float, ...]
    samplers: tuple[Sampler, ...]
    epoch_cells: int | None = None
    mix: str = "cell"
    batch_size: int = 1
    fetch_cells: int | None = None

    @property
    def offsets(self) -> np.ndarray:
        """``int64[k + 1]``: each source's first global cell id, then the total."""
        return np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])

    def plan(self, n_cells: int, *, seed: int, epoch: int) -> Plan:
        """The mixed plan of ``epoch``: the sources' fetches interleaved by weight."""
        if n_cells != sum(self.sizes):
            raise ValueError(
                f"a mixture of {sum(self.sizes)} cells was asked to plan {n_cells} cells; "
                "plan the mixture with its own size (Mixture.n_cells)"
            )
        windows = [self._window(k, seed, epoch) for k in range(len(self.sizes))]
        if len(windows) == 1:
            return _OnePlan(windows[0])
        totals = np.array([w.n_cells for w in windows], dtype=np.int64)
        # one fetch of each source per mixed fetch, as far as fetch_cells (memory) allows
        width = sum(int(w.sizes.max()) for w in windows if len(w.sizes))
        if self.fetch_cells is not None:  # rounding per source moves a fetch's end by < K
            width = min(width, self.fetch_cells - (len(windows) - 1))
        width = max(width, 1)
        rates = self._rates(windows)
        unit = self.batch_size if self.mix == "batch" else 1
        if unit == 1:
            cum = _cumulative(totals, rates, width)
        else:  # whole batches, every stream's last partial batch in a last fetch
            u = np.random.default_rng(derive_seed(seed, epoch, _INTERLEAVE)).random(len(totals))
            batches = 1 << (max(width // unit, 1).bit_length() - 1)  # a power of two
            cum = _by_units(totals // unit, rates, batches, u) * unit
            if (totals % unit).any():
                cum = np.vstack([cum, totals])
        return MixedPlan(windows, self.offsets, cum, seed, epoch, unit)

    def _rates(self, windows: Sequence[_Window]) -> np.ndarray:
        if self.epoch_cells is None:
            return np.asarray(self.weights, dtype=np.float64)
        return np.array([max(w.n_cells, 1) for w in windows], dtype=np.float64)

    def _window(self, k: int, seed: int, epoch: int) -> _Window:
        def plan(e: int) -> Plan:
            return self.samplers[k].plan(self.sizes[k], seed=seed, epoch=e)

        if self.epoch_cells is None:
            return _Window.whole(plan(epoch))
        quota = int(quotas(self.epoch_cells, self.weights)[k])
        return _Window.cut(plan, epoch * quota, (epoch + 1) * quota, self.names[k])

    def order_settings(self) -> dict[str, object]:
        """The mixture's settings, named apart in a checkpoint's order (refusals name them)."""
        return {
            "sources": list(self.names),
            "uris": list(self.uris),
            "source_cells": list(self.sizes),
            "weights": list(self.weights),
            "source_samplers": [repr(s) for s in self.samplers],
            "epoch_cells": self.epoch_cells,
            "mix": self.mix if self.mix == "cell" else f"{self.mix}:{self.batch_size}",
            "fetch_cells": self.fetch_cells,
        }

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{n}={w:g}:{s!r}"
            for n, w, s in zip(self.names, self.weights, self.samplers, strict=True)
        )
        mode = "one_pass" if self.epoch_cells is None else f"epoch_cells={self.epoch_cells}"
        mix = "" if self.mix == "cell" else f", mix={self.mix}:{self.batch_size}"
        return f"MixtureSampler({mode}{mix}; {parts})"


@dataclass(frozen=True, eq=False)
class _Window:
    """A source's fetches in one mixture epoch: fetch ``index[i]`` of plan ``passes[i]``,
    cut to its read-order cells ``[start[i], stop[i])``.
    """

    plans: dict[int, Plan]
    passes: np.ndarray
    index: np.ndarray
    start: np.ndarray
    stop: np.ndarray

    @property
    def sizes(self) -> np.ndarray:
        return self.stop - self.start

    @property
    def n_cells(self) -> int:
        return int(self.sizes.sum())

    @classmethod
    def whole(cls, plan: Plan) -> _Window:
        sizes = np.asarray(plan.fetch_sizes(), dtype=np.int64)
        n = len(sizes)
        zeros = np.zeros(n, dtype=np.int64)
        return cls({0: plan}, zeros, np.arange(n, dtype=np.int64), zeros, sizes)

    @classmethod
    def cut(cls, plan_of, first: int, last: int, name: str) -> _Window:
        """Cells ``[first, last)`` of the stream made of ``plan_of(0)``, ``plan_of(1)``, ..."""
        per_pass = plan_of(0).n_cells
        if per_pass <= 0 and last > first:
            raise ValueError(f"source {name!r} plans no cells; it cannot supply a quota")
        plans: dict[int, Plan] = {}
        columns: list[list[np.ndarray]] = [[], [], [], []]
        p = first // per_pass if per_pass else 0
        while last > first and p * per_pass < last:
            plan = plans[p] = plan_of(p)
            sizes = np.asarray(plan.fetch_sizes(), dtype=np.int64)
            if int(sizes.sum()) != per_pass:
                raise ValueError(
                    f"source {name!r}'s sampler plans {int(sizes.sum())} cells in its epoch {p} "
                    f"but {per_pass} in epoch 0; epoch_cells needs a sampler planning the same "
                    "number of cells every epoch"
                )
            ends = p * per_pass + np.cumsum(sizes)
            begins = ends - sizes
            take = (ends > first) & (begins < last)
            lo = np.maximum(first - begins[take], 0)
            hi = np.minimum(last, ends[take]) - begins[take]
            columns[0].append(np.full(int(take.sum()), p, dtype=np.int64))
            columns[1].append(np.flatnonzero(take))
            columns[2].append(lo)
            columns[3].append(hi)
            p += 1
        if not columns[0]:
            empty = np.zeros(0, dtype=np.int64)
            return cls(plans, empty, empty, empty, empty)
        passes, index, start, stop = (np.concatenate(c).astype(np.int64) for c in columns)
        return cls(plans, passes, index, start, stop)

    def fetch(self, i: int) -> Fetch:
        inner = self.plans[int(self.passes[i])].fetch(int(self.index[i]))
        start, stop = int(self.start[i]), int(self.stop[i])
        if start == 0 and stop == inner.n_cells:
            return inner
        seed = inner.shuffle_seed
        seed = None if seed is None else derive_seed(seed, start, stop)
        return Fetch(inner.index, slice_ranges(inner.ranges, start, stop), seed)


class MixedPlan(Plan):
    """One epoch's cells of every source, in mixed fetches (see the module docstring).

    Source ``k``'s cells of the epoch form a stream: its window's fetches, each in read
    order, one after the other. Mixed fetch ``j`` takes cells ``[cum[j - 1, k], cum[j, k])``
    of every source's stream (:class:`~slafload.samplers.interleave.MixedFetch`): source
    ``k`` supplies cells at rate ``rates[k]`` while its stream lasts, and each mixed fetch
    holds about as many cells as the largest fetch of any source.
    """

    def __init__(
        self,
        windows: Sequence[_Window],
        offsets: np.ndarray,
        cum: np.ndarray,
        seed: int,
        epoch: int,
        unit: int = 1,
    ):
        self._windows, self._offsets, self._cum = list(windows), offsets, cum
        self._seed, self._epoch, self._unit = seed, epoch, unit
        self._ends = [np.cumsum(w.sizes) for w in self._windows]
        self._sizes = np.diff(self._cum.sum(axis=1), prepend=0).astype(np.int64)

    def __len__(self) -> int:
        return len(self._sizes)

    def fetch_sizes(self) -> np.ndarray:
        """``int64`` cells per fetch, without building the fetches."""
        return self._sizes

    def fetch(self, index: int) -> Fetch:
        """Mixed fetch ``index``: a block of every source's stream, in global cell ids."""
        before = self._cum[index - 1] if index else np.zeros(len(self._windows), np.int64)
        pieces, runs, shuffled = [], [], []
        for k, (a, b) in enumerate(zip(before.tolist(), self._cum[index].tolist(), strict=True)):
            for ranges, seeded in self._stream(k, a, b):
                pieces.append(ranges + self._offsets[k])
                runs.append(int((ranges[:, 1] - ranges[:, 0]).sum()))
                shuffled.append(seeded)
        seed = derive_seed(self._seed, self._epoch, _INTERLEAVE, index)
        return MixedFetch(
            index,
            np.concatenate([np.zeros((0, 2), np.int64), *pieces]).astype(np.int64),
            seed,
            counts=self._cum[index] - before,
            runs=np.array(runs, dtype=np.int64),
            shuffled=np.array(shuffled, dtype=bool),
            unit=self._unit,
        )

    def _stream(self, k: int, a: int, b: int) -> Iterator[tuple[np.ndarray, bool]]:
        """Cells ``[a, b)`` of source ``k``'s stream, one piece per fetch of the source's
        own plan: its ranges, and whether that fetch is shuffled.
        """
        window, ends = self._windows[k], self._ends[k]
        first = int(np.searchsorted(ends, a, side="right"))
        last = int(np.searchsorted(ends, b, side="left")) if b > a else first - 1
        for i in range(first, last + 1):
            inner = window.fetch(i)
            begin = int(ends[i]) - inner.n_cells
            ranges = slice_ranges(inner.ranges, max(a - begin, 0), min(b, int(ends[i])) - begin)
            yield ranges, inner.shuffle_seed is not None


def _cumulative(totals: np.ndarray, rates: np.ndarray, width: int) -> np.ndarray:
    """``int64[n_fetches, n_sources]``: each source's cells taken by the end of each fetch.

    Source ``k`` supplies ``rates[k]`` cells per unit of time until its ``totals[k]`` are
    taken; fetch ``j`` ends when ``width * (j + 1)`` cells are taken in all. The rows are
    floors of that piecewise-linear schedule (never decreasing), the last row the totals.
    """
    n = int(totals.sum())
    if n == 0:
        return np.zeros((0, len(totals)), dtype=np.int64)
    live = totals > 0
    rates = np.where(live, np.maximum(rates, 1e-300), 1.0)
    times = np.unique(np.concatenate([[0.0], totals[live] / rates[live]]))
    taken = np.minimum(totals[None, :], rates[None, :] * times[:, None]).sum(axis=1)
    targets = np.minimum(width * np.arange(1, -(-n // width) + 1, dtype=np.float64), n)
    at = np.interp(targets, taken, times)
    cum = np.floor(np.minimum(totals[None, :], rates[None, :] * at[:, None]) + 1e-9)
    cum = np.minimum(cum.astype(np.int64), totals[None, :])
    cum[-1] = totals
    keep = np.diff(cum.sum(axis=1), prepend=0) > 0
    return cum[keep]


def _by_units(totals: np.ndarray, rates: np.ndarray, width: int, u: np.ndarray) -> np.ndarray:
    """Like :func:`_cumulative` in whole units (batches), every fetch exactly ``width`` units
    (the last one fewer): unit ``i`` of source ``k`` is due at ``(i + u[k]) / rates[k]``, units
    follow in order of due time, and fetch ``j`` is units ``[j * width, (j + 1) * width)``.
    """
    n = int(totals.sum())
    labels = np.repeat(np.arange(len(totals)), totals)
    within = np.arange(n) - np.repeat(np.cumsum(totals) - totals, totals)
    due = (within + u[labels]) / np.maximum(rates, 1e-300)[labels]
    order = np.lexsort((labels, due))
    ends = np.minimum(width * np.arange(1, -(-n // width) + 1), n)
    where = np.empty(n, dtype=np.int64)
    where[order] = np.arange(n)  # position of each unit in the merged order
    cum = [np.searchsorted(np.sort(where[labels == k]), ends) for k in range(len(totals))]
    return np.stack(cum, axis=1).astype(np.int64).reshape(len(ends), len(totals))


class _OnePlan(Plan):
    """A one-source mixture's plan: its source's own fetches (nothing to interleave)."""

    def __init__(self, window: _Window):
        self._window = window

    def __len__(self) -> int:
        return len(self._window.sizes)

    def fetch_sizes(self) -> np.ndarray:
        """``int64`` cells per fetch."""
        return self._window.sizes

    def fetch(self, index: int) -> Fetch:
        """The source's fetch ``index``."""
        inner = self._window.fetch(index)
        return Fetch(index, inner.ranges, inner.shuffle_seed)
