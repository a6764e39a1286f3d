"""Cut tokenized pieces into training batches of exactly ``batch_size`` rows, and
hand them over as torch tensors.

Pieces rarely hold a multiple of ``batch_size`` cells, so the rows left over at the end of a
piece are carried into the first batch of the next one; only the last batch of an epoch can
be short (or dropped with ``drop_last``). Full batches inside a piece are zero-copy views.
One chain may carry several epochs back to back (:mod:`slafload.pipeline.epochs`): each piece
carries its epoch leg, the piece ending a leg ends that epoch here, and no batch spans two
epochs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import torch

from slafload._validate import check_int
from slafload.errors import LoaderError
from slafload.pipeline.buffers import torch_dtype
from slafload.pipeline.partition import Leg, Tagged
from slafload.pipeline.stage import Stage
from slafload.types import Batch

Arrays = Mapping[str, np.ndarray]
NumpyBatch = dict[str, np.ndarray]  # one batch's numpy arrays, before ToTorch


class Batcher:
    """Accumulates row-aligned arrays and emits fixed-size batches, one epoch at a time."""

    def __init__(self, batch_size: int, *, drop_last: bool = False):
        check_int("batch_size", batch_size)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._pending: list[Arrays] = []
        self._pending_rows = 0

    def add(self, arrays: Arrays) -> Iterator[dict[str, np.ndarray]]:
        """Yield every batch completed by appending ``arrays`` (all of equal length)."""
        n = _rows(arrays)
        start = 0
        if self._pending_rows:
            start = min(self.batch_size - self._pending_rows, n)
            self._pending.append(_slice(arrays, 0, start))
            self._pending_rows += start
            if self._pending_rows < self.batch_size:
                return
            yield self._take_pending()
        full_end = start + (n - start) // self.batch_size * self.batch_size
        for i in range(start, full_end, self.batch_size):
            yield _slice(arrays, i, i + self.batch_size)
        if full_end < n:
            self._pending.append(_slice(arrays, full_end, n))
            self._pending_rows += n - full_end

    def finish(self) -> Iterator[dict[str, np.ndarray]]:
        """End the epoch: yield the short last batch unless ``drop_last``, then reset."""
        if self._pending_rows and not self.drop_last:
            yield self._take_pending()
        self._pending, self._pending_rows = [], 0

    def _take_pending(self) -> dict[str, np.ndarray]:
        parts, self._pending, self._pending_rows = self._pending, [], 0
        if len(parts) == 1:
            return dict(parts[0])
        return {k: _concat([p[k] for p in parts]) for k in parts[0]}


def _rows(arrays: Arrays) -> int:
    lengths = {len(v) for v in arrays.values()}
    if len(lengths) != 1:
        raise ValueError(f"arrays must have equal lengths, got {sorted(lengths)}")
    return lengths.pop()


def _concat(values: list) -> np.ndarray:
    """Join row-aligned values; containers of variable-length rows join themselves."""
    if hasattr(values[0], "concat"):
        return values[0].concat(values)
    return np.concatenate(values)


def _slice(arrays: Arrays, start: int, stop: int) -> dict[str, np.ndarray]:
    return {k: v[start:stop] for k, v in arrays.items()}


class Batches(Stage[Tagged[NumpyBatch]]):
    """Fixed-size batches of the rows of every piece; the short last one at each epoch's end.

    Each piece comes tagged with its epoch leg (:class:`~slafload.pipeline.partition.Tagged`):
    the leg's epoch ends (its short batch goes out, or is dropped with ``drop_last``) as soon
    as the piece ending it is in, and every batch carries its leg and the leg's cells done
    once it is delivered. Untagged pieces (``leg=None``) are one epoch, ended by the end of
    the stream. The rows of each leg are counted against its plan, so cells lost or
    duplicated upstream fail loudly here.

    Args:
        source: Row-aligned arrays, piece by piece, tagged.
        batch_size: Rows per batch.
        drop_last: Drop each epoch's short last batch.
    """

    def __init__(
        self, source: Iterator[Tagged[Arrays]], batch_size: int, *, drop_last: bool = False
    ):
        super().__init__(source)
        self._batcher = Batcher(batch_size, drop_last=drop_last)
        self._ready: Iterator[Tagged[NumpyBatch]] = iter(())
        self._finished = False
        self._open = False  # a leg has rows in, and has not ended
        self._leg: Leg | None = None  # the leg open, or the last one ended
        self._rows = self._done = 0  # its rows in, its cells batched

    def __next__(self) -> Tagged[NumpyBatch]:
        while True:
            batch = next(self._ready, None)
            if batch is not None:
                return batch
            if self._finished:
                raise StopIteration
            try:
                piece = next(self.source)
            except StopIteration:
                self._finished = True
                self._ready = self._end()
                continue
            self._ready = self._cut(piece)

    def _cut(self, piece: Tagged[Arrays]) -> Iterator[Tagged[NumpyBatch]]:
        """The batches ``piece`` completes, and the end of its leg if it is the last piece.

        A piece never spans two legs (it is part of one fetch of one epoch), so a piece that
        runs past its leg's rows means cells were lost or duplicated upstream.
        """
        leg, n = piece.leg, _rows(piece.item)
        if not self._open or leg is not self._leg:
            yield from self._end()
            if leg is not None and self._leg is not None and leg.epoch <= self._leg.epoch:
                raise LoaderError(
                    f"{n} rows arrived after the last planned epoch: epoch {leg.epoch} had "
                    f"all its {leg.rows} rows; the stages duplicated cells"
                )
            self._open, self._leg, self._rows, self._done = True, leg, 0, 0
        self._rows += n
        if leg is not None and self._rows > leg.rows:
            raise LoaderError(
                f"a piece of {n} rows arrived with {leg.rows - self._rows + n} rows left in "
                f"epoch {leg.epoch}: the stages lost or duplicated cells"
            )
        yield from self._tag(self._batcher.add(piece.item))
        if piece.ends:
            yield from self._end()

    def _end(self) -> Iterator[Tagged[NumpyBatch]]:
        """End the open leg, if any: its short last batch, unless ``drop_last``."""
        if not self._open:
            return
        leg = self._leg
        if leg is not None and self._rows < leg.rows:
            raise LoaderError(
                f"epoch {leg.epoch} ended {leg.rows - self._rows} cells short of its plan; "
                "the stages lost cells"
            )
        yield from self._tag(self._batcher.finish())
        self._open = False

    def _tag(self, batches: Iterator[NumpyBatch]) -> Iterator[Tagged[NumpyBatch]]:
        """``batches`` of the open leg, each with the leg's cells done after it."""
        for batch in batches:
            self._done += _rows(batch)
            yield Tagged(batch, self._leg, done=self._done)


