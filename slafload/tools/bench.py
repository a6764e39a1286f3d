"""End-to-end throughput of slafload against the raw Lance scan floor and slafdb's loader.

Everything runs in one process on one synthetic atlas, so the ratios hold on a noisy shared
machine even when the absolute numbers move. Each run constructs its loader and draws
``--warmup`` epochs' worth of cells, then ``--epochs`` more (more than any queue can hold),
stopping right there. Its throughput is that of the steady window after the warm-up (the
method of docs/benchmarks.md: a training run lasts hours, and what it pays once at its start
is reported as time to the first batch); the rate from constructing the loader to the last
cell is reported beside it (``cells_per_s_end_to_end``). Right before each run a raw scan of
the same number of cells is timed, and the fraction of the raw scan is the median of each
run's rate over its own scan's: the shared machine's speed drifts by 20-30% within minutes,
more than any one contender's run-to-run spread. The page cache is warmed by a full scan
first.

Reported: cells/s per loader (median of ``--repeats`` runs), steady and end to end, the time
to the first batch, the raw floor (a bare Lance scan of the same rows, no processing), the
ratios, peak RSS during each run, and a per-stage profile of slafload's producer. For every
layout (``padded``, ``longest``, ``packed``) and tokenize placement: cells/s, tokens per batch, bytes per cell delivered, the training thread's
time in ``next()`` (p50/p99) and the producer's tokenizing cost (:mod:`slafload.tools.bench_layout`).
Writes JSON (and a PNG bar chart when matplotlib is there).

    python benchmarks/throughput.py                      # quick: about 2 minutes on 2 cores
    python benchmarks/throughput.py --full               # every contender, layout and preset
    python benchmarks/throughput.py --cells 200000 --no-peers

By default the run is quick (:data:`QUICK`: a 20,000-cell atlas, the two built-in tokenizers
and slafdb) and writes under ``./slafload-bench/``; ``--full`` restores the full comparison
(presets, layouts, numpy kernels, the stage profile and the layout report).

Library code never prints; this module is a benchmark driver and reports on stdout/stderr.
"""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import slafload
from slafload.config import Tuning
from slafload.kernels import Kernels
from slafload.tools.bench_args import ensure_atlas, parse_args
from slafload.tools.bench_layout import PLACEMENTS, layout_report
from slafload.tools.bench_measure import Clock, timed_runs
from slafload.tools.bench_profile import profile_stages
from slafload.tools.bench_report import machine, plot, print_table, ratios, save_report
from slafload.tools.bench_runs import (
    BUILTINS,
    PRESETS,
    dataloader_run,
    raw_floor,
    raw_rate,
    slafdb_run,
    slafload_run,
    warm_kernels,
    warm_page_cache,
)


@dataclass(frozen=True)
class _Runs:
    """One benchmark's dataset and arguments: each run draws ``warmup`` cells, then ``target``
    more, timed beside a raw scan of ``target`` cells.
    """

    ds: slafload.SlafDataset
    args: Any
    target: int
    warmup: int

    def timed(self, label: str, run: Callable[[Clock], object], repeats: int) -> dict[str, Any]:
        """``repeats`` runs of ``run``, each right after a raw scan (see :func:`timed_runs`)."""
        scan = partial(raw_rate, self.ds, self.target)
        return timed_runs(label, run, repeats, warmup=self.warmup, floor=scan)

    def ours(self, tok: str, layout: str = "padded", **settings: Any) -> Callable[[Clock], int]:
        """A run of slafload's loader with ``tok`` and ``layout``, and the command's settings."""
        until = self.warmup + self.target
        settings = {"tuning": Tuning(check_rows=self.args.check_rows),
                    "kernels": self.args.kernels, **settings}  # fmt: skip
        return lambda clock: slafload_run(self.ds, tok, self.args, until, clock, layout, **settings)


