"""Tables edited after writing (renamed, dropped, cast and added columns, deleted rows) read
exactly as Lance reads them, on every read path.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings

import lance
import numpy as np
import pyarrow as pa
import pytest
from conftest import append_cell, random_counts, write_dense

from slafload import open_dataset
from slafload._lance._compat import deletion_array, version_skew
from slafload._lance.data_files import DataFiles
from slafload._lance.fragments import Deletions, deleted_rows
from slafload.errors import LanceVersionError, ReaderFallbackWarning
from slafload.kernels import NUMPY, Kernels, numba_available
from slafload.pipeline.reader import COLUMNS, Reader, ReadOptions
from slafload.samplers import BlockShuffle

pytestmark = pytest.mark.usefixtures("no_thread_leak")
N_CELLS, N_GENES = 400, 30


@pytest.fixture
def numba_kernels():
    if not numba_available():
        pytest.skip("numba is not installed")
    kernels = Kernels("numba")
    yield kernels
    kernels.close()


def paths(numba_kernels) -> dict[str, ReadOptions]:
    """Every way a fetch of scattered ranges is read."""
    return {
        "take_scan": ReadOptions(direct=False),
        "lance files": ReadOptions(direct=True, flat=False),
        "flat numpy": ReadOptions(direct=True, kernels=NUMPY, mini=False),
        "flat numba": ReadOptions(direct=True, kernels=numba_kernels, mini=True),
    }


def slaf_with_other(tmp_path, version: str):
    """A SLAF dataset whose expression table, in Lance format ``version``, has a fourth
    column ``other`` (uint16, unlike ``value`` everywhere), across many data files.
    """
    dense = random_counts(N_CELLS, N_GENES, seed=7, density=0.3, empty_every=11)
    path = write_dense(tmp_path / "d.slaf", dense)
    uri = str(path / "expression.lance")
    table = lance.dataset(uri).to_table()
    shutil.rmtree(uri)
    other = pa.array((np.arange(table.num_rows) * 7 + 1000) % 60000, pa.uint16())
    lance.write_dataset(
        table.append_column("other", other),
        uri,
        max_rows_per_file=300,
        data_storage_version=version,
    )
    return path


def swap(uri: str) -> None:
    ds = lance.dataset(uri)
    ds.alter_columns({"path": "value", "name": "tmp"})
    ds.alter_columns({"path": "other", "name": "value"})
    ds.alter_columns({"path": "tmp", "name": "other"})


def drop_and_rename(uri: str) -> None:
    ds = lance.dataset(uri)
    ds.drop_columns(["value"])
    lance.dataset(uri).alter_columns({"path": "other", "name": "value"})


def cast(uri: str) -> None:
    lance.dataset(uri).alter_columns({"path": "value", "data_type": pa.uint32()})


def add(uri: str) -> None:
    lance.dataset(uri).add_columns({"extra": "value * 2"})


EDITS = {"swap": swap, "drop and rename": drop_and_rename, "cast": cast, "add": add}


def read_all(reader: Reader, plan) -> pa.Table:
    tables = [pa.Table.from_batches(list(b)) for f in plan if (b := list(reader.read(f)))]
    return pa.concat_tables([t.select(COLUMNS).cast(tables[0].schema) for t in tables])


def lance_rows(dataset, plan) -> pa.Table:
    """The fetches' rows as Lance's own ``to_table()`` reads them."""
    whole = dataset.expression.to_table(columns=COLUMNS)
    start = dataset.cell_start
    parts = [whole.slice(start[a], start[b] - start[a]) for f in plan for a, b in f.ranges.tolist()]
    return pa.concat_tables(parts)


def assert_every_path_reads_as_lance(
    path, numba_kernels, version: str, *, warns: bool, pin: int | None = None
) -> None:
    dataset = open_dataset(path, version=pin)
    plan = list(
        BlockShuffle(block_size=3, fetch_factor=4, batch_size=8).plan(N_CELLS, seed=2, epoch=0)
    )
    want = lance_rows(dataset, plan)
    for name, options in paths(numba_kernels).items():
        reader = Reader(dataset, options)
        if not warns and options.direct:  # the path named is the one taken
            files = reader.data_files()
            flat = name == "flat numba" or (name == "flat numpy" and version == "2.0")
            assert files is not None and files.flat == flat, name
        if warns and options.direct:
            with pytest.warns(ReaderFallbackWarning, match="take_scan"):
                got = read_all(reader, plan)
        else:
            got = read_all(reader, plan)
        for column in COLUMNS:
            theirs = want.column(column).to_numpy()
            assert np.array_equal(got.column(column).to_numpy(), theirs), (name, column)


@pytest.mark.parametrize("version", ["2.0", "2.2"])  # flat pages; mini-block pages
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_table_reads_as_lance_reads_it_on_every_path(
    tmp_path, numba_kernels, version, edit
):
    path = slaf_with_other(tmp_path, version)
    uri = str(path / "expression.lance")
    EDITS[edit](uri)
    # a rename is read through the data files by field id; a column in a second data file
    # per fragment (cast, add) is left to Lance, with a warning
    split = edit in ("cast", "add")
    expression = lance.dataset(uri)
    assert (DataFiles.of(expression, COLUMNS) is None) == split
    assert_every_path_reads_as_lance(path, numba_kernels, version, warns=split)


def test_a_renamed_table_is_read_from_its_data_files_under_the_stored_names(tmp_path):
    path = slaf_with_other(tmp_path, "2.0")
    swap(str(path / "expression.lance"))
    files = DataFiles.of(lance.dataset(str(path / "expression.lance")), COLUMNS)
    assert files is not None and files.table is not None
    assert files.table.names["value"] == "other"
    got = pa.Table.from_batches(list(files.read(np.array([[5, 900]]), COLUMNS)[0]))
    want = lance.dataset(str(path / "expression.lance")).to_table(columns=COLUMNS)
    assert got.column_names == COLUMNS and got.equals(want.slice(5, 895))


def test_a_file_appended_after_a_rename_is_read_through_lance_with_one_warning(
    tmp_path, numba_kernels
):
    path = slaf_with_other(tmp_path, "2.0")
    uri = str(path / "expression.lance")
    lance.dataset(uri).drop_columns(["other"])
    swap_gene_and_value = [
        {"path": "gene_integer_id", "name": "tmp"},
        {"path": "value", "name": "gene_integer_id"},
        {"path": "tmp", "name": "value"},
    ]
    for change in swap_gene_and_value:
        lance.dataset(uri).alter_columns(change)
    append_cell(path, [1, 4, 9], [11, 12, 13])  # written as the table now names them
    dataset = open_dataset(path)
    assert dataset.n_cells == N_CELLS + 1
    plan = list(
        BlockShuffle(block_size=2, fetch_factor=4, batch_size=8).plan(N_CELLS + 1, seed=1, epoch=0)
    )
    want = lance_rows(dataset, plan)
    for name, options in paths(numba_kernels).items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = read_all(Reader(dataset, options), plan)
        fallback = [w for w in caught if issubclass(w.category, ReaderFallbackWarning)]
        assert len(fallback) == (1 if options.direct else 0), name
        assert got.select(COLUMNS).equals(want.cast(got.schema)), name


def delete_rows(path, predicate: str) -> None:
    """Delete expression rows and rewrite ``cell_start_index`` and ``config.json`` to match,
    as a user dropping bad cells or rows does.
    """
    uri = str(path / "expression.lance")
    lance.dataset(uri).delete(predicate)
    cell_ids = lance.dataset(uri).to_table(columns=["cell_integer_id"]).column(0).to_numpy()
    cells = lance.dataset(str(path / "cells.lance")).to_table()
    n_cells = cells.num_rows
    start = np.searchsorted(cell_ids, np.arange(n_cells)).astype(np.int64)
    index = cells.schema.get_field_index("cell_start_index")
    cells = cells.set_column(
        index, cells.schema.field(index), pa.array(start).cast(cells.schema.field(index).type)
    )
    lance.write_dataset(cells, str(path / "cells.lance"), mode="overwrite")
    config = json.loads((path / "config.json").read_text())
    config["metadata"]["expression_count"] = len(cell_ids)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("version", ["2.0", "2.2"])
def test_a_table_with_deleted_rows_reads_as_lance_reads_it_on_every_path(
    tmp_path, numba_kernels, version
):
    path = slaf_with_other(tmp_path, version)
    n_rows = lance.dataset(str(path / "expression.lance")).count_rows()
    # whole cells in the middle and at both ends, rows at file edges, scattered rows
    delete_rows(
        path,
        f"cell_integer_id IN (0, 1, 57, 58, {N_CELLS - 1}) OR other % 13 = 0 "
        f"OR other IN (1000, 1007, {1000 + 7 * (n_rows - 1)})",
    )
    expression = lance.dataset(str(path / "expression.lance"))
    assert sum(f.metadata.deletion_file is not None for f in expression.get_fragments()) > 3
    assert DataFiles.of(expression, COLUMNS) is not None
    assert_every_path_reads_as_lance(path, numba_kernels, version, warns=False)


def test_deleted_rows_map_live_pieces_to_physical_runs(tmp_path):
    uri = str(tmp_path / "t.lance")
    lance.write_dataset(pa.table({"x": np.arange(20, dtype=np.int64)}), uri)
    lance.dataset(uri).delete("x IN (0, 3, 4, 10, 19)")
    expression = lance.dataset(uri)
    deletions = Deletions(expression, {0: expression.get_fragments()[0].metadata.id})
    assert deletions.rows(0).tolist() == [0, 3, 4, 10, 19]
    live = [1, 2, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15, 16, 17, 18]
    for lo in range(len(live)):
        for n in range(1, len(live) - lo + 1):
            first, rows, kept = deletions.physical(0, lo, n, None)
            runs = np.array([[0, rows]]) if kept is None else kept
            got = [first + i for a, b in runs.tolist() for i in range(a, b)]
            assert got == live[lo : lo + n]
            keep = np.array([[0, 1], [n - 1, n]]) if n > 2 else None
            if keep is not None:
                first, rows, kept = deletions.physical(0, lo, n, keep)
                got = [first + i for a, b in kept.tolist() for i in range(a, b)]
                assert got == [live[lo], live[lo + n - 1]]


def forge_format(path, minor: int) -> None:
    """Rewrite the footer of every expression data file to say Lance format ``2.minor``, as
    a file from a pylance release newer than the installed one would."""
    for data in (path / "expression.lance" / "data").glob("*.lance"):
        raw = bytearray(data.read_bytes())
        raw[-6:-4] = minor.to_bytes(2, "little")  # the footer's minor version, before b"LANC"
        data.write_bytes(bytes(raw))


def test_a_format_the_installed_pylance_cannot_read_is_named_a_version_mismatch(tmp_path):
    path = write_dense(tmp_path / "d.slaf", random_counts(50, 10, seed=1))
    forge_format(path, 9)
    with pytest.raises(LanceVersionError) as raised:
        open_dataset(path)
    message = str(raised.value)
    assert "Lance version mismatch" in message and "Lance file format 2.9" in message
    assert f"pylance {lance.__version__}" in message and "Install the pylance release" in message
    assert "corrupt" not in message


def test_a_version_mismatch_while_reading_is_named_so_on_every_path(tmp_path, numba_kernels):
    path = write_dense(tmp_path / "d.slaf", random_counts(50, 10, seed=1), max_rows_per_file=90)
    opened = open_dataset(path)
    forge_format(path, 9)  # (a new session: the opened one caches the files' metadata)
    dataset = dataclasses.replace(opened, expression=lance.dataset(opened.expression.uri))
    plan = list(BlockShuffle(block_size=2, fetch_factor=2, batch_size=4).plan(50, seed=0, epoch=0))
    for options in paths(numba_kernels).values():
        with warnings.catch_warnings():  # the direct path cannot open the files: it says so
            warnings.simplefilter("ignore", ReaderFallbackWarning)
            with pytest.raises(LanceVersionError, match="Lance file format 2.9"):
                read_all(Reader(dataset, options), plan)


@pytest.mark.parametrize(
    ("error", "formats", "named"),
    [
        (
            OSError("Invalid user input: Unknown Lance storage version: 2.9, version.rs:271:5"),
            {},
            "Lance file format 2.9",
        ),
        (
            OSError("Not supported: miniblock encoding with 7 buffers"),
            {"cells": {(2, 2)}},
            "cells.lance: Lance 2.2",
        ),
        (OSError("Not supported: miniblock encoding with 7 buffers"), {"cells": {(2, 0)}}, None),
        (OSError("No such file or directory (os error 2)"), {"cells": {(2, 2)}}, None),
        (  # pylance 0.35 reading a 2.2 table written by 14.0.2: a panic in one of its tasks
            pa.ArrowInvalid("External error: RuntimeError: Task was aborted"),
            {"cells": {(2, 2)}},
            "cells.lance: Lance 2.2",
        ),
        (pa.ArrowInvalid("RuntimeError: Task was aborted"), {"cells": {(2, 1)}}, None),
        (  # pylance 14.0.2 reading a 2.2 table written by 0.35 or 1.0
            OSError("Invalid user input: Lance v2.2 miniblock pages require the u32 chunk grammar"),
            {"expression": {(2, 2)}},
            "expression.lance: Lance 2.2",
        ),
    ],
)
def test_version_skew_is_told_from_pylance_errors(error, formats, named):
    found = version_skew(error, formats)
    assert found == named if named is None else named in found


def test_a_panic_on_a_late_format_is_a_version_mismatch():
    class PanicException(BaseException):  # pyo3's, raised where Rust panics
        pass

    found = version_skew(PanicException("index out of bounds"), {"expression": {(2, 2)}})
    assert found is not None and f"pylance {lance.__version__}" in found
    assert version_skew(PanicException("boom"), {"expression": {(2, 0)}}) is None


@pytest.mark.parametrize("predicate", ["x % 97 = 3", "x % 3 != 0"])  # few and many deleted
def test_deleted_rows_read_from_the_deletion_file_are_those_lance_leaves_out(tmp_path, predicate):
    uri = str(tmp_path / "t.lance")
    lance.write_dataset(
        pa.table({"x": np.arange(30_000, dtype=np.int64)}), uri, max_rows_per_file=10_000
    )
    lance.dataset(uri).delete(predicate)
    expression = lance.dataset(uri)
    for fragment in expression.get_fragments():
        live = fragment.to_table(columns=["x"]).column(0).to_numpy() % 10_000
        want = np.setdiff1d(np.arange(10_000), live)
        assert np.array_equal(deleted_rows(expression.uri, fragment), want)
        listed = deletion_array(expression.uri, fragment)
        kind = fragment.metadata.deletion_file.file_type
        assert (listed is not None) == (kind == "array")
        assert listed is None or np.array_equal(listed, want)


def test_tiny_spans_of_a_table_with_deleted_rows_are_read_from_the_data_files(
    tmp_path, monkeypatch
):
    # Lance's take by row offset costs ~10 ms a row on such a table
    path = slaf_with_other(tmp_path, "2.0")
    delete_rows(path, "cell_integer_id IN (3, 4, 200)")
    dataset = open_dataset(path)
    takes = []
    real_take = lance.LanceDataset.take
    monkeypatch.setattr(
        lance.LanceDataset,
        "take",
        lambda self, *a, **k: takes.append(a) or real_take(self, *a, **k),
    )
    plan = list(
        BlockShuffle(block_size=1, fetch_factor=8, batch_size=8).plan(N_CELLS, seed=3, epoch=0)
    )
    got = read_all(Reader(dataset), plan)
    assert got.equals(lance_rows(dataset, plan).cast(got.schema)) and not takes


def test_data_files_the_flat_reader_does_not_decode_are_read_by_lance_with_one_warning(tmp_path):
    uri = str(tmp_path / "t.lance")
    n = 1000
    value = pa.array([None if i % 7 == 0 else i % 50 for i in range(n)], pa.uint16())  # nulls
    table = pa.table(
        {
            "cell_integer_id": pa.array(np.arange(n) // 10, pa.uint32()),
            "gene_integer_id": pa.array(np.arange(n) % 10, pa.uint16()),
            "value": value,
        }
    )
    lance.write_dataset(table, uri, data_storage_version="2.0", max_rows_per_file=300)
    files = DataFiles.of(lance.dataset(uri), COLUMNS)
    rows = np.array([[5, 40], [290, 620], [900, 1000]])
    with pytest.warns(ReaderFallbackWarning, match="flat reader does not decode") as caught:
        got = [pa.Table.from_batches(list(b)) for b in files.read(rows, COLUMNS)]
        got += [pa.Table.from_batches(list(b)) for b in files.read(rows, COLUMNS)]
    assert len(caught) == 1
    for (a, b), part in zip([*rows.tolist(), *rows.tolist()], got, strict=True):
        assert part.equals(table.slice(a, b - a))
