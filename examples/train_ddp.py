"""Masked-gene modelling under ``torchrun`` with DistributedDataParallel, one loader per rank.

Launch it with one process per device; on a CPU-only machine the ranks talk over gloo::

    torchrun --nproc_per_node 2 examples/train_ddp.py                 # 2 CPU ranks, gloo
    torchrun --nproc_per_node 8 examples/train_ddp.py --steps 2000    # 8 GPUs on one node, nccl
    torchrun --nproc_per_node 4 examples/train_ddp.py --resume --steps 200  # continue, 4 ranks

Rank 0 writes a small synthetic atlas on first use (``--data``). Every rank opens its own
:class:`slafload.Loader`, which reads its rank and world size from ``torch.distributed`` and
streams a disjoint share of every epoch, the same number of batches on every rank, so the
ranks' gradient all-reduces stay in step with no coordination from the training loop. Rank 0
saves the model, the optimizer and the loader's position together; the loader's state is the
same on every rank, and a checkpoint taken on W ranks resumes on any other number.

The model and the masking are those of ``examples/train_mlm.py`` (imported from beside this
file), which explains them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from train_mlm import MaskedGeneModel, mask_genes

import slafload
from slafload.tokenizers import GENE_OFFSET


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default="data/ddp_atlas.slaf", help="SLAF dataset (made if absent)")
    p.add_argument("--checkpoint", default="data/ddp_checkpoint.pt", help="written by rank 0")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (every rank)")
    p.add_argument("--batch-size", type=int, default=32, help="cells per batch per rank")
    p.add_argument("--max-genes", type=int, default=32, help="tokens per cell")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--log-every", type=int, default=10, help="steps between loss lines")
    p.add_argument("--seed", type=int, default=0, help="seed of the loader, model and masks")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if rank == 0 and not Path(args.data).exists():
        slafload.synthetic.write_atlas(
            args.data, n_cells=4_000, n_genes=200, mean_nnz=40, n_plates=8, seed=args.seed
        )
    dist.barrier()  # the atlas is complete before any rank opens it

    ds = slafload.open_dataset(args.data)
    vocab = ds.n_genes + GENE_OFFSET
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = MaskedGeneModel(vocab=vocab, max_len=args.max_genes, d_model=32, heads=2, layers=1)
    model = DistributedDataParallel(model.to(device), device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    masking = torch.Generator().manual_seed(args.seed + rank)  # different masks per rank
    loader = slafload.Loader(
        ds, tokenizer="geneformer", batch_size=args.batch_size, max_genes=args.max_genes,
        seed=args.seed, n_epochs=None, drop_last=True, device=device if cuda else None,
    )  # fmt: skip
    step = 0
    checkpoint = Path(args.checkpoint)
    if args.resume and checkpoint.exists():
        state = torch.load(checkpoint, map_location=device, weights_only=False)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])  # any world size: the loader re-shards
        step = state["step"]

    cells = 0
    with loader:
        batches = iter(loader)
        while step < args.steps:
            batch = next(batches)
            ids = batch["input_ids"]
            draw = torch.rand(ids.shape, generator=masking)
            inputs, labels = mask_genes(ids, draw, 0.15)
            logits = model(inputs, batch["attention_mask"])
            loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
            if torch.isnan(loss):  # no gene masked on this rank: still join the all-reduce
                loss = logits.sum() * 0.0
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over the ranks here
            optimizer.step()
            step += 1
            cells += len(batch["cell_integer_id"])
            if rank == 0 and (step % args.log_every == 0 or step == args.steps):
                print(f"step {step:5d}  loss {loss.item():.4f}", flush=True)
        state = loader.state_dict()
    if rank == 0:
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        snapshot = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "loader": state, "step": step}  # fmt: skip
        torch.save(snapshot, checkpoint.with_suffix(".tmp"))
        checkpoint.with_suffix(".tmp").replace(checkpoint)  # never a half-written checkpoint
    print(f"rank {rank}/{world}: {step} steps, {cells} cells", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
