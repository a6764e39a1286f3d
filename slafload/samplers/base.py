"""The sampler contract: a deterministic plan of fetches per epoch.

The contract itself (:class:`Fetch`, :class:`Plan`, :class:`Sampler`) lives in
:mod:`slafload.types`; this module holds what samplers share. A sampler decides *which cells,
in which order*. For an epoch it returns a :class:`Plan`, an
ordered sequence of :class:`Fetch` objects; each fetch is a list of contiguous cell ranges that
the reader turns into one prefetch chunk, plus the seed of the in-memory shuffle applied to
that chunk. Planning is pure index arithmetic on ``(seed, epoch)``: no I/O, no global RNG.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Self

import numpy as np

from slafload.types import Fetch, Plan, Sampler, shuffle_order

__all__ = [
    "Fetch",
    "MinibatchFetches",
    "Plan",
    "Sampler",
    "array_digest",
    "bind_batch_size",
    "derive_seed",
    "shuffle_order",
]


class MinibatchFetches:
    """Mixin of dataclass samplers whose ``fetch_factor`` counts minibatches.

    Such a sampler needs the loader's minibatch size to size its fetches. A user gives the
    batch size once, to the :class:`~slafload.Loader`, which binds it with
    :func:`bind_batch_size`; ``batch_size`` is given to the sampler itself only to plan
    without a loader (tests, docs, notebooks).
    """

    batch_size: int | None

    def with_batch_size(self, batch_size: int) -> Self:
        """This sampler planning for minibatches of ``batch_size`` cells.

        Raises:
            ValueError: the sampler was built with another ``batch_size``.
        """
        if self.batch_size is None:
            return dataclasses.replace(self, batch_size=batch_size)  # type: ignore[type-var]
        if self.batch_size != batch_size:
            raise ValueError(
                f"{type(self).__name__} was built with batch_size={self.batch_size} but the "
                f"loader uses batch_size={batch_size}; give the batch size once, to the "
                "loader, and leave the sampler's batch_size unset"
            )
        return self

    def _minibatch(self) -> int:
        if self.batch_size is None:
            raise ValueError(
                f"{type(self).__name__} needs the minibatch size to size its fetches: pass "
                "it to slafload.Loader(batch_size=...), which sets it, or give "
                f"{type(self).__name__}(batch_size=...) to plan without a loader"
            )
        return self.batch_size


def bind_batch_size(sampler: Sampler, batch_size: int) -> Sampler:
    """``sampler`` planning for the loader's ``batch_size`` (unchanged if it does not care)."""
    bind = getattr(sampler, "with_batch_size", None)
    return sampler if bind is None else bind(batch_size)


def array_digest(values: np.ndarray) -> str:
    """A short content hash, so ``repr`` (recorded in checkpoints) tells arrays apart."""
    values = np.ascontiguousarray(values)
    return f"{len(values)}x{values.dtype}:{hashlib.blake2b(values.data, digest_size=6).hexdigest()}"


def derive_seed(*parts: int) -> int:
    """A 63-bit seed derived from integer parts, independent across parts."""
    return int(
        np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0]
        >> np.uint64(1)
    )
