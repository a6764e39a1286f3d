"""Which local Lance data files read without Lance's decoder, and where their pages are.

:class:`FlatFile` is one such file: its pages checked and laid out when it is opened, its row
ranges then read by :func:`~slafload._lance.flat_reads.read_ranges` (2.0 flat pages by
``pread``; 2.1+ mini-block pages read the same way, then decoded by
:mod:`slafload._lance.miniblock`).

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
and a ``LanceFileReader`` with its metadata costs ~0.4 ms of CPU each.
:class:`~slafload._lance.file_format.FlatFiles` opens the first file of a table that way
(:meth:`FlatFile.open`) and learns the table's :class:`~slafload._lance.file_format.FileFormat`
from it (its footer, walked by :mod:`slafload._lance.footer`, must list exactly the pages Lance
listed);
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
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
from lance.file import LanceFileReader

from slafload._lance import miniblock
from slafload._lance.encodings import flat_bits
from slafload._lance.flat_reads import FlatRange, _dtype, read_ranges
from slafload._lance.footers import Footer, Page, read_footer
from slafload.kernels import NUMPY, Kernels

logger = logging.getLogger(__name__)

V2_0 = {(0, 3), (2, 0)}  # the 2.0 format's (major, minor) in file metadata (0.3 in its footer)
V2_1 = {(2, 1), (2, 2)}  # formats whose pages are mini-block pages (slafload._lance.miniblock)
CHECK_ROWS = 16  # rows compared with Lance's own read at each end of a file when it is opened
CHECK_MINI_ROWS = 1 << 14  # ...at the start of a 2.1+ file (several chunks of every kind)


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

    fill: Callable[[Sequence[tuple[Any, np.ndarray]]], None] | None = None
    """Reads a window's runs of file bytes into their buffers, where something other than
    ``pread`` does (:class:`~slafload._lance.ranged.RangedFile`)."""

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
    ) -> tuple[FlatFile | None, Footer | None, Any]:  # fmt: skip
        """:meth:`open`, and where the file is read flat, its footer (walked here: its pages'
        encoding messages say how each is read) and Lance's metadata of it, which
        :meth:`slafload._lance.file_format.FileFormat.learn` learns the table's format from.
        ``mini``: 2.1+ files' mini-block pages are decoded here too
        (:mod:`slafload._lance.miniblock`). ``check``: for a 2.0 and a 2.1+ file, as a pair;
        the check reads with ``kernels``.
        """
        if isinstance(check, bool):
            check = (check, check)
        if not hasattr(os, "preadv"):
            return None, None, None  # not on this platform (Windows)
        flat: FlatFile | None = None
        try:
            reader = LanceFileReader(path)
            meta = reader.metadata()
            stored = meta.schema
            version = (getattr(meta, "major_version", None), getattr(meta, "minor_version", None))
            if version not in V2_0 and not (mini and version in V2_1):
                return None, None, None
            if len(meta.columns) != len(stored) or not all(_fixed(f.type) for f in stored):
                return None, None, None  # one column per field: each field a flat primitive
            fd = _open_fd(path)
            flat = cls(path, pa.schema([]), [], fd)  # owns fd from here on
            footer = _footer(fd, path)
            picked = meta_columns(fd, meta, footer, columns)
            if picked is None:
                flat.close()
                return None, None, None
            flat.schema = pa.schema([stored.field(name) for name in columns])
            flat.names = tuple(stored.names)
            flat._columns = picked
            n_check = CHECK_MINI_ROWS if flat.mini else CHECK_ROWS
            agrees = not check[flat.mini] or flat._agrees(
                reader, list(columns), meta.num_rows, n_check, kernels
            )
        except Exception as exc:  # anything unexpected: Lance reads this file
            logger.debug("not reading %s flat: %r", path, exc)
            if flat is not None:
                flat.close()
            return None, None, None
        if not agrees:
            flat.close()
            logger.warning("the flat read of %s disagrees with Lance's; Lance reads it", path)
            return None, None, None
        return flat, footer, meta

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


def meta_columns(
    fd: int | miniblock.ReadAt, meta: Any, footer: Footer | None, columns: Sequence[str]
) -> list[_Column] | None:
    """The pages of ``columns`` of the data file open as ``fd`` (or read by it), as its walked
    ``footer`` lists them (their encoding messages as written), where they are exactly the
    pages Lance's metadata ``meta`` of the file lists; ``None`` unless every page is one the
    flat reads decode.
    """
    version = (getattr(meta, "major_version", None), getattr(meta, "minor_version", None))
    listed = listed_pages(footer, meta)
    if listed is None:
        return None
    stored, picked = meta.schema, []
    for name in columns:
        index = stored.get_field_index(name)
        if index < 0:
            return None
        kind = stored.field(index).type
        column = (
            _column(kind, listed[index], meta.num_rows)
            if version in V2_0
            else _mini_column(fd, kind, listed[index], meta.num_rows)
        )
        if column is None:
            return None
        picked.append(column)
    return picked


def _fixed(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def _column(kind: pa.DataType, pages: Sequence[Page], num_rows: int) -> _Column | None:
    """A 2.0 column's page table, or ``None`` unless every page is one buffer of its rows'
    values, flat at ``kind``'s width (its encoding message says so), and the pages' rows add
    up to the file's.
    """
    dtype = _dtype(kind)
    bits = {encoding: flat_bits(encoding) for encoding in {page.encoding for page in pages}}
    if any(len(page.sizes) != 1 or page.sizes[0] != page.rows * dtype.itemsize
           or bits[page.encoding] != 8 * dtype.itemsize for page in pages):  # fmt: skip
        return None
    rows = tuple(itertools.accumulate((page.rows for page in pages), initial=0))
    if rows[-1] != num_rows:
        return None
    return _Column(dtype, rows, tuple(page.positions[0] for page in pages))


def _footer(fd: int, path: str) -> Footer | None:
    """The walked footer of the file open as ``fd`` (at ``path``); ``None`` if it is not
    one the walk reads.
    """
    try:
        return read_footer(fd)
    except ValueError as exc:
        logger.debug("no footer parsed from %s: %r", path, exc)
        return None


def listed_pages(footer: Footer | None, meta: Any) -> list[list[Page]] | None:
    """Each column's pages as ``footer`` lists them (their encoding messages as written),
    where they are exactly the pages (rows, buffers) that Lance's metadata ``meta`` of the
    same file lists; ``None`` otherwise (no footer, or one the walk read otherwise than Lance).
    """
    if footer is None or footer.num_rows != meta.num_rows:
        return None
    columns = footer.columns()
    if len(columns) != len(meta.columns):
        return None
    out = []
    for (_, pages), theirs in zip(columns, meta.columns, strict=True):
        if len(pages) != len(theirs.pages):
            return None
        for page, their in zip(pages, theirs.pages, strict=True):
            listed = [(b.position, b.size) for b in their.buffers]
            if list(zip(page.positions, page.sizes, strict=True)) != listed:
                return None
        out.append(pages)
    return out


def _open_fd(path: str) -> int:
    return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))


def _mini_column(fd: int | miniblock.ReadAt, kind: pa.DataType, pages: Sequence[Page],
                 num_rows: int) -> _Column | None:  # fmt: skip
    """A 2.1+ column's pages (each read by :mod:`slafload._lance.miniblock`), or ``None`` unless
    every page is one it decodes and the pages' rows add up to the file's.
    """
    dtype = _dtype(kind)
    rows = tuple(itertools.accumulate((page.rows for page in pages), initial=0))
    if rows[-1] != num_rows:
        return None
    mini = []
    for page in pages:
        buffers = list(zip(page.positions, page.sizes, strict=True))
        decoded = miniblock.page(fd, page.encoding, buffers, dtype.itemsize, page.rows)
        if decoded is None:
            return None
        mini.append(decoded)
    return _Column(dtype, rows, (), tuple(mini))
