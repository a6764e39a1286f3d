"""Vectorized helpers for half-open integer ranges, shared by samplers and tokenizers."""

from __future__ import annotations

import numpy as np


def expand(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + n)`` for every ``(s, n)`` without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.repeat(np.asarray(starts, dtype=np.int64) - np.cumsum(lengths) + lengths, lengths)
    out += np.arange(len(out), dtype=np.int64)
    return out
