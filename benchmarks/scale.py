"""Atlas scale: cells/s, time to first batch and peak RSS per sampler, at 5M and 500k cells.

Each contender runs in its own fresh process (``--child``), so peak RSS is the whole process's
and nothing one contender leaves behind (threads, caches, heap) disturbs the next. A child
opens the dataset, builds a :class:`slafload.Loader`, and reports

* ``first_batch_s``: from the start of ``Loader(...)`` (which opens the dataset) to the first
  batch in hand (imports, torch's ~1 s included, are done before: a training script has; so
  is numba's start-up, :func:`slafload.kernels.warm_up`, where numba kernels are in use, and
  the cyclic GC's first full collection after those imports, ``gc.collect()``);
* ``cells_per_s``: after a warm-up of one fetch's worth of cells (or ``--warm-cells``, if
  more: on a 5M atlas a block sampler opens its thousands of data files over the first ~1M
  cells), over at least ``--fetches`` fetches' worth of cells and ``--min-cells`` cells, or
  ``--seconds`` seconds, whichever ends first;
* ``peak_rss_mb``: ``ru_maxrss`` of the child;
* ``file_format`` and ``read_path``: the Lance file format of the expression table's data
  files, and whether its pages were read by slafload's direct page reader (``direct``) or
  handed to Lance's ``take_scan``, with the reason the reader gave
  (:class:`~slafload.errors.ReaderFallbackWarning`).

``--caches warm,cold`` runs every contender twice per round: with the atlas read into the
page cache just before the child starts, and with every file of it evicted from the page
cache (``posix_fadvise(POSIX_FADV_DONTNEED)``, no root needed) just before. A cold run is what
a user whose atlas does not fit in RAM gets on every read; its ``vs chunk`` column is over
ChunkShuffle *warm*, so cold block sampling reads as a fraction of the best case.

The window is 300k cells by default. 60k cells are under half a second
of ChunkShuffle, and single runs of ``BlockShuffle(16, 256)`` on the 5M atlas gave 71-116k
cells/s (0.45-0.73 of ChunkShuffle's median); over 300k cells, 94-107k (0.63-0.72). A run's
RSS also keeps climbing after 60k cells on the 500k atlas (``BlockShuffle(1, 256)``: peaks
of 745-797 MB over the first 60k cells, 788-809 over 400k, reached at 104-143k cells), so
a short window compares one atlas's warm-up with the other's steady state.

With ``--repeat N`` every contender runs N times (rounds interleaved) and the table, the plot
and ``summary`` give each one's medians: one run's peak RSS varies by up to ~5% here (thread
timing decides how much is in flight, and the allocator's arenas), which is half the 10% by
which the 5M and 500k peaks may differ. ``summary`` also gives, per sampler, the largest
atlas's median peak RSS over the smallest's (``rss_growth``).

Before the contenders, one short child (a fetch of ChunkShuffle on the last atlas, not
reported) fills numba's on-disk cache, so no contender compiles a kernel: a process that
compiles keeps ~85 MB more for its life (slafload/kernels.py), and the first contender after
a checkout or an upgrade would otherwise do so.

The parent also times building an epoch's plan at 100M and 1B cells (index arithmetic only:
``sampler.plan``, rank sharding, the first fetch) with its ``tracemalloc`` peak.

The atlases are ``slafload.synthetic.write_atlas(n_cells, n_genes=20_000)`` with Lance's
default data-file size (~1M rows per file), written once if missing; any SLAF dataset may be
given instead (an atlas written another way, e.g. by ``slafload convert`` or
``lance.write_dataset``, reports its own file format and read path).

    python benchmarks/scale.py --atlas /tmp/atlas5m.slaf --atlas /tmp/atlas500k.slaf
    python benchmarks/scale.py --atlas /tmp/atlas5m.slaf --caches warm,cold --blocks 16,64 \
        --factors 256
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

from slafload.tools.bench_report import machine, save_report

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = (1, 16, 64, 256)
FACTORS = (64, 256, 1024)


def sampler_of(spec: str, batch_size: int):
    from slafload.samplers import BlockShuffle, ChunkShuffle

    if spec == "chunk":
        return ChunkShuffle()
    b, f = (int(x) for x in spec.split("x"))
    return BlockShuffle(block_size=b, fetch_factor=f, batch_size=batch_size)


def fetch_cells(spec: str, batch_size: int) -> int:
    if spec == "chunk":
        return 2048
    b, f = (int(x) for x in spec.split("x"))
    return -(-f * batch_size // b) * b


def make_loader(dataset, args: argparse.Namespace, settings: dict[str, Any]):
    """An endless, seeded :class:`slafload.Loader` of ``args.spec`` over ``dataset``."""
    from slafload.config import Tuning
    from slafload.loader import Loader  # imports torch, as a training script has already

    if "tuning" in settings:  # JSON: the Tuning's fields as an object
        settings = {**settings, "tuning": Tuning(**settings["tuning"])}
    return Loader(
        dataset,
        sampler=sampler_of(args.spec, args.batch_size),
        batch_size=args.batch_size,
        max_genes=args.max_genes,
        n_epochs=None,
        seed=0,
        **settings,
    )


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One contender in this process: first batch, then steady cells/s."""
    import slafload.kernels
    import slafload.loader  # torch imported before the clock starts

    settings = json.loads(args.settings)
    fallbacks = _record_fallbacks()
    if settings.get("kernels", "auto") != "numpy":
        slafload.kernels.warm_up()  # numba's start-up, like an import (slafload/kernels.py)
    # The imports' debt to the cyclic GC, paid now as an import pays it: torch, numba, Polars
    # and pyarrow leave ~350k tracked objects, and the first full collection after them
    # (0.13-0.15 s holding the GIL, once per process) otherwise lands in whichever contender's
    # first timed window allocates most.
    gc.collect()
    t0 = time.perf_counter()
    loader = make_loader(args.dataset, args, settings)
    it = iter(loader)
    got = len(next(it)["input_ids"])
    first = time.perf_counter() - t0
    per_fetch = fetch_cells(args.spec, args.batch_size)
    while got < max(per_fetch, getattr(args, "warm_cells", 0)):  # warm-up: the first fetch
        got += len(next(it)["input_ids"])
    start, cells = time.perf_counter(), 0
    target = max(args.fetches * per_fetch, args.min_cells)
    while cells < target and time.perf_counter() - start < args.seconds:
        cells += len(next(it)["input_ids"])
    elapsed = time.perf_counter() - start
    loader.close()
    peak_mb = (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )  # before _file_format reopens it
    return {
        "spec": args.spec,
        "dataset": args.dataset,
        "cache": args.cache,
        "file_format": _file_format(args.dataset),
        "read_path": _read_path(fallbacks),
        "first_batch_s": first,
        "cells_per_s": cells / elapsed,
        "cells_timed": cells,
        "seconds_timed": elapsed,
        "peak_rss_mb": peak_mb,
        "settings": settings,
    }


