"""Variable-length token rows, and the built-in tokenizers writing straight into them.

A :class:`Ragged` holds the token streams of ``n`` cells back to back (``input_ids``, scGPT's
``values``...), all aligned on one ``offsets`` array. The batcher cuts and joins it like any
row-aligned array (``len``, slicing, :meth:`Ragged.concat`), and the packed layout
(:mod:`slafload.pipeline.layout`) turns each batch's rows into packed tensors.

:func:`ragged_tokens` makes one from a ranked piece: the built-ins (``geneformer``, ``scgpt``,
``raw``, ``sparse``) write only real tokens, so no padding is filled and then stripped; any other
tokenizer is run as usual and stripped of its padding by its ``attention_mask``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from slafload.errors import LayoutError
from slafload.kernels import NUMPY, Kernels
from slafload.pipeline.buffers import fresh
from slafload.pipeline.ranges import run_offsets
from slafload.tokenizers import CLS, SEP, Geneformer, Raw, ScGPT, Sparse, Tokenizer
from slafload.tokenizers.builtin import copy_cell_tokens, gene_tokens, scgpt_value_tokens
from slafload.types import RankedChunk

RAGGED_KEY = "tokens"  # the key a piece's Ragged travels under until the layout expands it


@dataclass(frozen=True, eq=False)
class Ragged:
    """Token streams of ``n`` rows: row ``i``'s tokens are ``stream[offsets[i]:offsets[i+1]]``.

    Attributes:
        offsets: ``int64[n + 1]``, ``offsets[0] == 0``, non-decreasing.
        streams: Aligned 1-D arrays of ``offsets[-1]`` tokens each.
    """

    offsets: np.ndarray
    streams: Mapping[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Number of entries of each row."""
        return np.diff(self.offsets)

    def __getitem__(self, rows: slice) -> Ragged:
        """Rows ``[start, stop)``; the streams are views, the offsets rebased to 0."""
        start, stop, step = rows.indices(len(self))
        if step != 1:
            raise ValueError("Ragged rows can only be sliced contiguously")
        stop = max(start, stop)
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        streams = {k: v[lo:hi] for k, v in self.streams.items()}
        return Ragged(self.offsets[start : stop + 1] - lo, streams)

    @staticmethod
    def concat(parts: Sequence[Ragged]) -> Ragged:
        """The rows of ``parts``, in order (all with the same streams)."""
        first = parts[0]
        shifts = np.cumsum([0] + [int(p.offsets[-1]) for p in parts[:-1]])
        offsets = np.concatenate(
            [first.offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, shifts, strict=True)]
        )
        streams = {k: np.concatenate([p.streams[k] for p in parts]) for k in first.streams}
        return Ragged(offsets, streams)


def ragged_tokens(
    tokenizer: Tokenizer, ranked: RankedChunk, dtype: np.dtype, kernels: Kernels = NUMPY
) -> dict:
    """``tokenizer``'s output for ``ranked`` with its token rows as one :class:`Ragged`.

    Returns a dict of row-aligned arrays whose token streams sit in a ``Ragged`` under
    :data:`RAGGED_KEY`; per-cell arrays (e.g. raw's ``lengths``) stay as they are. Integer
    token streams have ``dtype``. The built-ins copy tokens with ``kernels``
    (:mod:`slafload.kernels`).

    Raises:
        LayoutError: a third-party tokenizer's output has no ``attention_mask`` to tell its
            padding from its tokens.
    """
    kind = _builtin(tokenizer)
    if kind is Geneformer:
        return _geneformer(cast(Geneformer, tokenizer), ranked, dtype, kernels)
    if kind is ScGPT:
        return _scgpt(cast(ScGPT, tokenizer), ranked, dtype, kernels)
    if kind is Raw:
        return _raw(cast(Raw, tokenizer), ranked, dtype, kernels)
    if kind is Sparse:
        return _sparse(ranked, dtype, kernels)
    return strip(dict(tokenizer(ranked)), dtype, name=tokenizer.name)


def _builtin(tokenizer: Tokenizer) -> type | None:
    """The built-in class whose token layout ``tokenizer`` produces, if any.

    A subclass counts when it keeps the built-in's ``__call__`` (e.g. scGPT with other bins:
    only :meth:`ScGPT.bins` differs, and the ragged path calls it too).
    """
    for kind in (Geneformer, ScGPT, Raw, Sparse):
        if isinstance(tokenizer, kind) and type(tokenizer).__call__ is kind.__call__:
            return kind
    return None


