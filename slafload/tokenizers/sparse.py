"""The ``sparse`` tokenizer: each cell's whole expression as CSR, for count models.

A scVI-style model reads every expressed gene of a cell in gene order, with its count: no
ranking, no sequence budget, no padding. :class:`Sparse` declares that it needs no ranking
(``ranks_genes = False``), so the token stage gathers each cell's entries as the chunk holds
them (genes ascending within a cell, see :class:`~slafload.types.Chunk`) and lays them out
back to back (:mod:`slafload.pipeline.layout`'s packed layout, without ``position_ids``).
A batch is then CSR: ``gene_ids`` (the column indices, in the ``token_dtype``), ``values``
(``float32``) and ``cu_seqlens`` (``int32`` row offsets), with ``cell_integer_id`` and the obs
columns beside them; :func:`sparse_csr` turns it into a ``torch.sparse_csr_tensor``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from slafload.errors import LayoutError
from slafload.types import RankedChunk

if TYPE_CHECKING:  # torch is imported where a batch is made into a tensor, not with slafload
    import torch


class Sparse:
    """Each cell's expressed genes in ascending gene id with their values, all of them.

    For count models (scVI-style) that read a cell's whole expression in gene order: the
    token stage skips ranking (:attr:`ranks_genes` is false: a chunk's genes are already
    ascending within each cell) and gathers each cell's entries as they are, none dropped,
    so there is no sequence budget. Its batches are CSR, in the packed layout only
    (``gene_ids`` in the ``token_dtype``, ``values`` ``float32``, ``cu_seqlens`` ``int32``;
    no ``position_ids``, no ``lengths``): :func:`sparse_csr` makes a
    ``torch.sparse_csr_tensor`` of one. The loader picks ``layout="packed"`` for it.

    Raises:
        ValueError: ``max_genes`` is given: every expressed gene is kept.
    """

    name = "sparse"
    ranks_genes = False
    takes_max_genes = False

    def __init__(self, *, max_genes: int | None = None):
        if max_genes is not None:
            raise ValueError(
                f"tokenizer 'sparse' keeps every expressed gene of each cell and takes no "
                f"max_genes (got {max_genes!r}); leave max_genes unset, or use tokenizer='raw' "
                "for the top max_genes genes of each cell"
            )

    def __call__(self, ranked: RankedChunk) -> dict[str, np.ndarray]:
        """Not callable for padded rows: its output is CSR (see the class docstring).

        Raises:
            LayoutError: always; the token stage gathers its CSR rows itself.
        """
        raise LayoutError(
            "tokenizer 'sparse' makes CSR batches, not padded rows: use it through a Loader "
            "with layout='packed' (its default)"
        )


def sparse_csr(
    batch: Mapping[str, torch.Tensor], n_genes: int, *, check_invariants: bool = False
) -> torch.Tensor:
    """A ``sparse`` batch as a ``torch.sparse_csr_tensor`` of shape ``(cells, n_genes)``.

    Row ``i`` is the batch's cell ``i`` (``batch["cell_integer_id"][i]``), column ``g`` gene
    id ``g``; the tensor shares the batch's ``gene_ids`` and ``values`` and is on their
    device. ``n_genes`` is the dataset's gene count (``loader.dataset.n_genes``; every gene id
    must be below it). The same as ``torch.sparse_csr_tensor(batch["cu_seqlens"].to(
    batch["gene_ids"].dtype), batch["gene_ids"], batch["values"], (len(batch["cu_seqlens"]) -
    1, n_genes))``; ``check_invariants=True`` has torch check the offsets and column indices
    (a pass over the batch). torch warns once per process that its CSR support is in beta.

    Raises:
        LayoutError: ``batch`` lacks ``cu_seqlens``, ``gene_ids`` or ``values`` (it is not
            a ``sparse`` tokenizer's batch).
    """
    missing = {"cu_seqlens", "gene_ids", "values"} - set(batch)
    if missing:
        raise LayoutError(
            f"sparse_csr needs a batch of tokenizer='sparse' (cu_seqlens, gene_ids, values); "
            f"this one lacks {sorted(missing)} and holds {sorted(batch)}"
        )
    import torch

    columns = batch["gene_ids"]
    rows = batch["cu_seqlens"].to(columns.dtype)
    shape = (len(rows) - 1, n_genes)
    return torch.sparse_csr_tensor(
        rows, columns, batch["values"], shape, check_invariants=check_invariants
    )
