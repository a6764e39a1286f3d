"""Run under ``torchrun``: one epoch per rank, then a mid-epoch resume; results as JSON.

Usage: torchrun --nproc_per_node=2 ddp_epoch.py DATASET [DATASET_B] OUT_DIR

With two datasets the loader reads a mixture of them (weights 1 and 2, the union of their
genes), and cells are reported as ``[source, cell]`` pairs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from slafload import Loader, Mixture


def cells(batches) -> list:
    ids = [c for b in batches for c in b["cell_integer_id"].tolist()]
    if not batches or "source" not in batches[0]:
        return ids
    sources = [s for b in batches for s in b["source"].tolist()]
    return [[s, c] for s, c in zip(sources, ids, strict=True)]


def main() -> None:
    *datasets, out = sys.argv[1:]
    out = Path(out)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    settings = {"batch_size": 8, "max_genes": 16, "chunk_cells": 30, "seed": 5}

    def loader() -> Loader:  # rank and world size come from torch.distributed
        if len(datasets) == 1:
            return Loader(datasets[0], **settings)
        mixture = Mixture(datasets, weights=[1, 2], vocabulary="union")
        return Loader(mixture, **settings)

    with loader() as first:
        epoch = [{k: v.clone() for k, v in b.items()} for b in first]
        n_batches = torch.tensor([len(epoch)])
        dist.all_reduce(n_batches, op=dist.ReduceOp.MAX)  # the test's check, not the loader's
        reference = cells(epoch)
        names = first.source_names
    with loader() as second:
        it = iter(second)
        before = [next(it) for _ in range(3)]
        state = json.loads(json.dumps(second.state_dict()))
    with loader() as third:
        third.load_state_dict(state)
        after = list(third)
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "names": names,
        "cells": reference,
        "batches": len(epoch),
        "max_batches": int(n_batches.item()),
        "resumed": cells(before) + cells(after),
        "state": state,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
