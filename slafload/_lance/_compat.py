"""Every private or unstable API of pylance and Polars that slafload calls, fenced in one place.

Both are used for speed, and both may change without notice; ``pyproject.toml`` bounds the
versions they are known to work with, and CI runs the core tests against the lowest versions
the bounds admit as well as the locked ones. When either library changes, only this module
changes.

- ``LanceDataset._ds.take_scan``: reads many row ranges in one call with read-ahead on Lance's
  own threads (private; no public equivalent streams ranges in order).
- ``lance.file.LanceFileSession`` (newer pylance only): one object-store client shared by the
  file readers of a dataset; older releases open each file reader with its own client.
- ``DataFile._path`` (private): a data file's path. The public ``DataFile.path`` builds a new
  ``str`` subclass on every access (so the deprecated call form ``path()`` still works): a
  class of ~2.7 KB a data file for the cyclic collector to free. Listing a 5M-cell atlas's
  3,816 files took 38 ms so and takes 14 ms without (``DataFiles.of``, before the first
  batch; ~0.5 s less by extrapolation on a 100M-cell atlas of ~76k files).
- ``LanceDataset.lance_schema.fields()``: each column's field id (``LanceField.id()``), which
  data files are matched by (newer pylance only; older releases leave the direct path unused).
- Lance's deletion files of the "array" kind (``DeletionFile.file_type == "array"``): an
  Arrow IPC file of one unsigned integer column, the deleted rows' offsets in their data
  file (``lance-table``'s ``io/deletion.rs``), read by :func:`deletion_array` (~1 ms, where
  listing the live rows' addresses takes ~25 ms per 1M rows). Checked against the count the
  manifest records; anything else is listed through Lance.
- The text of pylance's errors: a table whose Lance file format the installed pylance cannot
  read fails with a plain ``OSError``/``ValueError`` (or a Rust panic), whose message is all
  that says so (:func:`version_skew`).
- ``LazyFrame.collect(background=True)``: runs a query on Polars' thread pool and returns a
  handle (documented as unstable), so Polars ranks one piece while numpy tokenizes another.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import lance
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.ipc


def take_scan(
    dataset: lance.LanceDataset,
    spans: Sequence[tuple[int, int]],
    *,
    columns: list[str],
    batch_readahead: int,
) -> Iterator[pa.RecordBatch]:
    """One record batch per row span ``[start, stop)`` of ``dataset``, in request order."""
    return iter(
        dataset._ds.take_scan(list(spans), columns=columns, batch_readahead=batch_readahead)
    )


class BackgroundQuery(Protocol):
    """A Polars query running on Polars' own threads."""

    def fetch_blocking(self) -> pl.DataFrame:
        """Wait for the query and return its result."""
        ...


def data_file_path(data: Any) -> str:
    """The path of ``data`` (a ``lance.fragment.DataFile``) relative to the table's ``data/``,
    read without building the class ``DataFile.path`` builds on every access.
    """
    path = getattr(data, "_path", None)
    return path if isinstance(path, str) else str(data.path)


def field_ids(dataset: lance.LanceDataset) -> dict[str, int] | None:
    """The field id of each top-level column of ``dataset``'s schema, by name; ``None`` where
    this pylance does not list them.
    """
    try:
        return {f.name(): f.id() for f in dataset.lance_schema.fields()}
    except AttributeError:
        return None


_UNKNOWN_FORMAT = re.compile(r"Unknown Lance storage version: ([0-9]+\.[0-9]+)")
_DECODE_WORDS = ("not supported", "unsupported", "encoding", "decod", "miniblock", "grammar")
_ABORTED = "runtimeerror: task was aborted"
UNSTABLE_FROM = (2, 2)  # formats some admitted pylance releases wrote while still unstable


def version_skew(exc: BaseException, formats: Mapping[str, set[tuple[int, int]]]) -> str | None:
    """Why ``exc``, raised by pylance reading tables whose data files are in the Lance file
    formats ``formats`` (``(major, minor)`` by table name), is a Lance version mismatch, or
    ``None`` if nothing says it is.

    A format the installed pylance does not know is named in its error; a format it knows
    but whose encodings changed between releases (2.2 and later were unstable in older
    pylance: a 2.2 file written by one release may not decode, or may panic, in another)
    fails with a decoding error or a panic on a table holding such files (in pylance 0.35,
    a panic in one of Lance's tasks surfaces as ``RuntimeError: Task was aborted``).
    """
    text = f"{type(exc).__name__}: {exc}"
    installed = f"the installed pylance {lance.__version__}"
    unknown = _UNKNOWN_FORMAT.search(text)
    if unknown:
        return (
            f"its data files are in Lance file format {unknown.group(1)}, which {installed} "
            "does not read"
        )
    # a panic in one of Lance's tasks reaches older pylance releases as an aborted task
    panic = type(exc).__name__ == "PanicException" or _ABORTED in text.lower()
    if not panic and not any(word in text.lower() for word in _DECODE_WORDS):
        return None
    late = sorted(f"{name}.lance: Lance {v[0]}.{v[1]}" for name, found in formats.items()
                  for v in found if v >= UNSTABLE_FROM)  # fmt: skip
    if not late:
        return None
    return (
        f"{installed} failed to decode data files of a format whose encodings changed between "
        f"pylance releases ({', '.join(late)}; probably written by another release)"
    )


def deletion_array(uri: str, fragment: Any) -> np.ndarray | None:
    """The sorted offsets that ``fragment``'s deletion file lists, where it is a local file of
    Lance's "array" kind holding exactly the rows the manifest counts; ``None`` otherwise.
    """
    meta = fragment.metadata.deletion_file
    if meta is None or "://" in uri or getattr(meta, "file_type", None) != "array":
        return None
    try:
        path = f"{uri.rstrip('/')}/{meta.path(fragment.fragment_id)}"
        with open(path, "rb") as file:  # read whole: opening it by path costs ~3 ms more
            table = pa.ipc.open_file(pa.py_buffer(file.read())).read_all()
    except (OSError, pa.ArrowInvalid, TypeError, AttributeError):
        return None
    if table.num_columns != 1 or not pa.types.is_unsigned_integer(table.schema[0].type):
        return None
    rows = np.unique(table.column(0).to_numpy().astype(np.int64))
    counted = getattr(meta, "num_deleted_rows", None)
    if counted is None or len(rows) != counted or len(rows) != table.num_rows:
        return None
    if len(rows) and rows[-1] >= fragment.metadata.physical_rows:
        return None
    return rows


def collect_in_background(query: pl.LazyFrame) -> BackgroundQuery:
    """Start ``query`` on Polars' thread pool; the GIL is free while it runs."""
    return query.collect(background=True)


def file_session(base: str, storage_options: Mapping[str, str] | None) -> Any | None:
    """A ``LanceFileSession`` on ``base`` (readers opened through it share one client), or
    ``None`` on pylance releases that lack it.
    """
    try:
        from lance.file import LanceFileSession
    except ImportError:
        return None
    return LanceFileSession(base, storage_options=dict(storage_options or {}) or None)
