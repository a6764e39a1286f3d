"""What the ``slafload`` command line accepts: its parser, each command's arguments.

:mod:`slafload.tools.cli` runs the commands.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

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
  slafload cache s3://bucket/atlas.slaf /nvme/atlas.slaf    # stage a bucket's atlas locally
"""


_VERIFY = """Read every table of a SLAF dataset once and report each problem with its data file
and rows: damaged or truncated files, undecodable pages, row counts, cell ids and offsets, gene
ids out of range, negative or NaN values. Exit status 1 if any is found."""
_WARM_UP = """Compile every kernel into numba's on-disk cache (for container builds). The read
kernels, then the token kernels by short loader runs on tiny synthetic atlases, so the first run
on this machine does not compile. numba keys the cache by CPU model; NUMBA_CACHE_DIR picks where
it goes."""


_CACHE = """Copy a SLAF dataset from S3 to a local directory, with a progress bar. Run it
again after an interruption: it continues where it stopped. Credentials come from
--storage-options or the environment, as for Lance."""


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

    _add_convert(sub)
    _add_info(sub)
    _add_optimize(sub)
    _add_synth(sub)
    _add_tune(sub)
    _add_cache(sub)
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


def _add_convert(sub) -> None:
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


def _add_info(sub) -> None:
    i = sub.add_parser(
        "info",
        help="summarise a SLAF dataset",
        description="Cells, genes, non-zeros, sparsity, obs columns (with categories), and the "
        "Lance version and fragment count of each table, and the expression table's Lance file "
        "format.",
    )
    i.add_argument("path", metavar="PATH", help="SLAF dataset directory or URI")
    i.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def _add_optimize(sub) -> None:
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


def _add_synth(sub) -> None:
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


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _add_cache(sub) -> None:
    c = sub.add_parser("cache", help=_CACHE.split(".")[0].lower(), description=_CACHE)
    c.add_argument("uri", metavar="URI", help="s3://bucket/atlas.slaf")
    c.add_argument("path", metavar="PATH", help="local directory to copy into")
    c.add_argument("--storage-options", default="{}",
                   help="Lance-style storage options as a JSON object (aws_region...)")  # fmt: skip
    c.add_argument("--no-progress", action="store_true", help="hide the progress bar")


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
