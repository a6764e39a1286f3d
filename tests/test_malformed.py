"""The catalog of broken datasets: each is rejected at open or at first read, never hangs.

Every case starts from a valid tiny dataset on disk, breaks one thing the way real datasets
break, and checks the exception class and a message naming the file, the column and the fix.
Each trigger runs under a timeout guard, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest
from conftest import random_counts, write_dense

from slafload import (
    ConfigError,
    CorruptDataError,
    DatasetError,
    InconsistentDataError,
    Loader,
    MissingTableError,
    SchemaError,
    open_dataset,
)
from slafload.config import RetryPolicy, Tuning
from slafload.tools.writer import write_slaf

N_CELLS, N_GENES = 30, 10
COUNTS = pa.uint16()
GUARD_SECONDS = 30


def _write(path: Path, value_type: pa.DataType = COUNTS) -> Path:
    dense = random_counts(N_CELLS, N_GENES, seed=2, density=0.6, empty_every=7)
    return write_dense(path, dense, max_rows_per_file=40, value_type=value_type)


def _rewrite(path: Path, name: str, **columns: object) -> None:
    """Replace columns of a table (a new Lance version), keeping the others."""
    table = lance.dataset(str(path / f"{name}.lance")).to_table()
    for column, values in columns.items():
        index = table.schema.get_field_index(column)
        array = values if isinstance(values, pa.Array) else pa.array(values)
        table = table.set_column(index, column, array)
    lance.write_dataset(table, str(path / f"{name}.lance"), mode="overwrite")


def _column(path: Path, name: str, column: str) -> np.ndarray:
    table = lance.dataset(str(path / f"{name}.lance")).to_table(columns=[column])
    return table.column(0).to_numpy().copy()


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.pop("array_shape")  # so each count is checked on its own
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _data_file(path: Path) -> Path:
    return sorted((path / "expression.lance" / "data").glob("*.lance"))[0]


# -- the breakages -------------------------------------------------------------------------


def no_config(path: Path) -> None:
    (path / "config.json").unlink()


def missing_table(name: str) -> Callable[[Path], None]:
    return lambda path: shutil.rmtree(path / f"{name}.lance")


def cell_id_as_string(path: Path) -> None:
    ids = _column(path, "expression", "cell_integer_id")
    _rewrite(path, "expression", cell_integer_id=pa.array([str(i) for i in ids]))


def value_as_string(path: Path) -> None:
    values = _column(path, "expression", "value")
    _rewrite(path, "expression", value=pa.array([str(v) for v in values]))


def start_decreasing(path: Path) -> None:
    start = _column(path, "cells", "cell_start_index")
    start[3] = start[1]
    _rewrite(path, "cells", cell_start_index=start)


def rows_shuffled(path: Path) -> None:
    table = lance.dataset(str(path / "expression.lance")).to_table()
    order = np.random.default_rng(0).permutation(table.num_rows)
    lance.write_dataset(table.take(order), str(path / "expression.lance"), mode="overwrite")


def gene_out_of_range(path: Path) -> None:
    genes = _column(path, "expression", "gene_integer_id")
    start = _column(path, "cells", "cell_start_index")
    genes[start[2] - 1] = N_GENES  # the last (largest) gene of cell 1: still ascending
    _rewrite(path, "expression", gene_integer_id=pa.array(genes, pa.uint16()))


def negative_value(path: Path) -> None:
    values = _column(path, "expression", "value").astype(np.int32)
    values[17] = -3
    _rewrite(path, "expression", value=values)


def nan_value(path: Path) -> None:
    values = _column(path, "expression", "value").astype(np.float32)
    values[23] = np.nan
    _rewrite(path, "expression", value=values)


def start_past_row_count(path: Path) -> None:
    start = _column(path, "cells", "cell_start_index")
    start[-1] = start[-1] + 1000
    _rewrite(path, "cells", cell_start_index=start)


def extra_expression_rows(path: Path) -> None:
    extra = lance.dataset(str(path / "expression.lance")).to_table().slice(0, 5)
    lance.write_dataset(extra, str(path / "expression.lance"), mode="append")


def extra_expression_rows_unrecorded(path: Path) -> None:
    extra_expression_rows(path)
    config = json.loads((path / "config.json").read_text())
    del config["metadata"]["expression_count"]
    (path / "config.json").write_text(json.dumps(config))


def empty(path: Path) -> None:
    write_slaf(path, [], n_genes=3, overwrite=True)


def truncated_data_file(path: Path) -> None:
    data = _data_file(path)
    os.truncate(data, data.stat().st_size // 2)


def corrupted_data_file(path: Path) -> None:
    data = _data_file(path)
    raw = bytearray(data.read_bytes())
    raw[-64:] = b"\xa5" * 64  # the footer: the file no longer describes its own pages
    data.write_bytes(bytes(raw))


def config_says(**changes: object) -> Callable[[Path], None]:
    return lambda path: _edit_config(path, **changes)


def config_shape(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    config["array_shape"] = [N_CELLS, N_GENES + 1]
    (path / "config.json").write_text(json.dumps(config))


@dataclass(frozen=True)
class Case:
    break_it: Callable[[Path], None]
    stage: str  # "open": open_dataset raises; "read": it opens and the first epoch raises
    error: type[Exception]
    message: str  # regex naming the file, the column (where one is at fault) and the fix
    value_type: pa.DataType = COUNTS


CATALOG = {
    "no config.json": Case(
        no_config, "open", ConfigError, r"config\.json' is missing.*Write one with"
    ),
    **{
        f"missing {t} table": Case(
            missing_table(t),
            "open",
            MissingTableError,
            rf"The {t} table .*{t}\.lance' is missing.*needs expression\.lance, cells\.lance",
        )
        for t in ("expression", "cells", "genes")
    },
    "cell id of type string": Case(
        cell_id_as_string,
        "open",
        SchemaError,
        r"expression\.lance column 'cell_integer_id' .*type string; it must be integer\. Cast",
    ),
    "value of type string": Case(
        value_as_string,
        "open",
        SchemaError,
        r"expression\.lance column 'value' .*type string; it must be numeric\. Cast",
    ),
    "cell_start_index decreasing": Case(
        start_decreasing,
        "open",
        InconsistentDataError,
        r"cells\.lance .*cell_start_index must start at 0 and never decrease.*cell 3 .*"
        r"Recompute cell_start_index",
    ),
    "expression rows not sorted by cell": Case(
        rows_shuffled,
        "open",
        InconsistentDataError,
        r"expression\.lance .*belongs to cell.*must be sorted by cell_integer_id",
    ),
    "gene id at n_genes": Case(
        gene_out_of_range,
        "read",
        InconsistentDataError,
        r"expression\.lance .*column 'gene_integer_id' holds gene 10 in cell 1, but "
        r"genes\.lance has only 10 genes.*renumber gene_integer_id",
    ),
    "negative value": Case(
        negative_value,
        "read",
        InconsistentDataError,
        r"expression\.lance .*column 'value' holds -3 .*negative or NaN.*Drop or fix",
        pa.int32(),
    ),
    "NaN value": Case(
        nan_value,
        "read",
        InconsistentDataError,
        r"expression\.lance .*column 'value' holds nan .*negative or NaN.*Drop or fix",
        pa.float32(),
    ),
    "cell_start_index past the row count": Case(
        start_past_row_count,
        "open",
        InconsistentDataError,
        r"cells\.lance .*cell_start_index .*ending at or below the expression row count.*"
        r"Recompute cell_start_index",
    ),
    "expression rows appended, config.json disagrees": Case(
        extra_expression_rows,
        "open",
        ConfigError,
        r"config\.json .*expression_count=\d+ but cells\.cell_start_index and "
        r"expression\.lance imply \d+ rows\. If rows were appended, open the expression version",
    ),
    "expression rows appended, unrecorded": Case(
        extra_expression_rows_unrecorded,
        "open",
        InconsistentDataError,
        r"expression\.lance .*row 156 belongs to cell 1 but cells\.cell_start_index places it "
        r"in cell 29\. The expression rows must be sorted by cell_integer_id and agree",
    ),
    "empty dataset": Case(
        empty, "open", DatasetError, r"has no cells: cells\.lance is empty.*write at least one"
    ),
    "truncated data file": Case(
        truncated_data_file,
        "open",
        CorruptDataError,
        r"expression\.lance: data file .*expression\.lance/data/.*\.lance \(rows \d+-\d+\) is "
        r"truncated or overwritten.*Restore the file from a copy.*slafload verify",
    ),
    "corrupted data file": Case(
        corrupted_data_file,
        "open",
        CorruptDataError,
        r"expression\.lance: data file .*expression\.lance/data/.*\.lance \(rows \d+-\d+\) is "
        r"truncated or overwritten.*Restore the file from a copy.*slafload verify",
    ),
    "config n_cells disagrees": Case(
        config_says(n_cells=N_CELLS + 1),
        "open",
        ConfigError,
        r"config\.json .*says n_cells=31 but the tables hold 30\. Fix config\.json",
    ),
    "config n_genes disagrees": Case(
        config_says(n_genes=N_GENES - 1),
        "open",
        ConfigError,
        r"config\.json .*says n_genes=9 but the tables hold 10\. Fix config\.json",
    ),
    "config expression_count disagrees": Case(
        config_says(metadata={"expression_count": 1}),
        "open",
        ConfigError,
        r"config\.json .*says metadata\.expression_count=1 but cells\.cell_start_index",
    ),
    "config array_shape disagrees": Case(
        config_shape,
        "open",
        ConfigError,
        r"config\.json .*array_shape=\[30, 11\] but the tables hold \[30, 10\]\. Fix",
    ),
}


def _within(seconds: float, action: Callable[[], None]) -> BaseException | None:
    """Run ``action`` on a thread; fail if it does not finish in time; return what it raised."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            action()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, name="malformed-guard", daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"no error within {seconds} s: the loader hangs"
    return outcome[0]


