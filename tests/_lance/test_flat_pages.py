"""Flat page reads of local Lance 2.0 data files: every row as Lance reads it, or Lance reads it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import lance
import numpy as np
import pyarrow as pa
import pytest
from conftest import random_counts, write_dense
from lance.file import LanceFileReader, LanceFileWriter

import slafload._lance.data_files as data_files
import slafload._lance.flat_pages as flat_pages
import slafload.kernels
from slafload import Loader, open_dataset
from slafload._lance.data_files import DataFiles
from slafload._lance.file_format import FlatFiles
from slafload._lance.flat_pages import FlatFile
from slafload._lance.flat_reads import FlatRange, read_ranges
from slafload._lance.footer import PAGE
from slafload.kernels import NUMPY, Kernels, numba_available, prepare_reads
from slafload.pipeline.buffers import BytePool, size_class
from slafload.pipeline.reader import COLUMNS
from slafload.samplers import BlockShuffle
from slafload.tools.optimize import optimize

pytestmark = pytest.mark.usefixtures("no_thread_leak")
BACKENDS = ["numpy"] + (["numba"] if numba_available() else [])
SCHEMA = pa.schema(
    [("cell_integer_id", pa.uint32()), ("gene_integer_id", pa.uint16()), ("value", pa.float32())]
)


def write_file(path, rows: int, *, version="2.0", max_page_bytes=None, nulls=False) -> pa.Table:
    rng = np.random.default_rng(rows)
    values = pa.array(rng.random(rows, dtype=np.float32))
    if nulls:
        values = pa.array([None if i % 7 == 0 else v for i, v in enumerate(values.to_pylist())],
                          pa.float32())  # fmt: skip
    table = pa.table(
        [pa.array(np.arange(rows, dtype=np.uint32) // 5),
         pa.array(rng.integers(0, 60_000, rows).astype(np.uint16)), values],
        schema=SCHEMA,
    )  # fmt: skip
    with LanceFileWriter(str(path), SCHEMA, version=version, max_page_bytes=max_page_bytes) as w:
        w.write_batch(table)
    return table


@pytest.fixture(params=BACKENDS)
def kernels(request):
    k = Kernels(request.param)
    prepare_reads(k)
    yield k
    k.close()


def test_ranges_read_as_lance_reads_them_across_page_boundaries(tmp_path, kernels):
    path = tmp_path / "paged.lance"
    table = write_file(path, 20_000, max_page_bytes=8 << 10)  # pages of ~2-4k rows
    pages = LanceFileReader(str(path)).metadata().columns[0].pages
    assert len(pages) > 3
    flat = FlatFile.open(str(path), SCHEMA.names)
    assert flat is not None and flat.num_rows == 20_000
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 20_000, 60)
    ranges = [FlatRange(flat, int(a), int(rng.integers(0, 20_000 - a + 1))) for a in starts]
    ranges += [FlatRange(flat, 0, 20_000), FlatRange(flat, 19_999, 1), FlatRange(flat, 7, 0)]
    for (_, a, n), got in zip(ranges, read_ranges(ranges, kernels), strict=True):
        assert got.schema == SCHEMA
        assert got.equals(table.slice(a, n)), (a, n)
    some = flat.read(123, 4_567)
    assert some.equals(table.slice(123, 4_567))
    with pytest.raises(IndexError):
        flat.read(19_990, 11)
    flat.close()


def test_a_projection_reads_only_its_columns_in_its_order(tmp_path):
    path = tmp_path / "f.lance"
    table = write_file(path, 1_000)
    flat = FlatFile.open(str(path), ["value", "gene_integer_id"])
    assert flat is not None
    assert flat.read(10, 90).equals(table.select(["value", "gene_integer_id"]).slice(10, 90))
    assert FlatFile.open(str(path), ["value", "no_such_column"]) is None
    flat.close()


def test_files_that_are_not_flat_are_left_to_lance(tmp_path):
    write_file(tmp_path / "v22.lance", 1_000, version="2.2")
    write_file(tmp_path / "v21.lance", 1_000, version="2.1")
    write_file(tmp_path / "nulls.lance", 1_000, nulls=True)
    for name in ("v22", "v21", "nulls"):
        path = str(tmp_path / f"{name}.lance")
        assert FlatFile.open(path, SCHEMA.names, mini=False) is None, name
    for name in ("v22", "v21"):  # mini-block pages: tests/_lance/test_miniblock.py
        assert FlatFile.open(str(tmp_path / f"{name}.lance"), SCHEMA.names) is not None, name
    assert FlatFile.open(str(tmp_path / "nulls.lance"), SCHEMA.names) is None
    nested = tmp_path / "nested.lance"
    schema = pa.schema([("a", pa.uint32()), ("b", pa.list_(pa.uint16()))])
    with LanceFileWriter(str(nested), schema, version="2.0") as w:
        w.write_batch(pa.table({"a": pa.array([1, 2], pa.uint32()),
                                "b": pa.array([[1], [2, 3]], pa.list_(pa.uint16()))}))  # fmt: skip
    assert FlatFile.open(str(nested), ["a"]) is None  # column numbering differs: not ours
    assert FlatFile.open(str(tmp_path / "missing.lance"), SCHEMA.names) is None


def test_a_file_whose_flat_read_disagrees_with_lance_is_left_to_lance(
    tmp_path, monkeypatch, caplog
):
    path = tmp_path / "f.lance"
    write_file(path, 1_000)
    real = flat_pages._column

    def shifted(kind, pages, num_rows):  # misreads where the values start
        column = real(kind, pages, num_rows)
        if column is None:
            return None
        width = column.dtype.itemsize
        return column._replace(positions=tuple(p + width for p in column.positions))

    monkeypatch.setattr(flat_pages, "_column", shifted)
    with caplog.at_level(logging.WARNING, logger="slafload._lance.flat_pages"):
        assert FlatFile.open(str(path), SCHEMA.names) is None
    assert "disagrees with Lance" in caplog.text


def test_files_after_the_first_open_from_their_footers_and_read_as_lance_reads_them(
    tmp_path, lance_opens
):
    tables = {}
    for i, (rows, page_bytes) in enumerate([(3_000, None), (20_000, 8 << 10), (1, None),
                                            (100_000, 2 << 10), (5_000, 4 << 10)]):  # fmt: skip
        path = str(tmp_path / f"{i}.lance")
        tables[path] = write_file(path, rows, max_page_bytes=page_bytes)
    paths = list(tables)
    # ~150 pages a column: more metadata than the first tail read, so a second read of it
    assert len(LanceFileReader(paths[3]).metadata().columns[0].pages) > 100
    through_lance = lance_opens
    files = FlatFiles()
    opened = [files.open(path, SCHEMA.names) for path in paths]
    assert through_lance == paths[:1] and files.format is not None  # only the first
    projected = files.open(paths[1], ["value", "cell_integer_id"])
    assert projected is not None and through_lance == paths[:1]
    assert projected.read(5, 1_000).equals(
        tables[paths[1]].select(["value", "cell_integer_id"]).slice(5, 1_000)
    )
    rng = np.random.default_rng(1)
    for flat, path in zip(opened, paths, strict=True):
        assert flat is not None
        table, n = tables[path], tables[path].num_rows
        assert flat.read(0, n).equals(table)
        assert flat.read(0, n).equals(LanceFileReader(path).read_all().to_table())
        starts = rng.integers(0, n, 20)
        ranges = [FlatRange(flat, int(a), int(rng.integers(0, n - a + 1))) for a in starts]
        for (_, a, m), got in zip(ranges, read_ranges(ranges), strict=True):
            assert got.equals(table.slice(a, m)), (path, a, m)
        with pytest.raises(IndexError):
            flat.read(n, 1)
        flat.close()


def test_a_file_unlike_the_format_is_opened_through_lance_or_left_to_it(tmp_path):
    first = str(tmp_path / "first.lance")
    write_file(first, 1_000)
    files = FlatFiles()
    assert files.open(first, SCHEMA.names) is not None
    form = files.format
    assert form is not None
    wide = str(tmp_path / "wide.lance")  # another schema: float64 values
    schema = pa.schema([("cell_integer_id", pa.uint32()), ("gene_integer_id", pa.uint16()),
                        ("value", pa.float64())])  # fmt: skip
    table = pa.table([pa.array(np.arange(500, dtype=np.uint32)),
                      pa.array(np.arange(500, dtype=np.uint16)),
                      pa.array(np.linspace(0, 1, 500))], schema=schema)  # fmt: skip
    with LanceFileWriter(wide, schema, version="2.0") as w:
        w.write_batch(table)
    assert form.open(wide, SCHEMA.names) is None
    flat = files.open(wide, SCHEMA.names)  # Lance's metadata still finds it flat
    assert flat is not None and flat.read(0, 500).equals(table)
    flat.close()
    nulls = str(tmp_path / "nulls.lance")
    write_file(nulls, 1_000, nulls=True)
    assert form.open(nulls, SCHEMA.names) is None and files.open(nulls, SCHEMA.names) is None
    for name, damage in [("magic", lambda b: b[:-1] + b"X"), ("short", lambda b: b[-30:]),
                         ("metadata", lambda b: b[:-200] + bytes(160) + b[-40:]),
                         ("offsets", lambda b: b[:-40] + bytes([255] * 24) + b[-16:])]:  # fmt: skip
        broken = tmp_path / f"{name}.lance"
        broken.write_bytes(damage((tmp_path / "first.lance").read_bytes()))
        assert form.open(str(broken), SCHEMA.names) is None, name  # no error: Lance's turn


def test_a_footer_that_lists_other_pages_than_lance_leaves_the_file_to_lance(tmp_path, monkeypatch):
    paths = [str(tmp_path / f"{i}.lance") for i in range(3)]
    for path in paths:
        write_file(path, 2_000, max_page_bytes=4 << 10)
    real = flat_pages.read_footer

    def shifted(fd, status=None):  # misreads where each page starts
        footer = real(fd, status)
        rec = list(footer.rec)
        for index in range(footer.n_columns):
            _, n, k = footer.column(index)
            for _ in range(n):  # a page's record: PAGE fields (buffers the 4th), positions, sizes
                m = rec[k + 3]
                k += PAGE
                rec[k : k + m] = [p + 4 for p in rec[k : k + m]]
                k += 2 * m
        return footer._replace(rec=rec)

    monkeypatch.setattr(flat_pages, "read_footer", shifted)
    files = FlatFiles()
    # The pages' encodings are the footer's: where its pages are not Lance's, nothing is read
    # flat and no format is learned.
    assert [files.open(path, SCHEMA.names) for path in paths] == [None] * len(paths)
    assert files.format is None
    monkeypatch.setattr(flat_pages, "read_footer", real)
    flat = files.open(paths[0], SCHEMA.names)
    assert flat is not None and files.format is not None
    assert flat.read(0, 2_000).equals(LanceFileReader(paths[0]).read_all().to_table())
    flat.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_file_cut_short_after_opening_raises(tmp_path, backend):
    path = tmp_path / "f.lance"
    write_file(path, 50_000)
    flat = FlatFile.open(str(path), SCHEMA.names)
    assert flat is not None
    os.truncate(path, 1_000)
    kernels = Kernels(backend)
    prepare_reads(kernels)
    with pytest.raises(OSError, match="unexpected end of file"):
        read_ranges([FlatRange(flat, 100, 10), FlatRange(flat, 40_000, 5_000)], kernels)
    kernels.close()
    flat.close()


def test_byte_pool_reuses_a_buffer_once_no_view_of_it_is_alive():
    pool = BytePool(keep=1 << 20)
    a = pool.take(10_000)
    view = a[10:20].view(np.uint16)
    b = pool.take(5_000)
    assert not np.shares_memory(a, b)  # a is in use
    assert pool.held == size_class(10_000) + size_class(5_000) == 10_240 + 5_120
    del a, view
    c = pool.take(9_000)  # the first buffer is free again and large enough
    assert pool.held == 15_360 and len(c) == 9_000 and pool.in_use == 15_360
    table = pa.table({"x": pa.array(c[:8].view(np.uint64))})  # Arrow keeps it alive too
    del b, c
    assert pool.in_use == 10_240
    d = pool.take(10_100)  # rows a little over the first's, within its size class
    assert pool.held == 15_360 + 10_240 and len(d) == 10_100
    del table, d
    e = pool.take(10_200)  # ... reuse a free buffer of that class
    assert pool.held == 25_600 and pool.in_use == 10_240 and len(e) == 10_200
    big = pool.take(2 << 20)  # beyond what is kept: fresh, not held
    assert len(big) == 2 << 20 and pool.held <= 1 << 20


def test_byte_pool_drops_free_small_buffers_to_make_room():
    pool = BytePool(keep=10_000)
    pool.take(6_000)  # dropped at once: free
    x = pool.take(9_000)
    assert pool.held == size_class(9_000) and len(x) == 9_000


def test_size_classes_are_at_most_an_eighth_above_the_request():
    sizes = np.unique(np.geomspace(1, 1 << 34, 5_000).astype(np.int64)).tolist()
    got = [size_class(n) for n in sizes]
    assert all(n <= c <= max(4096, n * 9 / 8) for n, c in zip(sizes, got, strict=True))
    assert len({size_class(n) for n in range((1 << 20) + 1, (1 << 21) + 1)}) == 8  # a doubling


def test_run_without_start_never_starts_a_compile_thread():
    kernels = Kernels("auto")
    args = [np.zeros(0, np.int64)] * 4 + [np.zeros(0, np.uint8), np.zeros(1, np.int64)]
    kernels.run("pread_runs", *args, start=False)  # runs if compiled, else does nothing
    assert kernels._compiler is None  # no compile thread was started
    assert not NUMPY.run("pread_runs", *args, start=False)


@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
def test_the_read_kernel_is_cached_on_disk_and_loads_in_a_new_process():
    code = (
        "from slafload import kernels as k\n"
        "x = k.Kernels('numba'); k.prepare_reads(x)\n"
        "(d,) = [v for key, v in k._COMPILED.items() if key[0] == 'pread_runs']\n"
        "print(sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values()))\n"
    )
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=120) for _ in range(2)]  # fmt: skip
    hits, misses = map(int, runs[1].stdout.split())
    assert (hits, misses) == (1, 0), runs[1].stdout  # the second process loaded it


def test_without_libc_pread_the_reads_use_preadv(tmp_path, monkeypatch):
    monkeypatch.setattr(slafload.kernels, "_HAS_PREAD", False)
    kernels = Kernels("auto")
    prepare_reads(kernels)  # nothing to compile
    assert kernels._compiler is None
    path = tmp_path / "f.lance"
    table = write_file(path, 1_000)
    flat = FlatFile.open(str(path), SCHEMA.names)
    assert flat is not None
    (got,) = read_ranges([FlatRange(flat, 10, 900)], kernels)
    assert got.equals(table.slice(10, 900))
    flat.close()
    kernels.close()


@pytest.fixture
def atlas20(tmp_path):
    dense = random_counts(500, 60, seed=11, density=0.3, empty_every=19)
    path = write_dense(tmp_path / "a.slaf", dense, max_rows_per_file=397)
    optimize(path, progress=False)  # Lance 2.0: the flat path
    return path


def loader_batches(path, **config):
    with Loader(open_dataset(path), sampler=BlockShuffle(block_size=3, fetch_factor=4),
                batch_size=16, tokenizer="scgpt", max_genes=24, seed=5, **config) as loader:  # fmt: skip
        return [{k: v.numpy() for k, v in batch.items()} for batch in loader]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_loader_reads_flat_files_with_identical_tokens(
    atlas20, flat_opens, read_paths, backend
):
    opened = flat_opens
    flat = loader_batches(atlas20, kernels=backend)
    assert opened and all(f is not None for f in opened)
    n_opened = len(opened)
    read_paths(flat=False)
    through_lance = loader_batches(atlas20, kernels=backend)
    assert len(opened) == n_opened  # flat=False never opens a file flat
    assert len(flat) == len(through_lance) > 0
    for x, y in zip(flat, through_lance, strict=True):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def test_data_files_read_flat_and_through_lance_alike(atlas20):
    expression = lance.dataset(str(atlas20 / "expression.lance"))
    flat = DataFiles.of(expression, COLUMNS)
    lance_only = DataFiles.of(expression, COLUMNS, flat=False)
    assert flat is not None and lance_only is not None
    n = expression.count_rows()
    rng = np.random.default_rng(3)
    starts = np.sort(rng.integers(0, n - 50, 40))
    rows = np.stack([starts, starts + rng.integers(1, 50, 40)], axis=1)
    wanted = [None if i % 3 else np.array([[a, a + 1]]) for i, (a, _) in enumerate(rows.tolist())]
    a = [pa.Table.from_batches(list(x)) for x in flat.read(rows, COLUMNS, wanted)]
    b = [pa.Table.from_batches(list(x)) for x in lance_only.read(rows, COLUMNS, wanted)]
    assert all(x.equals(y) for x, y in zip(a, b, strict=True))
    assert any(isinstance(e.reader, FlatFile) for e in flat._open.values())
    assert not any(isinstance(e.reader, FlatFile) for e in lance_only._open.values())


def test_flat_reads_of_spans_read_only_the_rows_kept(atlas20):
    expression = lance.dataset(str(atlas20 / "expression.lance"))
    flat = DataFiles.of(expression, COLUMNS, threads=1)
    lance_only = DataFiles.of(expression, COLUMNS, flat=False, threads=1)
    assert flat is not None and lance_only is not None
    n = expression.count_rows()
    rows = np.array([[0, 900], [1_000, 2_500], [2_600, n]], dtype=np.int64)  # across files
    wanted = [np.array([[3, 5], [100, 180], [850, 900]]), np.zeros((0, 2), np.int64),
              np.array([[2_600, 2_601], [n - 40, n]])]  # fmt: skip
    kept_rows = sum(int((w[:, 1] - w[:, 0]).sum()) for w in wanted)
    schema = pa.schema([expression.schema.field(c) for c in COLUMNS])
    a = [pa.Table.from_batches(list(x), schema) for x in flat.read(rows, COLUMNS, wanted)]
    b = [pa.Table.from_batches(list(x), schema) for x in lance_only.read(rows, COLUMNS, wanted)]
    for x, y, w in zip(a, b, wanted, strict=True):
        assert x.num_rows == y.num_rows == int((w[:, 1] - w[:, 0]).sum())
        assert x.num_rows == 0 or x.equals(y)
    row_bytes = sum(f.type.bit_width // 8 for f in schema)
    assert flat._pool.held <= size_class(kept_rows * row_bytes + 64 * 8 * 3)  # no gap rows
    assert flat._pool.held < (n - 2_600) * row_bytes / 10


def test_windows_are_cut_at_a_piece_count_and_a_row_count():
    files = [(0, [(0, 0, 10), (1, 10, 10)]), (1, [(2, 0, 100), (3, 100, 5), (4, 105, 5)]),
             (2, [(5, 0, 1), (6, 1, 1), (7, 2, 1), (8, 3, 1)])]  # fmt: skip
    cut = data_files._windows(files, 3, first=True, max_rows=50)
    assert [[k for _, k, _, _ in w] for w in cut] == [[0], [1], [2], [3, 4, 5], [6, 7, 8]]
    assert sum(len(w) for w in data_files._windows(files, 2, first=False)) == 9


def test_flat_reads_are_chosen_for_local_2_0_tables_only(atlas20, tmp_path):
    expression = lance.dataset(str(atlas20 / "expression.lance"))
    assert DataFiles.of(expression, COLUMNS).flat
    assert not DataFiles.of(expression, COLUMNS, flat=False).flat
    as_written = write_dense(tmp_path / "v22.slaf", random_counts(50, 20, seed=2))
    v22 = lance.dataset(str(as_written / "expression.lance"))
    assert not DataFiles.of(v22, COLUMNS).flat  # no 2.0 file: never tried


def test_a_mixture_of_2_0_atlases_reads_flat_with_identical_tokens(
    atlas20, tmp_path, monkeypatch, read_paths
):
    other = write_dense(tmp_path / "b.slaf", random_counts(300, 60, seed=12, density=0.2),
                        max_rows_per_file=233)  # fmt: skip
    optimize(other, progress=False)
    pools: set[int] = set()
    real_init = DataFiles.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        pools.add(id(self._pool))

    monkeypatch.setattr(DataFiles, "__init__", spy)

    def run():
        with Loader([atlas20, other], sampler=BlockShuffle(block_size=4, fetch_factor=2),
                    batch_size=16, max_genes=24, seed=9) as loader:  # fmt: skip
            return [{k: v.numpy() for k, v in batch.items()} for batch in loader]

    flat = run()
    assert len(pools) == 1  # both sources' readers share one pool
    read_paths(flat=False)
    through_lance = run()
    assert len(flat) == len(through_lance) > 0
    for x, y in zip(flat, through_lance, strict=True):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def test_nans_at_either_end_still_agree_and_a_failing_check_leaves_the_file_to_lance(
    tmp_path, monkeypatch
):
    path = tmp_path / "nan.lance"
    table = write_file(path, 100)
    values = table.column("value").to_numpy().copy()
    values[[0, 99]] = np.nan
    table = table.set_column(2, "value", pa.array(values))
    with LanceFileWriter(str(path), SCHEMA, version="2.0") as w:
        w.write_batch(table)
    flat = FlatFile.open(str(path), SCHEMA.names)
    assert flat is not None
    np.testing.assert_array_equal(flat.read(0, 100).column("value").to_numpy(), values)
    flat.close()

    def broken(self, *args):
        raise OSError("the check's own read failed")

    monkeypatch.setattr(FlatFile, "_agrees", broken)
    assert FlatFile.open(str(path), SCHEMA.names) is None  # no error: Lance reads it
    assert FlatFile.open(str(path), SCHEMA.names, check=False) is not None


def test_a_2_2_table_keeps_the_reader_it_opened_to_check_the_schema(tmp_path):
    as_written = write_dense(tmp_path / "v22.slaf", random_counts(50, 20, seed=2))
    files = DataFiles.of(lance.dataset(str(as_written / "expression.lance")), COLUMNS)
    assert files is not None and not files.flat
    assert [e.reader is not None for e in files._open.values()] == [True]
