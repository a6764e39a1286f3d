"""Loader settings: frozen, validated dataclasses shared by every stage.

:class:`LoaderConfig` holds what a user sets (batch size, sequence budget, seed, epochs, layout...);
its :class:`Tuning` holds resource limits and read tuning, and :class:`RetryPolicy` the retries
of transient storage failures.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from slafload._validate import check_choice, check_int


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


RANGE_GAP = 256 << 10
"""Default :attr:`Tuning.range_gap`: reading 256 KB through costs ~3-5 ms of one connection at
S3's 50-90 MB/s, less than a request's 10-30 ms to first byte."""
REQUESTS_IN_FLIGHT = 64
"""Default :attr:`Tuning.requests_in_flight`."""

READERS = ("auto", "lance")
"""Values of :attr:`Tuning.reader`."""


@dataclass(frozen=True)
class Tuning:
    """Resource limits and read tuning of a :class:`Loader`, validated on construction.

    The defaults suit local disks and object stores alike; none of these settings changes which
    cells a batch holds or their tokens, only memory, speed and how reads are made. Pass one as
    ``Loader(ds, tuning=Tuning(read_ahead=0))``.

    Attributes:
        memory_budget: Bytes of expression data the reader and chunk stage may hold at once
            (default 512 MiB), counted as rows read x row width x 3 copies
            (``slafload/pipeline/budget.py``). Read-ahead starts another fetch only while it fits; a
            fetch costing over half of it is read in groups of consecutive ranges, as is a
            fetch of more than 256 scattered ranges (single cells, small blocks), 256 at most
            a group (``budget.GROUP_RANGES``). A mixture's fetch is capped at half of it (see
            docs/mixtures.md). Lower it on a small machine; raise it for long reads of
            large cells.
        queue_depth: Batches the producer may run ahead of the consumer.
        read_ahead: Fetches whose reads are started before the current one is computed, in
            ``[0, 8]``, so Lance decodes them on its own threads meanwhile. Each holds the Arrow
            data of its fetch's coalesced spans (the wanted rows plus any short gaps read
            through) until its turn. ``0`` reads each fetch only when it is needed.
        piece_cells: The most cells ranked and tokenized at once: every fetch, whatever its
            sampler, is computed in pieces of at most this many cells, which bounds the token
            arrays in memory.
        first_read_cells: The first fetch of a chain (a run's start, a resume, each epoch
            of an epoch-aware chain or of the ``DataLoader`` face) is read as its
            first ``max(first_read_cells, batch_size)`` output cells, then the rest, so the
            first batch does not wait for a whole large fetch; the order of cells is unchanged
            (``slafload/pipeline/first_read.py``). ``0`` reads one batch first.
        batch_rows: Rows per Arrow record batch requested from Lance. A fetch read as
            one batch is handed on without concatenating batches (4Mi rows covers a default
            2,048-cell fetch of cells with up to 2,000 genes expressed).
        read_threads: Data files slafload's direct reader reads at once, on its own threads, in
            ``[1, 256]``. ``None``: 16 on an object store (each range waits on a few
            sequential requests there, so fetches are latency-bound), 4 on local storage
            read by Lance's file reader (each range pays a fixed ~0.2 ms of Lance scheduling
            that overlaps across threads), one per core from 2 to 4 where slafload decodes
            local files itself (its Python steps wait for the GIL; see docs/sampling.md). A
            fetch's reads always go on in the background, overlapping the read-ahead with
            compute (docs/object-storage.md).
        check_rows: ``"once"`` (default) or ``"always"``. Every expression row's
            ``cell_integer_id`` is compared with the cell ``cell_start_index`` places it in,
            and a mismatch raises :class:`~slafload.InconsistentDataError`. With ``"once"``
            a loader compares the rows of each fetch of up to 16 contiguous ranges (a
            stream's chunk; a mixture's block per source) the first time it reads them and,
            the table being pinned to one immutable Lance version, reads them without that
            column afterwards (ChunkShuffle and Streaming from the second epoch on: about a
            fifth less decoding). Block sampling's scattered reads always carry it. The row
            count of every fetch, gene ids and values are checked on every read either way.
            ``"always"`` checks every read, for storage you do not trust to return the same
            bytes twice.
        retry: Retries of a fetch after a transient storage failure.
        reader: ``"auto"`` (default) or ``"lance"``. ``"auto"`` reads scattered ranges with
            slafload's direct reader where that is measured faster (``slafload/_lance/``:
            kept-open data files, local files' pages read by ``pread`` and decoded by
            slafload; on ``s3://``, the same pages fetched by range requests; on other object
            stores only for Lance 2.0 data files, ``slafload optimize``) and with Lance's
            ``take_scan`` elsewhere
            (:func:`~slafload._lance.data_files.direct_by_default`). ``"lance"`` leaves every
            read to Lance's own reader: set it if the direct reader misbehaves on your tables
            (an error raised from ``slafload/_lance/`` that Lance's own reader does not
            raise), at the cost of slower block sampling. Tables and files the direct reader
            does not handle fall back to Lance by themselves (a
            :class:`~slafload.errors.ReaderFallbackWarning` says why). Both return the same
            rows.
        range_gap: On an ``s3://`` store, byte ranges of one data file at most this many
            bytes apart may be read by one request, the gap read through, smallest gaps
            first, while the gaps a read reads through stay within half its ranges' bytes
            (docs/object-storage.md). Lower it where bytes cost more than requests.
        requests_in_flight: On an ``s3://`` store, range requests under way at once, in
            ``[1, 1024]`` (each waits on the store's latency on a thread of its own; the read
            threads' windows bound the bytes they hold).
    """

    memory_budget: int = 512 << 20
    queue_depth: int = 64
    read_ahead: int = 2
    piece_cells: int = 2048
    first_read_cells: int = 64
    batch_rows: int = 1 << 22
    read_threads: int | None = None
    check_rows: str = "once"
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    reader: str = "auto"
    range_gap: int = RANGE_GAP
    requests_in_flight: int = REQUESTS_IN_FLIGHT

    def __post_init__(self) -> None:
        for name in ("memory_budget", "queue_depth", "piece_cells", "batch_rows"):
            check_int(name, getattr(self, name))
        check_int("read_ahead", self.read_ahead, low=0, high=8)
        check_int("first_read_cells", self.first_read_cells, low=0)
        check_int("read_threads", self.read_threads, low=1, high=256, none_ok=True)
        check_int("range_gap", self.range_gap, low=0)
        check_int("requests_in_flight", self.requests_in_flight, low=1, high=1024)
        if not isinstance(self.retry, RetryPolicy):
            raise ValueError(f"retry must be a RetryPolicy, got {self.retry!r}")
        check_choice("check_rows", self.check_rows, ("once", "always"))
        check_choice("reader", self.reader, READERS)


@dataclass(frozen=True)
class LoaderConfig:
    """Settings of a :class:`Loader`, validated on construction.

    ``Loader(ds, **settings)`` takes every field as a keyword; resource limits and read tuning
    are grouped in :class:`Tuning` (``tuning=Tuning(...)``).

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
        layout: How a batch's token rows are laid out (see :mod:`slafload.pipeline.layout`):
            ``"padded"`` (fixed width, slafdb's), ``"longest"`` (padded to the batch's
            longest cell) or ``"packed"`` (every cell's tokens back to back, ``cu_seqlens``).
        token_dtype: ``"int64"`` or ``"int32"``, the integer type of token id streams.
        tokenize_on: ``"producer"`` (rank and tokenize on the producer thread) or
            ``"device"`` (ship each batch's sparse expression and rank, bin and lay out
            tokens with torch ops on the loader's device; see :mod:`slafload.pipeline.device_tokenize`).
        kernels: ``"auto"`` (default), ``"numba"`` or ``"numpy"``: whether the token
            worker's per-cell loops (token rows, re-padding, scGPT bins) run compiled by
            numba (``pip install slafload[fast]``) or as numpy calls; the tokens are the same.
            ``"auto"`` uses numba when it imports and compiles in the background, running the
            numpy code until each kernel is ready; ``"numba"`` requires it and waits for the
            compiler (see :mod:`slafload.kernels`).
        tuning: Resource limits and read tuning (:class:`Tuning`).
    """

    batch_size: int = 32
    max_genes: int = 2048
    seed: int = 0
    n_epochs: int | None = 1
    shuffle: bool = True
    drop_last: bool = False
    chunk_cells: int = 2048
    layout: str = "padded"
    token_dtype: str = "int64"
    tokenize_on: str = "producer"
    kernels: str = "auto"
    tuning: Tuning = field(default_factory=Tuning)

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_genes", "chunk_cells"):
            check_int(name, getattr(self, name))
        check_int("n_epochs", self.n_epochs, none_ok=True)
        check_int("seed", self.seed, low=0)
        check_choice("layout", self.layout, ("padded", "longest", "packed"))
        check_choice("token_dtype", self.token_dtype, ("int64", "int32"))
        check_choice("tokenize_on", self.tokenize_on, ("producer", "device"))
        check_choice("kernels", self.kernels, ("auto", "numba", "numpy"))
        if not isinstance(self.tuning, Tuning):
            raise ValueError(f"tuning must be a Tuning, got {self.tuning!r}")


_TUNED = ("memory_budget", "queue_depth", "read_ahead", "piece_cells", "first_read_cells",
          "read_threads", "check_rows", "retry")  # fmt: skip
MOVED: dict[str, str] = {
    **{name: f"moved, use tuning=Tuning({name}=...)" for name in _TUNED},
    "read_batch_rows": "moved, use tuning=Tuning(batch_rows=...)",
    "read_data_files": "removed, use tuning=Tuning(reader='lance') for Lance's reader "
    "everywhere (the default, 'auto', reads directly where that is faster)",
    **{
        name: "removed (on wherever it applies), use tuning=Tuning(reader='lance') for "
        "Lance's reader everywhere"
        for name in ("read_flat", "read_mini_blocks")
    },
}
"""Settings of slafload 0.1 that ``Loader`` no longer takes, and what replaces each."""


def check_settings(settings: Mapping[str, object]) -> None:
    """Raise ``TypeError`` for a keyword of ``Loader(**settings)`` that is not a
    :class:`LoaderConfig` field, naming its replacement where it moved into :class:`Tuning`.
    """
    fields = set(LoaderConfig.__dataclass_fields__)
    moved = {name: MOVED[name] for name in sorted(settings) if name in MOVED}
    if moved:
        raise TypeError(
            "Loader no longer takes these settings: "
            + "; ".join(f"{name}: {what}" for name, what in moved.items())
        )
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise TypeError(f"Loader got unknown settings {unknown}; allowed: {sorted(fields)}")
