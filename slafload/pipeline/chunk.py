"""Assemble a part's record batches into a chunk of whole cells, shuffle it, apply
the chunk transforms and split it into compute pieces.

A :class:`~slafload.types.Chunk` holds every expression row of its cells as flat numpy arrays
in CSR layout: views of the read's own buffers where a column's record batches lie back to
back in memory (a fetch read flat, one scanned range), else a copy that concatenates them.
It is built from exactly the rows of one fetch, so a cell never straddles two chunks, and the
rows are checked against the cell ranges they were read for: data that contradicts
``cell_start_index`` or its cell order fails loudly here rather than silently shifting cells.
Genes may be stored in any order within a cell; the chunk sorts them (see
:func:`sort_genes_within_cells`), so every later stage sees them ascending.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from slafload._lance import integrity
from slafload.errors import InconsistentDataError
from slafload.kernels import NUMPY, Kernels
from slafload.pipeline import budget
from slafload.pipeline.buffers import gather_runs, scratch
from slafload.pipeline.partition import Part, Tagged
from slafload.pipeline.ranges import RangeSet, expand
from slafload.pipeline.read import CHECKED_RANGES, Group
from slafload.pipeline.stage import Stage
from slafload.samplers.base import shuffle_order
from slafload.types import CellSource, Chunk, ChunkTransform, Fetch, Offsets


def assemble(
    fetch: Fetch,
    batches: Iterable[pa.RecordBatch],
    cell_start: Offsets,
    *,
    uri: str = "",
    n_genes: int | None = None,
    checked: bool = False,
) -> Chunk:
    """Concatenate a fetch's record batches into a :class:`~slafload.types.Chunk`, validating
    every row.

    ``n_genes`` (the ``genes`` table's row count), when given, bounds the gene ids.
    ``checked``: the fetch's rows were checked against ``cell_start`` before (their
    ``cell_integer_id`` column may be missing and is not compared again); the row count,
    gene ids and values are still checked.

    Raises:
        InconsistentDataError: the rows do not belong to the fetch's cells in order, a gene id
            is ``>= n_genes``, or a value is negative or NaN.

    Genes may be stored in any order within a cell: see :func:`sort_genes_within_cells`.
    """
    cell_ids = fetch.cell_ids()
    lengths = cell_start[cell_ids + 1] - cell_start[cell_ids]
    indptr = np.zeros(len(cell_ids) + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    batch_list = list(batches)
    table = pa.Table.from_batches(batch_list) if batch_list else None
    n_rows = 0 if table is None else table.num_rows
    where = f"expression.lance of {uri!r}, fetch {fetch.index}"
    if n_rows != indptr[-1]:
        raise InconsistentDataError(
            f"{where}: read {n_rows} rows for cells {fetch!r} but cell_start_index says "
            f"{indptr[-1]}. The table changed under a pinned version or is corrupt."
        )
    if n_rows == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Chunk(
            fetch.index,
            cell_ids,
            indptr,
            empty,
            empty.astype(np.float32),
            np.arange(len(cell_ids), dtype=np.int64),
        )
    genes = _column(table, "gene_integer_id")
    values = _column(table, "value")
    if not checked:
        _check_cells(_column(table, "cell_integer_id"), cell_ids, indptr, fetch.ranges, where)
    if n_genes is not None:
        _check_gene_range(genes, n_genes, indptr, cell_ids, where)
    _check_values(values, where)
    indptr, genes, values = sort_genes_within_cells(indptr, genes, values)
    return Chunk(
        fetch.index, cell_ids, indptr, genes, values, np.arange(len(cell_ids), dtype=np.int64)
    )


def _check_cells(
    row_cells: np.ndarray, cell_ids: np.ndarray, indptr: np.ndarray, ranges: np.ndarray, where: str
) -> None:
    """Raise unless every row's ``cell_integer_id`` is the cell ``indptr`` places it in."""
    bad = _misplaced_row(row_cells, cell_ids, indptr, ranges)
    if bad is None:
        return
    expected = cell_ids[np.searchsorted(indptr, bad, side="right") - 1]
    raise InconsistentDataError(
        f"{where}: row {bad} of the chunk belongs to cell {row_cells[bad]} but "
        f"cell_start_index places it in cell {expected}. Expression rows must be "
        "sorted by cell_integer_id and agree with cells.cell_start_index; if the dataset "
        "loaded before, a data file is damaged: `slafload verify` names it."
    )


