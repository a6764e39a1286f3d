"""Deprecated: gene ranking is :mod:`slafload.ranking`; ``RankedChunk`` is in :mod:`slafload.types`."""

from slafload._deprecated import moved

__getattr__ = moved(
    "slafload.rank",
    {
        "RankedChunk": "slafload.types",
        "PendingRank": "slafload.ranking",
        "rank": "slafload.ranking",
        "start_rank": "slafload.ranking",
    },
)
