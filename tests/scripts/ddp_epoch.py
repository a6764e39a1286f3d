"""Run under ``torchrun``: one epoch per rank, then a mid-epoch resume; results as JSON.

Usage: torchrun --nproc_per_node=2 ddp_epoch.py DATASET OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from slafload import Loader


def cells(batches) -> list[int]:
    return [c for b in batches for c in b["cell_integer_id"].tolist()]


def main() -> None:
    dataset, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    settings = {"batch_size": 8, "max_genes": 16, "chunk_cells": 30, "seed": 5}
    with Loader(dataset, **settings) as loader:  # rank and world size come from torch.distributed
        epoch = [{k: v.clone() for k, v in b.items()} for b in loader]
        n_batches = torch.tensor([len(epoch)])
        dist.all_reduce(n_batches, op=dist.ReduceOp.MAX)  # the test's check, not the loader's
        reference = cells(epoch)
    with Loader(dataset, **settings) as loader:
        it = iter(loader)
        before = [next(it) for _ in range(3)]
        state = json.loads(json.dumps(loader.state_dict()))
    with Loader(dataset, **settings) as loader:
        loader.load_state_dict(state)
        after = list(loader)
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
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
