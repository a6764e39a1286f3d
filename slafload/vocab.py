"""Deprecated: moved to :mod:`slafload.transforms.vocab`."""

from slafload._deprecated import moved

__getattr__ = moved(
    "slafload.vocab",
    {
        "FORMAT": "slafload.transforms.vocab",
        "FORMAT_VERSION": "slafload.transforms.vocab",
        "UNKNOWN_RULES": "slafload.transforms.vocab",
        "GeneRemap": "slafload.transforms.vocab",
        "Vocabulary": "slafload.transforms.vocab",
    },
)
