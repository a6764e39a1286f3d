"""Turn a ranked chunk into fixed-shape token arrays, in one vectorized pass.

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
``sparse``
    Each cell's expressed genes in ascending gene id with their values, every one of them
    (no ranking, no ``max_genes``): a CSR batch of ``gene_ids``, ``values`` (float32) and
    ``cu_seqlens`` offsets, in the packed layout only (scVI-style count models).

Token conventions are those of slafdb 0.5.2 (PAD=0, CLS=1, SEP=2, MASK=3, gene token = gene
id + 4, scGPT value tokens offset by 50,000, geneformer truncation keeps CLS and drops SEP) so
models move between the two; the *content* follows the published methods, which slafdb 0.5.2
does not (see ``docs/tokenizers.md``). Third-party tokenizers register under the
``slafload.tokenizers`` entry-point group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

import numpy as np
import numpy.typing as npt

from slafload._validate import check_int
from slafload.kernels import NUMPY, Kernels
from slafload.pipeline.buffers import RowBuffers, copy_aligned_runs, fresh, scratch
from slafload.tokenizers.sparse import Sparse
from slafload.types import RankedChunk, Tokenizer

PAD, CLS, SEP, MASK = 0, 1, 2, 3
GENE_OFFSET = 4
VALUE_OFFSET = 50_000
BIN_BLOCK_CELLS = 256  # cells binned at a time by quantile_bins (temporaries of ~100 KB)
ENTRY_POINT_GROUP = "slafload.tokenizers"


def _check_max_genes(max_genes: int, minimum: int) -> None:
    check_int("max_genes", max_genes, low=minimum)


def _padded(
    buffers: RowBuffers | None, name: str, ends: np.ndarray, width: int, dtype: type, pad=0,
    kernels: Kernels = NUMPY,
) -> np.ndarray:  # fmt: skip
    """``[len(ends), width]`` rows holding ``pad`` from column ``ends[i]`` on (see
    :meth:`RowBuffers.rows`): from ``buffers`` when given, else newly allocated.
    """
    if buffers is not None:
        return buffers.rows(name, ends, width, np.dtype(dtype), pad, kernels)
    return fresh((len(ends), width), dtype, pad)


def _fill_rows(
    out: np.ndarray, src: np.ndarray, ranked: RankedChunk, limit: int, first_col: int,
    *aligned: tuple[np.ndarray, np.ndarray], kernels: Kernels = NUMPY,
) -> None:  # fmt: skip
    """Each read-order cell's first ``limit`` entries of ``src`` into its output row of
    ``out`` from column ``first_col``; ``aligned`` are more ``(out, src)`` pairs of the same
    shapes, filled in the same loop (:func:`copy_cell_tokens`).
    """
    dst = np.arange(ranked.n_cells, dtype=np.int64) * out.shape[1] + first_col
    pairs = [(out.reshape(-1), src), *((o.reshape(-1), s) for o, s in aligned)]
    copy_cell_tokens(pairs, ranked, dst, limit, kernels)


def copy_cell_tokens(
    pairs: Sequence[tuple[np.ndarray, np.ndarray]], ranked: RankedChunk, dst: np.ndarray,
    limit: int, kernels: Kernels = NUMPY,
) -> None:  # fmt: skip
    """Each cell's first ``limit`` entries of every ``(out, src)`` pair (1-D, ``src``
    aligned with ``ranked.genes``) into ``out`` from ``dst[row]``, ``row`` its output row.

    One slice copy per cell and pair (:func:`~slafload.pipeline.buffers.copy_aligned_runs`), in output
    order: the sources are read in shuffled order, the large destinations front to back.
    """
    cells = ranked.order
    src, counts = ranked.indptr[cells], np.minimum(ranked.lengths[cells], limit)
    copy_aligned_runs(pairs, dst, src, counts, kernels)


def _mask(
    buffers: RowBuffers | None, ends: np.ndarray, width: int, kernels: Kernels = NUMPY
) -> np.ndarray:
    """``attention_mask``: row ``i`` is true on its first ``ends[i]`` columns (``ends`` at
    most ``width``).

    With compiled ``kernels`` and ``buffers``, only each row's true columns are written
    (``fill_runs``; the buffers' re-pad clears what a longer row left before): on 2,048-cell
    pieces of ~800 genes at width 2,048, 0.16 against 0.45 us a cell for the comparison of
    every column below.
    """
    if buffers is not None and kernels.backend != "numpy":
        mask = _padded(buffers, "attention_mask", ends, width, bool, False, kernels)
        starts = np.arange(len(ends), dtype=np.int64) * width
        if kernels.run("fill_runs", mask.reshape(-1), starts, starts + ends, True):
            return mask
    else:  # every column is written below
        mask = _padded(buffers, "attention_mask", np.full(len(ends), width), width, bool, False)
    # The smallest type holding 0..width, width included (a full row's end is width): a
    # quarter or less of int64's work.
    small = np.min_scalar_type(width)
    np.less(np.arange(width, dtype=small), ends.astype(small)[:, None], out=mask)
    return mask


def gene_tokens(ranked: RankedChunk) -> np.ndarray:
    """Gene id + ``GENE_OFFSET`` of every entry, in this thread's scratch (copy it out at once).

    In the gene ids' own unsigned type when every token fits it (``uint16`` for up to 65,531
    genes), else ``int64``: the rows it is copied into cast it on the way, and the narrow sum
    is a quarter of the memory traffic of a widening one.
    """
    genes = ranked.genes
    fits = (
        genes.dtype.kind == "u"
        and len(genes) > 0
        and int(genes.max()) + GENE_OFFSET <= np.iinfo(genes.dtype).max
    )
    dtype = genes.dtype if fits else np.dtype(np.int64)
    out = scratch("gene_tokens", len(genes), dtype)
    return np.add(genes, GENE_OFFSET, out=out, dtype=dtype, casting="unsafe")


class Geneformer:
    """Geneformer rank-value encoding with slafdb's layout (width ``max_genes``)."""

    name = "geneformer"

    def __init__(self, *, max_genes: int = 2048):
        _check_max_genes(max_genes, 2)
        self.max_genes = max_genes

    def __call__(
        self, ranked: RankedChunk, *, buffers: RowBuffers | None = None, kernels: Kernels = NUMPY
    ) -> dict[str, np.ndarray]:
        """Token rows of ``ranked``; ``buffers`` lends the arrays (see :mod:`slafload.pipeline.buffers`),
        ``kernels`` may copy the tokens (:mod:`slafload.kernels`).
        """
        width = self.max_genes
        sep = ranked.output_lengths(width - 1) + 1  # column of SEP, where it fits
        fits = np.flatnonzero(sep < width)
        ends = np.minimum(sep + 1, width)
        ids = _padded(buffers, "input_ids", ends, width, np.int64, PAD, kernels)
        ids[:, 0] = CLS
        _fill_rows(ids, gene_tokens(ranked), ranked, width - 1, first_col=1, kernels=kernels)
        ids[fits, sep[fits]] = SEP
        return {"input_ids": ids, "attention_mask": _mask(buffers, ends, width, kernels)}


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

    def value_tokens(self, ranked: RankedChunk, kernels: Kernels = NUMPY) -> np.ndarray:
        """``bins(ranked) + value_offset``, in one pass when the bins are the built-in ones
        (then in the narrowest integer type that holds every token, in this thread's scratch:
        copy them out at once; binned through ``kernels``).
        """
        if type(self).bins is ScGPT.bins:
            top = self.n_bins - 1 + self.value_offset
            dtype = np.min_scalar_type(top) if self.value_offset >= 0 else np.int64
            out = scratch("value_tokens", len(ranked.values), dtype)
            return quantile_bins(ranked, self.n_bins, self.value_offset, dtype, out, kernels)
        return np.add(self.bins(ranked), self.value_offset, dtype=np.int64)

    def __call__(
        self, ranked: RankedChunk, *, buffers: RowBuffers | None = None, kernels: Kernels = NUMPY
    ) -> dict[str, np.ndarray]:
        """Token rows of ``ranked``; ``buffers`` lends the arrays (see :mod:`slafload.pipeline.buffers`),
        ``kernels`` may bin and copy the tokens (:mod:`slafload.kernels`).
        """
        width, limit = self.max_genes + 2, self.max_genes
        sep = ranked.output_lengths(limit) + 1  # SEP always fits
        ids = _padded(buffers, "input_ids", sep + 1, width, np.int64, PAD, kernels)
        values = _padded(buffers, "values", sep, width, np.int64, PAD, kernels)
        ids[:, 0], values[:, 0] = CLS, PAD
        tokens = gene_tokens(ranked)
        value_tokens = scgpt_value_tokens(self, ranked, kernels)
        _fill_rows(ids, tokens, ranked, limit, 1, (values, value_tokens), kernels=kernels)
        ids[np.arange(ranked.n_cells), sep] = SEP
        return {"input_ids": ids, "attention_mask": _mask(buffers, sep + 1, width, kernels),
                "values": values}  # fmt: skip


