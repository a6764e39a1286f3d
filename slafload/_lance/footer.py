"""What a Lance 2.x data file's metadata says, walked from its last bytes.

A Lance 2.x data file (lance-file's v2 writer) ends with a 40-byte footer: where the column
metadata, the column metadata offset table and the global buffer offset table start, how many
global buffers and columns, the format's ``(major, minor)``, then ``b"LANC"``. Global buffer 0
is the ``FileDescriptor{schema=1, length=2}``; each column's metadata is a
``ColumnMetadata{encoding=1, pages=2}``, each page a ``Page{buffer_offsets=1, buffer_sizes=2,
length=3, encoding=4}`` (``file2.proto``). On the 5M-cell atlas that is ~1.1 KB per file.

:func:`walk` is written once for two runtimes. CPython runs it over the ``bytes`` read
(:func:`~slafload._lance.footers.read_footer`: the file's last 16 KB, more if its metadata
starts before them). Where numba is installed, :mod:`slafload.kernels` compiles it and
:func:`walk_many` runs it for every file of a read window in one call without the GIL
(:func:`~slafload._lance.footers.open_footers`): it opens each file, reads its last 4 KB (a
file with more metadata is walked again in Python), walks them and builds each mini-block
page's chunk tables. A block sampler on a large atlas opens thousands of data files in an
epoch's first seconds, and each time a read thread took the GIL back (about five times per
open in Python) it waited for the other threads' turns. Either way the walk fills one
``int64`` record (:class:`~slafload._lance.footers.Footer` reads it), every value checked
against the bytes' bounds: a file this does not read gives :data:`BAD`, never an
out-of-bounds read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FOOTER_SIZE = 40  # <QQQIIHH4s
TAIL = 16 << 10  # bytes read from a file's end to find its metadata (more only if it is larger)
MAX_METADATA = 64 << 20  # more than this is not a file this reads (Lance's reader opens it)
RECORD = 512  # entries of the Python walk's first record (FULL: walked again with more)
# The compiled walk, per file: the bytes it reads from the end (a file whose metadata starts
# before them is walked again in Python), its record, the most bytes of chunk words of a page
# whose tables it builds, and the int32s of chunk tables it builds per file of a call (shared
# by the call's files; pages past them are built in numpy).
FIRST_READ = 4 << 10
RECORD_COMPILED = 1024
WORDS = 16 << 10
TABLES = 1 << 13
# A page's chunk table (slafload._lance.miniblock.pack_table): a checkpoint every STRIDE chunk
# offsets, the offsets in 8-byte units modulo 2**16, so chunks, and a checkpoint's chunks, of
# under SPAN bytes. Here, not in miniblock, because numba's cache of the compiled walk is
# keyed on this file.
STRIDE = 16
SPAN = 1 << 19

# rec[0] after a walk: the entries used (> 0), or one of these.
BAD = 0  # not a Lance 2.x footer this reads
MORE = -1  # the metadata starts before the bytes given: rec[1] is the file offset it starts at
FULL = -2  # the record is too small for the metadata
HEADER = 10
"""rec[1:10]: major, minor, rows, where the schema message is in the bytes and its length,
columns, the chunk table entries built (compiled), the bytes walked, the descriptor it opened
(compiled, given a path); then the index in rec of
each column's record: the column's encoding (where, length), its pages, and each page's
record (:data:`PAGE`). Positions and sizes are the file's; "where" indexes the bytes walked."""
PAGE = 12
"""Entries of a page's record before its buffers' positions, then sizes: rows, its encoding
(where, length), buffers, then its layout key (:meth:`~slafload._lance.footers.Footer.pages`): the type URL of its
layout (where, length), its ``MiniBlockLayout`` message (where, length; where is -1 if the
page has none, or not one ``num_items`` equal to its rows) and that ``num_items`` field
(where it starts and ends); then its ``has_large_chunk`` (field 10: ``u32`` chunk words), and
where its chunk table starts in the tables the compiled walk built (-1: not built, or its
chunks are not alike and :func:`slafload._lance.miniblock.load` keeps each one's first row; -2: its
chunk words do not add up to its rows and bytes)."""

