"""Per-cell normalise-total and ``log1p``: count data onto the log-normalised scale."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from slafload.types import Chunk


@dataclass(frozen=True)
class LogNormalize:
    """Chunk transform: each cell scaled to ``target_sum`` total, then ``log1p`` (float32).

    Scanpy's ``normalize_total`` + ``log1p``; used by ``Mixture(values="log1p")`` to bring
    count sources onto the scale of log-normalised ones. A cell's own gene order is unchanged.
    """

    target_sum: float = 1e4

    def __call__(self, chunk: Chunk) -> Chunk:
        """``chunk`` with each cell's values scaled to ``target_sum`` and ``log1p``-ed."""
        lengths = np.diff(chunk.indptr)
        cell = np.repeat(np.arange(chunk.n_cells), lengths)
        values = chunk.values.astype(np.float64)
        totals = np.bincount(cell, weights=values, minlength=chunk.n_cells)
        scale = np.divide(self.target_sum, totals, out=np.zeros_like(totals), where=totals > 0)
        return dataclasses.replace(chunk, values=np.log1p(values * scale[cell]).astype(np.float32))