def scgpt_value_tokens(tok: ScGPT, ranked: RankedChunk, kernels: Kernels) -> np.ndarray:
    """``tok.value_tokens(ranked)``, through ``kernels`` unless a subclass overrides it (with
    the signature it had before kernels existed).
    """
    if type(tok).value_tokens is ScGPT.value_tokens:
        return tok.value_tokens(ranked, kernels)
    return tok.value_tokens(ranked)


class Raw:
    """Each cell's sparse expression, highest first: padded gene ids, values and lengths."""

    name = "raw"

    def __init__(self, *, max_genes: int = 2048):
        _check_max_genes(max_genes, 1)
        self.max_genes = max_genes

    def __call__(
        self, ranked: RankedChunk, *, buffers: RowBuffers | None = None, kernels: Kernels = NUMPY
    ) -> dict[str, np.ndarray]:
        """Padded rows of ``ranked``; ``buffers`` lends the arrays (see :mod:`slafload.pipeline.buffers`),
        ``kernels`` may copy them (:mod:`slafload.kernels`).
        """
        width = self.max_genes
        lengths = ranked.output_lengths(width)
        gene_ids = _padded(buffers, "gene_ids", lengths, width, np.int64, -1, kernels)
        values = _padded(buffers, "values", lengths, width, np.float32, 0, kernels)
        _fill_rows(gene_ids, ranked.genes, ranked, width, 0, (values, ranked.values),
                   kernels=kernels)  # fmt: skip
        return {"gene_ids": gene_ids, "values": values, "lengths": lengths}


