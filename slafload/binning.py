"""Deprecated: moved to :mod:`slafload.tokenizers.binning`."""

from slafload._deprecated import moved

__getattr__ = moved(
    "slafload.binning",
    {
        "ScGPTFixedBins": "slafload.tokenizers.binning",
        "fixed_bins": "slafload.tokenizers.binning",
    },
)
