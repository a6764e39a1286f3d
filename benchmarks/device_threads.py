"""Where a loader's CPU goes, thread by thread, when its batches go to a GPU.

Streams the same cells through ``slafload.Loader`` three ways, in turn: CPU tensors
(``device=None``), to CUDA through pinned memory (``device="cuda"``, the default
``pin_memory``), and to CUDA from pageable memory (``pin_memory=False``: the training thread's
``.to()`` then copies synchronously). For each it reports cells/s after a warm-up and the CPU
time per cell of every thread of the process (Python's thread names where Python owns the
thread, the kernel's otherwise: ``lance_backgroun`` are Lance's decoding threads), from each
thread's CPU clock (a thread that ends inside the timed window takes its CPU with it: the
threads' sum can fall short of the process's). Linux only. Without a CUDA device only the CPU-tensor row runs.

    python benchmarks/device_threads.py [--dataset PATH] [--tokenizers geneformer,scgpt]

Writes ``benchmarks/results/device_threads.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

import slafload
from slafload.tools import bench

ROOT = Path(__file__).resolve().parent.parent
MODES: dict[str, dict[str, Any]] = {
    "cpu": {},
    "cuda": {"device": "cuda"},
    "cuda_pageable": {"device": "cuda", "pin_memory": False},
}


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds so far of every thread of this process, by thread id, with its name.

    Read from each thread's CPU clock (nanoseconds, Linux's per-thread clock id of a thread
    id), or, where that is refused, from ``/proc/self/task/<tid>/stat`` (10 ms ticks).
    """
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        task = Path("/proc/self/task") / tid
        try:
            comm = (task / "comm").read_text().strip()
            try:
                seconds = time.clock_gettime((~int(tid) << 3) | 6)  # CPUCLOCK_SCHED, per thread
            except OSError:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                seconds = (int(fields[11]) + int(fields[12])) / tick
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid)) or comm
        out[int(tid)] = (name.rstrip("0123456789_"), seconds)
    return out


def run(path: Path, tokenizer: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One timed stream: cells/s and CPU µs per cell, in all and by thread name."""
    ds = slafload.open_dataset(path)
    with slafload.Loader(
        ds, tokenizer=tokenizer, batch_size=args.batch_size, max_genes=args.max_genes,
        n_epochs=None, seed=0, **MODES[mode],
    ) as loader:  # fmt: skip
        batches = iter(loader)
        bench.consume(batches, bench.Clock(), args.warmup, key="cell_integer_id")
        before, cpu0, t0 = thread_cpu(), time.process_time(), time.perf_counter()
        clock = bench.Clock()
        bench.consume(batches, clock, args.cells, key="cell_integer_id")
        if mode != "cpu":
            torch.cuda.synchronize()
        wall, cpu, after = time.perf_counter() - t0, time.process_time() - cpu0, thread_cpu()
    by_thread: dict[str, float] = {}
    for tid, (name, seconds) in after.items():
        spent = seconds - before.get(tid, (name, 0.0))[1]
        by_thread[name] = by_thread.get(name, 0.0) + spent / clock.cells * 1e6
    return {
        "cells_per_s": clock.cells / wall,
        "cpu_us_per_cell": cpu / clock.cells * 1e6,
        "cpu_us_per_cell_by_thread": dict(sorted(by_thread.items(), key=lambda kv: -kv[1])),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", help="a SLAF dataset (default: the benchmark's 50k atlas)")
    p.add_argument("--tokenizers", default="geneformer,scgpt")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-genes", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=20_000, help="cells before the timed window")
    p.add_argument("--cells", type=int, default=150_000, help="cells timed per run")
    p.add_argument("--rounds", type=int, default=2, help="runs of each mode, interleaved")
    p.add_argument("--data", default=str(ROOT / "data"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "device_threads.json"))
    args = p.parse_args()
    if args.dataset:
        path = Path(args.dataset)
    else:
        atlas = argparse.Namespace(cells=50_000, genes=20_000, nnz=800, plates=14, data=args.data)
        path = bench.ensure_atlas(atlas)
    modes = list(MODES) if torch.cuda.is_available() else ["cpu"]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for tokenizer in args.tokenizers.split(","):
        runs = results.setdefault(tokenizer, {mode: [] for mode in modes})
        for _ in range(args.rounds):
            for mode in modes:
                r = run(path, tokenizer, mode, args)
                runs[mode].append(r)
                threads = ", ".join(
                    f"{k} {v:.1f}" for k, v in r["cpu_us_per_cell_by_thread"].items() if v >= 0.1
                )
                print(f"{tokenizer:>10} {mode:>13}: {r['cells_per_s']:>9,.0f} cells/s, "
                      f"{r['cpu_us_per_cell']:5.1f} us CPU/cell ({threads})", flush=True)  # fmt: skip
    report = {
        "dataset": str(path),
        "machine": bench.machine(),
        "torch": torch.__version__,
        "settings": {k: v for k, v in vars(args).items() if k not in ("data", "out")},
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
