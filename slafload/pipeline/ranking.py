"""Rank each cell's genes by expression: the token stage's first step
(:mod:`slafload.pipeline.tokenize`).

(Gene *ranking*; the partition of epochs among distributed ranks is :mod:`slafload.pipeline.partition`.)

Within every cell the expressed genes (value > 0) are ordered by value, highest first, ties
broken by gene id ascending. Integer counts are ranked by a compiled counting sort of the
whole piece with the GIL released where numba is installed (:func:`rank_counts`, about half
the CPU of the radix sort below on counts). Otherwise, and until that kernel is compiled,
when a gene id and its value pack into one 32- or 64-bit integer key (integer counts,
``float32`` values), each cell's keys are sorted: by a compiled radix sort of the whole
piece, else by numpy's SIMD sort one cell at a time (:func:`rank_by_keys`: either about a
third of the CPU time of the Polars window, measured). Otherwise the whole chunk is ranked in
one Polars window expression (``struct(gene, value).sort_by(value).over(cell)``) running in
Rust with the GIL released.
The result keeps the chunk's CSR layout, so a cell's ranked genes are contiguous and the
``j``-th of them has rank ``j``. A tokenizer that reads no rank (``ranks_genes = False``: the
``sparse`` one) gets :func:`in_gene_order` instead: the expressed genes as the chunk holds
them, ascending, with no sort.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import polars as pl

from slafload._lance._compat import BackgroundQuery, collect_in_background
from slafload.kernels import NUMPY, Kernels
from slafload.pipeline.buffers import scratch
from slafload.types import Chunk, RankedChunk


def rank(chunk: Chunk, kernels: Kernels = NUMPY) -> RankedChunk:
    """Rank the genes of every cell of ``chunk`` (value descending, gene id ascending);
    ``kernels`` sort the keys of :func:`rank_by_keys` where they are compiled.
    """
    return start_rank(chunk, kernels).result()


class PendingRank:
    """A ranking, done or running on Polars' own thread pool; :meth:`result` waits for it.

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


def start_rank(chunk: Chunk, kernels: Kernels = NUMPY) -> PendingRank:
    """Start ranking ``chunk`` (see :class:`PendingRank`).

    Genes and values that pack into one integer sort key of at most 64 bits (integer counts,
    ``float32`` values: every SLAF converter's types) are ranked at once with a sort of each
    cell's keys (:func:`rank_by_keys`); anything else (``float64`` values after a
    normalising transform) on Polars' threads, in the background.
    """
    indptr, genes, values = expressed(chunk)
    if not len(genes):
        return PendingRank(chunk, indptr, genes, values, None)
    by_keys = rank_counts(indptr, genes, values, kernels)
    if by_keys is None:
        by_keys = rank_by_keys(indptr, genes, values, kernels)
    if by_keys is not None:
        return PendingRank(chunk, indptr, *by_keys, None)
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


def in_gene_order(chunk: Chunk) -> RankedChunk:
    """The expressed genes of every cell of ``chunk`` as they are, gene ids ascending, for a
    tokenizer that reads no rank (``ranks_genes = False``, e.g.
    :class:`~slafload.tokenizers.sparse.Sparse`): no sort, the chunk's arrays kept when
    every entry is expressed.
    """
    indptr, genes, values = expressed(chunk)
    return RankedChunk(chunk.fetch_index, chunk.cell_ids, indptr, genes, values, chunk.order)


def expressed(chunk: Chunk) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(indptr, genes, values)`` of ``chunk``'s expressed entries (value > 0), in order."""
    genes, values, indptr = chunk.genes, chunk.values, chunk.indptr
    kept = values > 0
    if not kept.all():
        genes, values = genes[kept], values[kept]
        indptr = np.concatenate([[0], np.cumsum(kept, dtype=np.int64)])[indptr]
    return indptr, genes, values


def rank_counts(
    indptr: np.ndarray, genes: np.ndarray, values: np.ndarray, kernels: Kernels = NUMPY
) -> tuple[np.ndarray, np.ndarray] | None:
    """Each cell's ``(genes, values)`` in rank order for integer ``values`` (counts), by the
    compiled ``rank_counts`` kernel: no keys, one stable counting pass a cell over 256
    buckets, one for each value from the cell's lowest to 254 above it, its few values higher
    still radix-sorted after (about half the CPU of :func:`rank_by_keys`' radix sort on counts, measured).

    Returns ``None`` where it does not run: values that are not integers within ``int64``,
    ``kernels`` not compiled (yet), or a cell whose genes do not strictly ascend (a chunk
    holds them ascending); :func:`rank_by_keys` gives the same result then. ``values`` must
    all be positive.
    """
    if not _counts(values) or kernels.backend == "numpy":
        return None
    ranked_genes, ranked = np.empty_like(genes), np.empty_like(values)
    count = scratch("rank_counts", 4 * 256, np.int64).reshape(4, 256)
    longest = int(np.diff(indptr).max()) if len(indptr) > 1 else 0
    bucket = scratch("rank_buckets", longest, np.uint8)
    spare = (
        scratch("rank_genes", longest, genes.dtype),
        scratch("rank_values", longest, values.dtype),
    )
    unordered = np.zeros(1, np.int64)
    args = (genes, values, indptr, ranked_genes, ranked, count, bucket, *spare, unordered)
    if not kernels.run("rank_counts", *args) or unordered[0]:
        return None  # not compiled yet, or genes out of order in a cell (never in a chunk)
    return ranked_genes, ranked


