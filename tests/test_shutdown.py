"""Prompt shutdown: close(), KeyboardInterrupt and garbage collection while the producer works.

Each test waits until the producer thread is inside a chunk (a chunk transform signals it,
then ranking and tokenizing thousands of cells still lie ahead), stops the loader one way,
and checks that no producer thread is left and that the producer stopped where it was: it
never went on to the end of the data (six chunks, with room in the queue for all of them).
No wall-clock bound is asserted (the machines are shared); ``HANG`` only turns a hang into a
failure instead of a stuck test run.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
from conftest import random_counts, write_dense

from slafload import Loader, Tuning, open_dataset

CHUNK = 2048  # cells per chunk: ~0.12 M expression rows to rank and tokenize
N_CHUNKS = 6
HANG = 30.0  # seconds: a stop that takes this long is a hang, not a slow machine


@pytest.fixture(scope="module")
def busy_dataset(tmp_path_factory):
    dense = random_counts(N_CHUNKS * CHUNK, 200, seed=11, density=0.3)
    return open_dataset(write_dense(tmp_path_factory.mktemp("busy") / "busy.slaf", dense))


class ChunkSignal:
    """A chunk transform that sets ``entered`` when the producer starts chunk ``at``.

    With ``hold``, the producer then waits inside that chunk until ``release`` is set, so a
    test knows the consumer is blocked waiting for a batch.
    """

    def __init__(self, at: int = 0, *, hold: bool = False):
        self.at, self.seen, self.entered = at, 0, threading.Event()
        self.hold, self.release = hold, threading.Event()

    def __call__(self, chunk):
        if self.seen == self.at:
            self.entered.set()
            if self.hold:
                self.release.wait(HANG)
        self.seen += 1
        return chunk


def busy_loader(dataset, signal: ChunkSignal) -> Loader:
    return Loader(
        dataset,
        chunk_cells=CHUNK,
        batch_size=64,
        max_genes=256,
        tuning=Tuning(queue_depth=N_CHUNKS * CHUNK // 64),  # room for all: only stop stops it
        transforms=[signal],
    )


def producers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "slafload-producer"]


def assert_stopped(signal: ChunkSignal, at_stop: int, elapsed: float) -> None:
    """No producer is left, and it stopped within three chunks of where the stop found it
    (the two being ranked ahead, and the one being read), well before the end of the data."""
    assert elapsed < HANG, elapsed
    assert not producers()
    assert signal.seen <= at_stop + 3 and signal.seen < N_CHUNKS, (at_stop, signal.seen)


def test_close_mid_chunk_returns_promptly_and_joins_the_thread(busy_dataset):
    signal = ChunkSignal(at=0)
    loader = busy_loader(busy_dataset, signal)
    iterator = iter(loader)
    assert signal.entered.wait(30)
    start, at_stop = time.monotonic(), signal.seen
    loader.close()
    elapsed = time.monotonic() - start
    assert_stopped(signal, at_stop, elapsed)
    with pytest.raises(StopIteration):
        next(iterator)


def test_keyboard_interrupt_in_the_consumer_stops_the_producer(busy_dataset):
    signal = ChunkSignal(at=1)
    with pytest.raises(KeyboardInterrupt), busy_loader(busy_dataset, signal) as loader:
        for _ in loader:
            assert signal.entered.wait(30)  # the producer is inside the second chunk
            start, at_stop = time.monotonic(), signal.seen
            raise KeyboardInterrupt
    elapsed = time.monotonic() - start
    assert_stopped(signal, at_stop, elapsed)


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
        start, at_stop = time.monotonic(), signal.seen  # leaving this frees the traceback
    elapsed = time.monotonic() - start
    assert_stopped(signal, at_stop, elapsed)


def test_garbage_collecting_the_loader_mid_chunk_stops_the_producer(busy_dataset):
    signal = ChunkSignal(at=1)

    def start_then_drop() -> tuple[weakref.ref, float, int]:
        loader = busy_loader(busy_dataset, signal)
        iterator = iter(loader)
        next(iterator)
        assert signal.entered.wait(30)
        assert producers()
        return weakref.ref(loader), time.monotonic(), signal.seen  # drops loader, iterator

    ref, start, at_stop = start_then_drop()
    gc.collect()  # reference counting has already done it; a cycle would need this
    assert ref() is None
    elapsed = time.monotonic() - start
    assert_stopped(signal, at_stop, elapsed)


def test_ctrl_c_while_the_consumer_waits_for_a_batch_stops_the_producer(busy_dataset):
    import _thread
    import signal as signals

    signal = ChunkSignal(at=0, hold=True)  # no batch exists yet: the consumer waits in next()

    def interrupt_once_busy() -> None:
        if signal.entered.wait(30):
            # No batch can exist while the chunk is held, so the main thread is (or will
            # shortly be) blocked in next(): give it time to get there, so the interrupt
            # cannot land in Thread.start() above, outside pytest.raises (seen 1 run in 25).
            time.sleep(0.2)
            _thread.interrupt_main()  # what Ctrl-C does: KeyboardInterrupt in the main thread
            signal.release.set()  # let the producer go on: only the stop request ends it now

    # Python's own Ctrl-C handler, whatever this process inherited: a shell that starts it in
    # the background (`cmd &` in a script) ignores SIGINT, and interrupt_main() then does nothing.
    inherited = signals.signal(signals.SIGINT, signals.default_int_handler)
    try:
        with busy_loader(busy_dataset, signal) as loader:
            iterator = iter(loader)
            with pytest.raises(KeyboardInterrupt):
                threading.Thread(target=interrupt_once_busy, name="ctrl-c").start()
                while True:  # the first batch waits on the held chunk: next() blocks
                    next(iterator)
            start, at_stop = time.monotonic(), signal.seen
    finally:
        signals.signal(signals.SIGINT, inherited)
    elapsed = time.monotonic() - start
    assert_stopped(signal, at_stop, elapsed)
