"""scGPT preset: the inputs of scGPT's fine-tuning pipeline, from the model's ``vocab.json``.

What scGPT's tutorials do (``scgpt/preprocess.py`` ``Preprocessor``, then
``scgpt/tokenizer/gene_tokenizer.py`` ``tokenize_and_pad_batch``), and where it happens here:

1. Keep the genes whose name is in ``vocab.json`` -> a :class:`~slafload.transforms.vocab.GeneRemap`
   transform that drops the others (dataset gene ids are kept for ordering).
2. ``normalize_total(target_sum=1e4)`` and ``log1p``, in ``float32`` as scanpy computes them on
   counts -> :class:`ScGPTTokens`, from the ranked chunk (both are monotone, so each cell's
   values stay sorted).
3. Per cell, bin the non-zero values: ``edges = np.quantile(nz, linspace(0, 1, n_bins - 1))``,
   ``left = digitize(x, edges)``, ``right = digitize(x, edges, right=True)`` and
   ``bin = ceil(u * (right - left) + left)`` with ``u`` uniform: values sitting on repeated
   edges are spread at random over the bins those edges span (scGPT's ``_digitize``).
4. Genes in the dataset's gene order, non-zero only (or all vocabulary genes with
   ``include_zero_gene``), ``<cls>`` first with value 0; a cell longer than ``max_len`` keeps
   ``<cls>`` and a random ordered sample of ``max_len - 1`` genes (``np.random.choice``
   without replacement); padding with ``<pad>`` and ``pad_value``.

Every random draw ``u`` is :func:`~slafload.presets.uniforms` of ``(seed, epoch, stream,
cell_integer_id, gene_integer_id)``: stream :data:`TIES` for step 3, :data:`SUBSAMPLE` for
step 4 (a cell's sample is its ``max_len - 1`` genes with the smallest draws, in draw order;
draws are compared on their top 40 bits).
The reference draws from numpy's global RNG instead, so identical *inputs* to the reference
are the same draws: ``tests/presets/test_presets.py`` feeds them to it and gets identical tokens.

Outputs: ``input_ids`` (scGPT's ``gene_ids``), ``values`` (``float32`` bins),
``attention_mask`` (True on real tokens; scGPT's ``src_key_padding_mask`` is its negation) and
``length``. Width is always ``max_len``; scGPT pads each batch only to its longest cell, so its
arrays are a prefix of these.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from slafload.data.dataset import SlafDataset
from slafload.data.value_kind import warn_unless_counts
from slafload.errors import VocabularyError
from slafload.presets.base import (
    DEFAULT_SAMPLE_CELLS,
    DEFAULT_WARN_BELOW,
    Preset,
    gene_names,
    load_dictionary,
    measure_coverage,
    uniforms,
)
from slafload.tokenizers.builtin import _lerp
from slafload.transforms.vocab import GeneRemap
from slafload.types import RankedChunk

TIES, SUBSAMPLE = 0, 1
_DENSE_BLOCK = 1 << 22  # cells x genes per block of the include_zero_gene layout
_DRAW_SCALE = 1 << 40  # sort keys: above any gene id, 2**23 cells per chunk still fit int64


def _read_json(path: Any) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


class ScGPTTokens:
    """scGPT's binned values and gene ids, on a chunk ranked by expression.

    Args:
        token_of_gene: ``int64[n_genes]`` vocabulary id of each dataset gene (``-1``: none;
            such genes must be removed before ranking).
        max_len: Width, ``<cls>`` included (scGPT's ``max_seq_len``).
        n_bins: scGPT's ``n_bins`` (bins ``1..n_bins-1`` for non-zeros, 0 for zeros).
        pad_id, cls_id: Vocabulary ids of ``<pad>`` and ``<cls>``.
        pad_value: Value at padding (-2 in the continuous/binned style, ``n_bins`` in the
            category style).
        append_cls, include_zero_gene: As in ``tokenize_and_pad_batch``.
        normalize_total, log1p: The ``Preprocessor`` steps before binning (``None``/``False``
            bins the stored values as they are).
        seed, epoch: Key of every random draw; :meth:`for_epoch` rebinds the epoch.
    """

    name = "scgpt-reference"

    def __init__(
        self,
        *,
        token_of_gene: np.ndarray,
        max_len: int,
        n_bins: int,
        pad_id: int,
        cls_id: int,
        pad_value: float = -2,
        append_cls: bool = True,
        include_zero_gene: bool = False,
        normalize_total: float | None = 1e4,
        log1p: bool = True,
        seed: int = 0,
        epoch: int = 0,
    ):
        minimum = 2 if append_cls else 1
        if not isinstance(max_len, int) or max_len < minimum:
            raise ValueError(f"max_len must be an integer >= {minimum}, got {max_len!r}")
        if not isinstance(n_bins, int) or n_bins < 3:
            raise ValueError(f"n_bins must be an integer >= 3, got {n_bins!r}")
        if normalize_total is not None and not normalize_total > 0:
            raise ValueError(f"normalize_total must be positive or None, got {normalize_total!r}")
        self.token_of_gene = np.asarray(token_of_gene, dtype=np.int64)
        self.max_len, self.n_bins = max_len, n_bins
        self.pad_id, self.cls_id, self.pad_value = int(pad_id), int(cls_id), float(pad_value)
        self.append_cls, self.include_zero_gene = append_cls, include_zero_gene
        # A Python float, so float32 arithmetic stays float32 as in scanpy (NEP 50).
        self.normalize_total = None if normalize_total is None else float(normalize_total)
        self.log1p, self.seed, self.epoch = log1p, int(seed), int(epoch)

    def for_epoch(self, epoch: int) -> ScGPTTokens:
        """This tokenizer drawing the random numbers of ``epoch``."""
        bound = object.__new__(ScGPTTokens)
        bound.__dict__.update(self.__dict__, epoch=int(epoch))
        return bound

    # -- the steps, each vectorized over the chunk ---------------------------------------

    def preprocessed(self, ranked: RankedChunk) -> tuple[np.ndarray, np.ndarray]:
        """(values after normalize_total/log1p, genes), still sorted descending per cell."""
        x, genes = ranked.values, ranked.genes
        if self.normalize_total is None and not self.log1p:
            return x, genes
        x = x.astype(np.float32)
        cell = ranked.entry_cell
        if self.normalize_total is not None:
            totals = np.bincount(cell, weights=ranked.values.astype(np.float64))
            size = totals.astype(np.float32) / self.normalize_total
            x = x / size[cell]
        if self.log1p:
            x = np.log1p(x)
        # Rounding is monotone, so order holds; re-sort if a platform's log1p disagrees.
        if len(x) > 1 and ((x[1:] > x[:-1]) & (cell[1:] == cell[:-1])).any():
            order = np.lexsort((-x, cell))
            x, genes = x[order], genes[order]
        return x, genes

    def bins(self, ranked: RankedChunk) -> tuple[np.ndarray, np.ndarray]:
        """(bin of every entry, its gene): scGPT's per-cell quantile bins, ties spread."""
        x, genes = self.preprocessed(ranked)
        if not len(x):
            return np.zeros(0, dtype=np.int64), genes
        edges = quantile_edges(x, ranked.indptr, self.n_bins - 1)
        left = digitize_sorted(x, ranked.indptr, edges, right=False)
        right = digitize_sorted(x, ranked.indptr, edges, right=True)
        u = uniforms(self.seed, self.epoch, TIES, ranked.cell_ids[ranked.entry_cell], genes)
        return np.ceil(u * (right - left) + left).astype(np.int64), genes

    def __call__(self, ranked: RankedChunk) -> dict[str, np.ndarray]:
        """Token rows and binned values in the model's layout for every cell."""
        bins, genes = self.bins(ranked)
        first = int(self.append_cls)
        ids = np.full((ranked.n_cells, self.max_len), self.pad_id, dtype=np.int64)
        values = np.full(ids.shape, self.pad_value, dtype=np.float32)
        if self.include_zero_gene:
            lengths = self._dense(ranked, bins, genes, ids, values, first)
        else:
            lengths = self._sparse(ranked, bins, genes, ids, values, first)
        if self.append_cls:
            ids[:, 0], values[:, 0] = self.cls_id, 0
        lengths = lengths + first
        mask = np.arange(self.max_len)[None, :] < lengths[:, None]
        return {"input_ids": ids, "values": values, "attention_mask": mask, "length": lengths}

    def _sparse(self, ranked, bins, genes, ids, values, first) -> np.ndarray:
        """Non-zero genes in gene order; long cells: a random ordered sample."""
        limit = self.max_len - first
        cell = ranked.entry_cell
        long_entry = (ranked.lengths > limit)[cell]
        # One int64 key per entry: cell, then gene id, or for long cells the subsampling
        # draw's top 40 bits (draw order; equal prefixes keep rank order, deterministically).
        within = genes.astype(np.int64)
        if long_entry.any():
            ids_of = ranked.cell_ids[cell[long_entry]]
            draws = uniforms(self.seed, self.epoch, SUBSAMPLE, ids_of, genes[long_entry])
            within[long_entry] = (draws * _DRAW_SCALE).astype(np.int64)
        order = np.argsort(cell * _DRAW_SCALE + within, kind="stable")  # CSR extents kept
        kept = np.flatnonzero(ranked.entry_rank < limit)
        src = order[kept]
        rows, cols = ranked.entry_row[kept], first + ranked.entry_rank[kept]
        ids[rows, cols] = self.token_of_gene[genes[src]]
        values[rows, cols] = bins[src]
        return ranked.output_lengths(limit)

    def _dense(self, ranked, bins, genes, ids, values, first) -> np.ndarray:
        """Every vocabulary gene of the dataset, zeros included; long rows sampled."""
        vocab_genes = np.flatnonzero(self.token_of_gene >= 0)
        n_vocab = len(vocab_genes)
        column = np.full(len(self.token_of_gene), -1, dtype=np.int64)
        column[vocab_genes] = np.arange(n_vocab)
        limit = min(self.max_len - first, n_vocab)
        block = max(1, _DENSE_BLOCK // max(n_vocab, 1))
        indptr = ranked.indptr
        for a in range(0, ranked.n_cells, block):
            b = min(a + block, ranked.n_cells)
            dense = np.zeros((b - a, n_vocab), dtype=np.float32)
            lo, hi = indptr[a], indptr[b]
            dense[ranked.entry_cell[lo:hi] - a, column[genes[lo:hi]]] = bins[lo:hi]
            if limit < n_vocab:
                draws = uniforms(
                    self.seed,
                    self.epoch,
                    SUBSAMPLE,
                    ranked.cell_ids[a:b, None],
                    vocab_genes[None, :],
                )
                pick = np.argpartition(draws, limit - 1, axis=1)[:, :limit]
                pick = np.take_along_axis(
                    pick, np.argsort(np.take_along_axis(draws, pick, 1), axis=1), 1
                )
            else:
                pick = np.broadcast_to(np.arange(n_vocab), (b - a, n_vocab))
            rows = ranked.row_of_cell[a:b]
            ids[rows, first : first + limit] = self.token_of_gene[vocab_genes[pick]]
            values[rows, first : first + limit] = np.take_along_axis(dense, pick, 1)
        return np.full(ranked.n_cells, limit, dtype=np.int64)


def quantile_edges(x: np.ndarray, indptr: np.ndarray, n_edges: int) -> np.ndarray:
    """``np.quantile(cell, linspace(0, 1, n_edges))`` of every non-empty cell, ``[k, n_edges]``.

    ``x`` holds each cell's values sorted descending (a ranked chunk's layout). Mirrors
    numpy's linear method step for step (virtual index ``(n - 1) * q``, neighbours, its
    ``_lerp``), so the ``float64`` edges are bit-identical to ``np.quantile``'s.
    """
    n = np.diff(indptr)
    cells = np.flatnonzero(n)
    count, base = n[cells][:, None], indptr[:-1][cells][:, None]
    virtual = (count - 1) * np.linspace(0.0, 1.0, n_edges)[None, :]
    floor = np.floor(virtual)
    above = virtual >= count - 1
    prev = np.where(above, count - 1, floor.astype(np.int64))
    nxt = np.where(above, count - 1, prev + 1)
    # Ascending index a of a cell is descending index n - 1 - a.
    lo, hi = x[base + count - 1 - prev], x[base + count - 1 - nxt]
    return _lerp(lo, hi, virtual - floor).astype(np.float64, copy=False)


def digitize_sorted(
    x: np.ndarray, indptr: np.ndarray, edges: np.ndarray, *, right: bool
) -> np.ndarray:
    """``np.digitize(x, cell_edges, right=right)`` for every entry, all cells at once.

    ``x``: each cell's values sorted descending; ``edges``: :func:`quantile_edges` of them.
    Instead of searching each value among its cell's edges, each edge is searched among its
    cell's sorted values (``k * n_edges`` binary searches instead of one per entry): edge ``j``
    covers the prefix of values ``>= e_j`` (``> e_j`` when ``right``), and a value's bin is
    the number of edges whose prefix holds it, counted with one ``bincount`` and ``cumsum``.
    """
    n = np.diff(indptr)
    cells = np.flatnonzero(n)
    k, n_edges = edges.shape
    count, base = n[cells][:, None], indptr[:-1][cells][:, None]
    # covered[c, j]: length of the prefix of cell c's values x >= e (x > e when right)
    lo = np.zeros(edges.shape, dtype=np.int64)
    hi = np.broadcast_to(count, edges.shape).copy()
    for _ in range(int(count.max(initial=0)).bit_length()):
        active = lo < hi
        mid = (lo + hi) >> 1
        value = x[base + np.minimum(mid, count - 1)]
        inside = (value > edges) if right else (value >= edges)
        lo = np.where(active & inside, mid + 1, lo)
        hi = np.where(active & ~inside, mid, hi)
    m = len(x)
    hits = np.bincount((base + lo).ravel(), minlength=m + 1)[:m]
    below = np.cumsum(hits) - np.repeat(np.arange(k, dtype=np.int64) * n_edges, n[cells])
    return n_edges - below


def scgpt(
    dataset: SlafDataset,
    *,
    vocab: str | os.PathLike[str] | dict,
    gene_column: str = "gene_id",
    max_len: int = 3001,
    n_bins: int = 51,
    pad_token: str = "<pad>",
    cls_token: str = "<cls>",
    pad_value: float = -2,
    append_cls: bool = True,
    include_zero_gene: bool = False,
    normalize_total: float | None = 1e4,
    log1p: bool = True,
    seed: int = 0,
    sample_cells: int = DEFAULT_SAMPLE_CELLS,
    warn_below: float = DEFAULT_WARN_BELOW,
) -> Preset:
    """The scGPT preset, with the settings of scGPT's fine-tuning tutorials as defaults.

    Args:
        dataset: The dataset to load.
        vocab: The model's ``vocab.json`` (gene name -> id, specials included) or that dict.
        gene_column: ``genes.lance`` column with the names the vocabulary uses (scGPT's
            whole-human vocabulary uses HGNC symbols), matched exactly.
        max_len: ``max_seq_len`` (tutorials: 3001; pretraining used 1200), ``<cls>`` included.
        n_bins: As in scGPT.
        pad_token: As in scGPT.
        cls_token: As in scGPT.
        pad_value: As in scGPT (``pad_value=n_bins`` for the category style).
        append_cls: As in scGPT.
        include_zero_gene: As in scGPT.
        normalize_total: As in scGPT.
        log1p: As in scGPT.
        seed: Key of the random tie spreading and subsampling (the loader passes its seed).
        sample_cells: Cells sampled to estimate the vocabulary's coverage.
        warn_below: Coverage below which a warning is logged.
    """
    token_index = load_dictionary(vocab, "vocab", _read_json)
    missing = [t for t in (pad_token, cls_token) if t not in token_index]
    if missing:
        raise VocabularyError(
            f"the vocabulary has no {missing}; pass pad_token=/cls_token= as the model names them"
        )
    if normalize_total is not None or log1p:
        warn_unless_counts(
            dataset, "preset 'scgpt-reference' (normalize_total + log1p)",
            "pass normalize_total=None, log1p=False if they are normalised and log-transformed "
            "already, or convert the raw counts (slafload convert --raw or --layer NAME)",
        )  # fmt: skip
    names = gene_names(dataset, gene_column)
    token_of_gene = np.array([token_index.get(g, -1) for g in names], dtype=np.int64)
    known = token_of_gene >= 0
    remap = GeneRemap(np.where(known, np.arange(len(names)), -1))
    tokenizer = ScGPTTokens(
        token_of_gene=token_of_gene,
        max_len=max_len,
        n_bins=n_bins,
        pad_id=token_index[pad_token],
        cls_id=token_index[cls_token],
        pad_value=pad_value,
        append_cls=append_cls,
        include_zero_gene=include_zero_gene,
        normalize_total=normalize_total,
        log1p=log1p,
        seed=seed,
    )
    coverage = measure_coverage(
        dataset,
        known,
        column=gene_column,
        model="scgpt-reference",
        sample_cells=sample_cells,
        warn_below=warn_below,
    )
    return Preset("scgpt-reference", tokenizer, (remap,), coverage)
