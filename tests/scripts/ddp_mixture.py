"""Run under ``torchrun``: one epoch of a two-source mixture per rank, then a mid-epoch
resume; results as JSON.

Usage: torchrun --nproc_per_node=2 ddp_mixture.py DATASET_A DATASET_B OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from slafload import Loader, Mixture


def cells(batches) -> list[list[int]]:
    return [
        [s, c]
        for b in batches
        for s, c in zip(b["source"].tolist(), b["cell_integer_id"].tolist(), strict=True)
    ]


def main() -> None:
    a, b, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    settings = {"batch_size": 8, "max_genes": 16, "chunk_cells": 30, "seed": 5, "n_epochs": 1}

    def loader() -> Loader:  # rank and world size come from torch.distributed
        return Loader(Mixture([a, b], weights=[1, 2], vocabulary="union"), **settings)

    with loader() as mixed:
        epoch = [{k: v.clone() for k, v in batch.items()} for batch in mixed]
        n_batches = torch.tensor([len(epoch)])
        dist.all_reduce(n_batches, op=dist.ReduceOp.MAX)  # the test's check, not the loader's
        names = list(mixed.source_names)
    with loader() as mixed:
        it = iter(mixed)
        before = [next(it) for _ in range(3)]
        state = json.loads(json.dumps(mixed.state_dict()))
    with loader() as mixed:
        mixed.load_state_dict(state)
        after = list(mixed)
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "names": names,
        "cells": cells(epoch),
        "batches": len(epoch),
        "max_batches": int(n_batches.item()),
        "resumed": cells(before) + cells(after),
        "state": state,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
