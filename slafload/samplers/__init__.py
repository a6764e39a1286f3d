"""Stage 2: samplers decide which cells are read, in which order, for each epoch."""

from slafload.samplers.base import Fetch, Plan, Sampler, derive_seed
from slafload.samplers.sequential import ChunkShuffle, Streaming

__all__ = ["ChunkShuffle", "Fetch", "Plan", "Sampler", "Streaming", "derive_seed"]
