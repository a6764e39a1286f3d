"""Opt-in scGPT binning choices beyond the default per-cell quantile bins.

The built-in ``scgpt`` tokenizer bins like scGPT (per-cell quantiles, see
:func:`slafload.tokenizers.quantile_bins`). :class:`ScGPTFixedBins` keeps its exact layout
(``input_ids``, ``attention_mask``, ``values`` of width ``max_genes + 2``) but fills
``values`` with slafdb's fixed-width bins instead::

    Loader(ds, tokenizer=ScGPTFixedBins(max_genes=1024, n_bins=10))

What slafdb 0.5.2 does (``slaf/ml/aggregators.py``, ``ScGPTWindow.apply`` with
``use_binned_expressions=True``): it keeps the genes of dense expression rank
``<= max_genes``, takes ``log1p`` of their values, and bins each as
``floor(log1p(x) * n_bins / max(log1p(x) over the cell))`` clipped to ``[0, n_bins - 1]``:
``n_bins`` equal-width bins over ``[0, log1p(cell max)]``, the cell's maximum landing in the top
bin. Its loader never uses those bins by default (``use_binned_expressions=False``, so
``values`` carry raw counts); and when enabled, the window emits the bins as floats, which
``ScGPTTokenizer`` bins a second time (``int(bin * n_bins)`` clipped), so every bin >= 1
collapses into the top token and bin 0 becomes PAD. slafload implements the window's
formula: the value token is ``bin + value_offset`` for every kept gene, bin 0 included.
"""

from __future__ import annotations

import numpy as np

from slafload.tokenizers.builtin import VALUE_OFFSET, ScGPT
from slafload.types import RankedChunk


def fixed_bins(ranked: RankedChunk, n_bins: int) -> np.ndarray:
    """slafdb's fixed-width log1p bins of every entry of ``ranked`` (``int64``, 0..n_bins-1).

    Each cell's values are in descending order, so the cell maximum is its first entry.
    """
    logs = np.log1p(ranked.values.astype(np.float64))
    if not len(logs):
        return np.zeros(0, dtype=np.int64)
    top = logs[ranked.indptr[:-1][ranked.entry_cell]]
    bins = np.floor(logs * n_bins / top)
    return np.clip(bins, 0, n_bins - 1).astype(np.int64)


class ScGPTFixedBins(ScGPT):
    """The ``scgpt`` layout with slafdb's fixed-width log1p bins in ``values``.

    Args:
        max_genes: Gene tokens per cell (width ``max_genes + 2``), top genes by expression.
        n_bins: Bins ``0..n_bins-1`` (slafdb's default is 10).
        value_offset: Added to every bin (slafdb's 50,000).
    """

    name = "scgpt_fixed"
    min_bins = 1

    def __init__(
        self, *, max_genes: int = 1024, n_bins: int = 10, value_offset: int = VALUE_OFFSET
    ):
        super().__init__(max_genes=max_genes, n_bins=n_bins, value_offset=value_offset)

    def bins(self, ranked: RankedChunk) -> np.ndarray:
        """Fixed-width value bins of every ranked entry."""
        return fixed_bins(ranked, self.n_bins)