def quantile_bins(
    ranked: RankedChunk, n_bins: int, offset: int = 0, dtype: npt.DTypeLike = np.int64,
    out: np.ndarray | None = None, kernels: Kernels = NUMPY,
) -> np.ndarray:  # fmt: skip
    """scGPT's per-cell binning of every entry: ``np.digitize(x, np.quantile(nz, q))``.

    ``nz`` is the cell's non-zero values and ``q = linspace(0, 1, n_bins - 1)``, so bins run
    from 1 to ``n_bins - 1``. This reproduces numpy's linear quantile interpolation exactly,
    for all cells of the chunk at once, using that each cell's values are already sorted.
    (scGPT breaks ties at bin edges at random; we take numpy's left edge, deterministically.)
    Returns bins aligned with ``ranked.values``, plus ``offset``, as ``dtype`` (which must
    hold ``offset .. offset + n_bins - 1``).

    Only the ``cells x (n_bins - 1)`` edges are computed and located; the entries are touched
    by one comparison pass (where ties sit) and by the final ``np.repeat`` of each cell's runs
    of equal bins. Cells are binned :data:`BIN_BLOCK_CELLS` at a time, so every temporary
    stays small enough to be reused from the allocator's free lists (in the loader, the
    chunk-wide temporaries were returned to the kernel and faulted in again on every piece)
    and to stay in cache; ``out``, when given, receives the bins (``m`` entries of ``dtype``).
    Compiled ``kernels`` bin every cell in one call instead, with the GIL released.
    """
    values, indptr = ranked.values, ranked.indptr
    out = np.empty(len(values), dtype=dtype) if out is None else out
    compiled = kernels.backend != "numpy" and len(indptr) > 0
    in_bounds = compiled and indptr[0] >= 0 and indptr[-1] <= min(len(values), len(out))
    if in_bounds and kernels.run("quantile_bins", values, indptr, n_bins, offset, out):
        return out  # (the kernel checks no bounds: out of them, numpy's slicing raises below)
    n_cells = len(indptr) - 1
    for first in range(0, n_cells, BIN_BLOCK_CELLS):
        last = min(first + BIN_BLOCK_CELLS, n_cells)
        lo, hi = int(indptr[first]), int(indptr[last])
        if hi > lo:
            out[lo:hi] = _block_bins(values[lo:hi], indptr[first : last + 1] - lo, n_bins,
                                     offset, dtype)  # fmt: skip
    return out


