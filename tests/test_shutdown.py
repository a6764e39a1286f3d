"""Prompt shutdown: close(), KeyboardInterrupt and garbage collection while the producer works.

Each test waits until the producer thread is inside a chunk (a chunk transform signals it,
then ranking and tokenizing thousands of cells still lie ahead), stops the loader one way,
and checks that the stop returns within a second and no producer thread is left.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
from conftest import random_counts, write_dense

from slafload import Loader, open_dataset

CHUNK = 4096  # cells per chunk: ~0.25 M expression rows to rank and tokenize
LIMIT = 1.0  # seconds: the bound on every way of stopping


@pytest.fixture(scope="module")
def busy_dataset(tmp_path_factory):
    dense = random_counts(3 * CHUNK, 200, seed=11, density=0.3)
    return open_dataset(write_dense(tmp_path_factory.mktemp("busy") / "busy.slaf", dense))


class ChunkSignal:
    """A chunk transform that sets ``entered`` when the producer starts chunk ``at``."""

    def __init__(self, at: int = 0):
        self.at, self.seen, self.entered = at, 0, threading.Event()

    def __call__(self, chunk):
        if self.seen == self.at:
            self.entered.set()
        self.seen += 1
        return chunk


def busy_loader(dataset, signal: ChunkSignal) -> Loader:
    return Loader(
        dataset,
        chunk_cells=CHUNK,
        batch_size=64,
        max_genes=256,
        queue_depth=4 * CHUNK // 64,  # room for a whole chunk: the producer moves on to the next
        transforms=[signal],
    )


def producers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "slafload-producer"]


def test_close_mid_chunk_returns_promptly_and_joins_the_thread(busy_dataset):
    signal = ChunkSignal(at=0)
    loader = busy_loader(busy_dataset, signal)
    iterator = iter(loader)
    assert signal.entered.wait(30)
    start = time.monotonic()
    loader.close()
    elapsed = time.monotonic() - start
    assert elapsed < LIMIT, elapsed
    assert not producers()
    with pytest.raises(StopIteration):
        next(iterator)


def test_keyboard_interrupt_in_the_consumer_stops_the_producer(busy_dataset):
    signal = ChunkSignal(at=1)
    with pytest.raises(KeyboardInterrupt), busy_loader(busy_dataset, signal) as loader:
        for _ in loader:
            assert signal.entered.wait(30)  # the producer is inside the second chunk
            start = time.monotonic()
            raise KeyboardInterrupt
    elapsed = time.monotonic() - start
    assert elapsed < LIMIT, elapsed
    assert not producers()


def test_keyboard_interrupt_without_a_with_block_stops_the_producer_once_unwound(busy_dataset):
    signal = ChunkSignal(at=1)

    def train() -> None:
        loader = busy_loader(busy_dataset, signal)
        for _ in loader:
            assert signal.entered.wait(30)
            raise KeyboardInterrupt

    try:
        train()
    except KeyboardInterrupt:
        start = time.monotonic()  # leaving this block frees the traceback and the loader
    elapsed = time.monotonic() - start
    assert elapsed < LIMIT, elapsed
    assert not producers()


def test_garbage_collecting_the_loader_mid_chunk_stops_the_producer(busy_dataset):
    signal = ChunkSignal(at=1)

    def start_then_drop() -> tuple[weakref.ref, float]:
        loader = busy_loader(busy_dataset, signal)
        iterator = iter(loader)
        next(iterator)
        assert signal.entered.wait(30)
        assert producers()
        return weakref.ref(loader), time.monotonic()  # returning drops loader and iterator

    ref, start = start_then_drop()
    gc.collect()  # reference counting has already done it; a cycle would need this
    assert ref() is None
    elapsed = time.monotonic() - start
    assert elapsed < LIMIT, elapsed
    assert not producers()


def test_ctrl_c_while_the_consumer_waits_for_a_batch_stops_the_producer(busy_dataset):
    import _thread

    signal = ChunkSignal(at=0)

    def interrupt_once_busy() -> None:
        if signal.entered.wait(30):
            _thread.interrupt_main()  # what Ctrl-C does: KeyboardInterrupt in the main thread

    with busy_loader(busy_dataset, signal) as loader:
        iterator = iter(loader)
        threading.Thread(target=interrupt_once_busy, name="ctrl-c").start()
        with pytest.raises(KeyboardInterrupt):
            while True:  # the first batch needs the whole first chunk: next() blocks
                next(iterator)
        start = time.monotonic()
    elapsed = time.monotonic() - start
    assert elapsed < LIMIT, elapsed
    assert not producers()
