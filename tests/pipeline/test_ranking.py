"""Ranking: value descending, gene id ascending on ties, zeros dropped, one window pass."""

from __future__ import annotations

import numpy as np
from conftest import random_counts, ranked_genes, write_dense

from slafload import open_dataset
from slafload.pipeline.chunk import assemble, shuffle
from slafload.pipeline.ranking import rank
from slafload.pipeline.reader import Reader
from slafload.samplers import Fetch


def read_chunk(path, ranges, seed=None):
    ds = open_dataset(path)
    fetch = Fetch(0, np.array(ranges), seed)
    return shuffle(assemble(fetch, Reader(ds).read(fetch), ds.cell_start), seed)


def test_genes_are_ranked_by_value_then_gene_id(tmp_path):
    dense = random_counts(60, 25, seed=9, max_count=3)  # few distinct values: many ties
    ranked = rank(read_chunk(write_dense(tmp_path / "a.slaf", dense), [[0, 60]]))
    for i, cell in enumerate(ranked.cell_ids):
        got = ranked.genes[ranked.indptr[i] : ranked.indptr[i + 1]]
        np.testing.assert_array_equal(got, ranked_genes(dense[cell]))
        values = ranked.values[ranked.indptr[i] : ranked.indptr[i + 1]]
        assert (np.diff(values.astype(np.int64)) <= 0).all()


def test_explicit_zeros_are_not_expressed_genes(tmp_path):
    import pyarrow as pa

    from slafload.tools.writer import CsrBlock, write_slaf

    block = CsrBlock(np.array([0, 3, 5]), np.array([0, 1, 2, 0, 4]), np.array([0, 5, 0, 1, 0]))
    path = write_slaf(tmp_path / "z.slaf", [block], n_genes=5, value_type=pa.uint16())
    ranked = rank(read_chunk(path, [[0, 2]]))
    np.testing.assert_array_equal(ranked.lengths, [1, 1])
    np.testing.assert_array_equal(ranked.genes, [1, 0])


def test_entry_helpers_place_each_gene_at_its_output_row_and_rank(tmp_path):
    dense = random_counts(40, 10, seed=2)
    ranked = rank(read_chunk(write_dense(tmp_path / "a.slaf", dense), [[5, 25], [30, 40]], seed=11))
    assert sorted(ranked.output_cell_ids) == [*range(5, 25), *range(30, 40)]
    for e in range(0, len(ranked.genes), 7):
        cell = ranked.output_cell_ids[ranked.entry_row[e]]
        assert ranked_genes(dense[cell])[ranked.entry_rank[e]] == ranked.genes[e]


def _polars_rank(chunk, monkeypatch):
    from slafload.pipeline import ranking

    with monkeypatch.context() as m:
        m.setattr(ranking, "rank_by_keys", lambda *args: None)
        return rank(chunk)


def test_key_sort_ranks_exactly_as_the_polars_window_for_every_dtype(monkeypatch):
    from slafload.pipeline.ranking import rank_by_keys
    from slafload.types import Chunk

    rng = np.random.default_rng(0)
    cases = [  # (gene dtype, value dtype, genes, value range): 32-bit, 64-bit and Polars keys
        (np.uint16, np.uint16, 20000, 60000),
        (np.int32, np.int32, 60000, 100000),
        (np.int32, np.float32, 30000, 100),
        (np.uint32, np.uint32, 1 << 20, 1 << 30),
        (np.int64, np.int64, 5000, 1 << 40),
        (np.int32, np.float64, 5000, 100),
        (np.uint16, np.float16, 5000, 100),
    ]
    for gene_type, value_type, n_genes, top in cases:
        lengths = rng.integers(0, 60, 300)
        indptr = np.concatenate([[0], np.cumsum(lengths)])
        genes = np.concatenate([np.sort(rng.choice(n_genes, k, replace=False)) for k in lengths])
        values = rng.integers(0, top, indptr[-1])  # zeros included: they are dropped
        if np.dtype(value_type).kind == "f":
            values = values * rng.choice([1, 0.5, 1e-3], indptr[-1])
        chunk = Chunk(0, np.arange(300), indptr, genes.astype(gene_type),
                      values.astype(value_type), rng.permutation(300))  # fmt: skip
        got, want = rank(chunk), _polars_rank(chunk, monkeypatch)
        for name in ("indptr", "genes", "values"):
            a, b = getattr(got, name), getattr(want, name)
            # Older Polars (1.0, the lowest CI tests) hand float16 values back as float32: compare
            # the values exactly, and the dtype where Polars keeps it.
            same_dtype = a.dtype == b.dtype or (a.dtype == np.float16 and b.dtype == np.float32)
            assert same_dtype and np.array_equal(a, b), (gene_type, value_type, name)
        keyed = rank_by_keys(np.array([0, 2]), np.array([1, 2], gene_type), np.ones(2, value_type))
        assert (keyed is None) == (value_type == np.float64)
