"""Reads of a table with deleted rows against the same table without them.

Writes a SLAF dataset (``--cells`` cells of ~``--rows-per-cell`` rows, ``--rows-per-file``
rows per data file, Lance format ``--format``) twice: as written, and with every
``--delete-every``-th cell's rows deleted (deletion files in every fragment, offsets
rewritten). Times one epoch of ``BlockShuffle`` fetches read by :class:`slafload.pipeline.reader.Reader`
on each, rounds interleaved: an epoch by a new reader (which opens the data files and lists each
fragment's deleted rows on its first read) and a second epoch by the same reader. Writes the
times and the speed ratios (deleted / plain) to ``--out`` (JSON). Identity with Lance's reads
is tested in ``tests/_lance/test_fragments.py``, not here. Page cache warm (the tables are read before timing).

Run:  python benchmarks/deleted_rows.py --cells 20000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

from slafload import open_dataset
from slafload.pipeline.reader import Reader, ReadOptions
from slafload.samplers import BlockShuffle
from slafload.tools.writer import CsrBlock, write_slaf


def write(path: Path, cells: int, per_cell: int, genes: int, per_file: int, version: str) -> None:
    rng = np.random.default_rng(0)
    counts = rng.integers(per_cell // 2, per_cell * 3 // 2, size=cells)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    indices = np.concatenate([np.sort(rng.choice(genes, size=c, replace=False)) for c in counts])
    data = rng.integers(1, 100, size=len(indices))
    write_slaf(path, [CsrBlock(indptr, indices.astype(np.int64), data)], n_genes=genes,
               value_type=pa.uint16(), max_rows_per_file=per_file)  # fmt: skip
    uri = str(path / "expression.lance")
    if version != "default":  # rewrite the expression table in the format asked for
        table = lance.dataset(uri).to_table()
        lance.write_dataset(table, uri, mode="overwrite", max_rows_per_file=per_file,
                            data_storage_version=version)  # fmt: skip


def delete_cells(path: Path, every: int, cells: int) -> None:
    uri = str(path / "expression.lance")
    doomed = ", ".join(str(c) for c in range(every // 2, cells, every))
    lance.dataset(uri).delete(f"cell_integer_id IN ({doomed})")
    ids = lance.dataset(uri).to_table(columns=["cell_integer_id"]).column(0).to_numpy()
    table = lance.dataset(str(path / "cells.lance")).to_table()
    i = table.schema.get_field_index("cell_start_index")
    start = pa.array(np.searchsorted(ids, np.arange(table.num_rows))).cast(table.schema[i].type)
    lance.write_dataset(table.set_column(i, table.schema[i], start), str(path / "cells.lance"),
                        mode="overwrite")  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    config["metadata"]["expression_count"] = len(ids)
    (path / "config.json").write_text(json.dumps(config))


def epochs(path: Path, sampler: BlockShuffle) -> tuple[float, float, float]:
    """Seconds to open the dataset, for an epoch read by a new reader (opening the data files and listing their
    deleted rows as it goes), then for a second epoch by the same reader.
    """
    began = time.perf_counter()
    dataset = open_dataset(path)
    opened = time.perf_counter() - began
    reader = Reader(dataset, ReadOptions())
    plan = list(sampler.plan(dataset.n_cells, seed=0, epoch=0))
    seconds = []
    for _ in range(2):
        began = time.perf_counter()
        for fetch in plan:
            for _ in reader.read(fetch):
                pass
        seconds.append(time.perf_counter() - began)
    return opened, seconds[0], seconds[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", type=int, default=20_000)
    parser.add_argument("--rows-per-cell", type=int, default=100)
    parser.add_argument("--rows-per-file", type=int, default=200_000)
    parser.add_argument("--format", default="2.0")
    parser.add_argument("--delete-every", type=int, default=50)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/deleted_rows.json")
    args = parser.parse_args()
    sampler = BlockShuffle(block_size=args.block_size, fetch_factor=4, batch_size=64)
    with tempfile.TemporaryDirectory() as tmp:
        plain, deleted = Path(tmp) / "plain.slaf", Path(tmp) / "deleted.slaf"
        for path in (plain, deleted):
            write(path, args.cells, args.rows_per_cell, 2000, args.rows_per_file, args.format)
        delete_cells(deleted, args.delete_every, args.cells)
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):  # interleaved
            for name, path in (("plain", plain), ("deleted", deleted)):
                opened, first, again = epochs(path, sampler)
                times.setdefault(f"{name}_open", []).append(opened)
                times.setdefault(f"{name}_new_reader", []).append(first)
                times.setdefault(f"{name}_same_reader", []).append(again)
        rows = lance.dataset(str(deleted / "expression.lance")).count_rows()
    median = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "args": vars(args),
        "rows_with_deletions": rows,
        "seconds": times,
        "median_seconds": median,
        "speed_ratio_new_reader": median["plain_new_reader"] / median["deleted_new_reader"],
        "speed_ratio_same_reader": median["plain_same_reader"] / median["deleted_same_reader"],
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=1))


if __name__ == "__main__":
    main()
