"""Masked-gene modelling on cell sentences streamed by slafload.

A small ``torch.nn.TransformerEncoder`` learns to recover masked gene tokens of Geneformer
rank-value sentences from a synthetic atlas (written on first use). The default run takes
about 15 s on 2 CPU cores, atlas included; ``--tiny`` a few seconds. With a GPU, batches are pinned by the
loader's producer thread and copied with ``non_blocking=True``.

    python examples/train_mlm.py                   # train, checkpoint to data/mlm_checkpoint.pt
    python examples/train_mlm.py --steps 400 --resume   # continue where the checkpoint stopped
    python examples/train_mlm.py --layout packed   # no padding: varlen attention per cell
    python examples/train_mlm.py --mix             # two atlases, different genes, one vocabulary

With ``--mix`` the model trains on a mixture of two synthetic atlases whose gene lists only
partly overlap (``--data`` and ``--data-b``), mixed by ``--mix-weights`` through the union of
their genes as one vocabulary (see docs/mixtures.md).

The checkpoint holds the model, the optimizer, the masking RNG and the loader's position
together, so a resumed run sees exactly the batches and masks an uninterrupted run would.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import lance
import pyarrow as pa
import torch
from torch import nn
from torch.nn import functional as F

import slafload
from slafload.tokenizers import GENE_OFFSET, MASK, PAD

TINY = {
    "n_cells": 512,
    "n_genes": 32,
    "mean_nnz": 12,
    "max_genes": 16,
    "batch_size": 32,
    "chunk_cells": 256,
    "steps": 24,
    "d_model": 32,
    "layers": 1,
    "heads": 2,
    "lr": 1e-2,
    "mask_prob": 0.3,
    "log_every": 4,
}


class MaskedGeneModel(nn.Module):
    """Token + rank-position embeddings, a pre-norm TransformerEncoder, a tied-size head."""

    def __init__(self, *, vocab: int, max_len: int, d_model: int, heads: int, layers: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.positions = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)
        x = self.encoder(x, src_key_padding_mask=~attention_mask)
        return self.head(self.norm(x))

    def forward_packed(
        self, ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        """Logits of a packed batch: one sequence of every cell's tokens, each cell attending
        only to itself through a block-diagonal mask (what FlashAttention's varlen kernel does
        without the mask; see docs/layouts.md)."""
        x = self.tokens(ids) + self.positions(position_ids)
        cell = cell_of_token(cu_seqlens, len(ids))
        other_cell = cell[:, None] != cell[None, :]  # True: may not attend
        x = self.encoder(x[None], mask=other_cell)[0]
        return self.head(self.norm(x))


def cell_of_token(cu_seqlens: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Index of the cell each token of a packed batch belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    cells = torch.arange(len(lengths), device=cu_seqlens.device)
    return torch.repeat_interleave(cells, lengths, output_size=n_tokens)


def mask_genes(
    ids: torch.Tensor, draw: torch.Tensor, prob: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT-style masking of gene tokens only (never CLS/SEP/PAD): inputs and labels.

    ``draw`` holds a uniform number per token; it is drawn on a ``[batch, max_genes]`` grid in
    every layout (packed tokens take theirs at ``[cell, position]``), so a packed run masks
    exactly the tokens a padded run does.
    """
    is_gene = ids >= GENE_OFFSET
    masked = is_gene & (draw.to(ids.device) < prob)
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    return torch.where(masked, torch.full_like(ids, MASK), ids), labels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default="data/mlm_atlas.slaf", help="SLAF dataset (made if absent)")
    p.add_argument("--mix", action="store_true", help="train on a mixture of two atlases")
    p.add_argument("--data-b", default="data/mlm_atlas_b.slaf", help="--mix: the second atlas")
    p.add_argument("--mix-weights", default="1,1", help="--mix: weights of the two atlases")
    p.add_argument("--checkpoint", default="data/mlm_checkpoint.pt")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--metrics", default=None, help="append one JSON line per logged step")
    p.add_argument("--tiny", action="store_true", help="seconds-long run (tests, smoke checks)")
    p.add_argument("--n-cells", type=int, default=10_000)
    p.add_argument("--n-genes", type=int, default=1_000)
    p.add_argument("--mean-nnz", type=int, default=150)
    p.add_argument("--max-genes", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--chunk-cells", type=int, default=4096)
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--layout", choices=["padded", "packed"], default="padded",
        help="packed: no padding, cells attend only to themselves (block-diagonal mask)",
    )  # fmt: skip
    known, _ = p.parse_known_args(argv)
    if known.tiny:
        p.set_defaults(**TINY)
    return p.parse_args(argv)


