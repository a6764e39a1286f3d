"""Byte ranges of files on an object store: range GETs, coalesced, many in flight, retried.

Every request to a bucket pays its latency (10-30 ms to first byte on S3), so what decides a
block sampler's rate there is how many requests a fetch costs and how many are in flight
(docs/object-storage.md). :class:`ObjectStore` is the one place slafload's direct reader
talks to a bucket: it opens files (one ``HEAD`` each, for the size, kept open), and
:meth:`ObjectStore.fill` reads a window's runs of file bytes by as few range GETs as their
gaps allow (:func:`coalesce`: gaps of one file of at most :attr:`StoreOptions.gap` bytes are
read through, smallest first, while the bytes read through stay within half the bytes the
runs occupy), up to :attr:`StoreOptions.in_flight` requests at once, each retried after a
transient failure as the loader's :class:`~slafload.config.RetryPolicy` says.

The requests go through ``pyarrow.fs.S3FileSystem`` (public and documented: ``open_input_file``
and ``RandomAccessFile.read_at``, which is thread-safe), built from Lance's storage options
by :func:`s3_filesystem`. Only ``s3://`` URIs (and S3-compatible endpoints) are read so;
other stores keep Lance's reader.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from slafload.config import RANGE_GAP, REQUESTS_IN_FLIGHT, RetryPolicy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreOptions:
    """How :class:`ObjectStore` requests bytes.

    Attributes:
        gap: Runs of one file at most this many bytes apart may be read by one request
            (:func:`coalesce`).
        in_flight: Range requests at once.
        retry: When a failed request is made again (transient failures: ``OSError``, a
            short body), with what waits.
    """

    gap: int = RANGE_GAP
    in_flight: int = REQUESTS_IN_FLIGHT
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        if self.gap < 0 or self.in_flight < 1:
            raise ValueError(f"gap must be >= 0 and in_flight >= 1, got {self!r}")


def supported(uri: str) -> bool:
    """Whether ``uri`` is on a store :class:`ObjectStore` reads (``s3://``)."""
    return uri.startswith("s3://")


def s3_filesystem(storage_options: Mapping[str, str] | None, *, retries: int = 3) -> Any:
    """A ``pyarrow.fs.S3FileSystem`` configured from Lance-style storage options
    (``aws_access_key_id``, ``aws_secret_access_key``, ``aws_session_token``, ``aws_region``,
    ``aws_endpoint``, ``aws_skip_signature``; credentials not given are taken from the
    environment as the AWS SDK does). ``retries``: attempts of each request by the SDK itself.
    """
    opts = dict(storage_options or {})
    anonymous = str(opts.get("aws_skip_signature", "")).lower() == "true"
    endpoint = opts.get("aws_endpoint") or opts.get("endpoint")
    scheme = "https"
    if endpoint and "://" in endpoint:
        scheme, endpoint = endpoint.split("://", 1)
    return pafs.S3FileSystem(
        access_key=opts.get("aws_access_key_id"),
        secret_key=opts.get("aws_secret_access_key"),
        session_token=opts.get("aws_session_token"),
        region=opts.get("aws_region") or opts.get("region"),
        endpoint_override=endpoint,
        scheme=scheme,
        anonymous=anonymous,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=retries),
    )


@dataclass(frozen=True)
class Blob:
    """An open file of the store: its id in :attr:`ObjectStore.blobs`, path and size."""

    id: int
    path: str
    size: int
    handle: Any  # pyarrow's RandomAccessFile


