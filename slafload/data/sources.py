"""How a mixture's global cell ids meet its sources: lookups, offsets, reading, transforms.

A :class:`~slafload.data.mixture.Mixture` numbers its sources' cells one after the other: source
``k`` holds global cell ids ``[offsets[k], offsets[k + 1])``. The pieces here translate between
global ids and each source's own: :class:`MixedReader` reads a fetch from its sources,
:class:`GlobalOffsets` gives the chunk stage CSR offsets by global id, :class:`CellColumn`
gives the token worker per-cell columns (source codes, ids within a source, obs codes), and
:class:`PerSource` runs each chunk through its own source's transforms and
:class:`PerSourceTokens` each ranked piece through its own source's tokenizer (a model
preset built for each source).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from slafload.data.dataset import SlafDataset
from slafload.errors import MixtureError
from slafload.pipeline import budget
from slafload.pipeline.buffers import BytePool, gather_runs
from slafload.pipeline.reader import ReadOptions, started
from slafload.types import Chunk, ChunkTransform, Fetch, Offsets, RankedChunk, Tokenizer

C = TypeVar("C", bound=Chunk)


def source_of(offsets: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """The source index of each global cell id."""
    return np.searchsorted(offsets, cells, side="right") - 1


def _by_source(offsets: np.ndarray, cells: np.ndarray, n_sources: int) -> Iterator[tuple[int, Any]]:
    """``(source, selector)`` for each source among ``cells``; a piece is one source's cells,
    so that common case costs two scans, not a search per cell.
    """
    if not cells.size:
        return
    first, last = (
        min(int(x), n_sources - 1) for x in source_of(offsets, np.array([cells.min(), cells.max()]))
    )
    if first == last:
        yield first, slice(None)
        return
    src = np.minimum(source_of(offsets, cells), n_sources - 1)
    for k in range(first, last + 1):
        yield k, src == k


class CellColumn:
    """``int64`` values of global cell ids, looked up in each cell's own source.

    ``parts[k]`` is an array indexed by source ``k``'s cell ids, a constant, or ``None`` (the
    cell's id within its source). Indexing with global cell ids (as the token worker's
    :func:`~slafload.pipeline.tokenize.with_obs` indexes obs codes) returns the values.
    """

    def __init__(self, offsets: np.ndarray, parts: Sequence[np.ndarray | int | None]):
        self.offsets, self.parts = offsets, list(parts)

    def __getitem__(self, cells: np.ndarray) -> np.ndarray:
        cells = np.asarray(cells, dtype=np.int64)
        kinds = {type(part) for part in self.parts}
        if kinds <= {int, type(None)} and len(kinds) == 1:
            # source codes, or ids within the source (every batch of a mixture carries both):
            # one search for the cells' sources, a gather and at most one subtraction, where
            # a lookup per source costs a dozen passes over a piece's interleaved cells
            src = np.searchsorted(self.offsets[1 : len(self.parts)], cells, side="right")
            if kinds == {int}:
                return np.asarray(self.parts, dtype=np.int64)[src]
            return cells - self.offsets[src]
        out = np.empty(len(cells), dtype=np.int64)
        for k, mask in _by_source(self.offsets, cells, len(self.parts)):
            local = cells[mask] - self.offsets[k]
            part = self.parts[k]
            out[mask] = local if part is None else part if isinstance(part, int) else part[local]
        return out


class GlobalOffsets:
    """The mixture's CSR offsets by global cell id, computed from the sources' own.

    Row ids are global too: source ``k``'s rows follow all rows of sources ``< k``. No array
    over all cells is built (each source already holds its own).
    """

    def __init__(self, offsets: np.ndarray, starts: Sequence[Offsets]):
        self.offsets, self.starts = offsets, list(starts)
        self.rows = np.concatenate([[0], np.cumsum([int(s[-1]) for s in starts])]).astype(np.int64)

    def __getitem__(self, cells: Any) -> Any:
        if isinstance(cells, (int, np.integer)):
            return int(self[np.array([cells if cells >= 0 else cells + len(self)])][0])
        if isinstance(cells, slice):  # budget.groups cuts a range at cell boundaries
            cells = np.arange(*cells.indices(len(self)))
        cells = np.asarray(cells, dtype=np.int64)
        out = np.empty(cells.shape, dtype=np.int64)
        for k, mask in _by_source(self.offsets, cells, len(self.starts)):
            out[mask] = self.starts[k][cells[mask] - self.offsets[k]] + self.rows[k]
        return out

    def __len__(self) -> int:
        return int(self.offsets[-1]) + 1


class MixedReader:
    """Reads each fetch (global cell ids, one or more sources) from its sources' Lance tables.

    The rows come back with global ``cell_integer_id`` so the chunk stage checks them against
    the fetch as it does for one dataset.
    """

    def __init__(
        self,
        offsets: np.ndarray,
        datasets: Sequence[SlafDataset],
        options: ReadOptions | None = None,
    ):
        self.offsets = offsets
        options = ReadOptions() if options is None else options
        if options.pool is None:  # one pool for every source: flat reads keep one bound's worth
            options = dataclasses.replace(options, pool=BytePool())
        self.readers = [ds.reader(options) for ds in datasets]
        self.common = _common_schema(datasets, int(offsets[-1]))

    def read(self, fetch: Fetch, *, cell_ids: bool = True) -> Iterator[pa.RecordBatch]:
        """The record batches of ``fetch``, read from its sources (each run of consecutive
        ranges of one source as one read of that source), with global cell ids
        (``cell_ids=False``: possibly without them, as :meth:`slafload.pipeline.reader.Reader.read` says).
        """
        ranges = _cut_at(fetch.ranges, self.offsets)
        if not len(ranges):
            return
        src = source_of(self.offsets, ranges[:, 0])
        bounds = np.flatnonzero(np.diff(src, prepend=-1, append=-1))
        common = self.common if len(bounds) > 2 else None  # one chunk: one schema
        runs = list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True))
        # every source's read started before the first is handed on, as one source's would be
        reads = [
            started(self._read(fetch, ranges[lo:hi], int(src[lo]), cell_ids)) for lo, hi in runs
        ]
        for read in reads:
            for batch in read:
                yield batch if common is None else _cast(batch, common)

    def _read(
        self, fetch: Fetch, ranges: np.ndarray, k: int, cell_ids: bool
    ) -> Iterator[pa.RecordBatch]:
        offset = int(self.offsets[k])
        local = Fetch(fetch.index, ranges - offset, fetch.shuffle_seed)
        for batch in self.readers[k].read(local, cell_ids=cell_ids):
            if "cell_integer_id" in batch.schema.names:
                if not cell_ids:  # another source's read may lack it: one schema per fetch
                    batch = batch.drop_columns(["cell_integer_id"])
                elif offset:
                    batch = _shift_cells(batch, offset, int(self.offsets[-1]))
            yield batch


def _cut_at(ranges: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``ranges`` (read order kept) with every range crossing a source boundary cut there."""
    ranges = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    first = source_of(offsets, ranges[:, 0])
    last = source_of(offsets, ranges[:, 1] - 1)
    if not len(ranges) or (first == last).all():
        return ranges
    pieces = []
    for (a, b), f, g in zip(ranges.tolist(), first.tolist(), last.tolist(), strict=True):
        edges = [a, *offsets[f + 1 : g + 1].tolist(), b]
        pieces += [[lo, hi] for lo, hi in itertools.pairwise(edges)]
    return np.array(pieces, dtype=np.int64)


