"""Read expression row ranges straight from the table's data files, with their readers kept open.

``LanceDataset.take_scan`` (and ``take``) turns every requested range of dataset row *offsets*
into row *addresses* by listing the pinned version's fragments and walking them from the first
(``row_offsets_to_row_addresses`` in Lance's ``dataset/take.rs``), then opens the fragment that
holds the range. Both costs are paid per range, and the first grows with the number of data
files: on a 5M-cell atlas (3,816 files) one 16-cell range costs several times what the same
read costs on a file whose reader is already open (numbers in docs/sampling.md). :class:`DataFiles` does that arithmetic once per pinned version
(one ``int64`` per data file) and keeps a bounded LRU cache of ``lance.file.LanceFileReader``
objects, so a range costs one ``read_range`` on an open file. Local files in Lance's 2.0
format, whose pages are plain arrays, are opened as :class:`~slafload._lance.flat_pages.FlatFile`
instead (``flat=True``, the default): their ranges are read by ``pread`` without Lance's
decoder, a window's worth by one kernel call, into reused buffers.

On an ``s3://`` store the files are read like local flat files, by range requests
(:mod:`slafload._lance.ranged`: each file's page metadata fetched once, then about one request
per column and range). Through Lance's file readers (other stores), a range read is a few
sequential requests (each column's page metadata, then its data: ~5 for the expression
table's three columns), each paying the store's latency, and a pylance file reader serves one
call at a time. So with ``threads > 1`` (the default:
:data:`REMOTE_THREADS` for ``s3://``-style URIs, :data:`LOCAL_THREADS` for local files, where
each range still pays a fixed ~0.2 ms of Lance's scheduling, whatever its size) the pieces of
a fetch are read by one task per thread, each data file's pieces in one task; with one, by one
background thread. Either way :meth:`DataFiles.read` returns as soon as they are submitted:
each range's batches are waited for when they are iterated, so the Read stage's read-ahead
overlaps the next fetch's requests with this one's compute. Readers on an object store share
one ``LanceFileSession`` (one client and connection pool) instead of a client each.

Only tables where this is exact take this path (:mod:`slafload._lance.fragments`): every fragment
has exactly one data file holding every column, no column overlays and no extra base path,
every data file lists the same field ids, and each column read is found by its field id, not
its name (a renamed column keeps the name it was written under in the files). Deleted rows are
skipped: a piece of live rows is read as the physical rows that hold them, deleted ones
dropped. Anything else gets a reason from :meth:`DataFiles.examine` and the reader keeps using
``take_scan`` (with a :class:`~slafload.errors.ReaderFallbackWarning`); a data file that stores
other names than the table's first (columns renamed between writes) is read through Lance.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lance
import numpy as np
import pyarrow as pa

from slafload._lance._compat import take_scan
from slafload._lance.flat_pages import V2_0, V2_1, FlatFile, _fixed
from slafload._lance.flat_reads import FlatRange, Layout, read_into, read_ranges
from slafload._lance.fragments import Deletions, Matched, file_versions, stored_names, survey
from slafload._lance.object_store import StoreOptions, supported
from slafload._lance.open_files import DECLINED, OpenFiles, is_remote
from slafload._lance.pieces import Job, Pending, keep_rows, pieces_kept
from slafload._lance.ranged import StoreFiles
from slafload.kernels import NUMPY, Kernels
from slafload.pipeline.buffers import BytePool
from slafload.pipeline.ranges import expand

logger = logging.getLogger(__name__)

Layouts = tuple[tuple[Layout, tuple[int, ...]], ...]  # a read's buffers and their columns

STREAMS_AT_ONCE = 128  # read_range streams alive at once (each holds its pages until consumed)
WINDOW_ROWS = 1 << 21  # ...and rows a read thread holds at once: a window is read whole first
REMOTE_THREADS = 16  # default threads for object stores: requests wait on latency, not CPU
LOCAL_THREADS = 4  # default for local files: each range's fixed scheduling cost overlaps


def flat_threads() -> int:
    """Default read threads for a local table read flat: one per core, 2 to :data:`LOCAL_THREADS`.

    Flat reads spend their time in GIL-free kernels, not in Lance's scheduling, and each
    thread's Python steps (a file's open, a window's plan) wait for the GIL. On 2 cores 2
    threads beat 4 by 11-16% at ``BlockShuffle(16 and 64, 256)`` on the 5M atlas as written
    (4 interleaved rounds, first 60k cells; docs/sampling.md). More cores keep up to 4, the
    Lance path's default (not measured there).
    """
    try:
        cores = len(os.sched_getaffinity(0))  # the cores this process may run on (cpusets)
    except AttributeError:  # not on every platform
        cores = os.cpu_count() or 2
    return max(2, min(LOCAL_THREADS, cores))


def direct_by_default(expression: lance.LanceDataset) -> bool:
    """Whether scattered ranges of ``expression`` are read through kept-open data files
    when ``Tuning.reader`` is ``"auto"``: on local storage, on an ``s3://`` store (by range
    requests, :mod:`slafload._lance.ranged`), and on other object stores when every data
    file is in Lance's 2.0 format.

    A pylance file reader keeps no cache of page metadata, so on an object store each range
    of a 2.1+ file first requests its pages' chunk metadata again; ``take_scan`` goes
    through the dataset's session, which caches it. Through a 20 ms-per-request proxy on
    the 500k-cell atlas (docs/object-storage.md): 2.2 files, ``BlockShuffle(64, 256)``
    5,622 (direct) vs 7,546 (``take_scan``) cells/s and ``(16, 256)`` 716 vs 1,381; 2.0
    files (``slafload optimize``), whose range reads need no such requests, 8,549 vs 6,205
    and 1,314 vs 1,314. Locally the direct path is several times faster per range.
    """
    if not is_remote(expression.uri) or supported(expression.uri):
        return True
    versions = file_versions(expression)
    return bool(versions) and max(versions) <= (2, 0)


class DataFiles(OpenFiles):
    """The data files of a pinned expression table, by dataset row offset.

    ``starts[i]`` is the dataset row offset of data file ``i``'s first row (``starts[-1]`` the
    row count). :meth:`read` is called from one thread (the producer) and hands the reads to
    worker threads, each file's reader (kept open by :class:`~slafload._lance.open_files.OpenFiles`)
    used by one of them at a time.

    Args:
        threads: Data files read at once by :meth:`read`; ``None``: :data:`REMOTE_THREADS` on
            an object store, :func:`flat_threads` for local paths read flat,
            :data:`LOCAL_THREADS` for others.
        flat: Read local files without Lance's decoder where exact (Lance 2.0 files, and
            2.1+ ones with ``mini``: :mod:`slafload._lance.flat_pages`); ``False`` reads every file
            through Lance (:meth:`of` passes ``False`` for a table with no such file, so
            none is tried).
        kernels: Where flat reads find the ``pread_runs`` kernel (compiled already: the read
            threads never start a compile).
        pool: The buffers flat reads read into (shared by a mixture's sources, so what is
            kept stays within one pool's bound); ``None``: a pool of its own.
        versions: Each data file's Lance format ``(major, minor)``, where known (:meth:`of`
            passes them): a 2.1+ file is then not tried flat until the mini-block decoder
            is loaded.
        mini: Flat reads decode 2.1+ files' mini-block pages too (:mod:`slafload._lance.miniblock`),
            by ``kernels``' ``decode_chunks`` once it is loaded (Lance's reader until then).
        store: How files on an ``s3://`` store are read by range requests
            (:mod:`slafload._lance.ranged`); ``None``: by Lance's file readers.
        shared: Where those files are kept for the dataset's other loaders
            (:class:`~slafload._lance.ranged.StoreFiles`); ``None``: this reader's own.
    """

    def __init__(
        self,
        paths: Sequence[str],
        starts: np.ndarray,
        storage_options: Mapping[str, str] | None = None,
        max_open: int | None = None,
        threads: int | None = None,
        *,
        flat: bool = True,
        kernels: Kernels = NUMPY,
        pool: BytePool | None = None,
        versions: Sequence[tuple[int, int]] | None = None,
        mini: bool = False,
        store: StoreOptions | None = None,
        shared: StoreFiles | None = None,
    ):
        super().__init__(paths, storage_options, max_open, flat=flat, kernels=kernels,
                         versions=versions, mini=mini, store=store, shared=shared)  # fmt: skip
        self.starts = np.asarray(starts, dtype=np.int64)
        remote = bool(self.paths) and is_remote(self.paths[0])
        if threads is None:
            threads = REMOTE_THREADS if remote else flat_threads() if flat else LOCAL_THREADS
        self.threads = threads
        self._pool = BytePool() if pool is None else pool  # the flat reads' buffers
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        self._in_turn = threading.Lock()  # one fetch's reads at a time on the one-thread path

    @classmethod
    def of(
        cls, expression: lance.LanceDataset, columns: Sequence[str], *args: Any, **kwargs: Any
    ) -> DataFiles | None:
        """:meth:`examine` (same arguments), with ``None`` where it declines."""
        found = cls.examine(expression, columns, *args, **kwargs)
        return found if isinstance(found, DataFiles) else None

    @classmethod
    def examine(
        cls,
        expression: lance.LanceDataset,
        columns: Sequence[str],
        storage_options: Mapping[str, str] | None = None,
        max_open: int | None = None,
        threads: int | None = None,
        *,
        flat: bool = True,
        kernels: Kernels = NUMPY,
        pool: BytePool | None = None,
        mini: bool = False,
        store: StoreOptions | None = None,
        shared: StoreFiles | None = None,
    ) -> DataFiles | str:
        """The data files of ``expression``'s pinned version, or why reading them directly
        would not be exact (see the module docstring and :mod:`slafload._lance.fragments`).

        ``flat``: read the version's local files without Lance's decoder where exact
        (:mod:`slafload._lance.flat_pages`): Lance 2.0 files, and with ``mini`` 2.1+ files when
        ``kernels`` are numba's (their mini-block pages decoded by a kernel,
        :mod:`slafload._lance.miniblock`; the numpy decoder is the reference, slower than Lance's).
        ``store``: on an ``s3://`` store, read the files by range requests
        (:mod:`slafload._lance.ranged`), their 2.1+ pages decoded by numpy until numba's kernel
        is loaded (a request's latency dwarfs the decoding); ``shared``: where the files it
        opens are kept for the dataset's other loaders.
        """
        found = survey(expression)
        if isinstance(found, str):
            return found
        ranged = store is not None and supported(expression.uri)
        mini = mini and (ranged or kernels.backend == "numba")  # 2.1+: a kernel decodes
        versions = found.versions
        flat = flat and any(v in V2_0 or (mini and v in V2_1) for v in versions)
        starts = np.concatenate([[0], np.cumsum(found.rows)])
        direct = cls(found.paths, starts, storage_options, max_open, threads, flat=flat,
                     kernels=kernels, pool=pool, versions=versions, mini=mini,
                     store=store if ranged else None, shared=shared)  # fmt: skip
        try:
            stored = direct.stored_schema()
        except Exception as exc:  # an unreadable file is the scan's to report, not ours
            return f"its first data file cannot be opened ({type(exc).__name__}: {exc})"
        if direct.ranged is not None:  # storage options Lance reads and pyarrow's S3 may not
            try:
                direct.ranged.open(direct.paths[0])
            except Exception as exc:
                return (
                    f"its first data file cannot be read by range requests through pyarrow's "
                    f"S3 client ({type(exc).__name__}: {exc}); check the storage options "
                    "(slafload/_lance/object_store.py's s3_filesystem says which it reads)"
                )
        names = stored_names(expression, found.fields, stored, columns)
        if isinstance(names, str):
            return names
        direct.table = Matched(
            expression, names, tuple(stored.names), Deletions(expression, found.deleted)
        )
        if int(direct.starts[-1]) != expression.count_rows():
            return (
                f"its fragments hold {int(direct.starts[-1])} live rows but the table counts "
                f"{expression.count_rows()}"
            )
        if not flat:  # the reader the reads would open first anyway
            cols = tuple(names[c] for c in columns)
            direct._entry(0, cols).reader = direct._new_reader(0, cols)
        return direct

    @property
    def n_files(self) -> int:
        """Data files of the pinned version."""
        return len(self.paths)

    def pieces(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Cut non-empty row ranges ``int64[k, 2]`` at data-file boundaries.

        Returns ``(range index, file index, first row in the file, rows)`` per piece, in
        range order.
        """
        first = np.searchsorted(self.starts, rows[:, 0], side="right") - 1
        last = np.searchsorted(self.starts, rows[:, 1] - 1, side="right") - 1
        counts = last - first + 1
        which = np.repeat(np.arange(len(rows)), counts)
        file = expand(first, counts)
        lo = np.maximum(rows[which, 0], self.starts[file])
        hi = np.minimum(rows[which, 1], self.starts[file + 1])
        return which, file, lo - self.starts[file], hi - lo

    def read(
        self,
        rows: np.ndarray,
        columns: Sequence[str],
        wanted: Sequence[np.ndarray | None] | None = None,
        apart: Sequence[str] = (),
    ) -> list[Sequence[pa.RecordBatch]]:
        """The batches of every row range (non-empty ``int64[k, 2]``), one sequence per range.

        ``wanted``, when given, holds for each range the row ranges inside it that the caller
        keeps (``int64[j, 2]``, absolute rows, ascending and not overlapping; the rest are
        gaps read through), or ``None`` for all of it: each range's batches are then those
        rows alone. Each read thread keeps them as soon as it has read a piece
        (:func:`~slafload._lance.pieces.keep_rows`), so the gap rows of a coalesced span (up to 32 times the wanted rows
        for scattered single cells) live only while that piece is in hand, not until the
        whole fetch is assembled.

        Flat pieces are read into one buffer per read, each column's rows of all of them back
        to back in range order (:meth:`_layouts`), so the fetch's columns need no copy to be
        made one; the columns ``apart`` names get a buffer of their own, which goes back to
        the pool as soon as they are dropped, not when the rest is (local files: on an
        object store the columns' requests are coalesced together).

        Returns at once: the reads run on ``threads`` background threads, one task each
        (:meth:`_read_windows`), each data file's pieces in one task, the files dealt to the
        tasks in turn. Each range's sequence waits, when it is iterated, for the windows that
        read its pieces, and raises their task's error there. So the Read stage's read-ahead
        overlaps a fetch's range reads with the compute of the fetch before it, as a scan
        overlaps its decoding on Lance's threads. The pool's threads end with their tasks (it
        is shut down without waiting), so nothing outlives a fetch that is dropped half read.
        """
        names = tuple(columns)
        cols = names if self.table is None else tuple(self.table.names[c] for c in names)
        which, file, lo, n = self.pieces(rows)
        keep = pieces_kept(rows, wanted, which, self.starts[file] + lo, n)
        live: list[tuple[int, int]] = []  # each piece's live rows, for a file read through Lance
        live_keep = list(keep)
        if self.table is not None:
            live.extend(zip((self.starts[file] + lo).tolist(), n.tolist(), strict=True))
            if self.table.deletions:
                lo, n, keep = self._physical(file, lo, n, keep)
        layouts, first = self._layouts(cols, names, n, keep, apart)
        job = Job(cols, names, [None] * len(file), keep, live, live_keep, layouts, first)
        by_file: dict[int, list[tuple[int, int, int]]] = {}
        for k, (f, a, m) in enumerate(zip(file.tolist(), lo.tolist(), n.tolist(), strict=True)):
            by_file.setdefault(f, []).append((k, a, m))
        files = list(by_file.items())
        n_tasks = min(self.threads, len(files))
        window = max(1, STREAMS_AT_ONCE // n_tasks)  # streams alive per fetch, in all
        plans = [_windows(files[t::n_tasks], window, first=t == 0) for t in range(n_tasks)]
        events = [[threading.Event() for _ in plan] for plan in plans]  # one per window
        pool = ThreadPoolExecutor(n_tasks, "slafload-read")
        try:
            tasks = [
                pool.submit(self._read_windows, plan, job, done)
                for plan, done in zip(plans, events, strict=True)
            ]
        finally:
            pool.shutdown(wait=False)  # the threads end with their tasks
        owner = {  # each piece's task and its window's event
            k: (task, read)
            for task, plan, done in zip(tasks, plans, events, strict=True)
            for some, read in zip(plan, done, strict=True)
            for _, k, _, _ in some
        }
        parts: list[list[int]] = [[] for _ in range(len(rows))]
        for k, w in enumerate(which.tolist()):
            parts[w].append(k)
        return [Pending([owner[k] for k in p], job.tables, p, self.notice) for p in parts]

    def _layouts(
        self, cols: tuple[str, ...], names: tuple[str, ...], n: np.ndarray,
        keep: Sequence[np.ndarray | None], apart: Sequence[str] = (),
    ) -> tuple[Layouts, list[int]]:  # fmt: skip
        """The buffers every flat piece of a read is read into, each with the positions of
        its columns (the columns ``apart`` names in one, the rest in another), and each
        piece's first row in them.

        The pieces' rows (those kept) lie in them in piece order, so each column of the fetch
        they make is one run of memory, which the chunk takes without a copy
        (:mod:`slafload.pipeline.chunk`). No buffers where no file is read flat or the
        table's columns are not all fixed-width numbers; a piece read otherwise (through
        Lance) leaves its rows of the buffers unused.
        """
        if not self.flat or self.table is None:
            return (), []
        schema = self.table.expression.schema
        fields = [schema.field(name).with_name(c) for c, name in zip(cols, names, strict=True)]
        if not all(_fixed(f.type) for f in fields):
            return (), []
        rows = [m if k is None else int((k[:, 1] - k[:, 0]).sum())
                for m, k in zip(n.tolist(), keep, strict=True)]  # fmt: skip
        first = list(itertools.accumulate(rows, initial=0))
        # On an object store one buffer: one fill coalesces every column's runs of a window
        # into fewer requests (a request costs more than the memory kept).
        split = [i for i, name in enumerate(names) if name in apart and self.ranged is None]
        groups = [g for g in (split, [i for i in range(len(names)) if i not in split]) if g]
        return tuple(
            (Layout.make(pa.schema([fields[i] for i in g]), first[-1], self._pool), tuple(g))
            for g in groups
        ), first

    def _physical(
        self, file: np.ndarray, lo: np.ndarray, n: np.ndarray, keep: list[np.ndarray | None]
    ) -> tuple[np.ndarray, np.ndarray, list[np.ndarray | None]]:
        """The pieces' physical rows and kept runs, deleted rows skipped
        (:meth:`slafload._lance.fragments.Deletions.physical`).
        """
        assert self.table is not None
        deletions = self.table.deletions
        lo, n, keep = lo.copy(), n.copy(), list(keep)
        for k, f in enumerate(file.tolist()):
            if f in deletions.files:
                lo[k], n[k], keep[k] = deletions.physical(f, int(lo[k]), int(n[k]), keep[k])
        return lo, n, keep

    def _read_windows(
        self, plan: list[list[tuple[int, int, int, int]]], job: Job,
        done: list[threading.Event],
    ) -> None:  # fmt: skip
        """Read one task's pieces ``(file, k, first row, rows)``, window by window, into
        ``job.tables[k]`` (only the rows ``job.keep[k]`` names, where it names any), setting a
        window's event ``done[i]`` once it is read (and every event left, if the task fails).

        A task per thread, not per file or range, and each piece read whole by one call: every
        Python step of a read (a future, a queue hand-off, a batch pulled) must take the GIL
        back, which the producer and the token worker hold for long stretches, so each step
        saved per range is waiting saved (docs/sampling.md, "The GIL and the read threads").
        A window's streams are all created before any of them is consumed, so Lance schedules
        their I/O together (1.9x faster than one by one on one thread, measured) while the
        pages they hold stay bounded (all 8k streams of a fetch of single cells at once peaked
        at 3 GB of RSS). The first task's first window is the fetch's first piece alone, so
        the fetch's first range, which the Read stage's read-ahead waits for (it takes each
        fetch as far as its first batch), waits for one read, not for a task's share of the
        fetch (the producer spent 40-58% of its time there at 5M). A file reader serves one
        call at a time, so its lock is held while a stream is created, not while it is read.
        With one thread, one fetch is read at a time, in the order asked.
        """
        try:
            with self._in_turn if self.threads == 1 else contextlib.nullcontext():
                for some, read in zip(plan, done, strict=True):
                    self._open_window(some, job.cols)
                    streams = [self._stream(f, job.cols, a, m) for f, _, a, m in some]
                    first = [job.first[k] for _, k, _, _ in some] if job.layouts else []
                    flat = self._read_flat(streams, [job.keep[k] for _, k, _, _ in some],
                                           job.layouts, first)  # fmt: skip
                    for i, ((_, k, _, _), stream) in enumerate(zip(some, streams, strict=True)):
                        if i in flat:  # read flat: the kept rows only
                            job.tables[k] = job.named(flat[i])
                        elif stream is DECLINED:
                            job.tables[k] = self._through_lance(job, k)
                        else:
                            table = stream.to_table()  # one call: the GIL is taken back once
                            ranges = job.keep[k]
                            table = table if ranges is None else keep_rows(table, ranges)
                            job.tables[k] = job.named(table)
                    read.set()
        finally:
            for read in done:
                read.set()

    def _through_lance(self, job: Job, k: int) -> pa.Table:
        """Piece ``k`` of ``job`` read by Lance's ``take_scan`` (its file is :data:`DECLINED`)."""
        assert self.table is not None
        first, rows = job.live[k]
        batches = take_scan(self.table.expression, [(first, first + rows)],
                            columns=list(job.names), batch_readahead=1)  # fmt: skip
        table = pa.Table.from_batches(list(batches))
        ranges = job.live_keep[k]
        return table if ranges is None else keep_rows(table, ranges)

    def _read_flat(
        self, streams: list[Any], keep: Sequence[np.ndarray | None],
        layouts: Layouts = (), first: Sequence[int] = (),
    ) -> dict[int, pa.Table]:  # fmt: skip
        """The tables of the :class:`FlatRange` items of ``streams``, by position, all read
        by one :func:`~slafload._lance.flat_reads.read_into` call per buffer: of a piece whose
        ``keep`` names the rows it keeps (relative to the piece), those rows alone, each run
        its own read (a flat read costs ~0.03 ms, so reading through the gaps saves nothing:
        on the 5M atlas, ``BlockShuffle(1, 256)``'s coalesced spans were ~20x its rows, and
        the pieces read whole beside them held their gap rows in memory).

        With the read's ``layouts`` (:meth:`_layouts`), each piece's rows are read into them
        from its row ``first[i]`` on and its table is made of slices of theirs; without them
        (or for files whose columns are not theirs), into a buffer of the window's own.
        """
        runs, owner, at = [], [], []
        for i, (stream, kept) in enumerate(zip(streams, keep, strict=True)):
            if not isinstance(stream, FlatRange):
                continue
            row = first[i] if layouts else 0
            file, start = stream.file, stream.start
            for a, b in [(0, stream.rows)] if kept is None else kept.tolist() or [(0, 0)]:
                runs.append(FlatRange(file, start + a, b - a))
                owner.append(i)
                at.append(row)
                row += b - a
        if not runs:
            return {}
        if layouts and _layouts_fit(runs, layouts):
            for layout, columns in layouts:
                read_into(runs, layout, at, self.kernels, self._pool, columns)
            ends = {i: row + r.rows for i, row, r in zip(owner, at, runs, strict=True)}
            return {i: _sliced(layouts, first[i], end - first[i]) for i, end in ends.items()}
        parts: dict[int, list[pa.Table]] = {}
        for i, table in zip(owner, read_ranges(runs, self.kernels, self._pool), strict=True):
            parts.setdefault(i, []).append(table)
        return {i: t[0] if len(t) == 1 else pa.concat_tables(t) for i, t in parts.items()}

    def _stream(self, index: int, cols: tuple[str, ...], start: int, rows: int) -> Any:
        """A started ``read_range`` of ``rows`` rows from ``start`` in data file ``index``
        (for a flat file, the read itself is left to the caller's ``to_table()``).
        """
        entry = self._entry(index, cols)
        with entry.lock:
            reader = self._opened(entry, index, cols)
            if reader is DECLINED:
                return DECLINED  # read through Lance by the caller
            if isinstance(reader, FlatFile):  # read with the window's other flat ranges
                return FlatRange(reader, start, rows)
            # One batch per range, so nothing to read ahead: pylance's default of 16 cost
            # ~5% more CPU per range, measured on the 5M-cell atlas.
            lance_reader: Any = reader
            return lance_reader.read_range(start, rows, batch_size=rows, batch_readahead=1)


def _layouts_fit(runs: Sequence[FlatRange], layouts: Layouts) -> bool:
    """Whether the files of ``runs`` store the columns of ``layouts``, in their dtypes."""
    dtypes: dict[int, np.dtype] = {}
    for layout, columns in layouts:
        dtypes.update(zip(columns, layout.dtypes, strict=True))
    wanted = [dtypes[c] for c in range(len(dtypes))]
    files = {id(r.file): r.file for r in runs}.values()
    return all([c.dtype for c in f._columns] == wanted for f in files)


def _sliced(layouts: Layouts, first: int, rows: int) -> pa.Table:
    """Rows ``[first, first + rows)`` of ``layouts``' tables, as one table in column order."""
    if len(layouts) == 1:
        return layouts[0][0].table.slice(first, rows)
    fields: dict[int, pa.Field] = {}
    arrays: dict[int, pa.ChunkedArray] = {}
    for layout, columns in layouts:
        table = layout.table.slice(first, rows)
        for j, c in enumerate(columns):
            fields[c], arrays[c] = table.schema.field(j), table.column(j)
    order = sorted(fields)
    return pa.Table.from_arrays(
        [arrays[c] for c in order], schema=pa.schema([fields[c] for c in order])
    )


def _windows(
    files: list[tuple[int, list[tuple[int, int, int]]]], window: int, *, first: bool,
    max_rows: int = WINDOW_ROWS,
) -> list[list[tuple[int, int, int, int]]]:  # fmt: skip
    """The pieces ``(file, k, first row, rows)`` of ``files``, in order, cut into windows of
    ``window`` pieces and at most ``max_rows`` rows (or one piece, if longer); with
    ``first``, the first piece is a window of its own.
    """
    pieces = [(f, k, a, m) for f, ps in files for k, a, m in ps]
    head = 1 if first and pieces else 0
    windows = [pieces[:head]] if head else []
    some: list[tuple[int, int, int, int]] = []
    rows = 0
    for piece in pieces[head:]:
        if some and (len(some) == window or rows + piece[3] > max_rows):
            windows.append(some)
            some, rows = [], 0
        some.append(piece)
        rows += piece[3]
    return [*windows, some] if some else windows
