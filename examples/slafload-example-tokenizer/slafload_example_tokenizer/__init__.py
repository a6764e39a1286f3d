"""A Transcriptformer-like slafload tokenizer: aligned (gene, count) pairs per cell.

Registered in ``pyproject.toml`` under the ``slafload.tokenizers`` entry-point group as
``gene_count_pairs``, so ``slafload.Loader(ds, tokenizer="gene_count_pairs")`` finds it once
this package is installed. It uses only slafload's public ``RankedChunk`` helpers and is
vectorized over the whole chunk (no per-cell loop), as the protocol asks.
"""

from __future__ import annotations

import numpy as np

from slafload.tokenizers import GENE_OFFSET, PAD
from slafload.types import RankedChunk

__all__ = ["GeneCountPairs"]
__version__ = "0.1.0"


class GeneCountPairs:
    """Each cell's top ``max_genes`` genes with their counts, highest first.

    Output (all ``[n_cells, max_genes]``): ``gene_ids`` int64 (gene id + 4, PAD=0),
    ``counts`` float32 (raw value clipped at ``count_cap``, 0 on padding), and
    ``attention_mask`` bool.
    """

    name = "gene_count_pairs"

    def __init__(self, *, max_genes: int = 2048, count_cap: float = 30.0):
        if not isinstance(max_genes, int) or max_genes < 1:
            raise ValueError(f"max_genes must be a positive integer, got {max_genes!r}")
        if not count_cap > 0:
            raise ValueError(f"count_cap must be positive, got {count_cap!r}")
        self.max_genes = max_genes
        self.count_cap = float(count_cap)

    def __call__(self, ranked: RankedChunk) -> dict[str, np.ndarray]:
        shape = (ranked.n_cells, self.max_genes)
        gene_ids = np.full(shape, PAD, dtype=np.int64)
        counts = np.zeros(shape, dtype=np.float32)
        keep = ranked.top(self.max_genes)
        rows, cols = ranked.entry_row[keep], ranked.entry_rank[keep]
        gene_ids[rows, cols] = ranked.genes[keep].astype(np.int64) + GENE_OFFSET
        counts[rows, cols] = np.minimum(ranked.values[keep], self.count_cap)
        return {"gene_ids": gene_ids, "counts": counts, "attention_mask": gene_ids != PAD}
