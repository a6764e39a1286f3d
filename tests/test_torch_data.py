"""The IterableDataset face resumes exactly, alone and under torchdata's StatefulDataLoader."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import append_cell, random_counts, worker_context, write_dense

from slafload import Loader, StateError
from slafload.samplers import BlockShuffle, ChunkShuffle

# torchdata 0.11 calls torch's deprecated ``set_vital``.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
N = 230
WORKERS = {"batch_size": None, "multiprocessing_context": worker_context()}
# About 1 run in 10-20, a worker dropped mid-epoch aborts as its interpreter exits: its queue
# feeder thread (not joined by PyTorch) is pickling a batch, with the GIL released inside
# THPStorage_shareFd, and CPython < 3.14 ends it with pthread_exit, whose unwind through C++
# calls std::terminate (from a core dump; docs/distributed.md). torchdata's iterator reports
# that from __del__ as an unraisable exception; it is not slafload's and not what this checks,
# so that report alone (the iterator's __del__) is let through; any other still fails the test.
DROPPED_WORKER_ABORT = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <function _StatefulMultiProcessingDataLoaderIter.__del__"
    ":pytest.PytestUnraisableExceptionWarning"
)


@pytest.fixture(scope="module")
def atlas(tmp_path_factory):
    dense = random_counts(N, 30, seed=3, empty_every=17)
    return write_dense(tmp_path_factory.mktemp("torch") / "t.slaf", dense, max_rows_per_file=301)


def cells_of(state) -> int:
    """The cells this copy has yielded in the state's epoch (its current segment)."""
    return state["segments"][-1][1]


def torch_dataset(atlas, seed=1, sampler=None, batch_size=12):
    sampler = sampler or BlockShuffle(block_size=4, fetch_factor=2)
    with Loader(
        atlas, sampler=sampler, batch_size=batch_size, max_genes=8, seed=seed, n_epochs=None
    ) as loader:
        return loader.as_torch_dataset()


def uneven_dataset(atlas):
    """Six parts of 40 cells but one of 30; with seed 3 the short one falls to worker 0 of 2,
    which gets 11 batches of 10 against worker 1's 12: worker 0 runs out first."""
    return torch_dataset(atlas, seed=3, sampler=ChunkShuffle(chunk_cells=40), batch_size=10)


def ids(batches) -> list[np.ndarray]:
    return [b["cell_integer_id"].numpy().copy() for b in batches]


