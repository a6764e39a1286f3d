"""Reader read paths: one scan, coalesced spans (take_scan), row-id takes; all exact."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pytest
from conftest import random_counts, write_dense

import slafload.pipeline.reader
from slafload import ReadError, open_dataset
from slafload.pipeline.reader import Reader, ReadOptions, coalesce
from slafload.samplers import Fetch


@pytest.fixture
def dataset(tmp_path):
    dense = random_counts(400, 25, seed=2, density=0.4, empty_every=11)
    return open_dataset(write_dense(tmp_path / "r.slaf", dense, max_rows_per_file=101))


def read_cells(reader: Reader, fetch: Fetch) -> np.ndarray:
    batches = list(reader.read(fetch))
    assert all(b.num_rows > 0 for b in batches)
    if not batches:
        return np.zeros(0, dtype=np.int64)
    return pa.Table.from_batches(batches).column("cell_integer_id").to_numpy()


def expected_cells(ds, fetch: Fetch) -> np.ndarray:
    cells = fetch.cell_ids()
    return np.repeat(cells, np.diff(ds.cell_start)[cells])


FETCHES = [
    [[0, 400]],
    [[5, 6]],
    [[11, 12]],  # an empty cell: no rows, no batch
    [[300, 320], [3, 9], [100, 101], [101, 130]],  # unsorted ranges
    [[10, 20], [10, 20], [15, 17]],  # repeated and overlapping ranges (with replacement)
    [[i, i + 1] for i in range(0, 400, 3)],  # many single cells with short gaps
    [[i, i + 4] for i in range(0, 400, 50)],  # blocks far apart
]


@pytest.mark.parametrize("ranges", FETCHES)
@pytest.mark.parametrize(
    ("max_gap", "take_below", "scan_from"),
    [(32_768, 512, 1 << 18), (0, 0, 1 << 18), (0, 10**6, 1 << 18), (50, 0, 40), (10**6, 0, 1)],
)
def test_every_read_path_yields_exactly_the_fetch_rows_in_range_order(
    dataset, monkeypatch, ranges, max_gap, take_below, scan_from
):
    monkeypatch.setattr(slafload.pipeline.reader, "MAX_GAP_ROWS", max_gap)
    monkeypatch.setattr(slafload.pipeline.reader, "TAKE_BELOW_ROWS", take_below)
    monkeypatch.setattr(slafload.pipeline.reader, "SCAN_FROM_ROWS", scan_from)
    monkeypatch.setattr(slafload.pipeline.reader, "DIRECT_SCAN_FROM_ROWS", scan_from)
    fetch = Fetch(0, np.array(ranges, dtype=np.int64))
    np.testing.assert_array_equal(
        read_cells(Reader(dataset), fetch), expected_cells(dataset, fetch)
    )


@pytest.mark.parametrize(("direct", "scanners"), [(True, 0), (False, 1)])
def test_long_spans_go_through_the_open_file_readers_on_local_files(
    dataset, monkeypatch, direct, scanners
):
    monkeypatch.setattr(slafload.pipeline.reader, "SCAN_FROM_ROWS", 40)
    monkeypatch.setattr(slafload.pipeline.reader, "DIRECT_SCAN_FROM_ROWS", 10**6)
    reader, scans = Reader(dataset, ReadOptions(direct=direct)), []
    scan = reader._scan
    monkeypatch.setattr(reader, "_scan", lambda *a: scans.append(a) or scan(*a))
    fetch = Fetch(0, np.array([[0, 30], [200, 201]], dtype=np.int64))  # a span over 40 rows
    assert int(np.diff(dataset.cell_start[[0, 30]])[0]) >= 40
    np.testing.assert_array_equal(read_cells(reader, fetch), expected_cells(dataset, fetch))
    assert len(scans) == scanners


def test_touching_ranges_are_read_as_one_scan(dataset, monkeypatch):
    # a mixed fetch's block may end one of its source's fetches and start the next, adjacent
    reader, scans = Reader(dataset), []
    scan = reader._scan
    monkeypatch.setattr(reader, "_scan", lambda *a: scans.append(a) or scan(*a))
    fetch = Fetch(0, np.array([[40, 90], [90, 91], [91, 130]], dtype=np.int64))
    np.testing.assert_array_equal(read_cells(reader, fetch), expected_cells(dataset, fetch))
    assert [s[:2] for s in scans] == [tuple(dataset.cell_start[[40, 130]].tolist())]
    batches = list(reader.read(fetch, cell_ids=False))  # checked rows: scanned without ids
    assert all("cell_integer_id" not in b.schema.names for b in batches)


def test_ranges_coalesce_across_short_forward_gaps_only():
    rows = np.array([[0, 5], [7, 9], [100, 110], [50, 60], [60, 61]])
    np.testing.assert_array_equal(coalesce(rows, 2), [0, 0, 1, 2, 2])
    np.testing.assert_array_equal(coalesce(rows, 0), [0, 1, 2, 3, 3])


def test_a_storage_failure_raises_read_error_naming_the_fetch(dataset):
    shutil.rmtree(f"{dataset.uri}/expression.lance/data")
    fetch = Fetch(7, np.array([[1, 3], [200, 240]]))
    with pytest.raises(ReadError, match=r"Fetch\(index=7.*expression rows \[") as info:
        list(Reader(dataset).read(fetch))
    assert dataset.uri in str(info.value)


def test_started_pulls_the_first_item_now_and_defers_its_error():
    pulled = []

    def items():
        pulled.append(1)
        yield "a"
        yield "b"

    it = slafload.pipeline.reader.started(items())
    assert pulled == [1] and list(it) == ["a", "b"]
    assert list(slafload.pipeline.reader.started(iter(()))) == []

    def failing():
        raise OSError("disk gone")
        yield

    it = slafload.pipeline.reader.started(failing())  # no error yet
    with pytest.raises(OSError, match="disk gone"):
        next(it)
