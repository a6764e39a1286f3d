"""slafload against its peers on random-like minibatches, each peer in its own format.

One synthetic ``.h5ad`` (cells x genes, ~800 non-zeros a cell, cells stored plate by plate as in
Tahoe-100M; built from :func:`slafload.synthetic.write_atlas`) is written once and converted by
each peer's own writer: ``slafload convert`` (:func:`slafload.tools.convert.convert`), slafdb's
``SLAFConverter``, annbatch's zarr collection writer (where annbatch imports, in this
interpreter or the one ``--python annbatch=PATH`` names); scDataset reads
the backed ``.h5ad`` itself. Each contender then runs in a fresh process (``--child``) that
imports torch first, as a training script does, and reports

* ``cells_per_s``: cells delivered to the consumer over a steady window (``--min-cells`` cells
  or ``--seconds``, whichever ends first) after a warm-up of ``--warm-cells`` cells;
* ``cpu_us_per_cell``: the process's CPU time (every thread) over that window, per cell;
* ``peak_rss_mb``: ``ru_maxrss`` of the process, and ``peak_above_torch_mb``: the same less
  the RSS right after ``import torch`` (what the loader and its imports hold);
* ``first_batch_s``: from opening the dataset (imports done, numba's cache warm, the imports'
  first full GC collection paid) to the first batch in hand;
* ``plate_entropy``: the mean Shannon entropy (bits) of the plate label in each minibatch of
  the window, beside ``random_entropy``, the same over batches of a uniform permutation.

Contenders, all batch 64: slafload ``BlockShuffle(16, 256)`` on the store in input order as
``convert`` writes it (Lance 2.2) with the ``raw``, ``geneformer`` and ``sparse`` tokenizers
(``sparse``: CSR batches, no ranking or padding, as annbatch's are), and with ``raw`` and
``sparse`` on the same store rewritten in Lance 2.0 by ``slafload optimize``; ``BlockShuffle(256,
32)`` with the three tokenizers on a store that ``convert(shuffle_seed=0)`` wrote in a shuffled
order, then ``optimize`` (annbatch's recipe: its writer shuffles its collection once, its
loader draws random chunks of it anew every epoch; plates are looked up through
``original_index``); scDataset
``BlockShuffling(16)`` with ``fetch_factor=256`` on the backed ``.h5ad``, no workers, batches of CSR torch tensors; slafdb's ``SLAFDataLoader`` with its
default mixture-of-scanners shuffling and its geneformer tokens; annbatch's ``Loader`` on its
shuffled collection. A peer that is not installed, or does not import, is listed under
``skipped`` with the reason. Rounds are interleaved (the order reverses every other round) and
every ratio to slafload is the median of per-round ratios. ``--variant`` runs a slafload
contender again with other ``Tuning`` fields or environment variables, as a row of its own
interleaved with the rest, for A/B runs of defaults. The page cache is warm: every
file of every format is read once before the rounds.

    python benchmarks/peers.py                       # ~50k cells: a few minutes on 2 cores
    python benchmarks/peers.py --cells 200000 --rounds 3
    python benchmarks/peers.py --python annbatch=/venv312/bin/python   # annbatch: Python >= 3.12
    python benchmarks/peers.py --only slafload-raw \\
        --variant 'half=slafload-raw:{"tuning": {"memory_budget": 268435456}}'  # settings A/B

Writes ``slafload-bench/peers.json`` and ``.png`` (``--out``); the data is cached under
``slafload-bench/data/`` (``--data``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BATCH_SIZE = 64
BLOCK, FETCH_FACTOR = 16, 256
SHUFFLED_BLOCK, SHUFFLED_FETCH_FACTOR = 256, 32  # 2,048-cell fetches of 8 random blocks
# slafload's stores, each written by `convert` from the one .h5ad: (shuffle_seed, rewritten in
# Lance 2.0 by `optimize`). "slafload" is convert's output as it is (Lance 2.2: mini-block
# pages, the smallest files); "-2.0" stores are then rewritten by `slafload optimize` (plain
# pages: ~2.9x the disk, about half the CPU a scattered read); the shuffled one is written in a
# seeded random order, as annbatch's writer shuffles its collection.
STORES = {
    "slafload": (None, False),
    "slafload-2.0": (None, True),
    "slafload-shuffled-2.0": (0, True),
}
SLAFLOAD = (
    "slafload-raw", "slafload-geneformer", "slafload-sparse",
    "slafload-2.0-raw", "slafload-2.0-sparse",
    "slafload-shuffled", "slafload-shuffled-geneformer", "slafload-shuffled-sparse",
)  # fmt: skip
# Each slafload contender's tokenizer and store: BlockShuffle(16, 256) on a store in input
# order, or BlockShuffle(256, 32) on the pre-shuffled store (any block of it is a random
# sample of cells; which blocks meet in a batch changes every epoch, as annbatch's chunks do).
SLAFLOAD_RUNS = {
    "slafload-raw": ("raw", "slafload"),
    "slafload-geneformer": ("geneformer", "slafload"),
    "slafload-sparse": ("sparse", "slafload"),
    "slafload-2.0-raw": ("raw", "slafload-2.0"),
    "slafload-2.0-sparse": ("sparse", "slafload-2.0"),
    "slafload-shuffled": ("raw", "slafload-shuffled-2.0"),
    "slafload-shuffled-geneformer": ("geneformer", "slafload-shuffled-2.0"),
    "slafload-shuffled-sparse": ("sparse", "slafload-shuffled-2.0"),
}
CONTENDERS = (*SLAFLOAD, "scdataset", "slafdb", "annbatch")
YIELDS_LABELS = {"annbatch"}  # batches come with plate labels, not the h5ad's row numbers
_IN_ORDER = f"slafload BlockShuffle({BLOCK}, {FETCH_FACTOR})"
_SHUFFLED = f"slafload BlockShuffle({SHUFFLED_BLOCK}, {SHUFFLED_FETCH_FACTOR}), store pre-shuffled"
LABELS = {
    "slafload-raw": f"{_IN_ORDER}, raw",
    "slafload-geneformer": f"{_IN_ORDER}, geneformer",
    "slafload-sparse": f"{_IN_ORDER}, sparse (CSR)",
    "slafload-2.0-raw": f"{_IN_ORDER}, store in Lance 2.0, raw",
    "slafload-2.0-sparse": f"{_IN_ORDER}, store in Lance 2.0, sparse (CSR)",
    "slafload-shuffled": f"{_SHUFFLED} in Lance 2.0, raw",
    "slafload-shuffled-geneformer": f"{_SHUFFLED} in Lance 2.0, geneformer",
    "slafload-shuffled-sparse": f"{_SHUFFLED} in Lance 2.0, sparse (CSR)",
    "scdataset": f"scDataset BlockShuffling({BLOCK}), fetch_factor {FETCH_FACTOR}, backed h5ad",
    "slafdb": "slafdb SLAFDataLoader, mixture of scanners, geneformer",
    "annbatch": "annbatch Loader, shuffled zarr collection",
}


# -- the child: one contender in a fresh process -----------------------------------------------


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rss_mb() -> float:
    return _status_mb("VmRSS")


def _peak_rss_mb() -> float:
    # VmHWM, not ru_maxrss: Linux carries the parent's peak over fork and exec into a child's
    # ru_maxrss, so every child would report at least the parent's RSS.
    return _status_mb("VmHWM")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process
    return usage.ru_utime + usage.ru_stime


def _slafload(spec: dict[str, Any], name: str) -> Iterator[Any]:
    import slafload
    from slafload.samplers import BlockShuffle
    from slafload.tokenizers.builtin import token_budget

    ds = slafload.open_dataset(spec["path"])
    tokenizer, store = SLAFLOAD_RUNS[name]
    block, fetch_factor = (
        (BLOCK, FETCH_FACTOR) if STORES[store][0] is None
        else (SHUFFLED_BLOCK, SHUFFLED_FETCH_FACTOR)
    )  # fmt: skip
    sampler = BlockShuffle(block_size=block, fetch_factor=fetch_factor, batch_size=BATCH_SIZE)
    tuning = slafload.Tuning(**spec.get("tuning", {}))  # the defaults unless a run sets some
    # sparse keeps every gene (no token budget) and is packed (CSR) by default
    budget = token_budget(tokenizer, spec["max_genes"])
    with slafload.Loader(
        ds, tokenizer=tokenizer, sampler=sampler, batch_size=BATCH_SIZE,
        n_epochs=None, seed=0, tuning=tuning, **budget,
    ) as loader:  # fmt: skip
        for batch in loader:
            yield batch["cell_integer_id"].numpy()


def _scdataset(spec: dict[str, Any]) -> Iterator[Any]:
    import anndata
    import numpy as np
    import torch
    from scdataset import BlockShuffling, scDataset  # type: ignore[import-untyped]

    adata = anndata.read_h5ad(spec["path"], backed="r")

    def fetch(collection: Any, idx: np.ndarray) -> tuple[Any, np.ndarray]:
        return collection.X[idx], idx  # the backed matrix's rows: a scipy CSR

    def batch(data: tuple[Any, np.ndarray], rows: np.ndarray) -> dict[str, Any]:
        x = data[0][rows]
        return {
            "indptr": torch.from_numpy(x.indptr), "indices": torch.from_numpy(x.indices),
            "data": torch.from_numpy(x.data), "ids": data[1][rows],
        }  # fmt: skip

    dataset = scDataset(
        adata, BlockShuffling(block_size=BLOCK), batch_size=BATCH_SIZE,
        fetch_factor=FETCH_FACTOR, fetch_callback=fetch, batch_callback=batch, seed=0,
    )  # fmt: skip
    try:
        while True:  # one iteration is one epoch; the next one reshuffles
            for b in dataset:
                yield b["ids"]
    finally:
        adata.file.close()


def _slafdb(spec: dict[str, Any]) -> Iterator[Any]:
    import numpy as np
    from slaf import SLAFArray
    from slaf.ml.dataloaders import SLAFDataLoader

    array = SLAFArray(spec["path"])
    array.wait_for_metadata()  # else its prefetcher may start first and yield nothing
    loader = SLAFDataLoader(
        array, tokenizer_type="geneformer", batch_size=BATCH_SIZE,
        max_genes=spec["max_genes"], n_epochs=1000, verbose=False,
    )  # fmt: skip
    try:
        for batch in loader:
            yield np.asarray(batch["cell_ids"])
    finally:
        loader._dataset.prefetcher.stop()  # its producer thread keeps reading otherwise


def _annbatch(spec: dict[str, Any]) -> Iterator[Any]:
    # Run with annbatch 0.3.1 in a Python 3.12 interpreter of its own (--python): its Loader's
    # default chunks (512 cells x 32 preloaded), batches of {"X", "obs", "index"}. Its
    # collection is shuffled on write, so "index" is not the h5ad's row: this yields the plate
    # labels of each batch's obs instead.
    import annbatch  # type: ignore[import-not-found]
    import numpy as np

    _zarrs_codecs()
    loader = annbatch.Loader(
        batch_size=BATCH_SIZE, shuffle=True, rng=np.random.default_rng(0), preload_to_gpu=False,
        to="torch" if "torch" in sys.modules else None,
    )  # fmt: skip
    loader.use_collection(annbatch.DatasetCollection(spec["path"]))
    while True:  # one iteration is one epoch
        for batch in loader:
            yield batch["obs"]["plate"].to_numpy()


def _zarrs_codecs() -> None:
    """annbatch's advice for local files: zarrs' codec pipeline, where it is installed."""
    import importlib.util

    if importlib.util.find_spec("zarrs") is not None:
        import zarr

        zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"})


def _imports(name: str) -> None:
    """The contender's libraries, imported before its clock starts (a script has them)."""
    if name in SLAFLOAD:
        import slafload.kernels
        import slafload.loader

        slafload.kernels.warm_up()  # numba's start-up from its cache, like an import
    elif name == "scdataset":
        import anndata  # noqa: F401
        import scdataset  # noqa: F401
    elif name == "slafdb":
        from loguru import logger

        logger.disable("slaf")  # its banner and INFO lines
        import slaf.ml.dataloaders  # noqa: F401
    elif name == "annbatch":
        import annbatch  # noqa: F401


