"""The ``slafload`` command line: convert, info, optimize, synth, tune, bench.

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
from typing import Any, NoReturn

import polars as pl

from slafload.errors import DatasetError

_USER_ERRORS = (DatasetError, FileNotFoundError, FileExistsError, ValueError)
_OPTIONAL = ("anndata", "h5py", "scipy", "pandas")  # needed by convert only
_MAX_CATEGORIES = 8

_EPILOG = """examples:
  slafload convert plate1.h5ad plate2.h5ad atlas.slaf --layer counts
  slafload convert big.h5ad atlas.slaf --shuffle-seed 0     # pre-shuffled for plain streaming
  slafload info atlas.slaf
  slafload verify atlas.slaf                                # read everything, find damage
  slafload optimize atlas.slaf                              # cheaper random block reads
  slafload synth toy.slaf --cells 10000 --genes 2000 --plates 14
  slafload tune atlas.slaf --label cell_type --budget-s 60  # pick BlockShuffle's (b, f)
  slafload bench --cells 20000 --no-peers                   # see slafload bench --help
  slafload warm-up                                          # compile kernels (containers)
"""


_VERIFY = """Read every table of a SLAF dataset once and report each problem with its data file
and rows: damaged or truncated files, undecodable pages, row counts, cell ids and offsets, gene
ids out of range, negative or NaN values. Exit status 1 if any is found."""
_WARM_UP = """Compile every kernel into numba's on-disk cache (for container builds). The read
kernels, then the token kernels by short loader runs on tiny synthetic atlases, so the first run
on this machine does not compile. numba keys the cache by CPU model; NUMBA_CACHE_DIR picks where
it goes."""


class _Parser(argparse.ArgumentParser):
    """Reports bad arguments on one line (argparse prints the usage block too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="slafload",
        description="Convert AnnData to SLAF, inspect SLAF datasets, write synthetic atlases "
        "and benchmark slafload's loader.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    c = sub.add_parser(
        "convert",
        help="convert .h5ad file(s) into one SLAF dataset",
        description="Convert one or more .h5ad files into one SLAF dataset, reading them in "
        "cell chunks (memory stays bounded whatever the file size). Several inputs are "
        "concatenated in order, with a 'source' obs column; their genes must match. Integer "
        "counts are stored as uint16 (uint32 when they do not fit), other values as float32.",
    )
    c.add_argument("paths", nargs="+", metavar="PATH", help="input .h5ad file(s), then OUT.slaf")
    which = c.add_mutually_exclusive_group()
    which.add_argument("--layer", metavar="NAME", help="convert layers[NAME] instead of X")
    which.add_argument("--raw", action="store_true", help="convert raw.X (and raw.var)")
    c.add_argument(
        "--shuffle-seed",
        type=int,
        metavar="N",
        help="write cells in a seeded shuffled block order (keeps ids in 'original_index')",
    )
    c.add_argument(
        "--shuffle-block",
        type=int,
        default=8,
        metavar="CELLS",
        help="consecutive cells kept together by --shuffle-seed (default: 8)",
    )
    c.add_argument("--chunk-cells", type=int, metavar="CELLS", help="cells read per chunk")
    c.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    c.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    i = sub.add_parser(
        "info",
        help="summarise a SLAF dataset",
        description="Cells, genes, non-zeros, sparsity, obs columns (with categories), and the "
        "Lance version and fragment count of each table, and the expression table's Lance file "
        "format.",
    )
    i.add_argument("path", metavar="PATH", help="SLAF dataset directory or URI")
    i.add_argument("--json", action="store_true", help="print the summary as one JSON object")

    o = sub.add_parser(
        "optimize",
        help="rewrite the expression table for cheaper random reads (a new Lance version)",
        description="Rewrite expression.lance, same rows in the same order, in Lance's 2.0 file "
        "format (and optionally into larger data files) as a new Lance version. Random block "
        "reads (BlockShuffle) cost about half the CPU; the table takes ~2.9x the disk. Tokens "
        "are unchanged; the previous version stays readable (checkpoints taken before still "
        "resume) until --delete-old-versions removes it. Run it with no other writer on the "
        "dataset. See docs/sampling.md.",
    )
    o.add_argument("path", metavar="DATASET", help="SLAF dataset directory or URI")
    o.add_argument(
        "--storage-version",
        default="2.0",
        choices=("2.0", "2.1", "2.2"),
        help="Lance file format of the new data files (default: 2.0; 2.2 undoes)",
    )
    o.add_argument(
        "--rows-per-file", type=int, metavar="N", help="rows per data file (default: Lance's)"
    )
    o.add_argument(
        "--delete-old-versions",
        action="store_true",
        help="then delete the expression table's older versions and their files (checkpoints "
        "taken before can no longer be resumed)",
    )
    o.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    s = sub.add_parser(
        "synth",
        help="write a synthetic plate-structured atlas",
        description="Write a seeded synthetic SLAF atlas (slafload.synthetic.write_atlas).",
    )
    s.add_argument("path", metavar="OUT", help="dataset directory to create")
    s.add_argument("--cells", type=int, default=10_000, help="number of cells (default: 10000)")
    s.add_argument("--genes", type=int, default=20_000, help="number of genes (default: 20000)")
    s.add_argument("--plates", type=int, default=14, help="number of plates (default: 14)")
    s.add_argument(
        "--nnz", type=int, help="mean non-zeros per cell (default: 800, at most --genes)"
    )
    s.add_argument(
        "--empty-fraction", type=float, default=0.0, help="fraction of cells with no counts"
    )
    s.add_argument("--float", action="store_true", help="log-normalised float32 values")
    s.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    s.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    s.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    _add_tune(sub)
    v = sub.add_parser("verify", help=_VERIFY.split(".")[0].lower(), description=_VERIFY)
    v.add_argument("path", metavar="DATASET", help="SLAF dataset directory")
    v.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    w = sub.add_parser("warm-up", help=_WARM_UP.split(".")[0].lower(), description=_WARM_UP)
    w.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    sub.add_parser(
        "bench",
        help="throughput benchmark against the raw Lance floor and slafdb",
        add_help=False,
        description="Arguments are those of `slafload bench --help`.",
    )
    for name, command in sub.choices.items():  # -v after the command, too
        if name != "bench":  # bench owns its arguments
            command.add_argument(
                "-v",
                "--verbose",
                action="store_true",
                default=argparse.SUPPRESS,  # keeps a -v given before the command
                help="log progress details",
            )
    return p


