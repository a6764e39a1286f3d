"""Opt-in expression values alongside gene tokens, for models that take both.

:class:`WithValues` wraps a tokenizer whose ``input_ids`` put a cell's rank-``r`` gene at
column ``r + 1`` after ``[CLS]`` (``geneformer``, ``scgpt``,
:class:`~slafload.tokenizers.binning.ScGPTFixedBins`) and adds a ``float32`` array of the
same shape holding each gene token's expression value (``0`` at CLS, SEP and padding)::

    Loader(ds, tokenizer=WithValues(Geneformer(max_genes=2048)))        # adds "values"
    Loader(ds, tokenizer=WithValues(ScGPT(), key="expression"))         # scgpt has "values"

The values are those the ranking saw: raw counts, or ``value / median`` after a
:class:`~slafload.transforms.normalize.MedianNormalize` transform.
"""

from __future__ import annotations

import numpy as np

from slafload.tokenizers.builtin import GENE_OFFSET, Tokenizer
from slafload.types import RankedChunk


class WithValues:
    """Adds ``key``: the expression value behind every gene token of ``input_ids``.

    Args:
        tokenizer: The wrapped tokenizer; its output must have ``input_ids`` with the rank-r
            gene at column ``r + 1``.
        key: Name of the added array; must not collide with the wrapped tokenizer's keys.
    """

    def __init__(self, tokenizer: Tokenizer, *, key: str = "values"):
        self.tokenizer, self.key = tokenizer, key
        self.name = f"{tokenizer.name}+{key}"

    def __call__(self, ranked: RankedChunk) -> dict[str, np.ndarray]:
        """The wrapped tokenizer's arrays plus the values aligned with ``input_ids``."""
        out = dict(self.tokenizer(ranked))
        if self.key in out or "input_ids" not in out:
            raise ValueError(
                f"WithValues needs a tokenizer emitting input_ids and no {self.key!r}; "
                f"{self.tokenizer.name!r} emits {sorted(out)}: pass another key="
            )
        ids = out["input_ids"]
        values = np.zeros(ids.shape, dtype=np.float32)
        keep = np.flatnonzero(ranked.entry_rank < ids.shape[1] - 1)
        rows, cols = ranked.entry_row[keep], ranked.entry_rank[keep] + 1
        # Only where the wrapped tokenizer put this very gene (e.g. not over a truncated SEP).
        placed = ids[rows, cols] == ranked.genes[keep].astype(np.int64) + GENE_OFFSET
        values[rows[placed], cols[placed]] = ranked.values[keep[placed]]
        out[self.key] = values
        return out
