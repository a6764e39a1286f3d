"""Stage 1: open a SLAF dataset, validate it, and pin its Lance versions.

A SLAF dataset is a directory (or object-store prefix) holding ``config.json`` and three Lance
tables: ``expression`` (one row per non-zero, sorted by cell then gene), ``cells`` (one row per
cell, with ``cell_start_index``, the CSR row offset of each cell) and ``genes``. See
``docs/format.md``.

Opening is cheap (``O(n_cells)``: it reads the two integer columns of ``cells``) and checks
everything that can be checked without scanning the expression table. What can only be seen in
the expression rows (sort order, value range) is checked chunk by chunk as it is read.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, cast

import lance
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.types as pat

from slafload._lance import integrity
from slafload._lance.fragments import version_error
from slafload.data.offsets import CellOffsets
from slafload.errors import (
    ConfigError,
    CorruptDataError,
    DatasetError,
    DatasetNotFoundError,
    InconsistentDataError,
    MissingTableError,
    SchemaError,
    SlafloadError,
)

if TYPE_CHECKING:
    from slafload.pipeline.reader import Reader, ReadOptions

logger = logging.getLogger(__name__)

TABLES = ("expression", "cells", "genes")
_SPOT_CHECKS = 32
_SPOT_WINDOW = 4096  # cells searched after a spot-check position for a non-empty one
_BATCH_CELLS = 1 << 20  # cells read and checked at once when opening


@dataclass(frozen=True, eq=False)
class SlafDataset:
    """An opened, validated SLAF dataset with every table pinned to one Lance version.

    Attributes:
        uri: Dataset directory or URI, as given to :func:`open_dataset`.
        config: Parsed ``config.json``.
        expression, cells, genes: Lance datasets checked out at the pinned versions.
        cell_start: CSR offsets, indexed like ``int64[n_cells + 1]``: the rows of cell ``c``
            are ``expression[cell_start[c]:cell_start[c + 1]]`` (:class:`CellOffsets`, 2.25
            bytes a cell, 4 on atlases denser than ~2.1k non-zeros a cell: the only state a
            run keeps per cell).
        storage_options: Lance storage options used to open the tables (object stores).
    """

    uri: str
    config: Mapping[str, Any]
    expression: lance.LanceDataset
    cells: lance.LanceDataset
    genes: lance.LanceDataset
    cell_start: CellOffsets
    storage_options: Mapping[str, str] | None = field(default=None, repr=False)

    @property
    def n_cells(self) -> int:
        """Number of cells (rows of the ``cells`` table)."""
        return len(self.cell_start) - 1

    @property
    def n_genes(self) -> int:
        """Number of genes (rows of the ``genes`` table)."""
        return self.genes.count_rows()

    @property
    def n_rows(self) -> int:
        """Number of stored non-zeros (expression rows)."""
        return int(self.cell_start[-1])

    @property
    def versions(self) -> dict[str, int]:
        """The pinned Lance version of each table."""
        return {
            "expression": self.expression.version,
            "cells": self.cells.version,
            "genes": self.genes.version,
        }

    @property
    def value_type(self) -> pa.DataType:
        """Arrow type of the expression table's ``value`` column."""
        return self.expression.schema.field("value").type

    @property
    def gene_type(self) -> pa.DataType:
        """Arrow type of the expression table's ``gene_integer_id`` column."""
        return self.expression.schema.field("gene_integer_id").type

    def obs(self, columns: list[str] | None = None) -> pl.DataFrame:
        """Cell metadata (the ``cells`` table) in cell-id order."""
        return cast(pl.DataFrame, pl.from_arrow(self.cells.to_table(columns=columns)))

    def obs_codes(self, column: str) -> tuple[np.ndarray, list[Any] | None]:
        """One obs column as an ``int64`` array per cell, plus its category table.

        Strings, booleans and categoricals become codes into the sorted category list (the
        second return value); integer columns are returned as they are, with ``None``.

        Raises:
            SchemaError: the column does not exist or is floating point.
        """
        if column not in self.cells.schema.names:
            raise SchemaError(
                f"cells.lance in {self.uri!r} has no obs column {column!r} "
                f"(columns: {self.cells.schema.names})"
            )
        series = self.obs([column]).get_column(column)
        if series.dtype.is_integer():
            return series.cast(pl.Int64).to_numpy(), None
        if series.dtype.is_float():
            raise SchemaError(
                f"obs column {column!r} in {self.uri!r} is floating point; only "
                "categorical, string, boolean or integer columns become codes"
            )
        categories = series.cast(pl.String).unique().sort(nulls_last=True)
        codes = series.cast(pl.String).replace_strict(
            categories, pl.int_range(len(categories), eager=True), return_dtype=pl.Int64
        )
        return codes.to_numpy(), categories.to_list()

    def reader(self, options: ReadOptions | None = None) -> Reader:
        """The Lance reader of this dataset's fetches (a mixture brings one per source)."""
        from slafload.pipeline.reader import Reader

        return Reader(self, options)

    def row_bytes(self, columns: list[str]) -> int:
        """Bytes of one expression row of ``columns``, as the memory budget counts them."""
        from slafload.pipeline.budget import row_bytes

        return row_bytes(self.expression.schema, columns)

    def var(self, columns: list[str] | None = None) -> pl.DataFrame:
        """Gene metadata (the ``genes`` table) in gene-id order."""
        return cast(pl.DataFrame, pl.from_arrow(self.genes.to_table(columns=columns)))

    def __repr__(self) -> str:
        return (
            f"SlafDataset({self.uri!r}, n_cells={self.n_cells:,}, n_genes={self.n_genes:,}, "
            f"n_rows={self.n_rows:,}, versions={self.versions})"
        )


