"""The token stage: ranking, tokenizing, batching and layout of every piece, in one place.

A loader's token work is one :class:`TokenStage`, picked by :func:`make_token_stage` from the
loader's config (on the host, :class:`HostTokens`; on the training device,
:class:`~slafload.pipeline.device_tokenize.DeviceTokens`), and it is entered once on each side:

- on the producer, :func:`token_stages` builds the chain's token work from it, three stages
  named as the benchmark's stage profile names them: ``rank`` (:class:`TokenWorker`:
  :meth:`TokenStage.rows` of each piece with ``cell_integer_id`` and obs codes beside them,
  :func:`with_obs`, a piece ahead a thread, on threads of its own), ``batch``
  (:class:`~slafload.pipeline.batcher.Batches`) and ``layout`` (:class:`LayOut`:
  :meth:`TokenStage.finish` of each batch, in the loader's layout, :mod:`slafload.pipeline.layout`);
- on the consumer, :meth:`TokenStage.consume` is the last step of every batch: a move to the
  device, and for :mod:`slafload.pipeline.device_tokenize` the tokenizing itself.

Every piece and batch keeps its tag (:class:`~slafload.pipeline.partition.Tagged`) through
these stages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from slafload.config import LoaderConfig
from slafload.kernels import NUMPY, Kernels
from slafload.pipeline.batcher import Batches
from slafload.pipeline.buffers import RowBuffers
from slafload.pipeline.chunk import Cut, gathered
from slafload.pipeline.layout import (
    Arrays,
    Layout,
    check_value_tokens,
    layout_for,
    make_layout,
)
from slafload.pipeline.partition import Tagged
from slafload.pipeline.ragged import _builtin, ragged_tokens
from slafload.pipeline.ranking import in_gene_order, rank
from slafload.pipeline.stage import Observe, Stage, as_is
from slafload.types import Chunk, RankedChunk, Tokenizer


class TokenStage(Protocol):
    """A loader's token work: two producer steps and the consumer's last step."""

    def rows(self, piece: Chunk) -> tuple[Arrays, np.ndarray]:
        """A piece's token rows and their output cell ids (on the token worker)."""

    def finish(self, batch: Arrays) -> dict[str, np.ndarray]:
        """One batch's rows as its output numpy arrays (on the producer)."""

    def consume(
        self, batch: Mapping[str, torch.Tensor], device: torch.device | None, non_blocking: bool
    ) -> dict[str, torch.Tensor]:
        """The consumer's last step: the batch's tensors, on ``device``."""


def token_stages(
    pieces: Iterator[Tagged[Chunk | Cut]],
    tokens: TokenStage,
    *,
    obs: Mapping[str, Any],
    batch_size: int,
    drop_last: bool,
    kernels: Kernels = NUMPY,
    observe: Observe = as_is,
) -> Stage[Tagged[dict[str, np.ndarray]]]:
    """The producer's token work on ``pieces``: rank (with cell ids and obs codes) -> batch -> layout.

    Args:
        pieces: Tagged pieces (:class:`~slafload.pipeline.chunk.Split`), each gathered
            (:class:`~slafload.pipeline.chunk.Cut`) before its work, on the token worker or,
            while that is busy, on the producer (:class:`TokenWorker`'s ``prepare``).
        tokens: The loader's token stage.
        obs: Obs column name to ``int64`` code per cell id (see :func:`with_obs`).
        batch_size: Rows per batch.
        drop_last: Drop each epoch's short last batch.
        kernels: The chain's compiled kernels; the layout stage closes them.
        observe: Called with each stage's name as it is built; returns the stage to use.
    """

    def gather(piece: Chunk | Cut) -> Chunk:
        return gathered(piece, kernels)

    def work(piece: Chunk | Cut) -> Arrays:
        return with_obs(*tokens.rows(gather(piece)), obs)

    # As many pieces ahead as workers: each has its next piece while the producer cuts the
    # finished one into batches (docs/benchmarks.md, "How many of the 2 cores").
    workers = getattr(tokens, "workers", 1)
    s: Stage[Any] = observe(
        "rank", TokenWorker(pieces, work, lookahead=workers, prepare=gather, workers=workers)
    )
    s = observe("batch", Batches(s, batch_size, drop_last=drop_last))
    return observe("layout", LayOut(s, tokens.finish, kernels))


