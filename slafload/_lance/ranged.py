"""Data files on an object store read like local flat files, by range requests.

:class:`RangedFiles` opens a table's data files on an object store the way
:class:`~slafload._lance.file_format.FlatFiles` opens local ones: the first file's footer is
checked against Lance's own metadata and its first and last rows against Lance's read of
them, which teaches the table's :class:`~slafload._lance.file_format.FileFormat`; every file
is then opened from its own footer (:func:`~slafload._lance.footers.walk_footer` over range
requests: a ``HEAD`` for its size, one GET of its last 16 KB, one GET of its pages' chunk
words, coalesced), once: its page tables stay with the open :class:`RangedFile`. A file
whose footer the format does not describe (a constant page, where a file holds one cell) is
opened from Lance's metadata instead, and its rows checked the same way.

A :class:`RangedFile`'s row ranges are then planned and decoded by
:func:`~slafload._lance.flat_reads.read_ranges` exactly as a local file's; only the reads differ:
its ``fill`` makes them as range requests through the table's
:class:`~slafload._lance.object_store.ObjectStore` (one per column page range, runs close
together coalesced, many in flight). A range of rows thus costs about one request per column
(three for the expression table), none for metadata once its file is open.

The loaders of one dataset share what they open (:class:`StoreFiles`, held by the
dataset): a file is opened, and the table's format learned, once per dataset and store
settings, not once per loader or ``iter(loader)``, as Lance's session keeps its metadata
for ``take_scan``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import pyarrow as pa
from lance.file import LanceFileReader

from slafload._lance.file_format import FileFormat
from slafload._lance.flat_pages import (
    CHECK_MINI_ROWS,
    CHECK_ROWS,
    V2_0,
    V2_1,
    FlatFile,
    _Column,
    _fixed,
    meta_columns,
)
from slafload._lance.footers import Footer, walk_footer
from slafload._lance.object_store import Blob, ObjectStore, StoreOptions
from slafload.kernels import NUMPY, Kernels

logger = logging.getLogger(__name__)

MAX_FILES = 8192  # opened files a RangedFiles keeps (each holds its pages' chunk tables)


class RangedFile(FlatFile):
    """Row ranges of one data file on an object store (see the module docstring).

    Holds no descriptor: its :attr:`fd` is its blob's id in the store, which ``fill`` reads.
    """

    def __init__(self, path: str, schema: Any, columns: Sequence[_Column], blob: Blob,
                 store: ObjectStore, names: tuple[str, ...]):  # fmt: skip
        self.path = path
        self.schema = schema
        self.names = names
        self._columns = list(columns)
        self.fd = blob.id
        self.fill = store.fill


class RangedFiles:
    """Opens the data files of one table on an object store (see the module docstring).

    Args:
        store: Where the files' bytes are requested.
        lance_reader: Lance's file reader (every column) of a data file, by path: the first
            file's metadata and rows are checked against it.
        kernels: What the first file's rows are decoded with when they are checked.

    Thread-safe. Mirrors :class:`~slafload._lance.file_format.FlatFiles`' interface. Each
    file's reader (or ``None``) is kept once opened, the last :data:`MAX_FILES` of them.
    """

    mini = True  # mini-block pages decoded (by numpy until numba's kernel is loaded)

    def __init__(self, store: ObjectStore, lance_reader: Callable[[str], Any],
                 kernels: Kernels = NUMPY):  # fmt: skip
        self.store = store
        self._lance_reader = lance_reader
        self.kernels = kernels
        self._format: FileFormat | None = None
        self._declined: str | None = None  # why the first file did not teach a format
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[str, tuple[str, ...]], RangedFile | None] = OrderedDict()
        self._meta: dict[str, Any] = {}

    def metadata(self, path: str) -> Any:
        """Lance's metadata of the data file at ``path`` (kept once read)."""
        with self._lock:
            meta = self._meta.get(path)
        if meta is None:
            meta = self._lance_reader(path).metadata()
            with self._lock:
                self._meta[path] = meta
        return meta

    @property
    def format(self) -> FileFormat | None:
        """The table's format, once the first file has taught it."""
        return self._format

    def open_many(self, paths: Sequence[str], columns: Sequence[str]) -> list[RangedFile | None]:
        """:meth:`open` of each of ``paths``, all at once: each open is three requests in
        turn (size, footer, chunk words), so a read window's files are opened in the time
        of one (on threads that end with their opens).
        """
        if len(paths) < 2:
            return [self.open(path, columns) for path in paths]
        pool = ThreadPoolExecutor(min(len(paths), self.store.options.in_flight), "slafload-open")
        try:
            tasks = [pool.submit(self.open, path, columns) for path in paths]
        finally:
            pool.shutdown(wait=False)
        wait(tasks)
        return [task.result() for task in tasks]  # the first failure is raised here

    def open(
        self, path: str, columns: Sequence[str], *, mini: bool | None = None
    ) -> RangedFile | None:
        """The reader of ``columns`` of the data file at ``path`` (an ``s3://`` URI), or
        ``None`` where its footer does not follow the table's format (then Lance reads it).
        A failed request (after the store's retries) raises its ``OSError``.
        """
        key = (path, tuple(columns))
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
                return self._kept[key]
        opened = self._open(path, columns)
        with self._lock:
            self._kept[key] = opened
            while len(self._kept) > MAX_FILES:
                self._kept.popitem(last=False)
        return opened

    def _open(self, path: str, columns: Sequence[str]) -> RangedFile | None:
        blob = self.store.open(path)
        try:
            footer = walk_footer(lambda n, at: self.store.read_at(blob, n, at), blob.size)
        except ValueError as exc:
            logger.debug("no footer parsed from %s: %r", path, exc)
            return None
        form = self._format
        if form is None and self._declined is None:
            with self._lock:  # the first file is checked once, by one thread
                form = self._format or self._learn(path, blob, footer, columns)
        opened = self._opened(form, path, blob, footer, columns) if form is not None else None
        if opened is None and form is not None:  # pages the format lacks (a constant column)
            opened = self._from_lance(path, blob, footer, columns)[0]
        return opened

    def _opened(self, form: FileFormat, path: str, blob: Blob, footer: Footer,
                columns: Sequence[str]) -> RangedFile | None:  # fmt: skip
        """The reader of ``blob`` from its walked ``footer``, its pages' chunk words fetched
        together; ``None`` where they are not the format's.
        """
        if footer.version != form.version or footer.schema != form.written_schema:
            return None
        runs = []
        for name in columns:
            index = form.schema.get_field_index(name)
            if index < 0 or index >= footer.n_columns:
                return None
            _, n_pages, k = footer.column(index)
            runs += [(p.positions[0], p.sizes[0]) for p in footer.pages(k, n_pages) if p.key]
        try:
            picked = form._columns(self.store.reader(blob, runs), footer, columns)
        except (ValueError, IndexError) as exc:  # not what the format says: Lance reads it
            logger.debug("not reading %s by range requests: %r", path, exc)
            return None
        if picked is None:
            return None
        return RangedFile(path, form._schema_of(columns), picked, blob, self.store,
                          tuple(form.schema.names))  # fmt: skip

    def _learn(self, path: str, blob: Blob, footer: Footer,
               columns: Sequence[str]) -> FileFormat | None:  # fmt: skip
        """The table's format from its first file (:meth:`_from_lance`), its footer
        required to list exactly the pages Lance's metadata lists; ``None``, and every
        file then left to Lance, where they differ.
        """
        flat, meta = self._from_lance(path, blob, footer, columns)
        try:
            form = FileFormat.learn(footer, meta) if flat is not None else None
        except Exception as exc:  # a footer this does not follow
            logger.debug("no format learned from %s: %r", path, exc)
            form = None
        if form is None:
            self._declined = f"{path} is not read exactly by range requests"
            logger.info("%s; Lance's reader reads the table's files", self._declined)
        self._format = form
        return form

    def _from_lance(self, path: str, blob: Blob, footer: Footer,
                    columns: Sequence[str]) -> tuple[RangedFile | None, Any]:  # fmt: skip
        """The reader of ``blob`` from Lance's metadata of it (and Lance's metadata), its
        first and last rows required to read the same as through Lance; ``None`` where
        they do not or its pages are not all ones the flat reads decode.
        """
        reader = self._lance_reader(path)
        meta = reader.metadata()
        stored = meta.schema
        version = (getattr(meta, "major_version", None), getattr(meta, "minor_version", None))
        if version not in V2_0 | V2_1 or len(meta.columns) != len(stored):
            return None, meta
        if not all(_fixed(f.type) for f in stored) or any(n not in stored.names for n in columns):
            return None, meta
        runs = [(page.buffers[0].position, page.buffers[0].size)
                for name in columns for page in meta.columns[stored.get_field_index(name)].pages
                if len(page.buffers) == 2]  # fmt: skip
        picked = meta_columns(self.store.reader(blob, runs), meta, footer, columns)
        if picked is None:
            return None, meta
        schema = pa.schema([stored.field(name) for name in columns])
        flat = RangedFile(path, schema, picked, blob, self.store, tuple(stored.names))
        n = CHECK_MINI_ROWS if flat.mini else CHECK_ROWS
        if not flat._agrees(reader, list(columns), meta.num_rows, n, self.kernels):
            logger.warning("the ranged read of %s disagrees with Lance's; Lance reads it", path)
            return None, meta
        return flat, meta


class StoreFiles:
    """What the loaders of one dataset share on an ``s3://`` store: one :class:`RangedFiles`
    (its :class:`ObjectStore`, learned format and opened files) per storage and store
    options. Thread-safe; pickled empty, and emptied in a forked child (a DataLoader worker
    opens its own: neither pyarrow's S3 client nor threads survive a fork).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[tuple[Any, ...], RangedFiles] = {}
        self._pid = os.getpid()

    def __reduce__(self) -> tuple[Any, ...]:
        return (StoreFiles, ())

    def files(self, storage_options: Mapping[str, str] | None, options: StoreOptions,
              kernels: Kernels = NUMPY) -> RangedFiles:  # fmt: skip
        """The :class:`RangedFiles` of ``storage_options`` and ``options``, made on first use
        (``kernels``: what the first file's rows are checked with).
        """
        opts = dict(storage_options or {})
        key = (tuple(sorted(opts.items())), options)
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's clients are not its own
                self._files, self._pid = {}, os.getpid()
            found = self._files.get(key)
            if found is None:
                found = self._files[key] = RangedFiles(
                    ObjectStore(opts, options),
                    lambda path: LanceFileReader(path, storage_options=opts),
                    kernels,
                )
        return found
