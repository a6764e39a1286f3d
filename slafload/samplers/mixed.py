"""Mixing the plans of several sources into one epoch plan, by weight.

A mixture (:mod:`slafload.data.mixture`) reads several SLAF datasets as one: source ``k``'s cells
are the *global* cell ids ``[offsets[k], offsets[k + 1])``. Each source keeps its own sampler;
:class:`MixtureSampler` interleaves the fetches of their plans into one :class:`Plan` whose
fetches each stay inside one source (reads stay contiguous). Everything is arithmetic on
``(seed, epoch)``, so partitioning among ranks (:mod:`slafload.pipeline.partition`) and resume work on
the mixed plan exactly as on a single source's.

Epoch semantics (``epoch_cells``):

``None`` (default): one pass over every source
    An epoch holds every fetch of every source's plan for that epoch, so every cell of every
    source comes exactly once (for the built-in samplers). Weights shape the *interleaving*:
    while every source still has fetches left, source ``k`` supplies cells at a rate
    proportional to ``weights[k]``; a source that runs out leaves the rest to the others.
    The default weights are the sources' sizes, which spreads every source evenly over the
    epoch (all sources end together).
``epoch_cells=M``: a fixed number of cells drawn by weight
    An epoch holds exactly ``M`` cells, ``quota[k] = M * weights[k] / sum(weights)`` of them
    from source ``k`` (largest-remainder rounding). Each source's cells come from its own
    stream: its sampler's epochs 0, 1, 2, ... back to back, so mixture epoch ``e`` takes cells
    ``[e * quota[k], (e + 1) * quota[k])`` of that stream. A down-weighted source thus takes
    several mixture epochs to go through its cells once, an up-weighted one goes through its
    cells several times per mixture epoch, and within one pass of a source no cell repeats
    (sampling without replacement within a pass). A fetch cut at a window's edge is cut in
    read order and reshuffled with a derived seed.

Within an epoch the interleaving is drawn as follows: fetch ``i`` of source ``k``, holding
cells ``[c_i, c_i + s_i)`` of that source's share, gets the time ``(c_i + u * s_i) / r_k``
(``u`` uniform, seeded by ``(seed, epoch, k)``; ``r_k`` the source's weight in one-pass mode,
its quota in fixed-size mode) and fetches are delivered by time. A source's own fetch order is
kept, and the share of source ``k`` among the cells delivered so far tracks ``r_k``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from slafload.pipeline.ranges import slice_ranges
from slafload.samplers.base import Fetch, Plan, derive_seed
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
    """Interleaves the plans of several sources' samplers (see the module docstring).

    Args:
        names: Source names (in checkpoints and refusals).
        uris: Source dataset URIs.
        sizes: Cells of each source.
        offsets: ``int64[k + 1]`` first global cell id of each source, then the total.
        weights: Positive weight of each source.
        samplers: Each source's sampler (already bound to the loader's batch size).
        epoch_cells: ``None``: one pass over every source; else cells per epoch.
    """

    names: tuple[str, ...]
    uris: tuple[str, ...]
    sizes: tuple[int, ...]
    weights: tuple[float, ...]
    samplers: tuple[Sampler, ...]
    epoch_cells: int | None = None

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
        return MixedPlan(windows, self.offsets, self._rates(windows), seed, epoch)

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
        }

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{n}={w:g}:{s!r}"
            for n, w, s in zip(self.names, self.weights, self.samplers, strict=True)
        )
        mode = "one_pass" if self.epoch_cells is None else f"epoch_cells={self.epoch_cells}"
        return f"MixtureSampler({mode}; {parts})"


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
    """One epoch's fetches of every source, interleaved by time (see the module docstring).

    Fetch ``j`` is fetch ``local[j]`` of source ``source[j]``'s window, its cell ranges moved
    to global cell ids.
    """

    def __init__(
        self,
        windows: Sequence[_Window],
        offsets: np.ndarray,
        rates: np.ndarray,
        seed: int,
        epoch: int,
    ):
        self._windows, self._offsets = list(windows), offsets
        times, sources, locals_ = [], [], []
        for k, window in enumerate(self._windows):
            sizes = window.sizes
            before = np.cumsum(sizes) - sizes
            u = np.random.default_rng(derive_seed(seed, epoch, _INTERLEAVE, k)).random(len(sizes))
            times.append((before + u * sizes) / rates[k])
            sources.append(np.full(len(sizes), k, dtype=np.int64))
            locals_.append(np.arange(len(sizes), dtype=np.int64))
        t, s, i = (np.concatenate(x) for x in (times, sources, locals_))
        order = np.lexsort((i, s, t))
        self.source, self.local = s[order], i[order]
        sizes = np.concatenate([w.sizes for w in self._windows])
        firsts = np.cumsum([0] + [len(w.sizes) for w in self._windows])[:-1]
        self._sizes = sizes[(firsts[self.source] + self.local)] if len(order) else sizes

    def __len__(self) -> int:
        return len(self.source)

    def fetch_sizes(self) -> np.ndarray:
        """``int64`` cells per fetch, without building the fetches."""
        return self._sizes

    def fetch(self, index: int) -> Fetch:
        """Fetch ``index``: its source's own fetch, in global cell ids."""
        k = int(self.source[index])
        inner = self._windows[k].fetch(int(self.local[index]))
        return Fetch(index, inner.ranges + self._offsets[k], inner.shuffle_seed)
