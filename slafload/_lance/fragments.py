"""What a pinned expression table's fragments hold, as the direct data-file path needs it.

Lance keeps two things outside the data files that change what a row offset reads:

- **Field ids.** A data file stores its columns under the names they had when it was written;
  the table's schema maps each column *name* to a field *id*, and each data file lists the
  field id of each of its columns (``DataFile.fields``). Renaming a column
  (``alter_columns``) changes only the table's schema, so after ``value`` is swapped with
  another column, or dropped and another column renamed to it, the file's ``value`` is not the
  table's ``value``. :func:`stored_names` finds each wanted column's position in the data files
  by its field id, and the name the files store there: the direct path reads those and names
  them as the table does. Every file opened later must store the same names
  (``DataFiles`` checks it at open; a file that does not is read through Lance).
- **Deleted rows.** ``dataset.delete(...)`` writes a deletion file per fragment; the data file
  keeps every physical row, and dataset row offsets count the live rows only.
  :class:`Deletions` turns a piece of live rows into the physical rows that hold them and the
  runs of live rows inside (a file's deleted rows are listed once, on its first read: from
  its deletion file, or by a row-address scan of the fragment, which reads no column data).

:func:`survey` lists what else the direct path does not read, and says why: column overlays,
a fragment whose columns are spread over several data files (columns added or cast after
writing), a data file on another base path, data files whose field ids differ, nested fields.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import lance
import numpy as np
import pyarrow as pa

from slafload._lance._compat import data_file_path, deletion_array, field_ids, version_skew
from slafload.errors import LanceVersionError


class Survey(NamedTuple):
    """The fragments of a pinned version that the direct path can read, one data file each."""

    paths: list[str]  # each data file's full path, in fragment order
    rows: list[int]  # each fragment's live rows
    versions: list[tuple[int, int]]  # each data file's Lance format (major, minor)
    fields: list[int]  # the field ids of every data file's columns, in the files' order
    deleted: dict[int, int]  # data file index -> fragment id, where it has a deletion file


def survey(expression: lance.LanceDataset) -> Survey | str:
    """The data files of ``expression``'s fragments, or why the direct path cannot read them."""
    paths: list[str] = []
    rows: list[int] = []
    versions: list[tuple[int, int]] = []
    fields: list[int] | None = None
    deleted: dict[int, int] = {}
    base = expression.uri.rstrip("/")
    for index, fragment in enumerate(expression.get_fragments()):
        meta = fragment.metadata
        where = f"fragment {meta.id}"
        if getattr(meta, "overlays", None):
            return f"{where} has column overlays"
        files = meta.files
        if len(files) != 1:
            return (
                f"{where} keeps its columns in {len(files)} data files (columns added or cast "
                "after the table was written; `slafload optimize` rewrites them into one)"
            )
        (data,) = files
        if getattr(data, "base_id", None) is not None:
            return f"{where}'s data file is on another base path"
        ids, columns = list(data.fields), list(getattr(data, "column_indices", None) or [])
        if columns and columns != list(range(len(ids))):
            return f"{where}'s data file has nested columns"
        if fields is None:
            fields = ids
        elif ids != fields:
            return f"{where}'s data file holds fields {ids}, the first fragment's {fields}"
        live = meta.physical_rows
        if meta.deletion_file is not None:
            gone = getattr(meta.deletion_file, "num_deleted_rows", None)
            live = fragment.count_rows() if gone is None else live - int(gone)
            deleted[index] = meta.id
        paths.append(f"{base}/data/{data_file_path(data)}")
        rows.append(live)
        versions.append((data.file_major_version, data.file_minor_version))
    if fields is None:
        return "the table has no fragments"
    return Survey(paths, rows, versions, fields, deleted)


def stored_names(
    expression: lance.LanceDataset, fields: Sequence[int], stored: pa.Schema,
    columns: Sequence[str],
) -> dict[str, str] | str:  # fmt: skip
    """The name a data file stores each of ``columns`` under, by field id (``stored``: the
    file's schema, ``fields``: its field ids in order), or why they cannot be read from it.
    """
    ids = field_ids(expression)
    if ids is None:
        return "this pylance does not list the table's field ids"
    if len(stored) != len(fields):
        return f"a data file has {len(stored)} columns but lists {len(fields)} field ids"
    wanted = expression.schema
    out = {}
    for name in columns:
        if name not in ids or ids[name] not in fields:
            return f"column {name!r} (field id {ids.get(name)}) is not in the data files"
        found = stored.field(list(fields).index(ids[name]))
        if found.type != wanted.field(name).type:
            return (
                f"column {name!r} is stored as {found.type} in the data files but the table "
                f"reads it as {wanted.field(name).type}"
            )
        out[name] = found.name
    return out


class Matched(NamedTuple):
    """How a table's data files are read as the table: what :class:`DataFiles` checks and maps."""

    expression: lance.LanceDataset
    names: dict[str, str]  # each column the reads ask for -> the name the data files store
    file_names: tuple[str, ...]  # every data file's stored column names (checked at open)
    deletions: Deletions