def open_dataset(
    uri: str | os.PathLike[str],
    *,
    version: int | Mapping[str, int] | None = None,
    storage_options: Mapping[str, str] | None = None,
) -> SlafDataset:
    """Open and validate a SLAF dataset, pinning each table's Lance version.

    Args:
        uri: Local directory or object-store URI (``s3://bucket/atlas.slaf``) of the dataset.
        version: Lance version of the expression table to pin (an ``int``), or a mapping
            ``{"expression": v, "cells": v, "genes": v}``. ``None`` pins the latest versions.
        storage_options: Lance storage options for object stores (credentials, endpoint).

    Raises:
        DatasetNotFoundError: ``uri`` does not exist.
        ConfigError: ``config.json`` is missing, unreadable or disagrees with the tables.
        MissingTableError: a table is absent or unreadable.
        SchemaError: a required column is missing or has the wrong type.
        InconsistentDataError: offsets, ids or counts contradict each other.
    """
    uri = os.fspath(uri)
    opts = dict(storage_options) if storage_options else None
    config = _read_config(uri, opts)
    versions = _requested_versions(version)
    tables = {name: _open_table(uri, config, name, versions.get(name), opts) for name in TABLES}
    try:
        _check_schema(uri, tables)
        cell_start = _cell_offsets(uri, tables)
        _check_counts(uri, config, tables, cell_start, pinned=bool(versions))
        _spot_check_expression(uri, tables["expression"], cell_start)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # BaseException: pylance's panics are
        _raise_version_skew(uri, exc, tables)
        raise
    ds = SlafDataset(uri=uri, config=config, cell_start=cell_start, storage_options=opts, **tables)
    logger.info("opened %r", ds)
    return ds


def _raise_version_skew(
    uri: str, exc: BaseException, tables: Mapping[str, lance.LanceDataset]
) -> None:
    """Raise :class:`LanceVersionError` where ``exc`` (or, for an error of ours, its cause)
    is the installed pylance failing on a Lance format another release wrote.
    """
    if isinstance(exc, CorruptDataError):  # damage shown by the files themselves
        return
    cause = exc.__cause__ if isinstance(exc, SlafloadError) else exc
    if cause is not None and not isinstance(cause, SlafloadError):
        skew = version_error(uri, cause, tables)
        if skew is not None:
            raise skew from cause


def _join(uri: str, name: str) -> str:
    return uri.rstrip("/") + "/" + name


