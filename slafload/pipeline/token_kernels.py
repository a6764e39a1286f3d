"""The token worker's compiled kernels: plain Python over arrays that numba compiles.

:mod:`slafload.kernels` registers, compiles and runs them; they are never run as Python. Each
does what the numpy function named in its docstring does, and the tokens are identical either
way (tests compare both on the same data).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Each run is copied between two slice views indexed from 0: LLVM vectorizes that loop, and not
# one indexing the whole arrays at ``d + k`` and ``s + k`` (0.26 against 1.9 ms for a piece's
# 2,048 runs).


def _copy_runs_1(out: np.ndarray, src: np.ndarray, dst: np.ndarray, start: np.ndarray,
                 count: np.ndarray) -> None:  # fmt: skip
    """:func:`~slafload.pipeline.buffers.copy_aligned_runs` for one ``(out, src)`` pair."""
    for r in range(len(dst)):
        o, i = out[dst[r] : dst[r] + count[r]], src[start[r] : start[r] + count[r]]
        for k in range(min(len(o), len(i))):  # equal; min keeps a bad run inside both
            o[k] = i[k]


def _copy_runs_2(out: np.ndarray, src: np.ndarray, out2: np.ndarray, src2: np.ndarray,
                 dst: np.ndarray, start: np.ndarray, count: np.ndarray) -> None:  # fmt: skip
    """:func:`~slafload.pipeline.buffers.copy_aligned_runs` for two aligned ``(out, src)`` pairs."""
    for r in range(len(dst)):
        o, i = out[dst[r] : dst[r] + count[r]], src[start[r] : start[r] + count[r]]
        for k in range(min(len(o), len(i))):
            o[k] = i[k]
        o2, i2 = out2[dst[r] : dst[r] + count[r]], src2[start[r] : start[r] + count[r]]
        for k in range(min(len(o2), len(i2))):
            o2[k] = i2[k]


def _fill_runs(flat: np.ndarray, start: np.ndarray, stop: np.ndarray, pad: Any) -> None:
    """``flat[start[i]:stop[i]] = pad`` for every ``i`` (``RowBuffers``' re-pad)."""
    for i in range(len(start)):
        run = flat[start[i] : stop[i]]
        for k in range(len(run)):
            run[k] = pad


def _quantile_bins(values: np.ndarray, indptr: np.ndarray, n_bins: int, offset: int,
                   out: np.ndarray) -> None:  # fmt: skip
    """:func:`~slafload.tokenizers.quantile_bins` of every cell (values in rank order).

    Per cell: its ``n_bins - 1`` edges by numpy's linear quantile interpolation of the
    ascending values (``ascending[a] = values[stop - 1 - a]``), then one walk down the
    descending values, the bin (number of edges ``<=`` the value) never increasing.
    """
    q = np.linspace(0.0, 1.0, n_bins - 1)
    edges = np.empty(n_bins - 1)
    for c in range(len(indptr) - 1):
        start, stop = indptr[c], indptr[c + 1]
        n = stop - start
        if n == 0:
            continue
        for j in range(n_bins - 1):
            virtual = (n - 1) * q[j]
            floor = np.floor(virtual)
            prev = min(int(floor), n - 1)
            nxt = min(prev + 1, n - 1)
            lo, hi = values[stop - 1 - prev], values[stop - 1 - nxt]
            t, diff = virtual - floor, hi - lo  # the difference in the values' type, as numpy
            edges[j] = hi - diff * (1 - t) if t >= 0.5 else lo + diff * t  # numpy's _lerp
        k = n_bins - 1
        for i in range(start, stop):
            while k > 0 and edges[k - 1] > values[i]:
                k -= 1
            out[i] = k + offset


def _sort_runs(keys: np.ndarray, indptr: np.ndarray, spare: np.ndarray, low_mask: Any,
               from_byte: int) -> None:  # fmt: skip
    """Each run ``keys[indptr[c]:indptr[c + 1]]`` sorted ascending in place
    (:func:`~slafload.pipeline.ranking.rank_by_keys`' per-cell ``sort``), one compiled call for
    every cell: stable least-significant-byte radix passes, ``spare`` (as long as the longest
    run, the keys' type) taking every other pass.

    A run already ascending in its low bits (``key & low_mask``: the gene, as a chunk holds
    each cell's genes) is sorted from byte ``from_byte`` up: a stable sort by the bytes above
    keeps the order of keys that tie on them. A byte that every key of a run shares is
    skipped (a small count's high bytes), so a cell of counts under 256 with ``uint16`` genes
    takes one pass. One scan of a run finds both (whether its genes ascend, and which bits
    differ from its first key's), so a pass is counted only for a byte that needs it.
    """
    n_bytes = keys.itemsize
    count = np.zeros(256, np.int64)
    for c in range(len(indptr) - 1):
        start, stop = indptr[c], indptr[c + 1]
        n = stop - start
        if n < 2:
            continue
        head = keys[start]
        differ = head ^ head  # the bits in which some key of the run differs from the first
        ascending = True
        for j in range(start + 1, stop):
            key = keys[j]
            if key & low_mask <= keys[j - 1] & low_mask:
                ascending = False
            differ |= key ^ head
        src, dst, moved = keys[start:stop], spare[:n], False
        for p in range(from_byte if ascending else 0, n_bytes):
            shift = 8 * p
            if (differ >> shift) & 255 == 0:
                continue  # every key of the run has this byte
            count[:] = 0
            for j in range(n):
                count[(src[j] >> shift) & 255] += 1
            total = 0
            for d in range(256):
                total, count[d] = total + count[d], total
            for j in range(n):
                d = (src[j] >> shift) & 255
                dst[count[d]] = src[j]
                count[d] += 1
            src, dst, moved = dst, src, not moved
        if moved:
            keys[start:stop] = src


def _rank_counts(genes: np.ndarray, values: np.ndarray, indptr: np.ndarray,
                 out_genes: np.ndarray, out_values: np.ndarray, count: np.ndarray,
                 bucket: np.ndarray, spare_genes: np.ndarray, spare_values: np.ndarray,
                 unordered: np.ndarray) -> None:  # fmt: skip
    """:func:`~slafload.pipeline.ranking.rank_counts`: each cell's ``(genes, values)`` of
    ``indptr`` into the same positions of ``out_genes``/``out_values``, values descending,
    ties by gene ascending, for integer values (positive, within ``int64``) of cells whose
    genes ascend (as a chunk holds them).

    No keys: one stable counting pass a cell over 256 buckets, one for each value from the
    cell's lowest to 254 above it, highest first (``count``: ``int64[4, 256]`` scratch, four
    histograms over the run's four quarters, so that a run of equal counts updates four
    counters in turn instead of waiting on one; ``bucket``: ``uint8`` scratch as long as the
    longest run).
    Values 255 or more above the cell's lowest (its few highest counts) share the first
    bucket, which is then put in order by stable radix passes over the bytes of the value's
    distance below the highest (``spare_genes``/``spare_values``: scratch as long as the
    longest run, of the outputs' types). A cell whose genes do not strictly ascend stops the
    kernel with ``unordered[0] = 1`` (the caller ranks the piece another way).
    """
    for c in range(len(indptr) - 1):
        start, stop = indptr[c], indptr[c + 1]
        n = stop - start
        if n == 0:
            continue
        g, v = genes[start:stop], values[start:stop]
        lo = hi = np.int64(v[0])
        ascending = True
        for j in range(1, n):
            x = np.int64(v[j])
            lo, hi = min(lo, x), max(hi, x)
            if g[j] <= g[j - 1]:
                ascending = False
        if not ascending:
            unordered[0] = 1
            return
        top = lo + 255  # values from here up share bucket 0; value x < top is in top - x
        b = bucket[:n]
        for j in range(n):
            x = np.int64(v[j])
            b[j] = 0 if x >= top else top - x
        first = 0 if hi >= top else top - hi  # buckets first..255 are used
        count[:, first:] = 0
        h = n // 4
        for j in range(h):
            for q in range(4):
                count[q, b[q * h + j]] += 1
        for j in range(4 * h, n):
            count[3, b[j]] += 1
        total = 0
        for d in range(first, 256):
            for q in range(4):
                total, count[q, d] = total + count[q, d], total
        og, ov = out_genes[start:stop], out_values[start:stop]
        for j in range(h):
            for q in range(4):
                i = q * h + j
                at = count[q, b[i]]
                og[at], ov[at] = g[i], v[i]
                count[q, b[i]] = at + 1
        for i in range(4 * h, n):
            at = count[3, b[i]]
            og[at], ov[at] = g[i], v[i]
            count[3, b[i]] = at + 1
        high = count[3, 0] if first == 0 else 0  # where bucket 0 ends, after the pass
        if high < 2:
            continue
        src_g, src_v, dst_g, dst_v = og[:high], ov[:high], spare_genes[:high], spare_values[:high]
        digits, moved = hi - top, False  # the largest distance below hi in bucket 0
        shift, per = 0, count[0]
        while shift < 64 and digits >> shift:  # (a shift by 64 is undefined: x86 takes it as 0)
            per[:] = 0
            for j in range(high):
                per[((hi - np.int64(src_v[j])) >> shift) & 255] += 1
            total = 0
            for d in range(256):
                total, per[d] = total + per[d], total
            for j in range(high):
                digit = ((hi - np.int64(src_v[j])) >> shift) & 255
                dst_g[per[digit]], dst_v[per[digit]] = src_g[j], src_v[j]
                per[digit] += 1
            src_g, src_v, dst_g, dst_v, moved = dst_g, dst_v, src_g, src_v, not moved
            shift += 8
        if moved:
            og[:high], ov[:high] = src_g, src_v


KERNELS = {
    "copy_runs_1": _copy_runs_1,
    "copy_runs_2": _copy_runs_2,
    "fill_runs": _fill_runs,
    "quantile_bins": _quantile_bins,
    "rank_counts": _rank_counts,
    "sort_runs": _sort_runs,
}
"""The kernels by the names :class:`slafload.kernels.Kernels` runs them under."""
