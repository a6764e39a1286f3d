"""The sampler contract: a deterministic plan of fetches per epoch.

A sampler decides *which cells, in which order*. For an epoch it returns a :class:`Plan`, an
ordered sequence of :class:`Fetch` objects; each fetch is a list of contiguous cell ranges that
the reader turns into one prefetch chunk, plus the seed of the in-memory shuffle applied to
that chunk. Planning is pure index arithmetic on ``(seed, epoch)``: no I/O, no global RNG.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, overload, runtime_checkable

import numpy as np

from slafload.ranges import expand


@dataclass(frozen=True, eq=False)
class Fetch:
    """One prefetch chunk: cell ranges to read together, and how to order them in memory.

    Attributes:
        index: Position of this fetch in its epoch plan.
        ranges: ``int64[k, 2]`` half-open cell ranges ``[start, stop)``, in read order.
        shuffle_seed: Seed of the in-memory cell shuffle of this chunk; ``None`` keeps the
            cells in range order.
    """

    index: int
    ranges: np.ndarray
    shuffle_seed: int | None = None

    @property
    def n_cells(self) -> int:
        return int((self.ranges[:, 1] - self.ranges[:, 0]).sum())

    def cell_ids(self) -> np.ndarray:
        """The cells of this fetch in read order (before any shuffle)."""
        return expand(self.ranges[:, 0], self.ranges[:, 1] - self.ranges[:, 0])

    def __repr__(self) -> str:
        spans = ", ".join(f"[{a}, {b})" for a, b in self.ranges[:4].tolist())
        more = f", ... {len(self.ranges) - 4} more" if len(self.ranges) > 4 else ""
        return f"Fetch(index={self.index}, cells={self.n_cells}, ranges={spans}{more})"


class Plan(Sequence[Fetch]):
    """An epoch's ordered fetches. Subclasses build fetches lazily from index arithmetic."""

    def __len__(self) -> int:
        raise NotImplementedError

    def fetch(self, index: int) -> Fetch:
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> Fetch: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Fetch]: ...
    def __getitem__(self, index: int | slice) -> Fetch | Sequence[Fetch]:
        if isinstance(index, slice):
            return [self.fetch(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"fetch index {index} out of range for a plan of {len(self)}")
        return self.fetch(index)

    @property
    def n_cells(self) -> int:
        """Cells delivered by the whole plan (sum over fetches)."""
        return int(self.fetch_sizes().sum())

    def fetch_sizes(self) -> np.ndarray:
        """``int64[len(self)]`` cells per fetch. Subclasses compute it without building fetches
        (sharding among ranks needs every size up front)."""
        return np.array([f.n_cells for f in self], dtype=np.int64)


@runtime_checkable
class Sampler(Protocol):
    """Turns ``(n_cells, seed, epoch)`` into a :class:`Plan`."""

    def plan(self, n_cells: int, *, seed: int, epoch: int) -> Plan:
        """The fetches of one epoch; the same arguments always give the same plan."""
        ...


class MinibatchFetches:
    """Mixin of dataclass samplers whose ``fetch_factor`` counts minibatches.

    Such a sampler needs the loader's minibatch size to size its fetches. A user gives the
    batch size once, to the :class:`~slafload.Loader`, which binds it with
    :func:`bind_batch_size`; ``batch_size`` is given to the sampler itself only to plan
    without a loader (tests, docs, notebooks).
    """

    batch_size: int | None

    def with_batch_size(self, batch_size: int) -> Sampler:
        """This sampler planning for minibatches of ``batch_size`` cells.

        Raises:
            ValueError: the sampler was built with another ``batch_size``.
        """
        if self.batch_size is None:
            return dataclasses.replace(self, batch_size=batch_size)  # type: ignore[type-var]
        if self.batch_size != batch_size:
            raise ValueError(
                f"{type(self).__name__} was built with batch_size={self.batch_size} but the "
                f"loader uses batch_size={batch_size}; give the batch size once, to the "
                "loader, and leave the sampler's batch_size unset"
            )
        return self  # type: ignore[return-value]

    def _minibatch(self) -> int:
        if self.batch_size is None:
            raise ValueError(
                f"{type(self).__name__} needs the minibatch size to size its fetches: pass "
                "it to slafload.Loader(batch_size=...), which sets it, or give "
                f"{type(self).__name__}(batch_size=...) to plan without a loader"
            )
        return self.batch_size


def bind_batch_size(sampler: Sampler, batch_size: int) -> Sampler:
    """``sampler`` planning for the loader's ``batch_size`` (unchanged if it does not care)."""
    bind = getattr(sampler, "with_batch_size", None)
    return sampler if bind is None else bind(batch_size)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed derived from integer parts, independent across parts."""
    return int(
        np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0]
        >> np.uint64(1)
    )