def _record_fallbacks() -> list[str]:
    """Record every :class:`~slafload.errors.ReaderFallbackWarning` of this process (one per
    dataset the direct page reader hands to Lance, saying why) in the list returned.
    """
    import warnings

    from slafload.errors import ReaderFallbackWarning

    seen: list[str] = []
    show = warnings.showwarning

    def record(message, category, *rest):  # type: ignore[no-untyped-def]
        if issubclass(category, ReaderFallbackWarning):
            seen.append(str(message))
        else:
            show(message, category, *rest)

    warnings.simplefilter("always", ReaderFallbackWarning)
    warnings.showwarning = record
    return seen


def _read_path(fallbacks: list[str]) -> str:
    """Which path the expression pages took: slafload's direct page reader, or Lance's."""
    if not fallbacks:
        return "direct"
    return "lance (take_scan): " + fallbacks[0][-300:]


def _file_format(dataset: str) -> str:
    """The Lance file format(s) of the expression table's data files."""
    from slafload import open_dataset
    from slafload.tools.optimize import file_format

    return file_format(open_dataset(dataset).expression)


def evict(dataset: str) -> int:
    """Drop ``dataset``'s files from the page cache (``POSIX_FADV_DONTNEED``: clean pages only,
    no root needed); the bytes of the files asked."""
    total = 0
    for path in Path(dataset).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            total += path.stat().st_size
    return total


