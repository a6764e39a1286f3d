"""Read each part's fetch whole, with retries and read-ahead.

:class:`Read` is the stage: it starts the reads of the next ``read_ahead`` parts before it
hands on the current one, so Lance decodes them on its own threads while the producer
computes (scattered block reads cost about as much as the compute; see docs/sampling.md). It
reads through a :class:`RetryingReader`, which wraps the Lance I/O of
:class:`~slafload.pipeline.reader.Reader`.

Object stores and network filesystems fail transiently (timeouts, throttling, connection
resets). :class:`RetryingReader` reads a fetch *whole* before handing on any of its rows, so a
failure halfway through a fetch is retried from the fetch's start and no row is delivered twice
or skipped. Waits grow exponentially up to a bound (:class:`~slafload.config.RetryPolicy`).
When the attempts run out, or the failure is not transient, it raises
:class:`~slafload.errors.ReadError` naming the fetch and its cell ranges, with the storage
error chained as its cause; the prefetcher forwards it to the consumer and its thread ends.

Materializing a fetch costs no extra memory over the chunk it becomes: ``assemble`` holds all of
a fetch's record batches at once anyway.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa

from slafload.config import RetryPolicy
from slafload.errors import ReadError, SlafloadError
from slafload.pipeline import budget
from slafload.pipeline.partition import Part
from slafload.pipeline.ranges import RangeSet, describe
from slafload.pipeline.reader import MAX_GAP_ROWS, started
from slafload.pipeline.stage import Stage
from slafload.types import Fetch, Offsets

# Fetches of up to this many contiguous ranges (a stream's chunk, one block per source of a
# mixed fetch) record and reuse the check of their rows; block sampling's scattered fetches
# always read cell ids (checking thousands of short ranges costs more than it saves).
CHECKED_RANGES = 16

# A fetch of at most CHECKED_RANGES ranges, each of at least this many cells (a mixed fetch:
# one range per source), is a few Lance scans, read ahead on the read thread as one range is.
LONG_RANGE_CELLS = 512

logger = logging.getLogger(__name__)


def _scanned_whole(ranges: np.ndarray) -> bool:
    """Whether a fetch of these cell ranges is read ahead on the read thread: one range (a
    stream's chunk), or a few long ones (a mixed fetch, one per source). Block sampling's
    short ranges are started on the producer, which hands them to the reader's threads.
    """
    lengths = ranges[:, 1] - ranges[:, 0]
    return len(ranges) == 1 or (
        len(ranges) <= CHECKED_RANGES and bool((lengths >= LONG_RANGE_CELLS).all())
    )


class FetchReader(Protocol):
    """Anything that turns a fetch into record batches (:class:`~slafload.pipeline.reader.Reader`)."""

    def read(self, fetch: Fetch, *, cell_ids: bool = True) -> Iterable[pa.RecordBatch]:
        """The record batches holding exactly the expression rows of ``fetch``
        (``cell_ids=False``: the ``cell_integer_id`` column may be left out).
        """


class RetryingReader:
    """Wraps ``reader`` so each fetch is read whole, retrying transient failures.

    Args:
        reader: The reader to wrap; its ``read(fetch)`` is called once per attempt.
        policy: Attempts, backoff bounds and which exceptions are transient.
        uri: Dataset URI, named in error messages.
        sleep: Waits between attempts (tests may pass a recorder).
    """

    def __init__(
        self,
        reader: FetchReader,
        policy: RetryPolicy,
        *,
        uri: str = "",
        sleep: Callable[[float], object] = time.sleep,
    ):
        if not isinstance(policy, RetryPolicy):
            raise TypeError(f"policy must be a RetryPolicy, got {type(policy).__name__}")
        self.reader = reader
        self.policy = policy
        self.uri = uri
        self._sleep = sleep

    def read(self, fetch: Fetch, *, cell_ids: bool = True) -> Iterator[pa.RecordBatch]:
        """The record batches of ``fetch``, read completely before the first is returned
        (``cell_ids`` as for :meth:`FetchReader.read`).

        Raises:
            ReadError: every attempt failed, or a non-transient storage error occurred; the
                message names the fetch index and cell ranges and the cause is chained.
            SlafloadError: a data error (e.g. inconsistent rows) passes through unchanged.
        """
        return self.start(fetch, cell_ids=cell_ids).result()

    def start(self, fetch: Fetch, *, cell_ids: bool = True) -> PendingRead:
        """Start the first attempt at ``fetch`` and return with its rows on the way.

        The wrapped reader is taken as far as its first batch, which for
        :class:`~slafload.pipeline.reader.Reader` sets Lance decoding the whole fetch on Lance's own
        threads while the caller works on something else. A failure so far surfaces (and is
        retried) in :meth:`PendingRead.result`, so the batches of earlier fetches are still
        delivered first.
        """

        def first_attempt() -> Iterator[pa.RecordBatch]:
            yield from self.reader.read(fetch, cell_ids=cell_ids)

        return PendingRead(self, fetch, started(first_attempt()), cell_ids)

    def complete(
        self, fetch: Fetch, first_attempt: Iterator[pa.RecordBatch], *, cell_ids: bool = True
    ) -> list[pa.RecordBatch]:
        """Every record batch of ``fetch``: the rest of ``first_attempt``, retried on failure."""
        policy = self.policy
        for attempt in range(1, policy.attempts + 1):
            try:
                batches = (
                    first_attempt if attempt == 1 else self.reader.read(fetch, cell_ids=cell_ids)
                )
                return list(batches)
            except Exception as exc:
                transient = self._is_transient(exc)
                if not transient or attempt == policy.attempts:
                    if isinstance(exc, SlafloadError) and not isinstance(exc, ReadError):
                        raise
                    raise self._failure(fetch, exc, attempt, transient) from exc
                wait = policy.backoff(attempt)
                logger.warning(
                    "reading fetch %d of %r failed (attempt %d of %d: %s: %s); retrying in %.2f s",
                    fetch.index,
                    self.uri,
                    attempt,
                    policy.attempts,
                    type(exc).__name__,
                    exc,
                    wait,
                )
                self._sleep(wait)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _is_transient(self, exc: BaseException) -> bool:
        if isinstance(exc, ReadError):  # the reader wraps storage errors; judge the cause
            return exc.__cause__ is not None and self.policy.is_transient(exc.__cause__)
        return not isinstance(exc, SlafloadError) and self.policy.is_transient(exc)

    def _failure(
        self, fetch: Fetch, exc: BaseException, attempts: int, transient: bool
    ) -> ReadError:
        cause = exc.__cause__ if isinstance(exc, ReadError) and exc.__cause__ else exc
        why = (
            f"failed {attempts} times (the last failure: {type(cause).__name__}: {cause})"
            if transient
            else f"failed with a non-transient {type(cause).__name__}: {cause}"
        )
        fix = (
            "Check that the storage is reachable, or raise Tuning.retry.attempts / "
            "max_backoff for a flaky store."
            if transient
            else "Check the dataset files; add the exception class to "
            "Tuning.retry.transient if it is worth retrying."
        )
        return ReadError(
            f"Reading fetch {fetch.index} (cells {describe(fetch.ranges, 8)}) from {self.uri!r} "
            f"{why}. {fix}"
        )


@dataclass(frozen=True, eq=False)
class PendingRead:
    """A fetch whose first attempt has started (see :meth:`RetryingReader.start`)."""

    reader: RetryingReader
    fetch: Fetch
    first_attempt: Iterator[pa.RecordBatch]
    cell_ids: bool = True

    def result(self) -> Iterator[pa.RecordBatch]:
        """All record batches of the fetch, retrying as :meth:`RetryingReader.read` does.

        Call it once: the first attempt's stream is consumed by the first call.
        """
        return iter(self.reader.complete(self.fetch, self.first_attempt, cell_ids=self.cell_ids))


@dataclass(frozen=True, eq=False)
class Group:
    """One read of a part: its whole fetch, or one group of its ranges (``last`` ends the part).

    A part whose fetch costs more than half the memory budget is read in groups of
    consecutive ranges (:func:`slafload.pipeline.budget.groups`), so its Arrow data never all sits in
    memory at once; so is a fetch of scattered ranges (:func:`slafload.pipeline.budget.scattered`),
    at most :data:`slafload.pipeline.budget.GROUP_RANGES` ranges a group.
    """

    part: Part
    fetch: Fetch
    batches: list[pa.RecordBatch]
    last: bool
    cell_ids: bool = True  # False: read without cell_integer_id, the rows checked before


@dataclass(eq=False)
class _Reading:
    """A part on its way in: its read groups, the bytes charged, the group being read."""

    part: Part
    groups: list[Fetch]
    cost: int
    pending: Future[PendingRead] | None = None


class Read(Stage[Group]):
    """Each part's record batches, group by group, with read-ahead bounded in bytes.

    ``read_ahead`` later parts are started before the current one is handed on, as long as
    the bytes they hold (:mod:`slafload.pipeline.budget`) fit ``memory_budget``; the next group of a
    part is started while the current one is handed on. The run's first part is handed on
    before anything is read ahead, so the first batch waits for nothing else. A failure to
    plan a later part (pulling it from the source) is raised only when that part's turn
    comes, after every batch of the parts before it; a failed read ahead is retried, or
    raised, only when its turn comes too.

    A group of one contiguous range is one Lance scan (a mixed group of a few long ranges, one
    per source, a few), which decodes most of the group before
    its first batch (``Tuning.batch_rows`` holds a chunk's rows) and the rest only as its
    batches are pulled: such reads ahead are read whole, retries included, on a read thread
    of this stage's own, so Lance decodes them while the producer computes (on the producer,
    they held it for the whole decode: about half of its time with the default sampler).
    Scattered groups are started on the producer, which only hands their reads to Lance's or
    the data files' threads (:meth:`RetryingReader.start`).

    ``checked`` holds the cells whose rows the chunk stage has checked against
    ``cell_start_index`` (``Tuning.check_rows="once"``): a group of one contiguous range
    of such cells is read without ``cell_integer_id``. ``None`` reads it every time.
    """

    def __init__(
        self,
        source: Iterator[Part],
        reader: RetryingReader,
        cell_start: Offsets,
        *,
        row_bytes: int,
        read_ahead: int = 2,
        memory_budget: int = 512 << 20,
        checked: RangeSet | None = None,
    ):
        super().__init__(source)
        self.reader, self.cell_start, self.row_bytes = reader, cell_start, row_bytes
        self.read_ahead, self.memory_budget = read_ahead, memory_budget
        self.checked = checked
        self._ahead: deque[_Reading] = deque()
        self._failure: Exception | None = None
        self._peeked: _Reading | None = None  # pulled and planned, waiting to fit
        self._exhausted = False
        self._first = True
        self._group = 0
        self._scans: ThreadPoolExecutor | None = None  # starts one-range reads ahead

    def _plan(self, part: Part) -> _Reading:
        fetch = part.fetch
        cost = budget.cost(fetch, self.cell_start, self.row_bytes, MAX_GAP_ROWS)
        scattered = budget.scattered(fetch, self.cell_start)
        half, quarter = self.memory_budget // 2, self.memory_budget // 4
        if cost <= half and not scattered:
            return _Reading(part, [fetch], cost)
        # Over half the budget: groups of about a quarter, charged a quarter. A scattered
        # fetch within it is cut by its range count alone, and charged as a whole read.
        max_ranges = budget.GROUP_RANGES if scattered else None
        max_bytes = quarter if cost > half else half
        groups = budget.groups(
            fetch, self.cell_start, self.row_bytes, max_bytes, MAX_GAP_ROWS, max_ranges
        )
        return _Reading(part, groups, quarter if cost > half else cost)

    def _start(self, fetch: Fetch) -> Future[PendingRead]:
        """Start reading ``fetch``, without cell ids where its cells were checked before: a
        read ahead of a few long ranges (:func:`_scanned_whole`) on the read thread, any other
        here.
        """
        ranges, checked = fetch.ranges, self.checked
        again = (
            checked is not None
            and len(ranges) <= CHECKED_RANGES
            and all(checked.covers(*r) for r in ranges.tolist())
        )
        if _scanned_whole(ranges) and not self._first:  # the run's first read is waited for
            if self._scans is None:
                self._scans = ThreadPoolExecutor(1, thread_name_prefix="slafload-scan")
            return self._scans.submit(self._read_whole, fetch, not again)
        started: Future[PendingRead] = Future()
        started.set_result(self.reader.start(fetch, cell_ids=not again))
        return started

    def _read_whole(self, fetch: Fetch, cell_ids: bool) -> PendingRead:
        """``fetch`` read whole (retries included; on the read thread), as a pending read
        whose batches are all in.
        """
        return PendingRead(self.reader, fetch, self.reader.read(fetch, cell_ids=cell_ids), cell_ids)

    def _start_until(self, n: int, holding: int = 0) -> None:
        """Start reads until ``n`` are in flight or the next does not fit the budget."""
        while self._failure is None and not self._exhausted and len(self._ahead) < n:
            if self._peeked is None:
                try:
                    part = next(self.source, None)
                except Exception as exc:
                    self._failure = exc
                    return
                if part is None:
                    self._exhausted = True
                    return
                self._peeked = self._plan(part)  # once, however often it does not fit yet
            reading = self._peeked
            held = holding + sum(r.cost for r in self._ahead)
            if not budget.fits(held, reading.cost, self.memory_budget):
                return
            reading.pending = self._start(reading.groups[0])
            self._ahead.append(reading)
            self._peeked = None

    def __next__(self) -> Group:
        self._start_until(1)
        if not self._ahead:
            if self._failure is not None:
                failure, self._failure = self._failure, None
                raise failure
            raise StopIteration
        reading, k = self._ahead[0], self._group
        assert reading.pending is not None
        pending = reading.pending.result()
        cell_ids = pending.cell_ids
        batches = list(pending.result())
        last = k + 1 == len(reading.groups)
        if not last:  # decoded by Lance while this group is assembled
            reading.pending = self._start(reading.groups[k + 1])
            self._group = k + 1
        else:
            self._ahead.popleft()
            self._group = 0
            if not self._first:  # the run's first part is handed on before reading ahead
                self._start_until(self.read_ahead, holding=reading.cost)
            self._first = False
        return Group(reading.part, reading.groups[k], batches, last, cell_ids)

    def close(self) -> None:
        """Drop the reads started ahead (Lance finishes them on its own threads), after the
        read thread's start in progress, if any.
        """
        self._ahead.clear()
        scans, self._scans = self._scans, None
        if scans is not None:
            scans.shutdown(wait=True, cancel_futures=True)
        super().close()
