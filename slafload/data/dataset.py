"""Open a SLAF dataset, validate it, and pin its Lance versions.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import lance
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.fs as pafs

from slafload._lance.fragments import version_error
from slafload._lance.object_store import s3_filesystem
from slafload._lance.ranged import StoreFiles
from slafload.data.checks import cell_offsets, check_counts, check_schema, spot_check_expression
from slafload.data.offsets import CellOffsets
from slafload.errors import (
    ConfigError,
    CorruptDataError,
    DatasetNotFoundError,
    MissingTableError,
    SchemaError,
    SlafloadError,
    StateError,
)

if TYPE_CHECKING:
    from slafload.pipeline.reader import Reader, ReadOptions
    from slafload.types import ChunkTransform, Sampler, Tokenizer

logger = logging.getLogger(__name__)

TABLES = ("expression", "cells", "genes")


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
        store_files: The expression table's data files opened by range requests (``s3://``),
            shared by the dataset's loaders so each file is opened once
            (:class:`~slafload._lance.ranged.StoreFiles`).
    """

    uri: str
    config: Mapping[str, Any]
    expression: lance.LanceDataset
    cells: lance.LanceDataset
    genes: lance.LanceDataset
    cell_start: CellOffsets
    storage_options: Mapping[str, str] | None = field(default=None, repr=False)
    store_files: StoreFiles = field(default_factory=StoreFiles, init=False, repr=False)

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

    # -- what a run asks of any cell source (types.CellSource); a mixture adds to each ------

    @property
    def source_names(self) -> None:
        """``None``: one dataset has no sources (a mixture's names them)."""
        return None

    @property
    def transform(self) -> None:
        """``None``: chunks run only the loader's transforms (a mixture's run its sources')."""
        return None

    def cell_columns(self) -> dict[str, Any]:
        """No per-cell columns besides ``cell_integer_id`` and the obs columns."""
        return {}

    def sampler(
        self,
        default: Sampler,
        bind: Callable[[Sampler], Sampler] = lambda s: s,
        batch_size: int = 1,
        memory_budget: int | None = None,
    ) -> Sampler:
        """``default``: the loader's sampler plans this dataset's epochs as it is."""
        return default

    def check_values(self, tokenizer: Tokenizer, transforms: Sequence[ChunkTransform]) -> None:
        """Accept any values: one dataset holds one kind."""

    def repin(self, versions: Mapping[str, Any]) -> SlafDataset:
        """This dataset opened at the Lance ``versions`` a checkpoint recorded (itself if it
        already is).

        Raises:
            StateError: those versions cannot be opened.
        """
        versions = dict(versions)
        if versions == self.versions:
            return self
        logger.info("re-pinning %s to the checkpoint's versions %s", self.uri, versions)
        try:
            return open_dataset(self.uri, version=versions, storage_options=self.storage_options)
        except Exception as exc:
            raise StateError(
                f"cannot reopen {self.uri!r} at the checkpoint's versions {versions}: {exc}"
            ) from exc

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
        check_schema(uri, tables)
        cell_start = cell_offsets(uri, tables)
        check_counts(uri, config, tables, cell_start, pinned=bool(versions))
        spot_check_expression(uri, tables["expression"], cell_start)
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
            fs, key = s3_filesystem(opts), path[len("s3://") :]
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
