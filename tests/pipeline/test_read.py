"""Storage faults: transient failures are retried with bounded backoff, permanent ones reported.

Faults are injected into a real :class:`Reader` on a real dataset: a subclass fails the first
``k`` reads of chosen fetches (sometimes after yielding part of the fetch), then delegates.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

import slafload.pipeline.reader
from slafload import Loader, ReadError, open_dataset
from slafload.config import RetryPolicy, Tuning
from slafload.pipeline.read import CHECKED_RANGES, LONG_RANGE_CELLS, RetryingReader, _scanned_whole
from slafload.pipeline.reader import Reader
from slafload.samplers import Fetch

FAST = RetryPolicy(attempts=4, initial_backoff=0.001, max_backoff=0.004)


def flaky_reader(failures: dict[int, int], *, after_batches: int = 0, exc=OSError):
    """A Reader class whose fetch ``i`` fails ``failures[i]`` times, then reads normally."""
    calls: Counter[int] = Counter()

    class FlakyReader(Reader):
        def read(self, fetch, **kw):
            calls[fetch.index] += 1
            if calls[fetch.index] <= failures.get(fetch.index, 0):
                batches = super().read(fetch, **kw)
                for _ in range(after_batches):  # a partial read before the failure
                    yield next(batches)
                raise exc(f"injected fault #{calls[fetch.index]} on fetch {fetch.index}")
            yield from super().read(fetch, **kw)

    FlakyReader.calls = calls
    return FlakyReader


def producers():
    return [t for t in threading.enumerate() if t.name == "slafload-producer"]


@pytest.mark.parametrize("after_batches", [0, 1])
def test_transient_failures_are_retried_and_every_cell_arrives_exactly_once(
    small_slaf, monkeypatch, after_batches
):
    flaky = flaky_reader({0: 3, 2: 1, 4: 2}, after_batches=after_batches)
    monkeypatch.setattr(slafload.pipeline.reader, "Reader", flaky)
    with Loader(
        small_slaf, batch_size=16, chunk_cells=32, tuning=Tuning(batch_rows=8, retry=FAST), seed=3
    ) as loader:
        ids = np.concatenate([b["cell_integer_id"].numpy() for b in loader])
    np.testing.assert_array_equal(np.sort(ids), np.arange(300))
    assert flaky.calls[0] == 4 and flaky.calls[2] == 2 and flaky.calls[4] == 3
    assert flaky.calls[1] == 1


def test_retried_tokens_equal_a_clean_run(small_slaf, monkeypatch):
    with Loader(small_slaf, batch_size=16, chunk_cells=32, seed=5) as loader:
        clean = [b["input_ids"] for b in loader]
    monkeypatch.setattr(slafload.pipeline.reader, "Reader", flaky_reader({1: 2}, after_batches=1))
    with Loader(
        small_slaf, batch_size=16, chunk_cells=32, seed=5, tuning=Tuning(batch_rows=8, retry=FAST)
    ) as loader:
        retried = [b["input_ids"] for b in loader]
    assert len(clean) == len(retried)
    assert all(np.array_equal(a, b) for a, b in zip(clean, retried, strict=True))


def test_a_permanent_failure_reaches_the_consumer_with_context_and_the_thread_ends(
    small_slaf, monkeypatch
):
    monkeypatch.setattr(slafload.pipeline.reader, "Reader", flaky_reader({2: 99}))
    loader = Loader(
        small_slaf, batch_size=16, chunk_cells=32, shuffle=False, tuning=Tuning(retry=FAST)
    )
    got = []
    with pytest.raises(ReadError) as info:
        for batch in loader:
            got.append(batch["cell_integer_id"].numpy())
    message = str(info.value)
    assert "fetch 2 (cells [64, 96))" in message and "failed 4 times" in message
    assert "small.slaf" in message and "retry.attempts" in message
    assert isinstance(info.value.__cause__, OSError)
    assert "injected fault #4" in str(info.value.__cause__)
    # Cells before the failed fetch arrived in order (the pipeline keeps one batch of
    # lookahead), and the position counts exactly those, so a resume skips nothing.
    delivered = np.concatenate(got)
    np.testing.assert_array_equal(delivered, np.arange(len(delivered)))
    assert 32 <= len(delivered) <= 64 and loader.position.cells == len(delivered)
    deadline = time.monotonic() + 2
    while producers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not producers()
    loader.close()


def test_a_non_transient_failure_is_not_retried(small_slaf):
    ds = open_dataset(small_slaf)
    flaky = flaky_reader({0: 1}, exc=KeyError)
    waits = []
    reader = RetryingReader(flaky(ds), FAST, uri=ds.uri, sleep=waits.append)
    with pytest.raises(ReadError, match="fetch 0 .*non-transient KeyError.*retry.transient"):
        reader.read(Fetch(0, np.array([[0, 10], [20, 25]])))
    assert flaky.calls[0] == 1 and waits == []


def test_backoff_grows_exponentially_up_to_its_bound(small_slaf):
    ds = open_dataset(small_slaf)
    policy = RetryPolicy(attempts=6, initial_backoff=0.5, max_backoff=3.0)
    waits = []
    reader = RetryingReader(flaky_reader({0: 5})(ds), policy, sleep=waits.append)
    batches = list(reader.read(Fetch(0, np.array([[0, 50]]))))
    assert sum(b.num_rows for b in batches) == ds.cell_start[50]
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_storage_error_wrapped_by_the_reader_counts_as_transient(small_slaf):
    import shutil

    ds = open_dataset(small_slaf)
    shutil.rmtree(small_slaf / "expression.lance" / "data")
    waits = []
    reader = RetryingReader(Reader(ds), FAST, uri=ds.uri, sleep=waits.append)
    with pytest.raises(ReadError, match=r"fetch 3 \(cells \[0, 5\)\).*failed 4 times") as info:
        reader.read(Fetch(3, np.array([[0, 5]])))
    assert len(waits) == 3 and info.value.__cause__ is not None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attempts": 0}, "attempts must be a positive integer"),
        ({"initial_backoff": 2.0, "max_backoff": 1.0}, "initial_backoff <= max_backoff"),
        ({"transient": (OSError, "x")}, "tuple of exception classes"),
    ],
)
def test_retry_policies_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RetryPolicy(**kwargs)


def test_the_loader_rejects_a_retry_setting_that_is_not_a_policy():
    with pytest.raises(ValueError, match="retry must be a RetryPolicy"):
        Tuning(retry=3)


def test_lance_io_errors_are_transient_by_message_and_others_are_not():
    import pyarrow as pa

    policy = RetryPolicy()
    assert policy.is_transient(pa.ArrowInvalid("External error: LanceError(IO): timed out"))
    assert policy.is_transient(ConnectionResetError("reset by peer"))
    assert not policy.is_transient(pa.ArrowInvalid("schema mismatch"))
    assert not RetryPolicy(transient=(), transient_messages=("x",)).is_transient(OSError("y"))


def test_start_reads_ahead_and_keeps_a_failure_for_result_which_retries_it(small_slaf):
    ds = open_dataset(small_slaf)
    flaky = flaky_reader({0: 2})
    waits = []
    reader = RetryingReader(flaky(ds), FAST, uri=ds.uri, sleep=waits.append)
    fetch = Fetch(0, np.array([[40, 60], [0, 10]]))
    pending = reader.start(fetch)  # the first attempt has run (and failed): nothing raised yet
    assert flaky.calls[0] == 1 and waits == []
    batches = list(pending.result())
    assert flaky.calls[0] == 3 and len(waits) == 2
    clean = list(Reader(ds).read(fetch))
    assert pa.Table.from_batches(batches).equals(pa.Table.from_batches(clean))


def test_a_non_transient_failure_of_a_started_read_surfaces_in_result(small_slaf):
    ds = open_dataset(small_slaf)
    flaky = flaky_reader({0: 1}, exc=KeyError)
    pending = RetryingReader(flaky(ds), FAST, uri=ds.uri).start(Fetch(0, np.array([[0, 10]])))
    with pytest.raises(ReadError, match="non-transient KeyError"):
        pending.result()
    assert flaky.calls[0] == 1


def test_a_read_ahead_of_one_range_runs_off_the_producer_while_earlier_batches_flow(
    small_slaf, monkeypatch
):
    # Fetch 4's read waits for the consumer to hold cells of fetch 1: had it been read on
    # the producer (which starts it before handing fetch 1 on: the token workers hold
    # fetches 2 and 3 by then, and two reads are started ahead), it would wait out its gate.
    received, gate, opened, threads = [0], threading.Event(), [], set()

    class Gated(Reader):
        def read(self, fetch, **kw):
            threads.add(threading.current_thread().name.split("_")[0])
            if fetch.index == 4:
                opened.append(gate.wait(10))
            yield from super().read(fetch, **kw)

    monkeypatch.setattr(slafload.pipeline.reader, "Reader", Gated)
    ids = []
    with Loader(small_slaf, batch_size=16, chunk_cells=32, seed=3) as loader:
        for batch in loader:
            ids.append(batch["cell_integer_id"].numpy())
            received[0] += len(ids[-1])
            if received[0] >= 48:
                gate.set()
    assert opened == [True]
    assert threads == {"slafload-producer", "slafload-scan"}  # the first read, then the rest
    np.testing.assert_array_equal(np.sort(np.concatenate(ids)), np.arange(300))
    assert not [t for t in threading.enumerate() if t.name.startswith("slafload-scan")]


def test_a_stream_chunk_or_a_mixed_fetch_is_read_ahead_whole_and_block_fetches_are_not():
    def ranges(*lengths: int) -> np.ndarray:
        stops = np.cumsum(np.array(lengths) + 10)
        return np.stack([stops - np.array(lengths), stops], axis=1)

    long = LONG_RANGE_CELLS
    assert _scanned_whole(ranges(3))  # one range, however short
    assert _scanned_whole(ranges(long, 2 * long))  # a mixed fetch: one range per source
    assert _scanned_whole(ranges(*[long] * CHECKED_RANGES))
    assert not _scanned_whole(ranges(*[long] * (CHECKED_RANGES + 1)))
    assert not _scanned_whole(ranges(long, long - 1))
    assert not _scanned_whole(ranges(*[256] * 16))  # BlockShuffle(256, 16)'s blocks