def _misplaced_row(
    row_cells: np.ndarray, cell_ids: np.ndarray, indptr: np.ndarray, ranges: np.ndarray
) -> int | None:
    """The first row whose ``cell_integer_id`` is not the cell ``indptr`` places it in.

    Checked exactly without building the expected column: every non-empty cell's first and
    last rows hold its id, and ids never decrease within a range of consecutive cells, so
    every row between a cell's first and last holds its id too. That is a few gathers and one
    comparison pass (no multi-megabyte temporary); only data that fails is compared in full.
    """
    starts, stops = indptr[:-1], indptr[1:]
    full = stops > starts
    ids = cell_ids[full]
    if (row_cells[starts[full]] == ids).all() and (row_cells[stops[full] - 1] == ids).all():
        ascending = np.greater_equal(
            row_cells[1:], row_cells[:-1], out=scratch("ascending", len(row_cells) - 1, bool)
        )
        range_first = indptr[np.cumsum(ranges[:, 1] - ranges[:, 0])[:-1]]
        ascending[range_first[(range_first > 0) & (range_first < len(row_cells))] - 1] = True
        if ascending.all():
            return None
    expected = np.repeat(cell_ids.astype(row_cells.dtype, copy=False), stops - starts)
    return int(np.flatnonzero(row_cells != expected)[0])


def shuffle(chunk: Chunk, seed: int | None) -> Chunk:
    """Return ``chunk`` with a seeded random output order (``seed=None`` keeps read order)."""
    if seed is None:
        return chunk
    return dataclasses.replace(chunk, order=shuffle_order(chunk.n_cells, seed))


def cuts(chunk: Chunk, start: int, stop: int, size: int) -> Iterator[Cut]:
    """Output rows ``[start, stop)`` of ``chunk`` as :class:`Cut` pieces of at most ``size``
    cells, not gathered yet.

    Gathered (:meth:`Cut.gather`), each piece holds its cells in output order (its own
    ``order`` is the identity), so the concatenated outputs of the pieces equal rows
    ``[start, stop)`` of the whole chunk.
    """
    if start == 0 and stop >= chunk.n_cells and chunk.n_cells <= size:
        yield Cut(chunk, None)
        return
    for first in range(start, stop, size):
        yield Cut(chunk, chunk.order[first : min(first + size, stop)])


@dataclasses.dataclass(frozen=True, eq=False)
class Cut:
    """A piece of a chunk before its rows are gathered: the chunk's read-order cells
    ``cells`` in output order (``None``: the whole chunk, as it is).

    :class:`Split` hands pieces on in this form and the token stage gathers each one
    (:meth:`gather`) as the first step of its work, on the token worker or, while that is
    busy, on the producer (:class:`~slafload.pipeline.tokenize.TokenWorker`), so the copy of
    a piece's rows runs on whichever thread is free (a fetch larger than a piece, e.g. a
    mixture's fetch of one block per source, is gathered piece by piece).
    """

    chunk: Chunk
    cells: np.ndarray | None

    @property
    def fetch_index(self) -> int:
        """The fetch the piece's chunk was read for."""
        return self.chunk.fetch_index

    @property
    def cell_ids(self) -> np.ndarray:
        """The piece's cell ids, in output order."""
        c = self.chunk
        return c.cell_ids[c.order] if self.cells is None else c.cell_ids[self.cells]

    def gather(self, kernels: Kernels = NUMPY) -> Chunk:
        """The piece as a chunk of its own, in output order (the chunk itself if whole)."""
        chunk, cells = self.chunk, self.cells
        if cells is None:
            return chunk
        indptr, (genes, values) = gather_runs(
            chunk.indptr, [chunk.genes, chunk.values], cells, kernels
        )
        return Chunk(chunk.fetch_index, chunk.cell_ids[cells], indptr, genes, values,
                     np.arange(len(cells), dtype=np.int64))  # fmt: skip


def gathered(piece: Chunk | Cut, kernels: Kernels = NUMPY) -> Chunk:
    """``piece`` as a chunk: a :class:`Cut` gathered, a chunk as it is."""
    return piece.gather(kernels) if isinstance(piece, Cut) else piece


def _column(table: pa.Table, name: str) -> np.ndarray:
    column = table.column(name)
    if column.null_count:
        raise InconsistentDataError(
            f"expression column {name!r} holds {column.null_count} "
            "nulls; SLAF expression rows must be complete."
        )
    joined = _back_to_back(column)
    return joined if joined is not None else column.combine_chunks().to_numpy(zero_copy_only=False)


