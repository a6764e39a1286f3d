"""Candidate settings against the defaults on the peers benchmark's data, interleaved.

Each variant is a name and a JSON object with any of ``"tuning"`` (:class:`slafload.Tuning`
fields), ``"env"`` (environment variables of its process, e.g. ``MALLOC_ARENA_MAX``),
``"contender"`` (a slafload contender of ``benchmarks/peers.py``, default ``slafload-raw``)
and ``"path"`` (its store); each run is one fresh process of ``peers.py``'s child, the
variants' order reversed every other round. Prints each variant's medians and its same-round
ratios to the first variant (peak RSS above torch, CPU per cell, cells/s) with the load
average, and writes every run to ``--out``. The data must exist: run ``peers.py`` once first.

    python benchmarks/tuning_ab.py --data slafload-bench/data/peers/100000x20000 --rounds 4 \\
        default='{}' half='{"tuning": {"memory_budget": 268435456}}' \\
        arenas='{"env": {"MALLOC_ARENA_MAX": "2"}}'
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import peers

KEYS = ("peak_above_torch_mb", "cpu_us_per_cell", "cells_per_s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variants", nargs="+", metavar="NAME=JSON", help="the first is the reference")
    p.add_argument("--data", required=True, help="peers.py's data folder of one atlas size")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-cells", type=int, default=100_000)
    p.add_argument("--out", default="slafload-bench/tuning_ab.json")
    args = p.parse_args()
    variants = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.variants)}
    data = Path(args.data)
    base = {"max_genes": 2048, "warm_cells": 16384, "min_cells": args.min_cells, "seconds": 8.0,
            "plates": str(data / "plates.npy")}  # fmt: skip
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            v = variants[name]
            spec = {**base, "path": v.get("path", str(data / "slafload.slaf")),
                    "tuning": v.get("tuning", {})}  # fmt: skip
            saved = dict(os.environ)
            os.environ.update(v.get("env", {}))
            try:
                result = peers.run_child(v.get("contender", "slafload-raw"), spec, 300)
            finally:
                os.environ.clear()
                os.environ.update(saved)
            if "error" in result:
                raise SystemExit(f"{name}: {result['error']}")
            runs[name].append({**result, "load_avg_1min": os.getloadavg()[0]})
    ref = runs[names[0]]
    for name in names:
        med = {k: statistics.median(x[k] for x in runs[name]) for k in KEYS}
        ratio = {k: statistics.median(b[k] / a[k] for a, b in zip(ref, runs[name], strict=True))
                 for k in KEYS}  # fmt: skip
        loads = [x["load_avg_1min"] for x in runs[name]]
        print(f"{name:<16}" + "".join(f"{k} {med[k]:,.1f} ({ratio[k]:.3f}x)  " for k in KEYS)
              + f"load {min(loads):.1f}-{max(loads):.1f}")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"variants": variants, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
