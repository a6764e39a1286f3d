"""The open readers of a table's data files: a bounded cache, each file flat where it allows it.

:class:`OpenFiles` keeps a bounded LRU cache of one reader per data file and column selection:
a :class:`~slafload._lance.flat_pages.FlatFile` for a local file whose pages the flat reader
reads exactly (opened from its footer alone once :class:`~slafload._lance.file_format.FlatFiles`
has learned the table's format, a read window's files by one kernel call), else Lance's
``LanceFileReader``; :data:`DECLINED` for a file that stores other names than the table's first
data file, whose rows are then read through Lance's ``take_scan``.
:class:`~slafload._lance.data_files.DataFiles` reads ranges through it.
"""

from __future__ import annotations

import logging
import resource
import threading
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lance.file import LanceFileReader

from slafload._lance._compat import file_session
from slafload._lance.file_format import FlatFiles
from slafload._lance.flat_pages import V2_0, FlatFile
from slafload._lance.fragments import Matched
from slafload._lance.object_store import ObjectStore, StoreOptions, supported
from slafload._lance.ranged import RangedFiles, StoreFiles
from slafload.errors import ReaderFallbackWarning
from slafload.kernels import NUMPY, Kernels

logger = logging.getLogger(__name__)

DECLINED = object()  # the reader of a data file read through Lance's take_scan instead
MAX_OPEN_FILES = 8192  # upper bound of the reader cache; each open reader holds a descriptor
FD_SHARE = 4  # the reader cache uses at most a quarter of the process's descriptors


def is_remote(uri: str) -> bool:
    """Whether ``uri`` names an object store (``s3://``, ``gs://``...) rather than a local path."""
    return "://" in uri and not uri.startswith("file://")


@dataclass(eq=False)
class _Open:
    """A cached file reader (``None`` until its first user opens it: a :class:`FlatFile` where
    the file's pages are flat, else Lance's) and the lock that lets one thread at a time use
    it (pylance file readers refuse concurrent calls).
    """

    reader: LanceFileReader | FlatFile | Any = None  # Any: DECLINED
    lock: threading.Lock = field(default_factory=threading.Lock)
    provisional: bool = False  # Lance's reader until the mini-block decoder is ready


