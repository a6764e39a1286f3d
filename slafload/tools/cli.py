"""The ``slafload`` command line: convert, info, optimize, synth, tune, verify, warm-up, cache,
bench.

User mistakes (a missing file, a path that is not a SLAF dataset, bad arguments) print one line
to stderr and exit with status 2, without a traceback. Anything else is a bug and propagates.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl

from slafload.errors import DatasetError
from slafload.tools.cli_parser import _parser

_USER_ERRORS = (DatasetError, FileNotFoundError, FileExistsError, ValueError)
_OPTIONAL = ("anndata", "h5py", "scipy", "pandas")  # needed by convert only
_MAX_CATEGORIES = 8


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    lead = 1 if args_list[:1] in (["-v"], ["--verbose"]) else 0
    if args_list[lead : lead + 1] == ["bench"]:  # bench owns its arguments
        from slafload.tools import bench

        bench.main(args_list[lead + 1 :], prog="slafload bench")
        return 0
    parser = _parser()
    if not args_list:  # bare `slafload`: what it can do
        parser.print_help()
        return 0
    args = parser.parse_args(args_list)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        commands = {
            "convert": _convert,
            "info": _info,
            "optimize": _optimize,
            "synth": _synth,
            "tune": _tune,
            "warm-up": _warm_up,
            "verify": _verify,
            "cache": _cache,
        }
        return commands[args.command](args)
    except _USER_ERRORS as exc:
        print(f"slafload {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if exc.name not in _OPTIONAL:
            raise
        print(
            f"slafload {args.command}: error: {exc}. Install it with: "
            "pip install 'slafload[anndata]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"slafload {args.command}: interrupted", file=sys.stderr)
        return 130


def _convert(args: argparse.Namespace) -> int:
    from slafload import open_dataset
    from slafload.data.value_kind import COUNTS, value_kind
    from slafload.tools.convert import convert

    if len(args.paths) < 2:
        raise ValueError("give at least one input .h5ad and then the output path")
    *inputs, output = args.paths
    _refuse_existing(output, args.overwrite)
    path = convert(
        inputs,
        output,
        layer=args.layer,
        raw=args.raw,
        shuffle_seed=args.shuffle_seed,
        shuffle_block=args.shuffle_block,
        chunk_cells=args.chunk_cells,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    ds = open_dataset(path)
    kind = value_kind(ds).kind
    what = "counts" if kind == COUNTS else "not counts: presets that normalise counts warn"
    print(
        f"wrote {path}: {ds.n_cells:,} cells x {ds.n_genes:,} genes, {ds.n_rows:,} non-zeros "
        f"({ds.value_type}, {what})"
    )
    return 0


def _info(args: argparse.Namespace) -> int:
    from slafload import open_dataset
    from slafload.data.value_kind import value_kind, value_range
    from slafload.tools.optimize import file_format

    if args.path.endswith((".h5ad", ".h5")) and Path(args.path).is_file():
        raise ValueError(
            f"{args.path} is an AnnData file, not a SLAF dataset; convert it first: "
            f"slafload convert {args.path} OUT.slaf"
        )
    ds = open_dataset(args.path)
    fmt = file_format(ds.expression)
    hint = "" if fmt == "2.0" else "; `slafload optimize` rewrites them in 2.0 for cheaper reads"
    total = ds.n_cells * ds.n_genes
    lines = [
        f"dataset    {ds.uri}",
        f"cells      {ds.n_cells:,}",
        f"genes      {ds.n_genes:,}",
        f"non-zeros  {ds.n_rows:,} ({ds.n_rows / ds.n_cells:,.1f} per cell)",
        f"sparsity   {1 - ds.n_rows / total:.4%}",
        f"values     {ds.value_type}, gene ids {ds.gene_type}",
        f"kind       {value_kind(ds)}, range {_range(ds)}",
        "tables     "
        + "; ".join(
            f"{name}: version {version}, {len(getattr(ds, name).get_fragments())} fragment(s)"
            for name, version in ds.versions.items()
        ),
        f"format     Lance {fmt} (the expression table's data files){hint}",
        "checked    metadata only, not the data: `slafload verify` reads every data file",
        "obs columns",
    ]
    skip = {"cell_integer_id", "cell_start_index"}
    obs = [name for name in ds.cells.schema.names if name not in skip]
    if args.json:
        summary: dict[str, Any] = {
            "uri": ds.uri,
            "n_cells": ds.n_cells,
            "n_genes": ds.n_genes,
            "n_nonzeros": ds.n_rows,
            "sparsity": 1 - ds.n_rows / total,
            "value_type": str(ds.value_type),
            "gene_type": str(ds.gene_type),
            "value_kind": value_kind(ds).kind,
            "value_range": value_range(ds),
            "versions": dict(ds.versions),
            "fragments": {name: len(getattr(ds, name).get_fragments()) for name in ds.versions},
            "expression_file_format": fmt,
            "obs_columns": {name: str(ds.cells.schema.field(name).type) for name in obs},
        }
        print(json.dumps(summary, indent=2))
        return 0
    for name in obs:
        lines.append(f"  {name}: {_describe(ds.obs([name]).get_column(name))}")
    print("\n".join(lines))
    return 0


def _refuse_existing(output: str, overwrite: bool) -> None:
    """A CLI user is told about ``--overwrite`` (the library says ``overwrite=True``)."""
    if not overwrite and Path(output).exists():
        raise FileExistsError(f"{output!r} already exists; pass --overwrite to replace it")


def _range(ds: Any) -> str:
    """The values' range as config.json records it (no scan of the data)."""
    from slafload.data.value_kind import value_range

    recorded = value_range(ds)
    return "not recorded" if recorded is None else f"[{recorded[0]:g}, {recorded[1]:g}]"


