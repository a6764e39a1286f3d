"""slafdb 0.5.2 interop: same token conventions, but slafload's content follows the methods.

slafdb's loader is the reference for *conventions* (special ids, gene token = id + 4, widths,
padding, attention masks, the scGPT ``values`` stream and its 50,000 offset). Its *content* is
wrong in two documented ways, which these tests pin down so a change in either is noticed:

* geneformer: genes come out in ascending gene-id order, and when a cell has more genes than
  fit, the lowest-numbered genes are kept rather than the most expressed;
* scgpt: ``values`` carry the raw count + 50,000 instead of an expression bin;
* both: cells with no non-zeros are never delivered (slafload yields them as ``[CLS] [SEP]``).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    assert_rank_value_tokens,
    geneformer_reference,
    random_counts,
    read_pbmc68k,
    scgpt_reference,
    unsorted_csr,
    write_dense,
)

from slafload import InconsistentDataError, Loader, open_dataset

slaf = pytest.importorskip("slaf")
pytest.importorskip("psutil")  # without it slafdb's loader silently yields nothing

pytestmark = [
    pytest.mark.peers,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

N_CELLS, N_GENES, MAX_GENES = 64, 48, 16


def slafdb_sentences(path, tokenizer: str, expected: int) -> dict[int, dict[str, np.ndarray]]:
    """The rows of the first ``expected`` distinct cells from slafdb's SLAFDataLoader."""
    from slaf.ml.dataloaders import SLAFDataLoader

    array = slaf.SLAFArray(str(path))
    array.wait_for_metadata()  # else its prefetcher races the metadata load and yields nothing
    loader = SLAFDataLoader(
        array,
        tokenizer_type=tokenizer,
        batch_size=8,
        max_genes=MAX_GENES,
        verbose=False,
        n_epochs=1,
    )
    rows: dict[int, dict[str, np.ndarray]] = {}
    deadline = time.monotonic() + 60
    try:
        for batch in loader:
            for i, cell in enumerate(np.asarray(batch["cell_ids"]).tolist()):
                rows[int(cell)] = {
                    k: batch[k][i].numpy()
                    for k in ("input_ids", "attention_mask", "values")
                    if k in batch
                }
            if len(rows) == expected or time.monotonic() > deadline:
                break
    finally:
        loader._dataset.prefetcher.stop()
    assert len(rows) == expected, f"slafdb delivered {len(rows)} of {expected} cells"
    return rows


def slafload_sentences(path, tokenizer: str) -> dict[int, dict[str, np.ndarray]]:
    rows = {}
    with Loader(path, tokenizer=tokenizer, max_genes=MAX_GENES, batch_size=8) as loader:
        for batch in loader:
            for i, cell in enumerate(batch["cell_integer_id"].tolist()):
                rows[cell] = {k: v[i].numpy() for k, v in batch.items()}
    return rows


@pytest.fixture(scope="module")
def atlas(tmp_path_factory):
    dense = random_counts(N_CELLS, N_GENES, seed=11, density=0.5, max_count=6, empty_every=9)
    return dense, write_dense(tmp_path_factory.mktemp("compat") / "a.slaf", dense)


def test_geneformer_conventions_match_slafdb_and_content_is_rank_value(atlas):
    dense, path = atlas
    expressed_cells = np.flatnonzero(dense.any(axis=1))
    theirs = slafdb_sentences(path, "geneformer", len(expressed_cells))
    ours = slafload_sentences(path, "geneformer")
    assert sorted(ours) == list(range(N_CELLS))
    assert sorted(theirs) == expressed_cells.tolist()  # slafdb drops empty cells
    for cell in expressed_cells:
        t, o = theirs[cell], ours[cell]
        # Conventions: width, dtype, CLS first, PAD=0 padding, SEP placement, mask.
        assert t["input_ids"].shape == o["input_ids"].shape == (MAX_GENES,)
        assert t["input_ids"].dtype == o["input_ids"].dtype
        np.testing.assert_array_equal(t["input_ids"] == 0, o["input_ids"] == 0)
        np.testing.assert_array_equal(t["input_ids"] < 4, o["input_ids"] < 4)
        np.testing.assert_array_equal(
            t["input_ids"][t["input_ids"] < 4], o["input_ids"][o["input_ids"] < 4]
        )
        np.testing.assert_array_equal(t["attention_mask"], o["attention_mask"])
        # Content: slafload is the rank-value encoding ...
        np.testing.assert_array_equal(o["input_ids"], geneformer_reference(dense[cell], MAX_GENES))
        # ... while slafdb lists the lowest-numbered expressed genes in id order.
        theirs_genes = t["input_ids"][t["input_ids"] >= 4] - 4
        expressed = np.flatnonzero(dense[cell])
        np.testing.assert_array_equal(theirs_genes, expressed[: MAX_GENES - 1])


