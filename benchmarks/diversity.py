"""Minibatch diversity vs throughput of block sampling on a plate-ordered atlas.

Sweeps ``BlockShuffle(block_size=b, fetch_factor=f)`` over a grid of ``b`` and ``f`` on the
synthetic atlas (cells stored plate by plate, as in Tahoe-100M) and, for each point, runs the
real :class:`slafload.Loader` end to end (read, shuffle, rank, tokenize, tensors) until
``--measure-cells`` cells (at least two fetches) have reached the consumer after a warm-up of
one fetch. Reported per point: steady-state cells/s and the mean Shannon entropy (bits) of the
plate label within each minibatch. For reference: ``ChunkShuffle``
(SLAF's behaviour) on the same data, random sampling (``b = 1``), the label entropy ``H(p)``
and the scDataset paper's bounds ``H(p) - (K-1) b / (2 m ln 2) <= E[H] <= H(p) - (K-1) /
(2 m ln 2)``. The points the issue's claim is about (``b`` in 16..64, ``f >= 64``) and
``ChunkShuffle`` are re-timed ``--repeats`` times, interleaved, and the median is used.

    python benchmarks/diversity.py                 # ~3-5 minutes on 2 busy cores
    python benchmarks/diversity.py --blocks 1,16,64 --factors 1,64 --measure-cells 8192

Writes ``benchmarks/results/diversity.json`` and ``diversity.png`` (two heatmaps).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import slafload
from slafload.samplers import BlockShuffle, ChunkShuffle, Sampler
from slafload.tools.bench_args import ensure_atlas
from slafload.tools.bench_measure import progress
from slafload.tools.bench_runs import raw_floor
from slafload.tools.diversity import batch_entropy, entropy, entropy_bounds

ROOT = Path.cwd()


def run(
    ds: slafload.SlafDataset, sampler: Sampler, args, fetch_cells: int, read_ahead: int = 1
) -> dict[str, Any]:
    """Steady-state cells/s and per-minibatch plate entropies of one loader run.

    The first fetch is a warm-up (its latency is the time to first batch, not throughput); then
    ``--measure-cells`` cells, or two fetches of ``fetch_cells`` if more, are timed.
    """
    warmup, target = fetch_cells, max(args.measure_cells, 2 * fetch_cells)
    entropies = []
    cells, start = 0, None
    with slafload.Loader(
        ds,
        sampler=sampler,
        batch_size=args.batch_size,
        max_genes=args.max_genes,
        obs_columns=["plate"],
        n_epochs=None,
        seed=args.seed,
        tuning=slafload.Tuning(read_ahead=read_ahead),
    ) as loader:
        for batch in loader:
            plates = batch["plate"].numpy()
            if len(plates) == args.batch_size:
                entropies.append(batch_entropy(plates))
            if start is None:
                warmup -= len(plates)
                if warmup <= 0:
                    start = time.perf_counter()
                continue
            cells += len(plates)
            if cells >= target:
                break
        elapsed = time.perf_counter() - start
    h = np.array(entropies)
    return {
        "cells_per_s": cells / elapsed,
        "entropy_bits": float(h.mean()),
        "entropy_sem": float(h.std(ddof=1) / math.sqrt(len(h))) if len(h) > 1 else 0.0,
        "n_batches": len(h),
    }


def iid_entropy(share: np.ndarray, m: int, seed: int, n: int = 200_000) -> float:
    """Monte Carlo expectation of the plug-in entropy of ``m`` i.i.d. draws from ``share``."""
    counts = np.random.default_rng(seed).multinomial(m, share, size=n) / m
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(counts > 0, counts * np.log2(counts), 0.0)
    return float(-terms.sum(axis=1).mean())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", type=int, default=200_000, help="atlas size")
    p.add_argument("--genes", type=int, default=2000)
    p.add_argument("--nnz", type=int, default=150, help="mean non-zeros per cell")
    p.add_argument("--plates", type=int, default=14)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-genes", type=int, default=256)
    p.add_argument("--blocks", default="1,4,16,64,256,1024")
    p.add_argument("--factors", default="1,4,16,64,256,1024")
    p.add_argument("--measure-cells", type=int, default=16_384, help="cells per grid point")
    p.add_argument("--chunk-cells", type=int, default=8192, help="ChunkShuffle's chunk")
    p.add_argument("--repeats", type=int, default=5, help="timings of the claim points")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=str(ROOT / "data"), help="where the atlas is cached")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "diversity.json"))
    args = p.parse_args(argv)
    blocks = [int(x) for x in args.blocks.split(",")]
    factors = [int(x) for x in args.factors.split(",")]

    ds = slafload.open_dataset(ensure_atlas(args))
    raw_floor(ds, ds.n_cells)  # warm the page cache: the atlas fits in RAM
    codes, plates = ds.obs_codes("plate")
    share = np.bincount(codes) / len(codes)
    h_p, m, k = entropy(share), args.batch_size, len(plates)

    def block(b: int, f: int) -> BlockShuffle:
        return BlockShuffle(block_size=b, fetch_factor=f, batch_size=m)

    grid: dict[str, dict[str, Any]] = {}
    points = [(b, f) for b in blocks for f in factors]
    # The bounds are first order in 1/m: at m = 32 and K = 14 the exact expectation of random
    # sampling sits below them. Its Monte Carlo value gives the size of that approximation error.
    random_exact = iid_entropy(share, m, args.seed)
    first_order_error = entropy_bounds(share, block_size=1, batch_size=m)[1] - random_exact
    for b, f in progress(points, desc="grid"):
        lo, hi = entropy_bounds(share, block_size=b, batch_size=m)
        res = run(ds, block(b, f), args, block(b, f).blocks_per_fetch * b)
        h, slack = res["entropy_bits"], 2 * res["entropy_sem"]
        res.update(block_size=b, fetch_factor=f, lower_bound=lo, upper_bound=hi,
                   within_bounds=bool(lo - slack <= h <= hi + slack),
                   within_bounds_up_to_first_order_error=bool(
                       lo - slack - first_order_error <= h <= hi + slack))  # fmt: skip
        grid[f"b{b}_f{f}"] = res

    # The claim points and ChunkShuffle are re-timed interleaved, with the producer's read-ahead
    # on (the default) and off, so both ratios come from the same stretch of machine time.
    chunk_sampler = ChunkShuffle(chunk_cells=args.chunk_cells)
    chunk = run(ds, chunk_sampler, args, args.chunk_cells)
    claim_points = [(b, f) for b in blocks if 16 <= b <= 64 for f in factors if f >= 64]
    timed = [("chunk_shuffle", chunk_sampler, args.chunk_cells)] + [
        (f"b{b}_f{f}", block(b, f), block(b, f).blocks_per_fetch * b) for b, f in claim_points
    ]
    timings: dict[str, list[float]] = {"chunk_shuffle": [chunk["cells_per_s"]]}
    for key in (f"b{b}_f{f}" for b, f in claim_points):
        timings[key] = [grid[key]["cells_per_s"]]
    no_read_ahead: dict[str, list[float]] = {key: [] for key, _, _ in timed}
    for _ in progress(range(args.repeats - 1), desc="re-timing claim points"):
        for key, sampler, fetch_cells in timed:
            timings[key].append(run(ds, sampler, args, fetch_cells)["cells_per_s"])
            no_read_ahead[key].append(
                run(ds, sampler, args, fetch_cells, read_ahead=0)["cells_per_s"]
            )
    chunk["cells_per_s"] = statistics.median(timings["chunk_shuffle"])
    chunk["runs_cells_per_s"] = timings["chunk_shuffle"]
    read_ahead = {
        key: {
            "cells_per_s_read_ahead_0": statistics.median(runs) if runs else None,
            "speedup_from_read_ahead": (
                statistics.median(timings[key]) / statistics.median(runs) if runs else None
            ),
        }
        for key, runs in no_read_ahead.items()
    }
    random_key = f"b1_f{max(factors)}" if 1 in blocks else None
    random_h = grid[random_key]["entropy_bits"] if random_key else None
    claims = []
    for b, f in claim_points:
        res = grid[f"b{b}_f{f}"]
        res["cells_per_s"] = statistics.median(timings[f"b{b}_f{f}"])
        res["runs_cells_per_s"] = timings[f"b{b}_f{f}"]
        gap = None if random_h is None else random_h - res["entropy_bits"]
        ratio = res["cells_per_s"] / chunk["cells_per_s"]
        claims.append({"block_size": b, "fetch_factor": f, "entropy_gap_to_random": gap,
                       "throughput_vs_chunk_shuffle": ratio,
                       "holds": gap is not None and gap <= 0.05 and ratio >= 0.5})  # fmt: skip

    report = {
        "benchmark": "diversity",
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "slafload": slafload.__version__,
        },
        "dataset": {
            "n_cells": ds.n_cells,
            "n_genes": ds.n_genes,
            "n_rows": ds.n_rows,
            "n_plates": k,
            "mean_nnz": args.nnz,
            "page_cache": "warm",
        },
        "settings": {
            "batch_size": m,
            "max_genes": args.max_genes,
            "tokenizer": "geneformer",
            "measure_cells": args.measure_cells,
            "chunk_cells": args.chunk_cells,
            "repeats_of_claim_points": args.repeats,
            "seed": args.seed,
        },
        "label_entropy_bits": h_p,
        "random_sampling": {
            "grid_point": random_key,
            "entropy_bits": random_h,
            "iid_expectation_monte_carlo": random_exact,
            "paper_upper_bound": h_p - (k - 1) / (2 * m * math.log(2)),
        },
        "chunk_shuffle": chunk,
        "grid": grid,
        "all_within_bounds": all(r["within_bounds"] for r in grid.values()),
        "all_within_bounds_up_to_first_order_error": all(
            r["within_bounds_up_to_first_order_error"] for r in grid.values()
        ),
        "claims": claims,
        "read_ahead_ablation": read_ahead,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print_table(report, blocks, factors)
    plot(report, blocks, factors, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return report


def print_table(report: dict[str, Any], blocks: list[int], factors: list[int]) -> None:
    grid = report["grid"]
    rs = report["random_sampling"]
    print(f"H(p) = {report['label_entropy_bits']:.3f} bits; random sampling "
          f"{rs['entropy_bits']:.3f} (i.i.d. expectation {rs['iid_expectation_monte_carlo']:.3f},"
          f" paper upper bound {rs['paper_upper_bound']:.3f}); ChunkShuffle entropy "
          f"{report['chunk_shuffle']['entropy_bits']:.3f} bits at "
          f"{report['chunk_shuffle']['cells_per_s']:.0f} cells/s")  # fmt: skip
    print("entropy bits (cells/s) [paper bounds], rows b, columns f = " + str(factors))
    for b in blocks:
        cells = [grid[f"b{b}_f{f}"] for f in factors]
        row = "  ".join(f"{c['entropy_bits']:.3f}{'' if c['within_bounds'] else '!'}"
                        f" ({c['cells_per_s']:.0f})" for c in cells)  # fmt: skip
        print(f"b={b:<5} [{cells[0]['lower_bound']:.2f}, {cells[0]['upper_bound']:.2f}]  {row}")
    for c in report["claims"]:
        print(f"claim b={c['block_size']} f={c['fetch_factor']}: gap to random "
              f"{c['entropy_gap_to_random']:.3f} bits, {c['throughput_vs_chunk_shuffle']:.2f}x "
              f"ChunkShuffle throughput -> {'holds' if c['holds'] else 'FAILS'}")  # fmt: skip
    for key, r in report["read_ahead_ablation"].items():
        if r["speedup_from_read_ahead"] is not None:
            print(f"read-ahead {key}: {r['speedup_from_read_ahead']:.2f}x over read_ahead=0")


def plot(report: dict[str, Any], blocks: list[int], factors: list[int], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no plot", file=sys.stderr)
        return
    grid = report["grid"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    panels = [("entropy_bits", "minibatch plate entropy (bits)", "{:.2f}", "viridis"),
              ("cells_per_s", "throughput (cells/s, steady state, end to end)", "{:.0f}", "magma")]  # fmt: skip
    for ax, (key, title, fmt, cmap) in zip(axes, panels, strict=True):
        values = np.array([[grid[f"b{b}_f{f}"][key] for f in factors] for b in blocks])
        image = ax.imshow(values, cmap=cmap, aspect="auto")
        ax.set_xticks(range(len(factors)), [str(f) for f in factors])
        ax.set_yticks(range(len(blocks)), [str(b) for b in blocks])
        ax.set_xlabel("fetch factor f")
        ax.set_ylabel("block size b")
        ax.set_title(title)
        for i in range(len(blocks)):
            for j in range(len(factors)):
                ax.text(j, i, fmt.format(values[i, j]), ha="center", va="center", fontsize=8,
                        color="white" if values[i, j] < values.mean() else "black")  # fmt: skip
        fig.colorbar(image, ax=ax)
    chunk = report["chunk_shuffle"]
    fig.suptitle(
        f"BlockShuffle on a plate-ordered atlas ({report['dataset']['n_cells']} cells, "
        f"{report['dataset']['n_plates']} plates, m={report['settings']['batch_size']}); "
        f"H(p)={report['label_entropy_bits']:.2f} bits; ChunkShuffle: "
        f"{chunk['entropy_bits']:.2f} bits, {chunk['cells_per_s']:.0f} cells/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
