r"""Reading row ranges of flat data files into buffers laid out by column (:class:`Layout`).

The files are :class:`~slafload._lance.flat_pages.FlatFile`\ s, opened and checked there. A
window of ranges is planned in Python (:func:`_plan`: which file bytes go where), then read by
the ``pread_runs`` and ``decode_chunks`` kernels where they are compiled
(:mod:`slafload._lance.read_kernels`), else by ``preadv`` and :mod:`slafload._lance.miniblock`'s
numpy decoder. :func:`read_ranges` reads a window into a layout of its own;
:class:`~slafload._lance.data_files.DataFiles` reads every window of a fetch into the fetch's
layouts (:func:`read_into`), so each of the fetch's columns is one run of memory.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import pyarrow as pa

from slafload._lance import miniblock
from slafload.kernels import NUMPY, Kernels
from slafload.pipeline.buffers import BytePool, fresh

if TYPE_CHECKING:
    from slafload._lance.flat_pages import FlatFile


def _dtype(kind: pa.DataType) -> np.dtype:
    """The little-endian numpy dtype of a fixed-width Arrow type."""
    return np.dtype(kind.to_pandas_dtype()).newbyteorder("<")


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
    buffer (a :class:`Layout`: each column's values of all the ranges back to back) by
    :func:`read_into`; the ranges' tables are zero-copy slices of one table over that
    buffer, taken from ``pool`` where one is given.
    """
    if not ranges:
        return []
    rows = [r.rows for r in ranges]
    layout = Layout.make(ranges[0].file.schema, sum(rows), pool)
    row_at = list(itertools.accumulate(rows, initial=0))[:-1]
    read_into(ranges, layout, row_at, kernels, pool)
    return [layout.table.slice(first, n) for first, n in zip(row_at, rows, strict=True)]


@dataclass(frozen=True, eq=False)
class Layout:
    """A buffer that rows of flat files are read into: each column's values of every row
    back to back (``col_at[c]`` on, 8-byte aligned), and the table over it (zero-copy).

    A read's pieces read into one layout at their own rows (:func:`read_into`) are slices of
    one table whose columns each lie in one run of memory, so a chunk made of them needs no
    copy (:mod:`slafload.pipeline.chunk`).
    """

    buffer: np.ndarray
    dtypes: list[np.dtype]
    col_at: list[int]
    table: pa.Table

    @classmethod
    def make(cls, schema: pa.Schema, n_rows: int, pool: BytePool | None = None) -> Layout:
        """An uninitialised layout of ``n_rows`` rows of ``schema`` (fixed-width columns),
        its buffer from ``pool`` where one is given (fresh otherwise: no huge-page
        compaction stalls, :func:`~slafload.pipeline.buffers.fresh`).
        """
        dtypes = [_dtype(field.type) for field in schema]
        col_at, total = [], 0
        for dtype in dtypes:
            col_at.append(total)
            total = -(-(total + n_rows * dtype.itemsize) // 8) * 8
        buffer = fresh(total, np.uint8) if pool is None else pool.take(total)
        arrays = [pa.array(buffer[a : a + n_rows * dtype.itemsize].view(dtype))
                  for dtype, a in zip(dtypes, col_at, strict=True)]  # fmt: skip
        return cls(buffer, dtypes, col_at, pa.Table.from_arrays(arrays, schema=schema))


def read_into(
    ranges: Sequence[FlatRange], layout: Layout, row_at: Sequence[int],
    kernels: Kernels = NUMPY, pool: BytePool | None = None,
    columns: Sequence[int] | None = None,
) -> None:  # fmt: skip
    """Read rows ``[start, start + rows)`` of each ``(file, start, rows)`` into ``layout``
    from its row ``row_at[i]`` on: the files' columns ``columns`` (positions among them;
    ``None``: all), which must be the layout's.

    One call of the ``pread_runs`` kernel where ``kernels`` has it compiled (one release of
    the GIL for the lot), else one ``preadv`` per column and page (each of which must take
    the GIL back). A read the kernel could not finish (an I/O error, a file cut short) is
    done again by ``preadv``, which raises its ``OSError``. Mini-block pages (2.1+) are read
    the same way into a scratch buffer (from ``pool`` where given), the chunks holding each
    range, then decoded into the layout by one call of the ``decode_chunks`` kernel
    (:mod:`slafload._lance.miniblock`'s numpy code until it is compiled). Files on an object
    store (:class:`~slafload._lance.ranged.RangedFile`) are read the same way but for the
    reads themselves, which their ``fill`` makes as range requests.

    The planning is a few Python steps per range, column and page (its lookups ``bisect``
    on Python ints): on the 5M-cell atlas a window holds ~128 ranges from as many files, so
    there is no per-file batch to vectorize, and every step runs holding the GIL.
    """
    if not ranges:
        return
    head, buffer = ranges[0].file, layout.buffer
    direct, packed, decode = _plan(ranges, layout.dtypes, row_at, layout.col_at, columns)
    scratch = (
        np.zeros(0, np.uint8) if not len(decode.table)
        else fresh(packed.total, np.uint8) if pool is None else pool.take(packed.total)
    )  # fmt: skip
    if head.fill is not None:  # an object store's files: range requests, then the decode
        head.fill(((direct, buffer), (packed, scratch)))
        if len(decode.table):
            decode.run(scratch, buffer, kernels)
    elif not _read_decode(direct, buffer, packed, scratch, decode, kernels):
        direct.read(buffer, kernels)
        if len(decode.table):
            packed.read(scratch, kernels)
            decode.run(scratch, buffer, kernels)


def _plan(
    ranges: Sequence[FlatRange],
    dtypes: list[np.dtype],
    row_at: Sequence[int],
    col_at: list[int],
    which: Sequence[int] | None = None,
) -> tuple[_Runs, _Runs, _Decode]:
    """What :func:`read_into` reads (the files' columns ``which``; ``None``: all): the runs of plain values read where they go (each
    range's rows of column ``c`` from ``col_at[c] + row_at[range] * width``), the runs of
    mini-block chunks read into a scratch buffer, and the decode jobs of those chunks.
    """
    head = ranges[0].file
    widths = [dtype.itemsize for dtype in dtypes]
    direct = _Runs()  # plain values: read where they go
    packed = _Runs()  # mini-block chunks: read to be decoded
    jobs: list[int] = []  # miniblock.JOB_FIELDS ints per decode job
    chunk_at: list[np.ndarray] = []
    chunk_rows: list[np.ndarray] = []
    n_chunks = n_rows_of = 0
    for (file, start, rows), first in zip(ranges, row_at, strict=False):
        columns = file._columns if which is None else [file._columns[c] for c in which]
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
    return direct, packed, _Decode(jobs, chunk_at, chunk_rows)


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