def _sentences(
    ranked: RankedChunk, limit: int, width: int, dtype: np.dtype,
    aligned: Sequence[tuple[np.dtype, np.ndarray]] = (), kernels: Kernels = NUMPY,
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:  # fmt: skip
    """Offsets and ids of ``[CLS] g1..gk [SEP]`` rows (``SEP`` only where it fits in
    ``width``), ``k <= limit``, and one zero-padded stream per ``(dtype, source)`` of
    ``aligned``, whose genes' entries are filled in the same loop (:func:`copy_cell_tokens`).
    """
    kept = ranked.output_lengths(limit)
    sep = kept + 1 < width
    offsets = run_offsets(kept + 1 + sep)
    starts = offsets[:-1]
    ids = fresh(int(offsets[-1]), dtype)  # CLS, genes and SEP cover every slot
    ids[starts] = CLS
    streams = [fresh(int(offsets[-1]), t, 0) for t, _ in aligned]
    pairs = [(ids, gene_tokens(ranked)), *zip(streams, (a for _, a in aligned), strict=True)]
    copy_cell_tokens(pairs, ranked, starts + 1, limit, kernels)
    ids[(starts + 1 + kept)[sep]] = SEP
    return offsets, ids, streams


def _geneformer(tok: Geneformer, ranked: RankedChunk, dtype: np.dtype, kernels: Kernels) -> dict:
    offsets, ids, _ = _sentences(ranked, tok.max_genes - 1, tok.max_genes, dtype, (), kernels)
    return {RAGGED_KEY: Ragged(offsets, {"input_ids": ids})}


def _scgpt(tok: ScGPT, ranked: RankedChunk, dtype: np.dtype, kernels: Kernels) -> dict:
    aligned = [(dtype, scgpt_value_tokens(tok, ranked, kernels))]
    width = tok.max_genes + 2
    offsets, ids, (values,) = _sentences(ranked, tok.max_genes, width, dtype, aligned, kernels)
    streams = {"input_ids": ids, "values": values}
    return {RAGGED_KEY: Ragged(offsets, streams)}


def _raw(tok: Raw, ranked: RankedChunk, dtype: np.dtype, kernels: Kernels) -> dict:
    rows = expression_rows(ranked, tok.max_genes, dtype, kernels)
    return {RAGGED_KEY: rows, "lengths": ranked.output_lengths(tok.max_genes)}


def expression_rows(
    ranked: RankedChunk, limit: int, dtype: np.dtype, kernels: Kernels = NUMPY
) -> Ragged:
    """Each output cell's first ``limit`` entries of ``ranked`` as ``gene_ids`` (``dtype``)
    and ``values`` (``float32``), back to back in output order: ``raw``'s rows (rank order)
    and, with no limit, ``sparse``'s (gene order, :class:`~slafload.tokenizers.sparse.Sparse`).

    One run copy per cell through ``kernels`` (:func:`copy_cell_tokens`), no padding.
    """
    offsets = run_offsets(ranked.output_lengths(limit))
    genes = fresh(int(offsets[-1]), dtype)
    values = fresh(int(offsets[-1]), np.float32)
    pairs = [(genes, ranked.genes), (values, ranked.values)]
    copy_cell_tokens(pairs, ranked, offsets[:-1], limit, kernels)
    return Ragged(offsets, {"gene_ids": genes, "values": values})


def _sparse(ranked: RankedChunk, dtype: np.dtype, kernels: Kernels) -> dict:
    """``sparse``'s rows: every entry of ``ranked`` (in gene order), as CSR."""
    return {RAGGED_KEY: expression_rows(ranked, len(ranked.genes), dtype, kernels)}


def strip(arrays: dict[str, Any], dtype: np.dtype, *, name: str = "") -> dict:
    """A padded tokenizer output with every ``attention_mask``-shaped array made ragged."""
    mask = arrays.pop("attention_mask", None)
    if mask is None or mask.ndim != 2:
        raise unmasked(f"tokenizer {name!r}")
    streams = {}
    for key in [k for k, v in arrays.items() if v.shape == mask.shape]:
        stream = arrays.pop(key)[mask]
        streams[key] = stream.astype(dtype) if stream.dtype == np.int64 else stream
    arrays[RAGGED_KEY] = Ragged(run_offsets(mask.sum(axis=1)), streams)
    return arrays


def unmasked(tokenizer: str) -> LayoutError:
    """The error for a ``tokenizer`` whose padding cannot be told from its tokens."""
    return LayoutError(
        f"{tokenizer} returns no 2-D attention_mask, so its padding cannot be told from its "
        "tokens; use layout='padded' with it, or return an attention_mask"
    )
