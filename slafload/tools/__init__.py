"""Offline tools, apart from the runtime: writing and converting datasets, synthetic atlases,
benchmarks, the tuner and the ``slafload`` command line.

None of these run inside a training loop; the runtime (:mod:`slafload`) never imports them,
except :func:`slafload.convert` and :mod:`slafload.synthetic`/:mod:`slafload.diversity`, which
the package re-exports for convenience.
"""
