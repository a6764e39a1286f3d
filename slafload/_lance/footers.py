"""Data files' footers walked and read: :class:`Footer`, what :mod:`slafload._lance.footer`'s
walk recorded, as Python reads it.

:func:`read_footer` walks one open file's metadata in Python; :func:`open_footers` opens and
walks a read window's files by one call of the compiled walk (``walk_many``), the GIL released
once for them all.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from slafload._lance.footer import (
    BAD,
    FIRST_READ,
    FULL,
    HEADER,
    MORE,
    PAGE,
    RECORD,
    RECORD_COMPILED,
    TABLES,
    TAIL,
    WORDS,
    walk,
)


class Page(NamedTuple):
    """One page as a data file's metadata lists it."""

    positions: list[int]  # file offset of each of the page's buffers
    sizes: list[int]  # and its bytes
    rows: int
    encoding: bytes  # the page's ``Encoding`` message, as written
    key: tuple[bytes, bytes] | None  # its layout key (Footer.pages)
    large: bool  # has_large_chunk: u32 chunk words (a mini-block page)
    tables_at: int  # where its chunk table is in Footer.tables; -1: not built (or its chunks
    # are not alike: miniblock.load builds both tables); -2: invalid


class Footer(NamedTuple):
    """A walked footer: :func:`walk`'s record (as Python ints), the bytes it indexes, and
    the chunk tables the compiled walk built (``int32``; empty from the Python walk).
    """

    rec: list[int]
    tail: bytes
    tables: np.ndarray = np.zeros(0, np.int32)

    @property
    def version(self) -> tuple[int, int]:
        """The format's ``(major, minor)`` as the footer has it: ``(0, 3)`` for 2.0."""
        return self.rec[1], self.rec[2]

    @property
    def num_rows(self) -> int:
        """The file's rows."""
        return self.rec[3]

    @property
    def schema(self) -> bytes:
        """The ``FileDescriptor.schema`` message, as written."""
        return self.tail[self.rec[4] : self.rec[4] + self.rec[5]]

    @property
    def n_columns(self) -> int:
        """The file's columns."""
        return self.rec[6]

    def column(self, index: int) -> tuple[bytes, int, int]:
        """Column ``index``'s encoding as written, its pages, and where in :attr:`rec` its
        first page's record is (:meth:`pages` walks them).
        """
        k = self.rec[HEADER + index]
        at, n, pages = self.rec[k : k + 3]
        return self.tail[at : at + n], pages, k + 3

    def columns(self) -> list[tuple[bytes, list[Page]]]:
        """Every column's encoding and pages."""
        out = []
        for index in range(self.n_columns):
            encoding, n, k = self.column(index)
            out.append((encoding, self.pages(k, n)))
        return out

    def pages(self, k: int, n: int) -> list[Page]:
        """The ``n`` pages whose records start at ``rec[k]``.

        A mini-block page's ``key`` is its layout's type URL and its ``MiniBlockLayout``
        message as written but for ``num_items`` (which is its rows): what pages laid out
        alike share, whatever their rows. ``None`` for any other page.
        """
        rec, tail, out = self.rec, self.tail, []
        for _ in range(n):
            rows, at, size, m, url_at, url_n, lay_at, lay_n, cut, end, large, tables_at = rec[
                k : k + PAGE
            ]
            key = None
            if lay_at >= 0:
                key = (tail[url_at : url_at + url_n], tail[lay_at:cut] + tail[end : lay_at + lay_n])
            k += PAGE
            positions, sizes = rec[k : k + m], rec[k + m : k + 2 * m]
            out.append(
                Page(positions, sizes, rows, tail[at : at + size], key, bool(large), tables_at)
            )
            k += 2 * m
        return out


