"""Partition an epoch's plan among distributed ranks, with no communication.

Every fetch of the epoch plan is cut into ``world_size`` contiguous *parts* of balanced sizes
(the +1 remainders rotate across ranks from fetch to fetch); rank ``r``'s share is its part of
every fetch, each part shuffled in memory with a seed derived from the fetch's. All ranks
compute all part sizes, so each knows the per-rank quota ``min_r T_r`` and delivers exactly
that many cells: equal batch counts, and the few cells beyond a rank's quota (at most about
one per fetch) are the documented uneven tail.

Resume is expressed in *segments*: ``Segment(world_size, cells)`` says every rank of a run with
that world size consumed ``cells`` cells of the epoch (DDP ranks move in lockstep). Which cells
those were is pure arithmetic, so a later segment, possibly with another world size, plans
exactly the cells no rank consumed yet: a checkpoint taken on ``W`` ranks resumes on ``W'``.

Units, outermost first: a *fetch* (the sampler's unit of reading and shuffling), a *part* (one
rank's share of a fetch), a *chunk* (a part's cells in memory), a *piece* (at most
``piece_cells`` cells ranked and tokenized at once), a *batch* (``batch_size`` cells).

Positions travel with the items: every part carries the :class:`Leg` (one epoch of the run, as
this consumer gets it) it belongs to and whether it ends that leg, and its pieces and batches
carry the same as :class:`Tagged` items, so the batch stage closes an epoch when the piece
ending its leg arrives and each batch tells where the consumer is once it holds it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from slafload.samplers.base import derive_seed
from slafload.types import Fetch, Plan

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class Segment:
    """``cells`` cells of the epoch consumed by *each* of ``world_size`` ranks."""

    world_size: int
    cells: int = 0


@dataclass(frozen=True, eq=False)
class Leg:
    """One epoch of a run as one consumer (a rank, or a DataLoader worker) gets it.

    Attributes:
        epoch: The epoch.
        history: Its completed (elastic-resume) segments.
        skip: Cells of the consumer's share delivered before the leg starts (a resumed epoch).
        rows: Cells its parts deliver.
        cells: Cells its batches deliver: ``rows``, less the short last batch ``drop_last``
            drops.
    """

    epoch: int
    history: tuple[Segment, ...] = ()
    skip: int = 0
    rows: int = 0
    cells: int = 0


@dataclass(frozen=True, eq=False)
class Part:
    """A rank's share of one fetch: read ``fetch`` and deliver its output rows ``[skip, keep)``.

    ``order``, when given, replaces the fetch's seeded shuffle: output row ``j`` is the fetch's
    read-order cell ``order[j]`` (see :mod:`slafload.pipeline.first_read`). ``leg`` is the
    epoch leg the part belongs to (``None``: a chain of one untagged epoch, ended by the end of
    the parts) and ``ends_leg`` whether it is the leg's last part.
    """

    fetch: Fetch
    skip: int
    keep: int
    order: np.ndarray | None = None
    leg: Leg | None = None
    ends_leg: bool = False


@dataclass(frozen=True, eq=False)
class Tagged(Generic[T]):
    """A piece or a batch on its way through the chain, beside the leg it belongs to.

    Attributes:
        item: The piece (a chunk, its token work, its rows) or the batch.
        leg: The part's :attr:`Part.leg`.
        ends: (pieces) The last piece of its leg: the batch stage ends the epoch after it.
        done: (batches) Cells of the leg delivered once this batch is.
    """

    item: T
    leg: Leg | None = None
    ends: bool = False
    done: int = 0

    def then(self, item: U) -> Tagged[U]:
        """``item`` with this item's tag: what a stage hands on for this one."""
        return Tagged(item, self.leg, self.ends, self.done)


class EpochFetches:
    """What is left of an epoch's plan: explicit ``head`` fetches, then the plan from ``start``.

    After an elastic resume, the fetches some ranks had partly consumed are replaced by
    ``head`` fetches holding just the cells nobody consumed.
    """

    def __init__(self, plan: Plan, head: Sequence[Fetch] = (), start: int = 0):
        self.plan, self.head, self.start = plan, list(head), start
        self._sizes: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.head) + len(self.plan) - self.start

    def fetch(self, j: int) -> Fetch:
        """The ``j``-th remaining fetch."""
        if j < len(self.head):
            return self.head[j]
        return self.plan[self.start + j - len(self.head)]

    def sizes(self) -> np.ndarray:
        """``int64[len(self)]`` cells per remaining fetch."""
        if self._sizes is None:
            tail = fetch_sizes(self.plan)[self.start :]
            head = np.array([h.n_cells for h in self.head], dtype=np.int64)
            self._sizes = np.concatenate([head, tail])
        return self._sizes


def fetch_sizes(plan: Plan) -> np.ndarray:
    """Cells per fetch of ``plan`` (duck-typed plans may lack ``fetch_sizes``)."""
    sizes = getattr(plan, "fetch_sizes", None)
    if sizes is not None:
        return np.asarray(sizes(), dtype=np.int64)
    return np.array([f.n_cells for f in plan], dtype=np.int64)


