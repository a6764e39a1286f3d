"""Read expression row ranges straight from the table's data files, with their readers kept open.

``LanceDataset.take_scan`` (and ``take``) turns every requested range of dataset row *offsets*
into row *addresses* by listing the pinned version's fragments and walking them from the first
(``row_offsets_to_row_addresses`` in Lance's ``dataset/take.rs``), then opens the fragment that
holds the range. Both costs are paid per range, and the first grows with the number of data
files: on a 5M-cell atlas (3,816 files) one 16-cell range costs several times what the same
read costs on a file whose reader is already open (numbers in docs/sampling.md, from
``benchmarks/range_cost.py``). :class:`DataFiles` does that arithmetic once per pinned version
(one ``int64`` per data file) and keeps a bounded LRU cache of ``lance.file.LanceFileReader``
objects, so a range costs one ``read_range`` on an open file.

Only tables where this is exact take this path: every fragment has exactly one data file
holding every column, no deletion file, no extra base path, and the data files' schema names
and types match the dataset's for the columns read. Anything else returns ``None`` from
:meth:`DataFiles.of` and the reader keeps using ``take_scan``.
"""

from __future__ import annotations

import logging
import resource
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import lance
import numpy as np
import pyarrow as pa
from lance.file import LanceFileReader

from slafload.ranges import expand

logger = logging.getLogger(__name__)

MAX_OPEN_FILES = 8192  # upper bound of the reader cache; each open reader holds a descriptor
STREAMS_AT_ONCE = 128  # read_range streams alive at once (each holds its pages until consumed)


def default_max_open() -> int:
    """Readers kept open: a quarter of the soft descriptor limit, within [16, MAX_OPEN_FILES]."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN_FILES
    return max(16, min(MAX_OPEN_FILES, soft // 4))


class DataFiles:
    """The data files of a pinned expression table, by dataset row offset.

    ``starts[i]`` is the dataset row offset of data file ``i``'s first row (``starts[-1]`` the
    row count). Not thread safe: one producer thread reads through it (pylance file readers
    refuse concurrent calls).
    """

    def __init__(
        self,
        paths: Sequence[str],
        starts: np.ndarray,
        storage_options: Mapping[str, str] | None = None,
        max_open: int | None = None,
    ):
        self.paths = list(paths)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.storage_options = dict(storage_options) if storage_options else None
        self.max_open = default_max_open() if max_open is None else max_open
        if self.max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {self.max_open}")
        self._open: OrderedDict[tuple[int, tuple[str, ...]], LanceFileReader] = OrderedDict()

    @classmethod
    def of(
        cls,
        expression: lance.LanceDataset,
        columns: Sequence[str],
        storage_options: Mapping[str, str] | None = None,
        max_open: int | None = None,
    ) -> DataFiles | None:
        """The data files of ``expression``'s pinned version, or ``None`` where reading them
        directly would not be exact (see the module docstring).
        """
        fragments = expression.get_fragments()
        if not fragments:
            return None
        paths: list[str] = []
        rows: list[int] = []
        fields: list[int] | None = None  # the field ids of every data file
        for fragment in fragments:
            meta = fragment.metadata
            files = meta.files
            if len(files) != 1 or meta.deletion_file is not None:
                return None
            (data,) = files
            if getattr(data, "base_id", None) is not None:
                return None
            if fields is None:
                fields = list(data.fields)
            elif list(data.fields) != fields:
                return None
            paths.append(f"{expression.uri.rstrip('/')}/data/{data.path}")
            rows.append(meta.physical_rows)
        direct = cls(paths, np.concatenate([[0], np.cumsum(rows)]), storage_options, max_open)
        try:
            stored = direct._reader(0, tuple(columns)).metadata().schema
        except Exception as exc:  # an unreadable file is the scan's to report, not ours
            logger.debug("not reading data files directly: %r", exc)
            return None
        wanted = expression.schema
        for name in columns:
            idx = stored.get_field_index(name)
            if idx < 0 or stored.field(idx).type != wanted.field(name).type:
                return None
        if int(direct.starts[-1]) != expression.count_rows():
            return None
        return direct

    @property
    def n_files(self) -> int:
        """Data files of the pinned version."""
        return len(self.paths)

    def pieces(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Cut non-empty row ranges ``int64[k, 2]`` at data-file boundaries.

        Returns ``(range index, file index, first row in the file, rows)`` per piece, in
        range order.
        """
        first = np.searchsorted(self.starts, rows[:, 0], side="right") - 1
        last = np.searchsorted(self.starts, rows[:, 1] - 1, side="right") - 1
        counts = last - first + 1
        which = np.repeat(np.arange(len(rows)), counts)
        file = expand(first, counts)
        lo = np.maximum(rows[which, 0], self.starts[file])
        hi = np.minimum(rows[which, 1], self.starts[file + 1])
        return which, file, lo - self.starts[file], hi - lo

    def read(self, rows: np.ndarray, columns: Sequence[str]) -> list[list[pa.RecordBatch]]:
        """The batches of every row range (non-empty ``int64[k, 2]``), one list per range.

        Streams are created :data:`STREAMS_AT_ONCE` at a time before any of them is consumed,
        so Lance schedules their I/O together (1.9x faster than one by one, measured) while
        the pages they hold stay bounded: all 8k streams of a fetch of single cells at once
        peaked at 3 GB of RSS.
        """
        cols = tuple(columns)
        which, file, lo, n = self.pieces(rows)
        out: list[list[pa.RecordBatch]] = [[] for _ in range(len(rows))]
        pieces = list(zip(which.tolist(), file.tolist(), lo.tolist(), n.tolist(), strict=True))
        for start in range(0, len(pieces), STREAMS_AT_ONCE):
            window = pieces[start : start + STREAMS_AT_ONCE]
            streams = [
                self._reader(f, cols).read_range(a, m, batch_size=m).to_batches()
                for _, f, a, m in window
            ]
            for (w, *_), stream in zip(window, streams, strict=True):
                out[w].extend(b for b in stream if b.num_rows)
        return out

    def _reader(self, index: int, columns: tuple[str, ...]) -> LanceFileReader:
        key = (index, columns)
        reader = self._open.get(key)
        if reader is not None:
            self._open.move_to_end(key)
            return reader
        reader = LanceFileReader(
            self.paths[index], storage_options=self.storage_options, columns=list(columns)
        )
        self._open[key] = reader
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return reader