# libc's open, lseek and pread, as numba calls them (bind): the compiled walk opens and reads
# the file itself; the Python walk is given its bytes.
_open: Any = None
_lseek: Any = None
_pread: Any = None


def bind(numba: Any) -> None:
    """Declare the libc functions the compiled walk calls, and compile :func:`walk` for
    :func:`walk_many` to call (by :mod:`slafload.kernels`, once it has imported numba). They
    are declared here, beside the code that calls them, because numba's on-disk cache of
    :func:`walk_many` is keyed on this file.
    """
    global _open, _lseek, _pread, walk_compiled
    t = numba.types
    _pread = t.ExternalFunction("pread", t.intp(t.int32, t.voidptr, t.uintp, t.int64))
    _lseek = t.ExternalFunction("lseek", t.int64(t.int32, t.int64, t.int32))
    # open(path, flags) without a mode: the fixed arguments of the variadic open(2)
    _open = t.ExternalFunction("open", t.int32(t.voidptr, t.int32))
    walk_compiled = numba.njit(nogil=True)(walk)


def walk(
    tail: Any, size: int, rec: Any, fd: int = -1, words: Any = None, tables: Any = None,
    flags: int = -1,
) -> None:  # fmt: skip
    """Walk the metadata of a Lance 2.x data file of ``size`` bytes whose last ``len(tail)``
    bytes are ``tail`` into ``rec`` (ints: a list, or the kernel's ``int64`` array; see
    :data:`HEADER`; ``rec[0]`` says how it went).

    Every integer must be below 2**63 (a file's offsets, sizes and row counts are), every
    varint at most 10 bytes, every field inside its message and every message inside the
    file; a page must list as many buffer sizes as positions. Fields the record does not
    hold are skipped; of a field given twice, the last counts (protobuf's rule).

    Compiled, it is given the file open as ``fd`` instead (and ``size`` -1): it reads the
    file's size and last bytes into ``tail`` itself, then, for each mini-block page, its
    chunk words into ``words`` and its chunk table (the log2 of its chunks' rows, then its
    ``chunks + 1`` offsets: :func:`slafload._lance.miniblock.pack_table`) into ``tables``: one call, the GIL
    released throughout, where Python would take it back after every read. With ``flags``
    (>= 0) it opens the file too: the path, NUL-terminated, at the start of ``tail``, opened
    with those ``open`` flags; the descriptor is then ``rec[9]`` (-1: it could not be opened),
    and the caller's to close.
    """
    rec[0] = BAD
    rec[9] = -1
    data = tail
    if flags >= 0:
        fd = _open(tail.ctypes.data, np.int32(flags))
        rec[9] = fd
        if fd < 0:
            return
    if fd >= 0:  # compiled: read the bytes here
        size = _lseek(np.int32(fd), 0, 2)
        n = min(size, len(tail))
        got = 0
        while got < n:
            r = _pread(np.int32(fd), tail.ctypes.data + got, n - got, size - n + got)
            if r <= 0:
                return
            got += r
        data = tail[: max(n, 0)]
    n_tail = len(data)
    base = size - n_tail
    rec[8] = n_tail
    if size < FOOTER_SIZE or n_tail < FOOTER_SIZE or base < 0:
        return

    def le(i: int, n: int) -> int:
        """The unsigned little-endian int at ``data[i:i + n]``; -1 if it is 2**63 or more."""
        if n == 8 and data[i + 7] >= 0x80:
            return -1
        value = 0
        for k in range(n):
            value |= int(data[i + k]) << (8 * k)
        return value

    def varint(i: int, end: int) -> tuple[int, int]:  # (value, where it ends); -1: malformed
        value, shift = 0, 0
        while i < end:
            byte = int(data[i])
            i += 1
            if shift == 63 and byte != 0:
                return 0, -1  # 2**63 or more, or longer than 10 bytes
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, i
            shift += 7
        return 0, -1

    def field(i: int, end: int) -> tuple[int, int, int, int]:
        """(number, wire type, value, where it ends) of the field at ``i``: a bytes field's
        value is its length (its bytes end where it ends); -1: malformed.
        """
        key, i = varint(i, end)
        if i < 0:
            return 0, 0, 0, -1
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(i, end)
            return number, 0, value, i
        if wire == 2:
            n, i = varint(i, end)
            if i < 0 or n > end - i:
                return 0, 0, 0, -1
            return number, 2, n, i + n
        if wire == 1 or wire == 5:
            n = 8 if wire == 1 else 4
            if n > end - i:
                return 0, 0, 0, -1
            value = le(i, n)
            return number, wire, value, i + n if value >= 0 else -1
        return 0, 0, 0, -1  # groups (3, 4) and wire types 6 and 7

    def last(i: int, end: int, number: int) -> tuple[int, int]:
        """(where, length) of the last field ``number`` of the message at ``data[i:end]``;
        -1 if it has none, the last is not a bytes field, or the message is malformed.
        """
        at, n = -1, 0
        while i < end:
            got, wire, value, nxt = field(i, end)
            if nxt < 0:
                return -1, 0
            if got == number:
                at, n = (nxt - value, value) if wire == 2 else (-1, 0)
            i = nxt
        return at, n

    def chunk_word(c: int, width: int) -> int:
        """Chunk ``c``'s word (``width`` = 2 or 4 bytes, little-endian) in the words read."""
        word = int(words[width * c]) | int(words[width * c + 1]) << 8
        if width == 4:
            word |= int(words[4 * c + 2]) << 16 | int(words[4 * c + 3]) << 24
        return word

    def tables_of(at: int, size: int, data_size: int, rows: int, width: int, out: int) -> int:
        """Read a page's ``size`` bytes of chunk words at ``at`` and write its table to
        ``tables[out:]``: the log2 of the rows of every chunk but the last, then its chunk
        offsets (:func:`slafload._lance.miniblock.pack_table`). 1: written; 0: the words do not add
        up to its rows and bytes; -1: they do, but its chunks are not all alike (for
        :func:`slafload._lance.miniblock.load`, which keeps each chunk's first row), or one is over
        :data:`SPAN` bytes.
        """
        got = 0
        while got < size:
            r = _pread(np.int32(fd), words.ctypes.data + got, size - got, at + got)
            if r <= 0:
                return 0
            got += r
        chunks = size // width
        before, blocks, log, first_log, alike = 0, 0, 0, 0, True
        for c in range(chunks):
            word = chunk_word(c, width)
            log = word & 0xF
            if c < chunks - 1:
                if log == 0:  # only the last chunk may hold "the rest"
                    return 0
                if c == 0:
                    first_log = log
                alike = alike and log == first_log
                before += 1 << log
            blocks += (word >> 4) + 1
        last_rows = rows - before
        if last_rows <= 0 or (log != 0 and 1 << log != last_rows) or blocks * 8 != data_size:
            return 0
        if chunks == 1:  # any log whose rows hold the one chunk's
            first_log = 1
            while 1 << first_log < last_rows:
                first_log += 1
        if not alike or (chunks > 1 and last_rows > 1 << first_log):
            return -1
        # The table as slafload._lance.miniblock.pack_table writes it: the log, every STRIDE-th
        # offset, then every offset in 8-byte units modulo 2**16, two to an int32.
        n = chunks + 1
        m = (n + STRIDE - 1) // STRIDE
        tables[out] = first_log
        offset, base = 0, 0
        for c in range(n):
            if c % STRIDE == 0:
                base = offset
                tables[out + 1 + c // STRIDE] = offset
            elif offset - base >= SPAN:
                return -1  # not this table's form: miniblock.load decides
            units = (offset >> 3) & 0xFFFF
            k = out + 1 + m + (c >> 1)
            if c % 2 == 0:
                tables[k] = units
            else:
                both = int(tables[k]) | (units << 16)
                tables[k] = both - (1 << 32) if both >= 1 << 31 else both
            if c < chunks:
                chunk_bytes = ((chunk_word(c, width) >> 4) + 1) * 8
                if chunk_bytes >= SPAN:
                    return -1
                offset += chunk_bytes
        return 1

    at = n_tail - FOOTER_SIZE
    meta_at, cmo_at, gbo_at = le(at, 8), le(at + 8, 8), le(at + 16, 8)
    n_global, n_columns = le(at + 24, 4), le(at + 28, 4)
    if data[at + 36] != 76 or data[at + 37] != 65 or data[at + 38] != 78 or data[at + 39] != 67:
        return  # not b"LANC"
    if n_global < 1 or not 0 <= meta_at <= cmo_at <= gbo_at < size:
        return
    if gbo_at + 16 * n_global > size or cmo_at + 16 * n_columns > gbo_at:
        return
    if gbo_at < base:
        rec[0], rec[1] = MORE, gbo_at
        return
    global_at, global_size = le(gbo_at - base, 8), le(gbo_at - base + 8, 8)
    if global_at < 0 or global_size < 0:
        return
    first = min(meta_at, global_at)
    if size - first > MAX_METADATA:
        return
    if first < base:
        rec[0], rec[1] = MORE, first
        return
    if global_size > size - global_at:  # (a sum could wrap, compiled)
        return
    # The FileDescriptor: the schema (bytes) and the rows (an int).
    i, end = global_at - base, global_at - base + global_size
    schema_at, schema_n, num_rows, bad = 0, -1, -1, False
    while i < end:
        number, wire, value, nxt = field(i, end)
        if nxt < 0:
            return
        if number == 1:
            schema_at, schema_n, bad = nxt - value, value, wire != 2
        elif number == 2:
            num_rows = value if wire != 2 else -1
        i = nxt
    if bad or schema_n < 0 or num_rows < 0:
        return
    if HEADER + n_columns > len(rec):
        rec[0] = FULL
        return
    rec[1], rec[2], rec[3] = le(at + 32, 2), le(at + 34, 2), num_rows
    rec[4], rec[5], rec[6] = schema_at, schema_n, n_columns
    k = HEADER + n_columns  # the next free entry
    for c in range(n_columns):
        col_at, col_n = le(cmo_at - base + 16 * c, 8), le(cmo_at - base + 16 * c + 8, 8)
        if col_at < base or col_n < 0 or col_n > size - col_at:
            return
        if k + 3 > len(rec):
            rec[0] = FULL
            return
        rec[HEADER + c] = k
        column = k
        rec[column], rec[column + 1], rec[column + 2] = 0, 0, 0  # no encoding, no pages
        k += 3
        i, end = col_at - base, col_at - base + col_n
        while i < end:
            number, wire, value, nxt = field(i, end)
            if nxt < 0:
                return
            if number == 1 and wire == 2:
                rec[column], rec[column + 1] = nxt - value, value
            elif number == 2 and wire == 2:  # a page: one pass for the positions, one for sizes
                page = k
                if k + PAGE > len(rec):
                    rec[0] = FULL
                    return
                rec[page], rec[page + 1], rec[page + 2] = 0, 0, 0
                k += PAGE
                for sizes in range(2):
                    j, stop, count = nxt - value, nxt, 0
                    while j < stop:
                        number2, wire2, value2, nxt2 = field(j, stop)
                        if nxt2 < 0:
                            return
                        if number2 == 1 + sizes:
                            # packed: varints; else the one value
                            a, b = (nxt2 - value2, nxt2) if wire2 == 2 else (j, nxt2)
                            while a < b:
                                v = value2
                                if wire2 == 2:
                                    v, a = varint(a, b)
                                    if a < 0:
                                        return
                                else:
                                    a = b
                                if k >= len(rec):
                                    rec[0] = FULL
                                    return
                                rec[k] = v
                                k += 1
                                count += 1
                        elif sizes == 0 and number2 == 3 and wire2 != 2:
                            rec[page] = value2
                        elif sizes == 0 and number2 == 4 and wire2 == 2:
                            rec[page + 1], rec[page + 2] = nxt2 - value2, value2
                        j = nxt2
                    if sizes == 0:
                        rec[page + 3] = count
                    elif count != rec[page + 3]:
                        return  # as many sizes as positions
                # The page's layout key (see PAGE): Encoding.direct (2) is a DirectEncoding
                # whose encoding (1) is an Any{type_url=1, value=2}; the value a PageLayout
                # of one field, 1: a MiniBlockLayout, whose num_items (9) must be the rows.
                for f in range(4, PAGE):
                    rec[page + f] = 0
                rec[page + 6], rec[page + 11] = -1, -1
                a, n = -1, 0  # 2.0 (0.3 in the footer) has no mini-block pages
                if rec[1] >= 2:
                    a, n = last(rec[page + 1], rec[page + 1] + rec[page + 2], 2)
                if a >= 0:
                    a, n = last(a, a + n, 1)
                url_at, url_n = (-1, 0) if a < 0 else last(a, a + n, 1)
                if url_at >= 0:
                    a, n = last(a, a + n, 2)
                    number, wire, value, nxt = (0, 0, 0, -1) if a < 0 else field(a, a + n)
                    if nxt == a + n and number == 1 and wire == 2:
                        lay_at, stop = nxt - value, nxt  # the MiniBlockLayout
                        j, items, items_at, items_end, large = lay_at, 0, -1, -1, 0
                        while j < stop:
                            number, wire, value, nxt = field(j, stop)
                            if nxt < 0:
                                items = 2
                                break
                            if number == 9:
                                items += 1
                                if wire != 2 and value == rec[page]:
                                    items_at, items_end = j, nxt
                            elif number == 10:
                                large = value if wire != 2 else 0
                            j = nxt
                        if items == 1 and items_at >= 0:
                            rec[page + 4], rec[page + 5] = url_at, url_n
                            rec[page + 6], rec[page + 7] = lay_at, stop - lay_at
                            rec[page + 8], rec[page + 9] = items_at, items_end
                            rec[page + 10] = large
                rec[column + 2] += 1
            i = nxt
    rec[0] = k
    rec[7] = 0
    if fd < 0:
        return
    # Compiled: each mini-block page's chunk tables (what miniblock.load checks and builds).
    for c in range(n_columns):
        page = rec[HEADER + c] + 3
        for _ in range(rec[rec[HEADER + c] + 2]):
            m = page + PAGE  # its buffers: words, then data
            if rec[page + 6] >= 0 and rec[page + 3] == 2:
                rows, words_at, words_size, data_size = rec[page], rec[m], rec[m + 2], rec[m + 3]
                width = 4 if rec[page + 10] else 2
                chunks = words_size // width
                used = rec[7]
                table_ints = 1 + (chunks + STRIDE) // STRIDE + (chunks + 2) // 2
                if (
                    0 < words_size <= len(words)
                    and words_size % width == 0
                    and used + table_ints <= len(tables)
                    and max(data_size, rows) < 2**31
                ):
                    ok = tables_of(words_at, words_size, data_size, rows, width, used)
                    rec[page + 11] = used if ok > 0 else -1 if ok < 0 else -2
                    rec[7] = used + table_ints if ok > 0 else used
            page = m + 2 * rec[page + 3]


def walk_many(buffers: Any, recs: Any, words: Any, tables: Any, flags: int) -> None:
    """Compiled only: open and walk each file whose NUL-terminated path starts ``buffers[f]``
    into ``recs[f]``, as :func:`walk` does given ``flags``, each file's chunk tables after
    the previous file's in ``tables``: every file of a read window in one call.
    """
    at = 0
    for f in range(len(buffers)):
        walk_compiled(buffers[f], -1, recs[f], -1, words, tables[at:], flags)
        if recs[f, 0] > 0:
            at += recs[f, 7]


walk_compiled: Any = None
""":func:`walk` compiled by numba (set by :mod:`slafload.kernels`): what :func:`walk_many` calls."""