def part_sizes(sizes: np.ndarray, world_size: int) -> np.ndarray:
    """``int64[n_fetches, world_size]``: balanced sizes, +1 remainders rotating over ranks."""
    j = np.arange(len(sizes))[:, None]
    r = np.arange(world_size)[None, :]
    extra = (r - j) % world_size < (sizes % world_size)[:, None]
    return sizes[:, None] // world_size + extra


class RankShare:
    """Rank ``rank``'s parts of ``fetches`` under ``world_size`` ranks, and the quota."""

    def __init__(self, fetches: EpochFetches, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.fetches, self.rank, self.world_size = fetches, rank, world_size
        self.sizes = part_sizes(fetches.sizes(), world_size)
        self.offsets = np.cumsum(self.sizes, axis=1) - self.sizes
        totals = self.sizes.sum(axis=0)
        self.quota = int(totals.min()) if len(totals) else 0
        self.prefix = np.cumsum(self.sizes, axis=0) - self.sizes  # per rank, before fetch j

    def part(self, j: int, rank: int) -> Fetch:
        """``rank``'s part of fetch ``j``, as a fetch of its own (ranges and shuffle seed)."""
        fetch = self.fetches.fetch(j)
        start = int(self.offsets[j, rank])
        seed = (
            None
            if fetch.shuffle_seed is None
            else derive_seed(fetch.shuffle_seed, self.world_size, rank)
        )
        return fetch.sliced(j, start, start + int(self.sizes[j, rank]), seed)

    def parts(
        self, skip: int = 0, worker: int = 0, n_workers: int = 1, leg: Leg | None = None
    ) -> Iterator[Part]:
        """The parts still to deliver, within the quota (lazy), each tagged with ``leg`` (the
        last one ending it).

        With ``n_workers > 1`` worker ``worker`` takes every ``n_workers``-th non-empty part,
        and ``skip`` counts the cells *this worker* has delivered: positions are per worker.
        """
        mine, drop, keep = self._mine(skip, worker, n_workers)
        live = np.flatnonzero(drop < keep).tolist()
        for i in live:
            j, d, k = int(mine[i]), int(drop[i]), int(keep[i])
            yield Part(self.part(j, self.rank), d, k, None, leg, i == live[-1])

    def cells(self, skip: int = 0, worker: int = 0, n_workers: int = 1) -> int:
        """Cells that :meth:`parts` with the same arguments delivers."""
        _, drop, keep = self._mine(skip, worker, n_workers)
        return int((keep - drop).sum())

    def _mine(self, skip: int, worker: int, n_workers: int) -> tuple[np.ndarray, ...]:
        """This worker's fetch indices, and the cells to drop and keep of each part."""
        keep = np.clip(self.quota - self.prefix[:, self.rank], 0, self.sizes[:, self.rank])
        mine = np.flatnonzero(keep)[worker::n_workers]
        before = np.cumsum(keep[mine]) - keep[mine]  # this worker's cells before each part
        return mine, np.clip(skip - before, 0, keep[mine]), keep[mine]

    def consumed(self, cells: int) -> list[tuple[int, np.ndarray]]:
        """Fetches partly consumed when every rank has taken ``cells`` cells, with those cells.

        Fetches before the first such fetch are wholly consumed; fetches after the last
        untouched.
        """
        ends = self.prefix + self.sizes
        first = int(np.argmax((ends > cells).any(axis=1))) if (ends > cells).any() else len(ends)
        last = int(np.flatnonzero((self.prefix < cells).any(axis=1))[-1]) if cells else -1
        out = []
        for j in range(first, last + 1):
            taken = []
            for rank in range(self.world_size):
                m = int(np.clip(cells - self.prefix[j, rank], 0, self.sizes[j, rank]))
                if m:
                    part = self.part(j, rank)
                    order = part.output_order()
                    taken.append(part.cell_ids()[order[:m]])
            out.append((j, np.concatenate(taken) if taken else np.zeros(0, np.int64)))
        return out


def remaining(fetches: EpochFetches, segment: Segment, index: int) -> EpochFetches:
    """What is left of ``fetches`` after ``segment`` (the ``index``-th of the epoch)."""
    share = RankShare(fetches, 0, segment.world_size)
    partial = share.consumed(segment.cells)
    done_before = partial[0][0] if partial else _first_unconsumed(share, segment.cells)
    head: list[Fetch] = []
    for j, taken in partial:
        fetch = fetches.fetch(j)
        seed = None if fetch.shuffle_seed is None else derive_seed(fetch.shuffle_seed, index)
        left = fetch.without(taken, seed)
        if left.n_cells:
            head.append(left)
    resume_at = (partial[-1][0] + 1) if partial else done_before
    head += [fetches.fetch(j) for j in range(resume_at, len(fetches.head))]
    return EpochFetches(fetches.plan, head, fetches.start + max(resume_at - len(fetches.head), 0))


def _first_unconsumed(share: RankShare, cells: int) -> int:
    ends = share.prefix + share.sizes
    pending = (ends > cells).any(axis=1)
    return int(np.argmax(pending)) if pending.any() else len(ends)


def rank_share(plan: Plan, history: Sequence[Segment], rank: int, world_size: int) -> RankShare:
    """Rank ``rank``'s share of an epoch after the completed ``history`` segments."""
    fetches = EpochFetches(plan)
    for index, segment in enumerate(history):
        fetches = remaining(fetches, segment, index + 1)
    return RankShare(fetches, rank, world_size)
