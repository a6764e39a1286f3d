"""What a resume state must match: the settings that decide which cells come in which order.

Both resumable faces (:class:`~slafload.loader.Loader` and the ``IterableDataset`` of
:mod:`slafload.torch_data`) record these settings and a short hash of them in their states, and
refuse a state written under settings that would order the cells differently.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from slafload.errors import StateError
from slafload.samplers import Sampler


def cell_order(sampler: Sampler, seed: int, n_cells: int) -> dict[str, Any]:
    """The settings that decide which cells come in which order."""
    return {"sampler": repr(sampler), "seed": seed, "n_cells": n_cells}


def fingerprint(order: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(order, sort_keys=True).encode()).hexdigest()[:16]


def require_same_order(state: Mapping[str, Any], ours: Mapping[str, Any]) -> None:
    """Raise :class:`StateError` unless ``state`` was written under the order ``ours``."""
    if state.get("fingerprint") == fingerprint(ours):
        return
    theirs = state.get("order") or {}
    differ = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
    raise StateError(
        "this loader would deliver cells in a different order than the one that wrote "
        f"the state; differing settings (checkpoint, loader): {differ}. Construct the "
        "loader with the checkpoint's sampler and seed."
    )
