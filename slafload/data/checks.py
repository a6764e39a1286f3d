"""What opening a SLAF dataset checks: the tables' schemas, the cell offsets, the counts, and
a few cells' expression rows.

Everything that can be checked without scanning the expression table
(:func:`slafload.data.dataset.open_dataset` runs these in order); each failure is an error that
names the table, the cell or row, and what to do.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

import lance
import numpy as np
import pyarrow as pa
import pyarrow.types as pat

from slafload._lance import integrity
from slafload.data.offsets import CellOffsets
from slafload.errors import (
    ConfigError,
    CorruptDataError,
    DatasetError,
    InconsistentDataError,
    MissingTableError,
    SchemaError,
)

logger = logging.getLogger(__name__)

_SPOT_CHECKS = 32
_SPOT_WINDOW = 4096  # cells searched after a spot-check position for a non-empty one
_BATCH_CELLS = 1 << 20  # cells read and checked at once when opening


def check_schema(uri: str, tables: Mapping[str, lance.LanceDataset]) -> None:
    """Check every required column is there with a type the loader reads: integer ids and
    offsets, a numeric ``value``.
    """
    required = {
        "expression": {
            "cell_integer_id": pat.is_integer,
            "gene_integer_id": pat.is_integer,
            "value": lambda t: pat.is_integer(t) or pat.is_floating(t),
        },
        "cells": {"cell_integer_id": pat.is_integer},
        "genes": {},
    }
    for name, columns in required.items():
        schema = tables[name].schema
        for column, ok in columns.items():
            idx = schema.get_field_index(column)
            if idx < 0:
                raise SchemaError(
                    f"{name}.lance in {uri!r} has no column {column!r} (columns: "
                    f"{schema.names}). Rewrite the dataset in the SLAF layout."
                )
            typ = schema.field(idx).type
            if not ok(typ):
                kind = "numeric" if column == "value" else "integer"
                raise SchemaError(
                    f"{name}.lance column {column!r} in {uri!r} has type {typ}; it must be "
                    f"{kind}. Cast it when writing the dataset."
                )
    start = tables["cells"].schema.get_field_index("cell_start_index")
    if start >= 0 and not pat.is_integer(tables["cells"].schema.field(start).type):
        raise SchemaError(
            f"cells.lance column 'cell_start_index' in {uri!r} has type "
            f"{tables['cells'].schema.field(start).type}; it must be integer."
        )


def cell_offsets(uri: str, tables: Mapping[str, lance.LanceDataset]) -> CellOffsets:
    """CSR offsets of every cell from ``cells.cell_start_index``, then the row count.

    The only state of one entry per cell that opening keeps (:class:`CellOffsets`: 2.25 bytes
    a cell, or 4). The cells table is read, checked and compacted in batches of
    :data:`_BATCH_CELLS`, so no ``int64`` array of every cell is held: a 100M-cell atlas opens
    in ~0.23 GB (0.4 GB in the 4-byte form, up to ~0.6 GB while it is widened) plus one batch
    (a table without ``cell_start_index`` is scanned instead, counting every cell's rows in
    one ``int64`` array).
    """
    cells = tables["cells"]
    n_rows = tables["expression"].count_rows()
    n_cells = cells.count_rows()
    if n_cells == 0:
        raise DatasetError(
            f"{uri!r} has no cells: cells.lance is empty. Nothing to load; write at least "
            "one cell (rows of cells.lance with cell_integer_id and cell_start_index)."
        )
    if "cell_start_index" not in cells.schema.names:
        logger.warning(
            "cells.lance in %r has no cell_start_index; computing it by scanning "
            "expression.cell_integer_id (slow on large datasets)",
            uri,
        )
        for _ in _id_checked(uri, cells, ["cell_integer_id"]):
            pass
        starts = np.append(_offsets_by_scan(tables["expression"], n_cells), n_rows)
        return CellOffsets.of(starts)  # ascending by construction
    try:
        with integrity.naming_damage("cells", cells, np.array([[0, n_cells]])):
            return CellOffsets.build(_checked_starts(uri, cells, n_rows), n_cells + 1)
    except (InconsistentDataError, CorruptDataError):
        raise
    except ValueError as exc:  # the table's row count and its batches disagree
        raise InconsistentDataError(
            f"cells.lance in {uri!r}: {exc} (cell_start_index of {n_cells} cells, then the "
            "row count). Rewrite the cells table."
        ) from exc


def _checked_starts(uri: str, cells: lance.LanceDataset, n_rows: int) -> Iterator[np.ndarray]:
    """``cell_start_index`` batch by batch (``int64``), then ``[n_rows]``, each checked: the
    cell ids in order, the offsets starting at 0, never decreasing and ending at or below
    ``n_rows``.
    """
    pos, previous = 0, 0
    above: tuple[int, int] | None = None  # the first cell starting past the rows, and where
    for batch in _id_checked(uri, cells, ["cell_integer_id", "cell_start_index"]):
        starts = batch.column(1).to_numpy().astype(np.int64, copy=False)
        if len(starts):
            down = np.flatnonzero(np.diff(starts, prepend=previous) < 0)
            if pos == 0 and starts[0] != 0:
                down = np.array([0])
            if len(down):
                _bad_offsets(uri, pos + int(down[0]), int(starts[down[0]]), n_rows)
            if above is None and starts[-1] > n_rows:
                first = int(np.flatnonzero(starts > n_rows)[0])
                above = (pos + first, int(starts[first]))
            previous = int(starts[-1])
        pos += len(starts)
        yield starts
    if above is not None:  # name the first cell past the end, not the row count
        _bad_offsets(uri, *above, n_rows, hint=True)
    yield np.array([n_rows], dtype=np.int64)


def _id_checked(
    uri: str, cells: lance.LanceDataset, columns: list[str]
) -> Iterator[pa.RecordBatch]:
    """The cells table's ``columns`` (``cell_integer_id`` first) in batches of
    :data:`_BATCH_CELLS`, each checked to number the cells ``0..n_cells-1`` in order.
    """
    pos = 0
    for batch in cells.to_batches(columns=columns, batch_size=_BATCH_CELLS):
        ids = batch.column(0).to_numpy()
        expected = np.arange(pos, pos + len(ids))
        if not np.array_equal(ids, expected):
            bad = int(np.flatnonzero(ids != expected)[0])
            raise InconsistentDataError(
                f"cells.lance in {uri!r}: cell_integer_id must be 0..n_cells-1 in order, but "
                f"row {pos + bad} holds {ids[bad]}. Sort the cells table by cell_integer_id "
                "and renumber."
            )
        pos += len(ids)
        yield batch


def _bad_offsets(uri: str, bad: int, value: int, n_rows: int, *, hint: bool = False) -> NoReturn:
    """Raise for ``cell_start_index`` of cell ``bad``, which is ``value``."""
    extra = (
        " (slafdb's converter takes the offsets from an obs 'n_genes' column when there "
        "is one: drop it before converting if it does not count the stored non-zeros)"
        if hint
        else ""
    )
    raise InconsistentDataError(
        f"cells.lance in {uri!r}: cell_start_index must start at 0 and never decrease, "
        f"ending at or below the expression row count ({n_rows}); cell_start_index of cell "
        f"{bad} breaks this (value {value}). Recompute cell_start_index as the CSR "
        f"indptr{extra}."
    )


def _offsets_by_scan(expression: lance.LanceDataset, n_cells: int) -> np.ndarray:
    counts = np.zeros(n_cells, dtype=np.int64)
    for batch in expression.to_batches(columns=["cell_integer_id"]):
        ids = batch.column(0).to_numpy()
        counts += np.bincount(ids, minlength=n_cells)[:n_cells]
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def check_counts(
    uri: str,
    config: Mapping[str, Any],
    tables: Mapping[str, lance.LanceDataset],
    cell_start: CellOffsets,
    *,
    pinned: bool = False,
) -> None:
    """Check config.json's counts against the tables.

    ``config.json`` is not versioned: it describes the latest tables. When older versions are
    pinned explicitly (resuming a checkpoint after an append), disagreement is logged, not
    raised; the tables themselves are still checked against each other.
    """
    n_cells, n_rows = len(cell_start) - 1, int(cell_start[-1])
    n_genes = tables["genes"].count_rows()
    if n_genes == 0:
        raise DatasetError(f"{uri!r} has no genes: genes.lance is empty. Nothing to load.")
    problems: list[str] = []
    actual = {"n_cells": n_cells, "n_genes": n_genes}
    for key, value in actual.items():
        stated = config.get(key)
        if stated is not None and int(stated) != value:
            problems.append(
                f"config.json in {uri!r} says {key}={stated} but the tables hold {value}. "
                "Fix config.json or rewrite the dataset."
            )
    shape = config.get("array_shape")
    if shape is not None and list(shape) != [n_cells, n_genes]:
        problems.append(
            f"config.json in {uri!r} says array_shape={list(shape)} but the tables hold "
            f"[{n_cells}, {n_genes}]. Fix config.json or rewrite the dataset."
        )
    stated_rows = (config.get("metadata") or {}).get("expression_count")
    if stated_rows is not None and int(stated_rows) != n_rows:
        problems.append(
            f"config.json in {uri!r} says metadata.expression_count={stated_rows} but "
            f"cells.cell_start_index and expression.lance imply {n_rows} rows. If rows were "
            "appended, open the expression version that matches (version=...); otherwise fix "
            "config.json or rewrite the dataset."
        )
    if problems and pinned:
        logger.warning("%s (tolerated: explicit versions are pinned)", "; ".join(problems))
    elif problems:
        raise ConfigError(problems[0])
    stored_rows = tables["expression"].count_rows()
    if stored_rows != n_rows:
        raise InconsistentDataError(
            f"expression.lance in {uri!r} has {stored_rows} rows but cell_start_index ends "
            f"at {n_rows}. Recompute cell_start_index or rewrite the dataset."
        )


def _rows_of(expression: lance.LanceDataset, rows: np.ndarray) -> np.ndarray:
    """``cell_integer_id`` of the sorted dataset ``rows``: one ``take``, or a scanner per row
    where the table has deleted rows (Lance's ``take`` then costs ~10 ms a row, a scanner's
    ``offset`` ~0.5 ms).
    """
    if not any(f.metadata.deletion_file is not None for f in expression.get_fragments()):
        return expression.take(rows.tolist(), columns=["cell_integer_id"]).column(0).to_numpy()
    return np.concatenate([
        expression.scanner(columns=["cell_integer_id"], offset=r, limit=1).to_table()
        .column(0).to_numpy() for r in rows.tolist()
    ])  # fmt: skip


def spot_check_expression(
    uri: str, expression: lance.LanceDataset, cell_start: CellOffsets
) -> None:
    """Check a few cells' first and last rows carry their cell id (cheap random access)."""
    n_cells = len(cell_start) - 1
    # Evenly spaced cells, each moved to the next non-empty one, found in windows so no array
    # of one entry per cell is built.
    picked = []
    for c in np.unique(np.linspace(0, n_cells - 1, min(_SPOT_CHECKS, n_cells)).astype(np.int64)):
        window = np.flatnonzero(np.diff(cell_start[c : c + _SPOT_WINDOW + 1]))
        if len(window):
            picked.append(c + int(window[0]))
    if not picked:
        return
    cells = np.unique(np.array(picked, dtype=np.int64))
    rows = np.unique(np.concatenate([cell_start[cells], cell_start[cells + 1] - 1]))
    try:
        with integrity.naming_damage("expression", expression, np.stack([rows, rows + 1], 1)):
            got = _rows_of(expression, rows)
    except CorruptDataError:
        raise
    except Exception as exc:  # Lance reports an unreadable data file as a plain OSError
        raise MissingTableError(
            f"expression.lance in {uri!r}: reading column 'cell_integer_id' failed "
            f"({integrity.message(exc)}), so a data file under expression.lance/data/ is "
            "missing or unreadable. Check its permissions (or credentials), or restore the "
            "dataset from a copy; `slafload verify` checks every file."
        ) from exc
    want = cell_start.searchsorted(rows, side="right") - 1
    if not np.array_equal(got.astype(np.int64), want):
        bad = int(np.flatnonzero(got != want)[0])
        raise InconsistentDataError(
            f"expression.lance in {uri!r}: row {rows[bad]} belongs to cell {got[bad]} but "
            f"cells.cell_start_index places it in cell {want[bad]}. The expression rows must be "
            "sorted by cell_integer_id and agree with cell_start_index."
        )
