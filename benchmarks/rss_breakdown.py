"""What a sampler's peak RSS is made of, per atlas size: the breakdown behind scale.py's growth.

``benchmarks/scale.py`` reports each sampler's peak RSS at 5M and at 500k cells. This script
says what such a peak holds, so that a difference between the sizes can be told apart:

* ``smaps``: file-backed pages (the libraries' code and data), anonymous memory, and the main
  heap (``[heap]``), summed over ``/proc/self/smaps``;
* ``malloc``: glibc's arenas, in use and free, and its ``mmap``ed blocks (``mallinfo2``;
  absent where the C library has none). Free arena memory is the allocator's, not the
  loader's: it is what the loader's temporaries left and glibc kept;
* the state that grows with the atlas by design: the cell offsets (``CellOffsets.nbytes``)
  and the open file descriptors (one per open data file of the flat reads).

Each (atlas, round) runs in a fresh process (``--child``) and reads ``--cells`` cells of
``--spec`` as scale.py's children do (same loader, seed and batch size). RSS is sampled after
every batch, and the breakdown is taken each time RSS passes its maximum so far by 1 MiB.
``peak_rss_mb`` is the process's ``ru_maxrss``, which may fall between two samples. A short
child on the last atlas runs first, unreported, to fill numba's on-disk cache (as in
scale.py: a child that compiles a kernel keeps ~85 MB more). The summary holds each atlas's
medians and, per field, the largest atlas's median less the smallest's.

    python benchmarks/rss_breakdown.py --atlas /tmp/atlas5m.slaf --atlas /tmp/atlas500k.slaf \\
        --spec 1x256 --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from slafload.tools.bench import machine, save_report

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from open_files import rss_mb  # noqa: E402  (the benchmarks' own helpers)
from scale import make_loader, progress  # noqa: E402

MIB = 2**20
STEP_MIB = 1.0  # RSS above the last breakdown's that takes a new one


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _mallinfo2() -> Any:
    """glibc's ``mallinfo2``, or ``None`` where the C library has none (glibc < 2.33, musl)."""
    name = ctypes.util.find_library("c")
    function = getattr(ctypes.CDLL(name), "mallinfo2", None) if name else None
    if function is not None:
        function.restype = _MallInfo2
    return function


def smaps_mb() -> dict[str, float]:
    """Resident MiB of this process's mappings: file-backed, anonymous, and ``[heap]``."""
    kinds = {"file_backed": 0, "anon": 0, "heap": 0, "other": 0}
    kind = "other"
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if fields[0] == "Rss:":
                kinds[kind] += int(fields[1])
            elif not fields[0].endswith(":"):  # a mapping's header: address range first
                path = fields[5] if len(fields) > 5 else ""
                kind = (
                    "file_backed" if path.startswith("/")
                    else "anon" if not path
                    else "heap" if path == "[heap]"
                    else "other"  # stacks, vdso, vvar
                )  # fmt: skip
    return {k: v / 1024 for k, v in kinds.items()}


def malloc_mb(info: Any) -> dict[str, float] | None:
    """glibc's arenas (in use, free) and ``mmap``ed blocks in MiB, if ``info`` is there."""
    if info is None:
        return None
    m = info()
    return {"arena": m.arena / MIB, "in_use": m.uordblks / MIB, "free": m.fordblks / MIB,
            "mmap": m.hblkhd / MIB}  # fmt: skip


def child(dataset: str, spec: str, cells: int, batch_size: int, max_genes: int) -> dict:
    """Read ``cells`` cells of ``spec`` over ``dataset`` in this process, breaking down RSS."""
    import slafload.kernels

    slafload.kernels.warm_up()
    gc.collect()
    info = _mallinfo2()
    args = argparse.Namespace(dataset=dataset, spec=spec, batch_size=batch_size,
                              max_genes=max_genes)  # fmt: skip
    loader = make_loader(dataset, args, {})  # the same loader as scale.py's children
    offsets = loader.dataset.cell_start
    at: dict[str, Any] = {}
    best = 0.0
    done = 0
    try:
        batches = iter(loader)
        while done < cells:
            done += len(next(batches)["input_ids"])
            now = rss_mb()
            if now > best + STEP_MIB:
                best = now
                at = {"rss_mb": now, "cells": done, "smaps": smaps_mb(),
                      "malloc": malloc_mb(info),
                      "open_descriptors": len(os.listdir("/proc/self/fd"))}  # fmt: skip
    finally:
        loader.close()
    return {
        "dataset": dataset, "spec": spec, "cells": done,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cell_offsets_mb": offsets.nbytes / MIB, "n_cells": len(offsets) - 1,
        "at_sampled_peak": at,
    }  # fmt: skip