def default_max_open(n_files: int | None = None) -> int:
    """Readers kept open: a quarter of the soft descriptor limit, within [16, MAX_OPEN_FILES].

    With ``n_files``, the soft limit is first raised (toward the hard limit, logged) until a
    quarter of it holds ``min(n_files, MAX_OPEN_FILES)`` readers. Linux's usual soft limit of
    1,024 keeps only 256 open, so on a 5M-cell atlas (3,816 data files) most blocks would
    reopen their file (``(16, 256)`` ran 14% slower so, docs/sampling.md). Where the hard
    limit is too low for that, a warning says how to raise it.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN_FILES
    wanted = FD_SHARE * min(n_files or 0, MAX_OPEN_FILES)
    if wanted > soft:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                logger.info("raised the soft open-files limit from %d to %d for the readers "
                            "of %d data files", soft, target, n_files)  # fmt: skip
                soft = target
            except (ValueError, OSError) as exc:
                logger.debug("could not raise the open-files limit: %r", exc)
        if soft < wanted:
            logger.warning(
                "the table has %d data files but the open-files limit (%d, hard %s) keeps "
                "only %d readers open, so blocks in the others reopen their file on every "
                "read; raise it (ulimit -n %d) or merge files (slafload optimize "
                "--rows-per-file)", n_files, soft, hard, soft // FD_SHARE, wanted,
            )  # fmt: skip
    return max(16, min(MAX_OPEN_FILES, soft // FD_SHARE))


class OpenFiles:
    """The readers of a pinned table's data files, opened on first use and kept in a bounded
    LRU cache (:attr:`max_open` of them), each used by one thread at a time.

    Args:
        paths: The data files, in table order.
        storage_options: For an object store (its files share one ``LanceFileSession``).
        max_open: Readers kept open; ``None``: :func:`default_max_open`.
        flat: Open local files without Lance's decoder where exact (see
            :class:`~slafload._lance.data_files.DataFiles`).
        kernels: What opens and reads the flat files.
        versions: Each data file's Lance format ``(major, minor)``, where known.
        mini: Open 2.1+ files' mini-block pages flat too, once the decoder is loaded.
        store: On an ``s3://`` store, read the files' pages by range requests
            (:mod:`slafload._lance.ranged`) as these options say; ``None``: Lance's reader.
        shared: Where files opened by range requests are kept for the dataset's other
            loaders (its :class:`~slafload._lance.ranged.StoreFiles`); ``None``: this
            reader's own.
    """

    def __init__(
        self,
        paths: Sequence[str],
        storage_options: Mapping[str, str] | None = None,
        max_open: int | None = None,
        *,
        flat: bool = True,
        kernels: Kernels = NUMPY,
        versions: Sequence[tuple[int, int]] | None = None,
        mini: bool = False,
        store: StoreOptions | None = None,
        shared: StoreFiles | None = None,
    ):
        self.paths = list(paths)
        self._v2_0 = None if versions is None else [v in V2_0 for v in versions]
        self.storage_options = dict(storage_options) if storage_options else None
        self.max_open = default_max_open(len(self.paths)) if max_open is None else max_open
        if self.max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {self.max_open}")
        remote = bool(self.paths) and is_remote(self.paths[0])
        self.kernels = kernels
        self.ranged: ObjectStore | None = None  # range requests read the files' pages
        self._flat_files: FlatFiles | RangedFiles
        if remote and flat and store is not None and supported(self.paths[0]):
            ranged = (StoreFiles() if shared is None else shared).files(
                storage_options, store, kernels
            )
            self.ranged = ranged.store
            self._flat_files = ranged
        else:
            self._flat_files = FlatFiles(mini=mini and kernels.backend == "numba", kernels=kernels)
        self.flat = flat and (not remote or self.ranged is not None)  # pread: local files
        # Over range requests the numpy decoder stands in until numba's is loaded: a
        # request's latency is far longer than decoding its chunks.
        self._decoder = self.ranged is not None  # the mini-block decode kernel is loaded
        self._open: OrderedDict[tuple[int, tuple[str, ...]], _Open] = OrderedDict()
        self._lock = threading.Lock()  # guards _open against workers opening readers
        self._session: Any | None = None  # a LanceFileSession, once a Lance reader needs it
        self._session_base: str | None = None  # the files' folder, where they share one
        self._session_lock = threading.Lock()
        self.table: Matched | None = None  # field-id names and deletions (set by examine)
        self._notice: str | None = None  # why a data file is read through Lance
        self._warned = False
        if remote and len({p.rsplit("/", 1)[0] for p in self.paths}) == 1:
            self._session_base = self.paths[0].rsplit("/", 1)[0]

    def _open_window(self, pieces: list[tuple[int, int, int, int]], cols: tuple[str, ...]) -> None:
        """Open the files of a window's ``pieces`` that are not open yet, flat from their
        footers, by one kernel call (:meth:`FlatFiles.open_many`): a block sampler's window
        on the 5M atlas opens ~100 files in an epoch's first seconds, and opening each alone
        took the GIL back once per file, each time after the other threads' turns. A file
        that does not open so is left to :meth:`_opened`.
        """
        if not (self.flat and self._flat_files.format is not None and self._decoder_ready()):
            return
        todo: dict[int, _Open] = {}
        for f, *_ in pieces:
            entry = self._entry(f, cols)
            if entry.reader is None or entry.provisional:
                todo[f] = entry
        if len(todo) < 2:
            return  # one file: _opened opens it as well
        opened = self._flat_files.open_many([self.paths[f] for f in todo], cols)
        for entry, flat in zip(todo.values(), opened, strict=True):
            if flat is not None and not self._fits(flat):
                flat.close()  # _opened decides what reads it
                flat = None
            if flat is None:
                continue
            with entry.lock:
                if entry.reader is None or entry.provisional:
                    entry.reader, entry.provisional = flat, False
                else:  # another thread opened it meanwhile
                    flat.close()

    def _entry(self, index: int, cols: tuple[str, ...]) -> _Open:
        key = (index, cols)
        with self._lock:
            entry = self._open.get(key)
            if entry is not None:
                self._open.move_to_end(key)
                return entry
            entry = self._open[key] = _Open()
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)  # a thread using it keeps its reference
            return entry

    def _new_reader(self, index: int, cols: tuple[str, ...] | None) -> LanceFileReader:
        """Lance's reader of ``cols`` of data file ``index`` (``None``: every column)."""
        columns = None if cols is None else list(cols)
        session = self._lance_session()
        if session is not None:
            return session.open_reader(self.paths[index].rsplit("/", 1)[1], columns)
        return LanceFileReader(
            self.paths[index], storage_options=self.storage_options, columns=columns
        )

    def _lance_session(self) -> Any | None:
        """The ``LanceFileSession`` Lance's readers of the files share, made on first use
        (``None`` for local files, or on pylance releases without one). Not at construction:
        making one costs the producer thread ~15-20 ms (an object-store client), paid by every
        loader of a dataset on ``s3://``, whose reads seldom need a Lance reader there.
        """
        with self._session_lock:
            if self._session is None and self._session_base is not None:
                self._session = file_session(self._session_base, self.storage_options)
                if self._session is None:  # pylance without sessions: readers of their own
                    self._session_base = None
            return self._session

    def stored_schema(self) -> Any:
        """The schema the first data file stores, as Lance's metadata has it."""
        if isinstance(self._flat_files, RangedFiles):  # kept with the dataset's opened files
            return self._flat_files.metadata(self.paths[0]).schema
        return self._new_reader(0, None).metadata().schema

    def _lance_reader(self, index: int, cols: tuple[str, ...]) -> LanceFileReader | object:
        """Lance's reader of ``cols`` of data file ``index``, or :data:`DECLINED` where the
        file stores other names than the table's first data file (see :meth:`_fits`).
        """
        try:
            reader = self._new_reader(index, cols)
        except Exception:
            if self.table is None or self._fits(self._new_reader(index, None)):
                raise  # not a name the file lacks: the read reports it
            return self._decline(index)
        return reader if self._fits(reader) else self._decline(index)

    def _fits(self, reader: LanceFileReader | FlatFile) -> bool:
        """Whether ``reader``'s file stores the columns under the names the reads ask for:
        those of the table's first data file (every file lists the same field ids,
        :func:`~slafload._lance.fragments.survey`, so the names are at the same places).
        """
        if self.table is None:
            return True
        if isinstance(reader, FlatFile):
            return reader.names == self.table.file_names
        return tuple(reader.metadata().schema.names) == self.table.file_names

    def _decline(self, index: int) -> object:
        """Mark data file ``index`` to be read through Lance, and say so once."""
        self._note(
            f"data file {self.paths[index]} stores its columns under other names than the "
            "table's first data file (columns renamed between writes), so its rows are read "
            "through Lance's take_scan, ~0.2-0.5 ms more per range"
        )
        return DECLINED

    def _note(self, notice: str) -> None:
        """Keep the first ``notice`` of a data file left to Lance, for :meth:`notice`."""
        with self._lock:
            if self._notice is None:
                self._notice = notice

    def notice(self) -> None:
        """Warn, once, that a data file is read through Lance (on the thread that reads the
        batches: a warning raised as an error there reaches the caller).
        """
        if self._notice is not None and not self._warned and self.table is not None:
            self._warned = True
            uri = self.table.expression.uri
            warnings.warn(f"{uri}: {self._notice}", ReaderFallbackWarning, stacklevel=2)

    def _opened(
        self, entry: _Open, index: int, cols: tuple[str, ...]
    ) -> LanceFileReader | FlatFile | object:
        """``entry``'s reader of data file ``index``, opened on first use: flat where the
        file allows it (:mod:`slafload._lance.flat_pages`), else Lance's; :data:`DECLINED` where
        the file stores other names than the reads ask for.
        """
        if entry.reader is DECLINED:
            return entry.reader
        if entry.reader is None or (entry.provisional and self._decoder_ready()):
            flat = None
            # A 2.1+ file opened before the decoder is loaded (numba's import takes ~0.5 s)
            # is read by Lance meanwhile, not by the numpy decoder (~5x slower).
            mini = self._flat_files.mini and self._decoder_ready()
            v2_0 = None if self._v2_0 is None else self._v2_0[index]  # None: not known
            if self.flat and (mini or v2_0 is not False):
                flat = self._flat_files.open(self.paths[index], cols, mini=mini)
                if flat is None and (mini or v2_0):
                    self._note(
                        f"data file {self.paths[index]} holds pages the flat reader does not "
                        "decode (an encoding, nulls or compression it does not read), so it "
                        "is read by Lance's file reader, several times the CPU per range"
                    )
            if flat is not None and not self._fits(flat):
                flat.close()
                flat, entry.reader = None, self._decline(index)
            entry.provisional = self.flat and self._flat_files.mini and not mini and not v2_0
            entry.provisional = entry.provisional and entry.reader is not DECLINED
            if flat is not None:
                entry.reader = flat
            elif entry.reader is None:
                entry.reader = self._lance_reader(index, cols)
        return entry.reader

    def _decoder_ready(self) -> bool:
        if not self._decoder:
            self._decoder = self.kernels.ready("decode_chunks")
        return self._decoder
