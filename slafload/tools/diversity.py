"""Minibatch diversity: the Shannon entropy (bits) of a categorical label within minibatches.

On data stored plate by plate, a loader that reads contiguous chunks gives minibatches of one
plate (entropy near 0); uniform random sampling gives close to the entropy ``H(p)`` of the
label's overall distribution. The scDataset paper bounds the expected plug-in entropy of a
minibatch of ``m`` cells built from blocks of ``b`` contiguous cells (``K`` classes, class
proportions ``p``):

    H(p) - (K - 1) b / (2 m ln 2)  <=  E[H]  <=  H(p) - (K - 1) / (2 m ln 2)

The upper bound is the small-sample bias of the plug-in estimator (Miller-Madow), reached by
random sampling (``b = 1``); the lower bound is the same bias with ``m / b`` effective draws.

>>> batch_entropy(np.array([0, 0, 1, 1]))
1.0
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

__all__ = ["batch_entropy", "entropy", "entropy_bounds", "mean_batch_entropy"]


def entropy(p: np.ndarray) -> float:
    """Shannon entropy in bits of a distribution (normalised here; zeros ignored)."""
    p = np.asarray(p, dtype=np.float64)
    if p.ndim != 1 or (p < 0).any() or not p.sum() > 0:
        raise ValueError("p must be a 1-d array of non-negative numbers with a positive sum")
    p = p[p > 0] / p.sum()
    return float(-(p * np.log2(p)).sum())


def batch_entropy(labels: np.ndarray) -> float:
    """Entropy in bits of the label frequencies of one minibatch (integer or string labels)."""
    labels = np.asarray(labels)
    if labels.size == 0:
        raise ValueError("a minibatch needs at least one label")
    _, counts = np.unique(labels, return_counts=True)
    return entropy(counts)


def mean_batch_entropy(batches: Iterable[np.ndarray]) -> float:
    """Mean of :func:`batch_entropy` over minibatches (each an array of labels)."""
    values = [batch_entropy(b) for b in batches]
    if not values:
        raise ValueError("mean_batch_entropy needs at least one minibatch")
    return float(np.mean(values))


def entropy_bounds(
    p: np.ndarray, *, block_size: int, batch_size: int, n_classes: int | None = None
) -> tuple[float, float]:
    """The scDataset paper's ``(lower, upper)`` bounds on the expected minibatch entropy.

    Args:
        p: Class proportions (or counts) over the dataset.
        block_size: ``b``, contiguous cells per sampled block.
        batch_size: ``m``, cells per minibatch.
        n_classes: ``K``; default: the number of classes with positive proportion.

    The bounds are asymptotic (large ``m / b``): the lower one may be negative, and the upper
    one is approached only when ``m`` is large compared with ``K``.
    """
    if block_size < 1 or batch_size < 1:
        raise ValueError(f"block_size and batch_size must be >= 1, got {block_size}, {batch_size}")
    h = entropy(p)
    k = int((np.asarray(p) > 0).sum()) if n_classes is None else n_classes
    bias = (k - 1) / (2 * batch_size * math.log(2))
    return h - bias * block_size, h - bias