def _read_config(uri: str, storage_options: dict[str, str] | None) -> dict[str, Any]:
    path = _join(uri, "config.json")
    if "://" not in uri:
        if not os.path.isdir(uri):
            raise DatasetNotFoundError(
                f"No SLAF dataset at {uri!r}: the directory does not exist. Pass the directory "
                "that holds config.json, expression.lance, cells.lance and genes.lance."
            )
        if not os.path.exists(path):
            raise ConfigError(
                f"{path!r} is missing: {uri!r} is not a SLAF dataset. Write one with "
                "slafload.synthetic.write_atlas, `slafload convert`, or slafdb's converter."
            )
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ConfigError(
                f"Cannot read {path!r}: {exc}. Check the file's permissions."
            ) from exc
    else:
        text = _read_remote_text(path, storage_options)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path!r} is not valid JSON ({exc}). Restore or rewrite it.") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path!r} must hold a JSON object, found {type(config).__name__}.")
    return config


def _read_remote_text(path: str, storage_options: dict[str, str] | None) -> str:
    """Read a small file from an object store with pyarrow, honouring Lance-style options."""
    opts = storage_options or {}
    try:
        if path.startswith("s3://"):
            endpoint = opts.get("aws_endpoint") or opts.get("endpoint")
            fs = pafs.S3FileSystem(
                access_key=opts.get("aws_access_key_id"),
                secret_key=opts.get("aws_secret_access_key"),
                region=opts.get("aws_region") or opts.get("region"),
                endpoint_override=endpoint,
                scheme="http" if endpoint and endpoint.startswith("http://") else "https",
            )
            key = path[len("s3://") :]
        else:
            fs, key = pafs.FileSystem.from_uri(path)
        with fs.open_input_stream(key) as fh:
            return fh.read().decode("utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(f"{path!r} is missing: the URI is not a SLAF dataset.") from exc
    except OSError as exc:
        raise DatasetNotFoundError(f"Cannot read {path!r}: {exc}") from exc


def _requested_versions(version: int | Mapping[str, int] | None) -> dict[str, int]:
    if version is None:
        return {}
    if isinstance(version, int):
        return {"expression": version}
    unknown = set(version) - set(TABLES)
    if unknown:
        raise ValueError(f"version names unknown tables {sorted(unknown)}; allowed: {TABLES}")
    return dict(version)


def _open_table(
    uri: str,
    config: Mapping[str, Any],
    name: str,
    version: int | None,
    storage_options: dict[str, str] | None,
) -> lance.LanceDataset:
    tables = config.get("tables") or {}
    path = _join(uri, tables.get(name, f"{name}.lance"))
    if "://" not in path and not os.path.isdir(path):
        raise MissingTableError(
            f"The {name} table {path!r} is missing. A SLAF dataset needs expression.lance, "
            "cells.lance and genes.lance beside config.json."
        )
    try:
        return lance.dataset(path, version=version, storage_options=storage_options)
    except Exception as exc:  # Lance raises plain OSError/ValueError with Rust messages.
        _raise_version_skew(uri, exc, {})
        raise MissingTableError(
            f"Cannot open the {name} table {path!r}"
            + (f" at version {version}" if version is not None else "")
            + f": {exc}. Check that it is readable (file permissions, or credentials and "
            "endpoint in storage_options) and not damaged; restore it from a copy if it is."
        ) from exc


def _check_schema(uri: str, tables: Mapping[str, lance.LanceDataset]) -> None:
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


def _cell_offsets(uri: str, tables: Mapping[str, lance.LanceDataset]) -> CellOffsets:
    """CSR offsets of every cell from ``cells.cell_start_index``, then the row count.

    The only state of one entry per cell that opening keeps (:class:`CellOffsets`: 2.25 bytes
    a cell, or 4). The cells table is read, checked and compacted in batches of
    :data:`_BATCH_CELLS`, so no ``int64`` array of every cell is held: a 100M-cell atlas opens
    in ~0.23 GB (0.4 GB in the 4-byte form, up to ~0.6 GB while it is widened) plus one batch
    (a table without ``cell_start_index`` is scanned instead, counting every cell's rows in
    one ``int64`` array, as before).
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


def _check_counts(
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


def _spot_check_expression(
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
