"""How well a mixture mixes, and what mixing costs.

Two synthetic atlases (``--cells`` each, same generator and settings, different seeds) are
mixed at ``--weights`` with ``epoch_cells`` (so the weights hold all epoch long), and a third
atlas of twice ``--cells`` from the same generator is the single-source contender on the same
amount of data. Reported:

- per-batch source entropy (bits): the mean Shannon entropy of the ``source`` label within
  each batch, for ``mix="cell"`` and ``mix="batch"``, beside the weights' own entropy ``H(w)``
  (a batch drawn at random from the sources has about ``H(w)``; a batch from one source 0);
- the share of batches holding every source;
- throughput (cells/s delivered as tensors, steady state after one warm-up batch) of the
  mixture and of the single-source loader on the same total data, interleaved rounds, median,
  and the ratio; CPU time per cell beside it. Page cache warm (the data is read in round 0).

    python benchmarks/mixture.py                 # ~1 minute on 2 busy cores
    python benchmarks/mixture.py --cells 50000 --rounds 5

Writes ``benchmarks/results/mixture[-block].json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

import slafload
from slafload import Mixture
from slafload.samplers import BlockShuffle
from slafload.synthetic import write_atlas
from slafload.tools.diversity import entropy, mean_batch_entropy

ROOT = Path.cwd()


def atlases(args) -> tuple[list[Path], Path]:
    """The two mixed atlases and the single one with as many cells as both (written once)."""
    base = Path(args.data)
    base.mkdir(parents=True, exist_ok=True)
    settings = {"n_genes": args.genes, "mean_nnz": args.nnz}

    def atlas(name: str, n: int, seed: int) -> Path:
        path = base / f"{name}-{n}-{args.genes}-{args.nnz}.slaf"
        if not (path / "config.json").exists():
            write_atlas(path, n_cells=n, seed=seed, overwrite=True, **settings)
        return path

    return [atlas("a", args.cells, 1), atlas("b", args.cells, 2)], atlas("ab", 2 * args.cells, 3)


def loader(source, args, **options) -> slafload.Loader:
    sampler = BlockShuffle(block_size=16, fetch_factor=64) if args.sampler == "block" else None
    return slafload.Loader(
        source, batch_size=args.batch_size, max_genes=args.max_genes, n_epochs=None,
        seed=args.seed, sampler=sampler, **options,
    )  # fmt: skip


def mixture(paths: list[Path], args, mix: str) -> Mixture:
    return Mixture(paths, weights=args.weights, epoch_cells=2 * args.cells, mix=mix)


def source_mix(paths: list[Path], args, mix: str) -> dict[str, Any]:
    """Per-batch source entropy and the share of batches holding every source, one epoch."""
    with loader(mixture(paths, args, mix), args, drop_last=True) as it:
        batches = [b["source"].numpy() for _, b in zip(range(len(it)), it, strict=False)]
    every = np.mean([len(np.unique(b)) == len(paths) for b in batches])
    return {"entropy_bits": mean_batch_entropy(batches), "all_sources": float(every)}


def rate(source, args) -> tuple[float, float]:
    """Steady-state cells/s (wall) and CPU seconds per cell over ``--measure`` cells."""
    with loader(source, args) as it:
        batches = iter(it)
        next(batches)  # warm-up: time to first batch is not throughput
        cells, wall, cpu = 0, time.perf_counter(), time.process_time()
        for batch in batches:
            cells += len(batch["source"] if "source" in batch else batch["input_ids"])
            if cells >= args.measure:
                break
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return cells / wall, cpu / cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", type=int, default=10_000, help="cells of each mixed atlas")
    p.add_argument("--weights", type=lambda s: [float(x) for x in s.split(",")], default=[1, 1])
    p.add_argument("--genes", type=int, default=2000)
    p.add_argument("--nnz", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-genes", type=int, default=256)
    p.add_argument("--measure", type=int, default=8_000, help="cells timed per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampler", choices=["default", "block"], default="default",
                   help="the loader's default sampler, or BlockShuffle(16, 64)")  # fmt: skip
    p.add_argument("--data", default="/tmp/slafload-bench-mixture")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    paths, single = atlases(args)
    mixing = {mix: source_mix(paths, args, mix) for mix in ("cell", "batch")}
    runs: dict[str, list[tuple[float, float]]] = {"single": [], "mixture": []}
    rate(single, args)  # round 0: page cache and kernels warm, not counted
    for _ in range(args.rounds):  # interleaved, so load on the machine hits both alike
        runs["single"].append(rate(single, args))
        runs["mixture"].append(rate(mixture(paths, args, "cell"), args))
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
           for k, v in runs.items()}  # fmt: skip
    result = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "data")},
        "weights_entropy_bits": entropy(np.asarray(args.weights)),
        "mixing": mixing,
        "cells_per_s": {k: m[0] for k, m in med.items()},
        "cpu_us_per_cell": {k: m[1] * 1e6 for k, m in med.items()},
        "ratio_wall": med["mixture"][0] / med["single"][0],
        "ratio_cpu": med["single"][1] / med["mixture"][1],
        "runs": runs,
        "page_cache": "warm",
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "mixture" if args.sampler == "default" else f"mixture-{args.sampler}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    plot(result, out / f"{name}.png")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = ["mix='cell'", "mix='batch'", "H(weights)"]
    values = [result["mixing"]["cell"]["entropy_bits"], result["mixing"]["batch"]["entropy_bits"],
              result["weights_entropy_bits"]]  # fmt: skip
    left.bar(names, values, color=["C0", "C1", "grey"])
    left.set_ylabel("mean per-batch source entropy (bits)")
    rates = result["cells_per_s"]
    right.bar(list(rates), list(rates.values()), color=["grey", "C0"])
    right.set_ylabel("cells/s (median, warm cache)")
    right.set_title(f"mixture / single: {result['ratio_wall']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
