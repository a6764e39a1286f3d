"""Padded token arrays reused from piece to piece, once the consumer has let go of them.

A padded ``[cells, width]`` output is mostly padding (a geneformer row is 2,048 ``int64`` for
~800 real tokens). Allocated fresh for every piece, the kernel hands over and zeroes every page
of it (the largest single cost of the producer in ``perf``). A
:class:`RowBuffers` keeps a few such arrays and gives one back out only when nothing outside
it refers to it any more, i.e. every batch viewing it (numpy views, and the tensors that
``torch.from_numpy`` made of them) has been released. It remembers how far each row was
written, so reusing an array costs re-padding only the tokens the previous piece wrote past
the new piece's, instead of the whole array.

Ownership is decided by reference counts: the pool's own reference is the only one left when
an array is free. An array that is still referenced is never handed out again, so a consumer
may keep a batch as long as it likes; the pool then allocates a new array (and keeps at most
``keep`` of each kind).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import polars as pl
import pyarrow as pa

from slafload.kernels import NUMPY, Kernels

_HUGE = 4 << 20  # numpy advises huge pages for arrays this large (see :func:`fresh`)
_FREE = 2  # references to a pooled array nobody else holds: the entry's and getrefcount's
_scratch = threading.local()


def scratch(name: str, n: int, dtype: npt.DTypeLike) -> np.ndarray:
    """An uninitialised 1-D array of ``n`` elements, reused by every call on this thread.

    For temporaries that never leave the function using them (e.g. ranking keys): each
    fresh multi-megabyte temporary costs its page faults again, since the allocator hands
    large blocks back to the kernel when they are freed. One array per ``(name, dtype)`` is
    kept per thread, as large as the largest request, and freed with the thread.
    """
    arrays = _scratch.__dict__.setdefault("arrays", {})
    key = (name, np.dtype(dtype))
    array = arrays.get(key)
    if array is None or len(array) < n:
        array = arrays[key] = np.empty(n, dtype=dtype)
    return array[:n]


def fresh(shape: int | tuple[int, ...], dtype: npt.DTypeLike, fill=None) -> np.ndarray:
    """A new array for the hot path (``fill`` it, or leave it uninitialised).

    numpy asks the kernel for transparent huge pages on every array of 4 MiB or more
    (``madvise(MADV_HUGEPAGE)``). Where THP's defrag setting is ``madvise`` (Ubuntu's and
    Debian's default), each first touch of such an array may stall in memory compaction once
    the page cache holds most of RAM, as it does while streaming an atlas: a fresh padded
    ``[2048, 2050]`` ``int64`` array cost 46-75 ms that way against 6 ms through torch's CPU
    allocator, which does not advise huge pages (measured). Arrays that
    large are therefore allocated by torch and returned as numpy views of its storage (they
    become torch tensors in the end anyway); smaller ones by numpy.
    """
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    kind = torch_dtype(dtype) if count * dtype.itemsize >= _HUGE else None
    if kind is None:  # small, or a dtype this torch lacks (uint16 before torch 2.3)
        return np.empty(shape, dtype) if fill is None else np.full(shape, fill, dtype)
    import torch

    # Not a reshaped view: views of this array must name it as their base, or the reference
    # counts that RowBuffers relies on would not see them.
    array = torch.empty(shape, dtype=kind).numpy()
    if fill is not None:
        array.fill(fill)
    return array


def torch_dtype(dtype: np.dtype) -> Any:
    """The torch dtype of numpy ``dtype``, or ``None`` where this torch has none."""
    import torch

    try:
        return torch.from_numpy(np.empty(0, dtype)).dtype
    except TypeError:
        return None


@dataclass(eq=False)
class _Entry:
    array: np.ndarray  # [rows, width], owns its data
    ends: np.ndarray  # int64[rows]: columns from here on hold the pad value


class RowBuffers:
    """Reusable padded ``[rows, width]`` arrays, keyed by name, width, dtype and pad value.

    Args:
        keep: Arrays kept per key; more are allocated (and dropped) when all are in use.
        rows: Rows each kept array is allocated with, at least (the largest piece the
            caller will ask for: a run's small first piece then does not take a slot that
            later pieces cannot use). A free kept array too small for a request is
            replaced by a larger one.
    """

    def __init__(self, keep: int = 4, rows: int = 0):
        self.keep, self.min_rows = keep, rows
        self._pools: dict[tuple, list[_Entry]] = {}
        self._lock = threading.Lock()

    def rows(
        self, name: str, ends: np.ndarray, width: int, dtype: np.dtype, pad: int | float = 0,
        kernels: Kernels = NUMPY,
    ) -> np.ndarray:  # fmt: skip
        """A ``[len(ends), width]`` array whose row ``i`` holds ``pad`` from column ``ends[i]``.

        Columns before ``ends[i]`` hold leftovers: the caller must write every one of them
        (``ends`` of ``width`` everywhere: the caller overwrites the whole array). A reused
        array is re-padded with ``kernels`` (:mod:`slafload.kernels`).
        """
        n = len(ends)
        key = (name, width, np.dtype(dtype), pad)
        with self._lock:
            pool = self._pools.setdefault(key, [])
            entry = next(
                (e for e in pool if len(e.array) >= n and sys.getrefcount(e.array) == _FREE), None
            )
            if entry is None:
                small = [e for e in pool if sys.getrefcount(e.array) == _FREE]
                if len(pool) >= self.keep and small:
                    pool.remove(small[0])  # free but too small: make room for a larger one
                if len(pool) >= self.keep:
                    return fresh((n, width), dtype, pad)
                capacity = max(n, self.min_rows)
                array = fresh((capacity, width), dtype, pad)
                entry = _Entry(array, np.zeros(capacity, dtype=np.int64))
                pool.append(entry)
            out = entry.array[:n]
            _repad(out, entry.ends[:n], ends, pad, kernels)
            entry.ends[:n] = ends
            return out


@dataclass(eq=False)
class _Held:
    array: np.ndarray  # uint8, owns its data


class BytePool:
    """Reusable byte buffers for reads whose results are views of them (the flat page reads
    of :mod:`slafload._lance.flat_pages`): a buffer is handed out again once no view of it is alive
    (its reference count, as :class:`RowBuffers` does).

    Reading into pages already mapped costs about a third of reading into fresh ones, each of
    which faults on its first touch: a ``BlockShuffle(64, 256)`` fetch's 100 MB read by
    ``pread`` from the page cache took 16 ms into reused memory and 51 ms into fresh (every
    large block the allocator frees goes back to the kernel). Buffers of up to ``keep``
    bytes in all are kept, whatever the dataset's size; a request that does not fit them
    gets a fresh array, dropped after use.

    Buffers are allocated in size classes, eight to a doubling (:func:`size_class`: at most
    an eighth more than asked): fetches of about the same rows then reuse each other's
    buffers. Allocated at the exact size, each fetch a few rows larger than every free
    buffer took a new one, and the pool grew toward ``keep`` over a long run (18 buffers
    of ~6.5 MB, 101 MB, for ~37 MB in use after 400,000 cells of the peers benchmark's
    pre-shuffled store).
    """

    def __init__(self, keep: int = 256 << 20):
        self.keep = keep
        self._held: list[_Held] = []
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Bytes of the buffers kept."""
        return sum(len(h.array) for h in self._held)

    @property
    def in_use(self) -> int:
        """Bytes of the kept buffers that a view still holds."""
        with self._lock:
            return sum(len(h.array) for h in self._held if sys.getrefcount(h.array) > _FREE)

    def take(self, n: int) -> np.ndarray:
        """``n`` bytes (uninitialised), reused where a kept buffer is free and large enough."""
        with self._lock:
            free = [h for h in self._held if sys.getrefcount(h.array) == _FREE]
            fits = [h for h in free if len(h.array) >= n]
            if fits:
                return min(fits, key=lambda h: len(h.array)).array[:n]
            for small in sorted(free, key=lambda h: len(h.array)):
                if self.held + size_class(n) <= self.keep:
                    break
                self._held.remove(small)  # free but too small: make room for a larger one
            size = size_class(n)
            if self.held + size > self.keep:
                return fresh(n, np.uint8)
            held = _Held(fresh(size, np.uint8))
            self._held.append(held)
            return held.array[:n]


