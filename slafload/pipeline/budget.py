"""Bound the expression bytes a run holds by a byte budget, not by a count of fetches.

A fetch's size in bytes varies by orders of magnitude between samplers and datasets (2,048
contiguous cells of ~800 non-zeros are 13 MB of Arrow data; ``BlockShuffle(16, 1024)`` fetches
32,768 cells), so counting fetches bounds nothing. Here every read is charged what it costs
while it is held: the rows Lance reads (wanted rows plus the short gaps the reader scans
through, :data:`slafload.pipeline.reader.MAX_GAP_ROWS`) times the row width, times
:data:`COPIES` (the Arrow batches, the concatenated columns, the chunk's arrays).

* Read-ahead starts another fetch only while the reads in flight fit the budget
  (:func:`fits`); the current fetch is always read, so a run never stalls.
* A fetch that alone exceeds half the budget is read in groups of consecutive ranges
  (:func:`groups`, cut at cell boundaries when one range is too large), each group checked and
  converted to compact arrays before the next is read, so its Arrow data is freed group by
  group. The groups are concatenated in read order, so the chunk, its shuffle and every
  delivered cell are exactly those of a whole-fetch read.
* A fetch of scattered ranges (:func:`scattered`: single cells, small blocks) is also read in
  groups of at most :data:`GROUP_RANGES` ranges, whatever its cost, so what a fetch of single
  cells holds in flight does not grow with the atlas. Its charge is unchanged.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from slafload.types import Chunk, Fetch, Offsets

COPIES = 3  # Arrow batches, their concatenation into columns, the chunk's numpy arrays
# A fetch whose ranges average fewer rows than this is scattered (BlockShuffle(1, f) and
# other small blocks: a 16-cell block of ~800 non-zeros a cell is 12.8k rows)...
SCATTERED_ROWS = 4096
# ...and is read in groups of at most this many ranges. The budget charges the gap rows
# between nearby cells, so on a 500k-cell atlas a BlockShuffle(1, 64) fetch was read in ~16
# groups of ~128 cells, while on a 5M one, whose cells are too far apart for that, in ~3 of
# ~700: 5M's peak RSS 786-805 MB instead of 731-773 with these groups, and 11% fewer cells/s
# (docs/sampling.md, "First batch and memory").
GROUP_RANGES = 256


def row_bytes(schema: pa.Schema, columns: list[str]) -> int:
    """Bytes per expression row of ``columns`` (fixed-width types; 8 for anything else)."""
    width = 0
    for name in columns:
        typ = schema.field(name).type
        width += typ.bit_width // 8 if pa.types.is_primitive(typ) else 8
    return width


def read_rows(fetch: Fetch, cell_start: Offsets, max_gap: int) -> np.ndarray:
    """Rows each range of ``fetch`` makes Lance read: its own, plus a preceding gap the reader
    scans through (at most ``max_gap`` rows after the previous range).
    """
    rows = cell_start[fetch.ranges]
    own = rows[:, 1] - rows[:, 0]
    gap = np.zeros(len(rows), dtype=np.int64)
    if len(rows) > 1:
        g = rows[1:, 0] - rows[:-1, 1]
        gap[1:] = np.where((g >= 0) & (g <= max_gap), g, 0)
    return own + gap


def cost(fetch: Fetch, cell_start: Offsets, width: int, max_gap: int) -> int:
    """Bytes charged to ``fetch`` while it is read and assembled."""
    return int(read_rows(fetch, cell_start, max_gap).sum()) * width * COPIES


def scattered(fetch: Fetch, cell_start: Offsets) -> bool:
    """Whether ``fetch`` holds more than :data:`GROUP_RANGES` ranges of, on average, fewer
    than :data:`SCATTERED_ROWS` rows each.
    """
    n = len(fetch.ranges)
    if n <= GROUP_RANGES:
        return False
    rows = cell_start[fetch.ranges]
    return int((rows[:, 1] - rows[:, 0]).sum()) < SCATTERED_ROWS * n


def fits(in_flight: int, extra: int, budget: int) -> bool:
    """Whether ``extra`` more bytes may be started with ``in_flight`` held (always if none)."""
    return in_flight == 0 or in_flight + extra <= budget


def groups(
    fetch: Fetch,
    cell_start: Offsets,
    width: int,
    max_bytes: int,
    max_gap: int,
    max_ranges: int | None = None,
) -> list[Fetch]:
    """``fetch`` cut into consecutive groups of ranges costing about ``max_bytes`` each, and
    holding at most ``max_ranges`` ranges each where that is given.

    A range costing more is cut at cell boundaries (a single cell is never cut). A range is
    charged the gap before it that the reader scans through (:func:`read_rows`), as
    :func:`cost` charges it: sparse single cells a few thousand rows apart are read as long
    spans, ~20 times their own rows on a 5M-cell atlas. The groups' ranges, concatenated, are
    ``fetch.ranges`` in the same read order.
    """
    per_row = width * COPIES
    max_rows = max(1, max_bytes // per_row)
    given = np.asarray(fetch.ranges, dtype=np.int64).reshape(-1, 2)
    large = (read_rows(fetch, cell_start, max_gap) > max_rows) & (given[:, 1] - given[:, 0] > 1)
    pieces: list[np.ndarray] = []
    done = 0
    for i in np.flatnonzero(large).tolist():  # the ranges to cut, alone: no loop over cells
        a, b = given[i].tolist()
        offsets = cell_start[a : b + 1] - cell_start[a]
        cuts = np.searchsorted(offsets, np.arange(max_rows, int(offsets[-1]), max_rows), "right")
        cuts = np.unique(np.clip(cuts - 1, 1, b - a - 1))
        edges = np.concatenate([[0], cuts, [b - a]]) + a
        pieces += [given[done:i], np.stack([edges[:-1], edges[1:]], axis=1)]
        done = i + 1
    ranges = np.concatenate([*pieces, given[done:]]) if pieces else given
    rows = read_rows(Fetch(fetch.index, ranges, None), cell_start, max_gap)
    group = (np.cumsum(rows) - rows) // max_rows
    bounds = np.flatnonzero(np.diff(group, prepend=-1, append=group[-1] + 1 if len(group) else 0))
    if max_ranges is not None:  # a group of more ranges: cut into equal groups of at most that
        lo, n = bounds[:-1], np.diff(bounds)
        parts = -(-n // max_ranges)
        extra = np.maximum(parts - 1, 0)  # cuts inside each group
        g = np.repeat(np.arange(len(n)), extra)
        j = np.arange(int(extra.sum())) - np.repeat(np.cumsum(extra) - extra, extra) + 1
        cuts = np.rint(j * (n[g] / parts[g]) + lo[g]).astype(np.int64)  # as np.linspace
        bounds = np.union1d(bounds, cuts)
    return [
        Fetch(fetch.index, ranges[lo:hi], None)
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
    ]


def concat(index: int, chunks: list[Chunk]) -> Chunk:
    """Chunks of consecutive groups of one fetch as one chunk, in read order."""
    if len(chunks) == 1:
        return chunks[0]
    rows = [c for c in chunks if len(c.genes)] or chunks[:1]  # an empty chunk's dtypes are
    lengths = np.concatenate([c.lengths for c in chunks])  # placeholders: leave them out
    indptr = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    cell_ids = np.concatenate([c.cell_ids for c in chunks])
    return Chunk(
        index,
        cell_ids,
        indptr,
        np.concatenate([c.genes for c in rows]),
        np.concatenate([c.values for c in rows]),
        np.arange(len(cell_ids), dtype=np.int64),
    )