def _batches(name: str, spec: dict[str, Any]) -> Iterator[Any]:
    if name in SLAFLOAD:
        return _slafload(spec, name)
    opener: dict[str, Callable[[dict[str, Any]], Iterator[Any]]] = {
        "scdataset": _scdataset, "slafdb": _slafdb, "annbatch": _annbatch,
    }  # fmt: skip
    return opener[name](spec)


def child(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run one contender in this (fresh) process and return its figures."""
    rss_start = _rss_mb()
    try:
        import torch  # noqa: F401  # first, as in a training script
    except ImportError:  # a peer's own interpreter (--python) may lack it: said in the report
        if name in SLAFLOAD:
            raise
    has_torch = "torch" in sys.modules
    rss_torch = _rss_mb()
    t = time.perf_counter()
    _imports(name)
    import_s = time.perf_counter() - t
    rss_imports = _rss_mb()
    gc.collect()  # the imports' first full collection, paid before the clock as scripts do

    t0 = time.perf_counter()
    batches = _batches(name, spec)
    ids = [next(batches)]
    first = time.perf_counter() - t0
    rss_first = _rss_mb()
    got = len(ids[0])
    while got < spec["warm_cells"]:
        got += len(next(batches))
    window: list[Any] = []
    start, cpu0, cells = time.perf_counter(), _cpu_s(), 0
    while cells < spec["min_cells"] and time.perf_counter() - start < spec["seconds"]:
        b = next(batches)
        window.append(b)
        cells += len(b)
    elapsed, cpu = time.perf_counter() - start, _cpu_s() - cpu0
    peak = _peak_rss_mb()
    batches.close()  # type: ignore[attr-defined]

    import numpy as np

    plates = np.load(spec["plates"])
    entropies = []
    for b in window:
        labels = b if name in YIELDS_LABELS else plates[np.asarray(b, dtype=np.int64)]
        _, counts = np.unique(labels, return_counts=True)
        p = counts / counts.sum()
        entropies.append(float(-(p * np.log2(p)).sum()))
    return {
        "cells": cells, "seconds": elapsed, "cells_per_s": cells / elapsed,
        "cpu_us_per_cell": cpu / cells * 1e6, "first_batch_s": first,
        "peak_rss_mb": peak, "peak_above_torch_mb": peak - rss_torch,
        "rss_start_mb": rss_start, "rss_after_torch_mb": rss_torch,
        "rss_after_imports_mb": rss_imports, "rss_after_first_batch_mb": rss_first,
        "import_s": import_s, "plate_entropy": float(np.mean(entropies)),
        "torch_imported": has_torch,
    }  # fmt: skip


# -- the parent: data, conversions, rounds, report ---------------------------------------------


def make_h5ad(args: argparse.Namespace, data: Path) -> Path:
    """The synthetic atlas as an ``.h5ad`` (CSR counts as float32, ``obs["plate"]``)."""
    import anndata
    import lance
    import numpy as np
    import pandas as pd
    import scipy.sparse as sp

    from slafload.synthetic import write_atlas

    params = {k: getattr(args, k) for k in ("cells", "genes", "plates", "nnz")}
    h5ad, record = data / "atlas.h5ad", data / "atlas.json"
    if h5ad.exists() and record.exists() and json.loads(record.read_text()) == params:
        return h5ad
    data.mkdir(parents=True, exist_ok=True)
    src = write_atlas(
        data / "generated.slaf", n_cells=args.cells, n_genes=args.genes, n_plates=args.plates,
        mean_nnz=args.nnz, seed=0, overwrite=True,
    )  # fmt: skip
    expr = lance.dataset(str(src / "expression.lance")).to_table(
        columns=["gene_integer_id", "value"]
    )
    cells = lance.dataset(str(src / "cells.lance")).to_table().to_pandas()
    genes = lance.dataset(str(src / "genes.lance")).to_table().to_pandas()
    indptr = np.append(cells["cell_start_index"].to_numpy(np.int64), expr.num_rows)
    x = sp.csr_matrix(
        (
            expr["value"].to_numpy().astype(np.float32),
            expr["gene_integer_id"].to_numpy().astype(np.int32),
            indptr,
        ),
        shape=(args.cells, args.genes),
    )
    obs = pd.DataFrame(
        {"plate": pd.Categorical(cells["plate"].astype(str))},
        index=cells["cell_id"].astype(str).to_numpy(),
    )
    var = pd.DataFrame(index=genes["gene_id"].astype(str).to_numpy())
    anndata.AnnData(X=x, obs=obs, var=var).write_h5ad(h5ad)
    np.save(data / "plates.npy", cells["plate"].astype("category").cat.codes.to_numpy(np.int16))
    record.write_text(json.dumps(params))
    return h5ad


def _peer_error(module: str, python: str | None = None) -> str | None:
    """Why ``module`` cannot be used here (or by ``python``), or None.

    Imported in this process where no other interpreter is given (the parent's memory is not
    measured).
    """
    import importlib

    if python is not None:
        try:
            out = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
        except OSError as exc:
            return f"cannot run {python}: {exc}"
        last = (out.stderr.strip().splitlines() or ["(no message)"])[-1]
        return None if out.returncode == 0 else f"`import {module}` fails in {python}: {last}"
    try:
        importlib.import_module(module)
    except Exception as exc:  # any failure to import makes the peer a skip, with its reason
        return f"`import {module}` fails on Python {sys.version.split()[0]}: {exc!r}"
    return None


def convert_all(
    h5ad: Path, data: Path, wanted: list[str], pythons: dict[str, str]
) -> tuple[dict, dict, dict]:
    """Each peer's own format, written by its own writer: paths, write times, skip reasons."""
    import shutil

    paths: dict[str, str] = {}
    seconds: dict[str, float] = {}
    skipped: dict[str, str] = {}

    def write(key: str, out: Path, writer: Callable[[], object]) -> None:
        done = out.with_suffix(".done")
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            t = time.perf_counter()
            writer()
            seconds[key] = time.perf_counter() - t
            done.write_text(json.dumps({"seconds": seconds[key]}))
        else:
            seconds[key] = json.loads(done.read_text())["seconds"]
        paths[key] = str(out)

    if any(n in SLAFLOAD for n in wanted):
        for key in sorted({SLAFLOAD_RUNS[n][1] for n in wanted if n in SLAFLOAD}):
            seed, optimized = STORES[key]
            out = data / f"{key}.slaf"
            write(key, out, lambda out=out, seed=seed, optimized=optimized: _slafload_convert(
                h5ad, out, seed, optimized))  # fmt: skip
    if "slafdb" in wanted:
        if (why := _peer_error("slaf")) is not None:
            skipped["slafdb"] = why
        else:
            out = data / "slafdb.slaf"
            write("slafdb", out, lambda: _slafdb_convert(h5ad, out))
    if "scdataset" in wanted:
        if (why := _peer_error("scdataset")) is not None:
            skipped["scdataset"] = why
        else:
            paths["scdataset"] = str(h5ad)  # reads the backed h5ad: no conversion
    if "annbatch" in wanted:
        python = pythons.get("annbatch")
        if (why := _peer_error("annbatch", python)) is not None:
            skipped["annbatch"] = why + " (annbatch 0.3.x needs Python >= 3.12: see --python)"
        else:
            out = data / "annbatch.zarr"
            write("annbatch", out, lambda: _write_in(python, "annbatch", h5ad, out))
    return paths, seconds, skipped


def _slafload_convert(h5ad: Path, out: Path, seed: int | None, optimized: bool) -> None:
    """``slafload convert`` (``--shuffle-seed`` where ``seed`` is given), then ``slafload
    optimize`` (Lance 2.0, the older version deleted) where ``optimized``.
    """
    from slafload.tools.convert import convert
    from slafload.tools.optimize import optimize

    convert([h5ad], out, shuffle_seed=seed, overwrite=True, progress=False)
    if optimized:
        optimize(out, delete_old_versions=True, progress=False)


def _slafdb_convert(h5ad: Path, out: Path) -> None:
    from loguru import logger

    logger.disable("slaf")
    from slaf.data.converter import SLAFConverter

    SLAFConverter().convert(str(h5ad), str(out))


def _write_in(python: str | None, peer: str, h5ad: Path, out: Path) -> None:
    """Write ``peer``'s format with its writer, in ``python`` where given."""
    if python is None:
        WRITERS[peer](h5ad, out)
        return
    cmd = [python, __file__, "--write", peer, "--spec", json.dumps([str(h5ad), str(out)])]
    subprocess.run(cmd, check=True)


def _annbatch_convert(h5ad: Path, out: Path) -> None:
    import annbatch
    import numpy as np

    _zarrs_codecs()
    annbatch.DatasetCollection(str(out)).add_adatas(
        adata_paths=[str(h5ad)], shuffle=True, rng=np.random.default_rng(0)
    )


WRITERS = {"annbatch": _annbatch_convert}


def warm_page_cache(paths: list[str]) -> None:
    """Read every file under ``paths`` once, so each contender's reads come from RAM."""
    for root in paths:
        files = [Path(root)] if Path(root).is_file() else Path(root).rglob("*")
        for f in files:
            if f.is_file():
                with open(f, "rb") as fh:
                    while fh.read(1 << 24):
                        pass


def run_child(
    name: str,
    spec: dict[str, Any],
    timeout: float,
    python: str | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One contender in a fresh interpreter (``python``, else this one; ``env`` added to its
    environment); its figures, or its error with stderr's tail.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [python or sys.executable, __file__, "--child", name, "--spec", json.dumps(spec),
               "--result", str(result)]  # fmt: skip
        child_env = {**os.environ, **(env or {})}
        try:
            out = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, env=child_env
            )
        except subprocess.TimeoutExpired:
            return {"error": f"no result within {timeout:.0f} s"}
        if out.returncode != 0 or not result.exists():
            return {"error": f"exit {out.returncode}: {out.stderr[-2000:]}"}
        return json.loads(result.read_text())