def load(dataset: str) -> int:
    """Read every file of ``dataset`` once, so it sits in the page cache; the bytes read."""
    total = 0
    for path in Path(dataset).rglob("*"):
        if path.is_file():
            with path.open("rb", buffering=0) as f:
                while chunk := f.read(8 << 20):
                    total += len(chunk)
    return total


def run_child(dataset: str, spec: str, args: argparse.Namespace, settings: dict) -> dict:
    if args.cache == "cold":
        evict(dataset)
    else:
        load(dataset)
    cmd = [
        sys.executable, __file__, "--child", "--dataset", dataset, "--spec", spec,
        "--batch-size", str(args.batch_size), "--max-genes", str(args.max_genes),
        "--fetches", str(args.fetches), "--seconds", str(args.seconds),
        "--min-cells", str(args.min_cells), "--warm-cells", str(getattr(args, "warm_cells", 0)),
        "--settings", json.dumps(settings), "--cache", args.cache,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=args.child_timeout
        )
    except subprocess.TimeoutExpired:
        return {"spec": spec, "dataset": dataset, "error": f"timed out ({args.child_timeout} s)"}
    if proc.returncode != 0:
        return {"spec": spec, "dataset": dataset, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plan_cost(n_cells: int, spec: str, batch_size: int) -> dict[str, Any]:
    """Seconds and tracemalloc peak of planning an epoch of ``n_cells`` (no I/O)."""
    from slafload.pipeline.partition import rank_share

    sampler = sampler_of(spec, batch_size)
    tracemalloc.start()
    t = time.perf_counter()
    plan = sampler.plan(n_cells, seed=0, epoch=0)
    stream = rank_share(plan, (), 0, 8)
    part = next(stream.parts())
    elapsed = time.perf_counter() - t
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"n_cells": n_cells, "spec": spec, "seconds": elapsed, "peak_mb": peak / 2**20,
            "first_part_cells": part.keep - part.skip, "fetches": len(plan)}  # fmt: skip


def ensure_atlas(path: str) -> str:
    if not Path(path, "config.json").exists():
        import re

        import slafload.synthetic

        match = re.search(r"(\d+)([km])", Path(path).name)
        if not match:
            raise SystemExit(f"{path} does not exist; name it like atlas5m.slaf to write it")
        n = int(match.group(1)) * {"k": 1_000, "m": 1_000_000}[match.group(2)]
        print(f"writing {n:,}-cell atlas {path} (once) ...", file=sys.stderr)
        slafload.synthetic.write_atlas(path, n_cells=n, n_genes=20_000, progress=True)
    return path


