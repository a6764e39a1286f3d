"""Training from a bucket: requests, bytes and cells/s per sampler, against the layout's floor.

A synthetic atlas (``--cells`` x ``--nnz`` non-zeros a cell, Lance 2.2 files as converters
write them) is uploaded to moto's S3 server on loopback, and read through a forwarder that
holds every request ``--latency`` seconds (20 ms: S3's time to first byte from the same
region) and counts requests and bytes (``benchmarks/s3_proxy.py``). For ``ChunkShuffle`` and
``BlockShuffle(b, --fetch-factor)`` at b = 16, 64, 256 (a fetch of 128 cells by default, at
least two blocks: the 1.6% of an 8,000-cell atlas that ``BlockShuffle(b, 256)``'s 8,192
cells are of a 500k-cell one, so blocks are as scattered), one epoch each (geneformer,
``batch_size=32``), by slafload's reader (``Tuning.reader="auto"``: range requests) and by
Lance's ``take_scan`` (``reader="lance"``), after a warm-up epoch by each (a loader opens the
data files once per dataset either way: Lance's session keeps their metadata, slafload's
dataset the files it opened by range requests), interleaved (each first in turn),
``--rounds`` rounds (medians):

- requests and bytes per 1,000 cells delivered, counted exactly, whatever the machine;
- the floor the layout allows: a block is one contiguous row range in three columns, so
  ``3 * 1000 / b`` requests per 1,000 cells (fewer where neighbouring blocks of a fetch share
  a request), and the bytes the table occupies per 1,000 cells (an epoch reads every row once);
- cells/s through the proxy, and what the request model predicts from the counts:
  ``cells/s = requests in flight / (requests per cell x latency)``;
- per sampler, slafload's cells/s over take_scan's in each round (the two run back to back)
  and their median, with the 1-minute load average before and after the rounds.

moto and the forwarder are Python on the loader's own cores (~2 ms of CPU a request), so the
cells/s here are bounded by them (~5k cells/s on 2 cores); the request counts carry over.

    python benchmarks/object_store.py                # ~1-2 minutes on 2 busy cores
    python benchmarks/object_store.py --cells 50000 --rounds 3
    python benchmarks/object_store.py --samplers ChunkShuffle --rounds 15

Writes ``benchmarks/results/object_store.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from s3_proxy import S3Proxy, storage_options, upload

from slafload import Loader, Tuning, open_dataset
from slafload.config import REQUESTS_IN_FLIGHT
from slafload.samplers import BlockShuffle, ChunkShuffle
from slafload.synthetic import write_atlas

READERS = {"slafload": "auto", "take_scan": "lance"}
BATCH = 32


def samplers(fetch_factor: int) -> dict[str, tuple[Any, int]]:
    """Each contender's sampler and the cells of one contiguous row range it reads."""
    out: dict[str, tuple[Any, int]] = {"ChunkShuffle": (ChunkShuffle(), 2048)}
    for b in (16, 64, 256):
        f = max(fetch_factor, 2 * b // BATCH)  # two blocks a fetch at least
        out[f"BlockShuffle({b}, {f})"] = (
            BlockShuffle(block_size=b, fetch_factor=f, batch_size=BATCH),
            b,
        )
    return out


def epoch(dataset: Any, sampler: Any, reader: str, proxy: S3Proxy) -> dict[str, float]:
    """One epoch's cells, seconds and requests/bytes through ``proxy``."""
    proxy.reset()
    start = time.perf_counter()
    cells = 0
    with Loader(dataset, tokenizer="geneformer", batch_size=BATCH, max_genes=2048, seed=0,
                sampler=sampler, tuning=Tuning(reader=reader)) as loader:  # fmt: skip
        for batch in loader:
            cells += len(batch["cell_integer_id"])
    seconds = time.perf_counter() - start
    counts = proxy.reset()
    return {"cells": cells, "seconds": seconds, "requests": counts.total, "bytes": counts.bytes}


def summary(runs: list[dict[str, float]], range_cells: int, stored_per_cell: float,
            latency: float) -> dict[str, float]:  # fmt: skip
    cells = runs[0]["cells"]
    requests = statistics.median(r["requests"] for r in runs)
    per_cell = requests / cells
    return {
        "cells": cells,
        "cells_per_s": statistics.median(r["cells"] / r["seconds"] for r in runs),
        "requests_per_1k_cells": 1000 * per_cell,
        "floor_requests_per_1k_cells": 3 * 1000 / range_cells,
        "bytes_per_1k_cells": 1000 * statistics.median(r["bytes"] for r in runs) / cells,
        "stored_bytes_per_1k_cells": 1000 * stored_per_cell,
        "model_cells_per_s": REQUESTS_IN_FLIGHT / (per_cell * latency) if latency else 0.0,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from moto.server import ThreadedMotoServer

    plans = samplers(args.fetch_factor)
    if args.samplers:
        unknown = set(args.samplers) - set(plans)
        if unknown:
            raise SystemExit(f"--samplers: unknown {sorted(unknown)}; use {list(plans)}")
        plans = {name: plans[name] for name in args.samplers}
    work = Path(args.data or tempfile.mkdtemp(prefix="slafload-s3-"))
    local = work / f"atlas-{args.cells}-{args.nnz}.slaf"
    if not (local / "config.json").exists():
        write_atlas(local, n_cells=args.cells, n_genes=args.genes, mean_nnz=args.nnz, seed=0,
                    overwrite=True)  # fmt: skip
    stored = sum(p.stat().st_size for p in (local / "expression.lance" / "data").iterdir())
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        uri = upload(local, f"http://{host}:{port}", "bench", "atlas.slaf")
        with S3Proxy(f"http://{host}:{port}", latency=args.latency) as proxy:
            dataset = open_dataset(uri, storage_options=storage_options(proxy.endpoint))
            stored_per_cell = stored / dataset.n_cells
            runs: dict[str, list[dict[str, float]]] = {}
            for reader in READERS.values():  # warm-up: kernels, imports, each file's metadata
                epoch(dataset, BlockShuffle(block_size=256, fetch_factor=16, batch_size=BATCH),
                      reader, proxy)  # fmt: skip
            load = [os.getloadavg()[0]]  # other work on the machine moves cells/s most
            for i in range(args.rounds):
                for j, (name, (sampler, _)) in enumerate(plans.items()):
                    order = list(READERS.items())[:: 1 if (i + j) % 2 else -1]
                    for who, reader in order:  # each reader first in turn
                        got = epoch(dataset, sampler, reader, proxy)
                        runs.setdefault(f"{name} {who}", []).append(got)
                        print(f"{name:24s} {who:9s} {got}", flush=True)
            load.append(os.getloadavg()[0])
    finally:
        server.stop()
    results = {
        key: summary(r, plans[key.rsplit(" ", 1)[0]][1], stored_per_cell, args.latency)
        for key, r in runs.items()
    }
    return {
        "settings": {
            **vars(args),
            "requests_in_flight": REQUESTS_IN_FLIGHT,
            "stored_bytes": stored,
            "machine": platform.platform(),
            "load_avg_start_end": load,
        },
        "results": results,
        "same_round_ratios": same_round_ratios(runs),
    }


def same_round_ratios(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Per sampler, slafload's cells/s over take_scan's in each round (run back to back, so
    the machine's other load moves both alike), sorted, and their median.
    """
    out: dict[str, dict[str, Any]] = {}
    for key in runs:
        name, who = key.rsplit(" ", 1)
        if who != "slafload" or f"{name} take_scan" not in runs:
            continue
        ratios = sorted(
            (a["cells"] / a["seconds"]) / (b["cells"] / b["seconds"])
            for a, b in zip(runs[key], runs[f"{name} take_scan"], strict=True)
        )
        out[name] = {"ratios": ratios, "median": statistics.median(ratios)}
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    names = list(dict.fromkeys(key.rsplit(" ", 1)[0] for key in results))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.27
    for i, who in enumerate(READERS):
        x = [j + (i - 0.5) * width for j in range(len(names))]
        axes[0].bar(x, [results[f"{n} {who}"]["requests_per_1k_cells"] for n in names],
                    width, label=who)  # fmt: skip
        axes[1].bar(x, [results[f"{n} {who}"]["cells_per_s"] for n in names], width, label=who)
    floor = [results[f"{n} slafload"]["floor_requests_per_1k_cells"] for n in names]
    axes[0].scatter(range(len(names)), floor, marker="_", s=600, color="k", label="floor")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("requests per 1,000 cells")
    axes[1].set_ylabel(f"cells/s through a {report['settings']['latency'] * 1000:.0f} ms proxy")
    for ax in axes:
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", type=int, default=8_000)
    parser.add_argument("--genes", type=int, default=20_000)
    parser.add_argument("--nnz", type=int, default=800, help="mean non-zeros a cell")
    parser.add_argument("--fetch-factor", type=int, default=4, help="a fetch: f x 32 cells")
    parser.add_argument("--latency", type=float, default=0.02, help="seconds a request")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--data", help="where the atlas is written (kept for reruns)")
    parser.add_argument("--out", default="benchmarks/results/object_store.json")
    parser.add_argument("--samplers", nargs="+", metavar="NAME",
                        help="only these rows (ChunkShuffle, 'BlockShuffle(16, 4)', ...)")  # fmt: skip
    args = parser.parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    plot(report, out.with_suffix(".png"))
    for key, r in report["results"].items():
        print(f"{key:34s} {r['requests_per_1k_cells']:8.1f} req/1k (floor "
              f"{r['floor_requests_per_1k_cells']:6.1f})  {r['bytes_per_1k_cells'] / 1e6:6.2f} "
              f"MB/1k (stored {r['stored_bytes_per_1k_cells'] / 1e6:5.2f})  "
              f"{r['cells_per_s']:7.0f} cells/s (model {r['model_cells_per_s']:7.0f})")  # fmt: skip
    for name, r in report["same_round_ratios"].items():
        print(f"{name:24s} slafload / take_scan cells/s, same round: median {r['median']:.3f} "
              f"(range {r['ratios'][0]:.2f}-{r['ratios'][-1]:.2f}); load average "
              f"{report['settings']['load_avg_start_end']}")  # fmt: skip


if __name__ == "__main__":
    main()
