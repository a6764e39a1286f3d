"""``slafload verify``: read every table of a SLAF dataset once and report each problem.

Opening a dataset (:func:`slafload.open_dataset`) checks what it can without reading the
expression rows; a damaged data file is otherwise found only when a run reaches it. This reads
every data file of the three tables, fragment by fragment, and checks what is cheap to check:
each file's Lance footer, that its pages decode, its row count, the cells' ids and offsets
(ascending, ending at the expression row count), and each expression row's cell (the one
``cell_start_index`` places it in), gene id (in range) and value (non-negative, not NaN).
Every problem is reported with its data file and rows; a file that fails is skipped to the
next, so one damaged file never hides another.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lance
import numpy as np
import pyarrow as pa

from slafload._lance import integrity
from slafload.data.dataset import TABLES, _join, _read_config
from slafload.tools.progress import progress_bar

BATCH_ROWS = 1 << 16
Check = Callable[[pa.RecordBatch, int], str | None]
"""A check of one record batch whose first row is table row ``start``: a problem or None."""


@dataclass(frozen=True)
class Problem:
    """One problem found: where (a data file, or a table) and what."""

    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def verify(uri: str | os.PathLike[str], *, progress: bool = False) -> list[Problem]:
    """Every problem found reading the dataset at ``uri`` once (empty: it is healthy).

    Raises:
        DatasetError: ``uri`` is not a SLAF dataset (no directory, no ``config.json``).
    """
    uri = os.fspath(uri)
    config = _read_config(uri, None)
    problems: list[Problem] = []
    tables: dict[str, lance.LanceDataset] = {}
    for name in TABLES:
        path = _join(uri, (config.get("tables") or {}).get(name, f"{name}.lance"))
        try:
            tables[name] = lance.dataset(path)
        except Exception as exc:
            problems.append(Problem(path, f"cannot be opened ({integrity.message(exc)})"))
    if len(tables) < len(TABLES):
        return problems
    total = sum(t.count_rows() for t in tables.values())
    bar = progress_bar(progress, total, "verify", unit="row")
    try:
        state = _State(n_genes=tables["genes"].count_rows())
        problems += _scan("genes", tables["genes"], state.check_genes, bar)
        cell_problems = _scan("cells", tables["cells"], state.check_cells, bar)
        if cell_problems:  # the expression rows' cells are then checked as ascending only
            state.starts, state.n_cells = None, tables["cells"].count_rows()
        problems += cell_problems
        state.finish_cells(tables["expression"].count_rows(), problems)
        problems += _scan("expression", tables["expression"], state.check_expression, bar)
    finally:
        if bar is not None:
            bar.close()
    for key, actual in (("n_cells", state.n_cells), ("n_genes", state.n_genes)):
        stated = config.get(key)
        if stated is not None and int(stated) != actual:
            problems.append(Problem(_join(uri, "config.json"), f"{key}={stated}, tables: {actual}"))
    return problems


def _scan(name: str, table: lance.LanceDataset, check: Check, bar: Any) -> list[Problem]:
    """Problems of each data file of ``table``: its footer, its pages, its rows' ``check``."""
    problems: list[Problem] = []
    for fragment, files in integrity.pieces(table):
        damaged = [(p, integrity.footer_problem(p.path)) for p in files]
        damaged = [(p, why) for p, why in damaged if why is not None]
        problems += [Problem(p.path, f"{p.rows()}: {why}") for p, why in damaged]
        piece = files[0] if files else integrity.Piece(f"{name}.lance", 0, 0)
        read = 0
        if not damaged:
            read, whole = _scan_fragment(fragment, piece, check, bar, problems)
            expected = piece.stop - piece.start
            if whole and read != expected:
                problems.append(Problem(piece.path, f"{read:,} rows read, {expected:,} expected"))
        if bar is not None:
            bar.update(max(piece.stop - piece.start - read, 0))  # what was not read
    return problems


def _scan_fragment(
    fragment: Any, piece: integrity.Piece, check: Check, bar: Any, problems: list[Problem]
) -> tuple[int, bool]:
    """Read ``fragment`` batch by batch, checking each: the rows read, and whether it was
    read to its end (a failed read is reported).
    """
    at, found = piece.start, []
    try:
        for batch in fragment.to_batches(batch_size=BATCH_ROWS):
            problem = check(batch, at)
            if problem is not None:
                found.append(problem)
            at += batch.num_rows
            if bar is not None:
                bar.update(batch.num_rows)
    except BaseException as exc:  # a damaged page may panic Lance's decoder (BaseException)
        if not isinstance(exc, Exception) and not integrity.is_panic(exc):
            raise
        what = "crashed Lance's decoder" if integrity.is_panic(exc) else "cannot be read"
        why = f"rows {at:,}-{piece.stop - 1:,} {what} ({integrity.message(exc)})"
        problems.append(Problem(piece.path, why))
        return at - piece.start, False
    finally:  # one line a file: its first problem, and how many more batches had one
        if found:
            more = f" (and problems in {len(found) - 1} more batches)" if len(found) > 1 else ""
            problems.append(Problem(piece.path, found[0] + more))
    return at - piece.start, True