def random_entropy(plates: Any, n_batches: int = 2000) -> float:
    """Mean plate entropy of batches of a uniform random permutation (true random sampling)."""
    import numpy as np

    from slafload.tools.diversity import mean_batch_entropy

    order = np.random.default_rng(0).permutation(len(plates))
    n = min(n_batches, len(order) // BATCH_SIZE)
    return mean_batch_entropy(plates[order[: n * BATCH_SIZE]].reshape(n, BATCH_SIZE))


def summarise(runs: dict[str, list[dict[str, Any]]]) -> tuple[dict, dict]:
    """Per contender the medians of its runs; per contender the per-round ratios' medians."""
    import statistics

    results: dict[str, dict[str, Any]] = {}
    ratios: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            results[name] = {"errors": [r["error"] for r in rs]}
            continue
        keys = [k for k, v in ok[0].items() if isinstance(v, int | float)]
        results[name] = {k: statistics.median(r[k] for r in ok) for k in keys}
        results[name]["runs"] = len(ok)
        if len(ok) < len(rs):
            results[name]["errors"] = [r["error"] for r in rs if "error" in r]
    for ref in SLAFLOAD:
        for name, rs in runs.items():
            pairs = [(a, b) for a, b in zip(rs, runs.get(ref, []), strict=False)
                     if name != ref and "error" not in a and "error" not in b]  # fmt: skip
            if not pairs:
                continue
            ratios[f"{ref} / {name}"] = {
                k: statistics.median(b[k] / a[k] for a, b in pairs)
                for k in ("cells_per_s", "peak_above_torch_mb", "first_batch_s")
            }
    return results, ratios


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", type=int, default=50_000, help="cells in the synthetic atlas")
    p.add_argument("--genes", type=int, default=20_000)
    p.add_argument("--plates", type=int, default=14)
    p.add_argument("--nnz", type=int, default=800, help="mean non-zeros a cell")
    p.add_argument("--max-genes", type=int, default=2048, help="token budget (tokenizers)")
    p.add_argument("--rounds", type=int, default=3, help="runs per contender, interleaved")
    p.add_argument("--warm-cells", type=int, default=BLOCK * -(-FETCH_FACTOR * BATCH_SIZE // BLOCK),
                   help="cells drawn before the window (default: one fetch)")  # fmt: skip
    p.add_argument("--min-cells", type=int, default=100_000, help="cells in the timed window")
    p.add_argument("--seconds", type=float, default=8.0, help="... or this long, if sooner")
    p.add_argument("--only", default=",".join(CONTENDERS), help="comma-separated contenders")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a child may take")
    p.add_argument("--data", default="slafload-bench/data/peers", help="where data is cached")
    p.add_argument("--out", default="slafload-bench/peers.json", help="JSON report (+ .png)")
    p.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="skip `slafload warm-up` before the rounds (numba's cache is warm)",
    )
    p.add_argument("--python", action="append", default=[], metavar="PEER=PATH",
                   help="run a peer (and its writer) in another interpreter, e.g. "
                   "annbatch=/venv312/bin/python (annbatch needs Python >= 3.12)")  # fmt: skip
    p.add_argument("--variant", action="append", default=[], metavar="NAME=CONTENDER:JSON",
                   help="a slafload contender again with other settings, as a row NAME of its "
                   'own: JSON may hold "tuning" (Tuning fields) and "env" (environment '
                   'variables of its process), e.g. half=slafload-raw:\'{"tuning": '
                   '{"memory_budget": 268435456}}\'')  # fmt: skip
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--write", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    wanted = [n for n in args.only.split(",") if n]
    if unknown := set(wanted) - set(CONTENDERS):
        raise SystemExit(f"--only: unknown contenders {sorted(unknown)}; known: {CONTENDERS}")
    import numpy as np

    from slafload.tools.bench_report import machine, save_report

    load_at_start = os.getloadavg()  # other users of the machine: their load is the noise
    data = Path(args.data) / f"{args.cells}x{args.genes}"
    h5ad = make_h5ad(args, data)
    pythons = dict(item.split("=", 1) for item in args.python)
    if unknown := set(pythons) - set(CONTENDERS):
        raise SystemExit(f"--python: unknown peers {sorted(unknown)}")
    paths, write_s, skipped = convert_all(h5ad, data, wanted, pythons)
    for name in wanted:
        key = SLAFLOAD_RUNS[name][1] if name in SLAFLOAD else name
        if key not in paths and name not in skipped:
            skipped[name] = skipped.get(key, "its data was not written")
    names = [n for n in wanted if n not in skipped]
    variants = parse_variants(args.variant, names)
    names += list(variants)
    for name, why in skipped.items():
        print(f"skipping {name}: {why}", file=sys.stderr)
    warm_page_cache(sorted(set(paths.values())))
    spec = {"max_genes": args.max_genes, "warm_cells": args.warm_cells,
            "min_cells": args.min_cells, "seconds": args.seconds,
            "plates": str(data / "plates.npy")}  # fmt: skip

    def spec_of(name: str) -> dict[str, Any]:
        if name in variants:
            base, settings = variants[name]
            return {**spec_of(base), "tuning": settings.get("tuning", {})}
        key = SLAFLOAD_RUNS[name][1] if name in SLAFLOAD else name
        shuffled = key in STORES and STORES[key][0] is not None
        plates = _plates_of(paths[key], data) if shuffled else spec["plates"]
        return {**spec, "path": paths[key], "plates": plates}

    if args.warm_up and any(n in SLAFLOAD for n in names):  # every kernel cached; not reported
        warm = [sys.executable, "-m", "slafload.tools.cli", "warm-up", "--no-progress"]
        subprocess.run(warm, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            base, settings = variants.get(name, (name, {}))
            runs[name].append(run_child(base, spec_of(name), args.timeout, pythons.get(name),
                                        env=settings.get("env")))  # fmt: skip
            print(f"round {r + 1}/{args.rounds} {name}: "
                  f"{runs[name][-1].get('cells_per_s', runs[name][-1].get('error'))}",
                  file=sys.stderr)  # fmt: skip
    results, ratios = summarise(runs)
    plates = np.load(data / "plates.npy")
    report = {
        "dataset": {"n_cells": args.cells, "n_genes": args.genes, "n_plates": args.plates,
                    "nnz_per_cell": _nnz_per_cell(h5ad),
                    "plates_in_order": True, "formats": paths, "write_s": write_s},
        "settings": {"batch_size": BATCH_SIZE, "block_size": BLOCK, "fetch_factor": FETCH_FACTOR,
                     "max_genes": args.max_genes, "rounds": args.rounds,
                     "warm_cells": args.warm_cells, "min_cells": args.min_cells,
                     "seconds": args.seconds, "page_cache": "warm",
                     "load_avg_start": load_at_start, "load_avg_end": os.getloadavg()},
        "machine": machine(),
        "labels": {n: LABELS[n] if n in LABELS else
                   f"{LABELS[variants[n][0]]}, {json.dumps(variants[n][1])}" for n in names},
        "variants": {n: {"contender": b, **v} for n, (b, v) in variants.items()},
        "interpreters": {n: pythons.get(n, sys.executable) for n in names},
        "random_entropy": random_entropy(plates),
        "results": results,
        "ratios": ratios,
        "skipped": skipped,
        "runs": runs,
    }  # fmt: skip
    save_report(report, args.out, print_table, plot)
    return report


def parse_variants(items: list[str], names: list[str]) -> dict[str, tuple[str, dict]]:
    """``--variant NAME=CONTENDER:JSON`` items as ``{NAME: (CONTENDER, settings)}``; each
    CONTENDER must be a slafload contender among ``names`` (its data is then written).
    """
    variants: dict[str, tuple[str, dict]] = {}
    for item in items:
        name, _, rest = item.partition("=")
        base, _, settings = rest.partition(":")
        if base not in SLAFLOAD or base not in names or name in CONTENDERS or not name:
            raise SystemExit(
                f"--variant {item!r}: expected NAME=CONTENDER:JSON with a new NAME and one of "
                f"the slafload contenders being run ({[n for n in names if n in SLAFLOAD]})"
            )
        parsed = json.loads(settings or "{}")
        if unknown := set(parsed) - {"tuning", "env"}:
            raise SystemExit(f"--variant {name}: unknown keys {sorted(unknown)} (tuning, env)")
        variants[name] = (base, parsed)
    return variants


def _plates_of(shuffled: str, data: Path) -> str:
    """The plate of each cell of the pre-shuffled store, by its ``cell_integer_id``: the input
    cell's plate (``original_index`` is each cell's row in the ``.h5ad``).
    """
    import lance
    import numpy as np

    out = data / "plates-shuffled.npy"
    if not out.exists():
        cells = lance.dataset(f"{shuffled}/cells.lance").to_table(
            columns=["cell_integer_id", "original_index"]
        )
        order = np.argsort(cells["cell_integer_id"].to_numpy())
        original = cells["original_index"].to_numpy()[order]
        np.save(out, np.load(data / "plates.npy")[original])
    return str(out)


def _nnz_per_cell(h5ad: Path) -> float:
    import h5py

    with h5py.File(h5ad, "r") as f:
        return float(f["X/indptr"][-1] / (len(f["X/indptr"]) - 1))


def print_table(report: dict[str, Any]) -> None:
    """Print the report as the issue's table, with the ratios to slafload."""
    d, s = report["dataset"], report["settings"]
    print(f"\n{d['n_cells']:,} cells x {d['n_genes']:,} genes, {d['nnz_per_cell']:.0f} "
          f"non-zeros/cell, {d['n_plates']} plates in order; batch {s['batch_size']}, "
          f"{s['rounds']} rounds interleaved, page cache {s['page_cache']}; random sampling's "
          f"plate entropy {report['random_entropy']:.2f} bits")  # fmt: skip
    print(f"{'loader':<64}{'cells/s':>9}{'CPU us/cell':>12}{'peak RSS MB':>12}"
          f"{'above torch':>12}{'1st batch s':>12}{'entropy':>8}")  # fmt: skip
    for name, r in report["results"].items():
        label = report["labels"][name]
        if "cells_per_s" not in r:
            print(f"{label:<64} failed: {r['errors'][0][-300:]}")
            continue
        print(f"{label:<64}{r['cells_per_s']:>9,.0f}{r['cpu_us_per_cell']:>12.1f}"
              f"{r['peak_rss_mb']:>12,.0f}{r['peak_above_torch_mb']:>12,.0f}"
              f"{r['first_batch_s']:>12.2f}{r['plate_entropy']:>8.2f}"
              f"{'' if r.get('torch_imported', True) else '  (no torch: above bare python)'}")  # fmt: skip
    for name, why in report["skipped"].items():
        print(f"{LABELS[name]:<64} skipped: {why}")
    for name, ratio in report["ratios"].items():
        parts = ", ".join(f"{k} {v:.3g}x" for k, v in ratio.items())
        print(f"{name}: {parts}")


def plot(report: dict[str, Any], path: Path) -> None:
    """cells/s and peak RSS above torch per contender, side by side, to a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [n for n, r in report["results"].items() if "cells_per_s" in r]
    colors = ["#3b7dd8" if n.startswith("slafload") else "#999999" for n in names]
    labels = [report["labels"][n] for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(13, 1.4 + 0.4 * len(names)), sharey=True)
    for ax, key, title, scale in (
        (axes[0], "cells_per_s", "thousand cells / s, median\n(higher is better)", 1e-3),
        (axes[1], "peak_above_torch_mb", "peak RSS above `import torch`, MB\n(lower is better)", 1),
    ):
        ax.barh(labels, [report["results"][n][key] * scale for n in names], color=colors)
        ax.set_xlabel(title)
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    cli = parser().parse_args()
    if cli.write:
        WRITERS[cli.write](*(Path(p) for p in json.loads(cli.spec)))
        sys.exit(0)
    if cli.child:
        figures = child(cli.child, json.loads(cli.spec))
        Path(cli.result).write_text(json.dumps(figures))
        sys.stdout.flush()
        os._exit(0)  # a peer's producer thread (slafdb's) may not end on its own
    main()