def assert_batch_for_batch_equal(head, rest, full) -> None:
    assert len(head) + len(rest) == len(full)
    for got, want in zip(head + rest, full, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("stop_after", [0, 1, 7, 19, 20])
def test_a_state_taken_mid_epoch_resumes_exactly_in_process(atlas, stop_after):
    full = ids(torch_dataset(atlas))
    assert len(full) == 20  # ceil(230 / 12)
    ds = torch_dataset(atlas)
    it = iter(ds)
    head = [next(it)["cell_integer_id"].numpy().copy() for _ in range(stop_after)]
    state = ds.state_dict()
    assert (state["epoch"], cells_of(state)) == (
        (0, sum(map(len, head))) if stop_after < 20 else (0, 230)
    )
    resumed = torch_dataset(atlas)
    resumed.load_state_dict(state)
    assert_batch_for_batch_equal(head, ids(resumed), full)


def test_the_state_after_a_whole_epoch_points_at_the_next_one(atlas):
    ds = torch_dataset(atlas)
    first = np.concatenate(ids(ds))
    state = ds.state_dict()
    assert (state["epoch"], cells_of(state)) == (1, 0)
    resumed = torch_dataset(atlas)
    resumed.load_state_dict(state)
    second = np.concatenate(ids(resumed))
    np.testing.assert_array_equal(np.sort(second), np.arange(N))
    assert not np.array_equal(first, second)


@pytest.fixture(scope="module")
def stateful_dataloader():
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader


# 7: mid-epoch, the workers have prefetched ahead; 22: each worker has yielded 11 batches;
# 23: worker 0 has run out (the loader has seen its end) while worker 1 has not.
STOPS = (7, 22, 23)


@DROPPED_WORKER_ABORT
def test_stateful_dataloader_with_two_workers_resumes_exactly(atlas, stateful_dataloader):
    """One uninterrupted run with its states taken after batches 7, 22 and 23 (taking one
    changes nothing), each resumed by a new loader: its batches are the run's rest."""
    loader = stateful_dataloader(uneven_dataset(atlas), num_workers=2, **WORKERS)
    full, states = [], {}
    for batch in loader:
        full.append(batch["cell_integer_id"].numpy().copy())
        if len(full) in STOPS:
            states[len(full)] = loader.state_dict()
    del loader
    np.testing.assert_array_equal(np.sort(np.concatenate(full)), np.arange(N))
    assert len(full) == 23 and set(states) == set(STOPS)
    for stop_after, state in states.items():
        resumed = stateful_dataloader(uneven_dataset(atlas), num_workers=2, **WORKERS)
        resumed.load_state_dict(state)
        assert_batch_for_batch_equal(full[:stop_after], ids(resumed), full)


@DROPPED_WORKER_ABORT
@pytest.mark.slow
def test_persistent_workers_resume_exactly_across_epochs(atlas, stateful_dataloader):
    settings = {"num_workers": 2, "persistent_workers": True, **WORKERS}
    loader = stateful_dataloader(uneven_dataset(atlas), **settings)
    full = [ids(loader) for _ in range(3)]
    for epoch in full:
        np.testing.assert_array_equal(np.sort(np.concatenate(epoch)), np.arange(N))
    assert not np.array_equal(np.concatenate(full[0]), np.concatenate(full[1]))

    loader = stateful_dataloader(uneven_dataset(atlas), **settings)
    assert_batch_for_batch_equal(ids(loader), [], full[0])
    it = iter(loader)
    head = [next(it)["cell_integer_id"].numpy().copy()]  # worker 1 has not yielded in epoch 1
    state = loader.state_dict()
    del it, loader

    resumed = stateful_dataloader(uneven_dataset(atlas), **settings)
    resumed.load_state_dict(state)
    assert_batch_for_batch_equal(head, ids(resumed), full[1])
    assert_batch_for_batch_equal(ids(resumed), [], full[2])


def test_set_epoch_keeps_a_loaded_position_in_that_epoch_only(atlas):
    ds = torch_dataset(atlas)
    it = iter(ds)
    head = [next(it)["cell_integer_id"].numpy().copy() for _ in range(3)]
    state = ds.state_dict()
    resumed = torch_dataset(atlas)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # as a training loop does at the top of every epoch
    assert_batch_for_batch_equal(head, ids(resumed), ids(torch_dataset(atlas)))
    other = torch_dataset(atlas)
    other.load_state_dict(state)
    other.set_epoch(1)  # another epoch was asked for: the loaded position is dropped
    assert cells_of(other.state_dict()) == 0
    np.testing.assert_array_equal(np.sort(np.concatenate(ids(other))), np.arange(N))


def test_resume_re_pins_the_lance_versions_of_the_state(tmp_path):
    path = write_dense(tmp_path / "a.slaf", random_counts(50, 6, seed=1))
    with Loader(path, batch_size=10, shuffle=False, n_epochs=None) as loader:
        ds = loader.as_torch_dataset()
    it = iter(ds)
    head = [next(it)["cell_integer_id"].numpy().copy() for _ in range(2)]
    state = ds.state_dict()
    append_cell(path, [1, 4], [3, 9])
    with Loader(
        path, batch_size=10, shuffle=False, n_epochs=None
    ) as loader:  # opens the newer versions
        newer = loader.as_torch_dataset()
    newer.load_state_dict(state)
    rest = ids(newer)
    np.testing.assert_array_equal(np.concatenate(head + rest), np.arange(50))

    versions = state["dataset"]["versions"]
    missing = {**state, "dataset": {"versions": {k: v + 50 for k, v in versions.items()}}}
    with pytest.raises(StateError, match="cannot reopen .* at the checkpoint's versions"):
        newer.load_state_dict(missing)
    assert newer.state_dict()["dataset"]["versions"] == versions  # a refused state changes nothing
    assert sum(len(b) for b in ids(newer)) == 50  # next epoch, still at the state's versions


def test_a_state_is_refused_by_another_worker_count_or_cell_order(atlas):
    ds = torch_dataset(atlas)
    next(iter(ds))
    state = ds.state_dict()
    with pytest.raises(StateError, match="worker 0 of 2.*worker 0 of 1; resume with the same"):
        torch_dataset(atlas).load_state_dict({**state, "n_workers": 2})
    with pytest.raises(StateError, match="rank 0 of 2.*rank 0 of 1.*elastic resume"):
        torch_dataset(atlas).load_state_dict({**state, "world_size": 2})
    with pytest.raises(StateError, match=r"different order.*'seed': \(1, 2\)"):
        torch_dataset(atlas, seed=2).load_state_dict(state)
    with Loader(atlas, sampler=ChunkShuffle(chunk_cells=40), seed=1) as loader:
        other_sampler = loader.as_torch_dataset()
    with pytest.raises(StateError, match="different order.*sampler"):
        other_sampler.load_state_dict(state)
    with pytest.raises(StateError, match="not a slafload state"):
        ds.load_state_dict({"epoch": 0})


class _SlowToPickle:
    """Pickles in ``seconds``: keeps a queue's feeder thread busy that long."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __reduce__(self):
        import time

        time.sleep(self.seconds)
        return (_SlowToPickle, (self.seconds,))


def _feeders() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "QueueFeederThread"]


def test_a_worker_exit_waits_for_its_queue_feeder_to_finish_pickling():
    # What a DataLoader worker does on its way out (torch closes its result queue without
    # joining it): the atexit hook must keep the process alive until the feeder is done.
    import multiprocessing

    from slafload.torch_data import join_queue_feeders

    queue = multiprocessing.get_context("spawn").Queue()
    queue.put(_SlowToPickle(0.5))
    queue.close()
    assert _feeders()  # still pickling
    join_queue_feeders(timeout=10)
    assert not _feeders()


def test_waiting_for_queue_feeders_is_bounded():
    import multiprocessing
    import time

    from slafload.torch_data import join_queue_feeders

    queue = multiprocessing.get_context("spawn").Queue()
    queue.put(b"x")  # starts a feeder that waits for more until the queue is closed
    start = time.monotonic()
    join_queue_feeders(timeout=0.2)
    assert 0.1 < time.monotonic() - start < 5 and _feeders()
    queue.close()
    queue.join_thread()
    assert not _feeders()


def test_a_mixture_is_split_among_dataloader_workers_and_resumes_in_process(tmp_path):
    from torch.utils.data import DataLoader

    a = write_dense(tmp_path / "a.slaf", random_counts(90, 20, seed=1), max_rows_per_file=301)
    b = write_dense(tmp_path / "b.slaf", random_counts(70, 20, seed=2), max_rows_per_file=301)

    def dataset():
        with Loader([a, b], batch_size=10, max_genes=8, seed=2, n_epochs=1) as loader:
            return loader.as_torch_dataset()

    def rows(batches) -> dict[tuple[int, int], np.ndarray]:
        out = {}
        for batch in batches:
            pairs = zip(batch["source"].tolist(), batch["cell_integer_id"].tolist(), strict=True)
            for j, key in enumerate(pairs):
                assert key not in out
                out[key] = batch["input_ids"][j].numpy().copy()
        return out

    with Loader([a, b], batch_size=10, max_genes=8, seed=2, n_epochs=1) as loader:
        want = rows(loader)
    assert len(want) == 160
    workers = rows(DataLoader(dataset(), num_workers=2, **WORKERS))  # each reopens the sources
    assert workers.keys() == want.keys()
    for key, ids_ in want.items():
        np.testing.assert_array_equal(workers[key], ids_)
    first = dataset()
    it = iter(first)
    head = [next(it) for _ in range(5)]
    resumed = dataset()
    resumed.load_state_dict(first.state_dict())
    both = rows([*head, *resumed])
    assert both.keys() == want.keys()
