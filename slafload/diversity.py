"""Minibatch diversity measures (public face of :mod:`slafload.tools.diversity`)."""

from slafload.tools.diversity import batch_entropy, entropy, entropy_bounds, mean_batch_entropy

__all__ = ["batch_entropy", "entropy", "entropy_bounds", "mean_batch_entropy"]
