"""Rank and world size, found without any communication between ranks.

Precedence: explicit arguments, then an initialized ``torch.distributed`` process group, then
the ``RANK`` / ``WORLD_SIZE`` environment variables that ``torchrun`` sets, then a single rank.
slafload never calls a collective: every rank derives its share of each epoch from
``(seed, epoch, rank, world_size)`` alone (see :mod:`slafload.pipeline.partition`).
"""

from __future__ import annotations

import os

import torch.distributed as dist


def resolve_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` for this process.

    Raises:
        ValueError: only one of ``rank``/``world_size`` given, or ``rank`` out of range.
    """
    if (rank is None) != (world_size is None):
        raise ValueError(
            "pass both rank and world_size, or neither (then they come from "
            "torch.distributed or the RANK/WORLD_SIZE environment variables)"
        )
    if rank is None:
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        elif "WORLD_SIZE" in os.environ:
            rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
        else:
            rank, world_size = 0, 1
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    return rank, world_size
