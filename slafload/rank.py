"""Stage 5: rank each cell's genes by expression with a Polars window function.

Within every cell the expressed genes (value > 0) are ordered by value, highest first, ties
broken by gene id ascending. The whole chunk is ranked in one Polars window
expression (``struct(gene, value).sort_by(value).over(cell)``) running in Rust with the GIL
released; nothing loops per cell.
The result keeps the chunk's CSR layout, so a cell's ranked genes are contiguous and the
``j``-th of them has rank ``j``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import polars as pl
from polars.lazyframe.in_process import InProcessQuery

from slafload.chunk import Chunk


@dataclass(frozen=True, eq=False)
class RankedChunk(Chunk):
    """A chunk whose cells' genes are sorted by expression; the input of every tokenizer.

    Same fields as :class:`~slafload.chunk.Chunk`, but only expressed genes (value > 0) are
    kept and, within each cell, ``genes``/``values`` are in rank order: highest value first,
    ties by gene id. Cells stay in read order; tokenizers write cell ``i`` to output row
    ``row_of_cell[i]`` using the helpers below, so they never loop over cells.
    """

    @cached_property
    def lengths(self) -> np.ndarray:
        """``int64[n]`` number of expressed genes of each cell (read order)."""
        return np.diff(self.indptr)

    @cached_property
    def row_of_cell(self) -> np.ndarray:
        """``int64[n]`` output row of each cell (the inverse of ``order``)."""
        rows = np.empty(self.n_cells, dtype=np.int64)
        rows[self.order] = np.arange(self.n_cells, dtype=np.int64)
        return rows

    @cached_property
    def entry_cell(self) -> np.ndarray:
        """Read-order cell index of every entry."""
        return np.repeat(np.arange(self.n_cells, dtype=np.int64), self.lengths)

    @cached_property
    def entry_rank(self) -> np.ndarray:
        """0-based rank of every entry within its cell."""
        return np.arange(len(self.genes), dtype=np.int64) - np.repeat(
            self.indptr[:-1], self.lengths
        )

    @cached_property
    def entry_row(self) -> np.ndarray:
        """Output row of every entry."""
        return self.row_of_cell[self.entry_cell]

    @property
    def output_cell_ids(self) -> np.ndarray:
        """``int64[n]`` the cell id of each output row."""
        return self.cell_ids[self.order]

    def output_lengths(self, limit: int | None = None) -> np.ndarray:
        """Expressed genes per output row, capped at ``limit``."""
        lengths = self.lengths[self.order]
        return lengths if limit is None else np.minimum(lengths, limit)

    def top(self, limit: int) -> np.ndarray:
        """Boolean mask of the entries ranked below ``limit`` in their cell."""
        return self.entry_rank < limit


def rank(chunk: Chunk) -> RankedChunk:
    """Rank the genes of every cell of ``chunk`` (value descending, gene id ascending)."""
    return start_rank(chunk).result()


class PendingRank:
    """A ranking running on Polars' own thread pool; :meth:`result` waits for it.

    Lets the single producer thread tokenize one chunk while Polars ranks the next, so
    numpy (one core) and Polars (Rust threads, no GIL) work at the same time.
    """

    def __init__(
        self,
        chunk: Chunk,
        indptr: np.ndarray,
        genes: np.ndarray,
        values: np.ndarray,
        query: InProcessQuery | None,
    ):
        self._chunk, self._indptr, self._query = chunk, indptr, query
        self._genes, self._values = genes, values

    def discard(self) -> None:
        """Wait for the query and drop it: Polars must never be left sending to nobody."""
        if self._query is not None:
            self._query.fetch_blocking()
            self._query = None

    def result(self) -> RankedChunk:
        genes, values = self._genes, self._values
        if self._query is not None:
            ranked, self._query = self._query.fetch_blocking(), None
            genes = ranked.get_column("gene").to_numpy()
            values = ranked.get_column("value").to_numpy()
        c = self._chunk
        return RankedChunk(c.fetch_index, c.cell_ids, self._indptr, genes, values, c.order)


def start_rank(chunk: Chunk) -> PendingRank:
    """Start ranking ``chunk`` in the background (see :class:`PendingRank`)."""
    genes, values, indptr = chunk.genes, chunk.values, chunk.indptr
    expressed = values > 0
    if not expressed.all():
        genes, values = genes[expressed], values[expressed]
        kept = np.concatenate([[0], np.cumsum(expressed, dtype=np.int64)])
        indptr = kept[indptr]
    if not len(genes):
        return PendingRank(chunk, indptr, genes, values, None)
    cell = np.repeat(np.arange(chunk.n_cells, dtype=np.int32), np.diff(indptr))
    # Chunks hold each cell's genes strictly ascending whatever the storage order (the chunk
    # stage sorts cells stored otherwise), so a stable sort by value descending breaks ties by
    # gene id ascending.
    # `cell` is sorted, so "explode" emits the groups in storage order without scattering
    # results back to row positions; sorting (gene, value) as one struct sorts once.
    query = (
        pl.LazyFrame({"cell": cell, "gene": genes, "value": values})
        .with_columns(pl.col("cell").set_sorted())
        .select(
            pl.struct("gene", "value")
            .sort_by("value", descending=True, maintain_order=True)
            .over("cell", mapping_strategy="explode")
            .alias("ranked")
        )
        .unnest("ranked")
        .collect(background=True)
    )
    return PendingRank(chunk, indptr, genes, values, query)
