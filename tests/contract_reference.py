"""The output contract, written from the specification alone (docs/tokenizers.md, docs/layouts.md).

A slow, plain-Python reference that shares no code with slafload: it writes SLAF datasets with
``lance.write_dataset`` itself, reads a cell's entries as a Python list, and builds each cell's
token rows one position at a time. ``tests/test_contract.py`` compares every batch slafload
delivers with it.

What a cell's output is, per the specification:

- A cell's expressed genes are its stored entries with repeated ``(cell, gene)`` entries summed,
  ordered by value descending, ties by gene id ascending.
- ``geneformer``: ``[CLS] g1+4 g2+4 ... [SEP]`` truncated to ``max_genes`` positions (a cell with
  ``>= max_genes - 1`` genes loses ``[SEP]``), padded with ``PAD``; the mask marks real tokens.
- ``scgpt``: width ``max_genes + 2``; ids ``[CLS] g1+4 .. gn+4 [SEP]`` with ``n = min(genes,
  max_genes)``; values ``[PAD] b1 .. bn [PAD]`` with ``b = digitize(x, quantile(all the cell's
  values, linspace(0, 1, n_bins - 1))) + 50_000``; the mask marks real ids.
- ``raw``: width ``max_genes``; ``gene_ids`` (pad -1), ``values`` float32 (pad 0), and the
  per-cell ``lengths`` in every layout.
- ``sparse``: every expressed gene of the cell in ascending gene id, as ``gene_ids`` and
  ``values`` float32 back to back with ``cu_seqlens`` (int32), in the packed layout only, with
  no ``position_ids`` and no ``lengths``; ``max_genes`` does not apply.
- Layouts: ``longest`` keeps the padded rows' first ``L`` columns, ``L`` the last column any
  row of the batch holds a real token in; ``packed`` keeps each row's real tokens back to back
  with ``cu_seqlens`` (int32) and ``position_ids`` (0, 1, ... within each cell) and no mask.
- Integer token streams and ``position_ids`` have the ``token_dtype``; ``cell_integer_id``,
  ``source``, obs codes and raw ``lengths`` are int64; raw ``values`` float32; masks bool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

PAD, CLS, SEP = 0, 1, 2
GENE_OFFSET = 4
SCGPT_VALUE_OFFSET = 50_000


@dataclass
class Atlas:
    """A dataset as the reference sees it: each cell's stored ``(gene, value)`` entries."""

    cells: list[list[tuple[int, int | float]]]
    n_genes: int
    dtype: str  # numpy name of the stored values' type, e.g. "uint16", "float32"
    plates: list[str] = field(default_factory=list)

    def expressed(self, cell: int) -> dict[int, int | float]:
        """The cell's genes with repeated entries summed (Python numbers, exact for ints)."""
        total: dict[int, int | float] = {}
        for gene, value in self.cells[cell]:
            total[gene] = total.get(gene, 0) + value
        return {g: v for g, v in total.items() if v > 0}

    def ranked(self, cell: int) -> list[int]:
        values = self.expressed(cell)
        return sorted(values, key=lambda g: (-values[g], g))