def test_scgpt_conventions_match_slafdb_and_values_are_bins_not_counts(atlas):
    dense, path = atlas
    expressed_cells = np.flatnonzero(dense.any(axis=1))
    theirs = slafdb_sentences(path, "scgpt", len(expressed_cells))
    ours = slafload_sentences(path, "scgpt")
    assert sorted(theirs) == expressed_cells.tolist()
    n_bins = 51
    for cell in expressed_cells:
        t, o = theirs[cell], ours[cell]
        for key in ("input_ids", "values", "attention_mask"):
            assert t[key].shape == o[key].shape == (MAX_GENES + 2,)
            assert t[key].dtype == o[key].dtype
        np.testing.assert_array_equal(t["input_ids"] < 4, o["input_ids"] < 4)
        np.testing.assert_array_equal(t["attention_mask"], o["attention_mask"])
        np.testing.assert_array_equal(t["values"] == 0, o["values"] == 0)
        ids, values = scgpt_reference(dense[cell], MAX_GENES, n_bins)
        np.testing.assert_array_equal(o["input_ids"], ids)
        np.testing.assert_array_equal(o["values"], values)
        # slafdb: ids in gene order, values = raw count + 50,000.
        genes = t["input_ids"][t["input_ids"] >= 4] - 4
        expressed = np.flatnonzero(dense[cell])[:MAX_GENES]
        np.testing.assert_array_equal(genes, expressed)
        np.testing.assert_array_equal(
            t["values"][1 : 1 + len(genes)], dense[cell][genes].astype(np.int64) + 50_000
        )


def slafdb_convert(adata, tmp_path: Path) -> Path:
    """``adata`` written to .h5ad and converted by slafdb's own converter."""
    from slaf.data import SLAFConverter

    adata.write_h5ad(tmp_path / "in.h5ad")
    SLAFConverter().convert(str(tmp_path / "in.h5ad"), str(tmp_path / "out.slaf"))
    return tmp_path / "out.slaf"


def stored_genes_ascend(path: Path) -> bool:
    import lance

    table = lance.dataset(str(path / "expression.lance")).to_table()
    cells, genes = (table.column(n).to_numpy().astype(np.int64) for n in table.column_names[:2])
    return bool(((np.diff(genes) > 0) | (np.diff(cells) > 0)).all())


def test_a_slafdb_conversion_of_unsorted_csr_yields_rank_value_tokens(tmp_path):
    ad = pytest.importorskip("anndata")
    pd = pytest.importorskip("pandas")
    sp = pytest.importorskip("scipy.sparse")
    dense = random_counts(N_CELLS, N_GENES, seed=12, density=0.5, max_count=4, empty_every=9)
    block = unsorted_csr(dense, seed=12)
    matrix = sp.csr_matrix((block.values, block.genes, block.indptr), shape=dense.shape)
    assert not matrix.has_sorted_indices
    adata = ad.AnnData(
        matrix,
        obs=pd.DataFrame(index=[f"c{i}" for i in range(N_CELLS)]),
        var=pd.DataFrame(index=[f"G{g}" for g in range(N_GENES)]),
    )
    path = slafdb_convert(adata, tmp_path)
    assert not stored_genes_ascend(path)  # slafdb kept the input's order
    assert_rank_value_tokens(path, dense)


def test_the_real_pbmc68k_file_converted_by_slafdb_loads_end_to_end(tmp_path):
    ad = pytest.importorskip("anndata")
    adata = read_pbmc68k()  # its X is scaled (negative): slafdb can only convert raw.X
    expression = adata.raw.X
    assert not expression.has_sorted_indices
    # slafdb takes cell_start_index from an obs "n_genes" column when there is one; here it
    # counts genes before the file was subset to 765, so slafdb writes wrong offsets.
    (tmp_path / "as_is").mkdir()
    as_is = slafdb_convert(
        ad.AnnData(expression, obs=adata.obs, var=adata.raw.var), tmp_path / "as_is"
    )
    with pytest.raises(InconsistentDataError, match=r"of cell 148 breaks this.*'n_genes'"):
        open_dataset(as_is)
    obs = adata.obs.drop(columns="n_genes")
    path = slafdb_convert(ad.AnnData(expression, obs=obs, var=adata.raw.var), tmp_path)
    assert not stored_genes_ascend(path)
    assert_rank_value_tokens(path, expression.toarray())
