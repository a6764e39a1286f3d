"""Read row ranges of local Lance data files without Lance's decoder: 2.0 flat pages by ``pread``.

(2.1+ mini-block pages are read the same way, then decoded by :mod:`slafload._lance.miniblock`.)

A data file in Lance's 2.0 format (what ``slafload optimize`` writes) stores each page of a
fixed-width column with no nulls as one plain buffer: row ``i`` of a page is bytes
``[position + i * width, position + (i + 1) * width)`` of the file. The page table (buffer
positions, sizes, encodings) is in the file's metadata, read once when the file is opened. So
a range of rows is one ``preadv`` per column and page straight into a numpy array that Arrow
wraps without a copy: ~0.03 ms for a 16-cell range (12.8k rows, three columns), against
~0.15 ms of CPU for the same range through an open ``LanceFileReader.read_range``, whose cost
is mostly fixed per call (scheduling the read on Lance's runtime, decoding, exporting the
stream; docs/sampling.md).

Nothing else takes this path: a column whose every page is not exactly the 2.0 encoding
"no nulls, flat, uncompressed, one page buffer" of the column's own width (or, with
``mini``, one of the 2.1+ mini-block layouts :mod:`slafload._lance.miniblock` decodes), a nested or
boolean field anywhere in the file, an object store. :meth:`FlatFile.open` checks each file's encodings and page sizes against its row
count and schema, then reads the file's first and last rows both ways and requires them
equal before it is used; anything else returns ``None`` and the caller keeps Lance's reader.

A block sampler on a large atlas opens thousands of data files in an epoch's first seconds,
and a ``LanceFileReader`` with its metadata costs ~0.4 ms of CPU each. :class:`FlatFiles`
opens the first file of a table that way and learns the table's :class:`FileFormat` from it
(its footer, walked by :mod:`slafload._lance.footer`, must list exactly the pages Lance listed);
every later file is then opened from its own footer (one ``pread`` of its last bytes, ~1 KB
of protobuf walked, and in 2.1+ one ``pread`` of each page's chunk words: with numba all of it
in one kernel call, a read window's files together, ~35-40 us a file on the 5M atlas; a 2.0
file walked in Python ~0.07 ms), and read flat only if its schema and encodings are the
format's, byte for byte.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa
from lance.file import LanceFileReader

from slafload._lance import miniblock
from slafload._lance.footer import Footer, open_footers, read_footer
from slafload.kernels import NUMPY, Kernels
from slafload.pipeline.buffers import BytePool, fresh

logger = logging.getLogger(__name__)

V2_0 = {(0, 3), (2, 0)}  # the 2.0 format's (major, minor) in file metadata (0.3 in its footer)
V2_1 = {(2, 1), (2, 2)}  # formats whose pages are mini-block pages (slafload._lance.miniblock)
CHECK_ROWS = 16  # rows compared with Lance's own read at each end of a file when it is opened
CHECK_MINI_ROWS = 1 << 14  # ...at the start of a 2.1+ file (several chunks of every kind)
MAX_KEYS = 4096  # column selections a FileFormat memoizes the schema of
GIVE_UP = 16  # files tried flat, none readable so, before a table is left to Lance

_FLAT = (
    r"Flat\{bits_per_value:(\d+),"
    r"buffer:Some\(Buffer\{buffer_index:0,buffer_type:Page\}\),compression:None\}"
)
_ENCODINGS = [  # a 2.0 page of values with no nulls, as pylance prints its encoding
    re.compile(rf"ArrayEncoding\{{array_encoding:Some\(Flat\({_FLAT}\)\)\}}"),
    re.compile(
        r"ArrayEncoding\{array_encoding:Some\(Nullable\(Nullable\{nullability:Some\(NoNulls\("
        rf"NoNull\{{values:Some\(ArrayEncoding\{{array_encoding:Some\(Flat\({_FLAT}\)\)\}}\)\}}"
        r"\)\)\}\)\)\}"
    ),
]


def flat_bits(encoding: str) -> int | None:
    """Bits per value of a page whose ``encoding`` (pylance's text of it) is a flat,
    uncompressed buffer of values with no nulls; ``None`` for any other encoding.
    """
    text = miniblock.squeezed(encoding)
    for pattern in _ENCODINGS:
        match = pattern.fullmatch(text)
        if match:
            return int(match.group(1))
    return None


class _Column(NamedTuple):
    """One column's pages: at which row each starts, and where (Python ints: the per-range
    lookups of :func:`read_ranges` ``bisect`` them, and a numpy call costs more than one).
    """

    dtype: np.dtype
    rows: tuple[int, ...]  # the row of each page's first value; then the column's rows
    positions: tuple[int, ...]  # 2.0: file offset of each page's values (2.1+: none)
    mini: tuple[miniblock.MiniPage, ...] | None = None  # 2.1+: each page's chunks

    def pieces(self, start: int, rows: int) -> list[tuple[int, int, int]]:
        """``(page, first row in the page, rows)`` of rows ``[start, start + rows)``."""
        firsts = self.rows
        page = bisect.bisect_right(firsts, start) - 1
        row, stop = start, start + rows
        out = []
        while row < stop:
            end = min(stop, firsts[page + 1])
            out.append((page, row - firsts[page], end - row))
            row, page = end, page + 1
        return out


class FlatFile:
    """Row ranges of one local Lance data file, read by ``preadv`` (see the module docstring).

    Thread-safe: reads are positional and share no state. The file is closed by
    :meth:`close`, or when the object is collected (as soon as the last reference goes, in
    CPython: a reader the cache evicts is closed once no read thread holds it).
    """

    def __init__(
        self, path: str, schema: pa.Schema, columns: Sequence[_Column], fd: int | None = None,
        names: tuple[str, ...] = (),
    ):  # fmt: skip
        self.path = path
        self.schema = schema
        self.names = names  # every column the file stores, by the name it stores it under
        self._columns = list(columns)
        self.fd = _open_fd(path) if fd is None else fd  # owned from here on
        self._owned = self.fd  # (a finalizer would be three more objects for the GC to walk)

    @classmethod
    def open(
        cls, path: str, columns: Sequence[str], *, check: bool = True, mini: bool = True
    ) -> FlatFile | None:
        """The flat reader of ``columns`` of the data file at ``path``, or ``None`` where the
        file is not one this reads exactly (then read it with Lance).

        ``check`` compares the file's first and last rows with Lance's read of them (two
        ``read_range`` calls, about doubling the open's cost); a caller opening many files
        of one table checks the first (the encodings and their reading are the same in
        every file; each row's place is what the chunk stage checks against
        ``cell_start_index``). ``mini``: a 2.1+ file whose pages are all mini-block pages
        :mod:`slafload._lance.miniblock` decodes is read too (its first 16k rows then checked).
        """
        return cls._open(path, columns, check=check, mini=mini)[0]

    @classmethod
    def _open(
        cls, path: str, columns: Sequence[str], *, check: bool | tuple[bool, bool],
        mini: bool = True, kernels: Kernels = NUMPY,
    ) -> tuple[FlatFile | None, FileFormat | None]:  # fmt: skip
        """:meth:`open`, and the file's :class:`FileFormat` where the file is read flat and
        its footer, parsed here, lists exactly the pages Lance's metadata lists. ``mini``:
        2.1+ files' mini-block pages are decoded here too (:mod:`slafload._lance.miniblock`).
        ``check``: for a 2.0 and a 2.1+ file, as a pair; the check reads with ``kernels``.
        """
        if isinstance(check, bool):
            check = (check, check)
        if not hasattr(os, "preadv"):
            return None, None  # not on this platform (Windows)
        flat: FlatFile | None = None
        try:
            reader = LanceFileReader(path)
            meta = reader.metadata()
            stored = meta.schema
            version = (getattr(meta, "major_version", None), getattr(meta, "minor_version", None))
            if version not in V2_0 and not (mini and version in V2_1):
                return None, None
            if len(meta.columns) != len(stored) or not all(_fixed(f.type) for f in stored):
                return None, None  # one column per field only when each field is a flat primitive
            fd = _open_fd(path)
            flat = cls(path, pa.schema([]), [], fd)  # owns fd from here on
            try:
                footer: Footer | None = read_footer(fd)
            except ValueError as exc:  # a 2.0 file still reads flat; no format is learned
                logger.debug("no footer parsed from %s: %r", path, exc)
                footer = None
            rows = None  # 2.1+: each page's rows, which only the footer has
            if version not in V2_0:
                if footer is None:
                    flat.close()
                    return None, None
                rows = [[p.rows for p in c] for _, c in footer.columns()]
            picked = []
            for name in columns:
                index = stored.get_field_index(name)
                if index < 0:
                    flat.close()
                    return None, None
                kind, pages = stored.field(index).type, meta.columns[index].pages
                column = (
                    _column(kind, pages, meta.num_rows)
                    if rows is None
                    else _mini_column(fd, kind, pages, rows[index], meta.num_rows)
                )
                if column is None:
                    flat.close()
                    return None, None
                picked.append(column)
            flat.schema = pa.schema([stored.field(name) for name in columns])
            flat.names = tuple(stored.names)
            flat._columns = picked
            n_check = CHECK_ROWS if rows is None else CHECK_MINI_ROWS
            agrees = not check[rows is not None] or flat._agrees(
                reader, list(columns), meta.num_rows, n_check, kernels
            )
        except Exception as exc:  # anything unexpected: Lance reads this file
            logger.debug("not reading %s flat: %r", path, exc)
            if flat is not None:
                flat.close()
            return None, None
        if not agrees:
            flat.close()
            logger.warning("the flat read of %s disagrees with Lance's; Lance reads it", path)
            return None, None
        try:
            form = None if footer is None else FileFormat.learn(footer, meta)
        except Exception as exc:  # a footer this does not follow: Lance's metadata each time
            logger.debug("no flat format from %s: %r", path, exc)
            form = None
        return flat, form

    @property
    def mini(self) -> bool:
        """Whether the file's pages are mini-block pages (2.1+), not flat values (2.0)."""
        return any(c.mini is not None for c in self._columns)

    @property
    def num_rows(self) -> int:
        """Rows in the file."""
        return self._columns[0].rows[-1] if self._columns else 0

    def read(self, start: int, rows: int) -> pa.Table:
        """Rows ``[start, start + rows)`` of the file's columns, as one Arrow table."""
        return read_ranges([FlatRange(self, start, rows)])[0]

    def _check(self, start: int, rows: int) -> None:
        if start < 0 or rows < 0 or start + rows > self.num_rows:
            raise IndexError(
                f"rows [{start}, {start + rows}) of {self.path} ({self.num_rows} rows)"
            )

    def close(self) -> None:
        """Close the file now (reads after this raise)."""
        owned = self.__dict__.pop("_owned", None)  # one pop wins, whichever thread calls
        if owned is not None:
            os.close(owned)

    def __del__(self) -> None:
        self.close()

    def _agrees(
        self, reader: LanceFileReader, columns: list[str], num_rows: int,
        first: int = CHECK_ROWS, kernels: Kernels = NUMPY,
    ) -> bool:  # fmt: skip
        """Whether the file's ``first`` rows and its last :data:`CHECK_ROWS` read the same
        flat (with ``kernels``) and through Lance, byte for byte (so NaNs compare equal).
        """
        for start, n in sorted({(0, min(first, num_rows)),
                                (max(0, num_rows - CHECK_ROWS), min(CHECK_ROWS, num_rows))}):  # fmt: skip
            if n == 0:
                continue
            lance_rows = reader.read_range(start, n).to_table()
            flat_rows = read_ranges([FlatRange(self, start, n)], kernels)[0]
            for name in columns:
                theirs = lance_rows.column(name)
                if theirs.null_count or theirs.type != flat_rows.schema.field(name).type:
                    return False
                mine = flat_rows.column(name).to_numpy()
                if mine.tobytes() != theirs.to_numpy().tobytes():
                    return False
        return True


def _fixed(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def _dtype(kind: pa.DataType) -> np.dtype:
    """The little-endian numpy dtype of a fixed-width Arrow type."""
    return np.dtype(kind.to_pandas_dtype()).newbyteorder("<")


def _column(kind: pa.DataType, pages: Sequence, num_rows: int) -> _Column | None:
    """A column's page table, or ``None`` unless every page is flat values of ``kind``'s
    width and the pages' values add up to the file's rows.
    """
    dtype = _dtype(kind)
    positions, counts = [], []
    for page in pages:
        if len(page.buffers) != 1 or flat_bits(page.encoding) != 8 * dtype.itemsize:
            return None
        (buffer,) = page.buffers
        if buffer.size % dtype.itemsize:
            return None
        positions.append(buffer.position)
        counts.append(buffer.size // dtype.itemsize)
    if sum(counts) != num_rows:
        return None
    return _Column(dtype, tuple(itertools.accumulate(counts, initial=0)), tuple(positions))


def _open_fd(path: str) -> int:
    return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))


@dataclass(frozen=True)
class FileFormat:
    """What the data files of one table read flat share, learned from one file whose pages
    Lance's own metadata describes (:meth:`learn`): the schema and column encodings as
    written, and each column's page encodings: byte for byte in 2.0 (flat pages), and in
    2.1+ the mini-block layouts, byte for byte but for the page's row count. :meth:`open`
    opens another file by parsing its footer alone, where it matches.
    """

    schema: pa.Schema  # as Lance reads it
    version: tuple[int, int]  # as the footer has it: (0, 3) for 2.0
    written_schema: bytes
    column_encodings: tuple[bytes, ...]
    page_encodings: tuple[frozenset[bytes], ...]  # 2.0, per column: each flat page's encoding
    layouts: tuple[dict[tuple, miniblock.Layout], ...] = ()  # 2.1+, per column: by layout key
    # Each fixed-width field's (index, dtype), by name: looked up at every open.
    _fields: dict[str, tuple[int, np.dtype | None]] = field(init=False, repr=False, compare=False)
    _schemas: dict[tuple[str, ...], pa.Schema] = field(init=False, repr=False, compare=False)
    _names: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fields = {f.name: (i, _dtype(f.type) if _fixed(f.type) else None)
                  for i, f in enumerate(self.schema)}  # fmt: skip
        object.__setattr__(self, "_fields", fields)
        object.__setattr__(self, "_names", tuple(self.schema.names))
        object.__setattr__(self, "_schemas", {})

    @classmethod
    def learn(cls, footer: Footer, meta) -> FileFormat | None:
        """The format of the file whose footer (parsed here) is ``footer`` and whose Lance
        metadata is ``meta``, or ``None`` unless the footer lists exactly the pages
        (buffers, rows) that ``meta`` lists, and Lance describes every page as flat (2.0) or
        pages of the 2.1+ file as mini-block pages :mod:`slafload._lance.miniblock` decodes (those
        are learned).
        """
        mini = footer.version in V2_1
        if (footer.version not in V2_0 and not mini) or footer.num_rows != meta.num_rows:
            return None
        columns = footer.columns()
        if len(columns) != len(meta.columns) or len(meta.columns) != len(meta.schema):
            return None
        encodings, layouts = [], []
        for arrow_field, (_, pages), theirs in zip(meta.schema, columns, meta.columns, strict=True):
            if not _fixed(arrow_field.type) or len(pages) != len(theirs.pages):
                return None
            width = _dtype(arrow_field.type).itemsize
            learned: dict[tuple, miniblock.Layout] = {}
            for page, their in zip(pages, theirs.pages, strict=True):
                listed = [(b.position, b.size) for b in their.buffers]
                if list(zip(page.positions, page.sizes, strict=True)) != listed:
                    return None
                if mini:
                    found = miniblock.layout(their.encoding, width)
                    key = page.key
                    if found is not None and key is not None and found[1] == page.rows:
                        learned[key] = found[0]
                elif flat_bits(their.encoding) != 8 * width or page.sizes != [page.rows * width]:
                    return None
            encodings.append(frozenset(() if mini else (page.encoding for page in pages)))
            layouts.append(learned)
        return cls(
            meta.schema, footer.version, footer.schema, tuple(e for e, _ in columns),
            tuple(encodings), tuple(layouts) if mini else (),
        )  # fmt: skip

    def open(self, path: str, columns: Sequence[str], kernels: Kernels = NUMPY) -> FlatFile | None:
        """The flat reader of ``columns`` of the data file at ``path``, from its footer
        alone, or ``None`` unless its format version, schema, column encodings and every
        page's encoding are this format's, byte for byte (a mini-block page's but for its
        row count), each 2.0 page one buffer of its rows' values, each mini-block page's
        chunks adding up to its rows and bytes, and the pages to the file's rows.

        The file is opened, read and walked and its chunk tables built by ``kernels``'
        ``walk_many`` where it is compiled (:meth:`open_many`), else in Python; the file
        opens the same either way.
        """
        many = self.open_many([path], columns, kernels)
        if many is not None:
            return many[0]
        try:
            fd = _open_fd(path)
        except OSError as exc:  # Lance's open reports it
            logger.debug("cannot open %s: %r", path, exc)
            return None
        try:
            found: Footer | Exception = read_footer(fd)
        except Exception as exc:  # an I/O error too: opened as the first file was
            found = exc
        return self._opened(path, columns, fd, found)

    def open_many(
        self, paths: Sequence[str], columns: Sequence[str], kernels: Kernels
    ) -> list[FlatFile | None] | None:
        """:meth:`open` of each of ``paths``, all opened, read and walked by one call of
        ``kernels``' ``walk_many`` (:func:`slafload._lance.footer.open_footers`: the GIL released
        once for them all); ``None`` where that kernel does not run.
        """
        opened = open_footers(paths, kernels.run) if kernels.backend == "numba" else None
        if opened is None:
            return None
        out: list[FlatFile | None] = []
        try:
            for path, (fd, found) in zip(paths, opened, strict=True):
                out.append(self._opened(path, columns, fd, found))
        except BaseException:  # the descriptors not handed on yet are closed
            for fd, _ in opened[len(out) + 1 :]:
                if fd >= 0:
                    os.close(fd)
            raise
        return out

    def _opened(
        self, path: str, columns: Sequence[str], fd: int, found: Footer | Exception
    ) -> FlatFile | None:
        """The flat reader of the file open as ``fd`` (-1: not open) from its walked footer
        (an exception: why it could not be opened or walked), or ``None`` (``fd`` closed).
        """
        if isinstance(found, Exception):  # Lance's open reports it, or reads the file
            logger.debug("no flat footer for %s: %r", path, found)
            if fd >= 0:
                os.close(fd)
            return None
        try:
            picked = self._columns(fd, found, columns)
        except Exception as exc:  # anything unexpected: opened as the first file was
            logger.debug("no flat footer for %s: %r", path, exc)
            picked = None
        if picked is None:
            os.close(fd)
            return None
        return FlatFile(path, self._schema_of(columns), picked, fd, self._names)

    def _schema_of(self, columns: Sequence[str]) -> pa.Schema:
        """The Arrow schema of ``columns`` (memoized: every open asks for it)."""
        key = tuple(columns)
        schema = self._schemas.get(key)
        if schema is None:
            schema = pa.schema([self.schema.field(name) for name in key])
            if len(self._schemas) < MAX_KEYS:
                self._schemas[key] = schema
        return schema

    def _columns(self, fd: int, footer: Footer, columns: Sequence[str]) -> list[_Column] | None:
        if footer.version != self.version or footer.schema != self.written_schema:
            return None
        if footer.n_columns != len(self.column_encodings):
            return None
        picked: list[_Column] = []
        mini_columns: list[tuple[np.dtype, tuple[int, ...]]] = []
        wanted = []  # 2.1+: every mini-block page of the columns, loaded together
        for name in columns:
            index, dtype = self._fields.get(name, (-1, None))
            if dtype is None:
                return None
            encoding, n_pages, k = footer.column(index)
            if encoding != self.column_encodings[index]:
                return None
            pages = footer.pages(k, n_pages)
            first = tuple(itertools.accumulate((page.rows for page in pages), initial=0))
            if first[-1] != footer.num_rows:
                return None
            if self.layouts:
                for page in pages:
                    found = self.layouts[index].get(page.key) if page.key is not None else None
                    if found is None:
                        return None
                    built = page.tables_at if found.large == page.large else -1
                    wanted.append((found, list(zip(page.positions, page.sizes, strict=True)),
                                   page.rows, built))  # fmt: skip
                mini_columns.append((dtype, first))
                continue
            if not all(
                page_encoding in self.page_encodings[index]
                and len(positions) == 1
                and sizes == [rows * dtype.itemsize]
                for positions, sizes, rows, page_encoding, *_ in pages
            ):
                return None
            picked.append(_Column(dtype, first, tuple(page.positions[0] for page in pages)))
        if not self.layouts:
            return picked
        mini = _load_pages(fd, wanted, footer.tables)
        if mini is None:
            return None
        done = 0
        for dtype, first in mini_columns:
            n = len(first) - 1
            picked.append(_Column(dtype, first, (), tuple(mini[done : done + n])))
            done += n
        return picked


def _load_pages(
    fd: int, pages: list[tuple[miniblock.Layout, list[tuple[int, int]], int, int]],
    tables: np.ndarray,
) -> list[miniblock.MiniPage] | None:  # fmt: skip
    """The :class:`miniblock.MiniPage` of each ``(layout, buffers, rows, tables_at)`` of the
    file open as ``fd`` (``None`` if any is not what its layout says): its chunk offsets and
    :attr:`~miniblock.MiniPage.log` sliced from ``tables`` where the compiled footer walk
    built them (``tables_at`` >= 0; -2: they did not add up), else (not built, or chunks that
    are not alike) read and built by :func:`miniblock.load`.
    """
    out = []
    words = tables.view(np.uint16)  # every page's offsets are a view of it
    for layout, buffers, rows, at in pages:
        if at == -2:
            return None
        if at < 0:
            page = miniblock.load(fd, layout, buffers, rows)
            if page is None:
                return None
        else:
            n = buffers[0][1] // (4 if layout.large else 2) + 1  # chunks + 1 offsets
            table = miniblock.unpack_table(tables, at, n, words)
            page = miniblock.mini_page(layout, rows, buffers[1][0], table, None)
        out.append(page)
    return out


class FlatFiles:
    """Opens the local data files of one table flat where they allow it.

    The first file that reads flat is opened as :meth:`FlatFile.open` opens a file: Lance's
    metadata, then its first and last rows read both ways and compared. Its footer
    (:mod:`slafload._lance.footer`) must list exactly the pages Lance listed; it then becomes the
    table's :class:`FileFormat`, and every later file is opened from its own footer alone
    (:meth:`FileFormat.open`: ~0.07 ms with numba's kernels, against ~0.4 ms for a
    ``LanceFileReader`` and its metadata; a block sampler opens thousands of files in an
    epoch's first seconds). A file whose footer does not match the format byte for byte is
    opened through Lance's metadata instead: row-checked if it is the first of its kind (2.0
    or 2.1+) or a 2.1+ file with a page layout the format lacks, the check reading with the
    ``kernels`` that will read it. Thread-safe.
    """

    def __init__(self, *, mini: bool = True, kernels: Kernels = NUMPY) -> None:
        self.mini = mini  # 2.1+ files' mini-block pages decoded too (slafload._lance.miniblock)
        self.kernels = kernels  # what reads them: the row checks read with them too
        self._format: FileFormat | None = None
        self._checked: set[bool] = set()  # kinds (mini-block or not) whose rows were checked
        self._misses = 0  # files tried before any opened flat
        self._lock = threading.Lock()

    @property
    def format(self) -> FileFormat | None:
        """The table's format, once a file has taught it."""
        return self._format

    def open_many(self, paths: Sequence[str], columns: Sequence[str]) -> list[FlatFile | None]:
        """The flat readers of ``columns`` of the data files at ``paths`` that open from their
        footers (:meth:`FileFormat.open_many`, by one kernel call), ``None`` for the others
        (:meth:`open` them one by one): all ``None`` until a file has taught the format, or
        while the ``walk_many`` kernel is not compiled.
        """
        form = self._format
        if form is None or (form.layouts and not self.mini):
            return [None] * len(paths)
        return form.open_many(paths, columns, self.kernels) or [None] * len(paths)

    def open(
        self, path: str, columns: Sequence[str], *, mini: bool | None = None
    ) -> FlatFile | None:
        """The flat reader of ``columns`` of the data file at ``path``, or ``None`` where
        the file is not one this reads exactly (then read it with Lance). ``mini``: open
        2.1+ files' mini-block pages (default: as constructed).

        The first 2.0 file and the first 2.1+ file are checked row by row, and so is every
        2.1+ file whose footer does not match the format (a page layout the first did not
        have). After :data:`GIVE_UP` files and none flat, the table is left to Lance.
        """
        mini = self.mini if mini is None else mini
        form = self._format
        if form is not None and (mini or not form.layouts):
            flat = form.open(path, columns, self.kernels)
            if flat is not None:
                return flat
        if self._misses >= GIVE_UP:
            return None
        unseen = bool(form is not None and form.layouts)  # a 2.1+ layout the format lacks
        check = (False not in self._checked, True not in self._checked or unseen)
        if not self._checked or unseen:
            with self._lock:  # the first check at a time
                flat, learned = FlatFile._open(path, columns, check=check, mini=mini,
                                               kernels=self.kernels)  # fmt: skip
        else:
            flat, learned = FlatFile._open(path, columns, check=check, mini=mini)
        if flat is None:
            self._misses += not self._checked
            return None
        self._checked.add(flat.mini)
        if self._format is None and learned is not None:
            self._format = learned
        return flat


def _mini_column(
    fd: int, kind: pa.DataType, pages: Sequence, rows: Sequence[int], num_rows: int
) -> _Column | None:
    """A 2.1+ column's pages (each read by :mod:`slafload._lance.miniblock`), or ``None`` unless
    every page is one it decodes and the pages' rows add up to the file's.
    """
    dtype = _dtype(kind)
    if len(rows) != len(pages) or sum(rows) != num_rows:
        return None
    mini = []
    for page, n in zip(pages, rows, strict=True):
        buffers = [(b.position, b.size) for b in page.buffers]
        decoded = miniblock.page(fd, page.encoding, buffers, dtype.itemsize, n)
        if decoded is None:
            return None
        mini.append(decoded)
    return _Column(dtype, tuple(itertools.accumulate(rows, initial=0)), (), tuple(mini))


class FlatRange(NamedTuple):
    """Rows ``[start, start + rows)`` of a :class:`FlatFile`."""

    file: FlatFile
    start: int
    rows: int


def read_ranges(
    ranges: Sequence[FlatRange], kernels: Kernels = NUMPY, pool: BytePool | None = None
) -> list[pa.Table]:
    """The tables of rows ``[start, start + rows)`` of each ``(file, start, rows)``, in order.

    The files must have the same columns. Every column of every range is read into one
    buffer, column by column (each column's values of all the ranges back to back), by one
    call of the ``pread_runs`` kernel where ``kernels`` has it compiled (one release of the
    GIL for the lot), else by one ``preadv`` per column and page (each of which must take the
    GIL back); the ranges' tables are zero-copy slices of one table over that buffer, taken
    from ``pool`` where one is given. A read the kernel could not finish (an I/O error, a file
    cut short) is done again by ``preadv``, which raises its ``OSError``. Mini-block pages
    (2.1+) are read the same way into a second buffer, the chunks holding each range, then
    decoded into the first by one call of the ``decode_chunks`` kernel
    (:mod:`slafload._lance.miniblock`'s numpy code until it is compiled).

    The planning is a few Python steps per range, column and page (its lookups ``bisect``
    on Python ints): on the 5M-cell atlas a window holds ~128 ranges from as many files, so
    there is no per-file batch to vectorize, and every step runs holding the GIL.
    """
    if not ranges:
        return []
    head = ranges[0].file
    dtypes = [column.dtype for column in head._columns]
    widths = [dtype.itemsize for dtype in dtypes]
    row_at = [0, *itertools.accumulate(r.rows for r in ranges)]
    n_rows = row_at[-1]
    col_at, total = [], 0  # each column's values of every range, 8-byte aligned
    for width in widths:
        col_at.append(total)
        total = -(-(total + n_rows * width) // 8) * 8
    direct = _Runs()  # plain values: read where they go
    packed = _Runs()  # mini-block chunks: read to be decoded
    jobs: list[int] = []  # miniblock.JOB_FIELDS ints per decode job
    chunk_at: list[np.ndarray] = []
    chunk_rows: list[np.ndarray] = []
    n_chunks = n_rows_of = 0
    for (file, start, rows), first in zip(ranges, row_at, strict=False):
        columns = file._columns
        if [c.dtype for c in columns] != dtypes:
            raise ValueError(f"{file.path} has other columns than {head.path}")
        file._check(start, rows)
        for column, width, at_col in zip(columns, widths, col_at, strict=True):
            out = at_col + first * width
            for page, at, n in column.pieces(start, rows):
                mini = column.mini[page] if column.mini is not None else None
                if mini is None:
                    direct.add(file.fd, column.positions[page] + at * width, n * width, out)
                elif mini.kind == miniblock.CONSTANT:
                    jobs += (mini.kind, width, 0, 0, 0, out, 0, n, mini.constant, 0, -1, 0, 0)
                else:
                    rows_of, at_of, log = mini.chunk_rows, mini.chunk_at, mini.log
                    assert at_of is not None
                    if log:  # alike chunks: which ones, by shifts
                        last = len(at_of) - 2
                        c0 = min(at >> log, last)
                        c1 = max(min(((at + n - 1) >> log) + 1, last + 1), c0 + 1)
                        first_row, r0 = c0 << log, -1
                    else:
                        assert rows_of is not None
                        c0 = bisect.bisect_right(rows_of, at) - 1  # a numpy call costs more
                        c1 = max(bisect.bisect_left(rows_of, at + n, c0), c0 + 1)
                        first_row, r0 = int(rows_of[c0]), n_rows_of
                        chunk_rows.append(rows_of[c0 : c1 + 1])
                        n_rows_of += c1 + 1 - c0
                    offset = mini.offset(c0)
                    size = mini.offset(c1) - offset
                    jobs += (mini.kind, width, mini.header, mini.size_bytes, packed.total, out,
                             at - first_row, n, 0, n_chunks, r0, log,
                             mini.rows - first_row)  # fmt: skip
                    chunk_at.append(at_of[c0 : c1 + 1])
                    n_chunks += c1 + 1 - c0
                    packed.add(file.fd, mini.data_at + offset, size, packed.total)
                    packed.total = -(-packed.total // 8) * 8
                out += n * width
    # Fresh arrays come from buffers.fresh: no huge-page compaction stalls.
    buffer = fresh(total, np.uint8) if pool is None else pool.take(total)
    scratch = (
        np.zeros(0, np.uint8) if not jobs
        else fresh(packed.total, np.uint8) if pool is None else pool.take(packed.total)
    )  # fmt: skip
    decode = _Decode(jobs, chunk_at, chunk_rows)
    if not _read_decode(direct, buffer, packed, scratch, decode, kernels):
        direct.read(buffer, kernels)
        if jobs:
            packed.read(scratch, kernels)
            decode.run(scratch, buffer, kernels)
    del scratch  # back to the pool
    arrays = [pa.array(buffer[a : a + n_rows * dtype.itemsize].view(dtype))
              for dtype, a in zip(dtypes, col_at, strict=True)]  # fmt: skip
    whole = pa.Table.from_arrays(arrays, schema=head.schema)
    return [whole.slice(first, r.rows) for r, first in zip(ranges, row_at, strict=False)]


class _Runs:
    """Runs of file bytes to read into a buffer: ``(fd, file offset, bytes, buffer offset)``."""

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.where: list[int] = []
        self.total = 0  # bytes of the buffer they need

    def add(self, fd: int, offset: int, size: int, at: int) -> None:
        self.fds.append(fd)
        self.offsets.append(offset)
        self.sizes.append(size)
        self.where.append(at)
        self.total = max(self.total, at + size)

    def table(self) -> np.ndarray:
        """``int64[4, runs]``: the descriptors, offsets, sizes and buffer offsets."""
        runs = [self.fds, self.offsets, self.sizes, self.where]
        return np.array(runs, dtype=np.int64).reshape(4, -1)

    def read(self, buffer: np.ndarray, kernels: Kernels) -> None:
        """Read every run, by the ``pread_runs`` kernel where it is compiled; what it could
        not read, by ``preadv`` (which raises the ``OSError``).
        """
        if not self.fds:
            return
        args = list(self.table())
        failed = np.full(1, -1, dtype=np.int64)  # the kernel's first unread run, if any
        if kernels.run("pread_runs", *args, buffer, failed, start=False):
            if failed[0] >= 0:  # read again in Python, which raises the OSError
                args = [a[failed[0] :] for a in args]
        else:
            failed[0] = 0
        if failed[0] >= 0:
            view = buffer.data
            for fd, offset, size, at in zip(*(a.tolist() for a in args), strict=True):
                _pread_into(fd, view[at : at + size], offset)


class _Decode:
    """The mini-block ``jobs`` of a read (:data:`miniblock.JOB_FIELDS` ints each) as the
    decode kernels take them: ``chunk_at`` and ``chunk_rows`` hold each job's slices of its
    page's chunk tables, in job order (fields 9 and 10 of a job say where its slices start;
    a page whose chunks are alike has no ``chunk_rows``).
    """

    def __init__(self, jobs: list[int], chunk_at: list[np.ndarray], chunk_rows: list[np.ndarray]):
        z = np.zeros(1, np.int64)
        self.table = np.asarray(jobs, dtype=np.int64).reshape(-1, miniblock.JOB_FIELDS)
        self.at = np.concatenate(chunk_at, dtype=np.int64) if chunk_at else z
        self.rows = np.concatenate(chunk_rows, dtype=np.int64) if chunk_rows else z
        self.tmp = np.empty(1024, dtype=np.uint64)  # a bit-packed chunk's values

    def run(self, scratch: np.ndarray, buffer: np.ndarray, kernels: Kernels) -> None:
        """Decode the jobs from ``scratch`` into ``buffer``: by the ``decode_chunks`` kernel
        where it is compiled, else by :func:`miniblock.decode_chunks`.
        """
        failed = np.full(1, -1, dtype=np.int64)
        args = (scratch[: len(scratch) // 8 * 8], self.table, self.at, self.rows,
                miniblock.FL_ORDER, self.tmp)  # fmt: skip
        if kernels.run("decode_chunks", *args, buffer[: len(buffer) // 8 * 8], failed, start=False):
            _decoded(failed[0])
            return
        miniblock.decode_chunks(scratch, self.table, self.at, self.rows, buffer)


def _decoded(failed: int) -> None:
    if failed >= 0:
        raise ValueError(f"a mini-block chunk is not what its page's encoding says ({failed})")


def _read_decode(direct: _Runs, buffer: np.ndarray, packed: _Runs, scratch: np.ndarray,
                 decode: _Decode, kernels: Kernels) -> bool:  # fmt: skip
    """A window's reads and decode by one call of the ``read_decode`` kernel (one release of
    the GIL instead of three); whether it ran and every read was whole (else the caller
    reads again, one step at a time, and raises the ``OSError``).
    """
    failed = np.full(3, -1, dtype=np.int64)
    if not kernels.run("read_decode", direct.table(), buffer[: len(buffer) // 8 * 8],
                       packed.table(), scratch[: len(scratch) // 8 * 8], decode.table,
                       decode.at, decode.rows, miniblock.FL_ORDER, decode.tmp, failed,
                       start=False):  # fmt: skip
        return False
    if failed[0] >= 0 or failed[1] >= 0:
        return False
    _decoded(failed[2])
    return True


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` with the bytes of ``fd`` from ``offset`` (the GIL is released meanwhile)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise OSError(f"unexpected end of file reading {len(view)} bytes at {offset}")
        got += n