def _block_bins(
    values: np.ndarray, indptr: np.ndarray, n_bins: int, offset: int, dtype: npt.DTypeLike
) -> np.ndarray:
    """:func:`quantile_bins` of the cells ``indptr`` delimits in ``values`` (rank order)."""
    n = np.diff(indptr)
    m = len(values)
    # Work on each cell's descending values d_0 >= d_1 >= ...: ascending index a is
    # descending index n-1-a, so only the (cells x bins) edge lookups need that mapping.
    start = indptr[:-1]
    cells = np.flatnonzero(n)
    count, base = n[cells][:, None], start[cells][:, None]
    q = np.linspace(0.0, 1.0, n_bins - 1)
    virtual = (count - 1) * q[None, :]
    floor = np.floor(virtual)
    prev = np.minimum(floor.astype(np.int64), count - 1)
    nxt = np.minimum(prev + 1, count - 1)
    lo_at = base + count - 1 - prev  # descending position of the ascending value [prev]
    lo, hi = values[lo_at], values[base + count - 1 - nxt]
    edges = _lerp(lo, hi, virtual - floor)
    # covered[j] = how many of the cell's values are >= edge j. Above `lo` the edge lies in
    # (lo, hi], so exactly the values from ascending index nxt up; at `lo` it is every value
    # down to the end of lo's run of ties.
    covered = count - nxt
    ties = (edges <= lo)[:, ::-1]  # reversed: the positions then ascend through the chunk
    if ties.any():
        run_start = np.empty(m, dtype=bool)
        run_start[0] = True
        np.not_equal(values[1:], values[:-1], out=run_start[1:])
        run_start[start[cells]] = True
        run_starts = np.flatnonzero(run_start)
        at = lo_at[:, ::-1][ties]
        after_run = np.append(run_starts, m)[np.searchsorted(run_starts, at, side="right")]
        covered[:, ::-1][ties] = after_run - np.broadcast_to(base, ties.shape)[ties]
    # bin of the value at descending index r = #{j : r < covered[j]}: with covered sorted
    # descending, runs of bins n_bins - 1, ..., 1, 0 ending at covered[-1], ..., covered[0], n.
    covered = -np.sort(-covered, axis=1)
    bounds = np.concatenate([np.zeros_like(count), covered[:, ::-1], count], axis=1)
    runs = np.diff(bounds, axis=1)
    bins = np.arange(n_bins - 1 + offset, offset - 1, -1, dtype=np.int64).astype(dtype)
    return np.repeat(np.broadcast_to(bins, runs.shape).ravel(), runs.ravel())


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
    "sparse": Sparse,
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
    return _factory(spec)(**options)


def _factory(name: str) -> Callable[..., Tokenizer]:
    factory = _BUILTINS.get(name)
    if factory is None:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            raise ValueError(f"unknown tokenizer {name!r}; available: {available_tokenizers()}")
        factory = found[0].load()
    return factory


def token_budget(tokenizer: object, max_genes: int) -> dict[str, Any]:
    """The sequence budget a front end passes to a named or given ``tokenizer`` when its user
    set none: ``{"max_genes": max_genes}``, or nothing for a tokenizer whose class says it
    keeps every gene (``takes_max_genes = False``, as ``sparse``). A name that is no tokenizer
    (a preset's) gets the budget; :func:`make_tokenizer` reports unknown names.
    """
    kind: object = tokenizer
    if isinstance(tokenizer, str):
        try:
            kind = _factory(tokenizer)
        except ValueError:
            return {"max_genes": max_genes}
    return {"max_genes": max_genes} if getattr(kind, "takes_max_genes", True) else {}