class Deletions:
    """The deleted physical rows of a table's data files, listed on first use, and the
    physical rows of a piece of live rows.

    Thread-safe; ``files`` maps a data file's index to its fragment's id.
    """

    def __init__(self, expression: lance.LanceDataset, files: dict[int, int]):
        self.expression = expression
        self.files = dict(files)
        self._rows: dict[int, tuple[np.ndarray, list[int], list[int]]] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self.files)

    def rows(self, index: int) -> np.ndarray:
        """The sorted physical offsets deleted from data file ``index`` (empty: none)."""
        return self._listed(index)[0]

    def _listed(self, index: int) -> tuple[np.ndarray, list[int], list[int]]:
        """Data file ``index``'s deleted rows, as an array and a list, and the live rows
        before each (lists: a piece's few lookups cost less by ``bisect`` than by numpy).
        """
        if index not in self.files:
            return np.zeros(0, np.int64), [], []
        with self._lock:
            found = self._rows.get(index)
            if found is None:
                fragment = self.expression.get_fragment(self.files[index])
                gone = deleted_rows(self.expression.uri, fragment)
                shift = gone - np.arange(len(gone))
                found = self._rows[index] = (gone, gone.tolist(), shift.tolist())
            return found

    def physical(
        self, index: int, lo: int, n: int, keep: np.ndarray | None
    ) -> tuple[int, int, np.ndarray | None]:
        """The physical rows ``(first, rows, kept runs)`` of data file ``index`` that hold its
        live rows ``[lo, lo + n)`` (of which ``keep``, relative to ``lo``, where given): the
        kept runs, relative to ``first``, skip every deleted row (``None``: all of them).
        """
        _, gone, shift = self._listed(index)
        if not gone:
            return lo, n, keep
        first = lo + bisect.bisect_right(shift, lo)
        stop = lo + n - 1 + bisect.bisect_right(shift, lo + n - 1) + 1
        runs: list[tuple[int, int]] = []
        for a, b in [(0, n)] if keep is None else keep.tolist():
            if b > a:
                p = lo + a + bisect.bisect_right(shift, lo + a)
                q = lo + b - 1 + bisect.bisect_right(shift, lo + b - 1) + 1
                runs.extend(_live_runs(gone, p, q))
        kept = np.array(runs, np.int64).reshape(-1, 2) - first
        if keep is None and len(kept) == 1:
            return first, stop - first, None
        return first, stop - first, kept


def _live_runs(gone: list[int], p: int, q: int) -> list[tuple[int, int]]:
    """The runs of physical rows ``[p, q)`` that ``gone`` (sorted) does not hold."""
    runs = []
    for d in gone[bisect.bisect_left(gone, p) : bisect.bisect_left(gone, q)]:
        if d > p:
            runs.append((p, d))
        p = d + 1
    if q > p:
        runs.append((p, q))
    return runs


def deleted_rows(uri: str, fragment: Any) -> np.ndarray:
    """The sorted physical offsets of the deleted rows of ``fragment`` (of the table at
    ``uri``): from its deletion file where :func:`slafload._lance._compat.deletion_array` reads it,
    else from the addresses of its live rows (a scan that reads no column data: ~25 ms for
    1M rows).
    """
    listed = deletion_array(uri, fragment)
    if listed is not None:
        return listed
    live = fragment.to_table(columns=[], with_row_address=True).column(0).to_numpy()
    mask = np.ones(fragment.metadata.physical_rows, dtype=bool)
    mask[(live & 0xFFFFFFFF).astype(np.int64)] = False
    return np.flatnonzero(mask).astype(np.int64)


def file_versions(expression: lance.LanceDataset) -> set[tuple[int, int]]:
    """The Lance file formats ``(major, minor)`` of a pinned table version's data files."""
    return {
        (f.file_major_version, f.file_minor_version)
        for fragment in expression.get_fragments()
        for f in fragment.metadata.files
    }


def version_error(
    uri: str, exc: BaseException, tables: Mapping[str, lance.LanceDataset]
) -> LanceVersionError | None:
    """The error to raise for ``exc`` (raised by pylance reading ``tables`` of the dataset at
    ``uri``) where it is a Lance version mismatch, not damage
    (:func:`slafload._lance._compat.version_skew`); ``None`` where nothing says it is.
    """
    formats = {}
    for name, table in tables.items():
        try:  # the manifest lists them, whatever the data files hold
            formats[name] = file_versions(table)
        except Exception:
            formats[name] = set()
    why = version_skew(exc, formats)
    if why is None:
        return None
    return LanceVersionError(
        f"Lance version mismatch reading {uri!r}: {why} ({type(exc).__name__}: {exc}). "
        "Install the pylance release that wrote the dataset, or have that release rewrite "
        "its tables in a format both read (`slafload optimize --storage-version 2.0` for "
        "expression.lance; `lance.write_dataset(..., data_storage_version='2.0')` for "
        "cells.lance and genes.lance)."
    )
