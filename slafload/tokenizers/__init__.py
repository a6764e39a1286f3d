"""Tokenizers: turn a ranked chunk into row-aligned token arrays (the token stage's add-ons).

Built-ins (:mod:`slafload.tokenizers.builtin`): ``geneformer``, ``scgpt``, ``raw``, with
slafdb 0.5.2's token conventions, and ``sparse`` (:mod:`slafload.tokenizers.sparse`): each
cell's whole expression as CSR. Variants: scGPT with fixed-width bins
(:mod:`slafload.tokenizers.binning`) and expression values beside gene tokens
(:mod:`slafload.tokenizers.values`). Published models' own vocabularies are presets
(:mod:`slafload.presets`). Third-party tokenizers register under the ``slafload.tokenizers``
entry-point group and are found by :func:`make_tokenizer`.
"""

from slafload.tokenizers.binning import ScGPTFixedBins, fixed_bins
from slafload.tokenizers.builtin import (
    CLS,
    ENTRY_POINT_GROUP,
    GENE_OFFSET,
    MASK,
    PAD,
    SEP,
    VALUE_OFFSET,
    Geneformer,
    Raw,
    ScGPT,
    available_tokenizers,
    make_tokenizer,
    quantile_bins,
)
from slafload.tokenizers.sparse import Sparse, sparse_csr
from slafload.tokenizers.values import WithValues
from slafload.types import Tokenizer

__all__ = [
    "CLS",
    "ENTRY_POINT_GROUP",
    "GENE_OFFSET",
    "MASK",
    "PAD",
    "SEP",
    "VALUE_OFFSET",
    "Geneformer",
    "Raw",
    "ScGPT",
    "ScGPTFixedBins",
    "Sparse",
    "Tokenizer",
    "WithValues",
    "available_tokenizers",
    "fixed_bins",
    "make_tokenizer",
    "quantile_bins",
    "sparse_csr",
]
