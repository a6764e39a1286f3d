"""The contracts between stages, in one place.

Data flows one way through these types::

    Sampler --plan--> Plan of Fetch --read--> Chunk --rank--> RankedChunk --Tokenizer--> Arrays
                                             (ChunkTransform: Chunk -> Chunk, before ranking)
    Arrays --batch--> Batch (torch tensors) --consumer--> PaddedBatch | PackedBatch

Every type here is a frozen dataclass, a ``Protocol`` or a ``TypedDict``: stages exchange
values, never mutate what they were given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    Protocol,
    Required,
    TypedDict,
    overload,
    runtime_checkable,
)

import numpy as np

from slafload.pipeline.ranges import describe, expand, ranges_of, slice_ranges

if TYPE_CHECKING:
    import torch

Arrays = dict[str, np.ndarray]
"""Row-aligned numpy arrays: a tokenizer's output, then a training batch before torch."""

Batch = dict[str, "torch.Tensor"]
"""A training batch between the stages: names to tensors (what the consumer receives is typed
by :data:`LoaderBatch`)."""


# -- batches: what a training loop receives ---------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """A batch entry's shape and the dtypes it may have: the metadata of each annotation in
    :class:`PaddedBatch` and :class:`PackedBatch` (``typing.get_type_hints(...,
    include_extras=True)`` returns it).

    Attributes:
        dims: The tensor's dimensions by name: ``batch`` (cells of the batch), ``batch + 1``,
            ``width`` (token positions of a padded row) or ``tokens`` (a packed batch's
            tokens, ``cu_seqlens[-1]``).
        dtypes: The torch dtypes it may have (``int32`` token streams with
            ``token_dtype="int32"``; raw ``values`` are ``float32``).
    """

    dims: tuple[str, ...]
    dtypes: tuple[str, ...]


_TOKENS = ("int64", "int32")  # token_dtype
_PER_CELL = TensorSpec(("batch",), ("int64",))


class _CellColumns(TypedDict, total=False):
    cell_integer_id: Required[Annotated[torch.Tensor, _PER_CELL]]
    """The cells' ids in their dataset (in its source, for a mixture)."""
    source: Annotated[torch.Tensor, _PER_CELL]
    """A mixture's source codes, indexed into ``Loader.source_names``."""
    lengths: Annotated[torch.Tensor, _PER_CELL]
    """``raw``: each cell's expressed genes kept (at most ``max_genes``)."""


class PaddedBatch(_CellColumns, total=False):
    """A batch of ``layout="padded"`` or ``"longest"``: token rows ``[batch, width]``, with
    ``width`` the tokenizer's (``padded``) or the batch's longest cell's (``longest``).

    Which keys a batch holds depends on the tokenizer: ``geneformer`` ``input_ids`` and
    ``attention_mask``; ``scgpt`` those and ``values`` (bins plus the value offset); ``raw``
    ``gene_ids`` (padded with -1), ``values`` (``float32``, padded with 0) and ``lengths``.
    Every batch has ``cell_integer_id``; a mixture's has ``source``; each of ``obs_columns``
    is one more ``int64 [batch]`` entry under its own name, and a plugin tokenizer's arrays
    come under theirs (neither is declared here).
    """

    input_ids: Annotated[torch.Tensor, TensorSpec(("batch", "width"), _TOKENS)]
    attention_mask: Annotated[torch.Tensor, TensorSpec(("batch", "width"), ("bool",))]
    values: Annotated[torch.Tensor, TensorSpec(("batch", "width"), (*_TOKENS, "float32"))]
    gene_ids: Annotated[torch.Tensor, TensorSpec(("batch", "width"), _TOKENS)]


