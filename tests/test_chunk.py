"""Reader and chunk assembly: whole cells across tiny Lance fragments, every row checked."""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa
import pytest
from conftest import random_counts, write_dense

from slafload import InconsistentDataError, open_dataset
from slafload.chunk import assemble, shuffle
from slafload.reader import Reader
from slafload.samplers import ChunkShuffle, Fetch


def test_cells_split_across_tiny_fragments_arrive_whole(tmp_path):
    dense = random_counts(200, 30, seed=6, density=0.5, empty_every=9)
    path = write_dense(tmp_path / "t.slaf", dense, max_rows_per_file=13)
    ds = open_dataset(path)
    assert len(ds.expression.get_fragments()) > 100
    plan = ChunkShuffle(chunk_cells=17).plan(ds.n_cells, seed=0, epoch=0)
    reader = Reader(ds, batch_rows=5)
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
            lambda c: c["gene_integer_id"].__setitem__(
                slice(10, 12), c["gene_integer_id"][11:9:-1]
            ),
            "not strictly ascending",
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
        assemble(fetch, Reader(ds).read(fetch), ds.cell_start)


@pytest.mark.parametrize(("start", "stop", "size"), [(0, 60, 100), (0, 60, 7), (5, 43, 8)])
def test_split_cuts_a_shuffled_chunk_into_ordered_pieces(tmp_path, start, stop, size):
    from slafload.chunk import split

    dense = random_counts(60, 9, seed=4, empty_every=6)
    ds = open_dataset(write_dense(tmp_path / "s.slaf", dense))
    fetch = Fetch(0, np.array([[0, 60]]))
    chunk = shuffle(assemble(fetch, Reader(ds).read(fetch), ds.cell_start), 3)
    pieces = list(split(chunk, start, stop, size))
    assert all(p.n_cells <= size for p in pieces)
    cells = np.concatenate([p.cell_ids[p.order] for p in pieces])
    np.testing.assert_array_equal(cells, chunk.cell_ids[chunk.order[start:stop]])
    for piece in pieces:
        for i, cell in enumerate(piece.cell_ids):
            genes = piece.genes[piece.indptr[i] : piece.indptr[i + 1]]
            np.testing.assert_array_equal(genes, np.flatnonzero(dense[cell]))
