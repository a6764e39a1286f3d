"""Tokenizers against independent numpy references of the published methods."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from conftest import (
    assert_rank_value_tokens,
    geneformer_reference,
    random_counts,
    scgpt_reference,
    unsorted_csr,
    write_dense,
)

import slafload.tokenizers.builtin
from slafload import open_dataset
from slafload.pipeline.chunk import assemble, shuffle
from slafload.pipeline.ranking import rank
from slafload.pipeline.reader import Reader
from slafload.samplers import Fetch
from slafload.tokenizers import (
    CLS,
    PAD,
    SEP,
    Geneformer,
    Raw,
    ScGPT,
    available_tokenizers,
    make_tokenizer,
    quantile_bins,
)
from slafload.tools.writer import write_slaf


def ranked_chunk(path, n_cells, seed=None):
    ds = open_dataset(path)
    fetch = Fetch(0, np.array([[0, n_cells]]), seed)
    chunk = assemble(fetch, Reader(ds).read(fetch), ds.cell_start)
    return rank(shuffle(chunk, seed))


@pytest.mark.parametrize("max_genes", [2, 5, 12, 64])
def test_geneformer_equals_rank_value_encoding_reference(tmp_path, max_genes):
    dense = random_counts(120, 30, seed=3, empty_every=11)
    ranked = ranked_chunk(write_dense(tmp_path / "a.slaf", dense), 120, seed=7)
    out = Geneformer(max_genes=max_genes)(ranked)
    cells = ranked.output_cell_ids
    want = np.stack([geneformer_reference(dense[c], max_genes) for c in cells])
    np.testing.assert_array_equal(out["input_ids"], want)
    np.testing.assert_array_equal(out["attention_mask"], want != PAD)
    assert out["input_ids"].dtype == np.int64 and out["attention_mask"].dtype == bool


@pytest.mark.parametrize("block", [7, 256])  # cells binned at a time (empty cells at edges)
@pytest.mark.parametrize(("max_genes", "n_bins"), [(4, 5), (16, 11), (64, 51)])
def test_scgpt_equals_quantile_binning_reference(tmp_path, monkeypatch, max_genes, n_bins, block):
    monkeypatch.setattr(slafload.tokenizers.builtin, "BIN_BLOCK_CELLS", block)
    dense = random_counts(150, 40, seed=5, max_count=30, density=0.5, empty_every=13)
    ranked = ranked_chunk(write_dense(tmp_path / "a.slaf", dense), 150, seed=1)
    out = ScGPT(max_genes=max_genes, n_bins=n_bins)(ranked)
    refs = [scgpt_reference(dense[c], max_genes, n_bins) for c in ranked.output_cell_ids]
    np.testing.assert_array_equal(out["input_ids"], np.stack([r[0] for r in refs]))
    np.testing.assert_array_equal(out["values"], np.stack([r[1] for r in refs]))
    np.testing.assert_array_equal(out["attention_mask"], out["input_ids"] != PAD)


@pytest.mark.parametrize("block", [1, 13, 256])
def test_scgpt_binning_is_exact_for_float_values_with_ties(tmp_path, monkeypatch, block):
    monkeypatch.setattr(slafload.tokenizers.builtin, "BIN_BLOCK_CELLS", block)
    rng = np.random.default_rng(0)
    dense = np.round(rng.lognormal(0, 1, size=(80, 25)), 1).astype(np.float32)
    dense[rng.random(dense.shape) > 0.6] = 0
    dense[5] = 0
    dense[6, :] = 2.5  # all-equal values
    path = write_dense(tmp_path / "f.slaf", dense, value_type=pa.float32())
    ranked = ranked_chunk(path, 80)
    out = np.full(len(ranked.values), 99, dtype=np.uint8)
    assert quantile_bins(ranked, 21, dtype=np.uint8, out=out) is out
    bins = quantile_bins(ranked, 21)
    np.testing.assert_array_equal(out, bins)
    for i, cell in enumerate(ranked.cell_ids):
        row = dense[cell]
        genes = ranked.genes[ranked.indptr[i] : ranked.indptr[i + 1]]
        if len(genes) == 0:
            continue
        edges = np.quantile(row[row > 0], np.linspace(0, 1, 20))
        np.testing.assert_array_equal(
            bins[ranked.indptr[i] : ranked.indptr[i + 1]], np.digitize(row[genes], edges)
        )
    assert bins.min() >= 1 and bins.max() <= 20


def test_empty_cells_become_cls_sep_sentences(tmp_path):
    dense = random_counts(20, 10, seed=2)
    dense[[0, 7, 19]] = 0
    ranked = ranked_chunk(write_dense(tmp_path / "e.slaf", dense), 20)
    empty_rows = np.flatnonzero(np.isin(ranked.output_cell_ids, [0, 7, 19]))
    gf = Geneformer(max_genes=6)(ranked)["input_ids"][empty_rows]
    np.testing.assert_array_equal(gf, np.tile([CLS, SEP, PAD, PAD, PAD, PAD], (3, 1)))
    sc = ScGPT(max_genes=4)(ranked)
    np.testing.assert_array_equal(sc["input_ids"][empty_rows], np.tile([1, 2, 0, 0, 0, 0], (3, 1)))
    assert not sc["values"][empty_rows].any()
    raw = Raw(max_genes=5)(ranked)
    assert (raw["lengths"][empty_rows] == 0).all()
    assert (raw["gene_ids"][empty_rows] == -1).all()


def test_raw_mode_yields_each_cells_sparse_expression(tmp_path):
    dense = random_counts(50, 12, seed=4)
    ranked = ranked_chunk(write_dense(tmp_path / "r.slaf", dense), 50, seed=3)
    out = Raw(max_genes=12)(ranked)
    for row, cell in enumerate(ranked.output_cell_ids):
        n = out["lengths"][row]
        assert n == np.count_nonzero(dense[cell])
        rebuilt = np.zeros(12, dtype=np.float32)
        rebuilt[out["gene_ids"][row, :n]] = out["values"][row, :n]
        np.testing.assert_array_equal(rebuilt, dense[cell])
        assert (out["gene_ids"][row, n:] == -1).all()


def test_make_tokenizer_resolves_names_and_instances():
    assert {"geneformer", "scgpt", "raw"} <= set(available_tokenizers())
    assert make_tokenizer("scgpt", max_genes=8, n_bins=5).n_bins == 5
    gf = Geneformer(max_genes=4)
    assert make_tokenizer(gf) is gf
    with pytest.raises(ValueError, match="unknown tokenizer 'nope'"):
        make_tokenizer("nope")
    with pytest.raises(TypeError, match="tokenizer must be a name or a Tokenizer"):
        make_tokenizer(object())


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (Geneformer, {"max_genes": 1}, "max_genes must be an integer >= 2"),
        (ScGPT, {"n_bins": 2}, "n_bins must be an integer >= 3"),
        (Raw, {"max_genes": 0}, "max_genes must be a positive integer"),
    ],
)
def test_tokenizer_arguments_are_validated(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_tokens_do_not_depend_on_the_gene_order_cells_are_stored_in(tmp_path):
    dense = random_counts(150, 40, seed=8, density=0.5, max_count=4, empty_every=11)
    path = write_slaf(tmp_path / "u.slaf", [unsorted_csr(dense, seed=8)], n_genes=40,
                      max_rows_per_file=57)  # fmt: skip
    assert_rank_value_tokens(path, dense)


def test_scgpt_binning_matches_numpy_on_many_random_cells():
    from slafload.types import RankedChunk

    rng = np.random.default_rng(5)
    for trial in range(60):
        lengths = rng.integers(0, 40, 30)
        pools = [rng.integers(1, 4, 40), rng.random(40) * 5, np.array([0.1, 0.2, 1 / 3, 1e-7])]
        cells = [np.sort(rng.choice(pools[trial % 3], k))[::-1] for k in lengths]
        values = np.concatenate(cells).astype(np.float64 if trial % 3 else np.uint16)
        indptr = np.concatenate([[0], np.cumsum(lengths)])
        ranked = RankedChunk(0, np.arange(30), indptr, np.zeros(len(values), np.int64),
                             values, rng.permutation(30))  # fmt: skip
        for n_bins in (3, 7, 51):
            bins = quantile_bins(ranked, n_bins)
            for i, cell in enumerate(cells):
                if len(cell):
                    edges = np.quantile(cell.astype(values.dtype), np.linspace(0, 1, n_bins - 1))
                    want = np.digitize(cell.astype(values.dtype), edges)
                    np.testing.assert_array_equal(bins[indptr[i] : indptr[i + 1]], want)
