"""The benchmark's contenders: the raw Lance scan (the floor), slafload's loader, slafload
through torch's ``DataLoader`` worker processes, and slafdb's loader, each fed to a
:class:`~slafload.tools.bench_measure.Clock`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import slafload
from slafload._lance._compat import data_file_path
from slafload.config import Tuning
from slafload.pipeline.reader import COLUMNS
from slafload.tools.bench_measure import Clock, consume


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
