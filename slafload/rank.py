"""Deprecated: gene ranking is :mod:`slafload.pipeline.ranking`; ``RankedChunk`` is in :mod:`slafload.types`."""

from slafload._deprecated import moved

__getattr__ = moved(
    "slafload.rank",
    {
        "RankedChunk": "slafload.types",
        "PendingRank": "slafload.pipeline.ranking",
        "rank": "slafload.pipeline.ranking",
        "start_rank": "slafload.pipeline.ranking",
    },
)
