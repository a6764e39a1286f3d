"""Reader and chunk assembly: whole cells across tiny Lance fragments, every row checked."""

from __future__ import annotations

import itertools

import lance
import numpy as np
import pyarrow as pa
import pytest
from conftest import csr_from_dense, random_counts, unsorted_csr, write_dense

import slafload.pipeline.chunk
from slafload import InconsistentDataError, open_dataset
from slafload.pipeline.buffers import size_class
from slafload.pipeline.chunk import assemble, shuffle
from slafload.pipeline.reader import Reader, ReadOptions
from slafload.samplers import ChunkShuffle, Fetch
from slafload.tools.optimize import optimize
from slafload.tools.writer import CsrBlock, write_slaf


def test_cells_split_across_tiny_fragments_arrive_whole(tmp_path):
    dense = random_counts(200, 30, seed=6, density=0.5, empty_every=9)
    path = write_dense(tmp_path / "t.slaf", dense, max_rows_per_file=13)
    ds = open_dataset(path)
    assert len(ds.expression.get_fragments()) > 100
    plan = ChunkShuffle(chunk_cells=17).plan(ds.n_cells, seed=0, epoch=0)
    reader = Reader(ds, ReadOptions(batch_rows=5))
    seen = []
    for fetch in plan:
        chunk = assemble(fetch, reader.read(fetch), ds.cell_start)
        for i, cell in enumerate(chunk.cell_ids):
            genes = chunk.genes[chunk.indptr[i] : chunk.indptr[i + 1]]
            np.testing.assert_array_equal(genes, np.flatnonzero(dense[cell]))
            np.testing.assert_array_equal(
                chunk.values[chunk.indptr[i] : chunk.indptr[i + 1]], dense[cell][genes]
            )
        seen.append(chunk.cell_ids)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(200))


def read_all(path):
    ds = open_dataset(path)
    fetch = Fetch(0, np.array([[0, ds.n_cells]]))
    return assemble(
        fetch, Reader(ds, ReadOptions(batch_rows=7)).read(fetch), ds.cell_start, n_genes=ds.n_genes
    )


def cell_rows(chunk, i):
    rows = slice(chunk.indptr[i], chunk.indptr[i + 1])
    return chunk.genes[rows], chunk.values[rows]


def test_cells_stored_in_any_gene_order_arrive_ascending_and_only_they_are_sorted(
    tmp_path, monkeypatch
):
    dense = random_counts(80, 30, seed=7, density=0.5, empty_every=9)
    shuffled = unsorted_csr(dense, seed=7)
    in_order = csr_from_dense(dense)
    # Every third cell keeps its ascending order: those must not be sorted again.
    ascending = np.repeat(np.arange(80) % 3 == 0, np.diff(in_order.indptr))
    genes = np.where(ascending, in_order.genes, shuffled.genes)
    values = np.where(ascending, in_order.values, shuffled.values)
    path = write_slaf(tmp_path / "u.slaf", [CsrBlock(in_order.indptr, genes, values)],
                      n_genes=30, max_rows_per_file=23)  # fmt: skip
    sorted_cells = []
    real = slafload.pipeline.chunk._sort_cells
    monkeypatch.setattr(
        slafload.pipeline.chunk, "_sort_cells", lambda *a: sorted_cells.append(a[-1]) or real(*a)
    )
    chunk = read_all(path)
    for i in range(80):
        got_genes, got_values = cell_rows(chunk, i)
        np.testing.assert_array_equal(got_genes, np.flatnonzero(dense[i]))
        np.testing.assert_array_equal(got_values, dense[i][got_genes])
    stored = np.split(genes.astype(np.int64), in_order.indptr[1:-1])
    out_of_order = [c for c in range(80) if (np.diff(stored[c]) < 0).any()]
    assert len(out_of_order) > 40
    assert np.concatenate(sorted_cells).tolist() == out_of_order
    sorted_cells.clear()
    read_all(write_dense(tmp_path / "s.slaf", dense, max_rows_per_file=23))
    assert sorted_cells == []  # data stored ascending pays no sort


