"""Stage 2b: split an epoch's plan among ranks, with no communication, resumable elastically.

Every fetch ("item") of the epoch plan is cut into ``world_size`` contiguous parts of balanced
sizes (the +1 remainders rotate across ranks from item to item); rank ``r``'s stream is its
part of every item, each part shuffled in memory with a seed derived from the item's. All
ranks compute all part sizes, so each knows the per-rank quota ``min_r T_r`` and delivers
exactly that many cells: equal batch counts, and the few cells beyond a rank's quota (at most
about one per item) are the documented uneven tail.

Resume is expressed in *segments*: ``Segment(world_size, cells)`` says every rank of a run with
that world size consumed ``cells`` cells of the epoch (DDP ranks move in lockstep). Which cells
those were is pure arithmetic, so a later segment, possibly with another world size, plans
exactly the cells no rank consumed yet: a checkpoint taken on ``W`` ranks resumes on ``W'``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from slafload.chunk import shuffle_order
from slafload.samplers import Fetch, Plan, derive_seed


@dataclass(frozen=True)
class Segment:
    """``cells`` cells of the epoch consumed by *each* of ``world_size`` ranks."""

    world_size: int
    cells: int = 0


@dataclass(frozen=True, eq=False)
class Part:
    """A rank's share of one item: read ``fetch`` and deliver its output rows ``[skip, keep)``.

    ``order``, when given, replaces the fetch's seeded shuffle: output row ``j`` is the fetch's
    read-order cell ``order[j]`` (see :mod:`slafload.first_read`).
    """

    fetch: Fetch
    skip: int
    keep: int
    order: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class _Item:
    ranges: np.ndarray
    shuffle_seed: int | None

    @property
    def n_cells(self) -> int:
        return int((self.ranges[:, 1] - self.ranges[:, 0]).sum())


class EpochItems:
    """What is left of an epoch's plan: explicit ``head`` items, then the plan from ``start``."""

    def __init__(self, plan: Plan, head: Sequence[_Item] = (), start: int = 0):
        self.plan, self.head, self.start = plan, list(head), start
        self._sizes: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.head) + len(self.plan) - self.start

    def item(self, j: int) -> _Item:
        if j < len(self.head):
            return self.head[j]
        fetch = self.plan[self.start + j - len(self.head)]
        return _Item(fetch.ranges, fetch.shuffle_seed)

    def sizes(self) -> np.ndarray:
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
    """``int64[n_items, world_size]``: balanced sizes, +1 remainders rotating over ranks."""
    j = np.arange(len(sizes))[:, None]
    r = np.arange(world_size)[None, :]
    extra = (r - j) % world_size < (sizes % world_size)[:, None]
    return sizes[:, None] // world_size + extra


def slice_ranges(ranges: np.ndarray, start: int, stop: int) -> np.ndarray:
    """The sub-ranges covering read-order positions ``[start, stop)`` of ``ranges``."""
    lengths = ranges[:, 1] - ranges[:, 0]
    ends = np.cumsum(lengths)
    begins = ends - lengths
    sel = (ends > start) & (begins < stop)
    out = ranges[sel].copy()
    out[:, 0] += np.maximum(start - begins[sel], 0)
    out[:, 1] -= np.maximum(ends[sel] - stop, 0)
    return out


def ranges_of(cells: np.ndarray) -> np.ndarray:
    """Sorted cell ids as maximal runs ``[start, stop)``."""
    cells = np.sort(cells)
    if len(cells) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(cells) != 1) + 1
    starts = cells[np.concatenate([[0], breaks])]
    stops = cells[np.concatenate([breaks - 1, [len(cells) - 1]])] + 1
    return np.stack([starts, stops], axis=1).astype(np.int64)


def _cells_of(ranges: np.ndarray) -> np.ndarray:
    return Fetch(0, ranges).cell_ids()


