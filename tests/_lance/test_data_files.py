"""Direct data-file reads: exactly take_scan's rows, and a fallback wherever they would not be."""

from __future__ import annotations

import gc
import resource
import subprocess
import sys
import threading
import time

import lance
import numpy as np
import pyarrow as pa
import pytest
from conftest import random_counts, write_dense

from slafload import open_dataset
from slafload._lance.data_files import DataFiles
from slafload.pipeline.reader import COLUMNS, Reader, ReadOptions
from slafload.samplers import BlockShuffle


@pytest.fixture
def dataset(tmp_path):
    dense = random_counts(500, 30, seed=4, density=0.3, empty_every=13)
    return open_dataset(write_dense(tmp_path / "d.slaf", dense, max_rows_per_file=173))


def rows_of(batches) -> pa.Table:
    return pa.Table.from_batches(list(batches)) if batches else None


def test_every_range_reads_the_same_rows_as_take_scan_across_file_boundaries(dataset):
    files = DataFiles.of(dataset.expression, COLUMNS)
    assert files is not None and files.n_files > 10
    rng = np.random.default_rng(0)
    starts = np.sort(rng.choice(dataset.n_rows - 400, size=40, replace=False))
    rows = np.stack([starts, starts + rng.integers(1, 400, size=40)], axis=1)
    got = files.read(rows, COLUMNS)
    for (a, b), batches in zip(rows.tolist(), got, strict=True):
        want = pa.Table.from_batches(list(dataset.expression._ds.take_scan([(a, b)], COLUMNS)))
        assert pa.Table.from_batches(batches).equals(want)


def test_only_the_wanted_rows_of_each_span_are_kept_and_the_gaps_let_go(dataset):
    files = DataFiles.of(dataset.expression, COLUMNS)
    spans = np.array([[0, 1200], [1500, 1600], [1700, 2400]], dtype=np.int64)
    wanted = [
        np.array([[3, 9], [170, 180], [1100, 1200]]),  # sparse, across file boundaries
        np.array([[1500, 1600]]),  # the whole span
        np.array([[1700, 2000], [2000, 2300], [2300, 2390]]),  # dense, touching
        None,  # the whole span
    ]
    spans = np.concatenate([spans, [[0, 500]]])
    got = files.read(spans, COLUMNS, wanted)
    for keep, span, batches in zip(wanted, spans.tolist(), got, strict=True):
        keep = np.array([span]) if keep is None else keep
        ids = [i for a, b in keep.tolist() for i in range(a, b)]
        want = dataset.expression.take(ids, columns=COLUMNS)
        assert pa.Table.from_batches(list(batches)).equals(want)
    # The sparse span's rows were copied out: its batches hold 116 rows' bytes, not 1,200's.
    sparse = sum(b.get_total_buffer_size() for b in got[0])
    assert sparse < 3 * 116 * 8 * 2
    row_bytes = dataset.expression.take(list(range(1200)), columns=COLUMNS).nbytes / 1200
    assert sparse < 0.2 * 1200 * row_bytes


