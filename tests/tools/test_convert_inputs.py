"""`slafload convert` over the AnnData shapes real files come in: each converts, or fails with
one line naming the problem. Unsorted CSR indices and duplicate entries included."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import (
    assert_rank_value_tokens,
    pbmc68k_path,
    random_counts,
    read_pbmc68k,
    unsorted_csr,
)

import slafload
from slafload import open_dataset
from slafload.tools.cli import main
from slafload.transforms.vocab import Vocabulary

ad = pytest.importorskip("anndata", exc_type=ImportError)
pd = pytest.importorskip("pandas", exc_type=ImportError)
sp = pytest.importorskip("scipy.sparse", exc_type=ImportError)

N_CELLS, N_GENES = 24, 6


def cli_convert(capsys, *args) -> tuple[int, str]:
    """Exit status and stderr of ``slafload convert ARGS --no-progress``, run in process."""
    status = main(["convert", *map(str, args), "--no-progress"])
    return status, capsys.readouterr().err


def stored_dense(ds) -> np.ndarray:
    table = ds.expression.to_table()
    cells, genes, values = (table.column(n).to_numpy() for n in table.column_names)
    assert (np.diff(cells.astype(np.int64) * ds.n_genes + genes) > 0).all()  # sorted, unique
    dense = np.zeros((ds.n_cells, ds.n_genes))
    dense[cells, genes] = values
    return dense


def frames(n_cells: int = N_CELLS, n_genes: int = N_GENES, **obs_columns):
    obs = pd.DataFrame(obs_columns, index=[f"c{i}" for i in range(n_cells)])
    return obs, pd.DataFrame(index=[f"G{g}" for g in range(n_genes)])


def csr(counts, **obs_columns):
    obs, var = frames(*counts.shape, **obs_columns)
    return ad.AnnData(sp.csr_matrix(counts), obs=obs, var=var)


def with_raw(counts):
    adata = csr(counts)
    adata.raw = adata.copy()
    adata.X = sp.csr_matrix(np.log1p(counts) - 0.5)  # scaled: negative values
    return adata


def with_var(counts, var):
    obs, _ = frames()
    return ad.AnnData(sp.csr_matrix(counts), obs=obs, var=var)


@dataclass(frozen=True)
class Shape:
    build: Callable[[np.ndarray], object]
    args: tuple[str, ...] = ()
    error: str | None = None  # pattern of the one-line message
    stored: Callable[[np.ndarray], np.ndarray] = lambda counts: counts
    check: Callable[[object], bool] = lambda ds: True
    backed: bool = False  # pass anndata.read_h5ad(..., backed="r") to slafload.tools.convert


SHAPES = {
    "X absent, counts in a layer": Shape(
        lambda c: ad.AnnData(obs=frames()[0], var=frames()[1], layers={"counts": csr(c).X}),
        error=r"has no X; it has layers \['counts'\] \(--layer NAME\)$",
    ),
    "X absent, --layer counts": Shape(
        lambda c: ad.AnnData(obs=frames()[0], var=frames()[1], layers={"counts": csr(c).X}),
        args=("--layer", "counts"),
    ),
    "raw.X with scaled X": Shape(with_raw, args=("--raw",)),
    "raw.X asked where there is none": Shape(
        csr, args=("--raw",), error=r"has no raw\.X; it holds no other matrix$"
    ),
    "scaled X without --raw": Shape(with_raw, error=r"negative values.*--raw"),
    "CSC X": Shape(lambda c: ad.AnnData(sp.csc_matrix(c), *frames())),
    "dense X": Shape(lambda c: ad.AnnData(c.astype(np.float32), *frames())),
    "float64 X": Shape(
        lambda c: csr(c * 0.37),
        stored=lambda c: (c * 0.37).astype(np.float32),
        check=lambda ds: str(ds.value_type) == "float",
    ),
    "int64 counts above 65,535": Shape(
        lambda c: csr(c.astype(np.int64) * 30_000),
        stored=lambda c: c.astype(np.int64) * 30_000,
        check=lambda ds: str(ds.value_type) == "uint32",
    ),
    "backed mode": Shape(csr, backed=True),
    "categorical obs with missing values": Shape(
        lambda c: csr(c, kind=pd.Categorical(["T", None, "B"] * (N_CELLS // 3))),
        check=lambda ds: ds.obs()["kind"].to_list() == ["T", None, "B"] * (N_CELLS // 3),
    ),
    "string obs with None": Shape(
        lambda c: csr(c, donor=np.array(["d1", None] * (N_CELLS // 2), dtype=object)),
        check=lambda ds: ds.obs()["donor"].to_list() == ["d1", None] * (N_CELLS // 2),
    ),
    "non-unique var_names": Shape(
        lambda c: with_var(c, pd.DataFrame(index=["A", "B", "A", "C", "D", "E"])),
        error=r"var_names are not unique \('A' appears 2 times\).*var_names_make_unique",
    ),
    "gene symbols in feature_name": Shape(
        lambda c: with_var(
            c,
            pd.DataFrame(
                {"feature_name": pd.Categorical(["CD3E", "CD4", "MS4A1", "CD8A", "NKG7", "LYZ"])},
                index=[f"ENSG{g:011d}" for g in range(N_GENES)],
            ),
        ),
        check=lambda ds: (
            Vocabulary.from_dataset(ds, column="feature_name").genes
            == ("CD3E", "CD4", "MS4A1", "CD8A", "NKG7", "LYZ")
        ),
    ),
    "zero cells": Shape(
        lambda c: ad.AnnData(sp.csr_matrix((0, N_GENES), dtype=np.float32), *frames(0)),
        error=r"input in holds no cells; nothing to convert$",
    ),
    "one gene": Shape(lambda c: csr(c[:, :1]), stored=lambda c: c[:, :1]),
}


@pytest.mark.parametrize("name", SHAPES)
def test_each_anndata_shape_converts_or_fails_with_one_line_naming_the_problem(
    tmp_path, capsys, name
):
    shape, counts = SHAPES[name], random_counts(N_CELLS, N_GENES, seed=2, empty_every=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anndata warns about some of these shapes on purpose
        shape.build(counts).write_h5ad(tmp_path / "in.h5ad")
    out = tmp_path / "out.slaf"
    if shape.backed:
        adata = ad.read_h5ad(tmp_path / "in.h5ad", backed="r")
        try:
            slafload.convert(adata, out)
        finally:
            adata.file.close()
    else:
        status, err = cli_convert(capsys, tmp_path / "in.h5ad", out, *shape.args)
        if shape.error is not None:
            assert status == 2 and err.count("\n") == 1, err
            assert re.search(shape.error, err.strip()), err
            assert not out.exists()
            return
        assert status == 0, err
    ds = open_dataset(out)
    np.testing.assert_allclose(stored_dense(ds), shape.stored(counts), rtol=1e-6)
    assert shape.check(ds)


def test_unsorted_csr_with_duplicate_entries_converts_to_rank_value_tokens(tmp_path, capsys):
    counts = random_counts(90, 30, seed=5, density=0.4, max_count=9, empty_every=13)
    block = unsorted_csr(counts, seed=5, duplicates=True)
    matrix = sp.csr_matrix((block.values, block.genes, block.indptr), shape=counts.shape)
    assert not matrix.has_sorted_indices and not matrix.has_canonical_format
    ad.AnnData(matrix, *frames(*counts.shape)).write_h5ad(tmp_path / "in.h5ad")
    status, err = cli_convert(capsys, tmp_path / "in.h5ad", tmp_path / "out.slaf")
    assert status == 0, err
    np.testing.assert_array_equal(stored_dense(open_dataset(tmp_path / "out.slaf")), counts)
    assert_rank_value_tokens(tmp_path / "out.slaf", counts)


def test_duplicate_entries_summing_past_the_value_type_fail_in_one_line(tmp_path, capsys):
    matrix = sp.csr_matrix(
        (np.array([40_000, 40_000, 7]), np.array([1, 1, 0]), np.array([0, 2, 3])), shape=(2, 3)
    )
    ad.AnnData(matrix, *frames(2, 3)).write_h5ad(tmp_path / "in.h5ad")
    status, err = cli_convert(capsys, tmp_path / "in.h5ad", tmp_path / "out.slaf")
    assert status == 2 and err.count("\n") == 1, err
    assert "sum to 80000, more than uint16" in err
    assert not (tmp_path / "out.slaf").exists()


def test_the_real_pbmc68k_file_converts_from_raw_and_loads_end_to_end(tmp_path, capsys):
    path, out = pbmc68k_path(), tmp_path / "pbmc.slaf"
    status, err = cli_convert(capsys, path, out)  # X is scaled: refused, pointing at --raw
    assert status == 2 and "negative values" in err and "--raw" in err
    status, err = cli_convert(capsys, path, out, "--raw")  # an old-format file: read whole
    assert status == 0, err
    adata = read_pbmc68k()
    assert not adata.raw.X.has_sorted_indices
    ds = open_dataset(out)
    assert ds.obs()["louvain"].to_list() == adata.obs["louvain"].astype(str).tolist()
    assert ds.var()["gene_id"].to_list() == adata.raw.var_names.tolist()
    assert_rank_value_tokens(out, adata.raw.X.toarray())
