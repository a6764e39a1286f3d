"""CPU per range read in each Lance file format: why ``slafload optimize`` rewrites into 2.0.

Copies the first ``--files`` data files' rows of an atlas's expression table into one new table
per Lance file format (2.0, 2.1, 2.2; same rows, same 1M-row data files), then times
``LanceFileReader(file, columns).read_range(start, rows).to_table()`` on a kept-open reader,
as the loader's direct range reads do (``slafload/data_files.py``): random starts, ``--reads``
reads per point, formats interleaved round by round, medians of process CPU time per read. A
1-row read is the fixed cost of a call; the columns are all three, then without
``cell_integer_id``, then ``value`` alone.

    python benchmarks/file_format_cost.py /tmp/atlas5m.slaf

Writes ``benchmarks/results/file_format_cost.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
from lance.file import LanceFileReader

FORMATS = ("2.0", "2.1", "2.2")
COLUMN_SETS = {
    "3 columns": ["cell_integer_id", "gene_integer_id", "value"],
    "gene, value": ["gene_integer_id", "value"],
    "value": ["value"],
}


def copies(atlas: str, n_files: int, root: Path) -> dict[str, str]:
    """One data file of each format holding the same rows: ``{format: data file path}``."""
    src = lance.dataset(os.path.join(atlas, "expression.lance"))
    rows = pa.concat_tables(f.to_table() for f in src.get_fragments()[:n_files])
    files = {}
    for version in FORMATS:
        path = root / f"expression_v{version}.lance"
        shutil.rmtree(path, ignore_errors=True)
        ds = lance.write_dataset(rows, str(path), data_storage_version=version)
        first = ds.get_fragments()[0].metadata.files[0].path
        files[version] = str(path / "data" / first)
    return files


def cpu_per_read(reader: LanceFileReader, starts: np.ndarray, rows: int) -> float:
    """Median process CPU ms of one ``read_range`` of ``rows`` rows, over ``starts``."""
    times = []
    for start in starts.tolist():
        c0 = time.process_time()
        reader.read_range(start, rows, batch_size=max(rows, 1)).to_table()
        times.append(time.process_time() - c0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("atlas", help="SLAF dataset whose expression rows are copied")
    p.add_argument("--files", type=int, default=2, help="data files copied (default: 2)")
    p.add_argument("--sizes", default="1,12800,51200", help="rows per read")
    p.add_argument("--reads", type=int, default=300, help="reads per point and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", default="/tmp/slafload-file-format-cost")
    p.add_argument("--out", default="benchmarks/results/file_format_cost.json")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    files = copies(args.atlas, args.files, work)
    sizes_on_disk = {v: os.path.getsize(f) for v, f in files.items()}
    readers = {(v, name): LanceFileReader(f, columns=cols)
               for v, f in files.items() for name, cols in COLUMN_SETS.items()}  # fmt: skip
    n_rows = readers[(FORMATS[0], "value")].metadata().num_rows
    rng = np.random.default_rng(0)
    samples: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for size in sizes:
            starts = rng.integers(0, n_rows - size, args.reads)
            for name in COLUMN_SETS:
                for version in FORMATS:
                    reader = readers[(version, name)]
                    cpu_per_read(reader, starts[:10], size)  # warm
                    key = json.dumps([version, name, size])
                    samples.setdefault(key, []).append(cpu_per_read(reader, starts, size))
    results = []
    for key, values in samples.items():
        version, name, size = json.loads(key)
        results.append({"format": version, "columns": name, "rows": size,
                        "cpu_ms_per_read": statistics.median(values), "rounds": values})  # fmt: skip
    print(f"{'rows':>7} {'columns':<12}" + "".join(f"{'Lance ' + v:>12}" for v in FORMATS))
    for size in sizes:
        for name in COLUMN_SETS:
            cells = [next(r for r in results if (r["format"], r["columns"], r["rows"])
                          == (v, name, size))["cpu_ms_per_read"] for v in FORMATS]  # fmt: skip
            print(f"{size:>7} {name:<12}" + "".join(f"{c:>9.3f} ms" for c in cells))
    print("bytes per row: " + ", ".join(f"{v}: {b / n_rows:.2f}" for v, b in sizes_on_disk.items()))
    report = {
        "settings": vars(args),
        "lance": lance.__version__,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "rows_per_file": n_rows,
        "bytes_per_row": {v: b / n_rows for v, b in sizes_on_disk.items()},
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
