"""Write the SLAF layout from blocks of cells in CSR form.

The single place that writes SLAF datasets: the synthetic atlas, AnnData conversion and the
tests all go through :func:`write_slaf`. Expression rows stream to Lance block by block, so
memory stays bounded by one block whatever the dataset size. The output opens in
``slaf.SLAFArray`` (slafdb) as well as in :func:`slafload.open_dataset`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import lance
import numpy as np
import pyarrow as pa

STORAGE_VERSION: Final = "2.2"  # the Lance file format slafdb 0.5.2's converter pins for SLAF 0.5


@dataclass(frozen=True, eq=False)
class CsrBlock:
    """Consecutive cells in CSR form: cell ``i``'s genes are ``genes[indptr[i]:indptr[i+1]]``.

    Genes are written in the given order; write them strictly ascending within each cell
    (readers sort cells stored otherwise, at a cost). Values are the stored non-zeros.
    ``obs`` optionally carries per-cell columns computed with the block (one entry per cell).
    """

    indptr: np.ndarray
    genes: np.ndarray
    values: np.ndarray
    obs: Mapping[str, np.ndarray] | None = None

    @property
    def n_cells(self) -> int:
        """Number of cells in the block."""
        return len(self.indptr) - 1


def write_slaf(
    path: str | os.PathLike[str],
    blocks: Iterable[CsrBlock],
    *,
    n_genes: int,
    value_type: pa.DataType | None = None,
    obs: pa.Table | Mapping[str, Any] | None = None,
    var: pa.Table | Mapping[str, Any] | None = None,
    max_rows_per_file: int | None = None,
    overwrite: bool = False,
    extra_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write a SLAF dataset at ``path`` and return its path.

    Args:
        path: Directory of the new dataset.
        blocks: Consecutive cell blocks, in cell order; the i-th cell overall gets
            ``cell_integer_id`` i.
        n_genes: Number of genes (columns).
        value_type: Arrow type of ``value``; default ``uint16`` (counts, as slafdb writes).
        obs: Per-cell columns, one row per cell written (``cell_id`` defaults to the id).
        var: Per-gene columns, one row per gene (``gene_id`` defaults to ``gene_<i>``).
        max_rows_per_file: Lance fragment size (small values force many fragments).
        overwrite: Replace an existing dataset at ``path``.
        extra_config: Keys merged into ``config.json``.

    ``CsrBlock.obs`` columns are concatenated into ``cells.lance`` after ``obs``. A failed write
    removes the partial directory; an exception raised while producing ``blocks`` propagates
    with its own type (Lance would otherwise wrap it in an ``OSError``).
    """
    path = Path(path)
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise FileExistsError(
                f"{str(path)!r} already exists; pass overwrite=True to replace it"
            )
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    path.mkdir(parents=True)
    try:
        return _write(path, blocks, n_genes, value_type or pa.uint16(), obs, var,
                      max_rows_per_file, extra_config)  # fmt: skip
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)  # never leave a half-written dataset behind
        raise


def _write(
    path: Path,
    blocks: Iterable[CsrBlock],
    n_genes: int,
    value_type: pa.DataType,
    obs: pa.Table | Mapping[str, Any] | None,
    var: pa.Table | Mapping[str, Any] | None,
    max_rows_per_file: int | None,
    extra_config: Mapping[str, Any] | None,
) -> Path:
    gene_type = pa.uint16() if n_genes <= np.iinfo(np.uint16).max + 1 else pa.uint32()
    schema = pa.schema(
        [("cell_integer_id", pa.uint32()), ("gene_integer_id", gene_type), ("value", value_type)]
    )
    lengths: list[np.ndarray] = []
    block_obs: dict[str, list[np.ndarray]] = {}
    stats = _Stats()

    def batches() -> Iterator[pa.RecordBatch]:
        first_cell = 0
        for block in blocks:
            counts: np.ndarray = np.diff(np.asarray(block.indptr, dtype=np.int64))
            lengths.append(counts)
            for name, column in (block.obs or {}).items():
                block_obs.setdefault(name, []).append(np.asarray(column))
            ids = np.arange(first_cell, first_cell + len(counts), dtype=np.uint32)
            first_cell += len(counts)
            values = np.asarray(block.values)
            stats.add(values)
            yield pa.RecordBatch.from_arrays(
                [
                    pa.array(np.repeat(ids, counts)),
                    pa.array(np.asarray(block.genes)).cast(gene_type),
                    pa.array(values).cast(value_type),
                ],
                schema=schema,
            )

    kwargs: dict[str, Any] = {"max_rows_per_file": max_rows_per_file} if max_rows_per_file else {}
    write_batches(batches(), str(path / "expression.lance"), schema,
                  data_storage_version=STORAGE_VERSION, **kwargs)  # fmt: skip

    counts = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    _write_cells_genes(path, counts, n_genes, obs, var, block_obs)
    config = _config(len(counts), n_genes, int(counts.sum()), stats, extra_config)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _write_cells_genes(
    path: Path,
    counts: np.ndarray,
    n_genes: int,
    obs: pa.Table | Mapping[str, Any] | None,
    var: pa.Table | Mapping[str, Any] | None,
    block_obs: Mapping[str, list[np.ndarray]],
) -> None:
    """Write ``cells.lance`` (``obs``, then the blocks' obs columns, ids and each cell's
    ``cell_start_index`` from its row ``counts``) and ``genes.lance`` (``var`` and ids).
    """
    n_cells = len(counts)
    start = np.zeros(n_cells, dtype=np.int64)
    np.cumsum(counts[:-1], out=start[1:])
    cells = _columns(obs, n_cells, "obs")
    for name, parts in block_obs.items():
        cells[name] = pa.array(np.concatenate(parts))
    cells.setdefault("cell_id", pa.array([str(i) for i in range(n_cells)]))
    cells["cell_integer_id"] = pa.array(np.arange(n_cells, dtype=np.int64))
    cells["cell_start_index"] = pa.array(start)
    genes = _columns(var, n_genes, "var")
    genes.setdefault("gene_id", pa.array([f"gene_{i}" for i in range(n_genes)]))
    genes["gene_integer_id"] = pa.array(np.arange(n_genes, dtype=np.int64))
    for name, columns in (("cells", cells), ("genes", genes)):
        lance.write_dataset(
            pa.table(columns), str(path / f"{name}.lance"), data_storage_version=STORAGE_VERSION
        )