class ObjectStore:
    """Range reads of one table's files on an S3-compatible store (see the module docstring).

    Thread-safe. :attr:`requests` and :attr:`bytes` count what it asked for (each attempt),
    for the benchmark and the logs. The requests run on :attr:`StoreOptions.in_flight`
    threads of its own, started on first use and kept while it lives (idle, they wait on a
    queue): starting a read's threads anew cost ~30% more CPU per request than the request
    itself makes in pyarrow's S3 client (~0.6 ms). A store is used in the process that made it
    (:class:`~slafload._lance.ranged.StoreFiles` makes a forked child its own).
    """

    def __init__(self, storage_options: Mapping[str, str] | None, options: StoreOptions):
        self.options = options
        # The SDK's own retries off: one policy (the loader's) decides, and counts, them all.
        self._fs = s3_filesystem(storage_options, retries=1)
        self.blobs: dict[int, Blob] = {}
        self._by_path: dict[str, Blob] = {}
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(options.in_flight)  # requests under way
        self._pool: ThreadPoolExecutor | None = None  # the requests' threads, once needed
        self.requests = 0
        self.bytes = 0

    def open(self, uri: str) -> Blob:
        """Open the file at ``uri`` (``s3://bucket/key``): one ``HEAD`` request, retried, the
        first time (pyarrow's ``open_input_file`` takes no size; the open file is kept).
        """
        with self._lock:
            blob = self._by_path.get(uri)
        if blob is not None:
            return blob
        handle = self._retried(lambda: self._fs.open_input_file(uri.split("://", 1)[1]), uri)
        with self._lock:
            blob = self._by_path.get(uri)
            if blob is None:
                blob = Blob(len(self.blobs), uri, handle.size(), handle)
                self.blobs[blob.id] = self._by_path[uri] = blob
        return blob

    def read_at(self, blob: Blob, n: int, at: int) -> bytes:
        """Bytes ``[at, at + n)`` of ``blob`` by one range request (retried)."""
        return self._get(blob, at, n)

    def reader(self, blob: Blob, runs: Sequence[tuple[int, int]]) -> Callable[[int, int], bytes]:
        """``read(n, at)`` over ``runs`` ``(at, n)`` of ``blob``, all fetched now, together
        (a file's chunk words when it is opened); a run not among them is requested alone.
        """
        got: dict[tuple[int, int], bytes] = {}
        out = [np.empty(n, np.uint8) for _, n in runs]
        self._read([blob.id] * len(runs), [at for at, _ in runs], [n for _, n in runs],
                   [(buf, 0) for buf in out])  # fmt: skip
        for (at, n), buf in zip(runs, out, strict=True):
            got[(n, at)] = buf.tobytes()
        return lambda n, at: got[(n, at)] if (n, at) in got else self._get(blob, at, n)

    def fill(self, targets: Sequence[tuple[Any, np.ndarray]]) -> None:
        """Read every run of each ``(runs, buffer)`` into its buffer: ``runs`` holds
        ``fds`` (blob ids), ``offsets``, ``sizes`` and ``where`` (the buffer offsets), as
        :class:`~slafload._lance.flat_reads._Runs` does.
        """
        fds: list[int] = []
        offsets: list[int] = []
        sizes: list[int] = []
        into: list[tuple[np.ndarray, int]] = []
        for runs, buffer in targets:
            fds += runs.fds
            offsets += runs.offsets
            sizes += runs.sizes
            into += [(buffer, at) for at in runs.where]
        self._read(fds, offsets, sizes, into)

    def _read(self, fds: list[int], offsets: list[int], sizes: list[int],
              into: list[tuple[np.ndarray, int]]) -> None:  # fmt: skip
        """Bytes ``[offsets[i], offsets[i] + sizes[i])`` of blob ``fds[i]`` read into
        ``into[i]`` (a buffer and where in it), by as few requests as :func:`coalesce`
        allows, up to :attr:`StoreOptions.in_flight` at once.
        """
        if not fds:
            return
        order, starts = coalesce(np.array(fds, np.int64), np.array(offsets, np.int64),
                                 np.array(sizes, np.int64), self.options.gap)  # fmt: skip
        runs = [(fds[i], offsets[i], sizes[i], *into[i]) for i in order.tolist()]
        groups = [runs[a:b] for a, b in itertools.pairwise(starts.tolist())]
        if len(groups) == 1:
            self._read_group(groups[0])
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.options.in_flight, "slafload-get")
            pool = self._pool
        tasks = [pool.submit(self._read_group, g) for g in groups]
        wait(tasks)  # all of them: none is left writing into a buffer after a failure
        for task in tasks:
            task.result()  # the first failure (after its retries) is raised here

    def _read_group(self, group: list[tuple[int, int, int, np.ndarray, int]]) -> None:
        first = group[0][1]
        last = max(offset + size for _, offset, size, _, _ in group)
        data = memoryview(self._get(self.blobs[group[0][0]], first, last - first))
        for _, offset, size, buffer, at in group:
            buffer[at : at + size] = np.frombuffer(data[offset - first : offset - first + size],
                                                   np.uint8)  # fmt: skip

    def _get(self, blob: Blob, at: int, n: int) -> bytes:
        def get() -> bytes:
            with self._slots:
                data = blob.handle.read_at(n, at)
            with self._lock:
                self.requests += 1
                self.bytes += len(data)
            if len(data) != n:
                raise OSError(f"short read: {len(data)} of {n} bytes at {at}")
            return data

        return self._retried(get, f"{blob.path} bytes [{at}, {at + n})")

    def _retried(self, call: Callable[[], Any], what: str) -> Any:
        policy = self.options.retry
        for attempt in range(1, policy.attempts + 1):
            try:
                return call()
            except Exception as exc:
                if attempt == policy.attempts or not policy.is_transient(exc):
                    raise
                wait = policy.backoff(attempt)
                logger.info("request for %s failed (attempt %d of %d: %s: %s); again in "
                            "%.2f s", what, attempt, policy.attempts, type(exc).__name__, exc,
                            wait)  # fmt: skip
                time.sleep(wait)
        raise AssertionError("unreachable")


def coalesce(
    fds: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, gap: int
) -> tuple[np.ndarray, np.ndarray]:
    """Which runs of file bytes one request reads: ``(order, starts)``, the runs sorted by
    file and offset, and where each request's runs start in that order (``starts[-1]`` is
    the number of runs).

    Runs of one file that overlap or touch share a request. Of the gaps between the others
    of one file, at most ``gap`` bytes each, the smallest are read through first, for as
    long as the bytes read through stay within half the bytes the runs occupy (counted once
    where they overlap): a read never costs more than 1.5 times its runs' bytes, and that
    budget saves the most requests it can (a small gap saves a request for fewer bytes).
    """
    order = np.lexsort((offsets, fds))
    # One axis for every file: a file's bytes at fd << 44 (files are below 16 TiB).
    at = (fds[order] << 44) + offsets[order]
    end = np.maximum.accumulate(at + sizes[order])  # the furthest byte read so far
    hole = at[1:] - end[:-1]
    same = fds[order][1:] == fds[order][:-1]
    wanted = int(sizes.sum()) - int(np.minimum(np.maximum(-hole, 0), sizes[order][1:]).sum())
    join = same & (hole <= 0)
    open_ = np.flatnonzero(same & (hole > 0) & (hole <= gap))
    open_ = open_[np.argsort(hole[open_], kind="stable")]
    taken = np.cumsum(hole[open_]) <= wanted // 2
    join[open_[taken]] = True
    starts = np.concatenate([[0], np.flatnonzero(~join) + 1, [len(at)]])
    return order, starts
