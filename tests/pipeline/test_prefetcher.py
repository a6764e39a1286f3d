"""Prefetcher: a bounded queue, an owned thread, forwarded errors, prompt shutdown."""

from __future__ import annotations

import threading
import time

import pytest

from slafload.pipeline.prefetcher import Prefetcher


def test_the_producer_blocks_on_a_full_queue_and_nothing_is_dropped():
    produced = []

    def produce(stop):
        for i in range(50):
            produced.append(i)
            yield i

    pf = Prefetcher(produce, depth=3)
    time.sleep(0.3)
    assert len(produced) <= 3 + 1  # queue full plus the item waiting to be put
    assert list(pf) == list(range(50))
    pf.close()


def test_an_exception_keeps_its_type_message_and_arrives_promptly():
    class Custom(Exception):
        pass

    def produce(stop):
        yield 1
        raise Custom("stage 3 failed: bad chunk 7")

    pf = Prefetcher(produce, depth=2)
    assert next(pf) == 1
    start = time.monotonic()
    with pytest.raises(Custom, match="stage 3 failed: bad chunk 7"):
        next(pf)
    assert time.monotonic() - start < 1.0
    with pytest.raises(StopIteration):
        next(pf)
    pf.close()


def test_close_stops_a_blocked_producer_and_joins_its_thread():
    def produce(stop):
        i = 0
        while True:
            yield i
            i += 1

    pf = Prefetcher(produce, depth=1, name="slafload-test")
    next(pf)
    start = time.monotonic()
    pf.close()
    assert time.monotonic() - start < 1.0
    assert not pf.alive
    assert not [t for t in threading.enumerate() if t.name == "slafload-test"]
    with pytest.raises(StopIteration):
        next(pf)


def test_close_does_not_wait_for_an_item_nobody_will_take():
    started = threading.Event()

    def produce(stop):
        yield 0
        yield 1  # blocks in put: the queue holds item 0
        started.set()  # making item 2 would take long; close() must not wait for it
        time.sleep(5)
        yield 2

    pf = Prefetcher(produce, depth=1, name="slafload-test-next")
    while pf._queue.qsize() < 1:
        time.sleep(0.01)
    time.sleep(0.1)  # the producer is now blocked putting item 1
    pf.close()
    assert not pf.alive and not started.is_set()


def test_the_generator_is_closed_when_stopped():
    cleaned = threading.Event()

    def produce(stop):
        try:
            while True:
                yield 0
        finally:
            cleaned.set()

    pf = Prefetcher(produce, depth=1)
    next(pf)
    pf.close()
    assert cleaned.wait(1.0)


def test_end_of_data_is_an_explicit_sentinel_not_a_timeout():
    def produce(stop):
        time.sleep(0.3)  # much longer than the poll interval
        yield "late"

    pf = Prefetcher(produce, depth=1, poll=0.01)
    assert list(pf) == ["late"]
    pf.close()


def test_the_producer_sees_the_stop_request_between_its_own_steps():
    steps = []

    def produce(stop):
        for i in range(1000):
            time.sleep(0.01)  # an expensive stage that checks the flag when it finishes
            steps.append(i)
            if stop.is_set():
                return
            yield i

    pf = Prefetcher(produce, depth=1000)
    next(pf)
    pf.close()
    assert not pf.alive and len(steps) < 1000