class PackedBatch(_CellColumns, total=False):
    """A batch of ``layout="packed"``: every token stream one 1-D tensor of the cells' real
    tokens back to back, with no padding and no ``attention_mask``.

    ``cu_seqlens[i]:cu_seqlens[i + 1]`` are cell ``i``'s tokens (FlashAttention's varlen
    convention), and ``position_ids`` restart at 0 for each cell. The token streams are the
    padded layout's (``input_ids``; scGPT's ``values``; raw ``gene_ids``, ``values``), and so
    are the per-cell entries, obs columns included. The ``sparse`` tokenizer's batches are
    CSR: ``gene_ids``, ``values`` and ``cu_seqlens`` only, without ``position_ids``.
    """

    cu_seqlens: Required[Annotated[torch.Tensor, TensorSpec(("batch + 1",), ("int32",))]]
    position_ids: Annotated[torch.Tensor, TensorSpec(("tokens",), _TOKENS)]
    """Within-cell positions; in every packed batch but the ``sparse`` tokenizer's."""
    input_ids: Annotated[torch.Tensor, TensorSpec(("tokens",), _TOKENS)]
    values: Annotated[torch.Tensor, TensorSpec(("tokens",), (*_TOKENS, "float32"))]
    gene_ids: Annotated[torch.Tensor, TensorSpec(("tokens",), _TOKENS)]


LoaderBatch = PaddedBatch | PackedBatch
"""What :class:`~slafload.Loader` and its DataLoader face yield: a :class:`PaddedBatch`, or a
:class:`PackedBatch` with ``layout="packed"`` (the loader's ``config.layout`` says which)."""


class Offsets(Protocol):
    """CSR offsets of cells, indexed like ``int64[n_cells + 1]`` (an ``np.ndarray``, a
    dataset's :class:`~slafload.data.offsets.CellOffsets`, a mixture's global offsets): an int
    gives an int, a slice or an array of positions gives ``int64`` (``budget.groups`` slices
    them to cut a range at cell boundaries).
    """

    def __getitem__(self, index: Any) -> Any: ...

    def __len__(self) -> int: ...


# -- sampling: which cells, in which order ---------------------------------------------------


@dataclass(frozen=True, eq=False)
class Fetch:
    """One prefetch chunk: cell ranges to read together, and how to order them in memory.

    Attributes:
        index: Position of this fetch in its epoch plan.
        ranges: ``int64[k, 2]`` half-open cell ranges ``[start, stop)``, in read order.
        shuffle_seed: Seed of the in-memory cell shuffle of this chunk; ``None`` keeps the
            cells in range order.
    """

    index: int
    ranges: np.ndarray
    shuffle_seed: int | None = None

    @property
    def n_cells(self) -> int:
        """Cells of the fetch."""
        return int((self.ranges[:, 1] - self.ranges[:, 0]).sum())

    def cell_ids(self) -> np.ndarray:
        """The cells of this fetch in read order (before any shuffle)."""
        return expand(self.ranges[:, 0], self.ranges[:, 1] - self.ranges[:, 0])

    def output_order(self) -> np.ndarray:
        """``int64[n_cells]``: output position ``j`` holds read-order cell ``[j]``."""
        return shuffle_order(self.n_cells, self.shuffle_seed)

    def sliced(self, index: int, start: int, stop: int, seed: int | None) -> Fetch:
        """Cells ``[start, stop)`` of this fetch as fetch ``index`` of their own, shuffled
        with ``seed``; consecutive slices of ``[0, n_cells)`` hold every cell once (the
        partition among ranks cuts a fetch so). Here the slice is in read order.
        """
        return Fetch(index, slice_ranges(self.ranges, start, stop), seed)

    def without(self, taken: np.ndarray, seed: int | None) -> Fetch:
        """The cells of this fetch not in ``taken``, as a fetch shuffled with ``seed``."""
        left = np.setdiff1d(self.cell_ids(), taken, assume_unique=True)
        return Fetch(self.index, ranges_of(left), seed)

    def __repr__(self) -> str:
        return f"Fetch(index={self.index}, cells={self.n_cells}, ranges={describe(self.ranges)})"


def shuffle_order(n: int, seed: int | None) -> np.ndarray:
    """The in-memory order of a fetch of ``n`` cells shuffled with ``seed``.

    Output position ``j`` holds read-order cell ``[j]``; ``seed=None`` keeps read order. The
    chunk stage applies it, and the partition among ranks uses it to know which cells a rank
    has consumed.
    """
    if seed is None:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng(seed).permutation(n).astype(np.int64)


