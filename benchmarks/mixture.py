"""Throughput of a two-source mixture against the single-source loader on the same total data.

What it measures
----------------
Synthetic atlases from :func:`slafload.synthetic.write_atlas` (same generator and settings):
``single`` (``2 * --cells`` cells) and two halves ``a`` and ``b`` (``--cells`` cells each,
other seeds). Three contenders, each a :class:`slafload.Loader` with the Geneformer tokenizer
and the default chunk-shuffle sampler, delivering one epoch of CPU tensors:

* ``single``          -- the single dataset;
* ``mixture``         -- ``Mixture([a, b])``: the same genes, so no remap (the cost of mixing);
* ``mixture_remap``   -- ``Mixture([a, b'], vocabulary="union")`` where ``b'`` has half its
                         genes renamed: every chunk of ``b'`` goes through a ``GeneRemap``
                         (the cost of mixing *and* of aligning genes, which a single dataset
                         in its own vocabulary does not pay);
* ``single_remap``    -- the single dataset through a ``GeneRemap`` into a vocabulary listing
                         its genes in reverse (every chunk remapped): what aligning costs
                         without mixing.

The contenders run in the same process, interleaved round by round (one epoch each per round,
after a warm-up epoch each, so the page cache is warm); each figure is the median cells/s over
``--rounds`` rounds (of wall time, and of the process's CPU time, which other processes on a
shared machine disturb less), and the ratios are ``mixture / single`` and ``mixture_remap / single``. Results go to
``benchmarks/results/mixture.json``. Tests never depend on these numbers: the machine running
them may be shared and noisy.

Run:  python benchmarks/mixture.py --cells 50000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import lance
import pyarrow as pa

import slafload
from slafload import Loader, Mixture
from slafload.transforms import Vocabulary

RESULTS = Path(__file__).parent / "results" / "mixture.json"


def write(path: Path, args: argparse.Namespace, n_cells: int, seed: int) -> Path:
    return slafload.synthetic.write_atlas(
        path, n_cells=n_cells, n_genes=args.genes, mean_nnz=args.nnz, seed=seed, n_plates=8
    )


def rename_half_the_genes(path: Path, n_genes: int) -> None:
    names = [f"GENE{g + n_genes // 2:06d}" for g in range(1, n_genes + 1)]
    ids = pa.array(range(n_genes), pa.uint16())
    lance.write_dataset(
        pa.table({"gene_id": names, "gene_integer_id": ids}),
        f"{path}/genes.lance",
        mode="overwrite",
    )


def epoch_rate(make) -> tuple[float, float]:
    """Cells per second of wall time and per second of this process's CPU time (all its
    threads: less disturbed by other processes on a shared machine) of one epoch of a fresh
    loader (the times include its start-up)."""
    with make() as loader:
        started, cpu, cells = time.perf_counter(), time.process_time(), 0
        for batch in loader:
            cells += len(batch["cell_integer_id"])
        return cells / (time.perf_counter() - started), cells / (time.process_time() - cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cells", type=int, default=50_000, help="cells per half (single: twice)")
    p.add_argument("--genes", type=int, default=2_000)
    p.add_argument("--nnz", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    settings = {"batch_size": 64, "max_genes": 256, "chunk_cells": 4096, "seed": 0}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        single = write(tmp / "single.slaf", args, 2 * args.cells, seed=1)
        a = write(tmp / "a.slaf", args, args.cells, seed=2)
        b = write(tmp / "b.slaf", args, args.cells, seed=3)
        b_renamed = write(tmp / "b_renamed.slaf", args, args.cells, seed=3)
        rename_half_the_genes(b_renamed, args.genes)
        single_ds = slafload.open_dataset(single)
        reverse = Vocabulary(tuple(reversed(Vocabulary.from_dataset(single_ds).genes)))
        contenders = {
            "single": lambda: Loader(single, **settings),
            "mixture": lambda: Loader(Mixture([a, b]), **settings),
            "mixture_remap": lambda: Loader(
                Mixture([a, b_renamed], vocabulary="union"), **settings
            ),
            "single_remap": lambda: Loader(
                single_ds, transforms=[reverse.remap(single_ds)], **settings
            ),
        }
        for make in contenders.values():  # warm-up: page cache, imports, Polars pools
            epoch_rate(make)
        rates: dict[str, list[float]] = {name: [] for name in contenders}
        cpu_rates: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.rounds):
            for name, make in contenders.items():
                wall, cpu = epoch_rate(make)
                rates[name].append(wall)
                cpu_rates[name].append(cpu)
    medians = {name: statistics.median(r) for name, r in rates.items()}
    cpu = {name: statistics.median(r) for name, r in cpu_rates.items()}
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "note": "same process, contenders interleaved round by round, page cache warm; "
        "the machine may be shared and noisy",
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "settings": settings,
        "cells_per_s": {name: sorted(r) for name, r in rates.items()},
        "median_cells_per_s": medians,
        "cells_per_cpu_s": {name: sorted(r) for name, r in cpu_rates.items()},
        "median_cells_per_cpu_s": cpu,
        "cpu_ratio_mixture_to_single": cpu["mixture"] / cpu["single"],
        "ratio_mixture_to_single": medians["mixture"] / medians["single"],
        "ratio_mixture_remap_to_single": medians["mixture_remap"] / medians["single"],
        "ratio_single_remap_to_single": medians["single_remap"] / medians["single"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("median_cells_per_s", "ratio_mixture_to_single",
                                             "cpu_ratio_mixture_to_single",
                                             "ratio_mixture_remap_to_single", "ratio_single_remap_to_single")}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