def open_footers(paths: Sequence[str], run: Any) -> list[tuple[int, Footer | Exception]] | None:
    """Each data file of ``paths`` opened (read-only, close-on-exec) and its footer walked,
    its chunk tables built, all by one call of ``run("walk_many", ...)``: the GIL released
    once for all the opens, reads and walks (a read window opens ~100 files on the 5M atlas,
    and each time a read thread takes the GIL back it waits for the other threads' turns).
    ``None`` where that kernel does not run (then ``os.open`` and :func:`read_footer`).

    Returns, per path, its descriptor (the caller's to close) and footer, or -1 and the
    ``OSError`` (it cannot be opened) or ``ValueError`` (not a Lance 2.x file this reads).
    """
    names = [os.fsencode(path) for path in paths]
    if any(len(name) >= FIRST_READ or b"\0" in name for name in names):
        return None
    buffers = np.empty((len(names), FIRST_READ), np.uint8)
    for row, name in zip(buffers, names, strict=True):
        row[: len(name)] = np.frombuffer(name, np.uint8)
        row[len(name)] = 0
    recs = np.empty((len(names), RECORD_COMPILED), np.int64)
    tables = np.empty(len(names) * TABLES, np.int32)
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    if not run("walk_many", buffers, recs, np.empty(WORDS, np.uint8), tables, flags,
               start=False):  # fmt: skip
        return None
    out: list[tuple[int, Footer | Exception]] = []
    # One array holds every file's tables (each file's a view): allocated once per call, not
    # once per file, so the open files' tables do not pin small blocks all over the heap.
    kept = tables[: int(recs[recs[:, 0] > 0, 7].sum())].copy()
    at = 0
    try:
        for path, buffer, rec in zip(paths, buffers, recs, strict=True):
            status, fd = int(rec[0]), int(rec[9])
            if fd < 0:
                out.append((-1, OSError(f"cannot open {path}")))
            elif status > 0:
                got = rec[:status].tolist()
                tail, used = buffer[: got[8]].tobytes(), got[7]
                out.append((fd, Footer(got, tail, kept[at : at + used])))
                at += used
            else:  # more metadata than the first read, or a record too small: in Python
                try:
                    out.append((fd, read_footer(fd, status)))
                except Exception as exc:  # an I/O error too: Lance's open reports it
                    os.close(fd)
                    out.append((-1, exc))
    except BaseException:  # every descriptor the kernel opened is closed
        for fd in recs[:, 9].tolist():
            if fd >= 0:
                os.close(fd)
        raise
    return out


def read_footer(fd: int, status: int | None = None) -> Footer:
    """The walked footer of the Lance 2.x data file open as ``fd``, walked in Python: one
    ``pread`` of its last :data:`TAIL` bytes (a second where its metadata starts before
    them). ``status``: what a compiled walk of it gave (:data:`BAD`: it is not one). Raises
    ``ValueError`` if it is not one this reads.
    """
    if status == BAD:
        raise ValueError("not a Lance 2.x footer this reads")
    return walk_footer(lambda n, at: os.pread(fd, n, at), os.fstat(fd).st_size)


def walk_footer(read: Callable[[int, int], bytes], size: int) -> Footer:
    """The walked footer of the Lance 2.x data file of ``size`` bytes whose bytes
    ``read(n, at)`` returns (a local file's ``pread``, an object store's range GET): its
    last :data:`TAIL` bytes, then more where its metadata starts before them. Raises
    ``ValueError`` if it is not one this reads.
    """
    base = max(0, size - TAIL)
    while True:
        tail = read(size - base, base)
        if len(tail) != size - base:
            raise ValueError("file changed while its footer was read")
        rec = [0] * RECORD  # a list: Python sets its items faster than an array's
        walk(tail, size, rec)
        if rec[0] == MORE and base > rec[1]:
            base = rec[1]
            continue
        if rec[0] == FULL:  # at most 6 entries a byte of metadata
            rec = [0] * (6 * len(tail) + HEADER + PAGE)  # an empty page: 2 bytes, 12 entries
            walk(tail, size, rec)
        if rec[0] <= 0:
            raise ValueError("not a Lance 2.x footer this reads")
        return Footer(rec[: rec[0]], tail)
