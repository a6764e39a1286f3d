"""Stage 5: rank each cell's genes by expression with a Polars window function.

(Gene *ranking*; the partition of epochs among distributed ranks is :mod:`slafload.partition`.)

Within every cell the expressed genes (value > 0) are ordered by value, highest first, ties
broken by gene id ascending. The whole chunk is ranked in one Polars window
expression (``struct(gene, value).sort_by(value).over(cell)``) running in Rust with the GIL
released; nothing loops per cell.
The result keeps the chunk's CSR layout, so a cell's ranked genes are contiguous and the
``j``-th of them has rank ``j``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import polars as pl

from slafload._compat import BackgroundQuery, collect_in_background
from slafload.stage import Stage
from slafload.types import Chunk, RankedChunk


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
        query: BackgroundQuery | None,
    ):
        self._chunk, self._indptr, self._query = chunk, indptr, query
        self._genes, self._values = genes, values

    def discard(self) -> None:
        """Wait for the query and drop it: Polars must never be left sending to nobody."""
        if self._query is not None:
            self._query.fetch_blocking()
            self._query = None

    def result(self) -> RankedChunk:
        """Wait for the ranking and return it."""
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
    )
    return PendingRank(chunk, indptr, genes, values, collect_in_background(query))


class RankGenes(Stage[Any]):
    """Starts each piece's token work ``lookahead`` pieces ahead; yields the started work.

    ``start`` is the token stage's (:mod:`slafload.layout`): on the producer it ranks the
    piece on Polars' threads (:func:`start_rank`), for device tokenizing it only packs the
    piece's CSR. With one piece of lookahead, Polars ranks piece ``i + 1`` while the
    tokenizer (numpy, this thread) works on piece ``i``, so both cores work. If pulling the
    next piece fails, the pieces already started are handed on first and the failure is
    raised after them.
    """

    def __init__(
        self,
        source: Iterator[Chunk],
        *,
        start: Callable[[Chunk], Any] = start_rank,
        lookahead: int = 1,
    ):
        super().__init__(source)
        self.start, self.lookahead = start, lookahead
        self._pending: list[Any] = []
        self._failure: BaseException | None = None

    def __next__(self) -> Any:
        while self._failure is None and len(self._pending) <= self.lookahead:
            try:
                piece = next(self.source)
            except StopIteration:
                break
            except Exception as exc:  # deliver what was read before the failure, then raise
                self._failure = exc
                break
            self._pending.append(self.start(piece))
        if self._pending:
            return self._pending.pop(0)
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        raise StopIteration

    def close(self) -> None:
        """Wait out rankings in flight (Polars must never send to nobody), close the source."""
        pending, self._pending = self._pending, []
        for work in pending:
            work.discard()
        super().close()
