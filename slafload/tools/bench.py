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

import argparse
import contextlib
import gc
import itertools
import json
import os
import platform
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

import slafload
from slafload._lance._compat import data_file_path
from slafload.config import Tuning
from slafload.kernels import Kernels
from slafload.pipeline.chain import ChainSpec, build_chain
from slafload.pipeline.epochs import Run
from slafload.pipeline.reader import COLUMNS
from slafload.pipeline.stage import Stage
from slafload.presets import make_preset
from slafload.tokenizers import make_tokenizer
from slafload.tools.bench_layout import PLACEMENTS, layout_report, layout_table

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


# -- measurement helpers -----------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples this process's RSS every 20 ms while active; ``peak`` in bytes."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss_bytes())

    def __enter__(self) -> PeakRss:
        self.peak = _rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def progress(iterable, **kwargs):
    """``iterable`` with a tqdm progress bar when tqdm is installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, **kwargs)


class Clock:
    """Counts the cells a run delivers as they arrive, from its start (the clock's creation,
    just before the loader is constructed): when the first batch came, and when the first
    ``warmup`` cells were in (the end of the warm-up, where the steady window starts).
    """

    def __init__(self, warmup: int = 0):
        self.warmup = warmup
        self.start = time.perf_counter()
        self.cells = 0
        self.first_batch: float | None = None
        self.warm: tuple[float, int] | None = (self.start, 0) if warmup <= 0 else None

    def add(self, cells: int) -> None:
        """``cells`` more arrived now."""
        now = time.perf_counter()
        if self.first_batch is None:
            self.first_batch = now
        self.cells += cells
        if self.warm is None and self.cells >= self.warmup:
            self.warm = (now, self.cells)

    def timing(self) -> dict[str, float]:
        """End-to-end and steady (after the warm-up) cells/s, and time to the first batch."""
        end = time.perf_counter()
        warm_at, warm_cells = self.warm or (end, self.cells)
        return {
            "end_to_end": self.cells / (end - self.start),
            "steady": (self.cells - warm_cells) / (end - warm_at) if end > warm_at else 0.0,
            "first_batch_s": (self.first_batch or end) - self.start,
        }


def consume(
    batches: Iterator[dict[str, Any]], clock: Clock, until: int, key: str = "input_ids"
) -> int:
    """Draw batches until ``clock`` has counted ``until`` cells in all; the cells counted."""
    for batch in batches:
        clock.add(len(batch[key]))
        if clock.cells >= until:
            break
    return clock.cells


def timed_runs(
    label: str,
    run: Callable[[Clock], object],
    repeats: int,
    *,
    warmup: int = 0,
    floor: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """``repeats`` runs of ``run`` (which feeds the :class:`Clock` it is given): median
    cells/s after ``warmup`` cells (``cells_per_s``) and from the start
    (``cells_per_s_end_to_end``), time to the first batch, CPU time per cell (every thread of
    the process, whole run) and peak RSS.

    With ``floor`` (a raw scan's cells/s), the scan runs right before each run, and
    ``fraction_of_raw_scan`` is the median of each run's rate over its own scan's: the machine
    changes speed from minute to minute, so a run is compared with a scan made beside it.
    """
    steady, e2e, firsts, cpu, peaks, floors = [], [], [], [], [], []
    for _ in progress(range(repeats), desc=label, leave=False):
        if floor is not None:
            floors.append(floor())
        gc.collect()
        with PeakRss() as rss:
            cpu_start = time.process_time()
            clock = Clock(warmup)
            run(clock)
            timing, cpu_s = clock.timing(), time.process_time() - cpu_start
        steady.append(timing["steady"])
        e2e.append(timing["end_to_end"])
        firsts.append(timing["first_batch_s"])
        cpu.append(cpu_s / clock.cells * 1e6)
        peaks.append(rss.peak)
    out: dict[str, Any] = {
        "cells_per_s": statistics.median(steady),
        "runs_cells_per_s": steady,
        "cells_per_s_end_to_end": statistics.median(e2e),
        "runs_cells_per_s_end_to_end": e2e,
        "first_batch_s": statistics.median(firsts),
        "cpu_us_per_cell": statistics.median(cpu),
        "peak_rss_mb": max(peaks) / 2**20,
    }
    if floors:
        out["paired_raw_scan_cells_per_s"] = floors
        out["fraction_of_raw_scan"] = statistics.median(
            a / b for a, b in zip(steady, floors, strict=True)
        )
        out["fraction_of_raw_scan_end_to_end"] = statistics.median(
            a / b for a, b in zip(e2e, floors, strict=True)
        )
    return out


# -- the contenders ----------------------------------------------------------------------------


def raw_floor(ds: slafload.SlafDataset, target: int, clock: Clock | None = None) -> int:
    """A bare scan of the expression rows of ``target`` cells from the first, round and
    round (whole epochs, then the rows of the cells left): no ranking, tokenizing or tensors.
    """
    cells = 0
    while cells < target:
        n = min(ds.n_cells, target - cells)
        limit = None if n == ds.n_cells else int(ds.cell_start[n])
        for _ in ds.expression.to_batches(columns=COLUMNS, batch_size=1 << 20, limit=limit):
            pass
        cells += n
        if clock is not None:
            clock.add(n)
    return cells


def warm_page_cache(ds: slafload.SlafDataset) -> str:
    """Read the expression table once where it fits in half the RAM; what was done."""
    fragments = ds.expression.get_fragments()
    paths = [
        Path(ds.expression.uri, "data", data_file_path(d))
        for f in fragments
        for d in f.metadata.files
    ]
    if "://" in ds.uri or not all(p.exists() for p in paths):
        return "not warmed (not a local table)"
    size = sum(p.stat().st_size for p in paths)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size > ram // 2:
        return f"not warmed: the expression table ({size / 2**30:.1f} GiB) is over half the RAM"
    raw_floor(ds, ds.n_cells)
    return "warm (the expression table read once before timing; it fits in RAM)"


def raw_rate(ds: slafload.SlafDataset, target: int) -> float:
    """Cells/s of one :func:`raw_floor` run of ``target`` cells."""
    start = time.perf_counter()
    return raw_floor(ds, target) / (time.perf_counter() - start)


BUILTINS = ("geneformer", "scgpt")
PRESETS = ("geneformer-v2", "geneformer-v1", "scgpt-reference")


def warm_kernels(ds: slafload.SlafDataset, tokenizers: Sequence[str], args) -> float:
    """Compile the loader's numba kernels (:mod:`slafload.kernels`) for this dataset's types
    before anything is timed, and return the seconds it took.

    A loader compiles them in the background and runs numpy until they are ready, and numba
    keeps them on disk for later processes; in a fresh clone the first compile (~1 s) would
    otherwise fall inside the first timed run's steady window. A loader's first batch never
    waits for it either way.
    """
    start = time.perf_counter()
    for tok in tokenizers:
        layouts = [name for name in args.layouts.split(",") if name and tok in BUILTINS]
        for layout in ("padded", *layouts):
            options = preset_options(ds, tok) if tok in PRESETS else None
            with slafload.Loader(
                ds, tokenizer=tok, tokenizer_options=options, batch_size=args.batch_size,
                max_genes=args.max_genes, n_epochs=None, layout=layout,
                token_dtype=args.token_dtype, kernels="numba", chunk_cells=256, tuning=Tuning(piece_cells=256),
            ) as loader:  # fmt: skip
                next(iter(loader))
    return time.perf_counter() - start


def preset_options(ds: slafload.SlafDataset, name: str, seed: int = 0) -> dict[str, Any]:
    """``tokenizer_options`` for preset ``name``: dictionaries in the models' formats for every
    gene of ``ds`` (named by ``gene_id``), built in memory as a user's files would load.

    Geneformer: upper-cased ids as Ensembl keys, tokens after the four specials, random medians;
    scGPT: a ``vocab.json``-style name -> id dict with ``<pad>`` and ``<cls>``. Each preset keeps
    its model's default width (V2 4096, V1 2048, scGPT 3001).
    """
    import numpy as np

    names = [str(g) for g in ds.var(["gene_id"]).get_column("gene_id").to_list()]
    if name == "scgpt-reference":
        vocab = {"<pad>": 0, "<cls>": 1, "<eoc>": 2}
        vocab.update({g: i + 3 for i, g in enumerate(names)})
        return {"vocab": vocab, "gene_column": "gene_id"}
    medians = np.random.default_rng(seed).uniform(0.5, 5.0, len(names))
    tokens = {"<pad>": 0, "<mask>": 1, "<cls>": 2, "<eos>": 3}
    tokens.update({g.upper(): i + 4 for i, g in enumerate(names)})
    return {
        "token_dictionary": tokens,
        "gene_median_dictionary": {
            g.upper(): float(m) for g, m in zip(names, medians, strict=True)
        },
        "gene_column": "gene_id",
    }


def slafload_run(
    ds, tokenizer: str, args, until: int, clock: Clock, layout: str = "padded", **settings: Any
) -> int:
    """Stream cells through a slafload loader until ``clock`` counts ``until``; the cells."""
    options = preset_options(ds, tokenizer) if tokenizer in PRESETS else None
    with slafload.Loader(
        ds,
        tokenizer=tokenizer,
        tokenizer_options=options,
        batch_size=args.batch_size,
        max_genes=args.max_genes,
        n_epochs=None,
        seed=0,
        layout=layout,
        token_dtype=args.token_dtype,
        **settings,
    ) as loader:
        cells = consume(iter(loader), clock, until, key="cell_integer_id")
    if settings.get("device") is not None and str(settings["device"]).startswith("cuda"):
        import torch

        torch.cuda.synchronize()  # the device's queued work is part of the run
    return cells


def dataloader_run(
    ds, tokenizer: str, args, until: int, workers: int, clock: Clock | None = None
) -> int:
    """Stream ``until`` cells (counted by ``clock``) through ``torch.utils.data.DataLoader``
    over the loader's ``as_torch_dataset()`` with ``workers`` persistent worker processes
    (spawned: each starts Python, torch and Lance, which the run's clock includes), epoch
    after epoch; the cells delivered.

    Each worker runs a producer of its own over its share of every epoch, so this is how
    slafload uses more cores than one producer thread and its token worker can.
    """
    from torch.utils.data import DataLoader

    with slafload.Loader(
        ds, tokenizer=tokenizer, batch_size=args.batch_size, max_genes=args.max_genes,
        n_epochs=None, seed=0, token_dtype=args.token_dtype,
    ) as loader:  # fmt: skip
        dataset = loader.as_torch_dataset()
    data = DataLoader(
        dataset, batch_size=None, num_workers=workers,
        multiprocessing_context="spawn" if workers else None, persistent_workers=workers > 0,
    )  # fmt: skip
    clock = Clock() if clock is None else clock
    try:
        for epoch in itertools.count():  # one pass of the DataLoader is one epoch
            dataset.set_epoch(epoch)
            # Stopped mid-epoch, with batches in flight: each worker waits for its queue
            # feeder before it exits (torch_data.join_queue_feeders).
            if consume(iter(data), clock, until, key="cell_integer_id") >= until:
                return clock.cells
    finally:
        iterator = getattr(data, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()  # end the persistent workers now
    raise AssertionError("unreachable")


def slafdb_run(path: Path, tokenizer: str, args, until: int, clock: Clock) -> int:
    """Stream cells through slafdb's loader until ``clock`` counts ``until``; the cells."""
    _quiet_slafdb()
    from slaf import SLAFArray
    from slaf.ml.dataloaders import SLAFDataLoader

    loader = SLAFDataLoader(
        SLAFArray(str(path)),
        tokenizer_type=tokenizer,
        batch_size=args.batch_size,
        max_genes=args.max_genes,
        n_epochs=int(args.epochs + args.warmup) + 2,
        verbose=False,
    )
    try:
        return consume(iter(loader), clock, until)
    finally:
        loader._dataset.prefetcher.stop()


def _quiet_slafdb() -> None:
    """Silence slafdb's banner and INFO lines (loguru), which would break up the table."""
    with contextlib.suppress(ImportError):
        from loguru import logger

        logger.disable("slaf")


class _Timed(Stage[Any]):
    """Times the ``__next__`` of the stage it wraps (the stages before it included)."""

    def __init__(self, stage: Stage[Any]):
        super().__init__(stage)
        self.seconds = 0.0

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        try:
            return next(self.source)
        finally:
            self.seconds += time.perf_counter() - t0


def profile_stages(ds, tokenizer_name: str, args, n_batches: int = 400) -> dict[str, float]:
    """Microseconds per cell that the producer thread spends in each stage of the real chain.

    Runs :func:`slafload.pipeline.chain.build_chain`, as the loader does, on this thread with no read
    ahead, so each stage's time is its own: time inside a stage's ``__next__`` minus the time
    inside its source's. Work that Lance, Polars and the rank stage's worker (ranking and
    tokenizing, one piece ahead) do on their own threads counts only where the producer waits
    for it: under ``rank``.
    """
    config = slafload.LoaderConfig(
        batch_size=args.batch_size, max_genes=args.max_genes, tuning=Tuning(read_ahead=0)
    )
    if tokenizer_name in PRESETS:  # a model's tokenizer and its transforms (gene mapping...)
        preset = make_preset(tokenizer_name, ds, **preset_options(ds, tokenizer_name))
        spec = ChainSpec(ds, preset.tokenizer, config, transforms=tuple(preset.transforms))
    else:
        spec = ChainSpec(ds, make_tokenizer(tokenizer_name, max_genes=args.max_genes), config)
    run = Run(spec, slafload.samplers.ChunkShuffle(chunk_cells=config.chunk_cells))
    timed: dict[str, _Timed] = {}

    def observe(name: str, stage: Stage[Any]) -> Stage[Any]:
        timed[name] = _Timed(stage)
        return timed[name]

    cells = 0
    with closing(build_chain(spec, run.share(0).parts(), observe=observe)) as chain:
        for batch in itertools.islice(chain, n_batches):
            cells += len(batch["cell_integer_id"])
    names, inclusive = list(timed), [t.seconds for t in timed.values()]
    own = np.diff([0.0, *inclusive])
    return {name: float(t) / cells * 1e6 for name, t in zip(names, own, strict=True)}


# -- main --------------------------------------------------------------------------------------


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
    """The benchmark's command-line options (``--full``'s quick defaults are set by :func:`main`)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], allow_abbrev=False)
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
        "layout, numpy kernels, the stage profile and the layout report (tens of minutes)",
    )
    p.add_argument("--data", default=str(OUT_DIR / "data"), help="where the atlas is cached")
    p.add_argument(
        "--out",
        default=str(OUT_DIR / "throughput.json"),
        help="JSON report, with a PNG beside it (default: %(default)s)",
    )
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
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    """Run the throughput benchmark from the command line; the report."""
    p = parser(prog)
    if not _wants_full(argv):
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)

    if args.dataset:  # an object-store URI stays a string (a Path would fold its "//")
        path: Path | str = args.dataset if "://" in args.dataset else Path(args.dataset)
    else:
        path = ensure_atlas(args)
    options = json.loads(args.storage_options)
    if not isinstance(options, dict):
        p.error(f"--storage-options must be a JSON object, got {args.storage_options!r}")
    ds = slafload.open_dataset(path, storage_options=options or None)
    target = max(1, int(args.epochs * ds.n_cells))
    warmup = int(args.warmup * ds.n_cells)
    until = warmup + target
    page_cache = warm_page_cache(ds)

    def timed(label: str, run: Callable[[Clock], object], repeats: int) -> dict[str, Any]:
        scan = partial(raw_rate, ds, target)  # beside every run: see timed_runs
        return timed_runs(label, run, repeats, warmup=warmup, floor=scan)

    def ours_run(tok: str, layout: str = "padded", **settings: Any) -> Callable[[Clock], int]:
        tuning = Tuning(check_rows=args.check_rows)
        settings = {"tuning": tuning, "kernels": args.kernels, **settings}
        return lambda clock: slafload_run(ds, tok, args, until, clock, layout, **settings)

    ours = BUILTINS + (() if args.no_presets else PRESETS)
    kernels = Kernels(args.kernels).backend
    compile_s = 0.0
    results: dict[str, Any] = {}
    results["raw_scan"] = timed_runs(
        "raw scan", lambda clock: raw_floor(ds, target, clock), args.repeats
    )
    layouts = [name for name in args.layouts.split(",") if name]
    for tok in ours:
        if kernels == "numba":  # right before its runs: the rows before keep their peak RSS
            compile_s += warm_kernels(ds, [tok], args)
        results[f"slafload_{tok}"] = timed(f"slafload {tok}", ours_run(tok), args.repeats)
        if args.full and kernels == "numba" and tok in BUILTINS:  # what the kernels buy
            results[f"slafload_{tok}_numpy_kernels"] = timed(
                f"slafload {tok}, kernels='numpy'", ours_run(tok, kernels="numpy"), args.repeats
            )
        for layout in layouts if tok in BUILTINS else ():  # presets: their model's layout
            results[f"slafload_{tok}_{layout}"] = timed(
                f"slafload {tok} {layout}", ours_run(tok, layout), args.repeats
            )
        # On an accelerator: tokens delivered on the device, tokenized by the producer or there
        for layout, on in [(lay, on) for lay in ("padded", "packed") for on in PLACEMENTS]:
            if args.device is None or tok not in BUILTINS:
                break
            results[f"slafload_{tok}_{layout}_{on}_on_{args.device}"] = timed(
                f"slafload {tok} {layout} tokenize_on={on} on {args.device}",
                ours_run(tok, layout, tokenize_on=on, device=args.device),
                args.repeats,
            )
    for workers in args.workers:  # several producers, one per DataLoader worker process
        results[f"slafload_geneformer_workers{workers}"] = timed(
            f"slafload geneformer, DataLoader with {workers} workers",
            partial(dataloader_run, ds, "geneformer", args, until, workers),
            args.repeats,
        )
    peers = not args.no_peers
    if peers:
        try:
            import psutil  # noqa: F401  (slafdb silently yields nothing without it)
            import slaf  # noqa: F401
        except ImportError as exc:
            print(f"skipping slafdb: {exc}", file=sys.stderr)
            peers = False
        if peers and isinstance(path, str):
            print("skipping slafdb: it is timed on local datasets only", file=sys.stderr)
            peers = False
    if peers and isinstance(path, Path):
        for tok in ("geneformer", "scgpt"):
            results[f"slafdb_{tok}"] = timed(
                f"slafdb {tok}", partial(slafdb_run, path, tok, args, until), args.peer_repeats
            )

    ratios = {}
    for tok in ours:
        keys = [f"slafload_{tok}", f"slafload_{tok}_numpy_kernels"]
        keys += [f"slafload_{tok}_{layout}" for layout in layouts]
        keys += [k for k in results if k.startswith(f"slafload_{tok}_workers")]
        for key in (k for k in keys if k in results):
            name = key.removeprefix("slafload_")
            ratios[f"{name}_fraction_of_raw_scan"] = results[key]["fraction_of_raw_scan"]
        if f"slafdb_{tok}" in results:
            ours_, peer = results[f"slafload_{tok}"], results[f"slafdb_{tok}"]
            ratios[f"{tok}_vs_slafdb"] = ours_["cells_per_s"] / peer["cells_per_s"]
            ratios[f"{tok}_vs_slafdb_end_to_end"] = (
                ours_["cells_per_s_end_to_end"] / peer["cells_per_s_end_to_end"]
            )
    report = {
        "dataset": {
            "path": str(path),
            "n_cells": ds.n_cells,
            "n_genes": ds.n_genes,
            "n_rows": ds.n_rows,
            "nnz_per_cell": ds.n_rows / ds.n_cells,
        },
        "settings": {
            "batch_size": args.batch_size,
            "max_genes": args.max_genes,
            "preset_widths": {}
            if args.no_presets
            else {
                "geneformer-v2": 4096,
                "geneformer-v1": 2048,
                "scgpt-reference": 3001,
            },  # each model's default, whatever max_genes says
            "token_dtype": args.token_dtype,
            "check_rows": args.check_rows,
            "kernels": {
                "requested": args.kernels,
                "in_effect": kernels,
                "compiled_before_timing_s": round(compile_s, 2),
            },
            "cells_per_run": until,
            "epochs_per_run": args.epochs,
            "warmup_cells": warmup,
            "timing": "cells_per_s: steady, the epochs_per_run after warmup_cells; "
            "cells_per_s_end_to_end: from constructing the loader to the last cell; "
            "fraction_of_raw_scan: median over runs of cells_per_s over a raw scan run "
            "right before each",
            "repeats": args.repeats,
            "peer_repeats": args.peer_repeats,
            "page_cache": page_cache,
            "next_timing": f"{args.consumer_batches} next() calls after 20, each followed by a "
            f"{args.step_ms} ms simulated training step; device {args.device or 'none (CPU)'}",
        },
        "results": results,
        "ratios": ratios,
        "profile_us_per_cell": {tok: profile_stages(ds, tok, args) for tok in ours}
        if args.full
        else {},
        "layouts": layout_report(
            ds,
            ("geneformer", "scgpt"),
            batch_size=args.batch_size,
            max_genes=args.max_genes,
            token_dtype=args.token_dtype,
            n_batches=args.consumer_batches,
            step_s=args.step_ms / 1e3,
            device=args.device,
        )
        if args.full
        else None,
        "machine": machine(),
        "peak_rss_mb_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    out = save_report(report, args.out, print_table, plot)
    print(f"\nwrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return report


def _wants_full(argv: Sequence[str] | None) -> bool:
    """Whether ``--full`` is among the arguments (it decides the other options' defaults)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--full", action="store_true")
    return pre.parse_known_args(argv)[0].full


def machine() -> dict[str, Any]:
    """The machine a benchmark ran on, for its JSON report."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def save_report(
    report: dict[str, Any],
    out: str | Path,
    table: Callable[[dict[str, Any]], None],
    draw: Callable[[dict[str, Any], Path], None],
) -> Path:
    """Write ``report`` as JSON to ``out``, print its table and draw its PNG beside it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    table(report)
    draw(report, out.with_suffix(".png"))
    return out


def print_table(report: dict[str, Any]) -> None:
    """Print the report as a table."""
    d, s = report["dataset"], report["settings"]
    print(
        f"\n{d['n_cells']:,} cells x {d['n_genes']:,} genes, {d['nnz_per_cell']:.0f} "
        f"non-zeros/cell; batch_size={s['batch_size']}, max_genes={s['max_genes']}, "
        f"{s['epochs_per_run']} epochs timed per run after {s['warmup_cells']:,} cells; "
        f"page cache {s['page_cache']}"
    )
    print("cells/s: steady, after the warm-up; x raw scan: median of each run over a raw scan "
          "run beside it; end to end: from constructing the loader")  # fmt: skip
    print(f"{'loader':<44}{'cells/s':>10}{'x raw scan':>11}{'end to end':>11}{'x raw':>7}"
          f"{'1st batch s':>12}{'CPU us/cell':>12}{'RSS MB':>8}")  # fmt: skip
    for name, r in report["results"].items():
        print(
            f"{name:<44}{r['cells_per_s']:>10,.0f}{r.get('fraction_of_raw_scan', 1.0):>11.2f}"
            f"{r['cells_per_s_end_to_end']:>11,.0f}"
            f"{r.get('fraction_of_raw_scan_end_to_end', 1.0):>7.2f}{r['first_batch_s']:>12.2f}"
            f"{r['cpu_us_per_cell']:>12.1f}{r['peak_rss_mb']:>8,.0f}"
        )
    for name, value in report["ratios"].items():
        print(f"{name:<34}{value:>8.2f}")
    for tok, prof in report["profile_us_per_cell"].items():
        parts = ", ".join(f"{k} {v:.1f}" for k, v in prof.items())
        print(f"profile {tok} (us/cell): {parts}")
    if report["layouts"] is not None:
        print(layout_table(report["layouts"]))


def plot(report: dict[str, Any], path: Path) -> None:
    """Plot the report's throughputs to a PNG at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [n for n in report["results"] if n != "raw_scan"]
    rates = [report["results"][n]["cells_per_s"] for n in names]
    # One bar per contender, each with room for its label: a fixed height made them overlap.
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.32 * len(names)))
    ax.barh(
        names, rates, color=["#3b7dd8" if n.startswith("slafload") else "#999999" for n in names]
    )
    floor = report["results"]["raw_scan"]["cells_per_s"]
    ax.axvline(floor, color="#d62728", linestyle="--", label=f"raw Lance scan {floor:,.0f}")
    ax.set_xlabel("cells / s after the warm-up (higher is better)")
    ax.legend(loc="lower right")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
