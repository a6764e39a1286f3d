"""Tokenizing on the training device: ``Loader(tokenize_on="device")``.

The producer only reads, shuffles and cuts batches (its token worker gathers each piece's
expressed entries); per batch it ships each cell's sparse expression (gene ids ``int32`` and
values, a few bytes per non-zero, zeros dropped, in output order) plus a few per-cell offsets. The consumer moves that to the loader's device and
there ranks (value descending, gene id ascending), bins (scGPT) and lays out the tokens with
torch ops: the padded token arrays, often ten times the bytes, are born on the device.

The result is identical, key for key and token for token, to ``tokenize_on="producer"`` with
the same layout and ``token_dtype`` (tested on the CPU device). Supported tokenizers: the
built-in ``geneformer``, ``scgpt`` (quantile bins) and ``raw``.

No step of the device work waits for the device: every size (tokens per batch, width,
non-zeros of the fullest cell) is computed by the producer, and entries that fall beyond
``max_genes`` are scattered into one spare slot dropped at the end instead of being filtered
by a boolean mask (which would synchronise).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from slafload.errors import LayoutError
from slafload.pipeline.layout import Arrays, Layout, _split
from slafload.pipeline.ragged import RAGGED_KEY, Ragged, _builtin
from slafload.pipeline.ranges import expand, run_offsets
from slafload.tokenizers import CLS, GENE_OFFSET, PAD, SEP, Geneformer, Raw, ScGPT, Tokenizer
from slafload.types import Chunk

_CSR = ("csr_genes", "csr_values", "csr_indptr", "csr_out_offsets", "csr_sizes")


@dataclass(frozen=True)
class _Spec:
    """What a built-in tokenizer writes for a cell with ``n`` expressed genes."""

    kind: type
    limit: int  # most gene tokens per cell
    width: int  # the padded layout's width
    first: int  # column of the first gene token (1 after CLS)
    sep_always: bool  # SEP follows the genes even when they fill the row (scGPT)
    n_bins: int = 0
    value_offset: int = 0

    @staticmethod
    def of(tokenizer: Tokenizer) -> _Spec:
        kind, t = _builtin(tokenizer), cast(Any, tokenizer)  # an instance of kind
        if kind is Geneformer:
            w = t.max_genes
            return _Spec(Geneformer, w - 1, w, 1, False)
        if kind is ScGPT and type(t).bins is ScGPT.bins:
            m = t.max_genes
            return _Spec(ScGPT, m, m + 2, 1, True, t.n_bins, t.value_offset)
        if kind is Raw:
            return _Spec(Raw, t.max_genes, t.max_genes, 0, False)
        raise LayoutError(
            f"tokenize_on='device' supports the built-in geneformer, scgpt (quantile bins) "
            f"and raw tokenizers, not {tokenizer.name!r}; use tokenize_on='producer'"
        )

    def lengths(self, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Gene tokens kept and tokens per cell, for ``n`` expressed genes per cell."""
        kept = np.minimum(n, self.limit)
        if self.kind is Raw:
            return kept, kept
        return kept, kept + 1 + (self.sep_always | (kept + 1 < self.width))


@dataclass(frozen=True, eq=False)
class DeviceTokens:
    """The token stage of ``tokenize_on="device"`` (see :mod:`slafload.pipeline.tokenize`)."""

    tokenizer: Tokenizer
    layout: Layout
    spec: _Spec = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", _Spec.of(self.tokenizer))

    def rows(self, piece: Chunk) -> tuple[Arrays, np.ndarray]:
        """The piece's expressed entries in output order, as ragged rows (ranking happens on
        the device).
        """
        c = piece
        genes, values, lengths = c.genes, c.values, c.lengths
        if not np.array_equal(c.order, np.arange(c.n_cells)):
            lengths = lengths[c.order]
            entries = expand(c.indptr[:-1][c.order], lengths)
            genes, values = genes[entries], values[entries]
        expressed = values > 0
        if not expressed.all():
            kept = np.concatenate([[0], np.cumsum(expressed, dtype=np.int64)])
            lengths = np.diff(kept[run_offsets(lengths)])
            genes, values = genes[expressed], values[expressed]
        streams = {"genes": genes.astype(np.int32), "values": _torchable(values)}
        ragged = Ragged(run_offsets(lengths), streams)
        return {RAGGED_KEY: ragged}, c.cell_ids[c.order]

    def finish(self, batch: Arrays) -> dict[str, np.ndarray]:
        """The batch's entries, and the sizes the device needs without asking the device."""
        cells, rows = _split(batch)
        n = rows.lengths
        kept, lengths = self.spec.lengths(n)
        out_offsets = run_offsets(lengths)
        width = self.spec.width if self.layout.name == "padded" else int(lengths.max(initial=0))
        out = {
            "csr_genes": rows.streams["genes"],
            "csr_values": rows.streams["values"],
            "csr_indptr": rows.offsets,
            "csr_out_offsets": out_offsets,
            "csr_sizes": np.array([out_offsets[-1], width, n.max(initial=0)], dtype=np.int64),
        }
        if self.layout.name == "packed":
            out["cu_seqlens"] = out_offsets.astype(np.int32)
        if self.spec.kind is Raw:
            out["lengths"] = kept
        return {**out, **cells}

    def consume(
        self, batch: Mapping[str, torch.Tensor], device: torch.device | None, non_blocking: bool
    ) -> dict[str, torch.Tensor]:
        """Move the batch's entries to ``device`` and tokenize them there."""
        total, width, max_nnz = batch["csr_sizes"].tolist()
        on = device if device is not None else torch.device("cpu")
        moved = {
            k: v.to(on, non_blocking=non_blocking) for k, v in batch.items() if k != "csr_sizes"
        }
        csr = [moved.pop(k) for k in _CSR[:4]]
        tokens = tokenize(
            self.spec, *csr, total=total, width=width, max_nnz=max_nnz,
            packed=self.layout.name == "packed", dtype=_TORCH[self.layout.token_dtype],
        )  # fmt: skip
        return {**tokens, **moved}


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


