import json
import math

import lance
import numpy as np
import pyarrow as pa
import pytest

from slafload.tools import synthetic
from slafload.tools.synthetic import write_atlas

N_CELLS, N_GENES, N_PLATES = 600, 2000, 3
SMALL = {"n_cells": N_CELLS, "n_genes": N_GENES, "n_plates": N_PLATES, "mean_nnz": 100}


def read(path, name: str) -> pa.Table:
    return lance.dataset(str(path / f"{name}.lance")).to_table()


def column(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy()


@pytest.fixture(scope="module")
def atlas(tmp_path_factory):
    return write_atlas(tmp_path_factory.mktemp("atlas") / "a.slaf", **SMALL, empty_fraction=0.1)


def test_tables_have_the_slafdb_schema(atlas):
    assert read(atlas, "expression").schema == pa.schema(
        [("cell_integer_id", pa.uint32()), ("gene_integer_id", pa.uint16()), ("value", pa.uint16())]
    )
    cells = read(atlas, "cells")
    assert set(cells.schema) == set(
        pa.schema(
            [
                ("cell_id", pa.string()),
                ("cell_integer_id", pa.int64()),
                ("cell_start_index", pa.int64()),
                ("plate", pa.string()),
                ("n_genes_by_counts", pa.int64()),
                ("total_counts", pa.int64()),
            ]
        )
    )
    assert cells.column("cell_id")[0].as_py() == "cell_0000001"
    assert cells.column("plate")[0].as_py() == "plate_00"
    genes = read(atlas, "genes")
    assert set(genes.schema) == set(
        pa.schema(
            [
                ("gene_id", pa.string()),
                ("gene_integer_id", pa.int64()),
                ("gene_symbol", pa.string()),
            ]
        )
    )
    assert genes.column("gene_id")[0].as_py() == "GENE000001"
    np.testing.assert_array_equal(column(cells, "cell_integer_id"), np.arange(N_CELLS))
    np.testing.assert_array_equal(column(genes, "gene_integer_id"), np.arange(N_GENES))


def test_gene_ids_widen_to_uint32_beyond_65535_genes(tmp_path):
    path = write_atlas(tmp_path / "wide", n_cells=4, n_genes=70_000, n_plates=1, mean_nnz=50)
    assert read(path, "expression").schema.field("gene_integer_id").type == pa.uint32()


def test_rows_are_sorted_by_cell_then_gene_without_duplicates(atlas):
    expression = read(atlas, "expression")
    key = column(expression, "cell_integer_id").astype(np.int64) * N_GENES + column(
        expression, "gene_integer_id"
    )
    assert np.all(np.diff(key) > 0)


def test_cell_start_index_is_the_csr_indptr_of_the_expression_rows(atlas):
    expression, cells = read(atlas, "expression"), read(atlas, "cells")
    cell_ids = column(expression, "cell_integer_id")
    nnz = np.bincount(cell_ids, minlength=N_CELLS)
    indptr = np.concatenate(([0], np.cumsum(nnz)))
    np.testing.assert_array_equal(column(cells, "cell_start_index"), indptr[:-1])
    np.testing.assert_array_equal(column(cells, "n_genes_by_counts"), nnz)
    totals = np.bincount(cell_ids, weights=column(expression, "value"), minlength=N_CELLS)
    np.testing.assert_array_equal(column(cells, "total_counts"), totals.astype(np.int64))


def test_empty_fraction_makes_exactly_that_many_cells_empty(atlas):
    nnz = column(read(atlas, "cells"), "n_genes_by_counts")
    assert np.sum(nnz == 0) == int(0.1 * N_CELLS)
    empty = np.flatnonzero(nnz == 0)
    assert empty.max() - empty.min() > N_CELLS // 2  # scattered, not one block


def test_no_cell_is_empty_by_default(tmp_path):
    path = write_atlas(tmp_path / "full", **SMALL)
    assert column(read(path, "cells"), "n_genes_by_counts").min() >= 1


def test_non_zeros_per_cell_are_spread_around_mean_nnz(atlas):
    nnz = column(read(atlas, "cells"), "n_genes_by_counts")
    nnz = nnz[nnz > 0]
    assert 85 < nnz.mean() < 115
    assert nnz.max() > 2 * nnz.min()


def test_values_are_heavy_tailed_counts_with_many_ties(atlas):
    values = column(read(atlas, "expression"), "value")
    assert values.min() == 1
    assert 0.5 < np.mean(values == 1) < 0.95
    assert values.max() >= 50


def test_plates_are_contiguous_and_equal_sized(tmp_path):
    path = write_atlas(tmp_path / "plates", n_cells=100, n_genes=50, n_plates=7, mean_nnz=5)
    plates = read(path, "cells").column("plate").to_pylist()
    assert plates == sorted(plates)
    sizes = [plates.count(f"plate_{p:02d}") for p in range(7)]
    assert sum(sizes) == 100
    assert max(sizes) - min(sizes) <= 1


def test_plates_have_different_top_genes(atlas):
    expression, cells = read(atlas, "expression"), read(atlas, "cells")
    plate_of_cell = np.array([int(p[-2:]) for p in cells.column("plate").to_pylist()])
    plate = plate_of_cell[column(expression, "cell_integer_id")]
    genes, values = column(expression, "gene_integer_id"), column(expression, "value")
    top = []
    for p in range(2):
        totals = np.bincount(genes[plate == p], weights=values[plate == p], minlength=N_GENES)
        top.append(set(np.argsort(-totals, kind="stable")[:20].tolist()))
    assert len(top[0] & top[1]) < 16


def test_same_seed_gives_identical_tables_and_a_different_seed_does_not(tmp_path):
    a = write_atlas(tmp_path / "a", **SMALL, empty_fraction=0.2, seed=7)
    b = write_atlas(tmp_path / "b", **SMALL, empty_fraction=0.2, seed=7)
    c = write_atlas(tmp_path / "c", **SMALL, empty_fraction=0.2, seed=8)
    for name in ("expression", "cells", "genes"):
        assert read(a, name).equals(read(b, name))
    assert not read(a, "expression").equals(read(c, "expression"))
    assert not read(a, "cells").equals(read(c, "cells"))


def test_generating_in_many_small_blocks_gives_the_same_atlas(tmp_path, monkeypatch):
    whole = write_atlas(tmp_path / "whole", **SMALL, empty_fraction=0.1)
    monkeypatch.setattr(synthetic, "_BLOCK_READS", 997)  # ~100 blocks, crossing plates
    blocks = write_atlas(tmp_path / "blocks", **SMALL, empty_fraction=0.1)
    for name in ("expression", "cells", "genes"):
        assert read(blocks, name).equals(read(whole, name))


def test_config_counts_agree_with_the_tables(atlas):
    config = json.loads((atlas / "config.json").read_text())
    values = column(read(atlas, "expression"), "value").astype(np.float64)
    assert config["format_version"] == "0.5"
    assert config["array_shape"] == [N_CELLS, N_GENES]
    assert (config["n_cells"], config["n_genes"]) == (N_CELLS, N_GENES)
    assert config["tables"] == {t: f"{t}.lance" for t in ("expression", "cells", "genes")}
    assert config["optimizations"] == {"use_integer_keys": True, "optimize_storage": True}
    metadata = config["metadata"]
    assert metadata["expression_count"] == len(values)
    assert metadata["total_possible_elements"] == N_CELLS * N_GENES
    assert math.isclose(metadata["density"], len(values) / (N_CELLS * N_GENES))
    assert math.isclose(metadata["sparsity"] + metadata["density"], 1.0)
    stats = metadata["expression_stats"]
    assert (stats["min_value"], stats["max_value"]) == (values.min(), values.max())
    assert math.isclose(stats["mean_value"], values.mean())
    assert math.isclose(stats["std_value"], values.std(ddof=1))
    assert config["generator"]["name"] == "slafload.tools.synthetic"
    assert config["generator"]["params"]["empty_fraction"] == 0.1
    assert isinstance(config["created_at"], str)


def test_max_rows_per_file_splits_expression_into_many_fragments(tmp_path):
    split = write_atlas(tmp_path / "split", **SMALL, max_rows_per_file=2_000)
    whole = write_atlas(tmp_path / "whole", **SMALL)
    dataset = lance.dataset(str(split / "expression.lance"))
    assert len(dataset.get_fragments()) >= dataset.count_rows() // 2_000
    assert len(lance.dataset(str(whole / "expression.lance")).get_fragments()) == 1
    assert read(split, "expression").equals(read(whole, "expression"))


def test_float32_values_are_positive_log_normalised_expression(tmp_path):
    path = write_atlas(tmp_path / "float", **SMALL, value_dtype="float32")
    expression, cells = read(path, "expression"), read(path, "cells")
    assert expression.schema.field("value").type == pa.float32()
    values = column(expression, "value")
    assert values.min() > 0
    assert len(np.unique(values)) < len(values)  # equal counts in a cell stay tied
    assert cells.schema.field("total_counts").type == pa.float64()
    totals = np.bincount(column(expression, "cell_integer_id"), weights=values, minlength=N_CELLS)
    np.testing.assert_allclose(column(cells, "total_counts"), totals, rtol=1e-9)


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("n_cells", 0),
        ("n_cells", 2.5),
        ("n_genes", 0),
        ("n_plates", 0),
        ("n_plates", 257),
        ("mean_nnz", 0),
        ("mean_nnz", 2001),
        ("empty_fraction", -0.1),
        ("empty_fraction", 1.0),
        ("empty_fraction", float("nan")),
        ("seed", -1),
        ("seed", True),
        ("max_rows_per_file", 0),
        ("value_dtype", "int64"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_the_argument(tmp_path, argument, value):
    with pytest.raises(ValueError, match=argument):
        write_atlas(tmp_path / "bad", **{**SMALL, "n_cells": 300, argument: value})
    assert not (tmp_path / "bad").exists()


def test_n_plates_may_not_exceed_n_cells(tmp_path):
    with pytest.raises(ValueError, match=r"n_plates must be an integer in \[1, 5\]"):
        write_atlas(tmp_path / "bad", n_cells=5, n_genes=10, n_plates=6, mean_nnz=2)


def test_existing_path_raises_file_exists_error_unless_overwrite(tmp_path):
    path = write_atlas(tmp_path / "a.slaf", **SMALL, seed=1)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_atlas(path, **SMALL, seed=2)
    write_atlas(path, **SMALL, seed=2, overwrite=True)
    assert json.loads((path / "config.json").read_text())["generator"]["seed"] == 2


def test_a_failed_write_leaves_no_directory_behind(tmp_path, monkeypatch):
    def explode(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(synthetic, "_expression_block", explode)
    with pytest.raises(RuntimeError, match="boom"):
        write_atlas(tmp_path / "broken", **SMALL)
    assert not (tmp_path / "broken").exists()


def test_tiny_atlases_with_one_gene_or_one_cell_are_valid(tmp_path):
    one_gene = write_atlas(tmp_path / "g", n_cells=10, n_genes=1, n_plates=2, mean_nnz=1)
    assert column(read(one_gene, "expression"), "gene_integer_id").tolist() == [0] * 10
    one_cell = write_atlas(tmp_path / "c", n_cells=1, n_genes=10, n_plates=1, mean_nnz=3)
    assert column(read(one_cell, "cells"), "cell_start_index").tolist() == [0]


def test_progress_bar_reports_on_stderr_only(tmp_path, capsys):
    pytest.importorskip("tqdm")
    write_atlas(tmp_path / "p", **SMALL, progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "cell" in captured.err


@pytest.mark.peers
def test_slafdb_opens_the_dataset_and_loads_batches(atlas):
    slaf = pytest.importorskip("slaf", exc_type=ImportError)
    pytest.importorskip("psutil", exc_type=ImportError)
    from slaf.ml.dataloaders import SLAFDataLoader

    array = slaf.SLAFArray(str(atlas))
    assert array.shape == (N_CELLS, N_GENES)
    array.wait_for_metadata()  # slafdb's prefetcher otherwise races its metadata load
    loader = SLAFDataLoader(
        array, tokenizer_type="geneformer", batch_size=32, max_genes=64, verbose=False, n_epochs=1
    )
    try:
        batch = next(iter(loader))
    finally:
        loader._dataset.prefetcher.stop()
    assert batch["input_ids"].shape[1] == 64
