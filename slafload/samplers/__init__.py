"""Samplers decide which cells are read, in which order, for each epoch."""

from slafload.samplers.base import Fetch, Plan, Sampler, bind_batch_size, derive_seed
from slafload.samplers.block import BlockShuffle
from slafload.samplers.feistel import FeistelPermutation
from slafload.samplers.sequential import ChunkShuffle, Streaming
from slafload.samplers.subset import Subset
from slafload.samplers.weighted import ClassBalanced, Weighted

__all__ = [
    "BlockShuffle",
    "ChunkShuffle",
    "ClassBalanced",
    "FeistelPermutation",
    "Fetch",
    "Plan",
    "Sampler",
    "Streaming",
    "Subset",
    "Weighted",
    "bind_batch_size",
    "derive_seed",
]
