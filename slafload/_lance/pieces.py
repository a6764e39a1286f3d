"""A fetch's pieces as the read threads share them: the rows each keeps, and what each range waits for.

:class:`~slafload._lance.data_files.DataFiles` cuts a fetch's row ranges into pieces at data-file
boundaries and reads each piece on a read thread: :class:`Job` is what those threads fill in,
:func:`pieces_kept` and :func:`keep_rows` which rows of a piece the caller keeps, and
:class:`Pending` one range's batches, each piece waited for when it is used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from slafload.pipeline.ranges import expand

if TYPE_CHECKING:
    from slafload._lance.flat_reads import Layout


def pieces_kept(
    rows: np.ndarray, wanted: Sequence[np.ndarray | None] | None, which: np.ndarray,
    first: np.ndarray, n: np.ndarray,
) -> list[np.ndarray | None]:  # fmt: skip
    """For each piece (of range ``which[k]``, absolute rows ``first[k]`` on, ``n[k]`` of them),
    the rows of it that ``wanted`` keeps, relative to the piece (``int64[j, 2]``); ``None``
    where that is the whole piece, or nothing was asked.
    """
    keep: list[np.ndarray | None] = [None] * len(which)
    if wanted is None:
        return keep
    whole = [w is None or (len(w) == 1 and w[0, 0] == a and w[0, 1] == b)
             for w, (a, b) in zip(wanted, rows.tolist(), strict=True)]  # fmt: skip
    for k, (r, a, m) in enumerate(zip(which.tolist(), first.tolist(), n.tolist(), strict=True)):
        ranges = wanted[r]
        if not whole[r] and ranges is not None:
            inside = np.clip(ranges, a, a + m) - a
            keep[k] = inside[inside[:, 1] > inside[:, 0]]
    return keep


def keep_rows(table: pa.Table, ranges: np.ndarray) -> pa.Table:
    """Rows ``ranges`` (``int64[j, 2]``, in order) of ``table``.

    Zero-copy slices where they are most of it; otherwise one ``take``, a copy of the kept
    rows that lets the table's buffers, gap rows and all, go at once. The copy comes from the
    system allocator: made on the read threads (which end with each fetch) and freed on the
    producer, copies from Arrow's default pool (mimalloc) raised peak RSS by 50-70 MB on the
    500k-cell atlas; from the system pool they did not (docs/sampling.md).
    """
    kept = int((ranges[:, 1] - ranges[:, 0]).sum())
    if kept == table.num_rows and len(ranges) == 1:
        return table
    if 2 * kept >= table.num_rows:
        return pa.concat_tables([table.slice(a, b - a) for a, b in ranges.tolist()])
    rows = pa.array(expand(ranges[:, 0], ranges[:, 1] - ranges[:, 0]))
    return pc.take(table, rows, memory_pool=pa.system_memory_pool())


@dataclass(frozen=True, eq=False)
class Job:
    """One :meth:`DataFiles.read` call, as its read threads share it."""

    cols: tuple[str, ...]  # the columns as the data files store them
    names: tuple[str, ...]  # ...and as the table names them (what the tables are given)
    tables: list[pa.Table | None]  # each piece's rows, once read
    keep: list[np.ndarray | None]  # each piece's kept runs, relative to its first row read
    live: list[tuple[int, int]]  # each piece's first dataset row and rows (with a table)
    live_keep: list[np.ndarray | None]  # ...and its kept runs in those rows
    # What the flat pieces are read into (buffers, each with its columns' positions), if
    # the read has them, and each piece's first row there.
    layouts: tuple[tuple[Layout, tuple[int, ...]], ...] = ()
    first: list[int] = field(default_factory=list)

    def named(self, table: pa.Table) -> pa.Table:
        """``table`` with the table's column names."""
        return table if self.cols == self.names else table.rename_columns(list(self.names))


class Pending(Sequence[pa.RecordBatch]):
    """One range's batches: its pieces' tables, each waited for (its window's event) on use.

    Raises the error of a piece's task where that piece was not read.
    """

    def __init__(
        self, waits: list[tuple[Future, threading.Event]], tables: list[pa.Table | None],
        pieces: list[int], notice: Callable[[], None] = lambda: None,
    ):  # fmt: skip
        self._waits, self._tables, self._pieces = waits, tables, pieces
        self._notice = notice
        self._batches: list[pa.RecordBatch] | None = None

    def _all(self) -> list[pa.RecordBatch]:
        if self._batches is None:
            batches: list[pa.RecordBatch] = []
            for (task, read), k in zip(self._waits, self._pieces, strict=True):
                read.wait()
                table = self._tables[k]
                if table is None:
                    error = task.exception()  # the task has failed: wait for its error
                    raise error if error is not None else RuntimeError(f"piece {k} not read")
                batches.extend(b for b in table.to_batches() if b.num_rows)
            self._notice()
            self._batches = batches
        return self._batches

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __getitem__(self, i):
        return self._all()[i]
