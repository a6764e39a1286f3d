"""Epochs, positions and resume: the one module that knows them, for every front end.

A *run* is ``n_epochs`` epochs (``None``: endless) of one rank. :class:`Run` plans each epoch
(sampler, then partition among ranks), builds the chain of stages for it
(:func:`slafload.pipeline.chain.build_chain`) and labels every batch with the :class:`Position` the
consumer reaches once it holds that batch. Positions are computed, never replayed: a position
is ``(epoch, cells consumed in it, completed segments)``, and which cells those were is
arithmetic on ``(seed, epoch, rank, world_size)``, so a run resumes exactly, on the same or
(elastic resume) another number of ranks.

:func:`build_run` builds a front end's run from its settings: the one place a
:class:`~slafload.pipeline.chain.ChainSpec` and a :class:`Run` are made, for the loader, its
DataLoader face and the benchmark's stage profile alike.

The resume state has one schema (:data:`STATE_FORMAT`, version :data:`STATE_VERSION`),
written by :func:`make_state` and read by :func:`read_state` for both
:class:`~slafload.Loader` and the ``IterableDataset`` face.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from slafload.config import LoaderConfig
from slafload.errors import LoaderError, StateError
from slafload.pipeline.chain import ChainSpec, build_chain
from slafload.pipeline.partition import Leg, Part, RankShare, Segment, rank_share
from slafload.samplers.base import bind_batch_size
from slafload.types import Batch, CellSource, ChunkTransform, Sampler, Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Position:
    """Where the consumer is in ``epoch``: it holds the first ``cells`` cells of its rank's
    share in the current segment, after the completed (elastic-resume) ``history``.
    """

    epoch: int = 0
    cells: int = 0
    history: tuple[Segment, ...] = ()


@dataclass(frozen=True, eq=False)
class Delivery:
    """A batch on its way to the consumer, and the position reached once it is consumed.

    The last batch of an epoch carries ``Position(epoch + 1)``.
    """

    batch: Batch
    after: Position


class Run:
    """The epochs of one rank's run: plans, shares, positions and the chain of each epoch.

    Args:
        spec: What the chain needs (dataset, tokenizer, settings).
        sampler: Plans each epoch.
        rank: This process's distributed rank.
        world_size: Number of ranks.
    """

    def __init__(self, spec: ChainSpec, sampler: Sampler, *, rank: int = 0, world_size: int = 1):
        self.spec, self.sampler = spec, sampler
        self.rank, self.world_size = rank, world_size

    @property
    def n_epochs(self) -> int | None:
        """Epochs of the run, counted from epoch 0; ``None``: endless."""
        return self.spec.config.n_epochs

    def complete(self, position: Position) -> bool:
        """Whether the run has nothing left after ``position``."""
        return self.n_epochs is not None and position.epoch >= self.n_epochs

    def share(self, epoch: int, history: tuple[Segment, ...] = ()) -> RankShare:
        """This rank's share of ``epoch`` after the completed segments ``history``."""
        cfg = self.spec.config
        plan = self.sampler.plan(self.spec.dataset.n_cells, seed=cfg.seed, epoch=epoch)
        return rank_share(plan, history, self.rank, self.world_size)

    def batches_in_epoch(self, epoch: int = 0) -> int:
        """Batches this rank yields in a full epoch (the same on every rank)."""
        n, cfg = self.share(epoch).quota, self.spec.config
        return n // cfg.batch_size if cfg.drop_last else -(-n // cfg.batch_size)

    def epoch(
        self,
        epoch: int,
        history: tuple[Segment, ...] = (),
        skip: int = 0,
        *,
        worker: int = 0,
        n_workers: int = 1,
        sleep: Callable[[float], object] = time.sleep,
    ) -> Generator[Delivery, None, None]:
        """One epoch's batches for this rank, leaving out its first ``skip`` cells.

        With ``n_workers > 1`` (DataLoader workers) this worker takes every ``n_workers``-th
        part of the rank's share; ``skip`` and the positions then count this worker's cells.
        Every batch, the last one included, carries its position inside ``epoch``.
        """
        span = _Span(self, Position(epoch, skip, history), epoch + 1, worker, n_workers)
        yield from self._deliver(span, sleep, roll_over=False)

    def run(
        self, start: Position, *, sleep: Callable[[float], object] = time.sleep
    ) -> Iterator[Delivery]:
        """The rest of the run from ``start``, up to the end of epoch ``n_epochs - 1``.

        A run resumed in epoch ``e`` delivers the rest of ``e`` and the epochs after it, so
        the batches before and after a checkpoint add up to the uninterrupted run; a complete
        run delivers nothing. The last batch of an epoch carries ``Position(epoch + 1)``.

        Epochs follow each other through one chain of stages whenever nothing in the chain
        depends on the epoch (no epoch-aware tokenizer or transform, see
        :meth:`ChainSpec.for_epoch`): the next epoch's reads start while this one's last
        cells are still being tokenized, so an epoch boundary costs no pipeline refill. An
        epoch-aware chain is rebuilt for every epoch.
        """
        position = start
        while not self.complete(position):
            span = _Span(self, position, self.n_epochs)
            yield from self._deliver(span, sleep, roll_over=True)
            assert span.end is not None and span.end > position.epoch
            position = Position(span.end)

    def _deliver(
        self, span: _Span, sleep: Callable[[float], object], *, roll_over: bool
    ) -> Iterator[Delivery]:
        """Every batch of ``span``'s chain with its position, computed from the leg the batch
        carries and the leg's cells done after it (the batch stage ends each leg, so no batch
        spans two). With ``roll_over`` a leg's last batch carries the start of the next epoch.
        """
        spec = self.spec.for_epoch(span.start.epoch)
        chain = build_chain(spec, span.parts(), sleep=sleep)
        last: tuple[Leg | None, int] = (None, 0)  # the last batch's leg and cells done
        with closing(chain):
            for batch in chain:
                leg = batch.leg
                assert leg is not None  # the span tags every part
                last, ends = (leg, batch.done), batch.done == leg.cells
                if ends:
                    span.unfinished.remove(leg)
                if roll_over and ends:
                    after = Position(leg.epoch + 1)
                else:
                    after = Position(leg.epoch, leg.skip + batch.done, leg.history)
                yield Delivery(batch.item, after)
        for leg in span.unfinished:  # the batch stage checks every leg but those that vanish
            left = leg.cells - (last[1] if last[0] is leg else 0)
            raise LoaderError(
                f"epoch {leg.epoch} ended {left} cells short of its plan; the stages lost cells"
            )


