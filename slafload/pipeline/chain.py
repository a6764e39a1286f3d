"""The chain of stages, built in one place for every front end.

:func:`build_chain` names every stage in the order data flows through it::

    parts -> Read -> Assemble -> Shuffle -> Transform -> Split
          -> [token stage: TokenWorker -> Batches -> LayOut] -> ToTorch

The token stage's three are built by :func:`slafload.pipeline.tokenize.token_stages`, from the
one :class:`~slafload.pipeline.tokenize.TokenStage` the spec holds.

:class:`~slafload.Loader` (on its prefetch thread), the ``IterableDataset`` face and the
benchmark's stage profile all run this same function; epochs and positions are the business
of :mod:`slafload.pipeline.epochs`, which runs a rank's epochs through one chain (or, when a tokenizer
or transform depends on the epoch, one chain per epoch).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from slafload._lance.object_store import StoreOptions
from slafload.config import LoaderConfig
from slafload.kernels import Kernels
from slafload.pipeline.batcher import ToTorch
from slafload.pipeline.buffers import BytePool
from slafload.pipeline.chunk import Assemble, Shuffle, Split, Transform
from slafload.pipeline.first_read import split_first
from slafload.pipeline.partition import Part, Tagged
from slafload.pipeline.ranges import RangeSet
from slafload.pipeline.read import Read, RetryingReader
from slafload.pipeline.reader import COLUMNS, ReadOptions
from slafload.pipeline.stage import Observe, Stage, as_is
from slafload.pipeline.tokenize import TokenStage, make_token_stage, token_stages
from slafload.types import Batch, CellSource, ChunkTransform, Tokenizer


@dataclass(frozen=True, eq=False)
class ChainSpec:
    """What the chain needs besides the parts to read; immutable for a loader's lifetime.

    Attributes:
        dataset: The pinned dataset, or a :class:`~slafload.data.mixture.Mixture` of several
            (a :class:`~slafload.types.CellSource`: the same reader, offsets and size).
        tokenizer: Turns ranked pieces into arrays.
        config: Loader settings (read, piece and batch sizes, retries, read-ahead).
        transforms: Chunk transforms run before ranking, in order.
        obs: Obs column name to ``int64`` code per cell, added to every batch.
        pin_memory: Pin each batch's tensors on the producer thread.
        checked: Cells whose rows the loader's chains have checked against
            ``cell_start_index`` (``Tuning.check_rows``); kept by the spec, so the
            chains of later epochs read them without ``cell_integer_id``.
    """

    dataset: CellSource
    tokenizer: Tokenizer
    config: LoaderConfig
    transforms: tuple[ChunkTransform, ...] = ()
    obs: Mapping[str, Any] = field(default_factory=dict)  # int64 codes indexable by cell id
    pin_memory: bool = False
    checked: RangeSet = field(default_factory=RangeSet)

    @cached_property
    def tokens(self) -> TokenStage:
        """Ranking, tokenizing and layout, as ``config.layout`` and ``tokenize_on`` ask."""
        return make_token_stage(self.tokenizer, self.config, self.kernels)

    @cached_property
    def kernels(self) -> Kernels:
        """The compiled kernels (``config.kernels``) of the token stage and the reader."""
        return Kernels(self.config.kernels)

    def for_epoch(self, epoch: int) -> ChainSpec:
        """This spec with its epoch-aware tokenizer and transforms bound to ``epoch``.

        A transform or tokenizer with a ``for_epoch(epoch)`` method (e.g. one drawing random
        numbers keyed by ``(seed, epoch, cell)``, as scGPT's presets do) is replaced by what it
        returns; the others are kept. Stages themselves never learn the epoch.
        """
        tokenizer = _bind_epoch(self.tokenizer, epoch)
        transforms = tuple(_bind_epoch(t, epoch) for t in self.transforms)
        if tokenizer is self.tokenizer and all(
            a is b for a, b in zip(transforms, self.transforms, strict=True)
        ):
            return self
        return dataclasses.replace(self, tokenizer=tokenizer, transforms=transforms)


def _bind_epoch(stage: Any, epoch: int) -> Any:
    """``stage.for_epoch(epoch)`` for an epoch-aware tokenizer or transform, else ``stage``."""
    bind = getattr(stage, "for_epoch", None)
    return stage if bind is None else bind(epoch)


def build_chain(
    spec: ChainSpec,
    parts: Iterator[Part],
    *,
    sleep: Callable[[float], object] = time.sleep,
    observe: Observe = as_is,
) -> Stage[Tagged[Batch]]:
    """The stages that turn ``parts`` (a rank's share of one or more epochs) into torch batches,
    each beside its epoch leg and the leg's cells done after it (:class:`Tagged`).

    Args:
        spec: Dataset, tokenizer, settings.
        parts: The parts to deliver, in order (:meth:`slafload.pipeline.partition.RankShare.parts`),
            tagged with the epoch leg each belongs to (no batch spans two legs); untagged
            parts are one epoch.
        sleep: Waits between read retries; the prefetcher passes one that a stop request
            interrupts.
        observe: Called with each stage's name as it is built; returns the stage to use.
    """
    cfg, ds = spec.config, spec.dataset
    tuning = cfg.tuning
    lance_reader = ds.reader(
        ReadOptions(
            batch_rows=tuning.batch_rows,
            direct=False if tuning.reader == "lance" else None,
            threads=tuning.read_threads,
            kernels=spec.kernels,
            pool=BytePool(keep=tuning.memory_budget // 2),  # flat reads' buffers, in the budget
            store=StoreOptions(
                gap=tuning.range_gap, in_flight=tuning.requests_in_flight, retry=tuning.retry
            ),
        )
    )
    reader = RetryingReader(lance_reader, tuning.retry, uri=ds.uri, sleep=sleep)
    checked = spec.checked if tuning.check_rows == "once" else None
    # The run's first part is read as its first few output cells, then the rest: the first
    # batch waits for a handful of cells, not a whole fetch (same cells, same order).
    parts = split_first(parts, max(tuning.first_read_cells, cfg.batch_size))
    read = Read(
        parts,
        reader,
        ds.cell_start,
        row_bytes=ds.row_bytes(COLUMNS),
        read_ahead=tuning.read_ahead,
        memory_budget=tuning.memory_budget,
        checked=checked,
    )
    s: Stage[Any] = observe("read", read)
    s = observe("assemble", Assemble(s, ds, checked))
    s = observe("shuffle", Shuffle(s))
    s = observe("transform", Transform(s, spec.transforms))
    s = observe("split", Split(s, tuning.piece_cells))
    s = token_stages(
        s, spec.tokens, obs=spec.obs, batch_size=cfg.batch_size, drop_last=cfg.drop_last,
        kernels=spec.kernels, observe=observe,
    )  # fmt: skip
    return observe("to_torch", ToTorch(s, pin_memory=spec.pin_memory))