def test_repeated_and_scattered_cells_read_in_order_across_file_boundaries(dataset):
    # Sampling with replacement repeats a cell; where it straddles two data files, its rows
    # must still come whole, once per repeat, as take_scan gives them.
    from slafload.types import Fetch

    start = dataset.cell_start
    straddle = np.flatnonzero(start[1:] // 173 > start[:-1] // 173)
    rng = np.random.default_rng(3)
    cells = np.sort(np.concatenate([rng.choice(500, 40), straddle, straddle[::2]]))
    fetch = Fetch(0, np.stack([cells, cells + 1], axis=1))
    got = rows_of(list(Reader(dataset).read(fetch)))
    want = rows_of(list(Reader(dataset, ReadOptions(direct=False)).read(fetch)))
    assert len(straddle) > 5 and got.equals(want)


def test_scattered_cells_keep_only_their_rows_in_memory(dataset):
    # Every 25th cell: one span of ~220 rows per wanted ~9, read through the open file
    # readers: the batches handed on hold the wanted rows alone.
    from slafload.types import Fetch

    cells = np.arange(0, 500, 25)
    fetch = Fetch(0, np.stack([cells, cells + 1], axis=1))
    got = list(Reader(dataset).read(fetch))
    want = rows_of(list(Reader(dataset, ReadOptions(direct=False)).read(fetch)))
    assert rows_of(got).equals(want)
    held = sum(b.get_total_buffer_size() for b in got)
    assert held <= 2 * want.nbytes < dataset.cell_start[-1]  # not the span's ~20x


def test_a_tiny_reader_cache_still_reads_exactly(dataset):
    files = DataFiles.of(dataset.expression, COLUMNS, max_open=1)
    rows = np.array([[900, 950], [10, 20], [2000, 2300], [11, 12]], dtype=np.int64)
    got = [pa.Table.from_batches(b) for b in files.read(rows, COLUMNS)]
    for (a, b), table in zip(rows.tolist(), got, strict=True):
        assert table.equals(dataset.expression.take(list(range(a, b)), columns=COLUMNS))
    assert len(files._open) == 1


def test_the_reader_takes_the_direct_path_and_its_fetches_match_take_scan(dataset):
    direct, scan = Reader(dataset), Reader(dataset, ReadOptions(direct=False))
    plan = BlockShuffle(block_size=4, fetch_factor=2, batch_size=8).plan(500, seed=1, epoch=0)
    for fetch in plan:
        got, want = rows_of(list(direct.read(fetch))), rows_of(list(scan.read(fetch)))
        assert (got is None and want is None) or got.equals(want)
    assert direct.data_files() is not None and scan.data_files() is None


def test_a_table_with_deleted_rows_reads_the_same_rows_as_take_scan(dataset):
    lance.dataset(dataset.expression.uri).delete("gene_integer_id = 3 OR cell_integer_id = 0")
    deleted = lance.dataset(dataset.expression.uri)
    files = DataFiles.of(deleted, COLUMNS)
    assert files is not None and int(files.starts[-1]) == deleted.count_rows()
    rows = np.array([[0, 5], [100, 700], [1500, 1600], [3000, deleted.count_rows()]])
    for (a, b), batches in zip(rows.tolist(), files.read(rows, COLUMNS), strict=True):
        want = pa.Table.from_batches(list(deleted._ds.take_scan([(a, b)], COLUMNS)))
        assert pa.Table.from_batches(batches).equals(want)


def test_a_table_with_an_added_column_file_falls_back(tmp_path):
    path = write_dense(tmp_path / "c.slaf", random_counts(50, 10, seed=1), max_rows_per_file=40)
    expression = lance.dataset(str(path / "expression.lance"))
    expression.add_columns({"extra": "value * 2"})
    assert DataFiles.of(lance.dataset(expression.uri), COLUMNS) is None


def test_listing_the_data_files_leaves_no_garbage_for_the_cyclic_collector(dataset):
    # pylance's DataFile.path builds a new class on each access: a few cyclic objects per data
    # file, for the collector to walk and free (slafload/_lance/_compat.py: data_file_path).
    assert len(dataset.expression.get_fragments()) > 10
    gc.collect()
    gc.disable()
    try:
        files = DataFiles.of(dataset.expression, COLUMNS)
        unreachable = gc.collect()
    finally:
        gc.enable()
    assert files is not None and files.n_files > 10
    assert unreachable < files.n_files


def test_pieces_cut_ranges_at_file_boundaries():
    files = DataFiles(["a", "b", "c"], np.array([0, 10, 20, 30]))
    which, file, lo, n = files.pieces(np.array([[5, 25], [10, 11], [29, 30]]))
    assert which.tolist() == [0, 0, 0, 1, 2]
    assert file.tolist() == [0, 1, 2, 1, 2]
    assert lo.tolist() == [5, 0, 0, 0, 9]
    assert n.tolist() == [5, 10, 5, 1, 1]


@pytest.mark.parametrize("threads", [1, 3])
def test_direct_reads_in_a_loader_deliver_the_same_batches(dataset, threads, read_paths):
    from slafload import Loader, Tuning

    sampler = BlockShuffle(block_size=3, fetch_factor=4, batch_size=16)
    runs = []
    for reader in ("lance", "direct"):  # take_scan everywhere, then the direct path forced
        if reader == "direct":
            read_paths(direct=True)
            reader = "auto"
        with Loader(dataset, sampler=sampler, batch_size=16, max_genes=8,
                    tuning=Tuning(read_threads=threads, reader=reader)) as loader:  # fmt: skip
            runs.append([b["input_ids"].numpy() for b in loader])
    assert len(runs[0]) == len(runs[1])
    for a, b in zip(*runs, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("threads", [1, 4])
def test_background_reads_match_take_scan_with_a_reader_cache_smaller_than_the_fetch(
    dataset, threads, monkeypatch
):
    monkeypatch.setattr("slafload._lance.data_files.STREAMS_AT_ONCE", 7)  # several windows
    files = DataFiles.of(dataset.expression, COLUMNS, max_open=2, threads=threads)
    assert files is not None and files.threads == threads
    rng = np.random.default_rng(3)
    starts = np.sort(rng.choice(dataset.n_rows - 400, size=40, replace=False))
    rows = np.stack([starts, starts + rng.integers(1, 400, size=40)], axis=1)
    for _ in range(2):  # the second time through, readers are reused and evicted again
        got = files.read(rows, COLUMNS)
        for (a, b), batches in zip(rows.tolist(), got, strict=True):
            want = pa.Table.from_batches(list(dataset.expression._ds.take_scan([(a, b)], COLUMNS)))
            assert pa.Table.from_batches(list(batches)).equals(want)
    assert len(files._open) == 2


@pytest.mark.parametrize("threads", [1, 2])
def test_a_background_read_that_fails_raises_when_its_range_is_used(dataset, threads, monkeypatch):
    monkeypatch.setattr("slafload._lance.data_files.STREAMS_AT_ONCE", 1)  # a window per range
    files = DataFiles.of(dataset.expression, COLUMNS, threads=threads)
    broken = int(np.searchsorted(files.starts, 1000, side="right")) - 1
    files.paths[broken] = files.paths[broken] + ".missing"
    got = files.read(np.array([[0, 5], [1000, 1001]], dtype=np.int64), COLUMNS)
    assert sum(b.num_rows for b in got[0]) == 5
    with pytest.raises(Exception, match="missing|not found|No such file"):
        list(got[1])


@pytest.mark.parametrize("threads", [1, 3])
def test_the_first_range_is_ready_while_the_rest_of_the_fetch_is_still_being_read(
    dataset, threads, monkeypatch
):
    """The read-ahead waits for a fetch's first range: that must cost one read, not a task's
    share of the fetch (every other read is held here until the first range is in hand).
    """
    files = DataFiles.of(dataset.expression, COLUMNS, threads=threads)
    rows = np.array([[a, a + 30] for a in range(0, 3000, 150)], dtype=np.int64)
    first = (int(files.pieces(rows)[1][0]), int(files.pieces(rows)[2][0]))
    release, held = threading.Event(), []
    stream = DataFiles._stream

    def holding(self, index, cols, start, n):
        if (index, start) != first:
            held.append(index)
            assert release.wait(timeout=60), "the first range waited for a held read"
        return stream(self, index, cols, start, n)

    monkeypatch.setattr(DataFiles, "_stream", holding)
    got = files.read(rows, COLUMNS)
    ready: list[pa.Table] = []
    reader = threading.Thread(target=lambda: ready.append(pa.Table.from_batches(got[0])))
    reader.start()
    reader.join(timeout=30)
    assert ready, "the first range is not ready while the other reads are held"
    for _ in range(600):  # other reads have started and are being held
        if held:
            break
        time.sleep(0.05)
    assert held
    release.set()
    for (a, b), batches in zip(rows.tolist(), got, strict=True):
        assert pa.Table.from_batches(batches).equals(
            dataset.expression.take(list(range(a, b)), columns=COLUMNS)
        )
    assert ready[0].num_rows == 30


def test_reads_use_more_threads_by_default_on_object_stores(dataset):
    from slafload._lance.data_files import LOCAL_THREADS, REMOTE_THREADS, flat_threads, is_remote

    assert DataFiles.of(dataset.expression, COLUMNS).threads == LOCAL_THREADS  # Lance reads
    assert REMOTE_THREADS > LOCAL_THREADS > 1
    # Local files read flat: one thread per core, 2 to LOCAL_THREADS (their Python waits for
    # the GIL).
    assert 2 <= flat_threads() <= LOCAL_THREADS
    assert DataFiles(["/a"], np.array([0, 10]), flat=True).threads == flat_threads()
    assert DataFiles(["/a"], np.array([0, 10]), flat=False).threads == LOCAL_THREADS
    assert is_remote("s3://bucket/a.slaf") and is_remote("gs://b/x")
    assert not is_remote("/tmp/a.slaf") and not is_remote("file:///tmp/a.slaf")
    with pytest.raises(ValueError, match="threads must be >= 1"):
        DataFiles(["a"], np.array([0, 10]), threads=0)


@pytest.mark.parametrize("hard", [None, 80])
def test_a_low_open_files_limit_is_raised_so_every_data_file_stays_open(dataset, hard):
    """In a child process (the limit is process-wide): soft limit 64, the table 25 data files."""
    n_files = DataFiles.of(dataset.expression, COLUMNS).n_files
    if hard is None and resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 4 * n_files:
        pytest.skip("this machine's hard open-files limit is below what the test raises to")
    code = f"""
import logging, resource, sys
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, {hard} or hard))
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
from slafload import open_dataset
from slafload._lance.data_files import DataFiles
from slafload.pipeline.reader import COLUMNS
files = DataFiles.of(open_dataset({str(dataset.uri)!r}).expression, COLUMNS)
print("RESULT", files.max_open, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    max_open, soft = map(int, run.stdout.split("RESULT")[1].split())
    if hard is None:  # room to raise it: every reader stays open, and no warning
        assert (soft, max_open) == (4 * n_files, n_files)
        assert "raised the soft open-files limit from 64 to 100" in run.stdout
        assert "WARNING" not in run.stdout
    else:  # raised as far as the hard limit goes, and the user is told how to go further
        assert (soft, max_open) == (80, 20) and n_files > 20
        assert f"has {n_files} data files" in run.stdout and "ulimit -n" in run.stdout
