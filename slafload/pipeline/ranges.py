"""Half-open integer ranges ``[start, stop)`` as ``int64[k, 2]`` arrays: all range arithmetic.

Samplers build cell ranges, the partition cuts them among ranks, the reader turns them into
row ranges and coalesces them into spans, and tokenizers expand offsets; every one of those
steps is a vectorized function here, with no Python loop over ranges.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, bisect_right
from collections.abc import Sequence

import numpy as np


def run_offsets(lengths: np.ndarray | Sequence[int]) -> np.ndarray:
    """``int64[len(lengths) + 1]``: where each of back-to-back runs of ``lengths`` starts, then
    their total.
    """
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def expand(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + n)`` for every ``(s, n)`` without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.repeat(np.asarray(starts, dtype=np.int64) - np.cumsum(lengths) + lengths, lengths)
    out += np.arange(len(out), dtype=np.int64)
    return out


def expand_ranges(ranges: np.ndarray) -> np.ndarray:
    """Every integer of ``int64[k, 2]`` half-open ranges, in range order."""
    return expand(ranges[:, 0], ranges[:, 1] - ranges[:, 0])


def merge_ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Ranges sorted by start, with touching ranges merged into one, as ``int64[k, 2]``.

    Repeated ranges (sampling with replacement) stay separate, repeated ranges.
    """
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], stops[order]
    if len(starts) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    new_run = np.ones(len(starts), dtype=bool)
    new_run[1:] = starts[1:] != stops[:-1]
    first = np.flatnonzero(new_run)
    last = np.append(first[1:], len(starts)) - 1
    return np.stack([starts[first], stops[last]], axis=1).astype(np.int64)


def block_ranges(blocks: np.ndarray, block_size: int, n_cells: int) -> np.ndarray:
    """``int64[k, 2]`` cell ranges of block ids, sorted by position, adjacent blocks merged."""
    starts = np.asarray(blocks, dtype=np.int64) * block_size
    return merge_ranges(starts, np.minimum(starts + block_size, n_cells))


def ranges_of(cells: np.ndarray) -> np.ndarray:
    """Cell ids (any order) as their sorted maximal runs ``[start, stop)``."""
    cells = np.sort(cells)
    if len(cells) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(cells) != 1) + 1
    starts = cells[np.concatenate([[0], breaks])]
    stops = cells[np.concatenate([breaks - 1, [len(cells) - 1]])] + 1
    return np.stack([starts, stops], axis=1).astype(np.int64)


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


def coalesce(ranges: np.ndarray, max_gap: int) -> np.ndarray:
    """Span number of each range: consecutive ranges whose gap is in ``[0, max_gap]`` share one."""
    gap = ranges[1:, 0] - ranges[:-1, 1]
    return np.concatenate([[0], np.cumsum((gap < 0) | (gap > max_gap))])


def span_ends(span_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First and last range index of each span, from the span number of each range."""
    first = np.flatnonzero(np.diff(span_of, prepend=-1))
    return first, np.append(first[1:], len(span_of)) - 1


def describe(ranges: np.ndarray, limit: int = 4) -> str:
    """``"[a, b), [c, d), ... n more"``: ranges for an error message or a ``repr``."""
    spans = ", ".join(f"[{a}, {b})" for a, b in np.asarray(ranges)[:limit].tolist())
    return spans + (f", ... {len(ranges) - limit} more" if len(ranges) > limit else "")


class RangeSet:
    """A growing set of integers held as sorted, disjoint, merged ranges ``[start, stop)``.

    The read and chunk stages keep the cell ranges whose rows have been checked against
    ``cell_start_index`` in one (``Tuning.check_rows``). Its size is the number of
    separate runs added, not of integers: contiguous reads merge as they meet (one run once an
    epoch of :class:`~slafload.samplers.ChunkShuffle` fetches has been added), and at most one
    run per fetch of an epoch in between. At most ``max_runs`` runs are held (a few MB of
    Python ints): a range that would start another is then not added, so it is checked
    again when it is read again. Safe to share between threads.
    """

    def __init__(self, max_runs: int = 1 << 16) -> None:
        self.max_runs = max_runs
        self._starts: list[int] = []
        self._stops: list[int] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Separate runs held."""
        return len(self._starts)

    def covers(self, start: int, stop: int) -> bool:
        """Whether every integer of ``[start, stop)`` is in the set (an empty range is)."""
        if stop <= start:
            return True
        with self._lock:
            i = bisect_right(self._starts, start) - 1
            return i >= 0 and self._stops[i] >= stop

    def add(self, start: int, stop: int) -> bool:
        """Add ``[start, stop)``, merging it with the runs it overlaps or touches; ``False``
        (and nothing added) when it would be a new run beyond ``max_runs``.
        """
        if stop <= start:
            return True
        with self._lock:
            first = bisect_left(self._stops, start)  # runs ending at or after start...
            last = bisect_right(self._starts, stop)  # ...and starting at or before stop
            if first < last:
                start = min(start, self._starts[first])
                stop = max(stop, self._stops[last - 1])
            elif len(self._starts) >= self.max_runs:
                return False
            self._starts[first:last] = [start]
            self._stops[first:last] = [stop]
            return True
