"""How well a mixture mixes, and what mixing costs.

Two synthetic atlases (``--cells`` each, same generator and settings, different seeds) are
mixed at ``--weights`` with ``epoch_cells`` (so the weights hold all epoch long), and a third
atlas of twice ``--cells`` from the same generator is the single-source contender on the same
amount of data. Reported:

- per-batch source entropy (bits): the mean Shannon entropy of the ``source`` label within
  each batch, for ``mix="cell"`` and ``mix="batch"``, beside the weights' own entropy ``H(w)``
  (a batch drawn at random from the sources has about ``H(w)``; a batch from one source 0);
- the share of batches holding every source;
- throughput (cells/s delivered as tensors, steady state after ``--warm-up`` cells) of the
  mixture and of the single-source loader on the same total data, interleaved rounds, median,
  and the ratio; CPU time per cell beside it. Page cache warm (the data is read in round 0);
- the 1-minute load average before and after the timed rounds (wall ratios move with it);
- memory (``--memory-sources``, default 8): peak RSS of a fresh process streaming
  ``--measure`` cells from one atlas, and from a 1:1:...:1 mixture of that many atlases of
  ``--cells`` each, with torch and slafload imported before the baseline is read; the growth
  over that baseline beside ``memory_budget``.

    python benchmarks/mixture.py                 # ~1 minute on 2 busy cores
    python benchmarks/mixture.py --cells 50000 --rounds 5

Writes ``benchmarks/results/mixture[-block].json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
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


def more_atlases(args, n: int) -> list[Path]:
    """``n`` atlases of ``--cells`` each (the first two are the mixed pair), written once."""
    paths = atlases(args)[0]
    for i in range(len(paths), n):
        path = Path(args.data) / f"{chr(ord('a') + i)}-{args.cells}-{args.genes}-{args.nnz}.slaf"
        if not (path / "config.json").exists():
            write_atlas(path, n_cells=args.cells, seed=i + 2, overwrite=True,
                        n_genes=args.genes, mean_nnz=args.nnz)  # fmt: skip
        paths.append(path)
    return paths[:n]


# Run in a fresh process: the peak RSS (VmHWM) is per process and never goes down.
_MEMORY_CHILD = """
import json, sys
import torch  # a training script has it imported
import slafload
from slafload import Mixture

def status(key):  # VmRSS now, VmHWM its peak (ru_maxrss would carry the parent's over exec)
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) << 10 for line in fh if line.startswith(key + ":"))

paths, settings, cells = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
epoch_cells = settings.pop("epoch_cells")
tuning = slafload.Tuning(memory_budget=settings.pop("memory_budget"))
baseline = status("VmRSS")
source = paths[0] if len(paths) == 1 else Mixture(
    paths, weights=[1] * len(paths), epoch_cells=epoch_cells)
with slafload.Loader(source, n_epochs=None, tuning=tuning, **settings) as it:
    got = 0
    for batch in it:
        got += len(batch["input_ids"])
        if got >= cells:
            break
peak = status("VmHWM")
print(json.dumps({"baseline_bytes": baseline, "peak_bytes": peak, "cells": got}))
"""


def memory(args) -> dict[str, Any]:
    """Peak RSS of one source and of ``--memory-sources`` mixed, each in a fresh process."""
    paths = [str(p) for p in more_atlases(args, args.memory_sources)]
    settings = {"batch_size": args.batch_size, "max_genes": args.max_genes, "seed": args.seed,
                "memory_budget": args.memory_budget,
                "epoch_cells": args.memory_sources * args.cells}  # fmt: skip
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}  # as tests/test_memory.py: arenas are noise
    out: dict[str, Any] = {"malloc_arena_max": 2, "memory_budget": args.memory_budget}
    for name, chosen in (("1 source", paths[:1]), (f"{len(paths)} sources", paths)):
        cmd = [sys.executable, "-c", _MEMORY_CHILD, json.dumps(chosen), json.dumps(settings),
               str(args.measure)]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        got = json.loads(run.stdout.strip().splitlines()[-1])
        got["growth_bytes"] = got["peak_bytes"] - got["baseline_bytes"]
        out[name] = got
    return out


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
    """Steady-state cells/s (wall) and CPU seconds per cell over ``--measure`` cells, after
    ``--warm-up`` cells (the same for both contenders).
    """
    with loader(source, args) as it:
        batches, warm = iter(it), 0
        # Warm-up: time to first batch is not throughput, and neither is the rest of the
        # first fetch (read after the first batch's few cells, docs/pipeline.md), which is
        # twice as large for a 2-source mixture as for one source (one fetch of each).
        while warm < args.warm_up:
            warm += len(next(batches)["cell_integer_id"])
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
    p.add_argument("--measure", type=int, default=400_000, help="cells timed per run")
    p.add_argument("--warm-up", type=int, default=4_096,
                   help="cells taken before the timing starts (the first mixed fetch)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=9, help="interleaved runs of each loader")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampler", choices=["default", "block"], default="default",
                   help="the loader's default sampler, or BlockShuffle(16, 64)")  # fmt: skip
    p.add_argument("--memory-budget", type=int, default=512 << 20, help="bytes (the default)")
    p.add_argument("--memory-sources", type=int, default=8,
                   help="sources of the peak-RSS run (0: skip it)")  # fmt: skip
    p.add_argument("--data", default="/tmp/slafload-bench-mixture")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--memory-only", action="store_true", help="only the peak-RSS run")
    args = p.parse_args()
    if args.memory_only:
        print(json.dumps(memory(args), indent=2))
        return
    paths, single = atlases(args)
    load = [os.getloadavg()[0]]  # other work on the machine moves the wall ratio most
    mixing = {mix: source_mix(paths, args, mix) for mix in ("cell", "batch")}
    runs: dict[str, list[tuple[float, float]]] = {"single": [], "mixture": []}
    rate(single, args)  # round 0: page cache and kernels warm, not counted
    for _ in range(args.rounds):  # interleaved, so load on the machine hits both alike
        runs["single"].append(rate(single, args))
        runs["mixture"].append(rate(mixture(paths, args, "cell"), args))
    load.append(os.getloadavg()[0])
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
        "memory": memory(args) if args.memory_sources > 1 else None,
        "page_cache": "warm",
        "load_average": {"before": load[0], "after": load[1], "cpus": os.cpu_count()},
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
