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
``memory_budget``), and source ``k``'s block in it is that size times its share. A block's
end is then moved to where one of its source's own fetches ends when that keeps every share
of this fetch and the next within :data:`SHARE_SLACK` (a short fetch, the last of a pass,
would otherwise shift every later cut off the source's fetches, and each block would be read
as two ranges). Where the cap
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

import bisect
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
            cum = _at_fetch_ends(cum, [np.cumsum(w.sizes) for w in windows], self.fetch_cells)
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
        settings: dict[str, object] = {
            "sources": list(self.names),
            "uris": list(self.uris),
            "source_cells": list(self.sizes),
            "weights": list(self.weights),
            "source_samplers": [repr(s) for s in self.samplers],
            "epoch_cells": self.epoch_cells,
            "mix": self.mix if self.mix == "cell" else f"{self.mix}:{self.batch_size}",
            "fetch_cells": self.fetch_cells,
        }
        if self.mix == "cell":  # cuts moved to the sources' fetch ends (_at_fetch_ends): a
            # checkpoint whose plan did not move them lacks this, and is refused
            settings["cuts"] = "source fetch ends"
        return settings

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


SHARE_SLACK = 0.03
"""How far a source's share of a mixed fetch may move from the schedule's so that its block
ends where one of its own fetches ends (:func:`_at_fetch_ends`)."""


def _at_fetch_ends(
    cum: np.ndarray, ends: Sequence[np.ndarray], fetch_cells: int | None
) -> np.ndarray:
    """``cum`` (:func:`_cumulative`) with each source's cuts moved to where its own fetches
    end, where that keeps the mix.

    A source's stream is its fetches back to back. Once a short fetch (the last of a pass)
    has shifted the schedule's cuts off the ends of its fetches, every later block of that
    source would be read as two ranges, the tail of one fetch and the head of the next.
    Moving a cut that falls inside a fetch to that fetch's start or end (the nearer one
    first) makes the next block start where a fetch starts, so the blocks after it are one
    range each again (the fetches of sources whose fetches end alike move together). A cut
    moves only while every source's share of this mixed fetch and of the next stays within
    :data:`SHARE_SLACK` of the schedule's, by at most the source's block in this fetch and
    never past its cut in the next, and while both fetches fit ``fetch_cells``. The last
    row (the totals) never moves, so every cell still comes once.

    Args:
        cum: ``int64[n_fetches, n_sources]`` cells of each source taken by each fetch's end.
        ends: Each source's fetch ends in its stream (``cumsum`` of its window's sizes).
        fetch_cells: The cap on a mixed fetch's cells, or ``None``.
    """
    out, stream_ends = cum.copy(), [e.tolist() for e in ends]
    before = np.zeros(cum.shape[1], dtype=np.int64)  # where each block of this fetch starts
    for j in range(len(cum) - 1):
        ideal = (cum[j] - (cum[j - 1] if j else 0), cum[j + 1] - cum[j])
        row = cum[j].copy()
        moves = [
            _moves(e, int(a), int(c)) for e, a, c in zip(stream_ends, before, row, strict=True)
        ]
        nearest = {k: m[0] for k, m in enumerate(moves) if m}
        together = _moved(row, nearest)
        if nearest and _keeps_mix(together, before, ideal, cum[j + 1], fetch_cells):
            row = together
        else:  # source by source, each to the first of its cuts that keeps the mix
            for k in nearest:
                alone = (_moved(row, {k: cut}) for cut in moves[k])
                row = next(
                    (m for m in alone if _keeps_mix(m, before, ideal, cum[j + 1], fetch_cells)),
                    row,
                )
        out[j] = before = row
    return out


def _moved(row: np.ndarray, cuts: dict[int, int]) -> np.ndarray:
    """``row`` with ``row[k] = cuts[k]``."""
    out = row.copy()
    out[list(cuts)] = list(cuts.values())
    return out


def _moves(ends: list[int], start: int, cut: int) -> list[int]:
    """Where a block ``[start, cut)`` of a stream with fetch ends ``ends`` could end instead,
    nearest first: the start (if after ``start``) and the end of the fetch ``cut`` falls
    inside, each within one block of ``cut`` (none if ``cut`` is a fetch end).
    """
    i = bisect.bisect_right(ends, cut)
    if i == len(ends) or (i and ends[i - 1] == cut):
        return []
    back = ends[i - 1] if i else 0
    found = [e for e in (back, ends[i]) if start < e and abs(e - cut) <= cut - start]
    return sorted(found, key=lambda e: abs(e - cut))


def _keeps_mix(
    row: np.ndarray,
    before: np.ndarray,
    ideal: tuple[np.ndarray, np.ndarray],
    following: np.ndarray,
    fetch_cells: int | None,
) -> bool:
    """Whether blocks ``[before, row)`` and ``[row, following)`` (this fetch and the next)
    hold every source's cells in shares within :data:`SHARE_SLACK` of the schedule's
    (``ideal``), none negative, and fit ``fetch_cells``.
    """
    for got, want in ((row - before, ideal[0]), (following - row, ideal[1])):
        if (got < 0).any() or (fetch_cells is not None and int(got.sum()) > fetch_cells):
            return False
        if (
            np.abs(got / max(int(got.sum()), 1) - want / max(int(want.sum()), 1)).max()
            > SHARE_SLACK
        ):
            return False
    return True


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
