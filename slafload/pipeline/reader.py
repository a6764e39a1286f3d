"""Read the expression rows of a fetch from Lance as Arrow record batches.

The read *stage* (retries, read-ahead) is :mod:`slafload.pipeline.read`; this module is the Lance I/O
it calls.

A fetch is a list of contiguous cell ranges. ``cells.cell_start_index`` turns each into a
contiguous row range of ``expression.lance``, so no filter is evaluated. How the ranges are
read depends on their shape (numbers in docs/sampling.md):

- one range (streaming, chunk shuffle): one Lance scan with ``offset``/``limit``;
- many ranges (block sampling): ranges whose gaps are short are coalesced into spans (scanning
  a gap row costs a few ns, a separate range request ~0.2-0.5 ms), unless the spans would hold
  more than 32 times the wanted rows (sparse single cells are cheaper by row id); spans of 1Mi
  rows or more (64Ki without kept-open readers, or on other object stores) are scanned, all shorter
  spans are read through kept-open Lance file readers
  (:mod:`slafload._lance.data_files`, where that is exact; else with one ``take_scan`` call, whose
  per-range cost grows with the number of data files) or, when they are tiny (single cells
  of a few hundred rows), one ``take`` of their row ids; the wanted rows are zero-copy slices
  of the spans. On ``s3://`` range requests read each span whole where its gap rows are worth
  the requests they save, else its ranges alone (:mod:`slafload._lance.ranged`); a fetch
  that is one span of 1Mi rows or more read whole (a chunk's first cells, or the rest of it)
  is one Lance scan there, as a fetch of one range is.

Every Lance stream of a fetch is opened and started (its first batch pulled) before the first
batch is handed on, so Lance decodes the rest of each stream on its own threads; a caller that
takes the first batch early (``RetryingReader.start``) overlaps that part of the read with other
work. A stream's first batch is read synchronously, as is a ``take`` of tiny spans, so a fetch
that fits one Arrow batch is read whole by then.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import pyarrow as pa

from slafload._lance._compat import take_scan
from slafload._lance.data_files import DataFiles, direct_by_default, is_remote
from slafload._lance.fragments import version_error
from slafload._lance.integrity import is_panic, raise_if_corrupt
from slafload._lance.object_store import StoreOptions
from slafload._validate import check_int
from slafload.errors import ReaderFallbackWarning, ReadError, SlafloadError
from slafload.kernels import NUMPY, Kernels, prepare_reads
from slafload.pipeline.buffers import BytePool
from slafload.pipeline.ranges import coalesce, describe, expand_ranges, span_ends
from slafload.types import Fetch

if TYPE_CHECKING:  # the dataset makes its readers (SlafDataset.reader)
    from slafload.data.dataset import SlafDataset

logger = logging.getLogger(__name__)
T = TypeVar("T")
_END = object()

COLUMNS = ["cell_integer_id", "gene_integer_id", "value"]
CHECKED_COLUMNS = ["gene_integer_id", "value"]  # rows already checked: no cell ids
MAX_GAP_ROWS = 1 << 17  # gaps up to this many rows are scanned through rather than skipped
MAX_READ_AMPLIFICATION = 32  # ...unless that reads more than this many times the wanted rows
TAKE_BELOW_ROWS = 512  # spans shorter than this on average are read by row id
SCAN_FROM_ROWS = 1 << 16  # spans this long are scanned (take_scan is slower per row)
DIRECT_SCAN_FROM_ROWS = 1 << 20  # ...or this long, when open file readers or requests read
REQUEST_ROWS = 1 << 14  # rows (~40 KB) a range request is worth reading through instead...
SHORT_RANGE_ROWS = 1 << 12  # ...where a span's ranges are this short on average
COMPACT_FROM = 8  # spans reading this many times their wanted rows keep only those, at once


@dataclass(frozen=True, eq=False)
class ReadOptions:
    """How a :class:`Reader` reads: the loader's read tuning (:class:`~slafload.config.Tuning`)
    and what it shares with its readers (a mixture hands the same options to every source's
    reader). ``Tuning.reader="lance"`` sets ``direct=False``; ``flat``, ``mini`` and ``direct=True``
    are not loader settings, and tests that compare read paths set them here.

    Attributes:
        batch_rows: Rows per Arrow record batch requested from Lance.
        direct: Read short spans from the data files with open file readers
            (:mod:`slafload._lance.data_files`) where that is exact; ``False`` always uses
            ``take_scan``; ``None`` decides by storage and file format
            (:func:`~slafload._lance.data_files.direct_by_default`).
        threads: Data files the direct path reads at once (:class:`DataFiles`); ``None``
            picks by storage (more on object stores).
        flat: Read local Lance 2.0 data files' plain pages without Lance's decoder
            (:mod:`slafload._lance.flat_pages`) on the direct path.
        kernels: The loader's compiled kernels: flat data files are read by one kernel
            call per window of ranges.
        pool: The buffers flat reads read into (shared by the readers given it); ``None``:
            each reader's own.
        mini: Flat reads decode local Lance 2.1+ files' mini-block pages too (with numba
            kernels; :mod:`slafload._lance.miniblock`).
        store: How the direct path reads data files on an ``s3://`` store: by range requests
            (:mod:`slafload._lance.ranged`); ``None``: Lance's file readers.
    """

    batch_rows: int = 1 << 22
    direct: bool | None = None
    threads: int | None = None
    flat: bool = True
    kernels: Kernels = NUMPY
    pool: BytePool | None = None
    mini: bool = True
    store: StoreOptions | None = field(default_factory=StoreOptions)

    def __post_init__(self) -> None:
        check_int("batch_rows", self.batch_rows)
        check_int("threads", self.threads, none_ok=True)


class Reader:
    """Reads whole cells from a pinned :class:`SlafDataset`, as ``options`` say
    (:class:`ReadOptions`; ``None``: the defaults).
    """

    def __init__(self, dataset: SlafDataset, options: ReadOptions | None = None):
        self.dataset = dataset
        self.options = ReadOptions() if options is None else options
        self._direct = self.options.direct  # None: decided on first use (lists the data files)
        self._files: DataFiles | None = None

    def data_files(self) -> DataFiles | None:
        """The direct data-file path, looked up on first use; ``None`` where it is not exact
        (or not chosen).
        """
        if self._direct is None:
            self._direct = direct_by_default(self.dataset.expression)
        if self._direct and self._files is None:
            o = self.options
            found = DataFiles.examine(
                self.dataset.expression,
                COLUMNS,
                storage_options=self.dataset.storage_options,
                threads=o.threads,
                flat=o.flat,
                kernels=o.kernels,
                pool=o.pool,
                mini=o.mini,
                store=o.store,
                shared=self.dataset.store_files,
            )
            if isinstance(found, str):
                warnings.warn(
                    f"{self.dataset.uri}: scattered reads (block sampling, shuffled blocks) "
                    f"go through Lance's take_scan, not slafload's direct data-file path, "
                    f"because {found}. The rows are the same; each scattered range costs "
                    "several times more, growing with the table's data files.",
                    ReaderFallbackWarning,
                    stacklevel=2,
                )
            self._files = found if isinstance(found, DataFiles) else None
            self._direct = self._files is not None
            if self._files is not None and self._files.flat:
                prepare_reads(o.kernels)  # compiled on the loader's thread, not the reads'
        return self._files

    def row_ranges(self, fetch: Fetch) -> np.ndarray:
        """``int64[k, 2]`` expression row ranges of the fetch's cell ranges."""
        return self.dataset.cell_start[fetch.ranges]

    def read(self, fetch: Fetch, *, cell_ids: bool = True) -> Iterator[pa.RecordBatch]:
        """Yield the record batches holding exactly the rows of ``fetch``, in range order.

        ``cell_ids=False`` allows leaving the ``cell_integer_id`` column out (for rows
        already checked): a fetch of one contiguous range is then scanned without it, which
        saves about a fifth of the scan's decoding. Scattered ranges always carry it (the
        kept-open file readers are opened for all three columns).

        Raises:
            ReadError: storage failed; the message names the fetch and its cell ranges.
        """
        rows = _joined(self.row_ranges(fetch))
        if len(rows) == 0:
            return
        try:
            if len(rows) == 1:
                columns = COLUMNS if cell_ids else CHECKED_COLUMNS
                yield from started(self._scan(int(rows[0, 0]), int(rows[0, 1]), columns))
            else:
                yield from self._read_many(rows)
        except (SlafloadError, GeneratorExit, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # BaseException: pylance's panics are
            if not isinstance(exc, Exception) and not is_panic(exc):
                raise
            raise_if_corrupt("expression", self.dataset.expression, rows, exc)  # damage shown
            skew = version_error(self.dataset.uri, exc, {"expression": self.dataset.expression})
            if skew is not None:
                raise skew from exc
            raise ReadError(
                f"Reading {fetch!r} (expression rows {describe(rows)}) from "
                f"{self.dataset.uri!r} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _scan(
        self, start: int, stop: int, columns: list[str] = COLUMNS
    ) -> Iterator[pa.RecordBatch]:
        scanner = self.dataset.expression.scanner(
            columns=columns,
            offset=start,
            limit=stop - start,
            batch_size=self.options.batch_rows,
            batch_readahead=max(16, -(-(stop - start) // self.options.batch_rows)),  # all of it
            scan_in_order=True,
        )
        return iter(scanner.to_batches())

    def _read_many(self, rows: np.ndarray) -> Iterator[pa.RecordBatch]:
        first, last = span_ends(coalesce(rows, MAX_GAP_ROWS))
        wanted = int((rows[:, 1] - rows[:, 0]).sum())
        if int((rows[last, 1] - rows[first, 0]).sum()) > MAX_READ_AMPLIFICATION * wanted:
            first, last = span_ends(np.arange(len(rows)))  # sparse: skip the gaps instead
        spans = np.stack([rows[first, 0], rows[last, 1]], axis=1)
        ranges = [rows[a : b + 1] for a, b in zip(first.tolist(), last.tolist(), strict=True)]
        own = np.concatenate([[0], np.cumsum(rows[:, 1] - rows[:, 0])])
        # Short spans mostly made of gaps (scattered single cells) keep their wanted rows as
        # soon as they are read, so the gap rows go at once, not when the fetch is assembled.
        # (Long scanned spans are not compacted: copying the rows of a 500k-cell atlas's
        # `BlockShuffle(1, 1024)` scans raised its peak RSS from ~1.0 to ~1.4 GB.)
        sparse = (spans[:, 1] - spans[:, 0] >= COMPACT_FROM * (own[last + 1] - own[first])).tolist()
        long = spans[:, 1] - spans[:, 0] >= self._scan_from()
        whole: list[bool] | None = None
        if self._ranged():  # range requests read every span, gap rows only where worth it
            wanted = own[last + 1] - own[first]
            gaps = spans[:, 1] - spans[:, 0] - wanted
            short = wanted < SHORT_RANGE_ROWS * (last + 1 - first)
            read_whole = gaps <= np.where(short, 3 * REQUEST_ROWS * (last - first), wanted // 2)
            whole = read_whole.tolist()
            # A fetch that is one long span read whole (a chunk's first cells, then the rest
            # of it, where the first batch is read first) is a contiguous read: one Lance scan,
            # as a one-range fetch and take_scan read it. Scattered spans keep the requests.
            long &= read_whole & (len(spans) == 1)
        # A scanner per long span and one Lance call for all short ones, all started before the
        # first batch is handed on; then the wanted rows of each span, in span order.
        scans = {i: started(self._scan(*spans[i].tolist())) for i in np.flatnonzero(long).tolist()}
        shorts = self._read_short(spans, ranges, np.flatnonzero(~long), sparse, whole)
        for i, span in enumerate(ranges):
            yield from _cut(scans.pop(i), span, int(spans[i, 0])) if long[i] else next(shorts)

    def _ranged(self) -> bool:
        """Whether range requests read this dataset's scattered ranges (an ``s3://`` store)."""
        files = self.data_files()
        return files is not None and files.ranged is not None

    def _scan_from(self) -> int:
        """Rows from which a span gets a scanner of its own.

        Kept-open file readers on local storage read a span of up to a data file's worth
        faster than a scanner, whose creation runs on the producer: on the 5M-cell atlas,
        ``BlockShuffle(1, 256)`` fetches hold ~840 spans of 64Ki-1Mi rows (docs/sampling.md).
        On ``s3://`` range requests read shorter spans, and only a fetch that is one span read
        whole is scanned from there (:meth:`_read_many`). ``take_scan`` (no direct path) and
        other object stores keep :data:`SCAN_FROM_ROWS`.
        """
        files = self.data_files()
        if files is not None and (files.ranged is not None or not is_remote(self.dataset.uri)):
            return DIRECT_SCAN_FROM_ROWS
        return SCAN_FROM_ROWS

    def _read_short(
        self,
        spans: np.ndarray,
        ranges: list[np.ndarray],
        which: np.ndarray,
        sparse: list[bool],
        whole: list[bool] | None = None,
    ) -> Iterator[Iterable[pa.RecordBatch]]:
        """The wanted rows of each span in ``which``, in order, read by one Lance call
        (``sparse`` spans' rows copied out of the span as soon as it is read). Where range
        requests read the files, ``whole`` says which spans are read whole, gap rows and all
        (the others' wanted rows alone are requested).
        """
        if len(which) == 0:
            return iter(())
        expression = self.dataset.expression
        wanted = [ranges[i] for i in which.tolist()]
        files = self.data_files()
        # Lance's take by row offset costs ~10 ms a row once a table has deleted rows: the
        # data files (which skip them) read those tables' tiny spans too.
        deleted = files is not None and files.table is not None and bool(files.table.deletions)
        ranged = files is not None and files.ranged is not None  # requests: fewest by range
        tiny = (spans[which, 1] - spans[which, 0]).sum() < TAKE_BELOW_ROWS * len(which)
        if tiny and not deleted and not ranged:
            ids = pa.array(expand_ranges(np.concatenate(wanted)))
            table = expression.take(ids, columns=COLUMNS)
            ends = np.cumsum([int((w[:, 1] - w[:, 0]).sum()) for w in wanted]).tolist()
            return (
                _nonempty(table.slice(a, b - a).to_batches())
                for a, b in zip([0, *ends[:-1]], ends, strict=True)
            )
        if files is not None:  # one read_range per piece on an open file: no per-range open
            # The read threads keep a sparse span's wanted rows as soon as they read each piece
            # (a span's ranges ascend without overlap: `coalesce` starts a new span at a repeat).
            # Range requests read no gap rows but those of spans read whole: each range's byte
            # runs are requested, those close together coalesced by the store (range_gap).
            keep = [
                None if ranged and whole is not None and whole[i]
                else ranges[i] if sparse[i] or ranged else None
                for i in which.tolist()
            ]  # fmt: skip
            # The chunk only checks the cell ids: their buffer goes back to the pool once
            # the fetch is assembled, while the chunk keeps the genes' and values'.
            per_span = files.read(spans[which], COLUMNS, keep, apart=COLUMNS[:1])
            return (
                batches if kept is not None else _cut(batches, ranges[i], int(spans[i, 0]))
                for batches, kept, i in zip(per_span, keep, which.tolist(), strict=True)
            )
        batches = take_scan(
            expression,
            [(a, b) for a, b in spans[which].tolist()],
            columns=COLUMNS,
            batch_readahead=len(which),  # all of them: Lance reads the fetch in the background
        )
        return (  # one batch per span, in request order
            _cut([batch], w, int(spans[i, 0]))
            for batch, w, i in zip(started(batches), wanted, which.tolist(), strict=True)
        )


def _joined(rows: np.ndarray) -> np.ndarray:
    """Non-empty row ranges, each run of touching ones joined (a mixed fetch's block may
    hold the end of one of its source's fetches and the start of the next, adjacent on disk):
    the same rows in the same order, read as one range where they are one.
    """
    rows = rows[rows[:, 1] > rows[:, 0]]
    if len(rows) < 2:
        return rows
    apart = rows[1:, 0] != rows[:-1, 1]
    if apart.all():
        return rows
    first = np.concatenate([[True], apart])
    last = np.concatenate([apart, [True]])
    return np.stack([rows[first, 0], rows[last, 1]], axis=1)


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
    return items if head is _END else itertools.chain([cast(T, head)], items)


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
    # Zero-copy slices, apart in memory: the chunk stage copies the wanted rows once when it
    # concatenates them.
    span = pa.Table.from_batches(list(batches))
    for a, b in (ranges - start).tolist():
        yield from _nonempty(span.slice(a, b - a).to_batches())


def _nonempty(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    return (batch for batch in batches if batch.num_rows)