class ToTorch(Stage[Tagged[Batch]]):
    """Each batch as torch tensors (zero-copy from contiguous, writable arrays; a read-only
    view of Arrow memory, such as a piece's expression rows, is copied), or, with
    ``pin_memory``, as copies in page-locked memory (:func:`pinned`); its tag kept beside it.
    """

    def __init__(self, source: Iterator[Tagged[NumpyBatch]], *, pin_memory: bool = False):
        super().__init__(source)
        self.pin_memory = pin_memory

    def __next__(self) -> Tagged[Batch]:
        batch = next(self.source)
        arrays = batch.item
        if self.pin_memory:
            return batch.then({k: pinned(v) for k, v in arrays.items()})
        return batch.then({k: torch.from_numpy(_writable(v)) for k, v in arrays.items()})


def pinned(array: np.ndarray) -> torch.Tensor:
    """``array`` copied into page-locked memory (for an asynchronous copy to the GPU).

    Not ``torch.from_numpy(array).pin_memory()``: that copies with ``Tensor.copy_``, which
    hands any tensor of 32,768 elements or more (every stream of a padded batch) to torch's
    intra-op thread pool. Each such copy wakes every OpenMP thread of the process, and they
    spin-wait after it: once per tensor per batch, on the producer. On CPU that copy costs
    5-13x the CPU of numpy's per padded batch, and 50x on a 16-core H100 host, where padded
    batches on their way to the GPU cost 37 (geneformer) and 54 (scGPT) us of CPU per cell
    with this copy, a tenth of what ``pin_memory()`` cost (docs/layouts.md). The copy here is numpy's, on the calling thread; the memory comes from
    torch's caching pinned allocator, as ``pin_memory()``'s does, so a block is reused only
    after the copies from it have ended.
    """
    out = torch.empty(array.shape, dtype=torch_dtype(array.dtype), pin_memory=True)
    copy_into(out, array)
    return out


def copy_into(out: torch.Tensor, array: np.ndarray) -> None:
    """Copy ``array`` into the CPU tensor ``out`` of its shape with numpy, on this thread
    (see :func:`pinned`): any layout, read-only views of Arrow memory included.
    """
    if tuple(out.shape) != array.shape:
        raise ValueError(f"cannot copy an array of shape {array.shape} into {tuple(out.shape)}")
    np.copyto(out.numpy(), array, casting="no")


def _writable(array: np.ndarray) -> np.ndarray:
    """``array`` as a C-contiguous array torch may wrap: itself where it already is one."""
    array = np.ascontiguousarray(array)
    return array if array.flags.writeable else array.copy()