class Plan(Sequence[Fetch]):
    """An epoch's ordered fetches. Subclasses build fetches lazily from index arithmetic."""

    def __len__(self) -> int:
        raise NotImplementedError

    def fetch(self, index: int) -> Fetch:
        """Fetch ``index`` (``0 <= index < len(self)``), computed on demand."""
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> Fetch: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Fetch]: ...
    def __getitem__(self, index: int | slice) -> Fetch | Sequence[Fetch]:
        if isinstance(index, slice):
            return [self.fetch(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"fetch index {index} out of range for a plan of {len(self)}")
        return self.fetch(index)

    @property
    def n_cells(self) -> int:
        """Cells delivered by the whole plan (sum over fetches)."""
        return int(self.fetch_sizes().sum())

    def fetch_sizes(self) -> np.ndarray:
        """``int64[len(self)]`` cells per fetch.

        Subclasses compute it without building fetches (partitioning among ranks needs every
        size up front).
        """
        return np.array([f.n_cells for f in self], dtype=np.int64)


@runtime_checkable
class Sampler(Protocol):
    """Turns ``(n_cells, seed, epoch)`` into a :class:`Plan`."""

    def plan(self, n_cells: int, *, seed: int, epoch: int) -> Plan:
        """The fetches of one epoch; the same arguments always give the same plan."""
        ...


# -- chunks: whole cells in memory -----------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Chunk:
    """All expression rows of a set of whole cells, in CSR layout.

    Attributes:
        fetch_index: Index of the fetch this chunk was read for.
        cell_ids: ``int64[n]`` cell ids in read order.
        indptr: ``int64[n + 1]`` offsets: cell ``i``'s rows are ``indptr[i]:indptr[i + 1]``.
        genes: Gene ids of the rows (the table's integer dtype), strictly ascending within a
            cell whatever the storage order (ranking relies on it; a transform that reorders
            genes must restore it, as :class:`~slafload.transforms.vocab.GeneRemap` does).
        values: Expression values of the rows (the table's numeric dtype; duplicate entries
            of a gene in a cell are summed, see :func:`slafload.pipeline.chunk.sort_genes_within_cells`).
        order: ``int64[n]`` output order: output row ``j`` is chunk cell ``order[j]``.
    """

    fetch_index: int
    cell_ids: np.ndarray
    indptr: np.ndarray
    genes: np.ndarray
    values: np.ndarray
    order: np.ndarray

    @property
    def n_cells(self) -> int:
        """Cells of the chunk."""
        return len(self.cell_ids)

    @property
    def lengths(self) -> np.ndarray:
        """``int64[n]`` rows of each cell (read order)."""
        return np.diff(self.indptr)


@dataclass(frozen=True, eq=False)
class RankedChunk(Chunk):
    """A chunk whose cells' genes are sorted by expression; the input of every tokenizer.

    Same fields as :class:`Chunk`, but only expressed genes (value > 0) are kept and, within
    each cell, ``genes``/``values`` are in rank order: highest value first, ties by gene id.
    Cells stay in read order; tokenizers write cell ``i`` to output row ``row_of_cell[i]``
    using the properties below, so they never loop over cells.
    """

    @cached_property
    def lengths(self) -> np.ndarray:
        """``int64[n]`` number of expressed genes of each cell (read order)."""
        return np.diff(self.indptr)

    @cached_property
    def row_of_cell(self) -> np.ndarray:
        """``int64[n]`` output row of each cell (the inverse of ``order``)."""
        rows = np.empty(self.n_cells, dtype=np.int64)
        rows[self.order] = np.arange(self.n_cells, dtype=np.int64)
        return rows

    @cached_property
    def entry_cell(self) -> np.ndarray:
        """Read-order cell index of every entry."""
        return np.repeat(np.arange(self.n_cells, dtype=np.int64), self.lengths)

    @cached_property
    def entry_rank(self) -> np.ndarray:
        """0-based rank of every entry within its cell."""
        return np.arange(len(self.genes), dtype=np.int64) - np.repeat(
            self.indptr[:-1], self.lengths
        )

    @cached_property
    def entry_row(self) -> np.ndarray:
        """Output row of every entry."""
        return self.row_of_cell[self.entry_cell]

    @property
    def output_cell_ids(self) -> np.ndarray:
        """``int64[n]`` the cell id of each output row."""
        return self.cell_ids[self.order]

    def output_lengths(self, limit: int | None = None) -> np.ndarray:
        """Expressed genes per output row, capped at ``limit``."""
        lengths = self.lengths[self.order]
        return lengths if limit is None else np.minimum(lengths, limit)

    def top(self, limit: int) -> np.ndarray:
        """Boolean mask of the entries ranked below ``limit`` in their cell."""
        return self.entry_rank < limit


class ChunkTransform(Protocol):
    """Rewrites a shuffled chunk before ranking (value normalisation, gene remapping).

    It must keep the chunk's cells and their order; it may change, drop or reorder rows
    within a cell (genes must stay ascending within a cell).
    """

    def __call__(self, chunk: Chunk, /) -> Chunk:
        """The rewritten chunk."""


@runtime_checkable
class Tokenizer(Protocol):
    """Maps a :class:`RankedChunk` to equal-length numpy arrays.

    Every returned array has ``ranked.n_cells`` rows, row ``j`` describing output cell
    ``ranked.order[j]``. Implementations must be vectorized over the chunk. A tokenizer with
    a class attribute ``ranks_genes = False`` reads no rank: the token stage then skips
    ranking and hands it each cell's expressed genes in ascending gene id instead (as the
    built-in ``sparse`` does); one with ``takes_max_genes = False`` keeps every gene, and the
    loader passes it no ``max_genes`` unless the user sets one.
    """

    name: str

    def __call__(self, ranked: RankedChunk) -> dict[str, np.ndarray]:
        """Equal-length arrays, one row per output cell."""


# -- sources: what the chain streams cells from ------------------------------------------------


class CellSource(Protocol):
    """What a run streams cells from: an opened :class:`~slafload.data.dataset.SlafDataset`,
    or a :class:`~slafload.data.mixture.Mixture` of several that numbers their cells one after
    the other.

    The chain reads through it (``reader``, ``cell_start``, ``row_bytes``), checkpoints record
    and restore it (``uri``, ``versions``, ``repin``), and the front ends ask it what a mixture
    adds instead of asking whether it is one: a dataset answers with nothing (``source_names`` and
    ``transform`` are ``None``, ``cell_columns()`` is empty, ``sampler(default, ...)`` is
    ``default``, ``check_values`` accepts everything).
    """

    @property
    def uri(self) -> str:
        """The dataset's directory or URI (a mixture's names its sources)."""

    @property
    def n_cells(self) -> int:
        """Cells, numbered ``0 .. n_cells - 1``."""

    @property
    def n_genes(self) -> int:
        """Genes (a mixture's: its shared vocabulary's)."""

    @property
    def versions(self) -> Mapping[str, Any]:
        """The pinned Lance versions (a mixture's: by source name)."""

    @property
    def storage_options(self) -> Mapping[str, str] | None:
        """Lance storage options the tables were opened with."""

    @property
    def cell_start(self) -> Offsets:
        """CSR offsets of the cells' expression rows."""

    @property
    def source_names(self) -> tuple[str, ...] | None:
        """A mixture's source names, indexed by the batches' ``source`` codes; else ``None``."""

    @property
    def transform(self) -> ChunkTransform | None:
        """The chunk transform every chunk runs first (a mixture's per-source work)."""

    def reader(self, options: Any = None) -> Any:
        """The reader of this source's fetches (``options``: a ``ReadOptions``)."""

    def row_bytes(self, columns: list[str]) -> int:
        """Bytes of one expression row of ``columns``, as the memory budget counts them."""

    def obs_codes(self, column: str) -> tuple[Any, list[Any] | None]:
        """One obs column as ``int64`` codes indexable by cell id, and its categories."""

    def cell_columns(self) -> Mapping[str, Any]:
        """Per-cell columns every batch carries besides the obs columns (a mixture's
        ``source`` and per-source ``cell_integer_id``).
        """

    def sampler(
        self,
        default: Sampler,
        bind: Callable[[Sampler], Sampler] = ...,
        batch_size: int = 1,
        memory_budget: int | None = None,
    ) -> Sampler:
        """The sampler of a run over this source, ``default`` the loader's (bound to its batch
        size); ``bind`` binds a mixture's per-source samplers the same way.
        """

    def check_values(self, tokenizer: Tokenizer, transforms: Sequence[ChunkTransform]) -> None:
        """Refuse values that ``tokenizer`` and ``transforms`` cannot take together."""

    def repin(self, versions: Mapping[str, Any]) -> CellSource:
        """This source at the Lance ``versions`` a checkpoint recorded (itself if it already
        is; a mixture re-pins each source the checkpoint names).
        """
