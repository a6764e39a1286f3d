"""Opening a table's data files flat from their footers alone, once one file taught the format.

A block sampler on a large atlas opens thousands of data files in an epoch's first seconds,
and a ``LanceFileReader`` with its metadata costs ~0.4 ms of CPU each. :class:`FlatFiles`
opens the first file of a table that way (:meth:`slafload._lance.flat_pages.FlatFile.open`)
and learns the table's :class:`FileFormat` from it; every later file is then opened from its
own footer (:mod:`slafload._lance.footer`), and read flat only if its schema and encodings are
the format's, byte for byte.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from slafload._lance import miniblock
from slafload._lance.encodings import flat_bits
from slafload._lance.flat_pages import (
    V2_0,
    V2_1,
    FlatFile,
    _Column,
    _fixed,
    _open_fd,
    listed_pages,
)
from slafload._lance.flat_reads import _dtype
from slafload._lance.footers import Footer, open_footers, read_footer
from slafload.kernels import NUMPY, Kernels

logger = logging.getLogger(__name__)

MAX_KEYS = 4096  # column selections a FileFormat memoizes the schema of
GIVE_UP = 16  # files tried flat, none readable so, before a table is left to Lance


@dataclass(frozen=True)
class FileFormat:
    """What the data files of one table read flat share, learned from one file whose footer
    lists the pages Lance's own metadata lists (:meth:`learn`): the schema and column
    encodings as written, and each column's page encodings (the messages
    :mod:`slafload._lance.encodings` recognised): byte for byte in 2.0 (flat pages), and in
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
        """The format of the file whose walked footer is ``footer`` and whose Lance metadata
        is ``meta``, or ``None`` unless the footer lists exactly the pages (buffers, rows)
        that ``meta`` lists and, in 2.0, every page's encoding message is flat values
        (:func:`slafload._lance.encodings.flat_bits`). The 2.1+ file's mini-block pages
        :mod:`slafload._lance.miniblock` decodes are learned by layout key.
        """
        mini = footer.version in V2_1
        if footer.version not in V2_0 and not mini:
            return None
        listed = listed_pages(footer, meta)
        if listed is None or len(meta.columns) != len(meta.schema):
            return None
        encodings, layouts = [], []
        for arrow_field, pages in zip(meta.schema, listed, strict=True):
            if not _fixed(arrow_field.type):
                return None
            width = _dtype(arrow_field.type).itemsize
            learned: dict[tuple, miniblock.Layout] = {}
            for page in pages:
                if mini:
                    found = miniblock.layout(page.encoding, width)
                    if found is not None and page.key is not None and found[1] == page.rows:
                        learned[page.key] = found[0]
                elif flat_bits(page.encoding) != 8 * width or page.sizes != [page.rows * width]:
                    return None
            encodings.append(frozenset(() if mini else (page.encoding for page in pages)))
            layouts.append(learned)
        return cls(
            meta.schema, footer.version, footer.schema,
            tuple(footer.column(i)[0] for i in range(footer.n_columns)), tuple(encodings),
            tuple(layouts) if mini else (),
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
        ``kernels``' ``walk_many`` (:func:`slafload._lance.footers.open_footers`: the GIL released
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

    def _columns(
        self, fd: int | miniblock.ReadAt, footer: Footer, columns: Sequence[str]
    ) -> list[_Column] | None:
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
    fd: int | miniblock.ReadAt, pages: list[tuple[miniblock.Layout, list[tuple[int, int]], int, int]],
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
                flat, footer, meta = FlatFile._open(path, columns, check=check, mini=mini,
                                                    kernels=self.kernels)  # fmt: skip
        else:
            flat, footer, meta = FlatFile._open(path, columns, check=check, mini=mini)
        if flat is None:
            self._misses += not self._checked
            return None
        self._checked.add(flat.mini)
        if self._format is None and footer is not None:
            self._format = _learn(path, footer, meta)
        return flat


def _learn(path: str, footer: Footer, meta: Any) -> FileFormat | None:
    """The table's format from the first file read flat: its ``footer`` and Lance's ``meta``
    of it (:meth:`FileFormat.learn`), or ``None``.
    """
    try:
        return FileFormat.learn(footer, meta)
    except Exception as exc:  # a footer this does not follow: Lance's metadata each time
        logger.debug("no flat format from %s: %r", path, exc)
        return None