def run_child(dataset: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", "--dataset", dataset, "--spec", args.spec,
           "--cells", str(args.cells), "--batch-size", str(args.batch_size),
           "--max-genes", str(args.max_genes)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout)
    if done.returncode != 0:
        return {"dataset": dataset, "spec": args.spec, "error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def flat(run: dict) -> dict[str, float]:
    """A run's numbers as one level of ``name: MiB`` (what the summary takes medians of)."""
    at = run["at_sampled_peak"]
    out = {"peak_rss_mb": run["peak_rss_mb"], "sampled_rss_mb": at["rss_mb"],
           "cell_offsets_mb": run["cell_offsets_mb"],
           "open_descriptors": float(at["open_descriptors"])}  # fmt: skip
    out.update({f"smaps_{k}_mb": v for k, v in at["smaps"].items()})
    if at["malloc"] is not None:
        out.update({f"malloc_{k}_mb": v for k, v in at["malloc"].items()})
    return out


def summarize(runs: list[dict]) -> dict[str, Any]:
    """Each atlas's medians over its runs, and the largest atlas's less the smallest's."""
    by_atlas: dict[str, list[dict[str, float]]] = {}
    cells: dict[str, int] = {}
    for run in runs:
        if "error" in run:
            continue
        by_atlas.setdefault(run["dataset"], []).append(flat(run))
        cells[run["dataset"]] = run["n_cells"]
    medians = {
        atlas: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for atlas, rs in by_atlas.items()
    }
    out: dict[str, Any] = {"medians": medians, "rounds": {a: len(r) for a, r in by_atlas.items()}}
    if len(medians) >= 2:
        large, small = max(cells, key=cells.__getitem__), min(cells, key=cells.__getitem__)
        out["largest_less_smallest"] = {
            key: medians[large][key] - medians[small][key]
            for key in medians[large]
            if key in medians[small]
        }
        out["rss_growth"] = medians[large]["peak_rss_mb"] / medians[small]["peak_rss_mb"]
    return out


def table(report: dict) -> None:
    summary = report["summary"]
    medians = summary["medians"]
    atlases = list(medians)
    keys = list(next(iter(medians.values()))) if medians else []
    print(f"{'MiB (medians)':<24}" + "".join(f"{Path(a).name:>22}" for a in atlases)
          + ("      largest - smallest" if "largest_less_smallest" in summary else ""))  # fmt: skip
    for key in keys:
        row = f"{key:<24}" + "".join(
            f"{medians[a].get(key, float('nan')):>22,.1f}" for a in atlases
        )
        if "largest_less_smallest" in summary:
            row += f"{summary['largest_less_smallest'].get(key, float('nan')):>24,.1f}"
        print(row)
    if "rss_growth" in summary:
        print(f"\npeak RSS, largest atlas over smallest: {summary['rss_growth']:.3f}")
    for run in report["runs"]:
        if "error" in run:
            print(f"{run['dataset']}: failed: {run['error'][-300:]}")


SMAPS = ("file_backed", "heap", "anon", "other")
MALLOC = ("in_use", "free", "mmap")


def draw(report: dict, path: Path) -> None:
    """Each atlas's median breakdown: RSS by kind of mapping, and glibc's share of it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    medians = report["summary"]["medians"]
    names = [Path(a).name for a in medians]
    fig, axes = plt.subplots(1, 2, figsize=(10, 1.8 + 0.6 * max(1, len(names))))
    for ax, keys, prefix, title in (
        (axes[0], SMAPS, "smaps", "RSS at the sampled peak, by mapping"),
        (axes[1], MALLOC, "malloc", "glibc: arenas in use, free, and mmap'ed blocks"),
    ):
        left = [0.0] * len(names)
        for key in keys:
            widths = [m.get(f"{prefix}_{key}_mb", 0.0) for m in medians.values()]
            ax.barh(names, widths, left=left, label=key)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        ax.set_xlabel("MiB (medians)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=len(keys))
    fig.suptitle(f"{report['settings']['spec']}: what the peak RSS holds, per atlas", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--atlas", action="append", default=[], help="dataset path (repeat)")
    p.add_argument("--spec", default="1x256", help="scale.py's sampler spec: chunk or BxF")
    p.add_argument("--cells", type=int, default=150_000)
    p.add_argument("--rounds", type=int, default=1, help="runs per atlas, interleaved")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-genes", type=int, default=2048)
    p.add_argument("--child-timeout", type=float, default=600)
    p.add_argument("--out", default=str(HERE / "results" / "rss_breakdown.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dataset", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        report = child(args.dataset, args.spec, args.cells, args.batch_size, args.max_genes)
        print(json.dumps(report))
        return report
    if not args.atlas:
        p.error("give at least one --atlas")
    runs = []
    todo = [(k, atlas) for k in range(args.rounds) for atlas in args.atlas]  # interleaved
    run_child(args.atlas[-1], argparse.Namespace(**{**vars(args), "cells": 4096}))  # the cache
    for k, atlas in progress(todo, desc="runs", unit="run"):
        runs.append({**run_child(atlas, args), "round": k})
    report = {"settings": {k: v for k, v in vars(args).items() if k not in {"child", "dataset"}},
              "machine": machine(), "runs": runs, "summary": summarize(runs)}  # fmt: skip
    save_report(report, args.out, table, draw)
    return report


if __name__ == "__main__":
    main()
