"""A reusable resume-conformance check for any loader configuration.

``assert_resumes_exactly(make_loader, ...)`` runs the loader uninterrupted, then for many
random midpoints stops after ``k`` batches, round-trips ``state_dict()`` through JSON into a
fresh loader and continues: the batches before and after must equal the uninterrupted run,
batch for batch, tensor for tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import torch

from slafload import Loader


def _take(loader: Loader, n: int) -> list[dict[str, torch.Tensor]]:
    out = []
    if n == 0:
        return out
    for batch in loader:
        out.append({k: v.clone() for k, v in batch.items()})
        if len(out) == n:
            break
    return out


def assert_resumes_exactly(
    make_loader: Callable[[], Loader], *, midpoints: int = 20, seed: int = 0
) -> None:
    with make_loader() as loader:
        reference = _take(loader, 10**9)
    assert reference, "the loader delivered nothing"
    rng = np.random.default_rng(seed)
    points = sorted({0, len(reference), *rng.integers(0, len(reference) + 1, midpoints).tolist()})
    for k in points:
        with make_loader() as first:
            before = _take(first, k)
            state = json.loads(json.dumps(first.state_dict()))
        with make_loader() as second:
            second.load_state_dict(state)
            after = _take(second, len(reference) - k)
        got = before + after
        assert len(got) == len(reference), f"resume at batch {k}: {len(got)} batches"
        for i, (a, b) in enumerate(zip(got, reference, strict=True)):
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(a[key], b[key]), f"resume at {k}: batch {i} key {key} differs"