def main(argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    """Run the throughput benchmark from the command line; the report."""
    p, args = parse_args(argv, prog)
    if args.dataset:  # an object-store URI stays a string (a Path would fold its "//")
        path: Path | str = args.dataset if "://" in args.dataset else Path(args.dataset)
    else:
        path = ensure_atlas(args)
    options = json.loads(args.storage_options)
    if not isinstance(options, dict):
        p.error(f"--storage-options must be a JSON object, got {args.storage_options!r}")
    ds = slafload.open_dataset(path, storage_options=options or None)
    runs = _Runs(ds, args, max(1, int(args.epochs * ds.n_cells)), int(args.warmup * ds.n_cells))
    page_cache = warm_page_cache(ds)
    ours = BUILTINS + (() if args.no_presets else PRESETS)
    results: dict[str, Any] = {"raw_scan": timed_runs(
        "raw scan", lambda clock: raw_floor(ds, runs.target, clock), args.repeats
    )}  # fmt: skip
    compile_s = sum(_time_slafload(runs, tok, results) for tok in ours)
    _time_workers(runs, results)
    if _peers_wanted(args, path) and isinstance(path, Path):
        for tok in ("geneformer", "scgpt"):
            until = runs.warmup + runs.target
            run = partial(slafdb_run, path, tok, args, until)
            results[f"slafdb_{tok}"] = runs.timed(f"slafdb {tok}", run, args.peer_repeats)
    report = {
        "dataset": {
            "path": str(path),
            "n_cells": ds.n_cells,
            "n_genes": ds.n_genes,
            "n_rows": ds.n_rows,
            "nnz_per_cell": ds.n_rows / ds.n_cells,
        },
        "settings": _settings(runs, page_cache, compile_s),
        "results": results,
        "ratios": ratios(results, ours, _layouts(args)),
        "profile_us_per_cell": {tok: profile_stages(ds, tok, args) for tok in ours}
        if args.full
        else {},
        "layouts": _layout_report(ds, args) if args.full else None,
        "machine": machine(),
        "peak_rss_mb_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    out = save_report(report, args.out, print_table, plot)
    print(f"\nwrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return report


def _layouts(args: Any) -> list[str]:
    """The layouts timed beside padded (``--layouts``)."""
    return [name for name in args.layouts.split(",") if name]


def _time_slafload(runs: _Runs, tok: str, results: dict[str, Any]) -> float:
    """Time slafload with tokenizer or preset ``tok`` into ``results``: padded, then with numpy
    kernels (``--full``), each of ``--layouts`` and each placement on ``--device``; the
    seconds spent compiling kernels before the runs.
    """
    args = runs.args
    compile_s = 0.0
    if Kernels(args.kernels).backend == "numba":  # right before its runs: the rows before
        compile_s = warm_kernels(runs.ds, [tok], args)  # keep their peak RSS
    results[f"slafload_{tok}"] = runs.timed(f"slafload {tok}", runs.ours(tok), args.repeats)
    if tok not in BUILTINS:  # presets: their model's layout, on the host
        return compile_s
    if args.full and Kernels(args.kernels).backend == "numba":  # what the kernels buy
        results[f"slafload_{tok}_numpy_kernels"] = runs.timed(
            f"slafload {tok}, kernels='numpy'", runs.ours(tok, kernels="numpy"), args.repeats
        )
    for layout in _layouts(args):
        results[f"slafload_{tok}_{layout}"] = runs.timed(
            f"slafload {tok} {layout}", runs.ours(tok, layout), args.repeats
        )
    # On an accelerator: tokens delivered on the device, tokenized by the producer or there
    for layout, on in [(lay, on) for lay in ("padded", "packed") for on in PLACEMENTS]:
        if args.device is None:
            break
        results[f"slafload_{tok}_{layout}_{on}_on_{args.device}"] = runs.timed(
            f"slafload {tok} {layout} tokenize_on={on} on {args.device}",
            runs.ours(tok, layout, tokenize_on=on, device=args.device),
            args.repeats,
        )
    return compile_s


def _time_workers(runs: _Runs, results: dict[str, Any]) -> None:
    """Time geneformer through torch's DataLoader with each of ``--workers`` worker processes
    (several producers, one per worker) into ``results``.
    """
    until = runs.warmup + runs.target
    for workers in runs.args.workers:
        results[f"slafload_geneformer_workers{workers}"] = runs.timed(
            f"slafload geneformer, DataLoader with {workers} workers",
            partial(dataloader_run, runs.ds, "geneformer", runs.args, until, workers),
            runs.args.repeats,
        )


def _peers_wanted(args: Any, path: Path | str) -> bool:
    """Whether slafdb is timed: asked for, installed, and the dataset local; says why not."""
    if args.no_peers:
        return False
    try:
        import psutil  # noqa: F401  (slafdb silently yields nothing without it)
        import slaf  # noqa: F401
    except ImportError as exc:
        print(f"skipping slafdb: {exc}", file=sys.stderr)
        return False
    if isinstance(path, str):
        print("skipping slafdb: it is timed on local datasets only", file=sys.stderr)
        return False
    return True


def _settings(runs: _Runs, page_cache: str, compile_s: float) -> dict[str, Any]:
    """The report's ``settings``: what was run, and how it was timed."""
    args = runs.args
    return {
        "batch_size": args.batch_size,
        "max_genes": args.max_genes,
        # each model's default, whatever max_genes says
        "preset_widths": {}
        if args.no_presets
        else {"geneformer-v2": 4096, "geneformer-v1": 2048, "scgpt-reference": 3001},
        "token_dtype": args.token_dtype,
        "check_rows": args.check_rows,
        "kernels": {
            "requested": args.kernels,
            "in_effect": Kernels(args.kernels).backend,
            "compiled_before_timing_s": round(compile_s, 2),
        },
        "cells_per_run": runs.warmup + runs.target,
        "epochs_per_run": args.epochs,
        "warmup_cells": runs.warmup,
        "timing": "cells_per_s: steady, the epochs_per_run after warmup_cells; "
        "cells_per_s_end_to_end: from constructing the loader to the last cell; "
        "fraction_of_raw_scan: median over runs of cells_per_s over a raw scan run "
        "right before each",
        "repeats": args.repeats,
        "peer_repeats": args.peer_repeats,
        "page_cache": page_cache,
        "next_timing": f"{args.consumer_batches} next() calls after 20, each followed by a "
        f"{args.step_ms} ms simulated training step; device {args.device or 'none (CPU)'}",
    }


def _layout_report(ds: slafload.SlafDataset, args: Any) -> dict[str, Any]:
    """Each layout and tokenize placement of the built-ins (``--full``)."""
    return layout_report(
        ds,
        ("geneformer", "scgpt"),
        batch_size=args.batch_size,
        max_genes=args.max_genes,
        token_dtype=args.token_dtype,
        n_batches=args.consumer_batches,
        step_s=args.step_ms / 1e3,
        device=args.device,
    )


if __name__ == "__main__":
    main()
