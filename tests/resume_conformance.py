"""A reusable resume-conformance check for any loader configuration.

``assert_resumes_exactly(make_loader, ...)`` runs the loader uninterrupted, then for many
random midpoints (always including some in the last epoch) stops after ``k`` batches,
round-trips ``state_dict()`` through JSON into a fresh loader and lets it run to its end: the
batches before and after must equal the uninterrupted run batch for batch, tensor for tensor,
*and in total* (a resumed run may not run extra epochs), and iterating the finished loader
again yields nothing (a :class:`~slafload.Mixture` of datasets is one more ``make_loader``:
see ``tests/data/test_mixture.py``). ``assert_torch_dataset_resumes_exactly`` checks the same of the
``IterableDataset`` face, driven the way a training loop drives it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import numpy as np
import torch

from slafload import Loader, SlafIterableDataset

Batch = dict[str, torch.Tensor]


def _take(batches: Iterable[Batch], n: int | None = None) -> list[Batch]:
    out: list[Batch] = []
    if n == 0:
        return out
    for batch in batches:
        out.append({k: v.clone() for k, v in batch.items()})
        if len(out) == n:
            break
    return out


def _midpoints(reference: list[Batch], last_epoch_start: int, midpoints: int, seed: int):
    rng = np.random.default_rng(seed)
    n = len(reference)
    anywhere = rng.integers(0, n + 1, midpoints).tolist()
    in_last_epoch = rng.integers(last_epoch_start, n + 1, max(3, midpoints // 4)).tolist()
    return sorted({0, n, last_epoch_start, *anywhere, *in_last_epoch})


def _assert_same_run(got: list[Batch], reference: list[Batch], where: str) -> None:
    assert len(got) == len(reference), (
        f"{where}: {len(got)} batches in all, the uninterrupted run has {len(reference)}"
    )
    for i, (a, b) in enumerate(zip(got, reference, strict=True)):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{where}: batch {i} key {key} differs"


def _last_epoch_start(reference: list[Batch], n_epochs: int) -> int:
    """Index of the first batch of the last epoch (epochs have equal batch counts)."""
    assert len(reference) % n_epochs == 0, "epochs of one run have equal batch counts"
    return len(reference) - len(reference) // n_epochs


def assert_resumes_exactly(
    make_loader: Callable[[], Loader], *, midpoints: int = 20, seed: int = 0
) -> None:
    with make_loader() as loader:
        n_epochs = loader.config.n_epochs
        assert n_epochs is not None, "the check needs a finite run"
        reference = _take(loader)
        assert not _take(loader), "a finished run yielded more batches"
    assert reference, "the loader delivered nothing"
    start = _last_epoch_start(reference, n_epochs)
    for k in _midpoints(reference, start, midpoints, seed):
        with make_loader() as first:
            before = _take(first, k)
            state = json.loads(json.dumps(first.state_dict()))
        with make_loader() as second:
            second.load_state_dict(state)
            after = _take(second)  # to its end: the total must match too
            assert not _take(second), f"resume at {k}: the finished run yielded more"
        _assert_same_run(before + after, reference, f"resume at batch {k}")


def _run_epochs(ds: SlafIterableDataset, first: int, n_epochs: int, n: int | None = None):
    """A training loop over the dataset face: ``set_epoch`` and iterate, epoch by epoch."""
    out: list[Batch] = []
    for epoch in range(first, n_epochs):
        if len(out) == n:
            return out
        ds.set_epoch(epoch)
        for batch in ds:
            out.append({k: v.clone() for k, v in batch.items()})
            if len(out) == n:
                return out  # stop as a crash would: right after the n-th batch
    return out


def assert_torch_dataset_resumes_exactly(
    make_dataset: Callable[[], SlafIterableDataset],
    n_epochs: int,
    *,
    midpoints: int = 12,
    seed: int = 0,
) -> None:
    """The dataset face under a loop ``for epoch in range(start, n_epochs)``: a run resumed
    from ``state_dict()`` starts at the state's epoch and adds up to the uninterrupted run."""
    ds = make_dataset()
    reference = _run_epochs(ds, 0, n_epochs)
    ds.set_epoch(n_epochs)
    assert not list(ds), "an epoch past the run yielded batches"
    assert reference, "the dataset delivered nothing"
    start = _last_epoch_start(reference, n_epochs)
    for k in _midpoints(reference, start, midpoints, seed):
        first = make_dataset()
        before = _run_epochs(first, 0, n_epochs, k)
        state = json.loads(json.dumps(first.state_dict()))
        second = make_dataset()
        second.load_state_dict(state)
        after = _run_epochs(second, state["epoch"], n_epochs)
        _assert_same_run(before + after, reference, f"dataset resume at batch {k}")