def _back_to_back(column: pa.ChunkedArray) -> np.ndarray | None:
    """``column``'s values as one read-only array without a copy, where its chunks' values lie
    back to back in memory (each ends where the next begins: the flat reader reads a fetch's
    pieces into one buffer, and a scan of one range is one chunk); ``None`` where they do not
    or the type is not a fixed-width number.

    The array views the chunks' own memory and holds ``column``, so every byte it spans
    stays alive with it: contiguity is all it needs, whatever allocated the chunks.
    """
    kind = column.type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        return None
    dtype = np.dtype(kind.to_pandas_dtype())
    first = end = -1
    for chunk in column.chunks:
        if not len(chunk):
            continue
        at = chunk.buffers()[1].address + chunk.offset * dtype.itemsize
        if end >= 0 and at != end:
            return None
        first = at if first < 0 else first
        end = at + len(chunk) * dtype.itemsize
    if first < 0:
        return None
    return np.frombuffer(pa.foreign_buffer(first, end - first, base=column), dtype)


def sort_genes_within_cells(
    indptr: np.ndarray, genes: np.ndarray, values: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR rows with every cell's genes strictly ascending: ``(indptr, genes, values)``.

    SLAF does not order genes within a cell (slafdb's converter keeps the input's order), but
    ranking breaks ties by gene id through that order. One vectorized pass finds the cells
    whose genes do not strictly ascend; only their rows are sorted (by cell, then gene), and
    duplicate ``(cell, gene)`` entries are then summed, as scipy does. Data that is already
    strictly ascending comes back as is (the same arrays), having paid that one pass only.
    Integer sums that overflow the value dtype widen it to 64 bits.
    """
    steps = _unordered_steps(genes, indptr)
    if not len(steps):
        return indptr, genes, values
    if (genes[steps + 1] < genes[steps]).any():
        cells = np.unique(np.searchsorted(indptr, steps, side="right") - 1)
        genes, values = _sort_cells(indptr, genes, values, cells)
        steps = _unordered_steps(genes, indptr)  # what is left are duplicates
    if not len(steps):
        return indptr, genes, values
    keep = np.ones(len(genes), dtype=bool)
    keep[steps + 1] = False
    first = np.flatnonzero(keep)
    kind = values.dtype.kind
    wide = np.add.reduceat(values, first, dtype={"u": np.uint64, "i": np.int64}.get(kind))
    fits = kind == "f" or wide.max() <= np.iinfo(values.dtype).max
    indptr = np.concatenate([[0], np.cumsum(keep, dtype=np.int64)])[indptr]
    return indptr, genes[first], wide.astype(values.dtype) if fits else wide


def _unordered_steps(genes: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    """Rows ``i`` whose successor, in the same cell, does not have a larger gene id.

    One comparison pass into per-thread scratch finds the steps that do not go up (every cell
    boundary among them); the few found are then checked against the cells' last rows. (A
    boundary mask as long as the chunk, and two more passes over it, cost three times as
    much: this runs on the producer for every fetch.)
    """
    n = len(genes)
    if n < 2:
        return np.zeros(0, dtype=np.int64)
    down = np.less_equal(genes[1:], genes[:-1], out=scratch("step_down", n - 1, bool))
    steps = np.flatnonzero(down)
    # A step may only go down where a new cell starts: from a cell's last row.
    last = indptr[1:-1] - 1
    last = last[(last >= 0) & (last < n - 1)]
    at = np.minimum(np.searchsorted(last, steps), max(len(last) - 1, 0))
    inside = last[at] != steps if len(last) else np.ones(len(steps), dtype=bool)
    return steps[inside]


def _sort_cells(
    indptr: np.ndarray, genes: np.ndarray, values: np.ndarray, cells: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Copies of ``genes``/``values`` with the rows of ``cells`` sorted by gene in each cell."""
    lengths = indptr[cells + 1] - indptr[cells]
    rows = expand(indptr[cells], lengths)
    local = np.repeat(np.arange(len(cells), dtype=np.int64), lengths)
    order = rows[np.lexsort((genes[rows], local))]
    genes, values = genes.copy(), values.copy()  # Arrow-backed arrays are read-only
    genes[rows], values[rows] = genes[order], values[order]
    return genes, values


def _check_gene_range(
    genes: np.ndarray, n_genes: int, indptr: np.ndarray, cell_ids: np.ndarray, where: str
) -> None:
    if int(genes.max()) < n_genes:
        return
    row = int(np.argmax(genes >= n_genes))
    cell = cell_ids[np.searchsorted(indptr, row, side="right") - 1]
    raise InconsistentDataError(
        f"{where}: column 'gene_integer_id' holds gene {genes[row]} in cell {cell}, but "
        f"genes.lance has only {n_genes} genes (ids 0..{n_genes - 1}). If the dataset "
        "loaded before, a data file is damaged: `slafload verify` names it. Otherwise add the "
        "missing genes to genes.lance or renumber gene_integer_id when writing the dataset."
    )