def build_run(
    dataset: CellSource,
    tokenizer: Tokenizer,
    config: LoaderConfig,
    sampler: Sampler,
    *,
    transforms: Sequence[ChunkTransform] = (),
    obs_columns: Sequence[str] = (),
    pin_memory: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[Run, dict[str, list[Any] | None]]:
    """The run of one rank over ``dataset``, and the category table of each obs column:
    the one place its :class:`ChainSpec` and :class:`Run` are built, for every front end
    (the :class:`~slafload.Loader`, its DataLoader face, the benchmark's stage profile).

    ``sampler`` plans for ``config.batch_size``; the source adds what it needs (a mixture:
    its own sampler over the sources', its per-source transform before ``transforms``, its
    ``source`` and per-source ``cell_integer_id`` columns after ``obs_columns``).
    """
    codes = {name: dataset.obs_codes(name) for name in obs_columns}
    obs = {name: column for name, (column, _) in codes.items()}
    obs.update(dataset.cell_columns())
    batch_size = config.batch_size
    sampler = dataset.sampler(
        bind_batch_size(sampler, batch_size),
        lambda s: bind_batch_size(s, batch_size),
        batch_size,
        config.tuning.memory_budget,
    )
    first = () if dataset.transform is None else (dataset.transform,)
    spec = ChainSpec(
        dataset,
        tokenizer,
        config,
        transforms=(*first, *transforms),
        obs=obs,
        pin_memory=pin_memory,
    )
    run = Run(spec, sampler, rank=rank, world_size=world_size)
    return run, {name: categories for name, (_, categories) in codes.items()}


class _Span:
    """Consecutive epochs served by one chain, planned lazily and in order.

    The chain's read stage pulls :meth:`parts`, which plans each epoch as it comes to it and
    tags its parts with the epoch's :class:`~slafload.pipeline.partition.Leg`, the last part
    ending it; the batch stage ends each epoch there, and every batch carries its leg to the
    positions. The span stops before ``stop`` (``None``: never) and before any later epoch
    whose chain would differ (an epoch-aware tokenizer or transform); :attr:`end` is then the
    first epoch not served. :attr:`unfinished` holds the legs planned with cells and not yet
    delivered whole, for the final check that no epoch lost cells.
    """

    def __init__(
        self, run: Run, start: Position, stop: int | None, worker: int = 0, n_workers: int = 1
    ):
        self.run, self.start, self.stop = run, start, stop
        self.worker, self.n_workers = worker, n_workers
        self.unfinished: list[Leg] = []
        self.end: int | None = None

    def parts(self) -> Iterator[Part]:
        """The parts of every epoch of the span, in order, tagged with their legs."""
        run, cfg = self.run, self.run.spec.config
        epoch, history, skip = self.start.epoch, self.start.history, self.start.cells
        while self.stop is None or epoch < self.stop:
            if epoch > self.start.epoch and run.spec.for_epoch(epoch) is not run.spec:
                break
            share = run.share(epoch, history)
            rows = share.cells(skip, self.worker, self.n_workers)
            kept = rows - rows % cfg.batch_size if cfg.drop_last else rows
            leg = Leg(epoch, history, skip, rows, kept)
            if kept:
                self.unfinished.append(leg)
            yield from share.parts(skip, self.worker, self.n_workers, leg)
            epoch, history, skip = epoch + 1, (), 0
        self.end = epoch


# -- the resume state ----------------------------------------------------------------------

STATE_FORMAT = "slafload.state"
STATE_VERSION = 2
FORMAT, VERSION, DATASET, URI, VERSIONS = "format", "version", "dataset", "uri", "versions"
ORDER, FINGERPRINT, EPOCH, SEGMENTS = "order", "fingerprint", "epoch", "segments"
RANK, WORLD_SIZE, WORKER, N_WORKERS, BATCH_SIZE = (
    "rank",
    "world_size",
    "worker",
    "n_workers",
    "batch_size",
)
_V1_FORMATS = ("slafload.loader.v1", "slafload.torch_dataset.v1")


def cell_order(sampler: Sampler, seed: int, n_cells: int) -> dict[str, Any]:
    """The settings that decide which cells come in which order.

    A sampler with an ``order_settings()`` method (a mixture's: its sources and weights) adds
    them by name, so a refused state names what changed.
    """
    extra = getattr(sampler, "order_settings", None)
    order = {"sampler": repr(sampler), "seed": seed, "n_cells": n_cells}
    return order if extra is None else {**order, **extra()}


def fingerprint(order: Mapping[str, Any]) -> str:
    """A short hash of :func:`cell_order`'s settings."""
    return hashlib.sha256(json.dumps(order, sort_keys=True).encode()).hexdigest()[:16]


def make_state(
    run: Run, position: Position, *, worker: int = 0, n_workers: int = 1
) -> dict[str, Any]:
    """The JSON-serializable state of ``run`` at ``position``.

    ``segments`` lists ``[world_size, cells]`` per segment of the epoch, the current one
    last. With ``n_workers > 1`` (a DataLoader worker's state) the cells count that worker's.
    """
    ds, cfg = run.spec.dataset, run.spec.config
    order = cell_order(run.sampler, cfg.seed, ds.n_cells)
    segments = [[s.world_size, s.cells] for s in position.history]
    segments.append([run.world_size, position.cells])
    return {
        FORMAT: STATE_FORMAT,
        VERSION: STATE_VERSION,
        DATASET: {URI: ds.uri, VERSIONS: dict(ds.versions)},
        ORDER: order,
        FINGERPRINT: fingerprint(order),
        EPOCH: position.epoch,
        SEGMENTS: segments,
        RANK: run.rank,
        WORLD_SIZE: run.world_size,
        WORKER: worker,
        N_WORKERS: n_workers,
        BATCH_SIZE: cfg.batch_size,
    }


def upgrade(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` in the current schema (0.1's two formats are converted).

    Raises:
        StateError: ``state`` is not a slafload state.
    """
    if not isinstance(state, Mapping):
        raise StateError(f"not a slafload state (expected a mapping, got {type(state).__name__})")
    fmt = state.get(FORMAT)
    if fmt == STATE_FORMAT:
        if state.get(VERSION) != STATE_VERSION:
            raise StateError(
                f"slafload state version {state.get(VERSION)!r} is not supported by this "
                f"slafload (it reads version {STATE_VERSION} and 0.1's states)"
            )
        return dict(state)
    if fmt not in _V1_FORMATS:
        raise StateError(f"not a slafload state (expected format {STATE_FORMAT!r})")
    old = dict(state)
    if fmt == "slafload.torch_dataset.v1":
        segments = [[old[WORLD_SIZE], old["cells"]]]
        dataset = {URI: None, VERSIONS: old[VERSIONS]}
    else:
        segments, dataset = old[SEGMENTS], old[DATASET]
    return {
        **old,
        FORMAT: STATE_FORMAT,
        VERSION: STATE_VERSION,
        DATASET: dataset,
        SEGMENTS: segments,
        WORKER: old.get(WORKER, 0),
        N_WORKERS: old.get(N_WORKERS, 1),
    }


def read_state(state: Mapping[str, Any], run: Run, *, replan: bool = False) -> Position:
    """The position ``state`` resumes ``run`` at (on this run's number of ranks).

    ``run`` must already be pinned to the state's Lance versions (``CellSource.repin``). With
    ``replan``, a state that orders cells differently (e.g. a mixture with a source added or a
    weight changed) is accepted: the run starts the next epoch not yet begun under its own
    plan, and the rest of a partly consumed epoch is left out.

    Raises:
        StateError: ``state`` orders cells differently (sampler, seed, dataset size, a
            mixture's sources or weights) and ``replan`` is false.
    """
    cfg, ds = run.spec.config, run.spec.dataset
    ours = cell_order(run.sampler, cfg.seed, ds.n_cells)
    if state.get(FINGERPRINT) != fingerprint(ours):
        theirs = state.get(ORDER) or {}
        keys = dict.fromkeys([*ours, *theirs])
        differ = {k: (theirs.get(k), ours.get(k)) for k in keys if theirs.get(k) != ours.get(k)}
        if not replan:
            raise StateError(
                "this loader would deliver cells in a different order than the one that "
                f"wrote the state; differing settings (checkpoint, loader): {differ}. "
                "Construct the loader with the checkpoint's settings (sampler, seed, a "
                "mixture's sources and weights), or load the state with replan=True to start "
                "the next epoch under this loader's plan."
            )
        started = any(int(cells) for _, cells in state[SEGMENTS])
        epoch = int(state[EPOCH]) + started
        logger.warning(
            "re-planning: the state's cell order differs (%s); continuing at the start of "
            "epoch %d%s",
            differ,
            epoch,
            f", leaving out the rest of epoch {epoch - 1}" if started else "",
        )
        return Position(epoch)
    segments = [Segment(int(w), int(c)) for w, c in state[SEGMENTS]]
    last = segments[-1]
    if last.world_size == run.world_size:
        return Position(int(state[EPOCH]), last.cells, tuple(segments[:-1]))
    # elastic: the other ranks' share of the old run is arithmetic; start a new segment
    return Position(int(state[EPOCH]), 0, tuple(segments))