def _config(
    n_cells: int, n_genes: int, n_rows: int, stats: _Stats, extra_config: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``config.json`` of a dataset of this shape (the SLAF layout's fields, docs/format.md)."""
    total = n_cells * n_genes
    return {
        "format_version": "0.5",
        "array_shape": [n_cells, n_genes],
        "n_cells": n_cells,
        "n_genes": n_genes,
        "tables": {
            "expression": "expression.lance",
            "cells": "cells.lance",
            "genes": "genes.lance",
        },
        "optimizations": {"use_integer_keys": True, "optimize_storage": True},
        "metadata": {
            "expression_count": n_rows,
            "sparsity": 1 - n_rows / total if total else 1.0,
            "density": n_rows / total if total else 0.0,
            "total_possible_elements": total,
            "expression_stats": stats.summary(),
        },
        "created_at": _dt.datetime.now(_dt.UTC).isoformat(),
        **dict(extra_config or {}),
    }


def write_batches(
    batches: Iterator[pa.RecordBatch], uri: str, schema: pa.Schema, **options: Any
) -> None:
    """``lance.write_dataset`` of a stream of record batches (``options`` are its keywords).

    What the stream raises (a bad block, Ctrl-C) is raised as itself: Lance reports it as a
    bare ``OSError``. Lance commits the new version only after the last batch, so a stream
    that fails commits nothing.
    """
    failure: list[BaseException] = []

    def kept() -> Iterator[pa.RecordBatch]:
        try:
            yield from batches
        except BaseException as exc:
            failure.append(exc)
            raise

    reader = pa.RecordBatchReader.from_batches(schema, kept())
    try:
        lance.write_dataset(reader, uri, schema=schema, **options)
    except OSError:
        if failure:
            raise failure[0] from None
        raise


class _Stats:
    """Running min/max/mean/std of the stored values, as slafdb's config records them."""

    def __init__(self) -> None:
        self.n, self.total, self.squares = 0, 0.0, 0.0
        self.lo, self.hi = np.inf, -np.inf

    def add(self, values: np.ndarray) -> None:
        if len(values):
            v = values.astype(np.float64)
            self.n += len(v)
            self.total += float(v.sum())
            self.squares += float(np.dot(v, v))
            self.lo, self.hi = min(self.lo, float(v.min())), max(self.hi, float(v.max()))

    def summary(self) -> dict[str, float]:
        if not self.n:
            return {"min_value": 0.0, "max_value": 0.0, "mean_value": 0.0, "std_value": 0.0}
        mean = self.total / self.n
        return {
            "min_value": self.lo,
            "max_value": self.hi,
            "mean_value": mean,
            "std_value": max((self.squares - self.n * mean * mean) / max(self.n - 1, 1), 0.0)
            ** 0.5,
        }


def _columns(
    columns: pa.Table | Mapping[str, Any] | None, n: int, what: str
) -> dict[str, pa.Array]:
    if columns is None:
        return {}
    table = columns if isinstance(columns, pa.Table) else pa.table(dict(columns))
    if table.num_rows != n:
        raise ValueError(f"{what} has {table.num_rows} rows but the dataset has {n}")
    return {name: table.column(name) for name in table.column_names}