def progress(items, **kw):
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, file=sys.stderr, dynamic_ncols=True, **kw)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--atlas", action="append", help="dataset path (repeat); written if missing")
    p.add_argument("--blocks", default=",".join(map(str, BLOCKS)))
    p.add_argument("--factors", default=",".join(map(str, FACTORS)))
    p.add_argument("--skip", default="", help="comma-separated specs to leave out, e.g. 1x1024")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-genes", type=int, default=2048)
    p.add_argument("--fetches", type=float, default=3, help="fetches' worth of cells timed")
    p.add_argument("--min-cells", type=int, default=300_000, help="...and at least this many")
    p.add_argument(
        "--warm-cells",
        type=int,
        default=0,
        help="cells delivered before the clock starts (default: the first fetch)",
    )
    p.add_argument("--seconds", type=float, default=30, help="...or this long, if shorter")
    p.add_argument("--repeat", type=int, default=1, help="runs per contender (medians)")
    p.add_argument(
        "--caches",
        default="warm",
        help='"warm", "cold" or "warm,cold": before each child, read the atlas into the page '
        "cache, or evict it (posix_fadvise DONTNEED)",
    )
    p.add_argument("--cache", default="warm", help=argparse.SUPPRESS)
    p.add_argument("--child-timeout", type=float, default=240)
    p.add_argument(
        "--settings",
        default="{}",
        help='LoaderConfig settings as JSON; tuning as an object, e.g. {"tuning": {"read_ahead": 0}}',
    )
    p.add_argument("--plan-cells", default="100000000,1000000000", help='"" plans none')
    p.add_argument("--note", default="", help="what else ran on the machine")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scale.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dataset", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}

    atlases = [ensure_atlas(a) for a in (args.atlas or ["/tmp/atlas5m.slaf"])]
    skip = set(filter(None, args.skip.split(",")))
    specs = ["chunk"] + [
        f"{b}x{f}"
        for b in map(int, args.blocks.split(","))
        for f in map(int, args.factors.split(","))
        if f"{b}x{f}" not in skip
    ]
    settings = json.loads(args.settings)
    runs = []
    caches = args.caches.split(",")
    jobs = [  # rounds of every contender, sizes and caches interleaved per contender
        (k, a, s, c) for k in range(args.repeat) for s in specs for a in atlases for c in caches
    ]
    warm = argparse.Namespace(**{**vars(args), "fetches": 1, "min_cells": 0, "warm_cells": 0})
    run_child(atlases[-1], "chunk", warm, settings)  # fills numba's cache; not reported
    for k, atlas, spec, cache in progress(jobs, desc="contenders"):
        each = argparse.Namespace(**{**vars(args), "cache": cache})
        r = {**run_child(atlas, spec, each, settings), "round": k, "cache": cache}
        runs.append(r)
        if "error" in r:
            print(f"{spec} on {atlas}: {r['error'][-300:]}", file=sys.stderr)
    plans = [
        plan_cost(int(n), spec, args.batch_size)
        for n in filter(None, args.plan_cells.split(","))  # --plan-cells "": none
        for spec in ("chunk", "1x64", "16x256", "64x1024")
    ]
    report = {
        "settings": {k: v for k, v in vars(args).items() if k not in {"child", "dataset", "spec"}},
        "page_cache": (
            "warm: every file of the atlas read just before the child starts; cold: every file "
            "evicted from the page cache (posix_fadvise DONTNEED) just before it starts"
        ),
        "machine": machine(),
        "runs": runs,
        "summary": summarize(runs),
        "plans": plans,
    }
    out = save_report(report, args.out, print_table, plot)
    print(f"\nwrote {out}", file=sys.stderr)
    return report


