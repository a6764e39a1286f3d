"""Geneformer's per-gene median normalisation: medians from a streaming pass, then a transform.

Geneformer divides each cell's expression by the gene's median non-zero expression across the
training corpus before ranking, so that housekeeping genes expressed highly everywhere rank
below genes that are high *for that gene*. Two pieces:

:func:`gene_medians`
    The exact median of every gene's non-zero values over the whole dataset, in a streaming
    pass (see its docstring for the method and memory), returned as :class:`GeneMedians`,
    which saves to and loads from a JSON file so it is computed once and reused.
:class:`MedianNormalize`
    A chunk transform dividing each value by its gene's median (``float64`` output), plugged
    in before ranking: ``Loader(ds, transforms=[MedianNormalize(medians)])``. It is opt-in;
    without it the tokens are those of plain rank-value encoding.

Geneformer first scales each cell to ``target_sum`` (10,000) total counts, computes medians
of those scaled values (approximately, with t-digests) and divides by them. Scaling a cell by
a constant never changes the order of its own genes, so ``target_sum`` only changes the
medians (and the ``values`` a tokenizer sees); pass ``target_sum=10_000`` to both to follow
Geneformer exactly. The default (``None``) uses the stored values as they are.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slafload.data.dataset import SlafDataset
from slafload.errors import MediansError
from slafload.pipeline.chunk import Chunk, sort_genes_within_cells

logger = logging.getLogger(__name__)

FORMAT = "slafload.gene_medians"
DEFAULT_MAX_VALUES = 1 << 23  # values held at once: ~8.4M, ~500 MB peak (~60 B per value)


@dataclass(frozen=True, eq=False)
class GeneMedians:
    """Median non-zero expression of every gene of a dataset.

    Attributes:
        medians: ``float64[n_genes]`` by gene id; ``NaN`` for a gene never expressed.
        nnz: ``int64[n_genes]`` number of non-zero values each median was taken over.
        genes: Gene names (``genes.lance`` ``gene_id``) by gene id, to align other datasets.
        target_sum: Cells were scaled to this total before taking medians (``None``: not).
        source: The dataset the medians come from, for messages only.
    """

    medians: np.ndarray
    nnz: np.ndarray
    genes: tuple[str, ...]
    target_sum: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if not len(self.medians) == len(self.nnz) == len(self.genes):
            raise MediansError(
                f"medians ({len(self.medians)}), nnz ({len(self.nnz)}) and genes "
                f"({len(self.genes)}) must have one entry per gene"
            )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write JSON: gene names, exact ``float64`` medians (``null`` for NaN), counts."""
        doc = {
            "format": FORMAT,
            "version": 1,
            "source": self.source,
            "target_sum": self.target_sum,
            "genes": list(self.genes),
            "medians": [None if math.isnan(m) else m for m in self.medians.tolist()],
            "nnz": self.nnz.tolist(),
        }
        path = Path(path)
        path.write_text(json.dumps(doc) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> GeneMedians:
        """Read a file written by :meth:`save`.

        Raises:
            MediansError: the file is not a medians file.
        """
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise MediansError(f"{path} is not valid JSON ({exc}); recompute it") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise MediansError(
                f"{path} is not a slafload medians file (format={FORMAT!r}); write one with "
                "gene_medians(ds).save(path)"
            )
        medians = np.array([np.nan if m is None else m for m in doc["medians"]], np.float64)
        return cls(
            medians,
            np.asarray(doc["nnz"], dtype=np.int64),
            tuple(doc["genes"]),
            doc.get("target_sum"),
            doc.get("source", ""),
        )

    def aligned_to(self, dataset: SlafDataset, *, column: str = "gene_id") -> GeneMedians:
        """These medians re-indexed by ``dataset``'s gene ids, matching genes by name.

        Genes of ``dataset`` absent here get ``NaN`` (left unscaled by :class:`MedianNormalize`).
        """
        from slafload.transforms.vocab import (
            Vocabulary,  # vocab imports tokenizers; keep this import lazy
        )

        ids = Vocabulary(self.genes, source=self.source).mapping(dataset, column=column)
        known = ids >= 0
        medians = np.full(len(ids), np.nan)
        nnz = np.zeros(len(ids), dtype=np.int64)
        medians[known], nnz[known] = self.medians[ids[known]], self.nnz[ids[known]]
        names = tuple(str(g) for g in dataset.var([column]).get_column(column).to_list())
        return GeneMedians(medians, nnz, names, self.target_sum, self.source)


def gene_medians(
    dataset: SlafDataset,
    *,
    target_sum: float | None = None,
    max_values: int = DEFAULT_MAX_VALUES,
    batch_rows: int = 1 << 20,
    column: str = "gene_id",
) -> GeneMedians:
    """Exact median of each gene's non-zero values, streaming over ``expression.lance``.

    A gene stored twice in a cell counts once, with the sum of its values, as in a loaded
    chunk. Method: an exact median needs all of a gene's values at once, so genes are processed in
    blocks of consecutive gene ids whose non-zeros fit in ``max_values``. If the whole table
    fits, one scan collects every non-zero and one ``lexsort`` by (gene, value) orders them;
    each gene's median is read at its middle offset (mean of the two middles for an even count,
    as ``np.median``). Otherwise a first scan counts non-zeros per gene (and cell totals for
    ``target_sum``), blocks are cut from those counts, and each block costs one more scan that
    keeps only its genes. Memory: about 60 bytes of peak RSS per held value (cell, gene and
    value columns, the sort index and permuted copy, Arrow buffers; measured) plus
    ``8 * (n_genes + n_cells)`` bytes; a single gene with more than ``max_values`` non-zeros
    gets a block of its own and exceeds the budget. Scans read the pinned Lance version.

    Args:
        dataset: The opened dataset to scan.
        target_sum: Scale every cell to this total (Geneformer: 10,000) before the medians.
        max_values: Non-zero values held in memory at once.
        batch_rows: Rows per Arrow record batch of each scan.
        column: ``genes.lance`` column naming the genes in the result.
    """
    if not isinstance(max_values, int) or max_values < 1:
        raise ValueError(f"max_values must be a positive integer, got {max_values!r}")
    if target_sum is not None and not target_sum > 0:
        raise ValueError(f"target_sum must be positive or None, got {target_sum!r}")
    n_genes, n_cells = dataset.n_genes, dataset.n_cells
    medians = np.full(n_genes, np.nan)
    nnz = np.zeros(n_genes, dtype=np.int64)
    if dataset.n_rows <= max_values:
        parts = list(_scan(dataset, batch_rows))
        if parts:
            cell, gene, value = _sum_duplicates(
                *(np.concatenate([p[i] for p in parts]) for i in range(3))
            )
            del parts
            if target_sum is not None:
                value *= target_sum / np.bincount(cell, weights=value, minlength=n_cells)[cell]
            del cell
            _block_medians(gene, value, 0, medians, nnz)
        passes = 1
    else:
        counts, totals = np.zeros(n_genes, dtype=np.int64), np.zeros(n_cells)
        for cell, gene, value in _scan(dataset, batch_rows):
            counts += np.bincount(gene, minlength=n_genes)
            totals += np.bincount(cell, weights=value, minlength=n_cells)
        scale = target_sum / np.where(totals > 0, totals, 1) if target_sum is not None else None
        blocks = _blocks(counts, max_values)
        for lo, hi in blocks:
            parts = [
                (c, g, v if scale is None else v * scale[c])
                for c, g, v in _scan(dataset, batch_rows, lo, hi)
            ]
            empty = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
            _, gene, value = _sum_duplicates(
                *(np.concatenate([p[i] for p in parts] or [empty[i]]) for i in range(3))
            )
            _block_medians(gene, value, lo, medians, nnz)
        passes = 1 + len(blocks)
    logger.info("gene medians of %r: %d scans of expression.lance", dataset.uri, passes)
    names = tuple(str(g) for g in dataset.var([column]).get_column(column).to_list())
    return GeneMedians(medians, nnz, names, target_sum, dataset.uri)


def _scan(
    dataset: SlafDataset, batch_rows: int, lo: int = 0, hi: int | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(cell, gene, float64 value) of the non-zeros with ``lo <= gene < hi``, batch by batch."""
    columns = ["cell_integer_id", "gene_integer_id", "value"]
    for batch in dataset.expression.to_batches(columns=columns, batch_size=batch_rows):
        cell = batch.column(0).to_numpy().astype(np.int64)
        gene = batch.column(1).to_numpy().astype(np.int64)
        value = batch.column(2).to_numpy().astype(np.float64)
        keep = value > 0
        if hi is not None:
            keep &= (gene >= lo) & (gene < hi)
        yield cell[keep], gene[keep], value[keep]


def _sum_duplicates(
    cell: np.ndarray, gene: np.ndarray, value: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows (``cell`` non-decreasing) with repeated (cell, gene) entries summed, as a chunk
    sums them (:func:`~slafload.pipeline.chunk.sort_genes_within_cells`), so medians match loading.
    """
    if not len(cell):
        return cell, gene, value
    indptr = np.concatenate([[0], np.flatnonzero(np.diff(cell)) + 1, [len(cell)]])
    merged, gene, value = sort_genes_within_cells(indptr, gene, value)
    if merged is not indptr:
        cell = np.repeat(cell[indptr[:-1]], np.diff(merged))
    return cell, gene, value


def _blocks(counts: np.ndarray, max_values: int) -> list[tuple[int, int]]:
    """Consecutive gene-id ranges, each holding at most ``max_values`` non-zeros if possible."""
    blocks, lo, held = [], 0, 0
    for g, n in enumerate(counts.tolist()):
        if held and held + n > max_values:
            blocks.append((lo, g))
            lo, held = g, 0
        held += n
    blocks.append((lo, len(counts)))
    return blocks


def _block_medians(
    gene: np.ndarray, value: np.ndarray, lo: int, medians: np.ndarray, nnz: np.ndarray
) -> None:
    """Fill ``medians``/``nnz`` for the genes present in (gene, value), all ``>= lo``."""
    if not len(gene):
        return
    order = np.lexsort((value, gene))
    value = value[order]
    counts = np.bincount(gene - lo)
    present = np.flatnonzero(counts)
    start = np.concatenate([[0], np.cumsum(counts)])[present]
    n = counts[present]
    medians[lo + present] = (value[start + (n - 1) // 2] + value[start + n // 2]) / 2
    nnz[lo + present] = n


@dataclass(frozen=True, eq=False)
class MedianNormalize:
    """Chunk transform: ``value / median[gene]`` in ``float64``, before ranking.

    Args:
        medians: :class:`GeneMedians` indexed by the loaded dataset's gene ids (use
            :meth:`GeneMedians.aligned_to` for another dataset), or a ``float`` array.
        target_sum: Scale each cell to this total first; default ``medians.target_sum``.

    Genes with a ``NaN`` median (never expressed where the medians were computed) keep their
    value. Run it before a :class:`~slafload.transforms.vocab.GeneRemap`: medians are by dataset gene id.
    """

    medians: GeneMedians | np.ndarray
    target_sum: float | None = None
    _scale: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        m = self.medians
        if isinstance(m, GeneMedians):
            if self.target_sum is None:
                object.__setattr__(self, "target_sum", m.target_sum)
            m = m.medians
        m = np.asarray(m, dtype=np.float64)
        if (m <= 0).any():
            raise MediansError("medians must be positive (or NaN for genes never expressed)")
        object.__setattr__(self, "_scale", np.where(np.isnan(m), 1.0, 1.0 / m))

    def __call__(self, chunk: Chunk) -> Chunk:
        """The chunk with every value divided by its gene's median."""
        scale = self._scale
        if len(chunk.genes) and int(chunk.genes.max()) >= len(scale):
            raise MediansError(
                f"chunk holds gene id {int(chunk.genes.max())} but the medians cover "
                f"{len(scale)} genes; compute them on this dataset or align them with "
                "GeneMedians.aligned_to(dataset)"
            )
        values = chunk.values.astype(np.float64) * scale[chunk.genes]
        if self.target_sum is not None and len(values):
            cell = np.repeat(np.arange(chunk.n_cells), chunk.lengths)
            totals = np.bincount(cell, weights=chunk.values.astype(np.float64))
            values *= self.target_sum / np.where(totals > 0, totals, 1)[cell]
        return dataclasses.replace(chunk, values=values)