def _version() -> str:
    from slafload import __version__

    return __version__


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


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _add_tune(sub) -> None:
    t = sub.add_parser(
        "tune",
        help="choose BlockShuffle's (block size, fetch factor) for a dataset",
        description="Measure the loader's cells/s on a small (block size, fetch factor) grid, "
        "compute each point's expected minibatch entropy gap to random sampling for a label "
        "(slafload.tools.tune), and recommend the fastest point within the target gap. Writes the "
        "report (every input of the recommendation) as JSON and a PNG next to it.",
    )
    t.add_argument("path", metavar="DATASET", help="SLAF dataset directory or URI")
    t.add_argument(
        "--label",
        metavar="COLUMN",
        help="obs column whose diversity matters (default: 'plate' if present, else "
        "--classes classes stored one after another)",
    )
    t.add_argument("--classes", type=int, default=14, help="K of the default (default: 14)")
    t.add_argument("--target-gap", type=float, default=0.05, help="bits (default: 0.05)")
    t.add_argument("--batch-size", type=int, default=32, help="minibatch size (default: 32)")
    t.add_argument(
        "--blocks",
        type=_ints,
        default=[1, 4, 16, 64, 256],
        metavar="B,B,...",
        help="block sizes to measure (default: 1,4,16,64,256)",
    )
    t.add_argument(
        "--factors",
        type=_ints,
        default=[16, 64, 256],
        metavar="F,F,...",
        help="fetch factors to measure (default: 16,64,256)",
    )
    t.add_argument("--seconds", type=float, default=2.0, help="timed seconds per run (default: 2)")
    t.add_argument(
        "--repeats", type=int, default=2, help="runs of each candidate point (default: 2)"
    )
    t.add_argument("--budget-s", type=float, default=120.0, help="total seconds (default: 120)")
    t.add_argument("--tokenizer", default="geneformer", help="tokenizer (default: geneformer)")
    t.add_argument("--max-genes", type=int, default=2048, help="tokens per cell (default: 2048)")
    t.add_argument("--seed", type=int, default=0, help="sampler seed (default: 0)")
    t.add_argument("--out", default="slafload-tune.json", help="JSON report (PNG beside it)")
    t.add_argument("--no-progress", action="store_true", help="hide the progress bar")


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