def _cache(args: argparse.Namespace) -> int:
    import json

    from slafload.tools.cache import cache

    try:
        options = json.loads(args.storage_options)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--storage-options is not JSON ({exc})") from exc
    if not isinstance(options, dict):
        raise ValueError(f"--storage-options must be a JSON object, got {args.storage_options!r}")
    report = cache(args.uri, args.path, storage_options=options or None,
                   progress=not args.no_progress)  # fmt: skip
    print(f"{args.path}: {report.files} files, {report.copied} copied "
          f"({report.bytes:,} bytes), {report.skipped} already there")  # fmt: skip
    return 0


def _verify(args: argparse.Namespace) -> int:
    import os

    from slafload.tools.verify import verify

    if not args.verbose:  # a damaged page may panic Lance: its message, not Rust's backtrace
        os.environ["RUST_BACKTRACE"] = "0"
    problems = verify(args.path, progress=not args.no_progress)
    for problem in problems:
        print(problem)
    if problems:
        print(f"slafload verify: {len(problems)} problem(s) in {args.path}", file=sys.stderr)
        return 1
    print(f"{args.path}: every table read, no problem found")
    return 0


def _warm_up(args: argparse.Namespace) -> int:
    from slafload.tools.warm_up import fill_cache

    try:
        runs = fill_cache(progress=not args.no_progress)
    except ImportError as exc:
        print(f"slafload warm-up: error: {exc}", file=sys.stderr)
        return 2
    print(f"numba's cache holds the read kernels and the token kernels of {runs} loader runs")
    return 0


def _describe(column: pl.Series) -> str:
    """dtype plus categories (strings, booleans) or range (numbers)."""
    dtype = str(column.dtype)
    if column.dtype.is_numeric():
        if column.null_count() == len(column):
            return f"{dtype}, all null"
        return f"{dtype}, range [{column.min()!s}, {column.max()!s}]"
    values = column.cast(pl.String).unique().sort(nulls_last=True).to_list()
    shown = ", ".join("null" if v is None else str(v) for v in values[:_MAX_CATEGORIES])
    more = f", ... (+{len(values) - _MAX_CATEGORIES} more)" if len(values) > _MAX_CATEGORIES else ""
    return f"{dtype}, {len(values):,} distinct: {shown}{more}"


