"""Sampling quality proven by training: one epoch of a classifier through each sampler.

The scDataset paper's experiment on a plate-ordered synthetic atlas: cells are stored plate by
plate and, within a plate, label by label, and each plate holds its own mix of labels (see
``slafload.tools.synthetic``, ``n_labels``). A held-out tenth of the cells (every tenth run of 256
cells, so every plate is in both splits) is the test set, selected with ``Subset``. For every
sampling strategy and seed, a softmax regression on ``log1p`` expression and a small MLP (one
hidden layer) are trained for ONE epoch through slafload's ``Loader`` (``raw`` tokenizer, both
models on the same minibatches) and scored by macro-F1 on the test set. Strategies:
``Streaming``, ``ChunkShuffle``, ``BlockShuffle(b, f)`` over a grid, and random sampling
(``BlockShuffle(block_size=1)``). Reported next to each: the mean plate and label entropy of
its minibatches, the epoch's cells/s with training, and the loader's own cells/s (one
loader-only pass, seed 0).

    python benchmarks/sampling_quality.py             # ~10 minutes on 2 busy cores
    python benchmarks/sampling_quality.py --cells 20000 --seeds 0 --blocks 16 --factors 256

Writes ``benchmarks/results/sampling_quality.json`` and ``sampling_quality.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

import slafload
from slafload.samplers import BlockShuffle, ChunkShuffle, Sampler, Streaming, Subset
from slafload.tools.bench_measure import progress
from slafload.tools.convert import convert
from slafload.tools.diversity import batch_entropy
from slafload.tools.synthetic import write_atlas

ROOT = Path.cwd()
PBMC = "10x_pbmc68k_reduced.h5ad"


# -- pieces (tested in tests/tools/test_tune.py) -----------------------------------------------------


def macro_f1(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Unweighted mean of per-class F1 over the classes in ``y_true`` or ``y_pred``.

    A class's F1 is ``2 TP / (2 TP + FP + FN)`` (sklearn's ``f1_score(average="macro")``).

    >>> macro_f1(np.array([0, 0, 1, 1]), np.array([0, 1, 1, 1]))  # F1 2/3 and 4/5
    0.7333333333333334
    """
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    if y_true.shape != y_pred.shape or y_true.size == 0:
        raise ValueError("y_true and y_pred must be non-empty and of the same shape")
    classes = np.union1d(y_true, y_pred)
    tp = np.array([np.sum((y_true == c) & (y_pred == c)) for c in classes])
    n_true = np.array([np.sum(y_true == c) for c in classes])
    n_pred = np.array([np.sum(y_pred == c) for c in classes])
    return float(np.mean(2 * tp / (n_true + n_pred)))


