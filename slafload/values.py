"""Deprecated: moved to :mod:`slafload.tokenizers.values`."""

from slafload._deprecated import moved

__getattr__ = moved(
    "slafload.values",
    {
        "WithValues": "slafload.tokenizers.values",
    },
)
