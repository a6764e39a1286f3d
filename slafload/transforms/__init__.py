"""Chunk transforms: rewrite each shuffled chunk before ranking (add-ons of the transform stage).

A transform is any callable ``Chunk -> Chunk`` that keeps the chunk's cells
(:class:`~slafload.types.ChunkTransform`); pass them as ``Loader(transforms=[...])``.

- :mod:`slafload.transforms.vocab`: gene vocabularies shared by datasets with different gene
  orders (:class:`Vocabulary`, its :class:`GeneRemap` transform).
- :mod:`slafload.transforms.lognorm`: per-cell normalise-total and ``log1p``
  (:class:`LogNormalize`; a mixture's ``values="log1p"``).
- :mod:`slafload.transforms.normalize`: Geneformer's per-gene median normalisation
  (:class:`GeneMedians`, :func:`gene_medians`, :class:`MedianNormalize`).
"""

from slafload.transforms.lognorm import LogNormalize
from slafload.transforms.normalize import GeneMedians, MedianNormalize, gene_medians
from slafload.transforms.vocab import UNKNOWN_RULES, GeneRemap, Vocabulary

__all__ = [
    "UNKNOWN_RULES",
    "GeneMedians",
    "GeneRemap",
    "LogNormalize",
    "MedianNormalize",
    "Vocabulary",
    "gene_medians",
]
