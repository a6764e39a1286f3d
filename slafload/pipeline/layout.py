"""Lay out each batch's token rows: padded, padded to the longest cell, or packed.

``Loader(layout=...)`` picks one of three :class:`Layout` strategies; a batch is always
``batch_size`` cells, only the shape of its token streams changes:

``"padded"`` (default)
    Fixed ``[batch, width]`` arrays, slafdb-compatible, exactly as the tokenizer made
    them.
``"longest"``
    The same rows padded only to the longest cell of the batch (Hugging Face's collator
    convention): ``padded[:, :width]`` where ``width`` is that cell's token count.
``"packed"``
    No padding at all: every token stream (``input_ids``, scGPT ``values``, raw ``gene_ids``
    and ``values``) is one 1-D tensor of the batch's cells back to back;
    ``cu_seqlens`` (``int32 [batch + 1]``, FlashAttention's varlen convention) holds where
    each cell starts and ``position_ids`` restart at 0 for each cell. There is no
    ``attention_mask``: every token is real, and the cell boundaries are ``cu_seqlens``.

The ``sparse`` tokenizer's batches are packed only, and are CSR: ``gene_ids``, ``values``
(``float32``) and ``cu_seqlens``, each cell's expressed genes in ascending gene id, with no
``position_ids`` (:class:`Csr`; :func:`slafload.tokenizers.sparse_csr` makes a
``torch.sparse_csr_tensor`` of one).

Per-cell arrays (``cell_integer_id``, obs codes, raw ``lengths``) are the same in every
layout. ``token_dtype="int32"`` makes every integer token stream (and ``position_ids``)
``int32``; ``cu_seqlens`` is always ``int32``, per-cell arrays stay ``int64``.

A layout is applied by the loader's token stage (:mod:`slafload.pipeline.tokenize`): its
``piece`` step to each tokenized piece, its ``finish`` step to each batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from slafload.errors import LayoutError
from slafload.pipeline.buffers import fresh
from slafload.pipeline.ragged import RAGGED_KEY, Ragged, unmasked
from slafload.tokenizers import ScGPT, Sparse
from slafload.types import Tokenizer

INT64 = np.dtype(np.int64)
ROW_TOKENS = "_row_tokens"  # a piece's per-row token counts, carried to the longest layout
Arrays = dict[str, Any]  # row-aligned numpy arrays, and at most one Ragged under RAGGED_KEY


class Layout(Protocol):
    """Turns one batch's rows (numpy, possibly a :class:`Ragged`) into its output arrays."""

    name: str
    ragged: bool  # whether pieces are tokenized straight into Ragged rows

    @property
    def token_dtype(self) -> np.dtype:
        """The dtype of integer token streams and ``position_ids``."""

    def piece(self, arrays: Arrays) -> Arrays:
        """Prepare a whole piece's rows before it is cut into batches."""

    def finish(self, batch: Arrays) -> dict[str, np.ndarray]:
        """One batch's rows as the layout's output arrays."""


@dataclass(frozen=True)
class _Layout:
    token_dtype: np.dtype = INT64  # of integer token streams and position_ids

    def piece(self, arrays: Arrays) -> Arrays:
        """A whole piece's rows, before batching: add what is cheaper made once per piece."""
        return arrays


class Padded(_Layout):
    """The tokenizer's own fixed-width rows, untouched."""

    name = "padded"
    ragged = False

    def finish(self, batch: Arrays) -> dict[str, np.ndarray]:
        """The batch's padded rows, as they are."""
        return dict(batch)


class Longest(_Layout):
    """Rows padded to the longest cell of the batch, with ``attention_mask`` if padded had it.

    The piece is tokenized exactly as for ``padded`` (into reused buffers, on the token
    worker); each batch's token rows are then its padded rows' first ``width`` columns, copied
    out whole by the producer's ``ToTorch`` (one bulk copy per stream, no loop over cells).
    """

    name = "longest"
    ragged = False

    def piece(self, arrays: Arrays) -> Arrays:
        """Add how many columns of each row hold tokens (:data:`ROW_TOKENS`): up to its last
        ``attention_mask`` position, or its ``lengths`` (raw).
        """
        mask = arrays.get("attention_mask")
        if mask is not None and mask.ndim == 2:
            last = mask.shape[1] - np.argmax(mask[:, ::-1], axis=1)  # one past the last true
            tokens = np.where(mask.any(axis=1), last, 0)
        elif "lengths" in arrays:  # raw: no mask, and a row holds its lengths' entries
            tokens = np.asarray(arrays["lengths"])
        else:
            raise unmasked(f"the tokenizer of output {sorted(arrays)}")
        return {**arrays, ROW_TOKENS: tokens}

    def finish(self, batch: Arrays) -> dict[str, np.ndarray]:
        """The batch's padded rows without the columns that are padding in every row."""
        out = dict(batch)
        tokens = out.pop(ROW_TOKENS)
        width = int(tokens.max()) if len(tokens) else 0
        return {k: v[:, :width] if v.ndim == 2 else v for k, v in out.items()}


