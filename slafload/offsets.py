"""The CSR offsets of a dataset's cells (``cells.cell_start_index``) in 4 bytes a cell.

The rows of cell ``c`` are ``expression[offsets[c]:offsets[c + 1]]``. They are the only state
a run keeps per cell, so their size is what grows with an atlas: 8 bytes a cell as ``int64``
is 40 MB at 5M cells and 800 MB at 100M. :class:`CellOffsets` keeps one ``int64`` base per
block of :data:`BLOCK` cells and, per cell, a ``uint32`` offset from its block's base (a block
of 4,096 cells would need over a million non-zeros a cell to overflow it; then the offsets are
kept as ``int64``). It indexes like the ``int64[n_cells + 1]`` array it stands for: an int
gives an int, a slice or an array of positions (any shape) gives ``int64``; ``np.asarray``
builds the whole array (for tests and tools, not for the loader's hot path).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import numpy as np

SHIFT = 12
BLOCK = 1 << SHIFT  # cells per base


class CellOffsets:
    """``int64[n + 1]`` CSR offsets stored as a base per :data:`BLOCK` cells plus ``uint32``
    offsets from it (see the module docstring). Build with :meth:`of` or :meth:`build`.
    """

    __slots__ = ("_base", "_rel")

    def __init__(self, base: np.ndarray, rel: np.ndarray):
        if len(base) != -(-len(rel) // BLOCK):
            raise ValueError(f"{len(base)} bases for {len(rel)} offsets")
        self._base, self._rel = base, rel

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
        base = np.zeros(-(-n // BLOCK), dtype=np.int64)
        rel: np.ndarray = np.empty(n, dtype=np.uint32)
        pos, previous = 0, 0
        for part in parts:
            k = len(part)
            if pos + k > n:
                raise ValueError(f"more than {n} offsets")
            if k == 0:
                continue
            firsts = np.arange(-(-pos // BLOCK) * BLOCK, pos + k, BLOCK)  # blocks starting here
            base[firsts >> SHIFT] = part[firsts - pos]
            b0, b1 = pos >> SHIFT, (pos + k - 1) >> SHIFT
            edges = np.clip(np.arange(b0, b1 + 2) * BLOCK, pos, pos + k)
            own = part - np.repeat(base[b0 : b1 + 1], np.diff(edges))
            if part[0] < previous or (k > 1 and not (part[1:] >= part[:-1]).all()):
                raise ValueError("offsets must not decrease")
            previous = int(part[-1])
            if rel.dtype == np.uint32 and int(own.max()) >= 2**32:
                rel = rel.astype(np.int64)  # more than 2**32 rows in a block of cells
            rel[pos : pos + k] = own
            pos += k
        if pos != n:
            raise ValueError(f"{pos} offsets given, {n} expected")
        return cls(base, rel)

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
            return int(self._base[i >> SHIFT]) + int(self._rel[i])
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
        out += self._base[index >> SHIFT]
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
            lo = block * BLOCK
            rel = self._rel[lo : lo + BLOCK]
            found = np.searchsorted(rel, value - int(self._base[block]), side=side)
            out.flat[i] = lo + int(found)
        return out

    def __repr__(self) -> str:
        return f"CellOffsets({len(self)} offsets, {self.nbytes} bytes)"