def write_atlas(path: str, args: argparse.Namespace, *, seed: int, gene_shift: int = 0) -> None:
    """A synthetic atlas; ``gene_shift`` renames its genes so atlases share only some."""
    if Path(path).exists():
        return
    print(f"writing a synthetic atlas to {path} ...", flush=True)
    slafload.synthetic.write_atlas(
        path, n_cells=args.n_cells, n_genes=args.n_genes, mean_nnz=args.mean_nnz,
        n_plates=min(14, args.n_cells), seed=seed,
    )  # fmt: skip
    if gene_shift:
        names = [f"GENE{g + gene_shift:06d}" for g in range(1, args.n_genes + 1)]
        ids = pa.array(range(args.n_genes), pa.uint16() if args.n_genes < 65536 else pa.uint32())
        genes = pa.table({"gene_id": names, "gene_integer_id": ids})
        lance.write_dataset(genes, f"{path}/genes.lance", mode="overwrite")


def open_data(args: argparse.Namespace) -> tuple[slafload.SlafDataset | slafload.Mixture, int]:
    """The dataset (or, with ``--mix``, the mixture) to train on, and its gene-id count."""
    write_atlas(args.data, args, seed=args.seed)
    if not args.mix:
        ds = slafload.open_dataset(args.data)
        return ds, ds.n_genes
    write_atlas(args.data_b, args, seed=args.seed + 1, gene_shift=args.n_genes // 2)
    weights = [float(w) for w in args.mix_weights.split(",")]
    mixture = slafload.Mixture([args.data, args.data_b], weights=weights, vocabulary="union")
    return mixture, mixture.vocab_size


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    ds, n_genes = open_data(args)
    loader = slafload.Loader(
        ds, tokenizer="geneformer", max_genes=args.max_genes, batch_size=args.batch_size,
        chunk_cells=args.chunk_cells, seed=args.seed, n_epochs=None, drop_last=True,
        device=device if cuda else None, pin_memory=cuda, layout=args.layout,
    )  # fmt: skip
    vocab = n_genes + GENE_OFFSET
    model = MaskedGeneModel(
        vocab=vocab, max_len=args.max_genes, d_model=args.d_model, heads=args.heads,
        layers=args.layers,
    ).to(device)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    masking = torch.Generator().manual_seed(args.seed)
    step = 0
    checkpoint = Path(args.checkpoint)
    if args.resume and checkpoint.exists():
        state = torch.load(checkpoint, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        masking.set_state(state["masking_rng"])
        loader.load_state_dict(state["loader"])
        step = state["step"]
        print(f"resumed at step {step}, loader {state['loader']}", flush=True)
    print(f"{ds!r}\nmodel: {sum(p.numel() for p in model.parameters()):,} parameters on {device}")

    def save() -> None:
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "masking_rng": masking.get_state(),
            "loader": loader.state_dict(),
            "dataset_versions": ds.versions,
            "step": step,
            "args": vars(args),
        }
        torch.save(state, checkpoint.with_suffix(".tmp"))
        checkpoint.with_suffix(".tmp").replace(checkpoint)  # never a half-written checkpoint

    metrics = open(args.metrics, "a") if args.metrics else None  # noqa: SIM115
    started, cells, window = time.perf_counter(), 0, []
    source_cells = [0] * len(loader.source_names or [None])
    with loader:
        batches = iter(loader)
        while step < args.steps:
            batch = next(batches)
            ids, n_cells = batch["input_ids"], len(batch["cell_integer_id"])
            draw = torch.rand((n_cells, args.max_genes), generator=masking)
            if args.layout == "packed":
                positions, cu = batch["position_ids"], batch["cu_seqlens"]
                draw = draw.to(ids.device)[cell_of_token(cu, len(ids)), positions]
                inputs, labels = mask_genes(ids, draw, args.mask_prob)
                logits = model.forward_packed(inputs, positions, cu)
            else:
                inputs, labels = mask_genes(ids, draw, args.mask_prob)
                logits = model(inputs, batch["attention_mask"])
            loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
            if torch.isnan(loss):  # no gene was masked in this batch: nothing to learn
                loss = logits.sum() * 0.0
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            cells += n_cells
            if "source" in batch:
                counts = torch.bincount(batch["source"].cpu(), minlength=len(source_cells))
                source_cells = [a + b for a, b in zip(source_cells, counts.tolist(), strict=True)]
            window.append(loss.item())
            if step % args.log_every == 0 or step == args.steps:
                mean = sum(window) / len(window)
                rate = cells / (time.perf_counter() - started)
                print(f"step {step:5d}  loss {mean:.4f}  (ln V = {math.log(vocab):.2f})  "
                      f"{rate:,.0f} cells/s", flush=True)  # fmt: skip
                if metrics:
                    line = {"step": step, "loss": mean}
                    if loader.source_names:
                        line["source_cells"] = dict(
                            zip(loader.source_names, source_cells, strict=True)
                        )
                    metrics.write(json.dumps(line) + "\n")
                    metrics.flush()
                window = []
            if step % args.save_every == 0 or step == args.steps:
                save()
    if metrics:
        metrics.close()
    print(f"saved {checkpoint} at step {step}, loader {loader.state_dict()}")


if __name__ == "__main__":
    main()
