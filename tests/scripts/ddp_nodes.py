"""Run under ``torchrun`` as one of two nodes, or as the smaller run resuming elastically.

Usage:
  torchrun --nnodes=2 --nproc-per-node=2 ... ddp_nodes.py epoch DATASET OUT_DIR TAKEN
  torchrun --nnodes=1 --nproc-per-node=2 ... ddp_nodes.py resume DATASET OUT_DIR

``epoch``: each of the 4 ranks delivers a full epoch (its cells and batch count to JSON), then
a second loader takes ``TAKEN`` batches and saves its ``state_dict`` and the cells it took.
``resume``: each of 2 ranks loads rank 0's 4-rank state and finishes the epoch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from slafload import Loader
from slafload.samplers import BlockShuffle

SETTINGS = {"batch_size": 8, "max_genes": 16, "seed": 5}


def loader(dataset: str) -> Loader:
    sampler = BlockShuffle(block_size=3, fetch_factor=4, batch_size=8)
    return Loader(dataset, sampler=sampler, **SETTINGS)  # rank and world size from dist


def cells(batches) -> list[int]:
    return [c for b in batches for c in b["cell_integer_id"].tolist()]


def main() -> None:
    mode, dataset, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"rank": rank, "world_size": world}
    if mode == "epoch":
        taken = int(sys.argv[4])
        with loader(dataset) as ld:
            epoch = list(ld)
        result.update(cells=cells(epoch), batches=len(epoch))
        with loader(dataset) as ld:
            it = iter(ld)
            before = [next(it) for _ in range(taken)]
            result.update(state=ld.state_dict(), taken=cells(before))
    else:
        state = json.loads((out / "epoch_rank0.json").read_text())["state"]
        with loader(dataset) as ld:
            ld.load_state_dict(state)
            rest = list(ld)
        result.update(cells=cells(rest), batches=len(rest))
    (out / f"{mode}_rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
