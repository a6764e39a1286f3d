"""Flat page reads on and off (``LoaderConfig.read_flat``): an interleaved A/B of the loader.

Each run is its own process (``benchmarks/scale.py``'s child: geneformer, batch 32, steady
cells/s after the first fetch, first batch, peak RSS), the two settings alternating which goes
first each round, on an atlas in Lance's 2.0 format (``slafload optimize``: the files the
flat path reads by default). Reports medians and each contender's ratio to ChunkShuffle with
the same setting. ``--setting read_mini_blocks`` A/Bs the decoding of 2.1+ mini-block pages
instead, on an atlas as written::

    python benchmarks/flat_reads.py --atlas /tmp/atlas500k_v20.slaf --rounds 3
    python benchmarks/flat_reads.py --atlas /tmp/atlas5m.slaf --setting read_mini_blocks
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale  # benchmarks/ is not a package

METRICS = ("cells_per_s", "first_batch_s", "peak_rss_mb")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--atlas", required=True, help="a SLAF dataset (Lance 2.0 for read_flat)")
    p.add_argument("--specs", default="chunk,16x256,64x256")
    p.add_argument("--setting", default="read_flat", choices=["read_flat", "read_mini_blocks"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-genes", type=int, default=2048)
    p.add_argument("--fetches", type=float, default=3)
    p.add_argument("--min-cells", type=int, default=60_000)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument(
        "--warm-cells",
        type=int,
        default=0,
        help="cells before the clock (a 5M atlas opens all its files in ~1M)",
    )
    p.add_argument("--child-timeout", type=float, default=300)
    p.add_argument("--note", default="")
    p.add_argument("--out", default=str(scale.ROOT / "benchmarks" / "results" / "flat_reads.json"))
    args = p.parse_args(argv)
    specs = args.specs.split(",")
    runs: dict[str, list[dict]] = {}
    for r in scale.progress(range(args.rounds), desc="rounds"):
        for spec in specs:
            for flat in (True, False) if r % 2 == 0 else (False, True):
                res = scale.run_child(args.atlas, spec, args, {args.setting: flat})
                key = f"{spec} {args.setting}={flat}"
                got = {m: res[m] for m in METRICS} if "error" not in res else res
                runs.setdefault(key, []).append(got)
                print(key, got, file=sys.stderr, flush=True)
    summary: dict[str, dict] = {}
    for key, got in runs.items():
        ok = [g for g in got if "error" not in g]
        summary[key] = {m: statistics.median(g[m] for g in ok) for m in METRICS} if ok else {}
    for flat in (True, False):
        chunk = summary.get(f"chunk {args.setting}={flat}", {}).get("cells_per_s")
        for spec in specs:
            row = summary[f"{spec} {args.setting}={flat}"]
            if chunk and row:
                row["vs_chunk"] = row["cells_per_s"] / chunk
    for spec in specs:
        on, off = summary[f"{spec} {args.setting}=True"], summary[f"{spec} {args.setting}=False"]
        if on and off:
            on[f"vs_{args.setting}_false"] = on["cells_per_s"] / off["cells_per_s"]
    report = {
        "what": __doc__.split("\n\n")[0],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "settings": vars(args),
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    for key, row in summary.items():
        print(key, {k: round(v, 3) for k, v in row.items()})
    return report


if __name__ == "__main__":
    main()