class Packed(_Layout):
    """Token streams back to back, with ``cu_seqlens`` and per-cell ``position_ids``."""

    name = "packed"
    ragged = True

    def piece(self, arrays: Arrays) -> Arrays:
        """Add within-cell ``position_ids`` to the piece's token streams."""
        # Positions count within a cell, so a piece's stream sliced at cell boundaries is each
        # batch's: one pass per piece instead of one numpy call chain per batch.
        rows = arrays[RAGGED_KEY]
        streams = {**rows.streams, "position_ids": position_ids(rows.offsets, self.token_dtype)}
        return {**arrays, RAGGED_KEY: Ragged(rows.offsets, streams)}

    def finish(self, batch: Arrays) -> dict[str, np.ndarray]:
        """The batch's token streams back to back, with ``cu_seqlens`` offsets."""
        cells, rows = _split(batch)
        return {**rows.streams, "cu_seqlens": rows.offsets.astype(np.int32), **cells}


class Csr(Packed):
    """The packed layout of a CSR tokenizer (``sparse``): ``cu_seqlens`` and the streams, no
    ``position_ids`` (a count model reads no positions, and a piece's would cost as much as
    gathering it).
    """

    def piece(self, arrays: Arrays) -> Arrays:
        """The piece's rows, as they are."""
        return arrays


LAYOUTS = {cls.name: cls for cls in (Padded, Longest, Packed)}


def make_layout(name: str, token_dtype: str = "int64") -> Layout:
    """The :class:`Layout` called ``name`` (``padded``, ``longest`` or ``packed``)."""
    if name not in LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(LAYOUTS)}, got {name!r}")
    return LAYOUTS[name](np.dtype(token_dtype))


def layout_for(tokenizer: Tokenizer, layout: Layout) -> Layout:
    """``layout`` as ``tokenizer`` lays it out: :class:`Csr` for ``sparse`` (its CSR batches).

    Raises:
        LayoutError: ``sparse`` with a layout other than ``"packed"``.
    """
    if not isinstance(tokenizer, Sparse):
        return layout
    if layout.name != "packed":
        raise LayoutError(
            f"tokenizer 'sparse' makes CSR batches (gene_ids, values, cu_seqlens), which have "
            f"no padded rows: layout={layout.name!r} cannot hold them; use layout='packed' "
            "(the loader's default for it) or tokenizer='raw' for padded rows"
        )
    return Csr(layout.token_dtype)


def position_ids(offsets: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``0, 1, ..`` restarting at every row start of ``offsets``.

    Each row is a slice of one short ramp, and one native ``concatenate`` writes them into an
    array from :func:`~slafload.pipeline.buffers.fresh`: no stream-sized temporaries (a ``repeat`` of
    the row starts and an ``arange``, 13 MB each per piece, made this cost as much as ranking
    the piece; 3.3 against 0.7-1.0 ms per 2,048-cell piece of 1.66M tokens).
    """
    lengths = np.diff(offsets)
    out = fresh(int(offsets[-1]), dtype)
    if len(out):
        ramp = np.arange(int(lengths.max()), dtype=dtype)
        np.concatenate([ramp[:n] for n in lengths.tolist()], out=out)
    return out


def _split(batch: Arrays) -> tuple[dict[str, np.ndarray], Ragged]:
    """The batch's per-cell arrays, and its token rows."""
    return {k: v for k, v in batch.items() if k != RAGGED_KEY}, batch[RAGGED_KEY]


def check_value_tokens(tokenizer: Tokenizer, dtype: np.dtype) -> None:
    """Refuse an scGPT value offset whose tokens ``dtype`` cannot hold (they would wrap)."""
    if not isinstance(tokenizer, ScGPT):
        return
    low, high = tokenizer.value_offset, tokenizer.value_offset + tokenizer.n_bins - 1
    limits = np.iinfo(dtype)
    if low < limits.min or high > limits.max:
        raise LayoutError(
            f"token_dtype={dtype.name!r} cannot hold tokenizer {tokenizer.name!r}'s value "
            f"tokens {low}..{high} (value_offset {low}, n_bins {tokenizer.n_bins}); use "
            "token_dtype='int64' or a value_offset within that range"
        )