def _optimize(args: argparse.Namespace) -> int:
    from slafload.tools.optimize import optimize

    r = optimize(
        args.path,
        storage_version=args.storage_version,
        rows_per_file=args.rows_per_file,
        delete_old_versions=args.delete_old_versions,
        progress=not args.no_progress,
    )
    if not r.changed:
        done = (
            f"; deleted its older versions ({r.freed_bytes / 1e9:.2f} GB)"
            if args.delete_old_versions
            else "; nothing to do"
        )
        print(f"{r.uri}: expression table already in Lance {r.storage_versions[0]}{done}")
        return 0
    print(
        f"optimized {r.uri}: {r.rows:,} rows, expression version {r.versions[0]} -> "
        f"{r.versions[1]}, Lance {r.storage_versions[0]} -> {r.storage_versions[1]}, "
        f"{r.data_files[0]:,} -> {r.data_files[1]:,} data files, "
        f"{r.bytes[0] / 1e9:.2f} -> {r.bytes[1] / 1e9:.2f} GB, {r.seconds:.0f} s"
        + (
            f"; deleted the older versions ({r.freed_bytes / 1e9:.2f} GB)"
            if args.delete_old_versions
            else f"; version {r.versions[0]} is kept (--delete-old-versions removes it)"
        )
    )
    return 0


def _synth(args: argparse.Namespace) -> int:
    from slafload.tools.synthetic import write_atlas

    _refuse_existing(args.path, args.overwrite)
    path = write_atlas(
        args.path,
        n_cells=args.cells,
        n_genes=args.genes,
        n_plates=args.plates,
        mean_nnz=args.nnz if args.nnz is not None else min(800, args.genes),
        empty_fraction=args.empty_fraction,
        seed=args.seed,
        value_dtype="float32" if args.float else "uint16",
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    print(f"wrote {path}: {args.cells:,} cells x {args.genes:,} genes, {args.plates} plates")
    return 0


def _tune(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from slafload import open_dataset
    from slafload.tools.tune import plot, tune

    report = tune(
        open_dataset(args.path),
        label=args.label,
        n_classes=args.classes,
        block_sizes=args.blocks,
        fetch_factors=args.factors,
        batch_size=args.batch_size,
        target_gap=args.target_gap,
        seconds=args.seconds,
        repeats=args.repeats,
        budget_s=args.budget_s,
        tokenizer=args.tokenizer,
        max_genes=args.max_genes,
        seed=args.seed,
        progress=not args.no_progress,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    inputs, rec = report["inputs"], report["recommendation"]
    print(
        f"label {inputs['label']['name']}: {inputs['label']['n_classes']} classes, "
        f"H = {inputs['label_entropy_bits']:.3f} bits; batch size {inputs['batch_size']}; "
        f"target gap {inputs['target_gap_bits']} bits"
    )
    print(f"{'b':>6}{'f':>6}{'fetch cells':>13}{'gap bits':>10}{'cells/s':>11}")
    for p in report["points"]:
        rate = "-" if p["cells_per_s"] is None else f"{p['cells_per_s']:,.0f}"
        mark = (
            "  <- recommended"
            if rec and all(p[k] == rec[k] for k in ("block_size", "fetch_factor"))
            else ""
        )
        print(f"{p['block_size']:>6}{p['fetch_factor']:>6}{p['fetch_cells']:>13,}"
              f"{p['expected_gap_bits']:>10.3f}{rate:>11}{mark}")  # fmt: skip
    png = out.with_suffix(".png")
    wrote = plot(report, str(png))
    print(f"wrote {out}" + (f" and {png}" if wrote else "") + f" in {report['elapsed_s']:.0f} s")
    if rec is None:
        print(
            f"slafload tune: no measured point is within {inputs['target_gap_bits']} bits; "
            "raise --factors or --budget-s, or add block size 1",
            file=sys.stderr,
        )
        return 1
    print(
        f"recommended: BlockShuffle(block_size={rec['block_size']}, "
        f"fetch_factor={rec['fetch_factor']}, batch_size={inputs['batch_size']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