@dataclass(frozen=True, eq=False)
class HostTokens:
    """Rank and tokenize with numpy, on the token worker (:class:`TokenWorker`; Polars'
    threads rank float64 values).

    The built-in tokenizers write padded rows into arrays reused from piece to piece once the
    consumer has released every batch viewing them (:mod:`slafload.pipeline.buffers`), and run their
    per-cell loops through ``kernels`` (:mod:`slafload.kernels`).
    """

    tokenizer: Tokenizer
    layout: Layout
    buffers: RowBuffers = field(default_factory=RowBuffers)
    kernels: Kernels = NUMPY

    @property
    def workers(self) -> int:
        """Pieces the token worker may work on at once: two for a built-in tokenizer, whose
        work is a function of its piece (per-thread scratch, locked buffers, compiled loops
        that release the GIL), so the token work of a piece-bound output uses both cores;
        one for any other, which may not expect calls from two threads.
        """
        return 1 if _builtin(self.tokenizer) is None else 2

    def rows(self, piece: Chunk) -> tuple[Arrays, np.ndarray]:
        """Rank and tokenize ``piece``; a tokenizer reading no rank (``ranks_genes = False``)
        gets its genes in the chunk's own ascending order, unsorted.
        """
        ranks = getattr(self.tokenizer, "ranks_genes", True)
        return self.tokenize(rank(piece, self.kernels) if ranks else in_gene_order(piece))

    def tokenize(self, ranked: RankedChunk) -> tuple[Arrays, np.ndarray]:
        """The token rows of a ranked piece, in the layout's dtype and piece form."""
        dtype = self.layout.token_dtype
        if self.layout.ragged:
            arrays = self.layout.piece(ragged_tokens(self.tokenizer, ranked, dtype, self.kernels))
        else:
            if _builtin(self.tokenizer) is not None:
                builtin: Any = self.tokenizer  # takes the per-loader buffers and kernels
                arrays = dict(builtin(ranked, buffers=self.buffers, kernels=self.kernels))
            else:
                arrays = dict(self.tokenizer(ranked))
            if dtype != np.int64:
                arrays = {k: _narrow(v, dtype) for k, v in arrays.items()}
            arrays = self.layout.piece(arrays)
        return arrays, ranked.output_cell_ids

    def finish(self, batch: Arrays) -> dict[str, np.ndarray]:
        """One batch's rows as the layout's output arrays."""
        return self.layout.finish(batch)

    def consume(
        self, batch: Mapping[str, torch.Tensor], device: torch.device | None, non_blocking: bool
    ) -> dict[str, torch.Tensor]:
        """Move the batch's tensors to ``device`` (no copy on the CPU)."""
        if device is None or device.type == "cpu":
            return dict(batch)
        return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}


