"""What an epoch boundary costs: one chain for the run's epochs against one chain per epoch.

A ``Loader`` feeds its epochs through one chain of stages, so the next epoch is read while
the current one's last pieces are tokenized (docs/pipeline.md). The baseline is the same
loader with one chain per epoch, which is what any epoch-aware transform gets: here an
identity transform with a ``for_epoch`` method, so both runs do the same work. Same process,
same atlas, warm cache, runs interleaved (the order alternates each round) between raw Lance
scans; each run is reported as a fraction of the mean of the raw scans around it. Also the
longest wait for a batch after the first piece (an epoch boundary of the per-epoch chains is
a pipeline refill).

    python benchmarks/epoch_boundary.py                       # 50k x 20k benchmark atlas
    python benchmarks/epoch_boundary.py --rounds 8 --epochs 2.5

Writes ``benchmarks/results/epoch_boundary.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import slafload
from slafload.tools import bench
from slafload.tools.bench import progress
from slafload.types import Chunk


class EpochBound:
    """An identity chunk transform that is epoch-aware: the loader rebuilds its chain (and
    refills its pipeline) at every epoch, as before epochs shared one chain.
    """

    def for_epoch(self, epoch: int) -> EpochBound:
        return EpochBound()

    def __call__(self, chunk: Chunk) -> Chunk:
        return chunk


def loader_run(ds, tokenizer: str, target: int, per_epoch: bool) -> tuple[float, float]:
    """Cells/s from constructing the loader to ``target`` cells, and the longest wait (ms)
    for a batch after the first 4,096 cells.
    """
    transforms = [EpochBound()] if per_epoch else []
    start = time.perf_counter()
    stamps, cells = [], 0
    with slafload.Loader(
        ds, tokenizer=tokenizer, batch_size=32, max_genes=2048, n_epochs=None, seed=0,
        transforms=transforms,
    ) as loader:  # fmt: skip
        for batch in loader:
            cells += len(batch["cell_integer_id"])
            stamps.append((time.perf_counter(), cells))
            if cells >= target:
                break
    elapsed = time.perf_counter() - start
    times = np.array([t for t, c in stamps if c > 4096])
    return cells / elapsed, float(np.diff(times).max() * 1e3) if len(times) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--atlas", type=Path, help="default: the throughput benchmark's atlas")
    parser.add_argument("--data", default="data", help="where that atlas is cached")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--epochs", type=float, default=2.5)
    parser.add_argument("--tokenizers", nargs="+", default=["geneformer", "scgpt"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/epoch_boundary.json"))
    args = parser.parse_args()
    defaults = argparse.Namespace(cells=50_000, genes=20_000, plates=14, nnz=800, data=args.data)
    path = args.atlas or bench.ensure_atlas(defaults)
    ds = slafload.open_dataset(path)
    target = int(args.epochs * ds.n_cells)
    bench.raw_floor(ds, ds.n_cells)  # warm the page cache
    results = {}
    for tokenizer in args.tokenizers:
        runs: dict[str, list[tuple[float, float, float]]] = {"one chain": [], "per epoch": []}
        for r in progress(range(args.rounds), desc=tokenizer):
            for name in ("one chain", "per epoch")[:: 1 if r % 2 == 0 else -1]:
                raw = [bench.raw_rate(ds, target)]
                rate, wait = loader_run(ds, tokenizer, target, name == "per epoch")
                raw.append(bench.raw_rate(ds, target))
                runs[name].append((rate, rate / statistics.mean(raw), wait))
        one, per = runs["one chain"], runs["per epoch"]
        results[tokenizer] = {
            name: {
                "cells_per_s": statistics.median(x[0] for x in v),
                "fraction_of_raw_scan": statistics.median(x[1] for x in v),
                "longest_wait_ms": statistics.median(x[2] for x in v),
                "fractions": [round(x[1], 4) for x in v],
            }
            for name, v in runs.items()
        }
        results[tokenizer]["one chain faster in"] = (
            f"{sum(a[1] > b[1] for a, b in zip(one, per, strict=True))} of {len(one)} rounds"
        )
        line = ", ".join(
            f"{name} {v['fraction_of_raw_scan']:.3f} (longest wait {v['longest_wait_ms']:.0f} ms)"
            for name, v in results[tokenizer].items()
            if isinstance(v, dict)
        )
        print(
            f"{tokenizer}: {line}; one chain faster in {results[tokenizer]['one chain faster in']}"
        )
    report = {
        "atlas": str(path),
        "n_cells": ds.n_cells,
        "epochs_per_run": args.epochs,
        "rounds": args.rounds,
        "machine": bench.machine(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
