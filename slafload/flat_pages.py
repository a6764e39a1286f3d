"""Read row ranges of local Lance 2.0 data files whose pages are stored flat, without Lance's decoder.

A data file in Lance's 2.0 format (what ``slafload optimize`` writes) stores each page of a
fixed-width column with no nulls as one plain buffer: row ``i`` of a page is bytes
``[position + i * width, position + (i + 1) * width)`` of the file. The page table (buffer
positions, sizes, encodings) is in the file's metadata, read once when the file is opened. So
a range of rows is one ``preadv`` per column and page straight into a numpy array that Arrow
wraps without a copy: ~0.03 ms for a 16-cell range (12.8k rows, three columns), against
~0.15 ms of CPU for the same range through an open ``LanceFileReader.read_range``, whose cost
is mostly fixed per call (scheduling the read on Lance's runtime, decoding, exporting the
stream; docs/sampling.md, ``benchmarks/range_cost.py``).

Nothing else takes this path: a column whose every page is not exactly the 2.0 encoding
"no nulls, flat, uncompressed, one page buffer" of the column's own width, a nested or
boolean field anywhere in the file, a 2.1+ file (mini-block pages, compressed), an object
store. :meth:`FlatFile.open` checks each file's encodings and page sizes against its row
count and schema, then reads the file's first and last rows both ways and requires them
equal before it is used; anything else returns ``None`` and the caller keeps Lance's reader.
"""

from __future__ import annotations

import logging
import os
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyarrow as pa
from lance.file import LanceFileReader

from slafload.buffers import BytePool, fresh
from slafload.kernels import NUMPY, Kernels

logger = logging.getLogger(__name__)

V2_0 = {(0, 3), (2, 0)}  # the 2.0 format's (major, minor) in file metadata (0.3 in its footer)
CHECK_ROWS = 16  # rows compared with Lance's own read at each end of a file when it is opened

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
    text = re.sub(r"\s+", "", str(encoding)).replace(",)", ")").replace(",}", "}")
    for pattern in _ENCODINGS:
        match = pattern.fullmatch(text)
        if match:
            return int(match.group(1))
    return None


@dataclass(frozen=True)
class _Column:
    """One column's pages: where each starts in the file and at which row."""

    dtype: np.dtype
    positions: np.ndarray  # int64[pages]: byte offset of each page's values
    first_rows: np.ndarray  # int64[pages + 1]: row of each page's first value; then the count


class FlatFile:
    """Row ranges of one local Lance 2.0 data file, read by ``preadv`` (see the module docstring).

    Thread-safe: reads are positional and share no state. The file is closed by
    :meth:`close`, or when the object is collected (as soon as the last reference goes, in
    CPython: a reader the cache evicts is closed once no read thread holds it).
    """

    def __init__(self, path: str, schema: pa.Schema, columns: Sequence[_Column]):
        self.path = path
        self.schema = schema
        self._columns = list(columns)
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._closer = weakref.finalize(self, os.close, self.fd)

    @classmethod
    def open(cls, path: str, columns: Sequence[str], *, check: bool = True) -> FlatFile | None:
        """The flat reader of ``columns`` of the data file at ``path``, or ``None`` where the
        file is not one this reads exactly (then read it with Lance).

        ``check`` compares the file's first and last rows with Lance's read of them (two
        ``read_range`` calls, about doubling the open's cost); a caller opening many files
        of one table checks the first (the encodings and their reading are the same in
        every file; each row's place is what the chunk stage checks against
        ``cell_start_index``).
        """
        if not hasattr(os, "preadv"):
            return None  # not on this platform (Windows)
        flat: FlatFile | None = None
        try:
            reader = LanceFileReader(path)
            meta = reader.metadata()
            stored = meta.schema
            version = (getattr(meta, "major_version", None), getattr(meta, "minor_version", None))
            if version not in V2_0:
                return None
            if len(meta.columns) != len(stored) or not all(_fixed(f.type) for f in stored):
                return None  # one column per field only when every field is a flat primitive
            picked = []
            for name in columns:
                index = stored.get_field_index(name)
                if index < 0:
                    return None
                column = _column(stored.field(index).type, meta.columns[index].pages, meta.num_rows)
                if column is None:
                    return None
                picked.append(column)
            schema = pa.schema([stored.field(name) for name in columns])
            flat = cls(path, schema, picked)
            agrees = not check or flat._agrees(reader, list(columns), meta.num_rows)
        except Exception as exc:  # anything unexpected: Lance reads this file
            logger.debug("not reading %s flat: %r", path, exc)
            if flat is not None:
                flat.close()
            return None
        if not agrees:
            flat.close()
            logger.warning("the flat read of %s disagrees with Lance's; Lance reads it", path)
            return None
        return flat

    @property
    def num_rows(self) -> int:
        """Rows in the file."""
        return int(self._columns[0].first_rows[-1]) if self._columns else 0

    def read(self, start: int, rows: int) -> pa.Table:
        """Rows ``[start, start + rows)`` of the file's columns, as one Arrow table."""
        return read_ranges([FlatRange(self, start, rows)])[0]

    def segments(self, start: int, rows: int) -> list[tuple[int, int]]:
        """``(file offset, bytes)`` of rows ``[start, start + rows)``, column by column and
        page by page within a column.
        """
        if start < 0 or rows < 0 or start + rows > self.num_rows:
            raise IndexError(
                f"rows [{start}, {start + rows}) of {self.path} ({self.num_rows} rows)"
            )
        out = []
        for column in self._columns:
            width = column.dtype.itemsize
            page = int(np.searchsorted(column.first_rows, start, side="right")) - 1
            row, stop = start, start + rows
            while row < stop:
                end = min(stop, int(column.first_rows[page + 1]))
                at = int(column.positions[page]) + (row - int(column.first_rows[page])) * width
                out.append((at, (end - row) * width))
                row, page = end, page + 1
        return out

    def close(self) -> None:
        """Close the file now (reads after this raise)."""
        self._closer()

    def _agrees(self, reader: LanceFileReader, columns: list[str], num_rows: int) -> bool:
        """Whether the file's first and last :data:`CHECK_ROWS` rows read the same flat and
        through Lance, byte for byte (so NaNs compare equal).
        """
        for start in sorted({0, max(0, num_rows - CHECK_ROWS)}):
            n = min(CHECK_ROWS, num_rows - start)
            if n == 0:
                continue
            lance_rows = reader.read_range(start, n).to_table()
            flat_rows = self.read(start, n)
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


