"""Stage 3: read the expression rows of a fetch as Arrow record batches.

A fetch is a list of contiguous cell ranges. ``cells.cell_start_index`` turns each into a
contiguous row range of ``expression.lance``, so no filter is evaluated. How the ranges are
read depends on their shape (numbers from ``benchmarks/read_paths.py`` and docs/sampling.md):

- one range (streaming, chunk shuffle): one Lance scan with ``offset``/``limit``;
- many ranges (block sampling): ranges whose gaps are short are coalesced into spans (scanning
  a gap row costs ~5-8 ns, a separate range request ~0.2-0.5 ms), unless the spans would hold
  more than 32 times the wanted rows (sparse single cells are cheaper by row id); spans of 64Ki
  rows or more are scanned, runs of shorter spans are read with one ``take_scan`` call (one
  request, Lance parallelises it) and the wanted rows cut out with Arrow ``take``, or, when
  they are tiny (single cells), with one ``take`` of their row ids.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from slafload.dataset import SlafDataset
from slafload.errors import ReadError, SlafloadError
from slafload.samplers import Fetch
from slafload.samplers.block import expand_ranges

logger = logging.getLogger(__name__)
T = TypeVar("T")
_END = object()

COLUMNS = ["cell_integer_id", "gene_integer_id", "value"]
MAX_GAP_ROWS = 32_768  # gaps up to this many rows are scanned through rather than skipped
MAX_READ_AMPLIFICATION = 32  # ...unless that reads more than this many times the wanted rows
TAKE_BELOW_ROWS = 512  # spans shorter than this on average are read by row id
SCAN_FROM_ROWS = 1 << 16  # spans this long are scanned (take_scan is slower per row)


class Reader:
    """Reads whole cells from a pinned :class:`SlafDataset`.

    Args:
        dataset: The opened dataset; its pinned Lance version is read.
        batch_rows: Rows per Arrow record batch requested from Lance.
    """

    def __init__(self, dataset: SlafDataset, *, batch_rows: int = 1 << 20):
        if batch_rows < 1:
            raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
        self.dataset = dataset
        self.batch_rows = batch_rows

    def row_ranges(self, fetch: Fetch) -> np.ndarray:
        """``int64[k, 2]`` expression row ranges of the fetch's cell ranges."""
        return self.dataset.cell_start[fetch.ranges]

    def read(self, fetch: Fetch) -> Iterator[pa.RecordBatch]:
        """Yield the record batches holding exactly the rows of ``fetch``, in range order.

        Raises:
            ReadError: storage failed; the message names the fetch and its cell ranges.
        """
        rows = self.row_ranges(fetch)
        rows = rows[rows[:, 1] > rows[:, 0]]
        if len(rows) == 0:
            return
        try:
            # Every Lance stream of the fetch is opened and started before the first batch is
            # handed on: Lance then decodes all of them on its own threads, so a caller that
            # takes the first batch early (``RetryingReader.start``) overlaps the read with work.
            streams = (
                [started(self._scan(int(rows[0, 0]), int(rows[0, 1])))]
                if len(rows) == 1
                else self._open_many(rows)
            )
            for stream in streams:
                yield from stream
        except SlafloadError:
            raise
        except Exception as exc:
            raise ReadError(
                f"Reading {fetch!r} (expression rows {_describe(rows)}) from "
                f"{self.dataset.uri!r} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _scan(self, start: int, stop: int) -> Iterator[pa.RecordBatch]:
        scanner = self.dataset.expression.scanner(
            columns=COLUMNS,
            offset=start,
            limit=stop - start,
            batch_size=self.batch_rows,
            batch_readahead=max(16, -(-(stop - start) // self.batch_rows)),  # the whole range
            scan_in_order=True,
        )
        return iter(scanner.to_batches())

    def _open_many(self, rows: np.ndarray) -> list[Iterator[pa.RecordBatch]]:
        first, last = _span_ends(coalesce(rows, MAX_GAP_ROWS))
        wanted = int((rows[:, 1] - rows[:, 0]).sum())
        if int((rows[last, 1] - rows[first, 0]).sum()) > MAX_READ_AMPLIFICATION * wanted:
            first, last = _span_ends(np.arange(len(rows)))  # sparse: skip the gaps instead
        spans = np.stack([rows[first, 0], rows[last, 1]], axis=1)
        long = spans[:, 1] - spans[:, 0] >= SCAN_FROM_ROWS
        # Runs of spans of one kind, in read order: long spans scan, runs of short ones batch.
        cuts = np.flatnonzero(np.diff(long)) + 1
        streams = []
        for group in np.split(np.arange(len(spans)), cuts):
            if long[group[0]]:
                for i in group.tolist():
                    batches = started(self._scan(int(spans[i, 0]), int(spans[i, 1])))
                    streams.append(_cut(batches, rows[first[i] : last[i] + 1], int(spans[i, 0])))
            else:
                streams.append(
                    self._open_short(
                        rows[first[group[0]] : last[group[-1]] + 1],
                        spans[group],
                        first[group],
                        last[group] + 1,
                    )
                )
        return streams

    def _open_short(
        self, rows: np.ndarray, spans: np.ndarray, first: np.ndarray, stop: np.ndarray
    ) -> Iterator[pa.RecordBatch]:
        expression = self.dataset.expression
        if (spans[:, 1] - spans[:, 0]).sum() < TAKE_BELOW_ROWS * len(spans):
            table = expression.take(pa.array(expand_ranges(rows)), columns=COLUMNS)
            return iter(table.to_batches(max_chunksize=self.batch_rows))
        reader = expression._ds.take_scan(
            [tuple(s) for s in spans.tolist()],
            columns=COLUMNS,
            batch_readahead=len(spans),  # all of them: Lance reads the fetch in the background
        )
        return _cut_spans(started(iter(reader)), rows, first, stop, spans)


def _cut_spans(
    batches: Iterator[pa.RecordBatch],
    rows: np.ndarray,
    first: np.ndarray,
    stop: np.ndarray,
    spans: np.ndarray,
) -> Iterator[pa.RecordBatch]:
    offset = first[0]
    for i, batch in enumerate(batches):  # one batch per span, in request order
        yield from _cut([batch], rows[first[i] - offset : stop[i] - offset], int(spans[i, 0]))


def started(items: Iterable[T]) -> Iterator[T]:
    """``items`` with its first item pulled now; an error in doing so is raised on iteration.

    Pulling a Lance stream's first batch starts its read-ahead on Lance's own threads: the rest
    is decoded in the background while the caller does other work.
    """
    items = iter(items)
    try:
        head = next(items, _END)
    except Exception as exc:
        return _raising(exc)
    return items if head is _END else itertools.chain([head], items)


def _raising(exc: Exception) -> Iterator[Any]:
    raise exc
    yield


def _cut(
    batches: Iterable[pa.RecordBatch], ranges: np.ndarray, start: int
) -> Iterator[pa.RecordBatch]:
    """The rows of ``ranges`` from the batches of one span starting at row ``start``."""
    if len(ranges) == 1:
        yield from batches  # the span is exactly one range
        return
    span = pa.Table.from_batches(list(batches)).combine_chunks()
    yield from span.take(pa.array(expand_ranges(ranges - start))).to_batches()


def coalesce(ranges: np.ndarray, max_gap: int) -> np.ndarray:
    """Span number of each range: consecutive ranges whose gap is in ``[0, max_gap]`` share one."""
    gap = ranges[1:, 0] - ranges[:-1, 1]
    return np.concatenate([[0], np.cumsum((gap < 0) | (gap > max_gap))])


def _span_ends(span_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First and last range index of each span, from the span number of each range."""
    first = np.flatnonzero(np.diff(span_of, prepend=-1))
    return first, np.append(first[1:], len(span_of)) - 1


def _describe(rows: np.ndarray) -> str:
    spans = ", ".join(f"[{a}, {b})" for a, b in rows[:4].tolist())
    return spans + (f", ... {len(rows) - 4} more" if len(rows) > 4 else "")