@pytest.mark.parametrize("storage", ["ascending", "shuffled"])
@pytest.mark.parametrize(("value_type", "big"), [(pa.uint16(), 40_000), (pa.float32(), 2.5)])
def test_duplicate_entries_of_a_gene_in_a_cell_are_summed(tmp_path, storage, value_type, big):
    # Cell 0: gene 3 twice and gene 1 three times; cell 1: gene 0 twice; cell 2: no duplicates.
    indptr = np.array([0, 7, 10, 12])
    genes = np.array([1, 1, 1, 2, 3, 3, 5, 0, 0, 4, 2, 6])
    values = np.array([1, 2, big, 7, big, big, 1, 3, 4, 9, 5, 6], dtype=np.float64)
    if storage == "shuffled":
        order = np.concatenate([[6, 4, 1, 3, 0, 5, 2], [8, 9, 7], [11, 10]])
        genes, values = genes[order], values[order]
    path = write_slaf(tmp_path / "d.slaf", [CsrBlock(indptr, genes, values)], n_genes=7,
                      value_type=value_type)  # fmt: skip
    chunk = read_all(path)
    np.testing.assert_array_equal(chunk.indptr, [0, 4, 6, 8])
    np.testing.assert_array_equal(chunk.genes, [1, 2, 3, 5, 0, 4, 2, 6])
    np.testing.assert_allclose(chunk.values, [3 + big, 7, 2 * big, 1, 7, 9, 5, 6])
    if value_type == pa.uint16():  # 80,000 does not fit uint16: the sum widens, never wraps
        assert chunk.values.dtype == np.uint64


def test_a_fetch_of_scattered_ranges_reads_exactly_those_cells(tmp_path):
    dense = random_counts(100, 10, seed=1)
    ds = open_dataset(write_dense(tmp_path / "t.slaf", dense, max_rows_per_file=7))
    fetch = Fetch(0, np.array([[90, 95], [3, 4], [40, 42]]))
    chunk = assemble(fetch, Reader(ds).read(fetch), ds.cell_start)
    np.testing.assert_array_equal(chunk.cell_ids, [90, 91, 92, 93, 94, 3, 40, 41])
    np.testing.assert_array_equal(chunk.lengths, np.count_nonzero(dense[chunk.cell_ids], 1))


def test_shuffle_permutes_the_output_order_reproducibly(tmp_path):
    ds = open_dataset(write_dense(tmp_path / "t.slaf", random_counts(50, 5)))
    fetch = Fetch(0, np.array([[0, 50]]))
    chunk = assemble(fetch, Reader(ds).read(fetch), ds.cell_start)
    a, b = shuffle(chunk, 1), shuffle(chunk, 1)
    np.testing.assert_array_equal(a.order, b.order)
    assert sorted(a.order) == list(range(50)) and list(a.order) != list(range(50))
    assert shuffle(chunk, None) is chunk


def _rewrite_expression(path, mutate):
    table = lance.dataset(str(path / "expression.lance")).to_table()
    columns = {n: table.column(n).to_numpy().copy() for n in table.column_names}
    mutate(columns)
    lance.write_dataset(
        pa.table({n: pa.array(v).cast(table.schema.field(n).type) for n, v in columns.items()}),
        str(path / "expression.lance"),
        mode="overwrite",
    )


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda c: c["gene_integer_id"].__setitem__(11, 10),  # genes.lance has 10 genes
            "holds gene 10 in cell",
        ),
        (
            lambda c: c["cell_integer_id"].__setitem__(40, c["cell_integer_id"][40] + 1),
            "belongs to cell",
        ),
    ],
)
def test_rows_contradicting_the_layout_fail_loudly(tmp_path, mutate, message):
    path = write_dense(tmp_path / "t.slaf", random_counts(30, 10, seed=2, density=0.9))
    _rewrite_expression(path, mutate)
    ds = open_dataset(path)
    fetch = Fetch(0, np.array([[0, 30]]))
    with pytest.raises(InconsistentDataError, match=message):
        assemble(fetch, Reader(ds).read(fetch), ds.cell_start, n_genes=ds.n_genes)


@pytest.mark.parametrize(("start", "stop", "size"), [(0, 60, 100), (0, 60, 7), (5, 43, 8)])
def test_cuts_of_a_shuffled_chunk_gather_into_ordered_pieces(tmp_path, start, stop, size):
    from slafload.pipeline.chunk import cuts

    dense = random_counts(60, 9, seed=4, empty_every=6)
    ds = open_dataset(write_dense(tmp_path / "s.slaf", dense))
    fetch = Fetch(0, np.array([[0, 60]]))
    chunk = shuffle(assemble(fetch, Reader(ds).read(fetch), ds.cell_start), 3)
    pieces = [cut.gather() for cut in cuts(chunk, start, stop, size)]
    assert all(p.n_cells <= size for p in pieces)
    cells = np.concatenate([p.cell_ids[p.order] for p in pieces])
    np.testing.assert_array_equal(cells, chunk.cell_ids[chunk.order[start:stop]])
    for piece in pieces:
        for i, cell in enumerate(piece.cell_ids):
            genes = piece.genes[piece.indptr[i] : piece.indptr[i + 1]]
            np.testing.assert_array_equal(genes, np.flatnonzero(dense[cell]))