class _State:
    """What the checks of later tables need from earlier ones (cell offsets, gene count)."""

    def __init__(self, n_genes: int):
        self.n_genes = n_genes
        self.n_cells = 0
        self.seen_genes = np.zeros(n_genes, bool)
        self.starts: list[np.ndarray] | None = []  # None: no cell_start_index column
        self.cell_start: np.ndarray | None = None
        self.last_cell = -1

    def check_genes(self, batch: pa.RecordBatch, start: int) -> str | None:
        """Gene ids in range and each once (genes.lance need not list them in id order)."""
        if "gene_integer_id" not in batch.schema.names:
            return None
        ids = _column(batch, "gene_integer_id").astype(np.int64)
        bad = (ids < 0) | (ids >= self.n_genes)
        bad[~bad] = self.seen_genes[ids[~bad]]
        self.seen_genes[ids[~bad]] = True
        if not bad.any():
            return None
        i = int(np.flatnonzero(bad)[0])
        return (
            f"gene_integer_id {ids[i]} at row {start + i:,} is out of range or repeated "
            f"(genes: {self.n_genes:,}; {int(bad.sum()):,} rows)"
        )

    def check_cells(self, batch: pa.RecordBatch, start: int) -> str | None:
        if self.starts is not None and "cell_start_index" in batch.schema.names:
            self.starts.append(_column(batch, "cell_start_index"))
        else:
            self.starts = None
        self.n_cells += batch.num_rows
        return _ids(batch, "cell_integer_id", start)

    def finish_cells(self, n_rows: int, problems: list[Problem]) -> None:
        if self.starts is None:  # placement is checked as ascending cell ids instead
            return
        starts = np.concatenate([*self.starts, [n_rows]]).astype(np.int64)
        bad = np.flatnonzero(np.diff(starts) < 0)
        if starts[0] != 0 or len(bad):
            cell = int(bad[0]) if len(bad) else 0
            problems.append(
                Problem(
                    "cells.lance",
                    f"cell_start_index is not ascending from 0 to the "
                    f"expression row count {n_rows:,} (at cell {cell:,})",
                )
            )
            starts = np.maximum.accumulate(np.clip(starts, 0, n_rows))
        self.cell_start = starts

    def check_expression(self, batch: pa.RecordBatch, start: int) -> str | None:
        rows = np.arange(start, start + batch.num_rows)
        cells = _column(batch, "cell_integer_id").astype(np.int64)
        genes = _column(batch, "gene_integer_id").astype(np.int64)
        values = _column(batch, "value")
        misplaced = self._misplaced(cells, rows)
        checks = (
            (misplaced, "cell_integer_id {v} is not the cell cell_start_index places row {r} in",
             cells),
            ((genes < 0) | (genes >= self.n_genes),
             f"gene_integer_id {{v}} at row {{r}} is out of range (genes: {self.n_genes:,})",
             genes),
            (_bad_values(values), "value {v} at row {r} is negative or NaN", values),
        )  # fmt: skip
        found = []
        for bad, text, column in checks:
            hits = np.flatnonzero(bad)
            if len(hits):
                i = int(hits[0])
                found.append(
                    text.format(v=column[i], r=f"{start + i:,}") + f" ({len(hits):,} rows)"
                )
        return "; ".join(found) or None

    def _misplaced(self, cells: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Rows whose cell id is not the cell ``cell_start_index`` places them in (without
        it: cell ids out of range or descending).
        """
        n = self.n_cells
        bad = (cells < 0) | (cells >= n)
        if self.cell_start is None:
            bad |= np.diff(cells, prepend=self.last_cell) < 0
            self.last_cell = int(cells[-1]) if len(cells) else self.last_cell
            return bad
        where = np.clip(cells, 0, max(n - 1, 0))
        bad |= self.cell_start[where] > rows
        return bad | (self.cell_start[np.minimum(where + 1, n)] <= rows)


def _ids(batch: pa.RecordBatch, column: str, start: int) -> str | None:
    ids = _column(batch, column).astype(np.int64)
    bad = np.flatnonzero(ids != np.arange(start, start + len(ids)))
    if not len(bad):
        return None
    i = int(bad[0])
    return f"{column} {ids[i]} at row {start + i:,} should be {start + i:,} ({len(bad):,} rows)"


def _bad_values(values: np.ndarray) -> np.ndarray:
    if values.dtype.kind == "u":
        return np.zeros(len(values), bool)
    return (values < 0) | np.isnan(values) if values.dtype.kind == "f" else values < 0


def _column(batch: pa.RecordBatch, name: str) -> np.ndarray:
    return batch.column(batch.schema.get_field_index(name)).to_numpy(zero_copy_only=False)