def write(
    path: Path,
    atlas: Atlas,
    *,
    value_type: pa.DataType,
    cell_type: pa.DataType,
    gene_type: pa.DataType,
    rows_per_file: int,
    storage: str,
) -> Path:
    """Write ``atlas`` in the SLAF layout with plain Lance calls, entries in the given order."""
    path.mkdir(parents=True)
    cell_ids, gene_ids, values, starts = [], [], [], []
    for cell, entries in enumerate(atlas.cells):
        starts.append(len(cell_ids))
        for gene, value in entries:
            cell_ids.append(cell)
            gene_ids.append(gene)
            values.append(value)
    expression = pa.table(
        {
            "cell_integer_id": pa.array(cell_ids, type=cell_type),
            "gene_integer_id": pa.array(gene_ids, type=gene_type),
            "value": pa.array(values, type=value_type),
        }
    )
    lance.write_dataset(
        expression,
        str(path / "expression.lance"),
        max_rows_per_file=rows_per_file,
        data_storage_version=storage,
    )
    n_cells = len(atlas.cells)
    cells = {
        "cell_id": pa.array([f"cell{i}" for i in range(n_cells)]),
        "cell_integer_id": pa.array(list(range(n_cells)), type=pa.int64()),
        "cell_start_index": pa.array(starts, type=pa.int64()),
    }
    if atlas.plates:
        cells["plate"] = pa.array(atlas.plates)
    lance.write_dataset(pa.table(cells), str(path / "cells.lance"), data_storage_version=storage)
    genes = {
        "gene_id": pa.array([f"G{i}" for i in range(atlas.n_genes)]),
        "gene_integer_id": pa.array(list(range(atlas.n_genes)), type=pa.int64()),
    }
    lance.write_dataset(pa.table(genes), str(path / "genes.lance"), data_storage_version=storage)
    config = {
        "format_version": "0.5",
        "n_cells": n_cells,
        "n_genes": atlas.n_genes,
        "array_shape": [n_cells, atlas.n_genes],
        "tables": {
            "expression": "expression.lance",
            "cells": "cells.lance",
            "genes": "genes.lance",
        },
        "metadata": {"expression_count": len(cell_ids)},
        "created_at": "2000-01-01T00:00:00+00:00",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def delete_cells(path: Path, atlas: Atlas, cells: list[int]) -> Atlas:
    """Delete every expression row of ``cells`` with Lance's ``delete`` (a deletion file, the
    data files untouched) and rewrite ``cell_start_index`` and the row count, as a user dropping bad cells does;
    the cells stay, empty."""
    if not cells:
        return atlas
    expression = lance.dataset(str(path / "expression.lance"))
    expression.delete(f"cell_integer_id IN ({', '.join(map(str, cells))})")
    kept = [[] if c in cells else entries for c, entries in enumerate(atlas.cells)]
    starts = [sum(len(e) for e in kept[:c]) for c in range(len(kept))]
    table = lance.dataset(str(path / "cells.lance")).to_table()
    index = table.schema.get_field_index("cell_start_index")
    table = table.set_column(index, "cell_start_index", pa.array(starts, type=pa.int64()))
    lance.write_dataset(table, str(path / "cells.lance"), mode="overwrite")
    config = json.loads((path / "config.json").read_text())
    config["metadata"]["expression_count"] = sum(len(e) for e in kept)
    (path / "config.json").write_text(json.dumps(config))
    return Atlas(kept, atlas.n_genes, atlas.dtype, atlas.plates)


def quantile_bins(
    values: list[int | float], kept: list[int | float], n_bins: int, dtype: str
) -> list[int]:
    """scGPT's per-cell bins of ``kept``: ``np.digitize`` against ``np.quantile`` of all the
    cell's values in their stored dtype, as the specification states it."""
    if not kept:
        return []
    edges = np.quantile(np.asarray(values, dtype=dtype), np.linspace(0, 1, n_bins - 1))
    return [int(np.digitize(np.asarray(x, dtype=dtype), edges)) for x in kept]


def padded_row(
    atlas: Atlas, cell: int, tokenizer: str, max_genes: int, n_bins: int
) -> dict[str, list]:
    """One cell's padded row per stream, plus ``n``: how many leading positions are real."""
    ranked = atlas.ranked(cell)
    values = atlas.expressed(cell)
    if tokenizer == "geneformer":
        tokens = ([CLS] + [g + GENE_OFFSET for g in ranked] + [SEP])[:max_genes]
        n = len(tokens)
        return {"input_ids": tokens + [PAD] * (max_genes - n), "n": [n]}
    if tokenizer == "scgpt":
        kept = ranked[:max_genes]
        ids = [CLS] + [g + GENE_OFFSET for g in kept] + [SEP]
        bins = quantile_bins(list(values.values()), [values[g] for g in kept], n_bins, atlas.dtype)
        vals = [PAD] + [b + SCGPT_VALUE_OFFSET for b in bins] + [PAD]
        n = len(ids)
        width = max_genes + 2
        return {
            "input_ids": ids + [PAD] * (width - n),
            "values": vals + [PAD] * (width - n),
            "n": [n],
        }
    kept = ranked[:max_genes]
    n = len(kept)
    return {
        "gene_ids": kept + [-1] * (max_genes - n),
        "values": [float(np.float32(values[g])) for g in kept] + [0.0] * (max_genes - n),
        "n": [n],
    }


def expected_batch(
    atlas_of: dict[int, Atlas],
    cells: list[tuple[int, int]],
    *,
    tokenizer: str,
    max_genes: int,
    n_bins: int,
    layout: str,
) -> dict[str, list]:
    """The token streams of one batch of ``(source, cell)`` pairs, as nested Python lists."""
    if tokenizer == "sparse":
        return sparse_batch(atlas_of, cells)
    rows = [padded_row(atlas_of[s], c, tokenizer, max_genes, n_bins) for s, c in cells]
    lengths = [r["n"][0] for r in rows]
    streams = [k for k in rows[0] if k != "n"] if rows else []
    out: dict[str, list] = {"lengths": lengths} if tokenizer == "raw" else {}
    if layout == "packed":
        for key in streams:
            out[key] = [x for r, n in zip(rows, lengths, strict=True) for x in r[key][:n]]
        out["cu_seqlens"] = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        out["position_ids"] = [p for n in lengths for p in range(n)]
        return out
    width = max(lengths, default=0) if layout == "longest" else len(rows[0][streams[0]])
    for key in streams:
        out[key] = [r[key][:width] for r in rows]
    if tokenizer != "raw":
        out["attention_mask"] = [[i < n for i in range(width)] for n in lengths]
    return out


def sparse_batch(atlas_of: dict[int, Atlas], cells: list[tuple[int, int]]) -> dict[str, list]:
    """A ``sparse`` batch: each cell's expressed genes, gene-ascending, as CSR."""
    rows = [sorted(atlas_of[s].expressed(c).items()) for s, c in cells]
    out: dict[str, list] = {"gene_ids": [], "values": [], "cu_seqlens": [0]}
    for row in rows:
        out["gene_ids"] += [g for g, _ in row]
        out["values"] += [float(np.float32(v)) for _, v in row]
        out["cu_seqlens"].append(out["cu_seqlens"][-1] + len(row))
    return out
