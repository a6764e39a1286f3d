"""The producer: every stage of the pipeline, run once per fetch on the prefetch thread.

``Pipeline.run`` reads like the data flow: plan an epoch, then for each fetch read its rows,
assemble a chunk of whole cells, shuffle it, rank genes, tokenize, and cut batches. It holds
no reference to the :class:`~slafload.loader.Loader`, so a loader dropped mid-epoch can be
garbage-collected and stop its thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from slafload import budget
from slafload.batcher import Batcher
from slafload.chunk import Chunk, assemble, shuffle, split
from slafload.config import LoaderConfig
from slafload.dataset import SlafDataset
from slafload.first_read import split_first
from slafload.rank import PendingRank, start_rank
from slafload.reader import COLUMNS, MAX_GAP_ROWS, Reader
from slafload.retry import PendingRead, RetryingReader
from slafload.samplers import Fetch, Sampler
from slafload.shard import Part, RankStream, Segment, rank_stream
from slafload.tokenizers import Tokenizer

Batch = dict[str, torch.Tensor]
ChunkTransform = Callable[[Chunk], Chunk]


@dataclass(frozen=True)
class Position:
    """Where the consumer is in ``epoch``: it holds the first ``cells`` cells of its rank's
    stream in the current segment, after the completed (elastic-resume) ``history``."""

    epoch: int = 0
    cells: int = 0
    history: tuple[Segment, ...] = ()


@dataclass(frozen=True, eq=False)
class Delivery:
    """A batch on its way to the consumer, and the position reached once it is consumed.

    The last batch of an epoch carries ``Position(epoch + 1, 0)``.
    """

    batch: Batch
    after: Position


@dataclass(eq=False)
class _Read:
    """A part on its way in: its read groups, the bytes charged, the group being read."""

    part: Part
    groups: list[Fetch]
    cost: int
    pending: PendingRead | None = None


@dataclass(frozen=True, eq=False)
class Pipeline:
    """Everything the producer needs, immutable for the loader's lifetime.

    ``transforms`` run on each shuffled chunk before ranking (e.g. value normalisation); each
    takes and returns a :class:`~slafload.chunk.Chunk` and must keep its cells. ``obs`` maps
    obs column names to per-cell ``int64`` codes added to every batch.
    """

    dataset: SlafDataset
    sampler: Sampler
    tokenizer: Tokenizer
    config: LoaderConfig
    pin_memory: bool = False
    rank: int = 0
    world_size: int = 1
    transforms: tuple[ChunkTransform, ...] = ()
    obs: Mapping[str, np.ndarray] | None = None  # obs column -> int64 code per cell

    def run(
        self,
        start: Position,
        worker: int = 0,
        n_workers: int = 1,
        stop: threading.Event | None = None,
    ) -> Iterator[Delivery]:
        """Deliver ``config.n_epochs`` epochs (or forever) starting at ``start``.

        With ``n_workers > 1`` (DataLoader workers) this worker takes every ``n_workers``-th
        part of the rank's stream; positions are then only meaningful per worker. A set
        ``stop`` event ends the run between stages, so shutdown never waits for a whole chunk.
        """
        cfg = self.config
        epochs = (
            itertools.count(start.epoch)
            if cfg.n_epochs is None
            else range(start.epoch, start.epoch + cfg.n_epochs)
        )
        position = start
        for epoch in epochs:
            last = None
            deliveries = self.epoch(
                epoch, position.history, position.cells, worker, n_workers, stop=stop
            )
            for delivery in deliveries:
                if last is not None:
                    yield last
                last = delivery
            if stop is not None and stop.is_set():
                return
            if last is not None:  # one batch of lookahead marks the end of the epoch
                yield Delivery(last.batch, Position(epoch + 1))
            position = Position(epoch + 1)

    def stream(self, epoch: int, history: tuple[Segment, ...] = ()) -> RankStream:
        """This rank's share of ``epoch`` after the completed segments ``history``."""
        plan = self.sampler.plan(self.dataset.n_cells, seed=self.config.seed, epoch=epoch)
        return rank_stream(plan, history, self.rank, self.world_size)

    def epoch(
        self,
        epoch: int,
        history: tuple[Segment, ...] = (),
        skip: int = 0,
        worker: int = 0,
        n_workers: int = 1,
        stop: threading.Event | None = None,
    ) -> Iterator[Delivery]:
        """One epoch's batches for this rank, leaving out its first ``skip`` cells."""
        cfg = self.config
        stopped = stop.is_set if stop is not None else (lambda: False)
        reader = RetryingReader(
            Reader(self.dataset, batch_rows=cfg.read_batch_rows, direct=cfg.read_data_files),
            cfg.retry,
            uri=self.dataset.uri,
            sleep=stop.wait if stop is not None else time.sleep,  # a backoff ends on close()
        )
        batcher = Batcher(cfg.batch_size, drop_last=cfg.drop_last)
        done = skip

        def deliver(batches: Iterator[dict[str, np.ndarray]]) -> Iterator[Delivery]:
            nonlocal done
            for batch in batches:
                done += len(batch["cell_integer_id"])
                yield Delivery(self.to_torch(batch), Position(epoch, done, history))

        # One chunk of lookahead: Polars ranks chunk i+1 on its own threads while this thread
        # tokenizes chunk i with numpy, so both cores work.
        pending: PendingRank | None = None
        first = True
        pieces = self.pieces(self.stream(epoch, history).parts(skip, worker, n_workers), reader)
        try:
            while True:
                try:
                    piece = next(pieces, None)
                except Exception:
                    if pending is not None:  # hand over what was read before failing
                        last, pending = pending, None
                        yield from deliver(batcher.add(self.tokenize(last)))
                    raise
                if piece is None or stopped():
                    break
                previous, pending = pending, start_rank(piece)
                if first:  # the run's first piece goes out before the next is read
                    first, previous, pending = False, pending, None
                if previous is not None:
                    yield from deliver(batcher.add(self.tokenize(previous)))
                    if stopped():
                        return
            if stopped():
                return
            if pending is not None:
                last, pending = pending, None
                yield from deliver(batcher.add(self.tokenize(last)))
            yield from deliver(batcher.finish())
        finally:
            pieces.close()
            if pending is not None:  # stopped, failed or closed with a ranking in flight
                pending.discard()

    def pieces(self, parts: Iterator[Part], reader: RetryingReader) -> Iterator[Chunk]:
        """Read, check and shuffle each part's fetch; cut it into compute pieces in order.

        A fetch is the unit of I/O and of shuffling; a piece (at most ``chunk_cells`` cells,
        already in output order) is the unit of ranking and tokenizing, which keeps the token
        arrays small however large a sampler's fetches are.
        """
        # Read-ahead: the next fetches are started before this one is computed, so Lance decodes
        # them on its own threads meanwhile (scattered block reads cost about as much as the
        # compute; see docs/sampling.md).
        # A failure to plan a later part is raised only when that part's turn comes, after
        # every batch of the fetches before it.
        # Read-ahead is bounded by LoaderConfig.memory_budget (bytes, see slafload/budget.py);
        # a fetch too large for half the budget is read in groups of consecutive ranges.
        cfg, cell_start = self.config, self.dataset.cell_start
        width = budget.row_bytes(self.dataset.expression.schema, COLUMNS)
        n_genes = self.dataset.n_genes
        parts = iter(split_first(parts, max(cfg.first_read_cells, cfg.batch_size)))
        ahead: deque[_Read] = deque()
        first = True
        failure: Exception | None = None
        peeked: Part | None = None
        exhausted = False

        def plan(part: Part) -> _Read:
            cost = budget.cost(part.fetch, cell_start, width, MAX_GAP_ROWS)
            if cost <= cfg.memory_budget // 2:
                return _Read(part, [part.fetch], cost)
            groups = budget.groups(part.fetch, cell_start, width, cfg.memory_budget // 4,
                                   MAX_GAP_ROWS)  # fmt: skip
            return _Read(part, groups, cfg.memory_budget // 4)

        def start_until(n: int, holding: int = 0) -> None:
            """Start reads until ``n`` are in flight or the next does not fit the budget."""
            nonlocal failure, peeked, exhausted
            while failure is None and not exhausted and len(ahead) < n:
                if peeked is None:
                    try:
                        peeked = next(parts, None)
                    except Exception as exc:
                        failure = exc
                        return
                    if peeked is None:
                        exhausted = True
                        return
                read = plan(peeked)
                held = holding + sum(r.cost for r in ahead)
                if not budget.fits(held, read.cost, cfg.memory_budget):
                    return
                read.pending = reader.start(read.groups[0])
                ahead.append(read)
                peeked = None

        while True:
            start_until(1)
            if not ahead:
                if failure is not None:
                    raise failure
                return
            read = ahead[0]
            chunks = []
            for k, group in enumerate(read.groups):
                batches = read.pending.result()
                if k + 1 < len(read.groups):  # decoded by Lance while this group is checked
                    read.pending = reader.start(read.groups[k + 1])
                else:
                    ahead.popleft()
                    if not first:  # the run's first read is handed on before reading ahead
                        start_until(cfg.read_ahead, holding=read.cost)
                chunks.append(
                    assemble(group, batches, cell_start, uri=self.dataset.uri, n_genes=n_genes)
                )
                del batches
            part = read.part
            chunk = budget.concat(part.fetch.index, chunks)
            del chunks, read
            if part.order is None:
                chunk = shuffle(chunk, part.fetch.shuffle_seed)
            else:
                chunk = dataclasses.replace(chunk, order=part.order)
            for transform in self.transforms:
                chunk = transform(chunk)
            yield from split(chunk, part.skip, part.keep, cfg.chunk_cells)
            first = False

    def tokenize(self, ranking: PendingRank) -> dict[str, np.ndarray]:
        """The token arrays of a ranked piece, plus cell ids and requested obs codes."""
        ranked = ranking.result()
        arrays = dict(self.tokenizer(ranked))
        arrays["cell_integer_id"] = ranked.output_cell_ids
        for name, codes in (self.obs or {}).items():
            arrays[name] = codes[ranked.output_cell_ids]
        return arrays

    def to_torch(self, arrays: Mapping[str, np.ndarray]) -> Batch:
        batch = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
        if self.pin_memory:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch
