"""The stage protocol: a small iterator that owns its source and closes it.

Stages compose by wrapping (torchdata ``nodes`` style, without generators): each takes the
stage before it, pulls an item at a time in ``__next__`` and ``close()``-s its source when it
is closed, so clean-up (pending Lance reads, Polars queries in flight) runs from the last
stage back to the first. Stages know nothing of threads, and of epochs only the tag each item
carries (:class:`~slafload.pipeline.partition.Tagged`: its epoch leg, which the batch stage
ends, :mod:`slafload.pipeline.epochs` plans and turns into positions); cancellation is checked
between items by the prefetcher.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class Stage(Iterator[T]):
    """Base of every stage: iterates items of type ``T`` pulled from ``source``."""

    def __init__(self, source: Iterator[Any]):
        self.source = source

    def __iter__(self) -> Stage[T]:
        return self

    def __next__(self) -> T:
        raise NotImplementedError

    def close(self) -> None:
        """Release what this stage holds, then close its source. Idempotent."""
        close_source(self.source)


def close_source(source: object) -> None:
    """``source.close()`` when it has one (stages, generators)."""
    close = getattr(source, "close", None)
    if close is not None:
        close()


Observe = Callable[[str, Stage[Any]], Stage[Any]]
"""Wraps each stage as it is built, by name (the benchmark times stages this way)."""


def as_is(name: str, stage: Stage[Any]) -> Stage[Any]:
    """The :data:`Observe` that keeps every stage as it is."""
    return stage