def _common_schema(datasets: Sequence[SlafDataset], n_cells: int) -> pa.Schema | None:
    """The expression columns' types every source's batches of one mixed fetch are cast to
    (integer counts and float values promote to float), or ``None`` where all agree.
    """
    names = ["cell_integer_id", "gene_integer_id", "value"]
    schemas = []
    for k, ds in enumerate(datasets):
        fields = [ds.expression.schema.field(n) for n in names]
        cell = fields[0].type
        if k and (not pa.types.is_integer(cell) or n_cells > np.iinfo(cell.to_pandas_dtype()).max):
            fields[0] = pa.field(names[0], pa.int64())
        schemas.append(pa.schema(fields))
    if all(schema.equals(schemas[0]) for schema in schemas):
        return None
    return pa.unify_schemas(schemas, promote_options="permissive")


def _cast(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` with each column in ``schema``'s type."""
    for i, f in enumerate(batch.schema):
        want = schema.field(f.name).type
        if f.type != want:
            batch = batch.set_column(i, f.name, batch.column(i).cast(want))
    return batch


def _shift_cells(batch: pa.RecordBatch, offset: int, n_cells: int) -> pa.RecordBatch:
    """``batch`` with ``offset`` added to its cell ids, in their own type where every global
    id fits (one pass over a 4-byte column), else as ``int64``.
    """
    i = batch.schema.get_field_index("cell_integer_id")
    column = batch.column(i)
    kind = column.type
    if not pa.types.is_integer(kind) or n_cells > np.iinfo(kind.to_pandas_dtype()).max:
        kind, column = pa.int64(), column.cast(pa.int64())
    return batch.set_column(i, "cell_integer_id", pc.add(column, pa.scalar(offset, kind)))


@dataclass(frozen=True, eq=False)
class PerSource:
    """Chunk transform: each source's cells of a chunk through that source's transforms.

    A mixed fetch reads each source's cells as one block, so a chunk is a few runs of
    consecutive cells of one source; each run is transformed as a chunk of its own and the
    runs are put back together, cells and output order unchanged.
    """

    offsets: np.ndarray
    transforms: tuple[tuple[ChunkTransform, ...], ...]

    def __call__(self, chunk: Chunk) -> Chunk:
        """``chunk`` with each source's cells through that source's transforms."""
        if not chunk.n_cells or not any(self.transforms):
            return chunk
        src = np.minimum(source_of(self.offsets, chunk.cell_ids), len(self.transforms) - 1)
        bounds = np.flatnonzero(np.diff(src, prepend=-1, append=-1))
        if len(bounds) == 2:
            return self._through(int(src[0]), chunk)
        runs = [
            self._through(int(src[lo]), _cells(chunk, lo, hi))
            for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
        ]
        return dataclasses.replace(budget.concat(chunk.fetch_index, runs), order=chunk.order)

    def _through(self, k: int, chunk: Chunk) -> Chunk:
        """``chunk`` (cells of source ``k``) through ``k``'s transforms, which see the cells'
        ids within the source (a preset looks up per-cell obs values by them).
        """
        if not self.transforms[k]:
            return chunk
        offset = int(self.offsets[k])
        chunk = _shifted(chunk, -offset)
        for transform in self.transforms[k]:
            chunk = transform(chunk)
        return _shifted(chunk, offset)

    def for_epoch(self, epoch: int) -> PerSource:
        """Epoch-aware transforms of every source bound to ``epoch`` (itself if none is)."""
        if not any(hasattr(t, "for_epoch") for ts in self.transforms for t in ts):
            return self
        return dataclasses.replace(
            self, transforms=tuple(_bound(ts, epoch) for ts in self.transforms)
        )


def _bound(stages: tuple[Any, ...], epoch: int) -> tuple[Any, ...]:
    """``stages`` with each epoch-aware one (a ``for_epoch`` method) bound to ``epoch``."""
    return tuple(t.for_epoch(epoch) if hasattr(t, "for_epoch") else t for t in stages)


def _shifted(chunk: C, offset: int) -> C:
    """``chunk`` with ``offset`` added to its cell ids."""
    if not offset:
        return chunk
    return dataclasses.replace(chunk, cell_ids=chunk.cell_ids + offset)


def _cells(chunk: Chunk, lo: int, hi: int) -> Chunk:
    """Read-order cells ``[lo, hi)`` of ``chunk`` as a chunk in read order."""
    a, b = int(chunk.indptr[lo]), int(chunk.indptr[hi])
    return Chunk(
        chunk.fetch_index,
        chunk.cell_ids[lo:hi],
        chunk.indptr[lo : hi + 1] - a,
        chunk.genes[a:b],
        chunk.values[a:b],
        np.arange(hi - lo, dtype=np.int64),
    )


@dataclass(eq=False)  # not frozen: a Tokenizer's name is a plain attribute
class PerSourceTokens:
    """Tokenizer: each source's cells of a ranked piece through that source's tokenizer.

    A model preset is built for each source (its gene map, obs columns and random draws are
    the source's own), and a piece interleaves the sources cell by cell; so each source's
    cells are tokenized as a ranked chunk of their own, with their ids within the source,
    and their rows written back to their output rows. Every source's tokenizer returns the
    same keys, dtypes and widths (the same preset built for each source does).
    """

    offsets: np.ndarray
    tokenizers: tuple[Tokenizer, ...]
    name: str

    def __call__(self, ranked: RankedChunk) -> dict[str, np.ndarray]:
        """Row-aligned arrays of every cell, each from its own source's tokenizer."""
        src = np.minimum(source_of(self.offsets, ranked.cell_ids), len(self.tokenizers) - 1)
        present = np.unique(src).tolist()
        if len(present) < 2:
            k = present[0] if present else 0
            return self.tokenizers[k](_shifted(ranked, -int(self.offsets[k])))
        out: dict[str, np.ndarray] = {}
        for k in present:
            cells = np.flatnonzero(src == k)
            rows = ranked.row_of_cell[cells]
            arrays = self.tokenizers[k](_ranked_cells(ranked, cells, rows, -int(self.offsets[k])))
            if out and set(arrays) != set(out):
                raise MixtureError(
                    f"source {k}'s tokenizer returns {sorted(arrays)} but another source's "
                    f"returns {sorted(out)}; build every source's tokenizer from one preset"
                )
            for key, array in arrays.items():
                if key not in out:
                    out[key] = np.empty((ranked.n_cells, *array.shape[1:]), array.dtype)
                out[key][np.sort(rows)] = array
        return out

    def for_epoch(self, epoch: int) -> PerSourceTokens:
        """Epoch-aware tokenizers of every source bound to ``epoch`` (itself if none is)."""
        if not any(hasattr(t, "for_epoch") for t in self.tokenizers):
            return self
        return dataclasses.replace(self, tokenizers=_bound(self.tokenizers, epoch))


def _ranked_cells(
    ranked: RankedChunk, cells: np.ndarray, rows: np.ndarray, offset: int
) -> RankedChunk:
    """Read-order cells ``cells`` of ``ranked`` (output rows ``rows``) as a ranked chunk whose
    output rows follow theirs, ``offset`` added to their ids.
    """
    indptr, (genes, values) = gather_runs(ranked.indptr, [ranked.genes, ranked.values], cells)
    return RankedChunk(
        ranked.fetch_index,
        ranked.cell_ids[cells] + offset,
        indptr,
        genes,
        values,
        np.argsort(rows, kind="stable"),
    )
