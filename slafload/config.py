"""Loader settings: one frozen, validated dataclass shared by every stage."""

from __future__ import annotations

from dataclasses import dataclass, field

from slafload._validate import check_int


@dataclass(frozen=True)
class RetryPolicy:
    """How the reader retries a fetch after a transient storage failure.

    A fetch is read whole up to ``attempts`` times; before retry ``i`` (1-based) the producer
    sleeps ``min(initial_backoff * 2 ** (i - 1), max_backoff)`` seconds. A failure is transient
    if it is an instance of one of ``transient``, or its message contains one of
    ``transient_messages`` (Lance reports object-store and file I/O failures during a scan as
    ``pyarrow.ArrowInvalid("... LanceError(IO) ...")``, not as ``OSError``); a
    :class:`~slafload.ReadError` is judged by its cause. Anything else, and the last failed
    attempt, raises at once.

    Attributes:
        attempts: Reads of one fetch before giving up (1 disables retrying).
        initial_backoff: Seconds before the first retry.
        max_backoff: Upper bound of any one wait, in seconds.
        transient: Exception classes worth retrying.
        transient_messages: Substrings of an error message that mark it as worth retrying.
    """

    attempts: int = 4
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    transient: tuple[type[BaseException], ...] = (OSError,)
    transient_messages: tuple[str, ...] = ("LanceError(IO)",)

    def __post_init__(self) -> None:
        check_int("attempts", self.attempts)
        if not 0 <= self.initial_backoff <= self.max_backoff:
            raise ValueError(
                "backoffs must satisfy 0 <= initial_backoff <= max_backoff, got "
                f"initial_backoff={self.initial_backoff!r}, max_backoff={self.max_backoff!r}"
            )
        if not isinstance(self.transient, tuple) or not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in self.transient
        ):
            raise ValueError(
                f"transient must be a tuple of exception classes, got {self.transient!r}"
            )
        if not isinstance(self.transient_messages, tuple) or not all(
            isinstance(m, str) and m for m in self.transient_messages
        ):
            raise ValueError(
                "transient_messages must be a tuple of non-empty strings, got "
                f"{self.transient_messages!r}"
            )

    def is_transient(self, exc: BaseException) -> bool:
        """Whether ``exc`` is worth another attempt under this policy."""
        return isinstance(exc, self.transient) or any(
            m in str(exc) for m in self.transient_messages
        )

    def backoff(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        return min(self.initial_backoff * 2.0 ** (retry - 1), self.max_backoff)


@dataclass(frozen=True)
class LoaderConfig:
    """Settings of a :class:`Loader`, validated on construction.

    Attributes:
        batch_size: Cells per training batch.
        max_genes: Sequence budget passed to named tokenizers.
        seed: Seed of every random choice (plans and in-chunk shuffles).
        n_epochs: Epochs of the whole run, counted from epoch 0 (``None``: endless). A loader
            resumed in epoch ``e`` stops after epoch ``n_epochs - 1``, like the run it
            replaces; once the run is complete, iterating yields nothing.
        shuffle: With no explicit sampler: ``True`` uses :class:`ChunkShuffle`, ``False``
            :class:`Streaming`.
        drop_last: Drop each epoch's short last batch.
        chunk_cells: Cells per fetch of the default samplers (:class:`ChunkShuffle`,
            :class:`Streaming`).
        piece_cells: The most cells ranked and tokenized at once: every fetch, whatever its
            sampler, is computed in pieces of at most this many cells, which bounds the token
            arrays in memory.
        queue_depth: Batches the producer may run ahead of the consumer.
        read_batch_rows: Rows per Arrow record batch requested from Lance. A fetch read as
            one batch is handed on without concatenating batches (4Mi rows covers a default
            2,048-cell fetch of cells with up to 2,000 genes expressed).
        read_ahead: Fetches whose reads are started before the current one is computed, so
            Lance decodes them on its own threads meanwhile. Each holds the Arrow data of its
            fetch's coalesced spans (the wanted rows plus any short gaps read through) until
            its turn. ``0`` reads each fetch only when it is needed.
        retry: Retries of a fetch after a transient storage failure.
        layout: How a batch's token rows are laid out (see :mod:`slafload.pipeline.layout`):
            ``"padded"`` (fixed width, slafdb's), ``"longest"`` (padded to the batch's
            longest cell) or ``"packed"`` (every cell's tokens back to back, ``cu_seqlens``).
        token_dtype: ``"int64"`` or ``"int32"``, the integer type of token id streams.
        tokenize_on: ``"producer"`` (rank and tokenize on the producer thread) or
            ``"device"`` (ship each batch's sparse expression and rank, bin and lay out
            tokens with torch ops on the loader's device; see :mod:`slafload.pipeline.device_tokenize`).
        memory_budget: Bytes of expression data the reader and chunk stage may hold at once
            (default 512 MiB), counted as rows read x row width x 3 copies
            (``slafload/pipeline/budget.py``). Read-ahead starts another fetch only while it fits; a
            fetch costing over half of it is read in groups of consecutive ranges, as is a
            fetch of more than 256 scattered ranges (single cells, small blocks), 256 at most
            a group (``budget.GROUP_RANGES``). The order of cells does not depend on it.
        first_read_cells: The first fetch of a chain (a run's start, a resume, each epoch
            of an epoch-aware chain or of the ``DataLoader`` face) is read as its
            first ``max(first_read_cells, batch_size)`` output cells, then the rest, so the
            first batch does not wait for a whole large fetch; the order of cells is unchanged
            (``slafload/pipeline/first_read.py``). ``0`` reads one batch first.
        read_data_files: Read scattered ranges through open Lance file readers where that is
            exact (``slafload/_lance/data_files.py``); ``False`` always uses ``take_scan``. ``None``
            (default): on local storage yes, on an object store only for Lance 2.0 data files
            (``slafload optimize``), where it is the faster path; for 2.1+ files there
            ``take_scan`` makes fewer requests per range and was 1.3-1.9x faster
            (:func:`~slafload._lance.data_files.direct_by_default`, docs/object-storage.md).
        read_threads: Data files those direct reads read at once, on their own threads, in
            ``[1, 256]``. ``None``: 16 on an object store (each range waits on a few
            sequential requests there, so fetches are latency-bound), 4 on local storage
            read by Lance (each range read pays a fixed ~0.2 ms of Lance scheduling that
            overlaps across threads: 1.3-1.6x the block-sampling throughput of 1 thread on 2
            cores), one per core from 2 to 4 where local files are read flat (their Python
            steps wait for the GIL: on 2 cores 2 threads beat 4 by 11-16%; docs/sampling.md). A fetch's reads always go on in the background, overlapping
            the read-ahead with compute (docs/object-storage.md).
        read_flat: Read local data files in Lance's 2.0 format (``slafload optimize``), whose
            pages are plain arrays, by ``pread`` without Lance's decoder
            (``slafload/_lance/flat_pages.py``; each file's pages checked when it is opened, the
            first file's rows compared with Lance's read of them, later files opened from
            their own footers): block sampling 1.10x on a cached 500k-cell atlas, 1.09-1.42x
            on a 5M-cell one read from disk (docs/sampling.md). ``False`` leaves every range
            to Lance's file reader. Flat reads keep their buffers for reuse (reading into
            fresh memory costs 3x, in page faults): up to half of ``memory_budget`` of them,
            idle or in use, whatever the dataset's size.
        read_mini_blocks: With ``read_flat`` and numba, also decode the mini-block pages of
            local Lance 2.1+ files (what converters write) in slafload, by a numba kernel
            (``slafload/_lance/miniblock.py``), instead of Lance's decoder: each file's page layouts
            checked when it is opened, the first file's rows compared with Lance's read. On
            by default: on the 5M-cell atlas as written, ``BlockShuffle(16, 256)`` and
            ``(64, 256)`` run ~1.4x faster than through Lance's reader, scattered single
            cells 2.8x (docs/sampling.md). ``False`` leaves 2.1+ files to Lance's decoder.
        check_rows: ``"once"`` (default) or ``"always"``. Every expression row's
            ``cell_integer_id`` is compared with the cell ``cell_start_index`` places it in,
            and a mismatch raises :class:`~slafload.InconsistentDataError`. With ``"once"``
            a loader compares the rows of each contiguous fetch the first time it reads them
            and, the table being pinned to one immutable Lance version, reads them without
            that column afterwards (ChunkShuffle and Streaming from the second epoch on:
            about a fifth less decoding). Scattered block reads always carry it. The row
            count of every fetch, gene ids and values are checked on every read either way.
        kernels: ``"auto"`` (default), ``"numba"`` or ``"numpy"``: whether the token
            worker's per-cell loops (token rows, re-padding, scGPT bins) run compiled by
            numba (``pip install slafload[fast]``) or as numpy calls; the tokens are the same.
            ``"auto"`` uses numba when it imports and compiles in the background, running the
            numpy code until each kernel is ready; ``"numba"`` requires it and waits for the
            compiler (see :mod:`slafload.kernels`).
    """

    batch_size: int = 32
    max_genes: int = 2048
    seed: int = 0
    n_epochs: int | None = 1
    shuffle: bool = True
    drop_last: bool = False
    chunk_cells: int = 2048
    piece_cells: int = 2048
    queue_depth: int = 64
    read_batch_rows: int = 1 << 22
    read_ahead: int = 2
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    layout: str = "padded"
    token_dtype: str = "int64"
    tokenize_on: str = "producer"
    memory_budget: int = 512 << 20
    first_read_cells: int = 64
    read_data_files: bool | None = None
    read_threads: int | None = None
    read_flat: bool = True
    read_mini_blocks: bool = True
    check_rows: str = "once"
    kernels: str = "auto"

    def __post_init__(self) -> None:
        positive = ("batch_size", "max_genes", "chunk_cells", "piece_cells", "queue_depth")
        for name in (*positive, "read_batch_rows"):
            check_int(name, getattr(self, name))
        check_int("read_ahead", self.read_ahead, low=0, high=8)
        check_int("n_epochs", self.n_epochs, none_ok=True)
        check_int("memory_budget", self.memory_budget)
        check_int("first_read_cells", self.first_read_cells, low=0)
        check_int("read_threads", self.read_threads, low=1, high=256, none_ok=True)
        if self.read_data_files is not None and not isinstance(self.read_data_files, bool):
            raise ValueError(
                f"read_data_files must be None, True or False, got {self.read_data_files!r}"
            )
        for name in ("read_flat", "read_mini_blocks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.retry, RetryPolicy):
            raise ValueError(f"retry must be a RetryPolicy, got {self.retry!r}")
        choices = {
            "layout": ("padded", "longest", "packed"),
            "token_dtype": ("int64", "int32"),
            "tokenize_on": ("producer", "device"),
            "check_rows": ("once", "always"),
            "kernels": ("auto", "numba", "numpy"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        check_int("seed", self.seed, low=0)
