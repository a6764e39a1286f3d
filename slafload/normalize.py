"""Deprecated: moved to :mod:`slafload.transforms.normalize`."""

from slafload._deprecated import moved

__getattr__ = moved(
    "slafload.normalize",
    {
        "DEFAULT_MAX_VALUES": "slafload.transforms.normalize",
        "FORMAT": "slafload.transforms.normalize",
        "GeneMedians": "slafload.transforms.normalize",
        "MedianNormalize": "slafload.transforms.normalize",
        "gene_medians": "slafload.transforms.normalize",
    },
)
