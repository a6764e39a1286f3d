"""Stage 6: tokenize each ranked piece, and attach its cell ids and obs codes.

The token stage (:mod:`slafload.pipeline.layout`: the tokenizer, a :class:`~slafload.types.Tokenizer`
from :mod:`slafload.tokenizers`, in the loader's layout and placement) turns a whole piece
into row-aligned arrays in one vectorized pass; this stage adds ``cell_integer_id`` and the
requested obs columns as ``int64`` codes, row for row. :func:`make_token_stage` picks the
token stage the loader's config asks for: on the host, or on the training device
(:mod:`slafload.pipeline.device_tokenize`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from slafload.config import LoaderConfig
from slafload.kernels import Kernels
from slafload.pipeline.buffers import RowBuffers
from slafload.pipeline.layout import HostTokens, TokenStage, check_value_tokens, make_layout
from slafload.pipeline.partition import Tagged
from slafload.pipeline.stage import Stage
from slafload.types import Arrays, Tokenizer


class Tokenize(Stage[Tagged[Arrays]]):
    """Row-aligned arrays of each piece: the tokenizer's, ``cell_integer_id``, obs codes.

    Args:
        source: Pieces whose token work was started (:class:`~slafload.pipeline.ranking.RankGenes`).
        tokens: The token stage that started them; it completes them here.
        obs: Obs column name to ``int64`` code per cell id, added to every batch: an array,
            or anything indexable by an ``int64`` array of cell ids (a mixture's lookups).
            They are written after ``cell_integer_id``, so a mixture's ``cell_integer_id``
            column replaces its global cell ids by ids within each source.
    """

    def __init__(
        self,
        source: Iterator[Tagged[Any]],
        tokens: TokenStage,
        obs: Mapping[str, np.ndarray] | None = None,
    ):
        super().__init__(source)
        self.tokens = tokens
        self.obs = dict(obs or {})

    def __next__(self) -> Tagged[Arrays]:
        piece = next(self.source)
        arrays, cells = self.tokens.rows(piece.item)
        arrays = dict(arrays)
        arrays["cell_integer_id"] = cells
        for name, codes in self.obs.items():
            arrays[name] = codes[cells]
        return piece.then(arrays)


def make_token_stage(tokenizer: Tokenizer, config: LoaderConfig, kernels: Kernels) -> TokenStage:
    """The token stage ``config.tokenize_on`` and ``config.layout`` ask for, its per-cell
    loops run through ``kernels`` (whose owner closes them).
    """
    layout = make_layout(config.layout, config.token_dtype)
    check_value_tokens(tokenizer, layout.token_dtype)
    if config.tokenize_on == "device":
        from slafload.pipeline.device_tokenize import DeviceTokens

        return DeviceTokens(tokenizer, layout)
    return HostTokens(
        tokenizer,
        layout,
        RowBuffers(rows=config.tuning.piece_cells),
        kernels,
    )