def _check_values(values: np.ndarray, where: str) -> None:
    if values.dtype.kind == "u":
        return
    bad = np.isnan(values) | (values < 0) if values.dtype.kind == "f" else values < 0
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InconsistentDataError(
            f"{where}: column 'value' holds {values[i]} at chunk row {i}, which is negative "
            "or NaN; expression values must be non-negative numbers. Drop or fix those rows "
            "when writing the dataset."
        )


class Assemble(Stage[tuple[Part, Chunk]]):
    """Each part's record batches, read by :class:`~slafload.pipeline.read.Read`, as one checked chunk.

    A part read in several groups is assembled group by group (each group's Arrow data is
    released once it is assembled), then the groups' chunks are joined. A group of one
    contiguous cell range whose rows pass the check is added to ``checked`` (the read stage
    then reads those cells without ``cell_integer_id``: ``Tuning.check_rows``).
    """

    def __init__(
        self, source: Iterator[Group], dataset: CellSource, checked: RangeSet | None = None
    ):
        super().__init__(source)
        self.dataset, self.checked = dataset, checked
        self.n_genes = dataset.n_genes  # a count of the pinned genes table: once, not per part

    def __next__(self) -> tuple[Part, Chunk]:
        ds, chunks = self.dataset, []
        while True:
            group = next(self.source)
            fetch, again = group.fetch, not group.cell_ids
            try:
                chunks.append(assemble(fetch, group.batches, ds.cell_start, uri=ds.uri,
                                       n_genes=self.n_genes, checked=again))  # fmt: skip
            except InconsistentDataError as exc:
                raise _naming_files(exc, ds, fetch) from exc
            if self.checked is not None and not again and len(fetch.ranges) <= CHECKED_RANGES:
                for start, stop in fetch.ranges.tolist():
                    self.checked.add(start, stop)
            if group.last:
                break
            del group
        part = group.part
        return part, chunks[0] if len(chunks) == 1 else budget.concat(part.fetch.index, chunks)


def _naming_files(exc: InconsistentDataError, ds: Any, fetch: Fetch) -> InconsistentDataError:
    """``exc`` with the data files of ``fetch``'s rows named (damage shows up this way too)."""
    table = getattr(ds, "expression", None)
    if table is None:  # a mixture's source: its own message names it
        return exc
    files = integrity.describe(integrity.holding(table, ds.cell_start[fetch.ranges]))
    return InconsistentDataError(f"{exc} The fetch's rows are in {files}.")


class Shuffle(Stage[tuple[Part, Chunk]]):
    """Each chunk in its output order: the fetch's seeded shuffle, or the part's own ``order``
    (a first read of a run, :mod:`slafload.pipeline.first_read`).
    """

    def __next__(self) -> tuple[Part, Chunk]:
        part, chunk = next(self.source)
        if part.order is not None:
            return part, dataclasses.replace(chunk, order=part.order)
        return part, dataclasses.replace(chunk, order=part.fetch.output_order())


class Transform(Stage[tuple[Part, Chunk]]):
    """Each chunk through the chunk transforms, in order (normalisation, gene remapping)."""

    def __init__(self, source: Iterator[tuple[Part, Chunk]], transforms: Sequence[ChunkTransform]):
        super().__init__(source)
        self.transforms = tuple(transforms)

    def __next__(self) -> tuple[Part, Chunk]:
        part, chunk = next(self.source)
        for transform in self.transforms:
            chunk = transform(chunk)
        return part, chunk


class Split(Stage[Tagged[Cut]]):
    """The output rows ``[part.skip, part.keep)`` of each chunk as pieces of at most
    ``piece_cells`` cells, in output order, each tagged with the part's leg (the last piece of
    a part that ends its leg ends it).

    A fetch is the unit of I/O and shuffling; a piece is the unit of ranking and tokenizing,
    which keeps the token arrays small however large a sampler's fetches are. Pieces are
    handed on as :class:`Cut` s: the token stage gathers their rows.
    """

    def __init__(self, source: Iterator[tuple[Part, Chunk]], piece_cells: int):
        super().__init__(source)
        self.piece_cells = piece_cells
        self._pieces: Iterator[Tagged[Cut]] = iter(())

    def __next__(self) -> Tagged[Cut]:
        while True:
            piece = next(self._pieces, None)
            if piece is not None:
                return piece
            part, chunk = next(self.source)
            self._pieces = self._tagged(part, chunk)

    def _tagged(self, part: Part, chunk: Chunk) -> Iterator[Tagged[Cut]]:
        last = len(range(part.skip, part.keep, self.piece_cells)) - 1
        for i, piece in enumerate(cuts(chunk, part.skip, part.keep, self.piece_cells)):
            yield Tagged(piece, part.leg, part.ends_leg and i == last)
