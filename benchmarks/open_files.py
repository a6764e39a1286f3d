"""What an open data file costs in memory and time: slafload's flat reader against Lance's.

A block sampler on an atlas keeps every data file it reads open (up to
``slafload.data_files.MAX_OPEN_FILES``): 3,816 files on the 5M-cell atlas, ~60,000 on
Tahoe-100M. Each contender runs in its own fresh process, opens every data file of the
expression table for its three columns, keeps them all open, and reports RSS per open file
(after a full collection and ``malloc_trim``, so what the opens left behind and still use,
not what their temporaries left free) and time per open:

* ``flat``: what the read stage does (``DataFiles._open_window``: a read window's files
  opened, read and walked by one call of the compiled footer walk, 32 files a call here,
  each then a ``FlatFile`` of its pages' chunk tables; a file whose footer does not match
  the table's format, as a read would open it: ``flat`` counts those read flat);
* ``lance``: a ``lance.file.LanceFileReader`` per file, kept open (what ``DataFiles`` keeps
  for files it cannot read flat).

    python benchmarks/open_files.py /tmp/atlas5m.slaf /tmp/atlas500k.slaf
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from slafload.tools.bench import machine, save_report

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ("cell_integer_id", "gene_integer_id", "value")
CONTENDERS = ("flat", "lance")
WINDOW = 32  # files opened per call of the footer walk (a window holds up to ~40 at 5M)


def rss_mb() -> float:
    """This process's resident set now, in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def settled_rss_mb() -> float:
    """RSS after a full collection and glibc's ``malloc_trim`` (where there is one)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
        if trim is not None:
            trim(0)
    return rss_mb()


def child(dataset: str, contender: str, limit: int | None) -> dict[str, Any]:
    """Open every data file of ``dataset`` (or its first ``limit``) as ``contender`` does."""
    import lance
    from lance.file import LanceFileReader

    import slafload.kernels
    from slafload.data_files import DataFiles
    from slafload.flat_pages import FlatFile
    from slafload.kernels import Kernels

    slafload.kernels.warm_up()
    kernels = Kernels("numba" if slafload.kernels.numba_available() else "numpy")
    expression = lance.dataset(f"{dataset.rstrip('/')}/expression.lance")
    files = DataFiles.of(expression, list(COLUMNS), kernels=kernels, mini=True)
    if files is None:
        raise SystemExit(f"{dataset}: its data files are not read directly")
    n = files.n_files if limit is None else min(limit, files.n_files)
    kept: list[Any] = []
    flat = 0
    if contender == "flat":  # the first file teaches the format, as in a run
        entry = files._entry(0, COLUMNS)
        with entry.lock:
            files._opened(entry, 0, COLUMNS)
    before = settled_rss_mb()
    start = time.perf_counter()
    if contender == "flat":
        for a in range(1, n, WINDOW):
            files._open_window([(f, 0, 0, 0) for f in range(a, min(n, a + WINDOW))], COLUMNS)
        for f in range(n):  # a file the window's call did not open: as its first read opens it
            entry = files._entry(f, COLUMNS)
            if entry.reader is None:
                with entry.lock:
                    files._opened(entry, f, COLUMNS)
        flat = sum(isinstance(entry.reader, FlatFile) for entry in files._open.values())
        opened = sum(entry.reader is not None for entry in files._open.values())
    else:
        kept = [LanceFileReader(files.paths[f], columns=list(COLUMNS)) for f in range(n)]
        opened = len(kept)
    seconds = time.perf_counter() - start
    grown = settled_rss_mb() - before
    per = max(opened - (contender == "flat"), 1)  # files opened in the timed part
    return {
        "dataset": dataset,
        "contender": contender,
        "files": n,
        "opened": opened,
        "flat": flat if contender == "flat" else 0,
        "kb_per_file": grown * 1024 / per,
        "rss_grown_mb": grown,
        "ms_per_open": seconds * 1000 / per,
    }


def run_child(dataset: str, contender: str, limit: int | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", dataset, contender]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"dataset": dataset, "contender": contender, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(report: dict[str, Any]) -> None:
    print(f"{'dataset':<28} {'contender':<8} {'files':>6} {'KB/file':>8} {'ms/open':>8}")
    for r in report["results"]:
        if "error" in r:
            print(f"{r['dataset']:<28} {r['contender']:<8} error")
            continue
        print(f"{r['dataset']:<28} {r['contender']:<8} {r['opened']:>6} "
              f"{r['kb_per_file']:>8.2f} {r['ms_per_open']:>8.3f}")  # fmt: skip


def draw(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["results"] if "error" not in r]
    labels = [f"{Path(r['dataset']).name}\n{r['contender']}" for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(labels, [r["kb_per_file"] for r in ok], color="tab:blue")
    axes[0].set_ylabel("RSS per open file (KB)")
    axes[1].bar(labels, [r["ms_per_open"] for r in ok], color="tab:orange")
    axes[1].set_ylabel("ms per open")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("An open expression data file (3 columns)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("datasets", nargs="+", help="SLAF datasets (paths)")
    p.add_argument("--limit", type=int, help="open only the first N data files")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "open_files.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        dataset, contender = args.datasets
        print(json.dumps(child(dataset, contender, args.limit)))
        return {}
    results = [run_child(d, c, args.limit) for d in args.datasets for c in CONTENDERS]
    report = {"benchmark": "open_files", "machine": machine(), "columns": list(COLUMNS),
              "window": WINDOW, "results": results}  # fmt: skip
    save_report(report, args.out, table, draw)
    return report


if __name__ == "__main__":
    main()
