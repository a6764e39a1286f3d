"""A seeded pseudo-random permutation of ``[0, n)`` in O(1) memory: a Feistel network with
cycle walking (Black and Rogaway, "Ciphers with arbitrary finite domains", 2002).

Shuffling 100M cells (or blocks) with ``rng.permutation`` allocates an 800 MB index array before
the first batch. A Feistel network is a bijection on ``2h``-bit integers built from any round
function of ``h``-bit halves; cycle walking (re-encrypting until the value lands below ``n``)
restricts it to ``[0, n)`` while staying a bijection. Evaluating ``perm[i]`` for a slice of
``i`` costs a few vectorized integer operations per element, and nothing else is stored.
"""

from __future__ import annotations

import numbers

import numpy as np

__all__ = ["FeistelPermutation"]

_MIX1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 finalizer constants
_MIX2 = np.uint64(0x94D049BB133111EB)
_MAX_N = 1 << 62


class FeistelPermutation:
    """A bijection ``[0, n) -> [0, n)`` keyed by ``seed``; ``perm(i)`` is vectorized.

    Args:
        n: Domain size, in [1, 2**62].
        seed: Non-negative integer key; the same ``(n, seed)`` always gives the same permutation.
        rounds: Feistel rounds (>= 4 gives a strong pseudo-random permutation, Luby-Rackoff).

    >>> perm = FeistelPermutation(10, seed=7)
    >>> sorted(perm(np.arange(10)).tolist()) == list(range(10))
    True
    """

    def __init__(self, n: int, *, seed: int, rounds: int = 6) -> None:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= _MAX_N:
            raise ValueError(f"n must be an integer in [1, 2**62], got {n!r}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if isinstance(rounds, bool) or not isinstance(rounds, numbers.Integral) or rounds < 4:
            raise ValueError(f"rounds must be an integer >= 4, got {rounds!r}")
        self.n: int = int(n)
        self.seed: int = int(seed)
        # Balanced halves of h bits each: the smallest even-width domain 4**h >= n, so cycle
        # walking needs at most 4 tries per element on average.
        self._half: int = max(1, ((self.n - 1).bit_length() + 1) // 2)
        self._mask: np.uint64 = np.uint64((1 << self._half) - 1)
        self._keys: np.ndarray = np.random.SeedSequence([self.seed, self.n]).generate_state(
            rounds, np.uint64
        )

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        return f"FeistelPermutation(n={self.n}, seed={self.seed}, rounds={len(self._keys)})"

    def __call__(self, indices: np.ndarray | int) -> np.ndarray:
        """``perm[i]`` for every ``i`` in ``indices`` (each in ``[0, n)``), as ``int64``."""
        return self._walk(indices, self._encrypt)

    def inverse(self, values: np.ndarray | int) -> np.ndarray:
        """``i`` such that ``perm[i] == v`` for every ``v`` in ``values`` (each in ``[0, n)``)."""
        return self._walk(values, self._decrypt)

    def _walk(self, items: np.ndarray | int, step) -> np.ndarray:
        x = np.array(items, dtype=np.int64, ndmin=1)
        if len(x) and (x.min() < 0 or x.max() >= self.n):
            raise IndexError(f"arguments must lie in [0, {self.n}), got [{x.min()}, {x.max()}]")
        out = step(x.astype(np.uint64))
        outside = np.flatnonzero(out >= np.uint64(self.n))
        while len(outside):  # cycle walking: every cycle of the 4**h permutation meets [0, n)
            out[outside] = step(out[outside])
            outside = outside[out[outside] >= np.uint64(self.n)]
        return out.astype(np.int64).reshape(np.shape(items))

    def _decrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self._half)
        left, right = x >> h, x & self._mask
        for key in self._keys[::-1]:
            left, right = right ^ self._round(left, key), left
        return (left << h) | right

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self._half)
        left, right = x >> h, x & self._mask
        for key in self._keys:
            left, right = right, left ^ self._round(right, key)
        return (left << h) | right

    def _round(self, half: np.ndarray, key: np.uint64) -> np.ndarray:
        z = half + key  # uint64 arrays wrap silently, as the mixing function wants
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return (z ^ (z >> np.uint64(31))) & self._mask
