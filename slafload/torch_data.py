"""A ``torch.utils.data.IterableDataset`` face, for code built around ``DataLoader``.

``Loader`` is the recommended interface (one producer thread, exact resume). When a training
stack insists on ``torch.utils.data.DataLoader``, ``loader.as_torch_dataset()`` returns an
``IterableDataset`` of ready batches: use ``DataLoader(ds, batch_size=None, num_workers=k,
multiprocessing_context="spawn")`` (Lance is not fork-safe). The rank's share of each epoch is
split among the ``k`` workers by parts, so every cell still comes exactly once per epoch.

Each worker process reopens the dataset (a mixture: each of its sources) at the loader's pinned
Lance versions. Every iteration advances the epoch counter of the object iterated: in-process,
and in persistent workers (``persistent_workers=True``), epochs therefore advance by
themselves. Non-persistent workers
iterate fresh copies each epoch, so, as with ``DistributedSampler``, call ``set_epoch(e)``
before each epoch; it is harmless in the other cases. As with the loader, ``n_epochs`` counts
the epochs of the whole run: iterating epoch ``n_epochs`` or later yields nothing.

Resume: the dataset has torchdata's ``state_dict``/``load_state_dict``. Under
``torchdata.stateful_dataloader.StatefulDataLoader`` every worker's copy reports, with each
batch it yields, the epoch it is in and how many cells *it* has yielded; the loader keeps the
state of the last batch the training loop received from each worker, and after
``load_state_dict`` every worker continues after exactly those cells. A state is only valid
with the same number of workers, sampler, seed and dataset size (checked).
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

from torch.utils.data import IterableDataset, get_worker_info

from slafload.config import LoaderConfig
from slafload.data.dataset import open_dataset
from slafload.data.mixture import Mixture
from slafload.errors import StateError
from slafload.pipeline import epochs
from slafload.pipeline.epochs import Delivery, Position, Run
from slafload.types import CellSource, ChunkTransform, LoaderBatch, Sampler, Tokenizer


class SlafIterableDataset(IterableDataset[LoaderBatch]):
    """Batches of one epoch per iteration, split among DataLoader workers: the loader's
    (:class:`~slafload.types.PaddedBatch`, or :class:`~slafload.types.PackedBatch` with
    ``layout="packed"``).

    Built by :meth:`slafload.Loader.as_torch_dataset`; holds only picklable settings.
    """

    def __init__(
        self,
        *,
        uri: str,
        versions: Mapping[str, Any],
        storage_options: Mapping[str, str] | None,
        sampler: Sampler,
        tokenizer: Tokenizer,
        config: LoaderConfig,
        rank: int,
        world_size: int,
        transforms: Sequence[ChunkTransform],
        obs_columns: Sequence[str],
        epoch: int = 0,
        mixture: Mixture | None = None,
    ):
        super().__init__()
        self._settings: dict[str, Any] = {
            "uri": uri,
            "versions": dict(versions),
            "storage_options": dict(storage_options) if storage_options else None,
            "sampler": sampler,
            "tokenizer": tokenizer,
            "config": config,
            "rank": rank,
            "world_size": world_size,
            "transforms": tuple(transforms),
            "obs_columns": tuple(obs_columns),
            "mixture": mixture,  # pickled as its sources' URIs and versions (Mixture.__reduce__)
        }
        self.epoch = epoch
        self._progress = (epoch, 0)  # (epoch, cells this copy has yielded in it)
        self._resume: tuple[int, int] | None = None  # set by load_state_dict
        self._run: Run | None = None  # opened lazily, in the process that iterates

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` next (call before each epoch when using workers).

        A position loaded by :meth:`load_state_dict` in that same epoch is kept.
        """
        self.epoch = int(epoch)
        if self._resume is not None and self._resume[0] != self.epoch:
            self._resume = None
        self._progress = self._resume or (self.epoch, 0)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_run": None}

    def _open(self) -> Run:
        if self._run is None:
            s = self._settings
            ds = s["mixture"] or open_dataset(
                s["uri"], version=dict(s["versions"]), storage_options=s["storage_options"]
            )
            self._run = self._run_on(ds)
        return self._run

    def _run_on(self, ds: CellSource) -> Run:
        s = self._settings
        run, _ = epochs.build_run(
            ds, s["tokenizer"], s["config"], s["sampler"], transforms=s["transforms"],
            obs_columns=s["obs_columns"], rank=s["rank"], world_size=s["world_size"],
        )  # fmt: skip
        return run

    def __iter__(self) -> Iterator[LoaderBatch]:
        # Not a generator itself: the position moves to the new epoch as soon as iteration
        # starts, so a state taken before this copy's first batch already points there.
        worker, n_workers = _worker()
        if get_worker_info() is not None:
            atexit.unregister(join_queue_feeders)  # once per worker process
            atexit.register(join_queue_feeders)
        run = self._open()
        epoch, skip = self._resume or (self.epoch, 0)
        self._resume = None
        if run.complete(Position(epoch)):  # the run is over: nothing more, as for the Loader
            self._progress = (epoch, 0)
            return iter(())
        self.epoch = epoch + 1  # in-process and persistent workers advance by themselves
        self._progress = (epoch, skip)
        return self._batches(run.epoch(epoch, skip=skip, worker=worker, n_workers=n_workers))

    def _batches(self, deliveries: Iterator[Delivery]) -> Iterator[LoaderBatch]:
        for delivery in deliveries:
            self._progress = (delivery.after.epoch, delivery.after.cells)
            yield cast(LoaderBatch, delivery.batch)
        # In-process, a finished epoch points at the next one. A worker's copy keeps pointing
        # at its finished share: StatefulDataLoader restores an exhausted worker of an epoch
        # still under way, and that worker must yield nothing more.
        if get_worker_info() is None:
            self._progress = (self.epoch, 0)

    def state_dict(self) -> dict[str, Any]:
        """This copy's position: the epoch under way and the cells it has yielded in it.

        The schema is :func:`slafload.pipeline.epochs.make_state`'s, with this worker's id and count.
        """
        worker, n_workers = _worker()
        epoch, cells = self._resume or self._progress
        return epochs.make_state(
            self._open(), Position(epoch, cells), worker=worker, n_workers=n_workers
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next iteration of this copy continue after the position in ``state``.

        The dataset is re-pinned to the Lance versions recorded in the state. Nothing changes
        if the state is refused.

        Raises:
            StateError: ``state`` is not a slafload state; was taken on another rank, world
                size or number of DataLoader workers (elastic resume is a
                :class:`~slafload.Loader` feature); was taken with settings that order the
                cells differently; or its Lance versions cannot be opened.
        """
        state = epochs.upgrade(state)
        s = self._settings
        worker, n_workers = _worker()
        keys = (epochs.RANK, epochs.WORLD_SIZE, epochs.WORKER, epochs.N_WORKERS)
        theirs = tuple(state[k] for k in keys)
        ours = (s["rank"], s["world_size"], worker, n_workers)
        if theirs != ours:
            raise StateError(
                "the state was taken by rank {} of {}, DataLoader worker {} of {}, but is being "
                "loaded into rank {} of {}, worker {} of {}; resume with the same ranks and "
                "num_workers (each worker's position counts its own cells), or use "
                "slafload.Loader for elastic resume.".format(*theirs, *ours)
            )
        current = self._open()
        versions = state[epochs.DATASET][epochs.VERSIONS]
        ds = current.spec.dataset.repin(versions)
        run = current if ds is current.spec.dataset else self._run_on(ds)
        position = epochs.read_state(state, run)
        s["versions"], self._run = dict(versions), run
        if isinstance(ds, Mixture):
            s["mixture"] = ds
        self._resume = (position.epoch, position.cells)
        self.epoch = position.epoch

    def __len__(self) -> int:
        return self._open().batches_in_epoch(self.epoch)


FEEDER_JOIN_S = 2.0  # how long a DataLoader worker's exit waits for its queue feeders


def join_queue_feeders(timeout: float = FEEDER_JOIN_S) -> None:
    """Wait (at most ``timeout`` seconds in all) for this process's multiprocessing queue
    feeder threads to end; registered with ``atexit`` in every DataLoader worker.

    When a DataLoader ends its workers with batches still in flight (the training loop broke
    out of an epoch, or dropped the iterator), torch closes each worker's result queue without
    waiting for it and the worker exits. Its queue's feeder thread, a daemon, may still be
    pickling a batch's tensors inside torch's C++ code; the interpreter's finalisation then
    ends that thread there and the worker aborts ("terminate called without an active
    exception"; the training process sees "DataLoader worker ... is killed by signal:
    Aborted"). That is torch's race: plain tensors from a bare ``IterableDataset`` reproduce it
    (docs/distributed.md). ``atexit`` handlers run before the finalisation, and a closed
    queue's feeder ends once it has written what it holds (a few short messages: the tensors
    themselves go through shared memory), so the worker waits for it here.
    """
    deadline = time.monotonic() + timeout
    for thread in threading.enumerate():
        if thread.name == "QueueFeederThread" and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


def _worker() -> tuple[int, int]:
    """This process's DataLoader worker id and worker count (``(0, 1)`` outside workers)."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)
