"""A small first read, so the first batch of an epoch (or of a resumed run) comes quickly.

A fetch is shuffled in memory before its first minibatch is cut, so the first batch of a run
normally waits for the whole first fetch: 32k cells for ``BlockShuffle(16, 1024)``, thousands
of scattered ranges. But which cells the first output rows are is known before any read: the
fetch's output order is seeded (:meth:`~slafload.types.Fetch.output_order`). :func:`split_first` turns a
run's first part into two reads of the same fetch: its first ``cells`` output rows (a handful
of cells, read as their own small ranges), then the rest of its output rows. Each read carries
the output order of its cells, so the delivered cells, their order and every position (hence
``state_dict`` and resume) are exactly those of the unsplit part: only the I/O is cut in two.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np

from slafload.pipeline.partition import Part
from slafload.types import Fetch


def split_first(parts: Iterable[Part], cells: int) -> Iterator[Part]:
    """``parts`` with the first one read as its first ``cells`` output rows, then the rest.

    ``cells <= 0``, or a first part delivering at most ``cells`` cells, leaves it whole. Both
    reads carry the first part's leg; the second ends it if the first part did.
    """
    parts = iter(parts)
    first = next(parts, None)
    if first is None:
        return
    if cells <= 0 or first.keep - first.skip <= cells or first.order is not None:
        yield first
    else:
        order = first.fetch.output_order()
        head = reading(first.fetch, order[first.skip : first.skip + cells])
        rest = reading(first.fetch, order[first.skip + cells : first.keep])
        yield dataclasses.replace(head, leg=first.leg)
        yield dataclasses.replace(rest, leg=first.leg, ends_leg=first.ends_leg)
    yield from parts


def reading(fetch: Fetch, positions: np.ndarray) -> Part:
    """A part that reads only the read-order ``positions`` of ``fetch`` and delivers them in
    the given order.

    The cells are read in ascending position order, consecutive positions of consecutive
    cells merged into one range (repeated ranges of sampling with replacement stay apart).
    """
    positions = np.asarray(positions, dtype=np.int64)
    ascending = np.sort(positions)
    cells = fetch.cell_ids()[ascending]
    breaks = np.flatnonzero((np.diff(ascending) != 1) | (np.diff(cells) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(cells)]])
    ranges = np.stack([cells[starts], cells[stops - 1] + 1], axis=1).astype(np.int64)
    if len(cells) == 0:
        ranges = np.zeros((0, 2), dtype=np.int64)
    sub = Fetch(fetch.index, ranges, None)
    return Part(sub, 0, len(positions), np.searchsorted(ascending, positions))