class RankStream:
    """Rank ``rank``'s parts of ``items`` under ``world_size`` ranks, and the quota."""

    def __init__(self, items: EpochItems, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.items, self.rank, self.world_size = items, rank, world_size
        self.sizes = part_sizes(items.sizes(), world_size)
        self.offsets = np.cumsum(self.sizes, axis=1) - self.sizes
        totals = self.sizes.sum(axis=0)
        self.quota = int(totals.min()) if len(totals) else 0
        self.prefix = np.cumsum(self.sizes, axis=0) - self.sizes  # per rank, before item j

    def part(self, j: int, rank: int) -> tuple[np.ndarray, int | None]:
        """Ranges and shuffle seed of ``rank``'s part of item ``j``."""
        item = self.items.item(j)
        start = int(self.offsets[j, rank])
        ranges = slice_ranges(item.ranges, start, start + int(self.sizes[j, rank]))
        seed = (
            None
            if item.shuffle_seed is None
            else derive_seed(item.shuffle_seed, self.world_size, rank)
        )
        return ranges, seed

    def parts(self, skip: int = 0, worker: int = 0, n_workers: int = 1) -> Iterator[Part]:
        """The parts still to deliver, within the quota (lazy).

        With ``n_workers > 1`` worker ``worker`` takes every ``n_workers``-th non-empty part,
        and ``skip`` counts the cells *this worker* has delivered: positions are per worker.
        """
        keep = np.clip(self.quota - self.prefix[:, self.rank], 0, self.sizes[:, self.rank])
        mine = np.flatnonzero(keep)[worker::n_workers]
        before = np.cumsum(keep[mine]) - keep[mine]  # this worker's cells before each part
        drop = np.clip(skip - before, 0, keep[mine])
        for j, d in zip(mine.tolist(), drop.tolist(), strict=True):
            if d < keep[j]:
                ranges, seed = self.part(j, self.rank)
                yield Part(Fetch(j, ranges, seed), d, int(keep[j]))

    def consumed(self, cells: int) -> list[tuple[int, np.ndarray]]:
        """Items partly consumed when every rank has taken ``cells`` cells, with those cells.

        Items before the first such item are wholly consumed; items after the last untouched.
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
                    ranges, seed = self.part(j, rank)
                    order = shuffle_order(self.sizes[j, rank], seed)
                    taken.append(_cells_of(ranges)[order[:m]])
            out.append((j, np.concatenate(taken) if taken else np.zeros(0, np.int64)))
        return out


def remaining(items: EpochItems, segment: Segment, index: int) -> EpochItems:
    """What is left of ``items`` after ``segment`` (the ``index``-th of the epoch)."""
    stream = RankStream(items, 0, segment.world_size)
    partial = stream.consumed(segment.cells)
    done_before = partial[0][0] if partial else _first_unconsumed(stream, segment.cells)
    head: list[_Item] = []
    for j, taken in partial:
        item = items.item(j)
        left = np.setdiff1d(_cells_of(item.ranges), taken, assume_unique=True)
        if len(left):
            seed = None if item.shuffle_seed is None else derive_seed(item.shuffle_seed, index)
            head.append(_Item(ranges_of(left), seed))
    resume_at = (partial[-1][0] + 1) if partial else done_before
    head += [items.item(j) for j in range(resume_at, len(items.head))]
    return EpochItems(items.plan, head, items.start + max(resume_at - len(items.head), 0))


def _first_unconsumed(stream: RankStream, cells: int) -> int:
    ends = stream.prefix + stream.sizes
    pending = (ends > cells).any(axis=1)
    return int(np.argmax(pending)) if pending.any() else len(ends)


def rank_stream(plan: Plan, history: Sequence[Segment], rank: int, world_size: int) -> RankStream:
    """Rank ``rank``'s stream for an epoch after the completed ``history`` segments."""
    items = EpochItems(plan)
    for index, segment in enumerate(history):
        items = remaining(items, segment, index + 1)
    return RankStream(items, rank, world_size)
