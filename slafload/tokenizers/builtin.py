"""Stage 6: turn a ranked chunk into fixed-shape token arrays, in one vectorized pass.

A tokenizer is any object with a ``name`` and a ``__call__(ranked) -> dict[str, ndarray]``
whose arrays all have one row per cell of the chunk, in output order. Built-ins:

``geneformer``
    Rank-value encoding: ``[CLS] g1 g2 ... [SEP] [PAD]...`` of width ``max_genes``, genes in
    decreasing expression (ties by gene id), as many as fit.
``scgpt``
    Two aligned streams of width ``max_genes + 2``: ``input_ids = [CLS] g1..gn [SEP] [PAD]..``
    and ``values = [PAD] b1..bn [PAD]..`` where ``b`` is scGPT's per-cell quantile bin of the
    gene's expression (``1..n_bins-1``) plus ``value_offset``.
``raw``
    The cell's sparse expression for non-transformer models: ``gene_ids`` (padded with -1),
    ``values`` (float32, padded with 0) and ``lengths``, highest expression first.

Token conventions are those of slafdb 0.5.2 (PAD=0, CLS=1, SEP=2, MASK=3, gene token = gene
id + 4, scGPT value tokens offset by 50,000, geneformer truncation keeps CLS and drops SEP) so
models move between the two; the *content* follows the published methods, which slafdb 0.5.2
does not (see ``docs/tokenizers.md``). Third-party tokenizers register under the
``slafload.tokenizers`` entry-point group.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

import numpy as np

from slafload._validate import check_int
from slafload.ranges import expand
from slafload.types import RankedChunk, Tokenizer

PAD, CLS, SEP, MASK = 0, 1, 2, 3
GENE_OFFSET = 4
VALUE_OFFSET = 50_000
ENTRY_POINT_GROUP = "slafload.tokenizers"


def _check_max_genes(max_genes: int, minimum: int) -> None:
    check_int("max_genes", max_genes, low=minimum)


def _destinations(
    ranked: RankedChunk, width: int, limit: int, first_col: int
) -> tuple[np.ndarray, np.ndarray | slice]:
    """Where each entry ranked below ``limit`` goes in a C-ordered ``[n_cells, width]`` array.

    Entry ``e`` of read-order cell ``c`` (rank ``e - indptr[c]``) lands at row
    ``row_of_cell[c]``, column ``first_col + rank``. Returns flat indices and the selector of
    the entries they belong to (a ``slice`` when every entry fits, so nothing is copied).
    """
    lengths, starts = ranked.lengths, ranked.indptr[:-1]
    flat = expand(ranked.row_of_cell * width + first_col, lengths)
    over = np.flatnonzero(lengths > limit)
    if len(over) == 0:
        return flat, slice(None)
    keep = np.ones(len(flat), dtype=bool)  # few cells overflow: drop just their excess
    keep[expand(starts[over] + limit, lengths[over] - limit)] = False
    return flat[keep], keep


def _gene_tokens(ranked: RankedChunk, keep: np.ndarray | slice) -> np.ndarray:
    return np.add(ranked.genes[keep], GENE_OFFSET, dtype=np.int64)


class Geneformer:
    """Geneformer rank-value encoding with slafdb's layout (width ``max_genes``)."""

    name = "geneformer"

    def __init__(self, *, max_genes: int = 2048):
        _check_max_genes(max_genes, 2)
        self.max_genes = max_genes

    def __call__(self, ranked: RankedChunk) -> dict[str, np.ndarray]:
        """Token rows for every cell of the ranked chunk."""
        width = self.max_genes
        ids = np.zeros((ranked.n_cells, width), dtype=np.int64)
        ids[:, 0] = CLS
        flat, keep = _destinations(ranked, width, width - 1, first_col=1)
        ids.reshape(-1)[flat] = _gene_tokens(ranked, keep)
        sep = ranked.output_lengths(width - 1) + 1
        fits = np.flatnonzero(sep < width)
        ids[fits, sep[fits]] = SEP
        return {"input_ids": ids, "attention_mask": ids != PAD}


class ScGPT:
    """scGPT gene ids plus per-cell quantile-binned values, slafdb's dual-stream layout.

    Subclasses change only how values are binned, by overriding :meth:`bins`.
    """

    name = "scgpt"
    min_bins = 3

    def __init__(
        self, *, max_genes: int = 1024, n_bins: int = 51, value_offset: int = VALUE_OFFSET
    ):
        _check_max_genes(max_genes, 1)
        if not isinstance(n_bins, int) or n_bins < self.min_bins:
            raise ValueError(f"n_bins must be an integer >= {self.min_bins}, got {n_bins!r}")
        self.max_genes, self.n_bins, self.value_offset = max_genes, n_bins, value_offset

    def bins(self, ranked: RankedChunk) -> np.ndarray:
        """``int64`` bin of every entry of ``ranked`` (before ``value_offset``)."""
        return quantile_bins(ranked, self.n_bins)

    def __call__(self, ranked: RankedChunk) -> dict[str, np.ndarray]:
        """Token rows and binned values for every cell of the ranked chunk."""
        width = self.max_genes + 2
        ids = np.zeros((ranked.n_cells, width), dtype=np.int64)
        values = np.zeros((ranked.n_cells, width), dtype=np.int64)
        ids[:, 0] = CLS
        flat, keep = _destinations(ranked, width, self.max_genes, first_col=1)
        ids.reshape(-1)[flat] = _gene_tokens(ranked, keep)
        values.reshape(-1)[flat] = self.bins(ranked)[keep] + self.value_offset
        sep = ranked.output_lengths(self.max_genes) + 1
        ids[np.arange(ranked.n_cells), sep] = SEP
        return {"input_ids": ids, "attention_mask": ids != PAD, "values": values}


