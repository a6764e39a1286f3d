"""Rewrite a dataset's expression table for cheaper random reads, as a new Lance version.

``slafload optimize DATASET`` (or :func:`optimize`) rewrites ``expression.lance``, the same
rows in the same order, in Lance's 2.0 file format and, optionally, into larger data files.
Nothing else changes: ``cells.lance`` (and its ``cell_start_index``), ``genes.lance`` and
``config.json`` stay as they are, every cell keeps its rows, and every token the loader yields
is identical. It is never implicit: the loader reads whatever version is latest.

Why 2.0. SLAF 0.5 converters (slafdb's, and ``slafload convert``) write Lance's 2.2 format,
whose pages are compressed mini-blocks: small on disk (~3 bytes per non-zero for ``uint16``
counts) but every range read re-reads and decodes its pages' metadata, ~0.2 ms of CPU per
call however few rows it returns (``pylance`` 14's file reader has no metadata cache). The 2.0
format stores each page whole, its metadata loaded once when a file is opened, so a range read
costs about half the CPU. The loader's range reads are what ``BlockShuffle`` pays per block,
so it gains most; the price is disk (and bytes fetched from object storage): ~2.9x here, the
columns' plain widths. Measured numbers: ``docs/sampling.md`` ("Rewriting into Lance 2.0").

``rows_per_file`` also merges data files. That helps tables with more data files than the
loader keeps open (a quarter of the descriptor limit, at most 8,192), where a block in an
evicted file pays for reopening it. It also helps the start of every run, when each file is
opened for the first time. Once every file is open, the file count makes no difference.

Run it with no other writer on the dataset: the rewrite replaces the table wholesale, so a
version another writer commits meanwhile is not in it (that is detected, and reported with the
version to restore). An interrupted or failed rewrite commits nothing (data files already
written may stay on disk, unreferenced, until ``cleanup_old_versions(delete_unverified=True)``),
and Ctrl-C or a read error surfaces as itself (:func:`~slafload.tools.writer.write_batches`).

The previous version stays readable (a run resumed from a checkpoint taken before keeps
reading it, and the disk holds both) until ``delete_old_versions`` (``--delete-old-versions``)
or Lance's ``LanceDataset.cleanup_old_versions`` removes it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, Literal, get_args

import lance
import pyarrow as pa

from slafload._lance._compat import data_file_path
from slafload._lance.data_files import file_versions
from slafload.data.dataset import open_dataset
from slafload.tools.progress import progress_bar
from slafload.tools.writer import write_batches

__all__ = ["OptimizeReport", "file_format", "optimize"]

logger = logging.getLogger(__name__)

StorageVersion = Literal["2.0", "2.1", "2.2"]
STORAGE_VERSION: Final = "2.0"  # Lance file format whose range reads cost least (see above)
STORAGE_VERSIONS: Final = get_args(StorageVersion)
_BATCH_ROWS: Final = 1 << 20  # rows read and written at a time


@dataclass(frozen=True)
class OptimizeReport:
    """What :func:`optimize` did (``changed`` is False when there was nothing to do)."""

    uri: str
    changed: bool
    rows: int
    versions: tuple[int, int]  # expression table's Lance version before, after
    storage_versions: tuple[str, str]
    data_files: tuple[int, int]
    bytes: tuple[int, int]  # data file bytes before, after
    seconds: float
    freed_bytes: int = 0  # removed with the older versions (``delete_old_versions``)


def optimize(
    uri: str | os.PathLike[str],
    *,
    storage_version: StorageVersion = STORAGE_VERSION,
    rows_per_file: int | None = None,
    storage_options: Mapping[str, str] | None = None,
    delete_old_versions: bool = False,
    progress: bool = True,
) -> OptimizeReport:
    """Rewrite ``uri``'s expression table in ``storage_version``, as a new Lance version.

    Args:
        uri: SLAF dataset directory or object-store URI.
        storage_version: Lance file format of the new data files (``"2.0"``; ``"2.2"`` undoes).
        rows_per_file: Rows per new data file; ``None`` keeps Lance's default (~1M rows).
        storage_options: Lance storage options for object stores.
        delete_old_versions: Once the new version is written and validated, delete every
            older version of the expression table and its files. Checkpoints taken before
            can then no longer be resumed.
        progress: Show a progress bar over the rows.

    Returns:
        An :class:`OptimizeReport`. When the table is already in ``storage_version`` and no
        ``rows_per_file`` is given, nothing is written (``changed`` is False).

    Raises:
        DatasetError: ``uri`` is not a valid SLAF dataset (checked before anything is written).
        ValueError: ``storage_version`` is not one of :data:`STORAGE_VERSIONS`, or
            ``rows_per_file`` is not a positive integer.
    """
    if storage_version not in STORAGE_VERSIONS:
        raise ValueError(f"storage_version must be one of {STORAGE_VERSIONS}, "
                         f"got {storage_version!r}")  # fmt: skip
    if rows_per_file is not None and (not isinstance(rows_per_file, int) or rows_per_file < 1):
        raise ValueError(f"rows_per_file must be a positive integer, got {rows_per_file!r}")
    started = time.perf_counter()
    ds = open_dataset(uri, storage_options=storage_options)
    table = ds.expression
    before = _summary(table)
    if before[0] == storage_version and rows_per_file is None:
        logger.info("%s: expression table already in Lance %s", ds.uri, storage_version)
        # An earlier run may have kept the versions it replaced: delete them if asked.
        freed = _delete_older(table) if delete_old_versions else 0
        return OptimizeReport(ds.uri, False, ds.n_rows, (table.version,) * 2,
                              (before[0],) * 2, (before[1],) * 2, (before[2],) * 2,
                              time.perf_counter() - started, freed)  # fmt: skip
    kwargs: dict[str, Any] = {"max_rows_per_file": rows_per_file} if rows_per_file else {}
    options = dict(ds.storage_options or {}) or None
    scan = table.scanner(batch_size=_BATCH_ROWS, scan_in_order=True)
    write_batches(_counted(scan.to_batches(), ds.n_rows, progress), table.uri, table.schema,
                  mode="overwrite", data_storage_version=storage_version,
                  storage_options=options, **kwargs)  # fmt: skip
    committed = lance.dataset(table.uri, storage_options=options).version
    if committed != table.version + 1:  # Overwrite replaced what another writer committed
        raise RuntimeError(
            f"another writer committed to {table.uri} while optimize rewrote version "
            f"{table.version} (now at {committed}); its changes are not in the rewrite: "
            f"restore version {committed - 1} with LanceDataset.restore() and run optimize "
            "again with no other writer"
        )
    new = open_dataset(ds.uri, storage_options=storage_options)  # validates the rewrite
    after = _summary(new.expression)
    freed = _delete_older(new.expression) if delete_old_versions else 0
    return OptimizeReport(
        ds.uri, True, ds.n_rows, (table.version, new.expression.version),
        (before[0], after[0]), (before[1], after[1]), (before[2], after[2]),
        time.perf_counter() - started, freed,
    )  # fmt: skip


def _delete_older(table: lance.LanceDataset) -> int:
    """Delete every version of ``table`` older than its pinned one, and their files; bytes
    freed.
    """
    return int(table.cleanup_old_versions(older_than=timedelta(0)).bytes_removed)


def file_format(table: lance.LanceDataset) -> str:
    """The Lance file format of a pinned table version's data files: ``"2.0"``, ``"2.2"``...

    Several, comma-separated, in a table that mixes them.
    """
    found = file_versions(table)
    return ", ".join(f"{major}.{minor}" for major, minor in sorted(found)) or "none"


def _data_files(table: lance.LanceDataset) -> list[Any]:
    return [f for fragment in table.get_fragments() for f in fragment.metadata.files]


def _summary(table: lance.LanceDataset) -> tuple[str, int, int]:
    """``(file format, data files, data bytes)`` of a pinned table version."""
    files = _data_files(table)
    storage = file_format(table)
    data = table.uri.rstrip("/") + "/data/"
    sizes = [
        f.file_size_bytes
        if f.file_size_bytes is not None or "://" in data
        else os.path.getsize(data + data_file_path(f))
        for f in files
    ]
    return storage, len(files), sum(s or 0 for s in sizes)


def _counted(
    batches: Iterator[pa.RecordBatch], total: int, progress: bool
) -> Iterator[pa.RecordBatch]:
    """``batches``, advancing a progress bar by their rows."""
    bar = progress_bar(progress, total, "optimize", unit="row")
    try:
        for batch in batches:
            yield batch
            if bar is not None:
                bar.update(batch.num_rows)
    finally:
        if bar is not None:
            bar.close()
