"""Shared fixtures: tiny real SLAF datasets on disk, and independent numpy references."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest

from slafload.writer import CsrBlock, write_slaf


def csr_from_dense(dense: np.ndarray) -> CsrBlock:
    """The non-zeros of a dense cells x genes matrix as one CSR block."""
    rows, cols = np.nonzero(dense)
    indptr = np.zeros(dense.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=dense.shape[0]), out=indptr[1:])
    return CsrBlock(indptr, cols, dense[rows, cols])


def random_counts(
    n_cells: int,
    n_genes: int,
    *,
    seed: int = 0,
    density: float = 0.3,
    max_count: int = 8,
    empty_every: int = 0,
) -> np.ndarray:
    """Dense integer counts with many ties; every ``empty_every``-th cell is empty."""
    rng = np.random.default_rng(seed)
    dense = rng.integers(1, max_count + 1, size=(n_cells, n_genes))
    dense[rng.random((n_cells, n_genes)) > density] = 0
    if empty_every:
        dense[::empty_every] = 0
    return dense.astype(np.uint16)


def write_dense(
    path: Path,
    dense: np.ndarray,
    *,
    max_rows_per_file: int | None = None,
    value_type=None,
    obs=None,
) -> Path:
    import pyarrow as pa

    return write_slaf(
        path,
        [csr_from_dense(dense)],
        n_genes=dense.shape[1],
        value_type=value_type or pa.uint16(),
        obs=obs,
        max_rows_per_file=max_rows_per_file,
    )


@pytest.fixture
def small_counts() -> np.ndarray:
    return random_counts(300, 40, seed=1, empty_every=37)


@pytest.fixture
def small_slaf(tmp_path: Path, small_counts: np.ndarray) -> Path:
    return write_dense(tmp_path / "small.slaf", small_counts, max_rows_per_file=97)


# -- independent references (deliberately simple per-cell loops) ------------------------------


def ranked_genes(row: np.ndarray) -> np.ndarray:
    """Expressed genes of one dense row, highest value first, ties by gene id ascending."""
    genes = np.flatnonzero(row > 0)
    return genes[np.lexsort((genes, -row[genes].astype(np.float64)))]


def geneformer_reference(row: np.ndarray, max_genes: int) -> np.ndarray:
    genes = ranked_genes(row)
    tokens = np.concatenate([[1], genes + 4, [2]])[:max_genes]
    return np.pad(tokens, (0, max_genes - len(tokens)))


def scgpt_reference(
    row: np.ndarray, max_genes: int, n_bins: int, offset: int = 50_000
) -> tuple[np.ndarray, np.ndarray]:
    genes = ranked_genes(row)
    nonzero = row[row > 0]
    ids = np.zeros(max_genes + 2, dtype=np.int64)
    values = np.zeros(max_genes + 2, dtype=np.int64)
    ids[0] = 1
    kept = genes[:max_genes]
    ids[1 : 1 + len(kept)] = kept + 4
    ids[1 + len(kept)] = 2
    if len(kept):
        edges = np.quantile(nonzero, np.linspace(0, 1, n_bins - 1))
        values[1 : 1 + len(kept)] = np.digitize(row[kept], edges) + offset
    return ids, values


@pytest.fixture
def no_thread_leak():
    """Fail the test if it leaves a slafload producer thread alive."""
    yield
    alive = [t for t in threading.enumerate() if t.name.startswith("slafload")]
    for t in alive:
        t.join(timeout=2)
    assert not [t for t in alive if t.is_alive()], "producer thread left running"


def append_cell(path, genes, values):
    """Append one cell to every table and config.json, as a writer extending an atlas would."""
    cells = lance.dataset(str(path / "cells.lance"))
    n_cells, n_rows = cells.count_rows(), lance.dataset(str(path / "expression.lance")).count_rows()
    lance.write_dataset(
        pa.table(
            {
                "cell_integer_id": pa.array([n_cells] * len(genes), pa.uint32()),
                "gene_integer_id": pa.array(genes, pa.uint16()),
                "value": pa.array(values, pa.uint16()),
            }
        ),
        str(path / "expression.lance"),
        mode="append",
    )
    row = {name: [None] for name in cells.schema.names}
    row.update(cell_id=[f"new_{n_cells}"], cell_integer_id=[n_cells], cell_start_index=[n_rows])
    lance.write_dataset(
        pa.table(row, schema=cells.schema), str(path / "cells.lance"), mode="append"
    )
    config = json.loads((path / "config.json").read_text())
    config["n_cells"] = config["array_shape"][0] = n_cells + 1
    config["metadata"]["expression_count"] = n_rows + len(genes)
    (path / "config.json").write_text(json.dumps(config))
