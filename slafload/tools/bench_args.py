"""The throughput benchmark's command line: its options, the quick run's defaults, and the
synthetic atlas the options name (written once, reused while it matches).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import slafload

DESCRIPTION = (
    "End-to-end throughput of slafload against the raw Lance scan floor and slafdb's loader."
)
OUT_DIR = Path("slafload-bench")  # relative to the working directory; ignored by git
# The quick run's defaults (--full keeps the parser's own); explicit arguments override both.
QUICK: dict[str, Any] = {
    "cells": 20_000,
    "epochs": 1.0,
    "repeats": 2,
    "peer_repeats": 1,
    "no_presets": True,
    "layouts": "",
}


def ensure_atlas(args) -> Path:
    """The benchmark atlas for ``args``, written once and reused."""
    params = {
        "n_cells": args.cells,
        "n_genes": args.genes,
        "n_plates": args.plates,
        "mean_nnz": args.nnz,
        "seed": 0,
    }
    path = Path(args.data) / ("atlas_{n_cells}x{n_genes}_nnz{mean_nnz}.slaf".format(**params))
    config = path / "config.json"
    if config.exists():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            generator = json.loads(config.read_text())["generator"]
            written = {**generator["params"], "seed": generator["seed"]}
            if all(written.get(k) == v for k, v in params.items()):
                return path
    print(f"writing synthetic atlas {path} ...", file=sys.stderr)
    slafload.synthetic.write_atlas(path, overwrite=True, progress=True, **params)
    return path


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The benchmark's command-line options with ``--full``'s defaults (:func:`parse_args`
    sets the quick run's).
    """
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, allow_abbrev=False)
    _data_options(p)
    _run_options(p)
    _loader_options(p)
    return p


def _data_options(p: argparse.ArgumentParser) -> None:
    """The dataset timed: a synthetic atlas's shape, or one of yours."""
    p.add_argument(
        "--dataset",
        help="a SLAF dataset of yours to benchmark instead of the synthetic atlas (--cells, "
        "--genes, --nnz and --plates then do not apply; on a large one, time a fraction of an "
        "epoch: --epochs 0.05 --warmup 0.01)",
    )
    p.add_argument(
        "--storage-options",
        default="{}",
        help="Lance storage options for a --dataset on an object store, as JSON (e.g. "
        '\'{"aws_region": "us-east-1"}\'; credentials may come from the environment)',
    )
    p.add_argument(
        "--cells", type=int, default=50_000, help="cells of the synthetic atlas (quick: 20,000)"
    )
    p.add_argument("--genes", type=int, default=20_000, help="genes of the synthetic atlas")
    p.add_argument("--nnz", type=int, default=800, help="mean non-zeros per cell")
    p.add_argument("--plates", type=int, default=14, help="plates of the synthetic atlas")


def _run_options(p: argparse.ArgumentParser) -> None:
    """What each run draws, how often, which contenders run, and where the atlas is cached and
    the report written.
    """
    p.add_argument("--batch-size", type=int, default=32, help="cells per minibatch")
    p.add_argument("--max-genes", type=int, default=2048, help="tokens per cell")
    p.add_argument(
        "--epochs",
        type=float,
        default=2.5,
        help="cells timed per run after the warm-up, in epochs (default 2.5; quick: 1)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=0.2,
        help="epochs' worth of cells each run delivers before its steady window starts",
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="runs of each slafload contender (quick: 2)"
    )
    p.add_argument("--peer-repeats", type=int, default=2, help="runs of slafdb's (quick: 1)")
    p.add_argument("--no-peers", action="store_true", help="skip slafdb")
    p.add_argument(
        "--no-presets", action="store_true", help="skip the published-model presets (quick: skip)"
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="the full comparison: 50,000 cells, 2.5 epochs, 3 runs, the presets, every "
        "layout, numpy kernels, the stage profile and the layout report (about ten minutes on 2 cores)",
    )
    p.add_argument("--data", default=str(OUT_DIR / "data"), help="where the atlas is cached")
    p.add_argument(
        "--out",
        default=str(OUT_DIR / "throughput.json"),
        help="JSON report, with a PNG beside it (default: %(default)s)",
    )


def _loader_options(p: argparse.ArgumentParser) -> None:
    """slafload's settings in its runs, and the extra runs (layouts, device, workers)."""
    p.add_argument(
        "--layouts",
        default="longest,packed",
        help="layouts timed end to end beside padded (comma-separated; '' for none, the "
        "quick default)",
    )
    p.add_argument(
        "--token-dtype", default="int64", choices=["int64", "int32"], help="token array dtype"
    )
    p.add_argument(
        "--check-rows",
        default="once",
        choices=["once", "always"],
        help="Tuning.check_rows of slafload's runs ('always': compare every row's "
        "cell_integer_id on every read, as 0.1 did)",
    )
    p.add_argument(
        "--kernels",
        default="auto",
        choices=["auto", "numba", "numpy"],
        help="LoaderConfig.kernels of slafload's runs; with numba in effect the padded "
        "built-ins are timed with 'numpy' kernels too",
    )
    p.add_argument("--consumer-batches", type=int, default=300, help="next() calls timed")
    p.add_argument(
        "--step-ms", type=float, default=5.0, help="simulated training step while timing next()"
    )
    p.add_argument(
        "--device",
        default=None,
        help="e.g. cuda: also time padded/packed delivered there, tokenized by the producer "
        "or on the device, and time next() there",
    )
    p.add_argument(
        "--workers",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[],
        help="also time geneformer through torch's DataLoader with these numbers of worker "
        "processes (comma-separated, e.g. 2,4,8: how a many-core machine scales)",
    )


def parse_args(
    argv: Sequence[str] | None, prog: str | None = None
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the parsed ``argv``: the quick run's defaults (:data:`QUICK`) unless
    ``--full`` is among them; explicit arguments override both.
    """
    p = parser(prog)
    if not wants_full(argv):
        p.set_defaults(**QUICK)
    return p, p.parse_args(argv)


def wants_full(argv: Sequence[str] | None) -> bool:
    """Whether ``--full`` is among the arguments (it decides the other options' defaults)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--full", action="store_true")
    return pre.parse_known_args(argv)[0].full