def _read_all(path: Path) -> None:
    ds = open_dataset(path)
    with Loader(
        ds, batch_size=8, shuffle=False, tuning=Tuning(retry=RetryPolicy(attempts=1))
    ) as loader:
        for _ in loader:
            pass


@pytest.mark.parametrize("name", list(CATALOG))
def test_a_broken_dataset_is_rejected_with_a_specific_error(tmp_path, name, no_thread_leak):
    case = CATALOG[name]
    path = _write(tmp_path / "broken.slaf", case.value_type)
    case.break_it(path)
    if case.stage == "read":
        open_dataset(path)  # the breakage is only visible in the rows
    action = (lambda: open_dataset(path)) if case.stage == "open" else lambda: _read_all(path)
    error = _within(GUARD_SECONDS, action)
    assert isinstance(error, case.error), f"{name}: got {error!r}"
    assert re.search(case.message, str(error)), str(error)
    assert "broken.slaf" in str(error)


# -- unreadable permissions: a subprocess that really lacks the right to read -------------

_UNREADABLE = textwrap.dedent(
    """
    import ctypes, json, os, sys

    # Root reads mode-000 files through CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH: drop both
    # from this thread before anything starts threads (Lance's threads inherit the set).
    libc = ctypes.CDLL(None, use_errno=True)
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]
    header, data = Header(0x20080522, 0), (Data * 2)()
    if libc.capget(ctypes.byref(header), data) == 0:
        data[0].effective &= ~0b110
        data[0].permitted &= ~0b110
        libc.capset(ctypes.byref(header), data)
    probe = sys.argv[1]
    try:
        open(probe).close()
    except PermissionError:
        pass
    else:
        print(json.dumps({"skip": "this process can still read mode-000 files"}))
        sys.exit(0)
    from slafload import open_dataset
    for path in sys.argv[2:]:
        try:
            open_dataset(path)
        except Exception as exc:
            mro = [c.__name__ for c in type(exc).__mro__]
            print(json.dumps({"mro": mro, "message": str(exc)}))
        else:
            print(json.dumps({"mro": [], "message": "opened"}))
    """
)


