"""The ``sparse`` tokenizer: each cell's whole expression, gene-ascending, as CSR batches."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch
from conftest import random_counts, unsorted_csr, write_dense
from resume_conformance import assert_resumes_exactly

import slafload.pipeline.tokenize
from slafload import Loader, Mixture, open_dataset
from slafload.errors import LayoutError
from slafload.samplers import BlockShuffle
from slafload.tokenizers import Sparse, make_tokenizer, sparse_csr
from slafload.tokenizers.builtin import token_budget
from slafload.tools.writer import write_slaf

pytestmark = [
    pytest.mark.usefixtures("no_thread_leak"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta"),
]
N_CELLS, N_GENES = 120, 30


@pytest.fixture(scope="module")
def counts() -> np.ndarray:
    return random_counts(N_CELLS, N_GENES, seed=6, density=0.4, empty_every=13)


@pytest.fixture(scope="module")
def unsorted_atlas(tmp_path_factory, counts):
    """``counts`` stored with each cell's genes shuffled and some entries split in two."""
    block = unsorted_csr(counts, seed=6, duplicates=True)
    path = tmp_path_factory.mktemp("sparse") / "u.slaf"
    return write_slaf(path, [block], n_genes=N_GENES, max_rows_per_file=101)


def dense_of(batches, n_cells: int = N_CELLS) -> tuple[np.ndarray, list[int]]:
    """The cells x genes matrix the batches hold (via ``sparse_csr``), and their cell order."""
    out = np.full((n_cells, N_GENES), -1.0, dtype=np.float32)
    order: list[int] = []
    for batch in batches:
        cells = batch["cell_integer_id"].numpy()
        out[cells] = sparse_csr(batch, N_GENES, check_invariants=True).to_dense().numpy()
        order += cells.tolist()
    return out, order


@pytest.mark.parametrize("kernels", ["numpy", "numba"])
@pytest.mark.parametrize("token_dtype", ["int64", "int32"])
def test_every_cell_comes_whole_in_gene_order_as_csr(unsorted_atlas, counts, kernels, token_dtype):
    with Loader(
        str(unsorted_atlas), tokenizer="sparse", batch_size=16, kernels=kernels,
        token_dtype=token_dtype,
    ) as loader:  # fmt: skip
        assert loader.config.layout == "packed"
        batches = list(loader)
    for batch in batches:
        assert set(batch) == {"gene_ids", "values", "cu_seqlens", "cell_integer_id"}
        assert batch["gene_ids"].dtype == getattr(torch, token_dtype)
        assert batch["values"].dtype == torch.float32
        assert batch["cu_seqlens"].dtype == torch.int32
        genes, offsets = batch["gene_ids"].numpy(), batch["cu_seqlens"].numpy()
        for lo, hi in pairwise(offsets):
            assert (np.diff(genes[lo:hi]) > 0).all(), "genes ascend within each cell"
    dense, order = dense_of(batches)
    assert sorted(order) == list(range(N_CELLS)) and order != sorted(order)
    np.testing.assert_array_equal(dense, counts)  # every gene, duplicates summed, none dropped


def test_the_token_worker_skips_ranking_for_it(unsorted_atlas, counts, monkeypatch):
    def no_ranking(chunk):
        raise AssertionError("the sparse tokenizer's pieces must not be ranked")

    monkeypatch.setattr(slafload.pipeline.tokenize, "rank", no_ranking)
    with Loader(str(unsorted_atlas), tokenizer=Sparse(), batch_size=32) as loader:
        dense, _ = dense_of(loader)
    np.testing.assert_array_equal(dense, counts)


def test_empty_cells_are_empty_rows(tmp_path):
    dense = random_counts(20, 8, seed=2, empty_every=3)
    with Loader(str(write_dense(tmp_path / "e.slaf", dense)), tokenizer="sparse",
                batch_size=20, shuffle=False) as loader:  # fmt: skip
        (batch,) = list(loader)
    lengths = np.diff(batch["cu_seqlens"].numpy())
    np.testing.assert_array_equal(lengths, np.count_nonzero(dense, axis=1))
    assert (lengths[::3] == 0).all()


def test_block_sampling_and_a_resume_give_the_uninterrupted_run(unsorted_atlas):
    ds = open_dataset(unsorted_atlas)
    assert_resumes_exactly(
        lambda: Loader(
            ds,
            tokenizer="sparse",
            sampler=BlockShuffle(block_size=4, fetch_factor=3),
            batch_size=9,
            n_epochs=2,
        ),
        midpoints=6,
    )


def test_a_mixture_delivers_each_sources_cells_whole(tmp_path, counts):
    other = random_counts(50, N_GENES, seed=9, density=0.2)
    paths = [str(write_dense(tmp_path / "a.slaf", counts)),
             str(write_dense(tmp_path / "b.slaf", other))]  # fmt: skip
    with Loader(Mixture(paths), tokenizer="sparse", batch_size=16) as loader:
        batches = list(loader)
    seen = {0: np.zeros_like(counts), 1: np.zeros_like(other)}
    for batch in batches:
        rows = sparse_csr(batch, N_GENES).to_dense().numpy()
        for source, cell, row in zip(batch["source"].tolist(), batch["cell_integer_id"].tolist(),
                                     rows, strict=True):  # fmt: skip
            seen[source][cell] = row
    np.testing.assert_array_equal(seen[0], counts)
    np.testing.assert_array_equal(seen[1], other)


@pytest.mark.parametrize("layout", ["padded", "longest"])
def test_padded_layouts_are_refused_with_the_fix(unsorted_atlas, layout):
    with pytest.raises(LayoutError, match="use layout='packed'"):
        Loader(str(unsorted_atlas), tokenizer="sparse", layout=layout)


def test_max_genes_is_refused_since_every_gene_is_kept(unsorted_atlas):
    with pytest.raises(ValueError, match="takes no max_genes"):
        Loader(str(unsorted_atlas), tokenizer="sparse", max_genes=64)
    with pytest.raises(ValueError, match="takes no max_genes"):
        make_tokenizer("sparse", max_genes=8)


def test_a_tokenizer_keeping_every_gene_gets_no_budget_whoever_made_it():
    class KeepsAll(Sparse):
        name = "keeps_all"  # a third party's, not registered

    for tokenizer in ["sparse", Sparse(), KeepsAll(), KeepsAll]:
        assert token_budget(tokenizer, 64) == {}, tokenizer
    for tokenizer in ["raw", "geneformer", make_tokenizer("scgpt"), "geneformer-v2", "nope"]:
        assert token_budget(tokenizer, 64) == {"max_genes": 64}, tokenizer


def test_device_tokenizing_is_refused(unsorted_atlas):
    with pytest.raises(LayoutError, match="tokenize_on='producer'"):
        Loader(str(unsorted_atlas), tokenizer="sparse", tokenize_on="device", device="cpu")


def test_sparse_csr_names_what_a_batch_lacks(unsorted_atlas):
    with Loader(str(unsorted_atlas), batch_size=4, max_genes=8) as loader:
        batch = next(iter(loader))
    with pytest.raises(LayoutError, match=r"lacks \['cu_seqlens', 'gene_ids', 'values'\]"):
        sparse_csr(batch, N_GENES)