def size_class(n: int) -> int:
    """``n`` rounded up to the next of eight sizes a doubling (``m * 2**k`` for ``m`` in 8..15),
    at least 4 KiB: at most an eighth more than ``n``.
    """
    if n <= 4096:
        return 4096
    step = 1 << (n.bit_length() - 4)  # an eighth of the power of two at or below n
    return -(-n // step) * step


def _repad(
    out: np.ndarray, old: np.ndarray, new: np.ndarray, pad: int | float, kernels: Kernels
) -> None:
    """Write ``pad`` into ``out[i, new[i]:old[i]]`` wherever the previous rows were longer."""
    flat, width = out.reshape(-1), out.shape[1]
    stale = np.flatnonzero(old > new)
    starts, stops = stale * width + new[stale], stale * width + old[stale]
    if kernels.run("fill_runs", flat, starts, stops, pad):
        return
    for start, stop in zip(starts.tolist(), stops.tolist(), strict=True):
        flat[start:stop] = pad


def gather_runs(
    indptr: np.ndarray, arrays: Sequence[np.ndarray], rows: np.ndarray,
    kernels: Kernels = NUMPY,
) -> tuple[np.ndarray, list[np.ndarray]]:  # fmt: skip
    """Runs ``rows`` of CSR ``arrays`` (run ``r`` is ``a[indptr[r]:indptr[r + 1]]``), back to
    back: ``(offsets int64[len(rows) + 1], [gathered array per array])``.

    Two arrays with compiled ``kernels`` (ready for their types): one kernel call copies
    every run into new arrays, the GIL released (~0.2 ms for 4,096 cells of 200 rows, against
    1.5-5 ms for the gather below on two busy cores). Otherwise one Polars gather of list
    columns (zero-copy views of ``arrays``): a memcpy per run in native code, with the GIL
    released; its outputs are read-only views of Arrow buffers. A Python loop of slice copies
    costs ~7x more per cell and holds the GIL between its copies, which starves the read
    threads of a block-sampled fetch (docs/sampling.md, "The GIL and the read threads").
    """
    rows = np.asarray(rows, dtype=np.int64)
    if kernels.backend != "numpy" and len(arrays) == 2 and len(rows):
        indptr = np.asarray(indptr, dtype=np.int64)
        lengths = indptr[rows + 1] - indptr[rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        (a, b), n = arrays, int(offsets[-1])
        out = [np.empty(n, dtype=a.dtype), np.empty(n, dtype=b.dtype)]
        if kernels.run("copy_runs_2", out[0], a, out[1], b, offsets[:-1], indptr[rows], lengths):
            return offsets, out
    offsets = pa.array(np.asarray(indptr, dtype=np.int64))
    frame = pl.DataFrame(
        [
            pl.Series(f"c{i}", pa.LargeListArray.from_arrays(offsets, pa.array(a)))
            for i, a in enumerate(arrays)
        ]
    )
    table = frame[np.asarray(rows, dtype=np.int64)].to_arrow()
    lists = [table.column(i).combine_chunks() for i in range(table.num_columns)]
    out_offsets = np.asarray(lists[0].offsets.to_numpy(), dtype=np.int64)
    return out_offsets - out_offsets[0], [x.flatten().to_numpy() for x in lists]


def _in_bounds(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], dst: np.ndarray, src: np.ndarray,
    lengths: np.ndarray,
) -> bool:  # fmt: skip
    """Whether every run lies inside every pair's arrays (the kernels check no bounds; out of
    them, the numpy loop raises as numpy does).
    """
    low = min(int(dst.min()), int(src.min()), int(lengths.min()))
    dst_end, src_end = int((dst + lengths).max()), int((src + lengths).max())
    return low >= 0 and all(dst_end <= len(o) and src_end <= len(s) for o, s in pairs)


def copy_aligned_runs(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], dst_starts: np.ndarray,
    src_starts: np.ndarray, lengths: np.ndarray, kernels: Kernels = NUMPY,
) -> None:  # fmt: skip
    """``dst[d : d + n] = src[s : s + n]`` for every ``(dst, src)`` of ``pairs`` (1-D arrays,
    casting) and every ``(d, s, n)``, in one loop over the runs.

    A loop of slice copies (memcpy, one numpy call per run): for runs of hundreds of tokens it
    costs a fifteenth of a scatter through expanded flat indices, which must first build and
    then read an index per token (measured). Aligned streams (scGPT's
    gene ids and value bins, raw's gene ids and values) share their run offsets, so the loop's
    per-run Python cost is paid once, not once per stream. Gathering whole runs into one
    contiguous array is :func:`gather_runs`' job (native, GIL released). With compiled
    ``kernels`` (one or two pairs), one call copies every run, the GIL released.
    """
    runs = (dst_starts, src_starts, lengths)
    if kernels.backend != "numpy" and len(lengths) and _in_bounds(pairs, *runs):
        if len(pairs) == 1 and kernels.run("copy_runs_1", *pairs[0], *runs):
            return
        if len(pairs) == 2 and kernels.run("copy_runs_2", *pairs[0], *pairs[1], *runs):
            return
    for d, s, n in zip(dst_starts.tolist(), src_starts.tolist(), lengths.tolist(), strict=True):
        for dst, src in pairs:
            dst[d : d + n] = src[s : s + n]
