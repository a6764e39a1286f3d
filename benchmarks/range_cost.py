"""Where the cost of one scattered cell-range read goes on an atlas with thousands of data files.

Issue 17 measured that one 16-cell range (~12.8k expression rows) read with ``take_scan`` costs
more the more data files the table has, and guessed that each range pays for opening its data
file. This probe times one range, and one fetch of many ranges, through every read path pylance
offers, on the same rows of the same dataset, interleaved (round robin over the contenders, so a
noisy shared machine disturbs them alike), and reports medians:

* ``take_scan``: ``LanceDataset._ds.take_scan([(start, stop)])``, the reader's path for short
  spans (per range, Lance turns dataset row *offsets* into row *addresses* by walking the
  fragment list, then opens the fragment and reads the rows);
* ``take_scan_2col``: the same without ``cell_integer_id``;
* ``take_scan_bigcache``: the same on a dataset opened with a 4 GiB metadata cache;
* ``take_offsets``: ``LanceDataset.take(np.arange(start, stop))`` (same conversion as take_scan);
* ``take_rows_addr``: ``LanceDataset._take_rows(row addresses)``: the addresses computed in
  numpy from the fragments' row counts, so Lance skips the offset walk;
* ``fragment_scan``: ``LanceFragment.to_batches(offset=, limit=)`` on a cached fragment object;
* ``fragment_session``: ``LanceFragment.open_session(columns).take(local offsets)``, one
  session per fragment kept open across reads;
* ``file_reader``: ``lance.file.LanceFileReader(data file, columns).read_range(...)``, one
  reader per data file kept open across reads (the file-level API);
* ``file_reader_open``: the same, opening the file reader for every read.

Each single-range contender reads the same ``--ranges`` random 16-cell ranges (one range per
call); the ``fetch`` contenders read all ``--fetch-ranges`` ranges of one BlockShuffle-like fetch
with one ``take_scan`` call (Lance parallelises inside it) or with a thread pool over kept-open
file readers. Every result is checked against ``take_scan``'s rows.

    python benchmarks/range_cost.py /tmp/atlas5m.slaf /tmp/atlas500k.slaf
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
from lance.file import LanceFileReader

import slafload

COLS = ["cell_integer_id", "gene_integer_id", "value"]
COLS2 = ["gene_integer_id", "value"]


class Layout:
    """Fragment boundaries of an expression table (one int per data file)."""

    def __init__(self, uri: str, ds: lance.LanceDataset):
        self.uri = uri
        self.frags = ds.get_fragments()
        counts = np.array([f.metadata.physical_rows for f in self.frags], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self.paths = [os.path.join(uri, "data", f.metadata.files[0].path) for f in self.frags]
        self.readers: dict[tuple, LanceFileReader] = {}
        self.sessions: dict[int, object] = {}

    def locate(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """(fragment index, local start, rows) pieces of dataset rows [start, stop)."""
        out = []
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.starts[i + 1]))
            out.append((i, start - int(self.starts[i]), end - start))
            start, i = end, i + 1
        return out

    def reader(self, i: int, columns: list[str]) -> LanceFileReader:
        # A pylance file reader is not shared between threads ("Already borrowed").
        key = (i, tuple(columns), threading.get_ident())
        r = self.readers.get(key)
        if r is None:
            r = self.readers[key] = LanceFileReader(self.paths[i], columns=columns)
        return r


def table_of(batches) -> pa.Table:
    return pa.Table.from_batches(list(batches))


def contenders(ds, big, layout: Layout):
    def take_scan(a, b):
        return table_of(ds._ds.take_scan([(a, b)], columns=COLS))

    def take_scan_2col(a, b):
        return table_of(ds._ds.take_scan([(a, b)], columns=COLS2))

    def take_scan_bigcache(a, b):
        return table_of(big._ds.take_scan([(a, b)], columns=COLS))

    def take_offsets(a, b):
        return ds.take(pa.array(np.arange(a, b, dtype=np.uint64)), columns=COLS)

    def take_rows_addr(a, b):
        parts = []
        for i, lo, n in layout.locate(a, b):
            fid = layout.frags[i].fragment_id
            parts.append((np.uint64(fid) << np.uint64(32)) + np.arange(lo, lo + n, dtype=np.uint64))
        return ds._take_rows(pa.array(np.concatenate(parts)), columns=COLS)

    def fragment_scan(a, b):
        out = []
        for i, lo, n in layout.locate(a, b):
            out += layout.frags[i].to_batches(columns=COLS, offset=lo, limit=n)
        return table_of(out)

    def fragment_session(a, b):
        out = []
        for i, lo, n in layout.locate(a, b):
            s = layout.sessions.get(i)
            if s is None:
                s = layout.sessions[i] = layout.frags[i].open_session(columns=COLS)
            out.append(s.take(pa.array(np.arange(lo, lo + n, dtype=np.uint32))))
        return pa.concat_tables(out)

    def file_reader(a, b):
        out = []
        for i, lo, n in layout.locate(a, b):
            out += layout.reader(i, COLS).read_range(lo, n, batch_size=n).to_batches()
        return table_of(out)

    def file_reader_2col(a, b):
        out = []
        for i, lo, n in layout.locate(a, b):
            out += layout.reader(i, COLS2).read_range(lo, n, batch_size=n).to_batches()
        return table_of(out)

    def file_reader_open(a, b):
        out = []
        for i, lo, n in layout.locate(a, b):
            r = LanceFileReader(layout.paths[i], columns=COLS)
            out += r.read_range(lo, n, batch_size=n).to_batches()
        return table_of(out)

    return {
        "take_scan": take_scan,
        "take_scan_2col": take_scan_2col,
        "take_scan_bigcache": take_scan_bigcache,
        "take_offsets": take_offsets,
        "take_rows_addr": take_rows_addr,
        "fragment_scan": fragment_scan,
        "fragment_session": fragment_session,
        "file_reader": file_reader,
        "file_reader_2col": file_reader_2col,
        "file_reader_open": file_reader_open,
    }


def fetch_contenders(ds, layout: Layout):
    def take_scan_fetch(spans):
        return table_of(ds._ds.take_scan(spans, columns=COLS, batch_readahead=len(spans)))

    def take_scan_fetch_2col(spans):
        return table_of(ds._ds.take_scan(spans, columns=COLS2, batch_readahead=len(spans)))

    def one(span, columns):
        out = []
        for i, lo, n in layout.locate(*span):
            out += layout.reader(i, columns).read_range(lo, n, batch_size=n).to_batches()
        return out

    pool = ThreadPoolExecutor(4)

    def file_reader_fetch_serial(spans):
        return table_of([b for s in spans for b in one(s, COLS)])

    def file_reader_fetch_streams(spans):
        # Every range's stream is created (its I/O scheduled) before any is consumed.
        streams = [layout.reader(i, COLS).read_range(lo, n, batch_size=n).to_batches()
                   for s in spans for i, lo, n in layout.locate(*s)]  # fmt: skip
        return table_of([b for st in streams for b in st])

    def file_reader_fetch_streams_2col(spans):
        streams = [layout.reader(i, COLS2).read_range(lo, n, batch_size=n).to_batches()
                   for s in spans for i, lo, n in layout.locate(*s)]  # fmt: skip
        return table_of([b for st in streams for b in st])

    def file_reader_fetch_threads(spans):
        return table_of([b for bs in pool.map(lambda s: one(s, COLS), spans) for b in bs])

    def file_reader_fetch_threads_2col(spans):
        return table_of([b for bs in pool.map(lambda s: one(s, COLS2), spans) for b in bs])

    return {
        "take_scan_fetch": take_scan_fetch,
        "take_scan_fetch_2col": take_scan_fetch_2col,
        "file_reader_fetch_serial": file_reader_fetch_serial,
        "file_reader_fetch_streams": file_reader_fetch_streams,
        "file_reader_fetch_streams_2col": file_reader_fetch_streams_2col,
        "file_reader_fetch_threads4": file_reader_fetch_threads,
        "file_reader_fetch_threads4_2col": file_reader_fetch_threads_2col,
    }


def probe(path: str, args) -> dict:
    sd = slafload.open_dataset(path)
    uri = sd.expression.uri
    ds = lance.dataset(uri, version=sd.expression.version)
    big = lance.dataset(uri, version=sd.expression.version, metadata_cache_size_bytes=4 << 30)
    layout = Layout(uri, ds)
    rng = np.random.default_rng(0)
    n_blocks = sd.n_cells // args.block
    blocks = rng.choice(n_blocks, size=args.ranges, replace=False) * args.block
    ranges = [(int(sd.cell_start[c]), int(sd.cell_start[c + args.block])) for c in blocks]
    # Where in the table a range sits: first and last fragment, to see the offset walk.
    first_frag = [(int(sd.cell_start[c]), int(sd.cell_start[c + args.block]))
                  for c in range(0, 50 * args.block, args.block)]  # fmt: skip
    last_cell = sd.n_cells - 51 * args.block
    last_frag = [(int(sd.cell_start[c]), int(sd.cell_start[c + args.block]))
                 for c in range(last_cell, last_cell + 50 * args.block, args.block)]  # fmt: skip
    single = contenders(ds, big, layout)
    ref = {r: single["take_scan"](*r) for r in ranges[:20]}
    for name, fn in single.items():  # correctness, and a warm-up of every cache
        for r, want in ref.items():
            got = fn(*r)
            cols = got.column_names
            assert got.equals(want.select(cols)), (name, r)
    times: dict[str, list[float]] = {k: [] for k in single}
    for _ in range(args.rounds):
        for name, fn in single.items():
            t = time.perf_counter()
            for r in ranges:
                fn(*r)
            times[name].append((time.perf_counter() - t) / len(ranges) * 1e3)
    where: dict[str, list[float]] = {"take_scan_first_fragments": [], "take_scan_last_fragments": [],
                                     "file_reader_first_fragments": [],
                                     "file_reader_last_fragments": []}  # fmt: skip
    for _ in range(args.rounds):
        for label, rs in (("first", first_frag), ("last", last_frag)):
            for name in ("take_scan", "file_reader"):
                t = time.perf_counter()
                for r in rs:
                    single[name](*r)
                where[f"{name}_{label}_fragments"].append((time.perf_counter() - t) / len(rs) * 1e3)
    # Whole fetches: --fetch-ranges random blocks, sorted (as BlockShuffle's plan gives them).
    fetches = []
    for _ in range(args.fetches):
        cells = np.sort(rng.choice(n_blocks, size=args.fetch_ranges, replace=False)) * args.block
        fetches.append([(int(sd.cell_start[c]), int(sd.cell_start[c + args.block])) for c in cells])
    many = fetch_contenders(ds, layout)
    want = many["take_scan_fetch"](fetches[0])
    for name, fn in many.items():
        got = fn(fetches[0])
        assert got.equals(want.select(got.column_names)), name
    fetch_times: dict[str, list[float]] = {k: [] for k in many}
    for f in fetches:
        for name, fn in many.items():
            t = time.perf_counter()
            fn(f)
            fetch_times[name].append((time.perf_counter() - t) * 1e3)
    rows = np.mean([b - a for a, b in ranges])
    return {
        "dataset": path,
        "n_cells": sd.n_cells,
        "n_rows": sd.n_rows,
        "n_data_files": len(layout.frags),
        "rows_per_range": float(rows),
        "single_range_ms": {k: statistics.median(v) for k, v in times.items()},
        "single_range_ms_runs": times,
        "by_position_ms": {k: statistics.median(v) for k, v in where.items()},
        "fetch": {"ranges": args.fetch_ranges, "block_cells": args.block},
        "fetch_ms": {k: statistics.median(v) for k, v in fetch_times.items()},
        "fetch_ms_runs": fetch_times,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("datasets", nargs="+")
    p.add_argument("--block", type=int, default=16, help="cells per range")
    p.add_argument("--ranges", type=int, default=200, help="single ranges per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fetch-ranges", type=int, default=512, help="ranges per fetch")
    p.add_argument("--fetches", type=int, default=5)
    p.add_argument("--note", default="", help="what else ran on the machine")
    p.add_argument("--out", default="benchmarks/results/range_cost.json")
    args = p.parse_args(argv)
    report = {
        "settings": vars(args),
        "page_cache": "warm (every contender read the sample ranges before timing)",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "pylance": lance.__version__,
        },
        "results": [],
    }
    for path in args.datasets:
        print(f"probing {path} ...", file=sys.stderr, flush=True)
        r = probe(path, args)
        report["results"].append(r)
        print(f"\n{path}: {r['n_data_files']} data files, {r['rows_per_range']:.0f} rows/range")
        for k, v in r["single_range_ms"].items():
            print(f"  {k:<22}{v:8.3f} ms/range")
        for k, v in r["by_position_ms"].items():
            print(f"  {k:<32}{v:8.3f} ms/range")
        for k, v in r["fetch_ms"].items():
            print(f"  {k:<32}{v:8.1f} ms/fetch of {args.fetch_ranges} ranges")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