def test_the_row_check_finds_every_misplaced_row_and_names_the_first():
    """The cheap check (first/last row of each cell, ids ascending within a range) agrees
    with the full comparison against the expected column, row for row.
    """
    from slafload.pipeline.chunk import _misplaced_row

    rng = np.random.default_rng(7)
    lengths_of = rng.integers(0, 4, 40)  # empty cells included
    ranges = np.array([[30, 36], [2, 5], [2, 5], [18, 19], [0, 1], [38, 40]])  # repeats, unsorted
    cell_ids = Fetch(0, ranges).cell_ids()
    lengths = lengths_of[cell_ids]
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    good = np.repeat(cell_ids, lengths).astype(np.uint32)
    assert _misplaced_row(good, cell_ids, indptr, ranges) is None
    for row in range(len(good)):
        for wrong in {int(good[row]) - 1, int(good[row]) + 1, int(rng.integers(0, 41))} - {
            int(good[row]),
            -1,
        }:
            corrupt = good.copy()
            corrupt[row] = wrong
            assert _misplaced_row(corrupt, cell_ids, indptr, ranges) == row
    shifted = np.roll(good, 1)  # offsets off by one row: every boundary moves
    expected = int(np.flatnonzero(shifted != good)[0])
    assert _misplaced_row(shifted, cell_ids, indptr, ranges) == expected


def test_the_order_check_finds_exactly_the_steps_inside_cells_that_do_not_go_up():
    from slafload.pipeline.chunk import _unordered_steps

    rng = np.random.default_rng(7)
    for _ in range(500):
        lengths = rng.integers(0, 6, int(rng.integers(1, 8)))
        indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        genes = rng.integers(0, 6, int(indptr[-1])).astype(np.uint16)
        want = [i for a, b in itertools.pairwise(indptr.tolist())
                for i in range(a, b - 1) if genes[i + 1] <= genes[i]]  # fmt: skip
        assert _unordered_steps(genes, indptr).tolist() == want


def test_a_column_whose_chunks_lie_back_to_back_is_taken_without_a_copy():
    values = np.arange(1, 1001, dtype=np.uint32)
    whole = pa.array(values)
    touching = pa.chunked_array([whole.slice(0, 300), whole.slice(300, 0), whole.slice(300, 700)])
    got = slafload.pipeline.chunk._back_to_back(touching)
    assert got is not None and np.shares_memory(got, values)
    np.testing.assert_array_equal(got, values)
    assert not got.flags.writeable  # Arrow's memory: read-only, as combine_chunks' is
    apart = pa.chunked_array([whole.slice(0, 300), whole.slice(301, 699)])  # a row skipped
    swapped = pa.chunked_array([whole.slice(300, 700), whole.slice(0, 300)])
    others = pa.chunked_array([whole.slice(0, 300), pa.array(values[300:].copy())])
    for column in (apart, swapped, others, pa.chunked_array([], pa.uint32())):
        assert slafload.pipeline.chunk._back_to_back(column) is None
    assert slafload.pipeline.chunk._back_to_back(pa.chunked_array([[True, False]])) is None


def test_a_block_fetch_read_flat_becomes_a_chunk_without_copying_its_rows(tmp_path):
    # ~600 rows a cell: blocks far apart, each read on its own, by two read threads.
    dense = random_counts(400, 2000, seed=8, density=0.3, empty_every=11)
    path = write_dense(tmp_path / "t.slaf", dense)
    optimize(path, progress=False, rows_per_file=20_000)  # Lance 2.0: the flat reader
    ds = open_dataset(path)
    fetch = Fetch(0, np.array([[300, 302], [12, 15], [100, 103], [390, 391], [60, 62]]))
    reader = Reader(ds)
    batches = list(reader.read(fetch))
    assert len(batches) >= 4
    chunk = assemble(fetch, batches, ds.cell_start)
    want = assemble(fetch, Reader(ds, ReadOptions(direct=False)).read(fetch), ds.cell_start)
    for name in ("indptr", "genes", "values", "cell_ids"):
        np.testing.assert_array_equal(getattr(chunk, name), getattr(want, name), err_msg=name)
    read_genes = batches[0].column("gene_integer_id").to_numpy()
    assert np.shares_memory(chunk.genes, read_genes)  # the read's own buffer, not a copy
    # The cell ids, only checked, had a buffer of their own: it is free once the read is
    # dropped, while the chunk holds the genes' and values'.
    pool = reader.data_files()._pool
    del batches, read_genes
    kept = chunk.genes.nbytes + chunk.values.nbytes
    assert kept <= pool.in_use <= size_class(kept + 16) < pool.held