KEYS = ("cells_per_s", "first_batch_s", "peak_rss_mb")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each contender's medians over its rounds, and each sampler's peak RSS growth from the
    smallest atlas to the largest (median over median).
    """
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in runs:
        if "error" not in r:
            groups.setdefault((r["dataset"], r["spec"], r.get("cache", "warm")), []).append(r)
    medians = []
    for (atlas, spec, cache), rs in groups.items():
        middle = {key: statistics.median(r[key] for r in rs) for key in KEYS}
        paths = sorted({r.get("read_path", "?") for r in rs})
        medians.append({"dataset": atlas, "spec": spec, "cache": cache, "rounds": len(rs),
                        "file_format": rs[0].get("file_format"), "read_path": "; ".join(paths),
                        **middle})  # fmt: skip
    sizes = {m["dataset"]: _cells(m["dataset"]) for m in medians}
    growth = {}
    if len(sizes) > 1:
        small, large = min(sizes, key=sizes.__getitem__), max(sizes, key=sizes.__getitem__)
        peak = {(m["dataset"], m["spec"]): m["peak_rss_mb"] for m in medians
                if m["cache"] == "warm"}  # fmt: skip
        growth = {
            spec: peak[(large, spec)] / peak[(small, spec)]
            for (atlas, spec) in peak
            if atlas == large and (small, spec) in peak
        }
    return {"medians": medians, "rss_growth": growth}


def _cells(path: str) -> int:
    try:
        import lance

        return lance.dataset(f"{path.rstrip('/')}/cells.lance").count_rows()
    except Exception:  # not readable here: order by name
        return 0


def print_table(report: dict[str, Any]) -> None:
    by_atlas: dict[tuple[str, str], list[dict]] = {}
    for r in report.get("summary", {}).get("medians") or report["runs"]:
        by_atlas.setdefault((r["dataset"], r.get("cache", "warm")), []).append(r)
    warm_chunk = {
        atlas: r["cells_per_s"]
        for (atlas, cache), runs in by_atlas.items()
        for r in runs
        if cache == "warm" and r["spec"] == "chunk" and "error" not in r
    }
    for (atlas, cache), runs in by_atlas.items():
        chunk = warm_chunk.get(atlas)
        ok = [r for r in runs if "error" not in r]
        fmt = ok[0].get("file_format", "?") if ok else "?"
        path = ok[0].get("read_path", "?") if ok else "?"
        print(f"\n{atlas}, {cache} page cache: Lance {fmt} data files, read path: {path}")
        print("(vs chunk: over ChunkShuffle with a warm page cache)")
        print(
            f"{'sampler':<12}{'cells/s':>10}{'vs chunk':>10}{'first batch s':>15}{'peak RSS MB':>13}"
        )
        for r in runs:
            if "error" in r:
                print(f"{r['spec']:<12}  error")
                continue
            ratio = r["cells_per_s"] / chunk if chunk else float("nan")
            print(f"{r['spec']:<12}{r['cells_per_s']:>10,.0f}{ratio:>10.2f}"
                  f"{r['first_batch_s']:>15.2f}{r['peak_rss_mb']:>13,.0f}")  # fmt: skip
    growth = report.get("summary", {}).get("rss_growth") or {}
    if growth:
        print("\npeak RSS, largest atlas over smallest: " + ", ".join(
            f"{spec} {g:.2f}" for spec, g in growth.items()))  # fmt: skip
    print(f"\n{'plan':<10}{'cells':>15}{'ms':>10}{'peak MB':>10}")
    for p in report["plans"]:
        print(f"{p['spec']:<10}{p['n_cells']:>15,}{p['seconds'] * 1e3:>10.1f}{p['peak_mb']:>10.2f}")


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = report.get("summary", {}).get("medians") or report["runs"]
    atlases = sorted({(r["dataset"], r.get("cache", "warm")) for r in runs})
    specs = list(dict.fromkeys(r["spec"] for r in runs))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5), sharey=True)
    width = 0.8 / max(len(atlases), 1)
    for k, (atlas, cache) in enumerate(atlases):
        got = {r["spec"]: r for r in runs
               if (r["dataset"], r.get("cache", "warm")) == (atlas, cache) and "error" not in r}  # fmt: skip
        ys = [i + k * width for i in range(len(specs))]
        for ax, key in zip(axes, KEYS, strict=True):
            ax.barh(ys, [got.get(s, {}).get(key, 0) for s in specs], height=width,
                    label=f"{Path(atlas).name} ({cache})")  # fmt: skip
    axes[0].set_yticks([i + width * (len(atlases) - 1) / 2 for i in range(len(specs))], specs)
    axes[0].set_xlabel("cells/s (steady)")
    axes[1].set_xlabel("first batch (s)")
    axes[1].axvline(1.0, color="#d62728", linestyle="--")
    axes[2].set_xlabel("peak RSS (MB)")
    axes[2].axvline(2048, color="#d62728", linestyle="--")
    axes[0].invert_yaxis()
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