def held_out(n_cells: int, run: int = 256, every: int = 10) -> np.ndarray:
    """Boolean mask of test cells: every ``every``-th run of ``run`` consecutive cells."""
    return (np.arange(n_cells) // run) % every == every - 1


def dense(batch: dict[str, torch.Tensor], n_genes: int) -> torch.Tensor:
    """``log1p`` expression of a ``raw`` batch as a dense ``float32[cells, n_genes]``."""
    ids, values = batch["gene_ids"], batch["values"]
    x = torch.zeros(len(ids), n_genes)
    # padding has id -1 and value 0: add 0 to gene 0 rather than overwrite it
    return x.scatter_add_(1, ids.clamp(min=0), torch.log1p(values.float()))


def plate_only_f1(plates: np.ndarray, labels: np.ndarray, test: np.ndarray) -> float:
    """Macro-F1 of predicting each test cell's label as its plate's commonest training label:
    what a model that only recognised plates could reach."""
    pred = np.empty(int(test.sum()), dtype=labels.dtype)
    for p in np.unique(plates):
        train_labels = labels[(plates == p) & ~test]
        pred[plates[test] == p] = np.bincount(train_labels).argmax()
    return macro_f1(labels[test], pred)


def models(n_genes: int, n_classes: int, hidden: int, seed: int) -> dict[str, torch.nn.Module]:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return {
            "softmax": torch.nn.Linear(n_genes, n_classes),
            "mlp": torch.nn.Sequential(
                torch.nn.Linear(n_genes, hidden),
                torch.nn.ReLU(),
                torch.nn.Linear(hidden, n_classes),
            ),
        }


# -- one run ----------------------------------------------------------------------------------


def strategies(args) -> Iterator[tuple[str, dict[str, Any], Sampler]]:
    m = args.batch_size
    yield "streaming", {}, Streaming(chunk_cells=args.chunk_cells)
    yield "chunk_shuffle", {}, ChunkShuffle(chunk_cells=args.chunk_cells)
    yield (
        "random",
        {"block_size": 1, "fetch_factor": args.random_factor},
        BlockShuffle(block_size=1, fetch_factor=args.random_factor, batch_size=m),
    )
    for b in args.blocks:
        for f in args.factors:
            sampler = BlockShuffle(block_size=b, fetch_factor=f, batch_size=m)
            yield f"block_b{b}_f{f}", {"block_size": b, "fetch_factor": f}, sampler


def loader(ds, sampler: Sampler, args, seed: int, n_epochs: int = 1) -> slafload.Loader:
    return slafload.Loader(
        ds,
        sampler=sampler,
        tokenizer="raw",
        batch_size=args.batch_size,
        max_genes=args.max_genes,
        obs_columns=[args.plate_column, args.label_column],
        seed=seed,
        n_epochs=n_epochs,
    )


def train(ds, sampler: Sampler, args, seed: int, n_classes: int, n_epochs: int = 1):
    """Train both models for ``n_epochs`` through the loader; return them and the run's stats."""
    nets = models(ds.n_genes, n_classes, args.hidden, seed)
    opts = {k: torch.optim.Adam(v.parameters(), lr=args.lr) for k, v in nets.items()}
    plate_h, label_h, cells = [], [], 0
    start = time.perf_counter()
    with loader(ds, sampler, args, seed, n_epochs) as batches:
        steps = len(batches) * n_epochs
        for step, batch in enumerate(batches):
            x, y = dense(batch, ds.n_genes), batch[args.label_column]
            for name, net in nets.items():
                if args.lr_schedule == "linear":  # decays to zero at the end of training
                    opts[name].param_groups[0]["lr"] = args.lr * (1 - step / steps)
                opts[name].zero_grad()
                torch.nn.functional.cross_entropy(net(x), y).backward()
                opts[name].step()
            if len(y) == args.batch_size:
                plate_h.append(batch_entropy(batch[args.plate_column].numpy()))
                label_h.append(batch_entropy(y.numpy()))
            cells += len(y)
    elapsed = time.perf_counter() - start
    return nets, {
        "plate_entropy_bits": float(np.mean(plate_h)),
        "label_entropy_bits": float(np.mean(label_h)),
        "train_cells_per_s": cells / elapsed,
        "cells": cells,
    }


def loader_rate(ds, sampler: Sampler, args) -> float:
    """Cells/s of a loader-only pass over one epoch (no training)."""
    start, cells = time.perf_counter(), 0
    with loader(ds, sampler, args, 0) as batches:
        for batch in batches:
            cells += len(batch["values"])
    return cells / (time.perf_counter() - start)


def test_set(ds, test_ids: np.ndarray, args) -> tuple[torch.Tensor, np.ndarray]:
    xs, ys = [], []
    with loader(ds, Subset(Streaming(chunk_cells=4096), test_ids), args, 0) as batches:
        for batch in batches:
            xs.append(dense(batch, ds.n_genes))
            ys.append(batch[args.label_column].numpy())
    return torch.cat(xs), np.concatenate(ys)


def evaluate(nets: dict[str, torch.nn.Module], x: torch.Tensor, y: np.ndarray) -> dict[str, float]:
    with torch.no_grad():
        return {f"f1_{k}": macro_f1(y, net(x).argmax(1).numpy()) for k, net in nets.items()}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("f1_softmax", "f1_mlp", "plate_entropy_bits", "label_entropy_bits",
                "train_cells_per_s"):  # fmt: skip
        v = np.array([r[key] for r in runs])
        out[key] = {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
                    "min": float(v.min()), "max": float(v.max())}  # fmt: skip
    return out


def experiment(ds, args, desc: str, n_epochs: int = 1) -> dict[str, Any]:
    plates, _ = ds.obs_codes(args.plate_column)
    labels, label_names = ds.obs_codes(args.label_column)
    test = held_out(ds.n_cells, run=args.test_run, every=args.test_every)
    train_ids, test_ids = np.flatnonzero(~test), np.flatnonzero(test)
    x_test, y_test = test_set(ds, test_ids, args)
    k = len(label_names)
    result: dict[str, Any] = {
        "n_cells": ds.n_cells, "n_genes": ds.n_genes, "n_train": len(train_ids),
        "n_test": len(test_ids), "n_classes": k, "n_plates": int(plates.max()) + 1,
        "epochs": n_epochs, "plate_only_macro_f1": (
            plate_only_f1(plates, labels, test) if args.plate_column != args.label_column else None
        ),
        "strategies": {},
    }  # fmt: skip
    todo = [(name, params, sampler, seed) for name, params, sampler in strategies(args)
            for seed in args.seeds]  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {}
    for name, params, sampler, seed in progress(todo, desc=desc):
        nets, stats = train(ds, Subset(sampler, train_ids), args, seed, k, n_epochs)
        runs.setdefault(name, []).append({"seed": seed, **stats, **evaluate(nets, x_test, y_test)})
        if len(runs[name]) == len(args.seeds):
            result["strategies"][name] = {
                **params, "runs": runs[name], **summarise(runs[name]),
                "loader_cells_per_s": loader_rate(ds, Subset(sampler, train_ids), args),
            }  # fmt: skip
    return result


# -- datasets ---------------------------------------------------------------------------------


def ensure_labelled_atlas(args) -> Path:
    params = {"n_cells": args.cells, "n_genes": args.genes, "n_plates": args.plates,
              "mean_nnz": args.nnz, "n_labels": args.labels, "label_weight": args.label_weight,
              "label_concentration": args.concentration, "seed": args.atlas_seed}  # fmt: skip
    name = "labelled_{n_cells}x{n_genes}_nnz{mean_nnz}_k{n_labels}_w{label_weight}_a{label_concentration}"
    path = Path(args.data) / (name.format(**params) + ".slaf")
    if not (path / "config.json").exists():
        print(f"writing synthetic atlas {path} ...", file=sys.stderr)
        write_atlas(path, overwrite=True, progress=True, **params)
    return path


def ensure_pbmc(args) -> Path | None:
    """scanpy's 700-cell PBMC file (raw log-normalised counts) converted with cells sorted by
    ``bulk_labels``, the worst case of label-ordered storage; ``None`` without scanpy."""
    try:
        import anndata
        import scanpy
    except ImportError as exc:
        print(f"skipping the PBMC sanity row: {exc}", file=sys.stderr)
        return None
    path = Path(args.data) / "pbmc68k_reduced_by_label.slaf"
    if not (path / "config.json").exists():
        source = Path(scanpy.__file__).parent / "datasets" / PBMC
        adata = anndata.read_h5ad(source)
        adata = adata[np.argsort(adata.obs["bulk_labels"].to_numpy(), kind="stable")].copy()
        convert(adata, path, raw=True, overwrite=True)
    return path


# -- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", type=int, default=100_000, help="atlas size")
    p.add_argument("--genes", type=int, default=1000)
    p.add_argument("--nnz", type=int, default=150, help="mean non-zeros per cell")
    p.add_argument("--plates", type=int, default=14)
    p.add_argument("--labels", type=int, default=10, help="classes of the label")
    p.add_argument("--label-weight", type=float, default=0.05)
    p.add_argument("--concentration", type=float, default=1.0, help="Dirichlet, labels per plate")
    p.add_argument("--atlas-seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-genes", type=int, default=1000, help="raw tokenizer width")
    p.add_argument("--blocks", default="4,16,64,256")
    p.add_argument("--factors", default="16,64,256")
    p.add_argument("--random-factor", type=int, default=256, help="f of random sampling (b=1)")
    p.add_argument("--chunk-cells", type=int, default=2048, help="Streaming/ChunkShuffle chunk")
    p.add_argument("--seeds", default="0,1,2,3")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam peak learning rate")
    p.add_argument("--lr-schedule", choices=["linear", "constant"], default="linear")
    p.add_argument("--hidden", type=int, default=64, help="MLP hidden units")
    p.add_argument("--test-run", type=int, default=256)
    p.add_argument("--test-every", type=int, default=10)
    p.add_argument("--pbmc-epochs", type=int, default=20, help="epochs of the 700-cell PBMC row")
    p.add_argument("--pbmc-lr", type=float, default=1e-2)
    p.add_argument("--no-pbmc", action="store_true")
    p.add_argument("--data", default=str(ROOT / "data"), help="where datasets are cached")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sampling_quality.json"))
    args = p.parse_args(argv)
    args.blocks = [int(x) for x in args.blocks.split(",")]
    args.factors = [int(x) for x in args.factors.split(",")]
    args.seeds = [int(x) for x in args.seeds.split(",")]
    args.plate_column, args.label_column = "plate", "label"
    torch.set_num_threads(1)  # tiny matmuls; leave the other core to Lance and Polars

    start = time.perf_counter()
    ds = slafload.open_dataset(ensure_labelled_atlas(args))
    synthetic = experiment(ds, args, "synthetic atlas")
    pbmc = None
    path = None if args.no_pbmc else ensure_pbmc(args)
    if path is not None:
        # 630 training cells: small fetches (64 cells) so the strategies differ at all, and
        # several epochs so the classifiers learn something.
        pbmc_args = argparse.Namespace(**{**vars(args), "label_column": "bulk_labels",
                                          "plate_column": "bulk_labels", "batch_size": 16,
                                          "blocks": [4], "factors": [4], "chunk_cells": 64,
                                          "random_factor": 4, "test_run": 10,
                                          "lr": args.pbmc_lr})  # fmt: skip
        pbmc = experiment(slafload.open_dataset(path), pbmc_args, "PBMC", args.pbmc_epochs)
    report = {
        "benchmark": "sampling_quality",
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "slafload": slafload.__version__,
            "torch_threads": 1,
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("data", "out")},
        "synthetic": synthetic,
        "pbmc": pbmc,
        "pbmc_skipped_reason": None if pbmc else "scanpy not installed or --no-pbmc",
        "claims": claims(synthetic),
        "wall_s": time.perf_counter() - start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print_table(report)
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')} in {report['wall_s']:.0f} s")
    return report


def claims(result: dict[str, Any]) -> dict[str, Any]:
    s = result["strategies"]
    rand = s["random"]["f1_softmax"]["mean"]
    out: dict[str, Any] = {"random_f1_softmax": rand}
    for name in ("streaming", "chunk_shuffle", "block_b16_f256"):
        if name in s:
            out[f"{name}_minus_random_f1_points"] = 100 * (s[name]["f1_softmax"]["mean"] - rand)
    if "block_b16_f256" in s:
        out["block_b16_f256_within_1_point"] = out["block_b16_f256_minus_random_f1_points"] >= -1
    return out


def print_table(report: dict[str, Any]) -> None:
    for title in ("synthetic", "pbmc"):
        result = report[title]
        if result is None:
            print(f"{title}: skipped ({report['pbmc_skipped_reason']})")
            continue
        print(f"\n{title}: {result['n_cells']:,} cells, {result['n_classes']} classes, "
              f"{result['epochs']} epoch(s); plate-only macro-F1 "
              f"{result['plate_only_macro_f1'] or float('nan'):.3f}")  # fmt: skip
        print(f"{'strategy':<18}{'F1 softmax':>16}{'F1 MLP':>16}{'H plate':>9}{'H label':>9}"
              f"{'train c/s':>11}{'loader c/s':>11}")  # fmt: skip
        for name, r in result["strategies"].items():
            f1s = [f"{r[k]['mean']:.3f}±{r[k]['std']:.3f}" for k in ("f1_softmax", "f1_mlp")]
            print(f"{name:<18}{f1s[0]:>16}{f1s[1]:>16}{r['plate_entropy_bits']['mean']:>9.3f}"
                  f"{r['label_entropy_bits']['mean']:>9.3f}{r['train_cells_per_s']['mean']:>11,.0f}"
                  f"{r['loader_cells_per_s']:>11,.0f}")  # fmt: skip
    print("claims: " + json.dumps(report["claims"]))


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    s = report["synthetic"]["strategies"]
    blocks, factors = report["settings"]["blocks"], report["settings"]["factors"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, model in zip(axes, ("softmax", "mlp"), strict=True):
        key = f"f1_{model}"
        for f in factors:
            rows = [s[f"block_b{b}_f{f}"][key] for b in blocks]
            ax.errorbar(blocks, [r["mean"] for r in rows], yerr=[r["std"] for r in rows],
                        marker="o", capsize=3, label=f"BlockShuffle f={f}")  # fmt: skip
        for name, style in (("random", "-"), ("chunk_shuffle", "--"), ("streaming", ":")):
            r = s[name][key]
            ax.axhline(r["mean"], color="k", linestyle=style, linewidth=1,
                       label=f"{name} {r['mean']:.3f}")  # fmt: skip
            if name == "random":
                ax.axhspan(r["mean"] - r["std"], r["mean"] + r["std"], color="k", alpha=0.08)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size b (cells)")
        ax.set_title(f"{model}: one epoch, {len(report['settings']['seeds'])} seeds (mean ± sd)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out macro-F1")
    axes[1].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
