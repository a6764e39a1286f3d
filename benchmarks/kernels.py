"""What the compiled kernels buy: ``LoaderConfig.kernels="numba"`` against ``"numpy"``.

The token worker's per-cell loops (token rows, re-padding, scGPT's quantile bins; see
``slafload/kernels.py``) run as numba kernels or as numpy calls; the tokens are the same. Same
process, same atlas (the README benchmark's 50k x 20k atlas by default), warm page cache, the
two interleaved (the order alternates each round), each run a steady window of
``--epochs`` after ``--warmup`` epochs, reported as cells/s and as a fraction of a raw Lance
scan run right before it. The kernels are compiled before anything is timed.

    python benchmarks/kernels.py                          # 4 rounds, geneformer and scgpt
    python benchmarks/kernels.py --rounds 8 --layouts padded,packed

Writes ``benchmarks/results/kernels.json``; needs numba (``pip install slafload[fast]``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import slafload
from slafload.tools import bench

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("numpy", "numba")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", help="a SLAF dataset (default: the README benchmark's atlas)")
    p.add_argument("--data", default=str(ROOT / "data"), help="where that atlas is cached")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokenizers", default="geneformer,scgpt")
    p.add_argument("--layouts", default="padded")
    p.add_argument("--epochs", type=float, default=2.5)
    p.add_argument("--warmup", type=float, default=0.2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernels.json"))
    args = p.parse_args()
    atlas = argparse.Namespace(cells=50_000, genes=20_000, nnz=800, plates=14, data=args.data)
    path = Path(args.dataset) if args.dataset else bench.ensure_atlas(atlas)
    ds = slafload.open_dataset(path)
    page_cache = bench.warm_page_cache(ds)
    target, warmup = int(args.epochs * ds.n_cells), int(args.warmup * ds.n_cells)
    run_args = argparse.Namespace(
        batch_size=32, max_genes=2048, token_dtype="int64", layouts=args.layouts
    )
    tokenizers = args.tokenizers.split(",")
    compile_s = bench.warm_kernels(ds, tokenizers, run_args)
    cases = [(t, lay) for t in tokenizers for lay in args.layouts.split(",")]
    runs: dict[str, list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for tok, layout in cases:
            for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
                name = f"{tok} {layout} kernels={backend}"
                res = bench.timed_runs(
                    name,
                    lambda clock, tok=tok, layout=layout, backend=backend: bench.slafload_run(
                        ds, tok, run_args, target + warmup, clock, layout, kernels=backend
                    ),
                    1,
                    warmup=warmup,
                    floor=lambda: bench.raw_rate(ds, target),
                )
                runs.setdefault(name, []).append(
                    {
                        "cells_per_s": round(res["cells_per_s"]),
                        "fraction_of_raw_scan": round(res["fraction_of_raw_scan"], 3),
                        "cpu_us_per_cell": round(res["cpu_us_per_cell"], 2),
                    }
                )
                print(name, runs[name][-1], flush=True)
    summary = {}
    for tok, layout in cases:
        a, b = (runs[f"{tok} {layout} kernels={k}"] for k in BACKENDS)
        med = {
            k: {m: statistics.median(x[m] for x in rows) for m in rows[0]}
            for k, rows in zip(BACKENDS, (a, b), strict=True)
        }
        wins = sum(y["cells_per_s"] > x["cells_per_s"] for x, y in zip(a, b, strict=True))
        summary[f"{tok} {layout}"] = {**med, "numba_faster_in": f"{wins} of {len(a)} rounds"}
        print(f"{tok} {layout}: {summary[f'{tok} {layout}']}")
    report = {
        "dataset": {"path": str(path), "n_cells": ds.n_cells, "n_rows": ds.n_rows},
        "settings": {
            "rounds": args.rounds,
            "epochs_per_run": args.epochs,
            "warmup_epochs": args.warmup,
            "batch_size": 32,
            "max_genes": 2048,
            "page_cache": page_cache,
            "kernels_compiled_before_timing_s": round(compile_s, 2),
            "order": "interleaved, alternating each round; each run right after a raw scan",
        },
        "summary": summary,
        "runs": runs,
        "machine": bench.machine(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
