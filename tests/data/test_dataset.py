"""Opening datasets: validation with clear errors, and Lance version pinning."""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa
import pytest
from conftest import random_counts, write_dense

from slafload import (
    ConfigError,
    DatasetNotFoundError,
    InconsistentDataError,
    Loader,
    SchemaError,
    open_dataset,
)


def test_open_reads_shape_offsets_and_pins_versions(small_slaf, small_counts):
    ds = open_dataset(small_slaf)
    assert (ds.n_cells, ds.n_genes) == small_counts.shape
    assert ds.n_rows == np.count_nonzero(small_counts)
    np.testing.assert_array_equal(np.diff(ds.cell_start), np.count_nonzero(small_counts, 1))
    assert set(ds.versions) == {"expression", "cells", "genes"}
    assert ds.obs().height == 300 and ds.var().height == 40
    assert "n_cells=300" in repr(ds)


def test_an_append_after_opening_does_not_change_the_pinned_epoch(small_slaf):
    ds = open_dataset(small_slaf)
    extra = pa.table(
        {
            "cell_integer_id": pa.array([299], pa.uint32()),
            "gene_integer_id": pa.array([39], pa.uint16()),
            "value": pa.array([9], pa.uint16()),
        }
    )
    lance.write_dataset(extra, str(small_slaf / "expression.lance"), mode="append")
    assert lance.dataset(str(small_slaf / "expression.lance")).version > ds.versions["expression"]
    with Loader(ds, shuffle=False, batch_size=300) as loader:
        assert len(list(loader)) == 1
    pinned = open_dataset(small_slaf, version=ds.versions["expression"])
    assert pinned.versions["expression"] == ds.versions["expression"]


def test_a_missing_path_names_the_path(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="nope.slaf.*does not exist"):
        open_dataset(tmp_path / "nope.slaf")


def test_a_missing_column_is_named(tmp_path):
    path = write_dense(tmp_path / "s.slaf", random_counts(5, 4))
    table = lance.dataset(str(path / "expression.lance")).to_table().drop_columns(["value"])
    lance.write_dataset(table, str(path / "expression.lance"), mode="overwrite")
    with pytest.raises(SchemaError, match="has no column 'value'"):
        open_dataset(path)


def test_cell_ids_out_of_order_are_rejected(tmp_path):
    path = write_dense(tmp_path / "s.slaf", random_counts(6, 4))
    cells = lance.dataset(str(path / "cells.lance")).to_table()
    ids = cells.column("cell_integer_id").to_numpy()[[1, 0, 2, 3, 4, 5]]
    cells = cells.set_column(
        cells.schema.get_field_index("cell_integer_id"), "cell_integer_id", pa.array(ids)
    )
    lance.write_dataset(cells, str(path / "cells.lance"), mode="overwrite")
    with pytest.raises(InconsistentDataError, match="cell_integer_id must be 0..n_cells-1"):
        open_dataset(path)


def test_invalid_json_config_is_rejected(small_slaf):
    (small_slaf / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        open_dataset(small_slaf)


def test_missing_cell_start_index_is_recomputed_from_the_expression_table(tmp_path, caplog):
    dense = random_counts(30, 5, seed=4, empty_every=7)
    path = write_dense(tmp_path / "s.slaf", dense)
    cells = lance.dataset(str(path / "cells.lance")).to_table().drop_columns(["cell_start_index"])
    lance.write_dataset(cells, str(path / "cells.lance"), mode="overwrite")
    ds = open_dataset(path)
    np.testing.assert_array_equal(np.diff(ds.cell_start), np.count_nonzero(dense, axis=1))
    assert "no cell_start_index" in caplog.text


def test_opening_holds_no_per_cell_array_but_cell_start(tmp_path, monkeypatch):
    import tracemalloc

    import slafload.data.checks
    from slafload.tools.writer import CsrBlock, write_slaf

    n = 200_000
    nnz = np.zeros(n, dtype=np.int64)
    nnz[::7] = 2
    indptr = np.concatenate([[0], np.cumsum(nnz)])
    genes = np.tile([0, 1], int(indptr[-1]) // 2)
    path = write_slaf(tmp_path / "wide.slaf", [CsrBlock(indptr, genes, np.ones_like(genes))],
                      n_genes=2)  # fmt: skip
    monkeypatch.setattr(slafload.data.checks, "_BATCH_CELLS", 4096)
    tracemalloc.start()
    ds = open_dataset(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert ds.n_cells == n
    assert ds.cell_start.nbytes <= 2.25 * (n + 1) + 8  # 2 bytes a cell, a base per 32 cells
    assert peak < 2.25 * (n + 1) + 2**20  # cell_start, and batches of 4096 cells: no int64 copy
    np.testing.assert_array_equal(np.diff(ds.cell_start), nnz)


@pytest.mark.parametrize(
    ("where", "cell"),
    [("at a batch's first cell", 4096), ("inside a batch", 5000), ("the first cell", 0)],
)
def test_offsets_are_checked_across_the_batches_they_are_read_in(tmp_path, monkeypatch, where,
                                                                  cell):  # fmt: skip
    import slafload.data.checks
    from slafload.errors import InconsistentDataError

    path = tmp_path / "d.slaf"
    write_dense(path, np.ones((9_000, 3), dtype=np.float32))
    cells = lance.dataset(str(path / "cells.lance")).to_table()
    start = cells.column("cell_start_index").to_numpy().copy()
    start[cell] = start[cell - 1] - 1 if cell else 2  # the batch before ends higher
    cells = cells.set_column(cells.schema.get_field_index("cell_start_index"),
                             "cell_start_index", pa.array(start))  # fmt: skip
    lance.write_dataset(cells, str(path / "cells.lance"), mode="overwrite")
    monkeypatch.setattr(slafload.data.checks, "_BATCH_CELLS", 4096)
    with pytest.raises(InconsistentDataError, match=rf"cell_start_index of cell {cell} breaks"):
        open_dataset(path)
