"""Stage 6: tokenize each ranked piece, and attach its cell ids and obs codes.

The tokenizer (a :class:`~slafload.types.Tokenizer`: built-ins and plugins live in
:mod:`slafload.tokenizers`) turns a whole piece into row-aligned arrays in one vectorized
pass; this stage adds ``cell_integer_id`` and the requested obs columns as ``int64`` codes,
row for row.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from slafload.stage import Stage
from slafload.types import Arrays, RankedChunk, Tokenizer


class Tokenize(Stage[Arrays]):
    """Row-aligned arrays of each piece: the tokenizer's, ``cell_integer_id``, obs codes.

    Args:
        source: Ranked pieces.
        tokenizer: Maps a ranked piece to arrays with one row per output cell.
        obs: Obs column name to ``int64`` code per cell id, added to every batch.
    """

    def __init__(
        self,
        source: Iterator[RankedChunk],
        tokenizer: Tokenizer,
        obs: Mapping[str, np.ndarray] | None = None,
    ):
        super().__init__(source)
        self.tokenizer = tokenizer
        self.obs = dict(obs or {})

    def __next__(self) -> Arrays:
        ranked = next(self.source)
        arrays = dict(self.tokenizer(ranked))
        cells = ranked.output_cell_ids
        arrays["cell_integer_id"] = cells
        for name, codes in self.obs.items():
            arrays[name] = codes[cells]
        return arrays