def rank_by_keys(
    indptr: np.ndarray, genes: np.ndarray, values: np.ndarray, kernels: Kernels = NUMPY
) -> tuple[np.ndarray, np.ndarray] | None:
    """Each cell's ``(genes, values)`` in rank order, by sorting one integer key per entry.

    The key of an entry is ``(top - value) << gene_bits | gene``: ascending keys are values
    descending, ties by gene id ascending (a cell's genes are distinct, so keys never tie).
    Positive ``float`` values order as their bit patterns do. Each cell's keys are sorted in
    place and decoded back: with compiled ``kernels``, every cell's in one call that releases
    the GIL (``sort_runs``: radix passes over the value's bytes alone where a cell's genes
    ascend, as a chunk holds them); else by numpy's SIMD sort, one call a cell, each taking
    the GIL back from the producer thread. Integer counts always take numpy's sort here: their
    compiled ranking is :func:`rank_counts`, and this is its stand-in until it is loaded.

    Returns ``None`` when the key would need more than 64 bits (``float64`` values, very
    wide integers); the caller then ranks another way. ``values`` must all be positive.
    """
    value_bits, as_int = _value_key(values)
    gene_bits = _bits(genes)
    if value_bits is None or gene_bits is None or value_bits + gene_bits > 64:
        return None
    key_type = np.uint32 if value_bits + gene_bits <= 32 else np.uint64
    top = (1 << value_bits) - 1
    keys = np.subtract(top, as_int, out=scratch("rank_keys", len(genes), key_type),
                       dtype=key_type, casting="unsafe")  # fmt: skip
    keys <<= gene_bits
    np.bitwise_or(keys, genes, out=keys, dtype=key_type, casting="unsafe")
    longest = int(np.diff(indptr).max()) if len(indptr) > 1 else 0
    spare = scratch("rank_spare", longest, key_type)
    low = key_type((1 << gene_bits) - 1)  # the gene: ascending in a chunk's cells
    # Counts are compiled as rank_counts: until that is loaded, numpy (no sort_runs compile).
    radix = not _counts(values)
    if not (radix and kernels.run("sort_runs", keys, indptr, spare, low, gene_bits // 8)):
        for start, stop in pairwise(indptr.tolist()):
            if stop - start > 1:
                keys[start:stop].sort()
    if genes.dtype.kind == "u" and genes.dtype.itemsize * 8 == gene_bits:
        ranked_genes = keys.astype(genes.dtype)  # the low bits are the gene
    else:
        ranked_genes = (keys & ((1 << gene_bits) - 1)).astype(genes.dtype)
    keys >>= gene_bits
    ranked = np.subtract(top, keys, dtype=as_int.dtype, casting="unsafe")
    return ranked_genes, ranked.view(values.dtype) if values.dtype.kind == "f" else ranked


def _counts(values: np.ndarray) -> bool:
    """Whether ``values`` are integers that :func:`rank_counts` ranks (within ``int64``)."""
    return values.dtype.kind in "iu" and values.dtype != np.uint64


def _bits(ints: np.ndarray) -> int | None:
    """Bits of the largest of ``ints``; ``None`` unless they are non-negative integers."""
    if ints.dtype.kind not in "iu" or (ints.dtype.kind == "i" and int(ints.min()) < 0):
        return None
    if ints.dtype.kind == "u" and ints.dtype.itemsize <= 2:
        return ints.dtype.itemsize * 8
    return max(int(ints.max()).bit_length(), 1)


def _value_key(values: np.ndarray) -> tuple[int | None, np.ndarray]:
    """Bits of the order-preserving integer form of positive ``values``, and that form."""
    if values.dtype.kind == "f":
        if values.dtype.itemsize > 4:
            return None, values
        as_int = values.view(np.uint32 if values.dtype.itemsize == 4 else np.uint16)
        return values.dtype.itemsize * 8, as_int
    return _bits(values), values
