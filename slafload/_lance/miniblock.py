"""Decode the mini-block pages of Lance 2.1 and 2.2 data files (what converters write) for the
flat reads of :mod:`slafload._lance.flat_pages`, without Lance's decoder.

In Lance 2.1+, a page of a fixed-width column with no nulls is usually a *mini-block* page:
its values are cut into chunks of up to 4,096 (each compressed on its own), the chunks
stored back to back in the page's second buffer, and one word per chunk in its first buffer
gives the chunk's size and value count. A range of rows is then the run of chunks that holds
it: one ``pread`` of their bytes, then a decode of each chunk, then the rows wanted. This
module knows the page layouts pylance writes for such columns, and nothing else:

- ``MiniBlockLayout`` with no repetition or definition levels, no dictionary, one layer
  ``RepdefAllValidItem``, and values compressed by ``Flat`` (plain values), ``Rle``
  (``Flat`` run values of the column's width and ``Flat`` 8-bit run lengths) or
  ``InlineBitpacking`` (FastLanes bit-packing of 1,024-value chunks, the bit width first);
- ``ConstantLayout`` (2.2: every row one value, stored in the encoding itself).

Chunk words are ``u16`` in 2.1 and ``u32`` in 2.2 (``has_large_chunk``): the low 4 bits are
log2 of the chunk's value count (0 for the last chunk, which holds the rest), the others
``bytes / 8 - 1``. A chunk starts with a ``u16`` level count (0 here), then the byte size of
each of its value buffers (``u16`` in 2.1, ``u32`` in 2.2), padded to 8 bytes; each buffer is
padded to 8 bytes. Every page's encoding message is recognised field by field
(:mod:`slafload._lance.encodings`), and its chunk table must add up to the page's rows and
bytes, or the file stays with Lance
(:meth:`slafload._lance.flat_pages.FlatFile.open`, which also compares the first file's rows with
Lance's read of them). The decode runs as one numba kernel per window of ranges
(``decode_chunks`` in :mod:`slafload._lance.read_kernels`); :func:`decode_chunks` here is the numpy
reference it must match.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from slafload._lance import encodings
from slafload._lance.footer import SPAN, STRIDE

ReadAt = Callable[[int, int], bytes]
"""``read(n, at)``: ``n`` bytes of a file from offset ``at`` (an object store's range reads)."""

MINI_FLAT, RLE, BITPACK, CONSTANT = 1, 2, 3, 4  # page kinds (0 is a 2.0 flat page)
FL_ORDER = np.array([0, 4, 2, 6, 1, 5, 3, 7], dtype=np.int64)  # FastLanes' row order
JOB_FIELDS = 13
"""Ints per decode job: kind, bytes per value, chunk header bytes, bytes of a chunk's buffer
sizes, where the job's chunks were read to in the scratch buffer, where its first value goes
(bytes), values of its first chunk before the range, values to write, a constant page's value
bits, where its slice of the chunk offsets starts in the concatenated offsets, where its
slice of the chunks' first rows starts in theirs (-1: its page's chunks are alike, see
:class:`MiniPage`), that log2 of their rows, and the page's rows from the job's first chunk on."""


@dataclass(frozen=True, slots=True)
class MiniPage:
    """One mini-block (or constant) page of a column: where its chunks are and what they hold.

    Its chunk offsets (bytes from :attr:`data_at`, each chunk's start and then the page's
    size, all multiples of 8) are kept in 2.25 bytes a chunk instead of 4 or 8: every
    :data:`~slafload._lance.footer.STRIDE`-th offset whole in :attr:`chunk_base`, and every offset
    in 8-byte units modulo ``2**16`` in :attr:`chunk_at`. :meth:`offset` gives one back; the
    decode kernels take slices of :attr:`chunk_at` and add up a chunk's bytes as
    ``((at[c + 1] - at[c]) & 0xFFFF) * 8``. An open file keeps these tables for as long as it
    stays open (thousands on an atlas: the three expression columns' tables of a 5M-atlas
    file hold 3.5 KB, not 6.2).
    """

    kind: int
    rows: int
    data_at: int = 0  # file offset of the chunks (the page's second buffer)
    chunk_at: np.ndarray | None = None  # uint16[chunks + 1]: offsets / 8, modulo 2**16
    chunk_rows: np.ndarray | None = None  # int32 (or 64)[chunks + 1]: first rows, then the rows
    header: int = 0  # bytes from a chunk's start to its first value buffer
    size_bytes: int = 0  # width of the buffer sizes in a chunk's header (2 or 4)
    constant: int = 0  # CONSTANT: the value's bits
    log: int = 0  # > 0: every chunk but the last holds 2**log rows, the last the rest (at most
    # as many), and chunk_rows is None: what Lance writes, and half the memory an open file's
    # pages keep
    chunk_base: np.ndarray | None = None  # int32[(chunks + STRIDE) // STRIDE]: offsets 0, 16...

    def offset(self, c: int) -> int:
        """The byte offset of chunk ``c`` from :attr:`data_at` (``c`` = chunks: the size)."""
        assert self.chunk_base is not None and self.chunk_at is not None
        base = self.chunk_base.item(c // STRIDE)
        return base + (((self.chunk_at.item(c) - (base >> 3)) & 0xFFFF) << 3)


def table_size(n_offsets: int) -> int:
    """``int32`` entries of the chunk table of a page of ``n_offsets`` chunk offsets (its
    chunks + 1): its log, a checkpoint every :data:`~slafload._lance.footer.STRIDE` offsets, the
    offsets two by two.
    """
    return 1 + (n_offsets + STRIDE - 1) // STRIDE + (n_offsets + 1) // 2


def pack_table(log: int, offsets: np.ndarray) -> np.ndarray | None:
    """The chunk table (``int32[table_size(len(offsets))]``) of a page whose chunk offsets
    are ``offsets`` (bytes, multiples of 8, from 0 to its size) and whose chunks hold
    ``2**log`` rows (0: kept in :attr:`MiniPage.chunk_rows`); the footer walk writes the same
    (:func:`slafload._lance.footer.walk`). ``None`` where it cannot hold them: a page of 2 GiB or
    more, or a chunk, or a checkpoint's chunks, of :data:`~slafload._lance.footer.SPAN` bytes or
    more (Lance's fixed-width chunks are at most ~32 KiB: 4,096 eight-byte values).
    """
    n = len(offsets)
    base = offsets[::STRIDE]
    if offsets[-1] >= 2**31 or (n > 1 and int(np.diff(offsets).max()) >= SPAN):
        return None
    if int((offsets - np.repeat(base, STRIDE)[:n]).max()) >= SPAN:
        return None
    table = np.zeros(table_size(n), np.int32)
    table[0] = log
    table[1 : 1 + len(base)] = base
    table[1 + len(base) :].view(np.uint16)[:n] = np.bitwise_and(np.right_shift(offsets, 3), 0xFFFF)
    return table


def unpack_table(table: np.ndarray, at: int, n_offsets: int,
                 words: np.ndarray | None = None) -> tuple[int, np.ndarray, np.ndarray]:  # fmt: skip
    """The log, :attr:`~MiniPage.chunk_base` and :attr:`~MiniPage.chunk_at` of the chunk table
    of ``n_offsets`` offsets at ``table[at:]`` (views of ``table``; ``words``, if given, is
    ``table.view(np.uint16)``, made once for a file's pages).
    """
    m = (n_offsets + STRIDE - 1) // STRIDE
    first = 2 * (at + 1 + m)
    words = table.view(np.uint16) if words is None else words
    return table.item(at), table[at + 1 : at + 1 + m], words[first : first + n_offsets]


class Layout(NamedTuple):
    """What a mini-block page's encoding says, but for its row count."""

    kind: int
    n_buffers: int  # value buffers in each chunk
    large: bool  # has_large_chunk: u32 chunk words and buffer sizes (2.2), else u16 (2.1)


_KINDS = {encodings.FLAT: MINI_FLAT, encodings.RLE: RLE, encodings.INLINE_BITPACKING: BITPACK}


def layout(encoding: bytes, width: int) -> tuple[Layout, int] | None:
    """The :class:`Layout` and row count of a mini-block page of ``width``-byte values whose
    ``Encoding`` message (as the file holds it) is ``encoding``; ``None`` for any other page
    (a constant page too: :func:`page` reads those).
    """
    return _layout(encodings.page_layout(encoding), width)


def _layout(found: encodings.MiniBlock | encodings.Constant | None,
            width: int) -> tuple[Layout, int] | None:  # fmt: skip
    if not isinstance(found, encodings.MiniBlock) or found.bits != 8 * width:
        return None
    kind = _KINDS[found.compression]
    if found.n_buffers != (2 if kind == RLE else 1) or (kind == BITPACK and width > 4):
        return None
    return Layout(kind, found.n_buffers, found.large), found.items


def page(fd: int | ReadAt, encoding: bytes, buffers: list[tuple[int, int]], width: int,
         rows: int) -> MiniPage | None:  # fmt: skip
    """The :class:`MiniPage` of a page of ``rows`` values of ``width`` bytes whose
    ``Encoding`` message is ``encoding``, with ``buffers`` ``(position, size)``, in the file
    open as ``fd`` (or read by it: :data:`ReadAt`; its chunk words read now); ``None`` for any
    other page.
    """
    decoded = encodings.page_layout(encoding)
    if isinstance(decoded, encodings.Constant):
        if len(decoded.value) != width or buffers:
            return None
        bits = int.from_bytes(decoded.value, "little", signed=width == 8)  # an int64 job field
        return MiniPage(CONSTANT, rows, constant=bits)
    found = _layout(decoded, width)
    if found is None or found[1] != rows:
        return None
    return load(fd, found[0], buffers, rows)


def load(
    fd: int | ReadAt, layout: Layout, buffers: list[tuple[int, int]], rows: int
) -> MiniPage | None:
    """The :class:`MiniPage` of a page of ``rows`` values laid out as ``layout`` with
    ``buffers`` ``(position, size)`` in the file open as ``fd``: its chunk words read now,
    and required to add up to the page's rows and to its chunks' bytes; else ``None``.
    """
    if len(buffers) != 2:
        return None
    (words_at, words_size), (data_at, data_size) = buffers
    word = np.dtype("<u4" if layout.large else "<u2")
    if words_size == 0 or words_size % word.itemsize:
        return None
    words = np.frombuffer(_pread(fd, words_size, words_at), word).astype(np.int64)
    # A block sampler opens thousands of files in an epoch's first seconds: a few numpy
    # calls per page, each a ufunc called directly (np.cumsum's Python dispatch cost more).
    logs = np.bitwise_and(words, 0xF)
    counts = np.left_shift(1, logs)
    last = rows - int(np.add.reduce(counts[:-1]))
    if last <= 0 or (logs[-1] and counts[-1] != last) or not logs[:-1].all():
        return None
    counts[-1] = last
    chunk_at = np.empty(len(words) + 1, np.int64)
    chunk_at[0] = 0
    np.add.accumulate(np.right_shift(words, 4) + 1, out=chunk_at[1:])
    if chunk_at[-1] * 8 != data_size:
        return None
    chunk_at *= 8
    log = alike_log(logs, last)
    table = pack_table(log, chunk_at)
    if table is None:
        return None
    views = unpack_table(table, 0, len(chunk_at))
    if log:
        return mini_page(layout, rows, data_at, views, None)
    chunk_rows = np.empty(len(words) + 1, np.int64)
    chunk_rows[0] = 0
    np.add.accumulate(counts, out=chunk_rows[1:])
    return mini_page(layout, rows, data_at, views, _compact(chunk_rows))


def alike_log(logs: np.ndarray, last: int) -> int:
    """The :attr:`MiniPage.log` of a page whose chunk words hold ``logs`` and whose last
    chunk holds ``last`` rows: 0 unless every chunk but the last holds as many rows, and the
    last at most as many (the compiled footer walk decides the same).
    """
    if len(logs) == 1:  # any log whose rows hold the one chunk's
        return max(1, (last - 1).bit_length())
    first = int(logs[0])
    if last > 1 << first or not (logs[:-1] == first).all():
        return 0
    return first


def mini_page(layout: Layout, rows: int, data_at: int,
              table: tuple[int, np.ndarray, np.ndarray],
              chunk_rows: np.ndarray | None) -> MiniPage:  # fmt: skip
    """The :class:`MiniPage` of a page laid out as ``layout``, given its chunk ``table``
    (:func:`unpack_table`'s log and views), and ``chunk_rows`` where its log is 0.
    """
    size_bytes = 4 if layout.large else 2
    header = -(-(2 + size_bytes * layout.n_buffers) // 8) * 8
    log, base, at = table
    return MiniPage(layout.kind, rows, data_at, at, chunk_rows, header, size_bytes, log=log,
                    chunk_base=base)  # fmt: skip


def _compact(prefix: np.ndarray) -> np.ndarray:
    """A page's chunks' first rows as ``int32`` where they fit (kept only for pages whose
    chunks are not alike).
    """
    return prefix.astype(np.int32 if prefix[-1] < 2**31 else np.int64)


def decode_chunks(scratch: np.ndarray, jobs: np.ndarray, chunk_at: np.ndarray,
                  chunk_rows: np.ndarray, out: np.ndarray) -> None:  # fmt: skip
    """Decode every job's chunks from ``scratch`` into ``out`` (both ``uint8``): the numpy
    reference of the ``decode_chunks`` kernel. Raises ``ValueError`` on a chunk that is not
    what its page's encoding says.
    """
    for job in jobs.tolist():
        kind, width, header, size_bytes, scratch_at, out_at, skip, rows, constant = job[:9]
        c0, r0, log, tail = job[9:]
        dtype = np.dtype(f"<u{width}")
        target = out[out_at : out_at + rows * width].view(dtype)
        if kind == CONSTANT:
            target[:] = constant & ((1 << 8 * width) - 1)
            continue
        written, c, end = 0, c0, scratch_at
        while written < rows:
            base, end = end, end + (int(chunk_at[c + 1] - chunk_at[c]) & 0xFFFF) * 8
            if r0 < 0:  # alike chunks: 2**log rows each, the last the rest
                count = min(1 << log, tail - ((c - c0) << log))
            else:
                count = int(chunk_rows[r0 + c - c0 + 1] - chunk_rows[r0 + c - c0])
            chunk = scratch[base:end]
            values = _decode_chunk(chunk, kind, dtype, header, size_bytes, count)
            lo = skip if c == c0 else 0
            n = min(count - lo, rows - written)
            target[written : written + n] = values[lo : lo + n]
            written, c = written + n, c + 1


def _decode_chunk(chunk: np.ndarray, kind: int, dtype: np.dtype, header: int, size_bytes: int,
                  count: int) -> np.ndarray:  # fmt: skip
    n_buffers = 2 if kind == RLE else 1
    if len(chunk) < header or int(chunk[:2].view("<u2")[0]) != 0:
        raise ValueError("a mini-block chunk with levels in a page without them, or too short")
    sizes = chunk[2 : 2 + size_bytes * n_buffers].view(f"<u{size_bytes}").astype(np.int64)
    first = chunk[header : header + sizes[0]]
    if len(first) != sizes[0] or sizes[0] % dtype.itemsize or sizes[0] < dtype.itemsize:
        raise ValueError("a mini-block chunk's values of another length")
    if kind == MINI_FLAT:
        values = first.view(dtype)
        if len(values) != count:
            raise ValueError("a flat chunk of another length")
        return values
    if kind == RLE:
        at = header + (-(-int(sizes[0]) // 8) * 8)
        runs, lengths = first.view(dtype), chunk[at : at + sizes[1]]
        if (len(runs) != len(lengths) or int(lengths.astype(np.int64).sum()) < count
                or not lengths.all()):  # fmt: skip
            raise ValueError("an RLE chunk of another length")
        return np.repeat(runs, lengths.astype(np.int64))[:count]
    words = first.view(dtype).astype(np.uint64)
    bits = 8 * dtype.itemsize
    width, lanes = int(words[0]), 1024 // bits
    if width > bits or len(words) != 1 + width * lanes or count > 1024:
        raise ValueError("a bit-packed chunk of another length")
    out = np.zeros(1024, np.uint64)
    if width:
        packed = words[1:].reshape(width, lanes)
        mask = np.uint64((1 << width) - 1)
        for row in range(bits):
            word, shift = divmod(row * width, bits)
            v = packed[word] >> np.uint64(shift)
            if shift + width > bits:
                v = v | (packed[word + 1] << np.uint64(bits - shift))
            index = FL_ORDER[row // 8] * 16 + (row % 8) * 128 + np.arange(lanes)
            out[index] = v & mask
    return out[:count].astype(dtype)


def _pread(fd: int | ReadAt, n: int, at: int) -> bytes:
    data = os.pread(fd, n, at) if isinstance(fd, int) else fd(n, at)
    if len(data) != n:
        raise OSError(f"unexpected end of file reading {n} bytes at {at}")
    return data
