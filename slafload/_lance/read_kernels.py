"""The flat reads' compiled kernels: ``pread`` runs into a buffer and decode mini-block chunks.

Plain Python over arrays that numba compiles (:mod:`slafload.kernels` registers, compiles and
runs them; they are never run as Python). Each does what the numpy code named in its docstring
does: :func:`~slafload._lance.flat_reads.read_ranges` reads with :func:`_pread_runs`, and
:func:`~slafload._lance.miniblock.decode_chunks` is :func:`_decode_chunks`' reference.
:func:`bind` declares libc's ``pread`` and compiles the two kernels :func:`_read_decode` calls;
they are declared here, beside the code that calls them, because numba's on-disk cache of each
kernel is keyed on the file that defines it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_pread: Any = None
"""libc's ``pread(int, void *, size_t, off_t) -> ssize_t`` as numba calls it: declared by
:func:`bind` as an external function found by its name when the kernel is loaded, not by an
address baked into the code, so numba can cache the kernel on disk (loaded in ~2 ms instead of
compiled in 0.1-0.4 s per process; a ctypes function could not be cached)."""
_pread_runs_compiled: Any = None
_decode_chunks_compiled: Any = None
""":func:`_pread_runs` and :func:`_decode_chunks` compiled (by :func:`bind`): what
:func:`_read_decode` calls."""


def bound() -> bool:
    """Whether :func:`bind` has run in this process."""
    return _pread is not None


def bind(numba: Any) -> None:
    """Declare libc's ``pread`` for the kernels and compile the two :func:`_read_decode`
    calls (by :mod:`slafload.kernels`, once it has imported numba, where libc has ``pread``).
    """
    global _pread, _pread_runs_compiled, _decode_chunks_compiled
    t = numba.types
    _pread = t.ExternalFunction("pread", t.intp(t.int32, t.voidptr, t.uintp, t.int64))
    _pread_runs_compiled = numba.njit(nogil=True)(_pread_runs)
    _decode_chunks_compiled = numba.njit(nogil=True)(_decode_chunks)


def _pread_runs(fds: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, where: np.ndarray,
                out: np.ndarray, failed: np.ndarray) -> None:  # fmt: skip
    """``sizes[i]`` bytes of file ``fds[i]`` from ``offsets[i]`` into ``out[where[i]:]``, for
    every ``i`` (:func:`~slafload._lance.flat_reads.read_ranges`); ``failed[0]`` is the first run
    not read whole (an error, or the end of the file), else -1.
    """
    base = out.ctypes.data
    for i in range(len(fds)):
        got = 0
        while got < sizes[i]:
            n = _pread(np.int32(fds[i]), base + where[i] + got, sizes[i] - got, offsets[i] + got)
            if n <= 0:
                failed[0] = i
                return
            got += n
    failed[0] = -1


def _decode_chunks(scratch: np.ndarray, jobs: np.ndarray, chunk_at: np.ndarray,
                   chunk_rows: np.ndarray, order: np.ndarray, tmp: np.ndarray, out: np.ndarray,
                   failed: np.ndarray) -> None:  # fmt: skip
    """:func:`slafload._lance.miniblock.decode_chunks` (``scratch`` and ``out`` ``uint8`` whose
    lengths are multiples of 8, every chunk and value 8-byte aligned in them; ``tmp``
    ``uint64[1024]``); ``failed[0]`` is the first job with a chunk that is not what its
    encoding says, else -1. Each value is written straight to ``out`` (bit-packed chunks,
    whose values come out of order, through ``tmp``), and of a run-length chunk only the
    runs the range needs are expanded.
    """
    failed[0] = -1
    # Typed views of the same bytes, and a branch per width at each access: passing them to
    # a helper (a tuple of arrays) made the kernel 15-20x slower. The hot loops index with
    # unsigned ints: numba wraps a negative signed index, and that check kept LLVM from
    # vectorizing them (bit-unpacking compiled to scatter stores, ~10x slower on the 5M atlas).
    s16, s32, s64 = scratch.view(np.uint16), scratch.view(np.uint32), scratch.view(np.uint64)
    o16, o32, o64 = out.view(np.uint16), out.view(np.uint32), out.view(np.uint64)
    for j in range(len(jobs)):
        kind, width, header, size_bytes = jobs[j, 0], jobs[j, 1], jobs[j, 2], jobs[j, 3]
        scratch_at, out_at, skip, rows = jobs[j, 4], jobs[j, 5], jobs[j, 6], jobs[j, 7]
        o = out_at // width  # the next value's index in out's view of this width
        if kind == 4:  # constant
            value = jobs[j, 8]
            for i in range(rows):
                if width == 1:
                    out[o + i] = value
                elif width == 2:
                    o16[o + i] = value
                elif width == 4:
                    o32[o + i] = value
                else:
                    o64[o + i] = value
            continue
        c, row_c, log, rows_left = jobs[j, 9], jobs[j, 10], jobs[j, 11], jobs[j, 12]
        # The job's chunks lie back to back from scratch_at; chunk_at holds their offsets in
        # 8-byte units modulo 2**16 (MiniPage), so each chunk's bytes are a masked difference.
        end = scratch_at
        lo = skip  # values of this chunk before the range
        left = rows  # values still to write
        while left > 0:
            base = end
            end = base + ((chunk_at[c + 1] - chunk_at[c]) & 0xFFFF) * 8
            if row_c < 0:  # alike chunks: 2**log rows each, the last the rest
                count = min(1 << log, rows_left)
                rows_left -= count
            else:
                count = chunk_rows[row_c + 1] - chunk_rows[row_c]
                row_c += 1
            if base + header > end or scratch[base] != 0 or scratch[base + 1] != 0 or lo >= count:
                failed[0] = j
                return
            size0, size1 = 0, 0
            for b in range(size_bytes):
                size0 |= int(scratch[base + 2 + b]) << (8 * b)
                if kind == 2:
                    size1 |= int(scratch[base + 2 + size_bytes + b]) << (8 * b)
            at = base + header  # the first value buffer, 8-byte aligned
            if at + size0 > end or size0 < width or size0 % width:
                failed[0] = j
                return
            n = min(count - lo, left)  # values of this chunk to write
            if kind == 1:  # plain values
                if size0 != count * width:
                    failed[0] = j
                    return
                v0 = at // width + lo
                for i in range(n):
                    if width == 1:
                        out[o + i] = scratch[v0 + i]
                    elif width == 2:
                        o16[o + i] = s16[v0 + i]
                    elif width == 4:
                        o32[o + i] = s32[v0 + i]
                    else:
                        o64[o + i] = s64[v0 + i]
            elif kind == 2:  # runs: run values, then u8 run lengths
                runs = size0 // width
                lengths = at + ((size0 + 7) // 8) * 8
                if size1 != runs or lengths + size1 > end:
                    failed[0] = j
                    return
                # Every run counted and checked, as the numpy code does: a chunk whose runs
                # are too short, or one of them empty, fails.
                total, shortest = 0, 255
                first_length = np.uint64(lengths)
                for r in range(np.uint64(runs)):
                    length = scratch[first_length + r]
                    total += length
                    shortest = min(shortest, length)
                if total < count or shortest == 0:
                    failed[0] = j
                    return
                v0 = at // width
                pos, r = 0, 0  # the first run the range needs, and the value it starts at
                while pos + scratch[lengths + r] <= lo:
                    pos += scratch[lengths + r]
                    r += 1
                # Its values from lo on, then whole runs. A run of at most 8 values, 8 or
                # more values before the range's end, is written as 8 (the next run
                # overwrites the rest): no loop whose length varies run to run (runs average
                # ~4 values in expression values).
                k = min(pos + scratch[lengths + r] - lo, n)
                if width == 2:
                    value16 = s16[v0 + r]
                    for i in range(k):
                        o16[o + i] = value16
                    r += 1
                    while k < n:
                        length = scratch[lengths + r]
                        value16 = s16[v0 + r]
                        if length <= 8 and k + 8 <= n:
                            at_k = np.uint64(o + k)  # unsigned: one vector store
                            for i in range(np.uint64(8)):
                                o16[at_k + i] = value16
                            k += length
                        else:
                            take = min(length, n - k)
                            for i in range(take):
                                o16[o + k + i] = value16
                            k += take
                        r += 1
                elif width == 4:
                    value32 = s32[v0 + r]
                    for i in range(k):
                        o32[o + i] = value32
                    r += 1
                    while k < n:
                        length = scratch[lengths + r]
                        value32 = s32[v0 + r]
                        if length <= 8 and k + 8 <= n:
                            at_k = np.uint64(o + k)  # unsigned: one vector store
                            for i in range(np.uint64(8)):
                                o32[at_k + i] = value32
                            k += length
                        else:
                            take = min(length, n - k)
                            for i in range(take):
                                o32[o + k + i] = value32
                            k += take
                        r += 1
                else:  # 1 or 8 bytes: not what expression tables hold, kept simple
                    done = 0  # values written; k: the next run's, from the first one's
                    while True:
                        for i in range(k):  # numba: a branch per width, not a helper
                            if width == 1:
                                out[o + done + i] = scratch[v0 + r]
                            else:
                                o64[o + done + i] = s64[v0 + r]
                        done, r = done + k, r + 1
                        if done == n:
                            break
                        k = min(int(scratch[lengths + r]), n - done)
            else:  # FastLanes bit-packing: the bit width, then width * lanes words
                bits = 8 * width
                lanes = 1024 // bits
                words = at // width
                w = int(scratch[at])
                if width == 2:
                    w = int(s16[words])
                elif width == 4:
                    w = int(s32[words])
                if w > bits or count > 1024 or size0 != (1 + w * lanes) * width:
                    failed[0] = j
                    return
                mask = (np.uint64(1) << np.uint64(w)) - np.uint64(1)
                if w == 0:
                    for i in range(1024):
                        tmp[i] = 0
                if width == 2 and w > 0:  # u16 (gene ids): 16 rows of 64 lanes, in u32
                    whole = lo == 0 and n == 1024  # straight to out, else through tmp
                    t16 = tmp.view(np.uint16)
                    m16 = np.uint32(mask)
                    for row in range(16):
                        word, shift = (row * w) // 16, (row * w) % 16
                        low = words + 1 + word * 64
                        down16 = np.uint32(shift)
                        up16 = np.uint32(16 - shift)
                        at_row = order[row // 8] * 16 + (row % 8) * 128
                        dst = o + at_row if whole else at_row
                        target = o16 if whole else t16
                        src = np.uint64(low)  # unsigned indices: no negative-index
                        dst_u = np.uint64(dst)  # wraparound, so the lane loop vectorizes
                        if shift + w > 16:
                            for lane in range(np.uint64(64)):
                                v16 = np.uint32(s16[src + lane]) >> down16
                                v16 |= np.uint32(s16[src + np.uint64(64) + lane]) << up16
                                target[dst_u + lane] = v16 & m16
                        else:
                            for lane in range(np.uint64(64)):
                                target[dst_u + lane] = (np.uint32(s16[src + lane]) >> down16) & m16
                    if not whole:
                        for i in range(n):
                            o16[o + i] = t16[lo + i]
                    o += n
                    left -= n
                    lo = 0
                    c += 1
                    continue
                for row in range(bits if w > 0 else 0):  # u8 and u32 (u16 is above)
                    word, shift = (row * w) // bits, (row * w) % bits
                    src = np.uint64(words + 1 + word * lanes)
                    dst = np.uint64(order[row // 8] * 16 + (row % 8) * 128)
                    up = np.uint64(bits - shift)
                    down = np.uint64(shift)
                    if shift + w > bits:  # the value spills into the lane's next word
                        if width == 4:
                            for lane in range(np.uint64(lanes)):
                                v = np.uint64(s32[src + lane]) >> down
                                v |= np.uint64(s32[src + np.uint64(lanes) + lane]) << up
                                tmp[dst + lane] = v & mask
                        else:
                            for lane in range(np.uint64(lanes)):
                                v = np.uint64(scratch[src + lane]) >> down
                                v |= np.uint64(scratch[src + np.uint64(lanes) + lane]) << up
                                tmp[dst + lane] = v & mask
                    elif width == 4:
                        for lane in range(np.uint64(lanes)):
                            tmp[dst + lane] = (np.uint64(s32[src + lane]) >> down) & mask
                    else:
                        for lane in range(np.uint64(lanes)):
                            tmp[dst + lane] = (np.uint64(scratch[src + lane]) >> down) & mask
                for i in range(n):
                    if width == 1:
                        out[o + i] = tmp[lo + i]
                    elif width == 2:
                        o16[o + i] = tmp[lo + i]
                    else:
                        o32[o + i] = tmp[lo + i]
            o += n
            left -= n
            lo = 0
            c += 1


def _read_decode(direct: np.ndarray, buffer: np.ndarray, packed: np.ndarray,
                 scratch: np.ndarray, jobs: np.ndarray, chunk_at: np.ndarray,
                 chunk_rows: np.ndarray, order: np.ndarray, tmp: np.ndarray,
                 failed: np.ndarray) -> None:  # fmt: skip
    """A read window's whole read in one call: :func:`_pread_runs` of the ``direct`` runs
    (``int64[4, n]``: descriptors, offsets, sizes, where) into ``buffer``, of the ``packed``
    runs into ``scratch``, then :func:`_decode_chunks` of ``jobs`` from ``scratch`` into
    ``buffer`` (each call of a kernel returns to Python, which takes the GIL back after the
    other threads' turns). ``failed``: the first direct run, packed run and job that failed,
    each -1 if none; no step runs after one fails.
    """
    failed[1], failed[2] = -1, -1
    _pread_runs_compiled(direct[0], direct[1], direct[2], direct[3], buffer, failed[0:1])
    if failed[0] >= 0:
        return
    _pread_runs_compiled(packed[0], packed[1], packed[2], packed[3], scratch, failed[1:2])
    if failed[1] >= 0 or len(jobs) == 0:
        return
    _decode_chunks_compiled(scratch, jobs, chunk_at, chunk_rows, order, tmp, buffer, failed[2:3])


KERNELS = {
    "pread_runs": _pread_runs,
    "decode_chunks": _decode_chunks,
    "read_decode": _read_decode,
}
"""The kernels by the names :class:`slafload.kernels.Kernels` runs them under."""