def _column(kind: pa.DataType, pages: Sequence, num_rows: int) -> _Column | None:
    """A column's page table, or ``None`` unless every page is flat values of ``kind``'s
    width and the pages' values add up to the file's rows.
    """
    dtype = np.dtype(kind.to_pandas_dtype()).newbyteorder("<")
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
    first = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
    return _Column(dtype, np.asarray(positions, dtype=np.int64), first)


class FlatRange(NamedTuple):
    """Rows ``[start, start + rows)`` of a :class:`FlatFile`."""

    file: FlatFile
    start: int
    rows: int


def read_ranges(
    ranges: Sequence[FlatRange], kernels: Kernels = NUMPY, pool: BytePool | None = None
) -> list[pa.Table]:
    """The tables of rows ``[start, start + rows)`` of each ``(file, start, rows)``, in order.

    Every column of every range is read into one buffer, by one call of the ``pread_runs``
    kernel where ``kernels`` has it compiled (one release of the GIL for the lot), else by one
    ``preadv`` per column and page (each of which must take the GIL back); the tables are
    zero-copy views of that buffer, taken from ``pool`` where one is given. A read the kernel
    could not finish (an I/O error, a file cut short) is done again by ``preadv``, which
    raises its ``OSError``.
    """
    fds, offsets, sizes, where = [], [], [], []
    layout = []  # per range: per column (dtype, first byte in the buffer, bytes)
    total = 0
    for file, start, rows in ranges:
        columns = []
        segments = iter(file.segments(start, rows))
        for column in file._columns:
            first, need = total, rows * column.dtype.itemsize
            while need:
                offset, size = next(segments)
                fds.append(file.fd)
                offsets.append(offset)
                sizes.append(size)
                where.append(total)
                total += size
                need -= size
            columns.append((column.dtype, first, total - first))
            total = -(-total // 8) * 8  # each column's values 8-byte aligned
        layout.append(columns)
    # Fresh arrays come from buffers.fresh: no huge-page compaction stalls.
    buffer = fresh(total, np.uint8) if pool is None else pool.take(total)
    args = [np.asarray(x, dtype=np.int64) for x in (fds, offsets, sizes, where)]
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
    tables = []
    for (file, _, _), columns in zip(ranges, layout, strict=True):
        arrays = [pa.array(buffer[a : a + n].view(dtype)) for dtype, a, n in columns]
        tables.append(pa.Table.from_arrays(arrays, schema=file.schema))
    return tables


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    """Fill ``view`` with the bytes of ``fd`` from ``offset`` (the GIL is released meanwhile)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise OSError(f"unexpected end of file reading {len(view)} bytes at {offset}")
        got += n