class Raw:
    """Each cell's sparse expression, highest first: padded gene ids, values and lengths."""

    name = "raw"

    def __init__(self, *, max_genes: int = 2048):
        _check_max_genes(max_genes, 1)
        self.max_genes = max_genes

    def __call__(self, ranked: RankedChunk) -> dict[str, np.ndarray]:
        """Gene ids and raw values of every cell, ``-1``/``0``-padded."""
        gene_ids = np.full((ranked.n_cells, self.max_genes), -1, dtype=np.int64)
        values = np.zeros((ranked.n_cells, self.max_genes), dtype=np.float32)
        flat, keep = _destinations(ranked, self.max_genes, self.max_genes, first_col=0)
        gene_ids.reshape(-1)[flat] = ranked.genes[keep]
        values.reshape(-1)[flat] = ranked.values[keep]
        return {
            "gene_ids": gene_ids,
            "values": values,
            "lengths": ranked.output_lengths(self.max_genes),
        }


def quantile_bins(ranked: RankedChunk, n_bins: int) -> np.ndarray:
    """scGPT's per-cell binning of every entry: ``np.digitize(x, np.quantile(nz, q))``.

    ``nz`` is the cell's non-zero values and ``q = linspace(0, 1, n_bins - 1)``, so bins run
    from 1 to ``n_bins - 1``. This reproduces numpy's linear quantile interpolation exactly,
    for all cells of the chunk at once, using that each cell's values are already sorted.
    (scGPT breaks ties at bin edges at random; we take numpy's left edge, deterministically.)
    Returns ``int64`` bins aligned with ``ranked.values``.
    """
    values, indptr = ranked.values, ranked.indptr
    n = ranked.lengths
    m = len(values)
    if m == 0:
        return np.zeros(0, dtype=np.int64)
    # Work on each cell's descending values d_0 >= d_1 >= ...: ascending index a is
    # descending index n-1-a, so only the (cells x bins) edge lookups need that mapping.
    start = indptr[:-1]
    cells = np.flatnonzero(n)
    count, base = n[cells][:, None], start[cells][:, None]
    q = np.linspace(0.0, 1.0, n_bins - 1)
    virtual = (count - 1) * q[None, :]
    prev = np.minimum(np.floor(virtual).astype(np.int64), count - 1)
    nxt = np.minimum(prev + 1, count - 1)
    lo_at = base + count - 1 - prev  # descending position of the ascending value [prev]
    lo, hi = values[lo_at], values[base + count - 1 - nxt]
    edges = _lerp(lo, hi, virtual - np.floor(virtual))
    # covered[j] = how many of the cell's values are >= edge j. Above `lo` the edge lies in
    # (lo, hi], so exactly the values from ascending index nxt up; at `lo` it is every value
    # down to the end of lo's run of ties.
    run_starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
    run_starts = np.union1d(run_starts, start[cells])
    after_run = np.append(run_starts, m)[np.searchsorted(run_starts, lo_at, side="right")]
    covered = np.where(edges <= lo, after_run - base, count - nxt)
    # bin of the value at descending index r = #{j : r < covered[j]} = edges - #{covered <= r}
    hits = np.bincount((base + covered).ravel(), minlength=m + 1)[:m]
    below = np.cumsum(hits) - np.repeat(
        np.arange(len(cells), dtype=np.int64) * (n_bins - 1), n[cells]
    )
    return (n_bins - 1) - below


def _lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """numpy's own quantile interpolation (``numpy.lib._function_base_impl._lerp``)."""
    diff = np.subtract(b, a)
    out = np.asarray(np.add(a, diff * t))
    np.subtract(b, diff * (1 - t), out=out, where=t >= 0.5, casting="unsafe")
    return out


_BUILTINS: dict[str, Callable[..., Tokenizer]] = {
    "geneformer": Geneformer,
    "scgpt": ScGPT,
    "raw": Raw,
}


def available_tokenizers() -> list[str]:
    """Names accepted by :func:`make_tokenizer`: built-ins and installed plugins."""
    return sorted(set(_BUILTINS) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def make_tokenizer(spec: str | Tokenizer, **options: Any) -> Tokenizer:
    """A tokenizer from a registered name (with constructor ``options``) or an instance.

    Names resolve to built-ins first, then to the ``slafload.tokenizers`` entry points.
    """
    if not isinstance(spec, str):
        if not isinstance(spec, Tokenizer):
            raise TypeError(
                f"tokenizer must be a name or a Tokenizer (an object with `name` "
                f"and `__call__(ranked)`), got {type(spec).__name__}"
            )
        return spec
    factory = _BUILTINS.get(spec)
    if factory is None:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == spec]
        if not found:
            raise ValueError(f"unknown tokenizer {spec!r}; available: {available_tokenizers()}")
        factory = found[0].load()
    return factory(**options)
