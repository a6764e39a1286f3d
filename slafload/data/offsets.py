"""The CSR offsets of a dataset's cells (``cells.cell_start_index``) in ~2.25 bytes a cell.

The rows of cell ``c`` are ``expression[offsets[c]:offsets[c + 1]]``. They are the only state
a run keeps per cell, so their size is what grows with an atlas: 8 bytes a cell as ``int64``
is 40 MB at 5M cells and 800 MB at 100M. :class:`CellOffsets` keeps one ``int64`` base per
block of cells and, per cell, its offset from its block's base:

* ``uint16`` offsets and a base per :data:`NARROW_BLOCK` (32) cells, 2.25 bytes a cell, where
  no block's offsets reach 65,536 rows past its first (its first 31 cells: ~2.1k non-zeros a
  cell on average; single-cell atlases hold a few hundred to a few thousand, Tahoe-100M ~600);
* else ``uint32`` offsets and a base per :data:`BLOCK` (4,096) cells, 4 bytes a cell (a block
  would need over a million non-zeros a cell to overflow it; then the offsets are ``int64``).

The form is picked while the offsets are built, batch by batch: the narrow one until a block
overflows it, then what was built is widened once (both forms are held while it is: ~6 bytes
a cell, once, where the first overflow comes late). It indexes like the ``int64[n_cells + 1]``
array it stands for: an int gives an int, a slice or an array of positions (any shape) gives
``int64``; ``np.asarray`` builds the whole array (for tests and tools, not for the loader's
hot path).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import numpy as np

SHIFT = 12
BLOCK = 1 << SHIFT  # cells per base of the uint32 form
NARROW_SHIFT = 5
NARROW_BLOCK = 1 << NARROW_SHIFT  # cells per base of the uint16 form
_WIDEN_CELLS = 1 << 20  # cells widened at a time (a multiple of both blocks)


class CellOffsets:
    """``int64[n + 1]`` CSR offsets stored as a base per block of cells plus a small offset
    per cell from it (see the module docstring). Build with :meth:`of` or :meth:`build`.
    """

    __slots__ = ("_base", "_rel", "_shift")

    def __init__(self, base: np.ndarray, rel: np.ndarray, shift: int = SHIFT):
        if len(base) != -(-len(rel) >> shift):
            raise ValueError(f"{len(base)} bases for {len(rel)} offsets in blocks of {1 << shift}")
        self._base, self._rel, self._shift = base, rel, shift

    @classmethod
    def of(cls, offsets: Any) -> CellOffsets:
        """The compact form of ascending ``offsets`` (an array of ints)."""
        return cls.build([np.asarray(offsets, dtype=np.int64)], len(offsets))

    @classmethod
    def build(cls, parts: Iterable[np.ndarray], n: int) -> CellOffsets:
        """The compact form of ``n`` non-negative ascending offsets given in consecutive
        ``int64`` parts (never all at once: only one part is held as ``int64``). Raises
        ``ValueError`` if they decrease or are not ``n``.
        """
        shift = NARROW_SHIFT
        base = np.zeros(-(-n >> shift), dtype=np.int64)
        rel: np.ndarray = np.empty(n, dtype=np.uint16)
        pos, previous = 0, 0
        for part in parts:
            k = len(part)
            if pos + k > n:
                raise ValueError(f"more than {n} offsets")
            if k == 0:
                continue
            if part[0] < previous or (k > 1 and not (part[1:] >= part[:-1]).all()):
                raise ValueError("offsets must not decrease")
            previous = int(part[-1])
            while True:
                own = _from_bases(part, pos, base, shift)
                if int(own.max()) <= np.iinfo(rel.dtype).max:
                    break
                if rel.dtype == np.uint16:  # a narrow block overflows: widen what was built
                    base, rel = _widened(base, rel, pos, n)
                    shift = SHIFT
                else:  # more than 2**32 rows in a block of cells
                    rel = rel.astype(np.int64)
            rel[pos : pos + k] = own
            pos += k
        if pos != n:
            raise ValueError(f"{pos} offsets given, {n} expected")
        return cls(base, rel, shift)

    @property
    def width(self) -> int:
        """Bytes of each cell's offset from its block's base (2, 4 or 8)."""
        return self._rel.dtype.itemsize

    def __len__(self) -> int:
        return len(self._rel)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return self._base.nbytes + self._rel.nbytes

    def __getitem__(self, index: Any) -> Any:
        n = len(self._rel)
        if isinstance(index, (bool, np.bool_)):
            raise IndexError("cell offsets are indexed by ints, not bools")
        if isinstance(index, (int, np.integer)):
            i = int(index)
            if not -n <= i < n:
                raise IndexError(f"index {i} out of range for {n} offsets")
            i %= n
            return int(self._base[i >> self._shift]) + int(self._rel[i])
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            index = np.arange(start, stop, step, dtype=np.int64)
        else:
            index = np.asarray(index)
            if index.size == 0:
                index = index.astype(np.int64)
            if index.dtype.kind not in "iu":
                raise IndexError(f"cell offsets are indexed by ints, not {index.dtype}")
            index = index.astype(np.int64, copy=False)
            if index.size and (int(index.min()) < -n or int(index.max()) >= n):
                raise IndexError(f"an index out of range for {n} offsets")
            if index.size and int(index.min()) < 0:
                index = np.where(index < 0, index + n, index)
        out = self._rel[index].astype(np.int64)
        out += self._base[index >> self._shift]
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)

    def searchsorted(self, values: Any, side: Literal["left", "right"] = "left") -> np.ndarray:
        """``np.searchsorted`` of ``values`` in the offsets, block by block (no whole array)."""
        values = np.asarray(values, dtype=np.int64)
        blocks = np.searchsorted(self._base, values, side=side) - 1  # last base below (or at)
        out = np.empty(values.shape, dtype=np.int64)
        for i, (value, block) in enumerate(
            zip(values.ravel().tolist(), blocks.ravel().tolist(), strict=True)
        ):
            if block < 0:
                out.flat[i] = 0
                continue
            lo = block << self._shift
            rel = self._rel[lo : lo + (1 << self._shift)]
            found = np.searchsorted(rel, value - int(self._base[block]), side=side)
            out.flat[i] = lo + int(found)
        return out

    def __repr__(self) -> str:
        return f"CellOffsets({len(self)} offsets, {self.nbytes} bytes)"


def _from_bases(part: np.ndarray, pos: int, base: np.ndarray, shift: int) -> np.ndarray:
    """``part`` (the offsets of cells ``pos..``) less its blocks' bases, setting the bases of
    the blocks that start in it (a block that started in an earlier part has its base).
    """
    k, block = len(part), 1 << shift
    firsts = np.arange(-(-pos >> shift) << shift, pos + k, block)  # blocks starting here
    base[firsts >> shift] = part[firsts - pos]
    b0, b1 = pos >> shift, (pos + k - 1) >> shift
    edges = np.clip(np.arange(b0, b1 + 2) << shift, pos, pos + k)
    return part - np.repeat(base[b0 : b1 + 1], np.diff(edges))


def _widened(base: np.ndarray, rel: np.ndarray, pos: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``pos`` offsets of the narrow form (``base``, ``uint16`` ``rel``) in the
    ``uint32`` form, a slice of cells at a time (never an ``int64`` array of them all). They
    fit: a wide block is 128 narrow ones, each spanning under 2**16 rows.
    """
    wide_base = np.zeros(-(-n >> SHIFT), dtype=np.int64)
    wide: np.ndarray = np.empty(n, dtype=np.uint32)
    for a in range(0, pos, _WIDEN_CELLS):
        b = min(pos, a + _WIDEN_CELLS)
        cells = np.arange(a, b)
        full = rel[a:b] + base[cells >> NARROW_SHIFT]
        wide[a:b] = _from_bases(full, a, wide_base, SHIFT)  # < 128 narrow blocks: < 2**23
    return wide_base, wide
