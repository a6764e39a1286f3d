"""Ranking: value descending, gene id ascending on ties, zeros dropped, one window pass."""

from __future__ import annotations

import numpy as np
from conftest import random_counts, ranked_genes, write_dense

from slafload import open_dataset
from slafload.chunk import assemble, shuffle
from slafload.ranking import rank
from slafload.reader import Reader
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