def _torchable(values: np.ndarray) -> np.ndarray:
    """Values in a dtype torch computes with, keeping the arithmetic numpy does on them.

    Narrow unsigned ints widen to ``int32`` (differences of non-negative values are the same);
    floats keep their width, so scGPT's bin edges round exactly as on the producer.
    """
    if values.dtype.kind == "f":
        return values
    if values.dtype.itemsize <= 2 or values.dtype == np.int32:
        return values.astype(np.int32)
    return values.astype(np.int64)


def tokenize(
    spec: _Spec,
    genes: torch.Tensor,
    values: torch.Tensor,
    indptr: torch.Tensor,
    out_offsets: torch.Tensor,
    *,
    total: int,
    width: int,
    max_nnz: int,
    packed: bool,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Rank, bin and lay out one batch's entries with torch ops on their device."""
    dev, n_cells, m = genes.device, len(indptr) - 1, len(genes)
    n = indptr[1:] - indptr[:-1]
    cell = torch.repeat_interleave(torch.arange(n_cells, device=dev), n, output_size=m)
    # Two stable sorts: value descending, then cell; the rows arrive gene-ascending within a
    # cell, so ties keep gene id ascending, as on the producer.
    by_value = torch.sort(values, descending=True, stable=True).indices
    order = by_value[torch.sort(cell[by_value], stable=True).indices]
    genes, values = genes[order], values[order]
    rank = torch.arange(m, device=dev) - indptr[cell]
    kept = n.clamp(max=spec.limit)
    if packed:
        base, size = out_offsets[:-1], total
    else:
        base, size = torch.arange(n_cells, device=dev) * width, n_cells * width
    spare = size  # the slot where entries beyond max_genes are written, then dropped
    slot = torch.where(rank < spec.limit, base[cell] + spec.first + rank, spare)
    sep = base + spec.first + kept
    if not spec.sep_always:
        sep = torch.where(kept + 1 < spec.width, sep, spare)

    def lay(pad: float, kind: torch.dtype, entries: torch.Tensor, cls=None, sep_value=None):
        if packed:  # CLS, genes and SEP cover every slot
            out = torch.empty(size + 1, dtype=kind, device=dev)
        else:
            out = torch.full((size + 1,), pad, dtype=kind, device=dev)
        if cls is not None:
            out[base] = cls
            out[sep] = sep_value
        out[slot] = entries.to(kind)
        return out[:size] if packed else out[:size].view(n_cells, width)

    if spec.kind is Raw:
        out = {
            "gene_ids": lay(-1, dtype, genes),
            "values": lay(0, torch.float32, values),
        }
    else:
        out = {"input_ids": lay(PAD, dtype, genes + GENE_OFFSET, CLS, SEP)}
        if not packed:
            out["attention_mask"] = out["input_ids"] != PAD
        if spec.kind is ScGPT:
            bins = quantile_bins(values, indptr, cell, rank, spec.n_bins, max_nnz)
            out["values"] = lay(0, dtype, bins + spec.value_offset, 0, 0)
    if packed:
        lengths = out_offsets[1:] - out_offsets[:-1]
        starts = torch.repeat_interleave(base, lengths, output_size=total)
        out["position_ids"] = (torch.arange(total, device=dev) - starts).to(dtype)
    return out


def quantile_bins(
    values: torch.Tensor,
    indptr: torch.Tensor,
    cell: torch.Tensor,
    rank: torch.Tensor,
    n_bins: int,
    max_nnz: int,
) -> torch.Tensor:
    """scGPT's per-cell quantile bin of every ranked entry, as
    :func:`slafload.tokenizers.quantile_bins` computes it (numpy's linear quantiles and
    ``digitize``), with the same floating-point operations in the same order.
    """
    dev, m, n_cells = values.device, len(values), len(indptr) - 1
    if m == 0:
        return torch.zeros(0, dtype=torch.int64, device=dev)
    q = torch.from_numpy(np.linspace(0.0, 1.0, n_bins - 1)).to(dev)  # numpy's exact edges
    count, start = (indptr[1:] - indptr[:-1])[:, None], indptr[:-1, None]
    virtual = (count - 1) * q[None, :]
    floor = torch.floor(virtual)
    prev = torch.minimum(floor.long(), count - 1)
    nxt = torch.minimum(prev + 1, count - 1)
    # values are descending within a cell: ascending index a sits at start + count - 1 - a.
    # Empty cells index nothing real (clamped); their edges are never used.
    lo = values[(start + count - 1 - prev).clamp(0, m - 1)]
    hi = values[(start + count - 1 - nxt).clamp(0, m - 1)]
    t = virtual - floor
    diff = (hi - lo).double()  # in the values' own dtype first, as numpy's _lerp does
    edges = torch.where(t >= 0.5, hi.double() - diff * (1 - t), lo.double() + diff * t)
    grid = torch.zeros(n_cells * max_nnz, dtype=torch.float64, device=dev)
    at = cell * max_nnz + rank
    grid[at] = values.double()
    bins = torch.searchsorted(edges.contiguous(), grid.view(n_cells, max_nnz), right=True)
    return bins.view(-1)[at]
