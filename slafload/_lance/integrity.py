"""Damaged data files: naming them when a read fails, and checking a whole dataset.

A Lance read of a damaged data file fails in one of three ways: an I/O error (a truncated
file: "failed to fill whole buffer"), a decode error, or a Rust panic, which pyo3 raises as
``pyo3_runtime.PanicException``, a ``BaseException`` that ``except Exception`` does not
catch. None of them names the file. :func:`corruption` maps the failed rows to their data
files and checks each one's Lance footer (the last 40 bytes end with the magic ``LANC``); a
file that fails it, or a read that panicked, becomes a
:class:`~slafload.errors.CorruptDataError` naming the file and the rows. (Rust prints a
panic's message on stderr before Python sees it; it adds a backtrace only where
``RUST_BACKTRACE`` is set.)

:func:`verify` reads every table once (``slafload verify``).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import lance
import numpy as np

from slafload._lance._compat import data_file_path
from slafload.errors import CorruptDataError, SlafloadError

FOOTER_BYTES = 40  # Lance file footer: offsets, counts, versions, then b"LANC"
MAGIC = b"LANC"
_LISTED = 4  # data files named in a message
_RUST_LOCATION = re.compile(r",? ?/\S+\.rs:\d+(:\d+)?")  # where in Rust's source it failed


def is_panic(exc: BaseException) -> bool:
    """Whether ``exc`` is a Rust panic raised through pyo3 (``pyo3_runtime.PanicException``)."""
    kind = type(exc)
    return kind.__name__ == "PanicException" and kind.__module__ == "pyo3_runtime"


def message(exc: BaseException) -> str:
    """``exc``'s message without the Rust source locations Lance appends (``/rustc/...``)."""
    return _RUST_LOCATION.sub("", str(exc)).strip()


@dataclass(frozen=True)
class Piece:
    """A data file of a table and the table rows (logical, after deletions) it holds."""

    path: str
    start: int
    stop: int

    def rows(self) -> str:
        """``"rows a-b"``, inclusive, as the messages name them."""
        return f"rows {self.start:,}-{self.stop - 1:,}"


def pieces(table: lance.LanceDataset) -> Iterator[tuple[Any, list[Piece]]]:
    """Each fragment of ``table`` with its data files and their row range, in row order."""
    start = 0
    for fragment in table.get_fragments():
        stop = start + fragment.count_rows()
        files = [
            Piece(os.path.join(table.uri, "data", data_file_path(d)), start, stop)
            for d in fragment.data_files()
        ]
        yield fragment, files
        start = stop


def footer_problem(path: str) -> str | None:
    """How the Lance footer of local file ``path`` shows damage; ``None`` if it does not
    (or the file is remote, missing or unreadable: not damage, and not checked here).
    """
    if "://" in path:
        return None
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            fh.seek(max(size - FOOTER_BYTES, 0))
            tail = fh.read(FOOTER_BYTES)
    except OSError:
        return None
    if size < FOOTER_BYTES or tail[-4:] != MAGIC:
        return f"is truncated or overwritten: its {size:,} bytes do not end in a Lance footer"
    meta_start = int.from_bytes(tail[0:8], "little")
    if meta_start > size:
        return f"is truncated: its footer points at byte {meta_start:,} of {size:,}"
    return None


def corruption(
    table_name: str, table: lance.LanceDataset, rows: np.ndarray, exc: BaseException
) -> CorruptDataError | None:
    """The error to raise for a read of ``table``'s row ranges ``rows`` (``int64[k, 2]``)
    that failed with ``exc``: a :class:`CorruptDataError` naming the damaged file if a data
    file of those rows fails its footer check, or if the read panicked while another data file
    of the table in the same Lance format decodes (a panic alone may also be a file written by
    another pylance release: :func:`slafload._lance.fragments.version_error`); else ``None`` (not
    known to be damage: the caller reports ``exc`` as a read failure).
    """
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
    a, b = int(rows[:, 0].min()), int(rows[:, 1].max())
    hit = holding(table, rows)
    for piece in hit:
        problem = footer_problem(piece.path)
        if problem is not None:
            return CorruptDataError(
                f"{table_name}.lance: data file {piece.path} ({piece.rows()}) {problem}. "
                f"Restore the file from a copy or rewrite the dataset; `slafload verify` "
                f"lists every damaged file."
            )
    sound = _decoding_sibling(table, hit) if is_panic(exc) else None
    if sound is None:
        return None
    return CorruptDataError(
        f"{table_name}.lance: reading rows {a:,}-{b - 1:,} crashed Lance's decoder "
        f"({message(exc)}): a page of {describe(hit)} is damaged (the first row of {sound} "
        "decodes, so this pylance reads the format). Run `slafload verify` on the dataset to "
        "find every damaged file, then restore them from a copy or rewrite it."
    )


def _decoding_sibling(table: lance.LanceDataset, hit: list[Piece], tries: int = 3) -> str | None:
    """A data file of ``table`` in a Lance format of ``hit``'s files whose first row decodes
    (at most ``tries`` tried, ``hit``'s own first): this pylance reads that format as written,
    so a panic further in is damage. ``None`` if none does.
    """
    paths = {p.path for p in hit}
    formats: set[tuple[int, int]] = set()
    candidates: list[tuple[Any, str, set[tuple[int, int]]]] = []
    for fragment, files in pieces(table):
        kinds = {(f.file_major_version, f.file_minor_version) for f in fragment.metadata.files}
        if files and any(p.path in paths for p in files):
            formats |= kinds
            candidates.insert(0, (fragment, files[0].path, kinds))
        elif files:
            candidates.append((fragment, files[0].path, kinds))
    for fragment, path, _ in [c for c in candidates if c[2] & formats][:tries]:
        try:
            fragment.head(1)
        except BaseException as exc:
            if not isinstance(exc, Exception) and not is_panic(exc):
                raise
            continue
        return path
    return None


def holding(table: lance.LanceDataset, rows: np.ndarray) -> list[Piece]:
    """The data files of ``table`` that hold any of the row ranges ``rows`` (``int64[k, 2]``)."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
    return [
        p
        for _, files in pieces(table)
        for p in files
        if np.any((rows[:, 0] < p.stop) & (rows[:, 1] > p.start))
    ]


def describe(files: list[Piece]) -> str:
    """``files`` (at most a few) with their rows, for a message."""
    text = ", ".join(f"{p.path} ({p.rows()})" for p in files[:_LISTED]) or "no data file"
    if len(files) > _LISTED:
        text += f" or one of {len(files) - _LISTED} more data files"
    return text


def raise_if_corrupt(
    table_name: str, table: lance.LanceDataset, rows: np.ndarray, exc: BaseException
) -> None:
    """Raise :func:`corruption`'s error (chained to ``exc``) if there is one."""
    error = corruption(table_name, table, rows, exc)
    if error is not None:
        raise error from exc


@contextlib.contextmanager
def naming_damage(table_name: str, table: lance.LanceDataset, rows: np.ndarray) -> Iterator[None]:
    """Turn a failure to read ``table``'s ``rows`` inside the block into a
    :class:`CorruptDataError` where :func:`corruption` finds damage; re-raise it otherwise.
    """
    try:
        yield
    except SlafloadError:
        raise
    except BaseException as exc:  # a Rust panic in Lance is a BaseException
        if isinstance(exc, Exception) or is_panic(exc):
            raise_if_corrupt(table_name, table, rows, exc)
        raise