UNREADABLE_CASES = {  # the file made mode 000 -> (error, message)
    "config.json": (
        ConfigError,
        r"Cannot read .*broken\.slaf/config\.json'.*Permission denied.*Check the file's perm",
    ),
    "expression.lance": (
        MissingTableError,
        r"Cannot open the expression table .*expression\.lance'.*Permission denied.*"
        r"Check that it is readable \(file permissions",
    ),
}


def test_unreadable_files_are_rejected_with_a_permissions_hint(tmp_path):
    probe = tmp_path / "probe"
    probe.write_text("x")
    paths = [_write(tmp_path / name / "broken.slaf") for name in UNREADABLE_CASES]
    targets = [path / name for path, name in zip(paths, UNREADABLE_CASES, strict=True)]
    for target in [probe, *targets]:
        os.chmod(target, 0)
    try:  # one subprocess for all cases: it pays the import of torch once
        result = subprocess.run(
            [sys.executable, "-c", _UNREADABLE, str(probe), *map(str, paths)],
            capture_output=True,
            text=True,
            timeout=GUARD_SECONDS,
            check=True,
        )
    finally:
        for target in [probe, *targets]:
            os.chmod(target, 0o755 if target.is_dir() else 0o644)
    reports = [json.loads(line) for line in result.stdout.strip().splitlines()]
    if "skip" in reports[0]:
        pytest.skip(reports[0]["skip"])
    for report, (error, message) in zip(reports, UNREADABLE_CASES.values(), strict=True):
        assert error.__name__ in report["mro"], report
        assert re.search(message, report["message"]), report["message"]