def _narrow(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Token rows (2-D ``int64``) in ``dtype``; per-cell arrays unchanged."""
    return array.astype(dtype) if array.ndim == 2 and array.dtype == np.int64 else array


def make_token_stage(tokenizer: Tokenizer, config: LoaderConfig, kernels: Kernels) -> TokenStage:
    """The token stage ``config.tokenize_on`` and ``config.layout`` ask for, its per-cell
    loops run through ``kernels`` (whose owner closes them).
    """
    layout = layout_for(tokenizer, make_layout(config.layout, config.token_dtype))
    check_value_tokens(tokenizer, layout.token_dtype)
    if config.tokenize_on == "device":
        from slafload.pipeline.device_tokenize import DeviceTokens

        return DeviceTokens(tokenizer, layout)
    return HostTokens(
        tokenizer,
        layout,
        RowBuffers(rows=config.tuning.piece_cells),
        kernels,
    )


class TokenWorker(Stage[Tagged[Any]]):
    """Does each piece's token work (``work``: :meth:`TokenStage.rows`) ``lookahead`` pieces
    ahead, on ``workers`` threads of its own (pieces at once).

    The worker threads are owned by this stage, so piece ``i + 1`` is ranked and tokenized
    while the producer cuts piece ``i`` into batches and assembles the next chunk (numpy and
    the compiled kernels release the GIL in their bulk work: both cores work; measured in
    docs/benchmarks.md); with two workers, piece ``i + 1`` is also worked on while the
    producer waits for piece ``i``, and with ``lookahead`` 2 (the chain's: one a worker)
    pieces ``i + 1`` and ``i + 2`` go on while the producer cuts piece ``i``. Results come back
    in order, each with its piece's tag. The first piece goes out before the next is pulled,
    so the first batch of a run waits for nothing else. If pulling the next piece fails, the
    pieces already started are handed on first and the failure is raised after them; a
    failure of the work itself is raised in its turn.

    ``prepare``, when given, is a first step of the work (``work(prepare(x)) == work(x)``)
    that runs on whichever thread is free: on the producer when the worker is still busy
    with the piece before (the producer would only wait for it), else on the worker. A
    mixture's pieces are gathered that way (:class:`~slafload.pipeline.chunk.Cut`): on the
    worker where the producer bounds throughput (small cells), on the producer where ranking
    and tokenizing do (large cells).
    """

    def __init__(
        self,
        source: Iterator[Tagged[Any]],
        work: Callable[[Any], Any],
        *,
        lookahead: int = 1,
        prepare: Callable[[Any], Any] | None = None,
        workers: int = 1,
    ):
        super().__init__(source)
        self.work, self.lookahead, self.prepare = work, lookahead, prepare
        self.workers = workers
        self._pending: list[tuple[Tagged[Any], Future[Any]]] = []
        self._failure: BaseException | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._first = True

    def __next__(self) -> Tagged[Any]:
        ahead = 0 if self._first else self.lookahead
        self._first = False
        while self._failure is None and len(self._pending) <= ahead:
            try:
                piece = next(self.source)
                item = piece.item
                if self.prepare is not None and self._busy():
                    item = self.prepare(item)
            except StopIteration:
                break
            except Exception as exc:  # deliver what was read before the failure, then raise
                self._failure = exc
                break
            if self._worker is None:
                self._worker = ThreadPoolExecutor(
                    self.workers, thread_name_prefix="slafload-tokens"
                )
            self._pending.append((piece, self._worker.submit(self.work, item)))
        if self._pending:
            piece, work = self._pending.pop(0)
            return piece.then(work.result())
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        raise StopIteration

    def _busy(self) -> bool:
        """Whether every worker is still working on a piece handed to it."""
        return sum(not work.done() for _, work in self._pending) >= self.workers

    def close(self) -> None:
        """Wait out the work in flight (Polars must never send to nobody), end the worker,
        close the source.
        """
        pending, self._pending = self._pending, []
        for _, future in pending:
            future.cancel()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        super().close()


def with_obs(rows: Arrays, cells: np.ndarray, obs: Mapping[str, Any]) -> Arrays:
    """A piece's token ``rows`` with ``cell_integer_id`` and the obs codes of its ``cells``.

    ``obs`` maps an obs column name to ``int64`` codes per cell id: an array, or anything
    indexable by an ``int64`` array of cell ids (a mixture's lookups). The codes are written
    after ``cell_integer_id``, so a mixture's ``cell_integer_id`` column replaces its global
    cell ids by ids within each source. Runs on the token worker with the piece's token work:
    each lookup is a pass over the piece's cells the producer does not make.
    """
    arrays = dict(rows)
    arrays["cell_integer_id"] = cells
    for name, codes in obs.items():
        arrays[name] = codes[cells]
    return arrays


class LayOut(Stage[Tagged[dict[str, np.ndarray]]]):
    """Each batch's token rows in the loader's layout (``finish``: :meth:`TokenStage.finish`)."""

    def __init__(
        self,
        source: Iterator[Tagged[Arrays]],
        finish: Callable[[Arrays], dict[str, np.ndarray]],
        kernels: Kernels = NUMPY,
    ):
        super().__init__(source)
        self.finish, self.kernels = finish, kernels

    def __next__(self) -> Tagged[dict[str, np.ndarray]]:
        batch = next(self.source)
        return batch.then(self.finish(batch.item))

    def close(self) -> None:
        """Close the stages before, then end the chain's kernels' compile thread (the token
        worker and the producer have stopped by then, so nothing starts a new one; the read
        threads never do).
        """
        try:
            super().close()
        finally:
            self.kernels.close()
