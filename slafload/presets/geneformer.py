"""Geneformer presets: the tokens of Geneformer's ``TranscriptomeTokenizer``, from its own files.

What ``TranscriptomeTokenizer`` (``geneformer/tokenizer.py``) does, and where it happens here:

1. Map each dataset gene's id (``var["ensembl_id"]``, upper-cased) through the Ensembl mapping
   dictionary (kept to entries whose target has a token); genes without a mapping are dropped.
   Genes mapped to the same Ensembl id have their counts summed.
   -> :class:`GeneformerNormalize` (chunk transform), with a gene -> token lookup built once.
2. ``value = count / n_counts * 10_000 / median[gene]`` with ``n_counts`` the obs column (here:
   ``cells.lance`` ``n_counts`` when present, else each cell's total over *all* its genes,
   before dropping) -> the same transform, with the arithmetic of the ``.h5ad`` path
   (``tokenize_anndata``) bit for bit: scipy evaluates the divisions on a sparse matrix as
   multiplications by reciprocals, in ``float32`` for ``float32`` counts and ``n_counts``
   (see its docstring).
3. Rank the cell's non-zero genes by decreasing value -> the rank stage.
4. V2: keep the top ``model_input_size - 2`` and wrap in ``<cls> ... <eos>``; V1: keep the top
   ``model_input_size``, no special tokens -> :class:`GeneformerTokens`.

Two deviations remain, both deliberate:

* Genes whose identifier is listed twice (literal duplicate Ensembl ids) are summed per cell,
  like ids the mapping makes identical; the reference keeps literal duplicates as two tokens.
* Genes with exactly equal normalised values are ordered by token id; Geneformer's
  ``np.argsort`` is not stable, so it orders them as numpy's sort kernel happens to.

Outputs per cell: ``input_ids`` (padded with the dictionary's ``<pad>``), ``attention_mask``
and ``length``. Geneformer drops cells left without genes; a loader cannot drop cells without
breaking its batch and resume arithmetic, so they come out with ``length`` 2 (V2:
``<cls> <eos>``) or 0 (V1).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from slafload.data.dataset import SlafDataset
from slafload.data.value_kind import warn_unless_counts
from slafload.errors import SchemaError, VocabularyError
from slafload.presets.base import (
    DEFAULT_SAMPLE_CELLS,
    DEFAULT_WARN_BELOW,
    Preset,
    gene_names,
    load_dictionary,
    measure_coverage,
)
from slafload.tokenizers.builtin import _fill_rows
from slafload.types import Chunk, RankedChunk

TARGET_SUM = 10_000
PathOrDict = str | os.PathLike[str] | dict


def _read_pickle(path: Any) -> Any:
    with open(path, "rb") as fh:
        return pickle.load(fh)


@dataclass(frozen=True, eq=False)
class GeneformerNormalize:
    """Chunk transform: Geneformer's gene mapping, duplicate collapse and normalisation.

    Args:
        token_of_gene: ``int64[n_genes]`` token of each dataset gene id, ``-1`` to drop it.
            Genes sharing a token are summed within a cell.
        median_of_token: ``float64`` non-zero median of each token's gene (by token id).
        n_counts: Per ``cell_integer_id`` total counts (the obs column, its own dtype), or
            ``None`` to use each cell's total over all its stored genes.
        target_sum: Geneformer's 10,000.

    Output: genes are token ids (ascending within a cell), values ``float64``
    ``count / n_counts * target_sum / median`` computed as Geneformer's ``.h5ad`` path
    (``tokenize_anndata``) computes it on a scipy sparse matrix, bit for bit: counts times
    ``1 / n_counts`` (the reciprocal in ``n_counts``' own type) in their result type, times
    ``target_sum`` in that type, times the ``float64`` ``1 / median`` (see
    :func:`_h5ad_normalize`). Counts stored as integers (``uint16``, as ``slafload convert``
    writes a ``float32`` count matrix) are taken as ``float32`` counts (``uint32`` and wider
    as ``float64``, numpy's promotion). Without ``n_counts``, each cell's total is the exact
    sum rounded once to that type, as scipy's ``X.sum(axis=1)`` gives for integer counts below
    2**24. Summed duplicates are added in that type too.
    """

    token_of_gene: np.ndarray
    median_of_token: np.ndarray
    n_counts: np.ndarray | None = None
    target_sum: int | float = TARGET_SUM

    def __call__(self, chunk: Chunk) -> Chunk:
        """The chunk mapped to tokens and normalized as described above."""
        n = chunk.n_cells
        genes = chunk.genes.astype(np.int64, copy=False)
        if len(genes) and int(genes.max()) >= len(self.token_of_gene):
            raise VocabularyError(
                f"chunk holds gene id {int(genes.max())} but the Geneformer preset maps "
                f"{len(self.token_of_gene)} genes; build the preset from the dataset loaded"
            )
        cell = np.repeat(np.arange(n, dtype=np.int64), chunk.lengths)
        acc = np.result_type(chunk.values.dtype, np.float32)
        if self.n_counts is None:
            # ``X.sum(axis=1)`` in X's dtype: the exact total, rounded once (scipy's float32
            # sum is exact too while totals stay below 2**24)
            totals = np.bincount(cell, weights=chunk.values.astype(np.float64), minlength=n)
            totals = totals.astype(acc)
        else:
            if n and int(chunk.cell_ids.max()) >= len(self.n_counts):
                raise SchemaError(
                    f"cell {int(chunk.cell_ids.max())} has no n_counts: the preset read "
                    f"{len(self.n_counts)} cells; rebuild it for this dataset version"
                )
            totals = self.n_counts[chunk.cell_ids]
        tokens = self.token_of_gene[genes]
        keep = np.flatnonzero(tokens >= 0)
        cell, tokens = cell[keep], tokens[keep]
        values = chunk.values[keep].astype(acc, copy=False)
        # Cell-major, then token: one int64 key sorts every cell and exposes duplicates.
        key = cell * (int(self.token_of_gene.max()) + 1) + tokens
        order = np.argsort(key, kind="stable")
        key, cell, tokens, values = key[order], cell[order], tokens[order], values[order]
        if len(key) > 1 and (key[1:] == key[:-1]).any():
            first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
            values = np.add.reduceat(values, first)
            cell, tokens = cell[first], tokens[first]
        normalized = _h5ad_normalize(
            values, _reciprocal(totals)[cell], self.target_sum, self.median_of_token[tokens]
        )
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(cell, minlength=n), out=indptr[1:])
        return dataclasses.replace(chunk, indptr=indptr, genes=tokens, values=normalized)


def _h5ad_normalize(
    values: np.ndarray, recip_total: np.ndarray, target_sum: int | float, median: np.ndarray
) -> np.ndarray:
    """``X / n_counts * target_sum / median`` as scipy evaluates it on a sparse ``X``.

    A sparse matrix divided by a dense array multiplies by ``np.true_divide(1., other)``
    (``scipy.sparse._base._divide``): ``values * (1 / n_counts)`` in the two arrays' result
    type (``float32`` for ``float32`` counts and ``n_counts``), times the Python scalar
    ``target_sum`` in that type, times the ``float64`` ``1 / median``. Dividing instead
    rounds differently in the last bit, and near-equal genes swap places.
    """
    scaled = values * recip_total
    scaled *= target_sum
    return scaled * np.true_divide(1.0, median)


def _reciprocal(totals: np.ndarray) -> np.ndarray:
    """``1 / totals`` in their own float type (``float64`` for integers), as numpy divides
    ``1.`` by them; empty cells' zero totals give ``inf``, never used.
    """
    with np.errstate(divide="ignore"):
        return np.true_divide(1.0, totals)


class GeneformerTokens:
    """Rank-value encoding in Geneformer's layout, on a chunk ranked by normalised value.

    Args:
        model_input_size: Width of ``input_ids`` (V2: 4096, V1: 2048).
        special_tokens: Wrap in ``cls_id ... eos_id`` (V2) or not (V1).
        pad_id, cls_id, eos_id: Token ids from the model's token dictionary.
    """

    def __init__(
        self,
        *,
        model_input_size: int,
        special_tokens: bool,
        pad_id: int,
        cls_id: int | None = None,
        eos_id: int | None = None,
        name: str = "geneformer-v2",
    ):
        minimum = 3 if special_tokens else 1
        if not isinstance(model_input_size, int) or model_input_size < minimum:
            raise ValueError(
                f"model_input_size must be an integer >= {minimum}, got {model_input_size!r}"
            )
        if special_tokens and (cls_id is None or eos_id is None):
            raise ValueError("special_tokens=True needs cls_id and eos_id")
        self.model_input_size, self.special_tokens = model_input_size, special_tokens
        self.pad_id, self.cls_id, self.eos_id, self.name = pad_id, cls_id, eos_id, name

    def __call__(self, ranked: RankedChunk) -> dict[str, np.ndarray]:
        """Token rows in the model's layout for every cell of the chunk."""
        width, first = self.model_input_size, int(self.special_tokens)
        body = width - 2 * first
        ids = np.full((ranked.n_cells, width), self.pad_id, dtype=np.int64)
        _fill_rows(ids, ranked.genes, ranked, body, first_col=first)
        lengths = ranked.output_lengths(body)
        if self.special_tokens:
            assert self.cls_id is not None and self.eos_id is not None  # checked in __init__
            ids[:, 0] = self.cls_id
            ids[np.arange(ranked.n_cells), lengths + 1] = self.eos_id
            lengths = lengths + 2
        mask = np.arange(width)[None, :] < lengths[:, None]
        return {"input_ids": ids, "attention_mask": mask, "length": lengths}


def _ensembl_ids(
    dataset: SlafDataset, names: Sequence[str], tokens: dict,
    ensembl_mapping: PathOrDict | None, gene_column: str, collapse_gene_ids: bool,
) -> list[str | None]:  # fmt: skip
    """Each gene's identifier in the token dictionary (``None``: not tokenized), as
    :func:`geneformer_v2` describes ``ensembl_mapping`` and ``collapse_gene_ids``.
    """
    if collapse_gene_ids:
        mapping = (
            {k: k for k in tokens}
            if ensembl_mapping is None
            else load_dictionary(ensembl_mapping, "ensembl_mapping", _read_pickle)
        )
        mapping = {k: v for k, v in mapping.items() if v in tokens}
        return [mapping.get(str(g).upper()) for g in names]
    ensembl = [g if g in tokens else None for g in names]
    known = [g for g in ensembl if g is not None]
    if len(known) != len(set(known)):
        raise VocabularyError(
            f"column {gene_column!r} of {dataset.uri!r} repeats identifiers; pass "
            "collapse_gene_ids=True to sum them, as Geneformer does by default"
        )
    return ensembl


def _median_of_token(tokens: dict, medians: dict, ensembl: list[str | None]) -> np.ndarray:
    """Each token's gene median (NaN for tokens of no gene here); every tokenized gene must
    have one.
    """
    no_median = sorted({e for e in ensembl if e is not None and e not in medians})
    if no_median:
        raise VocabularyError(
            f"{len(no_median)} tokenized genes have no entry in the gene median dictionary, "
            f"e.g. {no_median[:5]}; pass the median file of the same model version"
        )
    median_of_token = np.full(max(tokens.values()) + 1, np.nan)
    for e in set(ensembl) - {None}:
        median_of_token[tokens[e]] = medians[e]
    return median_of_token


def geneformer_v2(
    dataset: SlafDataset,
    *,
    token_dictionary: PathOrDict,
    gene_median_dictionary: PathOrDict,
    ensembl_mapping: PathOrDict | None = None,
    gene_column: str = "ensembl_id",
    n_counts_column: str | None = "n_counts",
    model_input_size: int = 4096,
    special_tokens: bool = True,
    collapse_gene_ids: bool = True,
    sample_cells: int = DEFAULT_SAMPLE_CELLS,
    warn_below: float = DEFAULT_WARN_BELOW,
    name: str = "geneformer-v2",
) -> Preset:
    """The Geneformer V2 preset (``model_input_size=4096``, ``<cls> ... <eos>``).

    Args:
        dataset: The dataset to load; its ``gene_column`` names the genes.
        token_dictionary: ``token_dictionary_gc104M.pkl`` (path or the loaded dict:
            Ensembl id -> token, plus ``<pad>``, ``<cls>``, ``<eos>``...).
        gene_median_dictionary: ``gene_median_dictionary_gc104M.pkl`` (Ensembl id -> median).
        ensembl_mapping: ``ensembl_mapping_dict_gc104M.pkl`` (id -> Ensembl id), or ``None``
            for the identity on the token dictionary. A symbol -> Ensembl dictionary works the
            same way with ``gene_column`` naming a symbol column. Keys are matched against the
            upper-cased gene names, as Geneformer does.
        gene_column: ``genes.lance`` column with the identifiers (``ensembl_id``,
            ``feature_id``, ``gene_id``, a symbol column with a symbol mapping).
        n_counts_column: ``cells.lance`` column of total counts; when absent (or ``None``),
            each cell's total over all its stored genes.
        model_input_size: Tokens per cell, specials included (V1: 2048).
        special_tokens: Wrap each cell in ``<cls> ... <eos>`` (V1: ``False``).
        collapse_gene_ids: Map through ``ensembl_mapping`` and sum genes sharing an id (the
            reference's default). ``False`` matches names to the token dictionary directly and
            refuses duplicates among matched names, as the reference does.
        sample_cells: Cells sampled to estimate the vocabulary's coverage.
        warn_below: Coverage below which a warning is logged.
        name: The preset's name.
    """
    tokens = load_dictionary(token_dictionary, "token_dictionary", _read_pickle)
    medians = load_dictionary(gene_median_dictionary, "gene_median_dictionary", _read_pickle)
    if special_tokens:
        missing = [t for t in ("<cls>", "<eos>") if t not in tokens]
        if missing:
            raise VocabularyError(
                f"the token dictionary has no {missing}: V2 wraps cells in <cls> ... <eos>; "
                "use the V2 dictionary (token_dictionary_gc104M.pkl) or geneformer_v1"
            )
    warn_unless_counts(
        dataset, f"preset {name!r} (count / n_counts * 10,000 / median)",
        "convert the raw counts (slafload convert --raw or --layer NAME)",
    )  # fmt: skip
    names = gene_names(dataset, gene_column)
    ensembl = _ensembl_ids(dataset, names, tokens, ensembl_mapping, gene_column, collapse_gene_ids)
    token_of_gene = np.array([-1 if e is None else tokens[e] for e in ensembl], np.int64)
    median_of_token = _median_of_token(tokens, medians, ensembl)
    transform = GeneformerNormalize(
        token_of_gene, median_of_token, _n_counts(dataset, n_counts_column)
    )
    tokenizer = GeneformerTokens(
        model_input_size=model_input_size,
        special_tokens=special_tokens,
        pad_id=int(tokens.get("<pad>", 0)),
        cls_id=tokens.get("<cls>"),
        eos_id=tokens.get("<eos>"),
        name=name,
    )
    coverage = measure_coverage(
        dataset,
        token_of_gene >= 0,
        column=gene_column,
        model=name,
        sample_cells=sample_cells,
        warn_below=warn_below,
    )
    return Preset(name, tokenizer, (transform,), coverage)


def geneformer_v1(
    dataset: SlafDataset,
    *,
    token_dictionary: PathOrDict,
    gene_median_dictionary: PathOrDict,
    ensembl_mapping: PathOrDict | None = None,
    model_input_size: int = 2048,
    **options: Any,
) -> Preset:
    """The Geneformer V1 preset: 2048 tokens, no special tokens, the ``*_gc30M`` files.

    Takes the same options as :func:`geneformer_v2`.
    """
    return geneformer_v2(
        dataset,
        token_dictionary=token_dictionary,
        gene_median_dictionary=gene_median_dictionary,
        ensembl_mapping=ensembl_mapping,
        model_input_size=model_input_size,
        special_tokens=False,
        name="geneformer-v1",
        **options,
    )


def _n_counts(dataset: SlafDataset, column: str | None) -> np.ndarray | None:
    """The obs ``n_counts`` column by cell_integer_id, or ``None`` when it is absent."""
    if column is None or column not in dataset.cells.schema.names:
        return None
    obs = dataset.obs(["cell_integer_id", column]).sort("cell_integer_id")
    if obs.get_column(column).null_count():
        raise SchemaError(
            f"cells.lance column {column!r} of {dataset.uri!r} has nulls; fill it or pass "
            "n_counts_column=None to use each cell's total"
        )
    return obs.get_column(column).to_numpy()
