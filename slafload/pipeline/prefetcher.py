"""One owned background thread filling a bounded queue.

The producer runs a generator on its own thread and puts every item into a bounded
``queue.Queue``: a full queue blocks it (nothing is ever dropped). Every blocking call uses a
timeout so a stop request is seen within ``poll`` seconds; the end of data is an explicit
sentinel (never inferred from a timeout); any exception raised by the generator is forwarded
and re-raised in the consumer with its original type, message and traceback.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from slafload.errors import LoaderError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _End:
    """Sentinel: the generator is exhausted."""


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetcher(Generic[T]):
    """Iterates ``produce(stop)`` on a background thread, ``depth`` items ahead of the consumer.

    Args:
        produce: Called on the thread with the stop ``Event`` (set by :meth:`close`; check it
            between expensive steps), returns the iterator to run. It must not hold a
            reference to whatever owns this prefetcher, so that owner can be
            garbage-collected (and close us) while the thread runs.
        depth: Maximum number of items waiting in the queue.
        poll: Seconds between checks of the stop flag while blocked.
        name: Thread name.
    """

    def __init__(
        self,
        produce: Callable[[threading.Event], Iterator[T]],
        *,
        depth: int,
        poll: float = 0.05,
        name: str = "slafload-producer",
    ):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._produce = produce
        self._queue: queue.Queue[T | _End | _Failure] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._poll = poll
        self._done = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the producer thread is still running."""
        return self._thread.is_alive()

    def _put(self, item: T | _End | _Failure) -> bool:
        """Put unless stopped; False if a stop request arrived first."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=self._poll)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        iterator = None
        try:
            iterator = self._produce(self._stop)
            for item in iterator:
                # A put that a stop request unblocked (close() drains the queue) ends the
                # run too: making the next item would only delay close().
                if not self._put(item) or self._stop.is_set():
                    return
            self._put(_End())
        except BaseException as exc:  # forwarded, never swallowed: the consumer re-raises it
            logger.debug("producer failed: %r", exc)
            self._put(_Failure(exc))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=self._poll)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    if self._stop.is_set():
                        raise StopIteration from None
                    raise LoaderError("the producer thread ended without a result") from None
                continue
            if isinstance(item, _End):
                self._done = True
                raise StopIteration
            if isinstance(item, _Failure):
                self._done = True
                raise item.exc
            return item

    def close(self, timeout: float = 10.0) -> None:
        """Stop the producer and join its thread. Idempotent."""
        self._stop.set()
        self._done = True
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("producer thread did not stop within %.1f s", timeout)
