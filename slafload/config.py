"""Loader settings: one frozen, validated dataclass shared by every stage."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoaderConfig:
    """Settings of a :class:`Loader`, validated on construction.

    Attributes:
        batch_size: Cells per training batch.
        max_genes: Sequence budget passed to named tokenizers.
        seed: Seed of every random choice (plans and in-chunk shuffles).
        n_epochs: Epochs per ``iter(loader)``; ``None`` iterates forever.
        shuffle: With no explicit sampler: ``True`` uses :class:`ChunkShuffle`, ``False``
            :class:`Streaming`.
        drop_last: Drop each epoch's short last batch.
        chunk_cells: Cells per prefetch chunk for the default samplers. Larger chunks
            amortise per-chunk overhead; memory grows linearly.
        queue_depth: Batches the producer may run ahead of the consumer.
        read_batch_rows: Rows per Arrow record batch requested from Lance.
    """

    batch_size: int = 32
    max_genes: int = 2048
    seed: int = 0
    n_epochs: int | None = 1
    shuffle: bool = True
    drop_last: bool = False
    chunk_cells: int = 8192
    queue_depth: int = 64
    read_batch_rows: int = 1 << 20

    def __post_init__(self) -> None:
        positive = {
            "batch_size": self.batch_size,
            "max_genes": self.max_genes,
            "chunk_cells": self.chunk_cells,
            "queue_depth": self.queue_depth,
            "read_batch_rows": self.read_batch_rows,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_epochs is not None and (not isinstance(self.n_epochs, int) or self.n_epochs < 1):
            raise ValueError(f"n_epochs must be a positive integer or None, got {self.n_epochs!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
