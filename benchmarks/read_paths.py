"""Benchmark pylance read paths for CSR-style row-range reads of an expression table.

What it measures
----------------
A synthetic ``expression.lance``-like table (``cell_integer_id`` uint32, ``gene_integer_id``
uint16, ``value`` uint16; sorted by cell, ~800 rows per cell with a CSR ``indptr``) is written
into a temporary directory, once per requested fragment count (``--fragments``, e.g. ``1,20``).
After one warm-up full scan (page cache warm), every read path below is timed; each number is
the median of ``--repeats`` runs and is reported as rows/s.  Every result is checked against the
generated numpy arrays (same rows, same order).

* floor    -- bare full scans: ``ds.to_batches(columns=...)`` (default and large batch_size)
              and ``ds.to_table``.
* case (a) -- one large contiguous row range [start, stop) (``--large-sizes`` rows, cell
              aligned), read by: ``ds.scanner(offset=, limit=)`` ``.to_batches()`` /
              ``.to_table()`` with several ``batch_size`` / readahead / ``scan_in_order``
              settings, ``ds.slice``, ``ds._ds.take_scan``, ``ds.take(np.arange)``, and
              fragment-level ``LanceFragment.to_table/to_batches(offset=, limit=)`` with the
              range split at fragment boundaries.
* case (b) -- ``--n-ranges`` (256) scattered, non-overlapping, offset-sorted ranges of
              ``--block-cells`` (16, 64) cells each, read by the same APIs (a per-range loop
              for scanner / fragment reads, a single call for ``take_scan``, ``take`` and
              ``scanner(row_addr_allowlist=...)``), "coalesce" variants that merge ranges
              separated by small gaps into one scan and cut the ranges out with zero-copy
              ``Table.slice``, a sparser variant (``--sparse-n-ranges``), and the per-call
              latency of tiny (one-cell) reads.
* case (c) -- ``--threads`` (1, 2, 4) ``ThreadPoolExecutor`` workers each running case (b)
              requests, with one shared ``LanceDataset`` or one dataset object per thread;
              aggregate rows/s over wall time.
* extras   -- cost of ``lance.dataset(uri)`` / ``lance.dataset(uri, version=v)`` /
              ``checkout_version``, version pinning across an append, a shared-dataset thread
              stress test, and pyarrow -> numpy / polars conversion costs.

Run:  python benchmarks/read_paths.py --rows 20000000 --fragments 1,20
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
from lance.dataset import serialize_row_addrs

try:
    import polars as pl
except ImportError:  # pragma: no cover - polars is optional
    pl = None

COLS = ["cell_integer_id", "gene_integer_id", "value"]
SCHEMA = pa.schema(
    [("cell_integer_id", pa.uint32()), ("gene_integer_id", pa.uint16()), ("value", pa.uint16())]
)
MIB = 1 << 20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


@dataclass
class Reference:
    """Generated columns kept in memory to verify reads, plus the CSR indptr."""

    indptr: np.ndarray
    cells: np.ndarray
    genes: np.ndarray
    values: np.ndarray

    @property
    def n_rows(self) -> int:
        return int(self.indptr[-1])

    @property
    def n_cells(self) -> int:
        return len(self.indptr) - 1


def make_reference(n_rows: int, mean_rpc: int, seed: int) -> Reference:
    """Cells with 0.5x-1.5x ``mean_rpc`` rows, genes sorted within a cell, small counts."""
    rng = np.random.default_rng(seed)
    n_cells = max(1, n_rows // mean_rpc)
    rpc = rng.integers(mean_rpc // 2, mean_rpc + mean_rpc // 2 + 1, n_cells)
    indptr = np.zeros(n_cells + 1, dtype=np.int64)
    np.cumsum(rpc, out=indptr[1:])
    total = int(indptr[-1])
    cells = np.repeat(np.arange(n_cells, dtype=np.uint32), rpc)
    genes = rng.integers(0, 60_000, total, dtype=np.uint16)
    # sort genes within each cell: stable lexsort on (gene, cell) keeps cells in order
    genes = genes[np.lexsort((genes, cells))]
    values = np.minimum(rng.geometric(0.3, total), 65_535).astype(np.uint16)
    return Reference(indptr, cells, genes, values)


def write_dataset(ref: Reference, uri: str, n_fragments: int, block_rows: int) -> float:
    def batches():
        for s in range(0, ref.n_rows, block_rows):
            e = min(ref.n_rows, s + block_rows)
            yield pa.record_batch([ref.cells[s:e], ref.genes[s:e], ref.values[s:e]], schema=SCHEMA)

    max_rows = max(ref.n_rows, 1) if n_fragments <= 1 else math.ceil(ref.n_rows / n_fragments)
    t0 = time.perf_counter()
    lance.write_dataset(
        pa.RecordBatchReader.from_batches(SCHEMA, batches()),
        uri,
        schema=SCHEMA,
        max_rows_per_file=max_rows,
    )
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# range helpers (all vectorised)
# --------------------------------------------------------------------------------------------


def ranges_to_indices(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(start, stop)`` for all ranges without a Python loop."""
    lens = stops - starts
    offs = np.zeros(len(lens), dtype=np.int64)
    np.cumsum(lens[:-1], out=offs[1:])
    return np.repeat(starts - offs, lens) + np.arange(int(lens.sum()), dtype=np.int64)


def split_by_fragment(
    starts: np.ndarray, stops: np.ndarray, bounds: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split global ranges at fragment boundaries.

    ``bounds`` is ``[0, n0, n0 + n1, ...]`` (cumulative fragment row counts).  Returns
    ``(fragment_position, local_start, local_stop)`` per piece, in global row order.
    """
    first = np.searchsorted(bounds, starts, side="right") - 1
    last = np.searchsorted(bounds, stops - 1, side="right") - 1
    n_pieces = last - first + 1
    rep_first = np.repeat(first, n_pieces)
    piece_offs = np.zeros(len(n_pieces), dtype=np.int64)
    np.cumsum(n_pieces[:-1], out=piece_offs[1:])
    frag = rep_first + np.arange(int(n_pieces.sum())) - np.repeat(piece_offs, n_pieces)
    g_start = np.maximum(np.repeat(starts, n_pieces), bounds[frag])
    g_stop = np.minimum(np.repeat(stops, n_pieces), bounds[frag + 1])
    return frag, g_start - bounds[frag], g_stop - bounds[frag]


def n_ranges_used(ref: Reference, block_cells: int, n_ranges: int) -> int:
    """At most half of all blocks are picked, so a request stays scattered."""
    return min(n_ranges, max(1, ref.n_cells // block_cells // 2))


def random_blocks(ref: Reference, block_cells: int, n_ranges: int, rng) -> np.ndarray:
    """``n_ranges`` distinct cell-aligned blocks of ``block_cells`` cells, sorted by offset."""
    n_blocks = ref.n_cells // block_cells
    b = np.sort(rng.choice(n_blocks, n_ranges_used(ref, block_cells, n_ranges), replace=False))
    return np.stack([ref.indptr[b * block_cells], ref.indptr[(b + 1) * block_cells]], axis=1)


def large_ranges(ref: Reference, size: int, count: int, rng) -> np.ndarray:
    """``count`` cell-aligned ranges of ~``size`` rows at random positions."""
    size = min(size, ref.n_rows)
    hi = int(np.searchsorted(ref.indptr, ref.n_rows - size, side="right"))
    c0 = rng.integers(0, max(hi, 1), count)
    starts = ref.indptr[c0]
    end_cells = np.searchsorted(ref.indptr, starts + size, side="left")
    stops = ref.indptr[np.minimum(end_cells, ref.n_cells)]
    return np.stack([starts, stops], axis=1)


# --------------------------------------------------------------------------------------------
# read methods: (ctx, ranges[k, 2]) -> list of RecordBatch / Table pieces, in row order
# --------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    ds: lance.LanceDataset
    fragments: list
    bounds: np.ndarray
    cols: list[str] = field(default_factory=lambda: list(COLS))

    @classmethod
    def open(cls, uri: str, version: int | None = None) -> Ctx:
        ds = lance.dataset(uri, version=version)
        frags = ds.get_fragments()
        counts = np.array([f.count_rows() for f in frags], dtype=np.int64)
        bounds = np.zeros(len(frags) + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
        return cls(ds, frags, bounds)


Method = Callable[[Ctx, np.ndarray], list]


def per_range_scanner(to_table: bool, batch_size: int | str | None = None, **opts) -> Method:
    """``ds.scanner(offset=start, limit=n, ...)`` once per range."""

    def run(ctx: Ctx, ranges: np.ndarray) -> list:
        out: list = []
        for s, e in ranges.tolist():
            bs = e - s if batch_size == "len" else batch_size
            sc = ctx.ds.scanner(columns=ctx.cols, offset=s, limit=e - s, batch_size=bs, **opts)
            if to_table:
                out.append(sc.to_table())
            else:
                out.extend(sc.to_batches())
        return out

    return run


def m_slice(ctx: Ctx, ranges: np.ndarray) -> list:
    return [ctx.ds.slice(s, e, columns=ctx.cols) for s, e in ranges.tolist()]


def take_scan(batch_readahead: int = 10) -> Method:
    """Private ``ds._ds.take_scan([(start, stop), ...])``: one batch per range, request order."""

    def run(ctx: Ctx, ranges: np.ndarray) -> list:
        reader = ctx.ds._ds.take_scan(
            [tuple(r) for r in ranges.tolist()], columns=ctx.cols, batch_readahead=batch_readahead
        )
        return list(reader)

    return run


def m_take_arange(ctx: Ctx, ranges: np.ndarray) -> list:
    return [ctx.ds.take(ranges_to_indices(ranges[:, 0], ranges[:, 1]), columns=ctx.cols)]


def m_fragment_take(ctx: Ctx, ranges: np.ndarray) -> list:
    idx = ranges_to_indices(ranges[:, 0], ranges[:, 1])
    frag = np.searchsorted(ctx.bounds, idx, side="right") - 1
    cuts = np.flatnonzero(np.diff(frag)) + 1
    out = []
    for piece in np.split(np.arange(len(idx)), cuts):
        f = int(frag[piece[0]])
        out.append(ctx.fragments[f].take(idx[piece] - ctx.bounds[f], columns=ctx.cols))
    return out


def per_piece_fragment(to_table: bool, batch_size: int | str | None = None) -> Method:
    """``LanceFragment.to_table/to_batches(offset=, limit=)`` per piece after splitting."""

    def run(ctx: Ctx, ranges: np.ndarray) -> list:
        frag, ls, le = split_by_fragment(ranges[:, 0], ranges[:, 1], ctx.bounds)
        out: list = []
        for f, s, e in zip(frag.tolist(), ls.tolist(), le.tolist(), strict=True):
            fr = ctx.fragments[f]
            if to_table:
                out.append(fr.to_table(columns=ctx.cols, offset=s, limit=e - s))
            else:
                bs = e - s if batch_size == "len" else batch_size
                out.extend(fr.to_batches(columns=ctx.cols, offset=s, limit=e - s, batch_size=bs))
        return out

    return run


def m_allowlist(ctx: Ctx, ranges: np.ndarray) -> list:
    """``scanner(row_addr_allowlist=serialize_row_addrs(...))`` incl. serialisation cost."""
    frag, ls, le = split_by_fragment(ranges[:, 0], ranges[:, 1], ctx.bounds)
    ids = np.array([f.fragment_id for f in ctx.fragments], dtype=np.uint64)
    local = ranges_to_indices(ls, le).astype(np.uint64)
    addrs = (np.repeat(ids[frag], le - ls) << np.uint64(32)) | local
    blob = serialize_row_addrs(addrs.tolist())
    return [ctx.ds.scanner(columns=ctx.cols, row_addr_allowlist=blob).to_table()]


def coalesced_scanner(max_gap: int) -> Method:
    """Merge ranges whose gap is <= ``max_gap`` rows, read each merged span with one
    ``scanner(offset, limit, batch_size=min(span, 1Mi)).to_table()`` and cut the wanted ranges
    out with zero-copy ``Table.slice`` (over-reads the gaps)."""

    def run(ctx: Ctx, ranges: np.ndarray) -> list:
        starts, stops = ranges[:, 0], ranges[:, 1]
        new_group = np.ones(len(starts), dtype=bool)
        new_group[1:] = starts[1:] - stops[:-1] > max_gap
        gid = np.cumsum(new_group) - 1
        g_start = starts[new_group]
        g_stop = np.maximum.reduceat(stops, np.flatnonzero(new_group))
        tables = [
            ctx.ds.scanner(
                columns=ctx.cols, offset=s, limit=e - s, batch_size=min(e - s, MIB)
            ).to_table()
            for s, e in zip(g_start.tolist(), g_stop.tolist(), strict=True)
        ]
        rel = (starts - g_start[gid]).tolist()
        lens = (stops - starts).tolist()
        return [tables[g].slice(o, n) for g, o, n in zip(gid.tolist(), rel, lens, strict=True)]

    return run


BS1M = MIB
METHODS_A: dict[str, Method] = {
    "scanner.to_batches()": per_range_scanner(False),
    "scanner.to_batches(batch_size=64Ki)": per_range_scanner(False, 1 << 16),
    "scanner.to_batches(batch_size=1Mi)": per_range_scanner(False, BS1M),
    "scanner.to_batches(batch_size=1Mi,batch_readahead=4)": per_range_scanner(
        False, BS1M, batch_readahead=4
    ),
    "scanner.to_batches(batch_size=1Mi,io_buffer_size=256MiB)": per_range_scanner(
        False, BS1M, io_buffer_size=256 * MIB
    ),
    "scanner.to_batches(batch_size=1Mi,scan_in_order=False)": per_range_scanner(
        False, BS1M, scan_in_order=False
    ),
    "scanner.to_batches(batch_size=len)": per_range_scanner(False, "len"),
    "scanner.to_table()": per_range_scanner(True),
    "scanner.to_table(batch_size=1Mi)": per_range_scanner(True, BS1M),
    "scanner.to_table(batch_size=len)": per_range_scanner(True, "len"),
    "ds.slice(start,stop)": m_slice,
    "fragment.to_batches(batch_size=1Mi)": per_piece_fragment(False, BS1M),
    "fragment.to_table()": per_piece_fragment(True),
    "_ds.take_scan(ranges)": take_scan(),
    "ds.take(np.arange)": m_take_arange,
}

METHODS_B: dict[str, Method] = {
    "_ds.take_scan(ranges)": take_scan(),
    "_ds.take_scan(ranges,batch_readahead=32)": take_scan(32),
    "scanner.to_table() per range": per_range_scanner(True),
    "scanner.to_table(batch_size=len) per range": per_range_scanner(True, "len"),
    "scanner.to_batches(batch_size=len) per range": per_range_scanner(False, "len"),
    "fragment.to_table() per piece": per_piece_fragment(True),
    "fragment.to_batches(batch_size=len) per piece": per_piece_fragment(False, "len"),
    "ds.take(concat aranges)": m_take_arange,
    "fragment.take(local idx) per fragment": m_fragment_take,
    "scanner(row_addr_allowlist) incl. serialize": m_allowlist,
    "coalesce(adjacent)+scanner.to_table+slice": coalesced_scanner(0),
    "coalesce(gap<=64Ki rows)+scanner.to_table+slice": coalesced_scanner(1 << 16),
    "coalesce(gap<=256Ki rows)+scanner.to_table+slice": coalesced_scanner(1 << 18),
    "coalesce(gap<=1Mi rows)+scanner.to_table+slice": coalesced_scanner(MIB),
}

METHODS_C = [
    "_ds.take_scan(ranges)",
    "coalesce(gap<=64Ki rows)+scanner.to_table+slice",
    "scanner.to_batches(batch_size=len) per range",
    "fragment.to_batches(batch_size=len) per piece",
]


# --------------------------------------------------------------------------------------------
# timing / verification
# --------------------------------------------------------------------------------------------


def as_table(pieces: list) -> pa.Table:
    tables = [p if isinstance(p, pa.Table) else pa.Table.from_batches([p]) for p in pieces]
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def verify(pieces: list, ref: Reference, ranges: np.ndarray) -> bool:
    tbl = as_table(pieces)
    idx = ranges_to_indices(ranges[:, 0], ranges[:, 1])
    if tbl.num_rows != len(idx) or tbl.column_names != COLS:
        return False
    for name, arr in zip(COLS, (ref.cells, ref.genes, ref.values), strict=True):
        col = tbl.column(name)
        if col.type != SCHEMA.field(name).type or col.null_count:
            return False
        if not np.array_equal(col.to_numpy(), arr[idx]):
            return False
    return True


def batch_sizes(pieces: list) -> dict:
    sizes = [p.num_rows for p in pieces]
    chunks = [p.column(0).num_chunks if isinstance(p, pa.Table) else 1 for p in pieces]
    return {
        "n_pieces": len(sizes),
        "rows_min": min(sizes, default=0),
        "rows_max": max(sizes, default=0),
        "arrow_chunks": int(sum(chunks)),
    }


def timed(fn: Callable[[], object], repeats: int) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def bench_method(
    ctx: Ctx, method: Method, ranges: np.ndarray, ref: Reference, repeats: int
) -> dict:
    n = int((ranges[:, 1] - ranges[:, 0]).sum())
    try:
        times, pieces = timed(lambda: method(ctx, ranges), repeats)
    except Exception as exc:  # report unsupported paths instead of aborting the run
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    med = statistics.median(times)
    return {
        "rows": n,
        "median_s": med,
        "times_s": times,
        "rows_per_s": n / med,
        "correct": verify(pieces, ref, ranges),
        **batch_sizes(pieces),
    }


# --------------------------------------------------------------------------------------------
# cases
# --------------------------------------------------------------------------------------------


def bench_floor(ctx: Ctx, repeats: int) -> dict:
    ds, n = ctx.ds, ctx.bounds[-1]
    runs = {
        "ds.to_batches(columns)": lambda: sum(b.num_rows for b in ds.to_batches(columns=COLS)),
        "ds.to_batches(columns,batch_size=1Mi)": lambda: sum(
            b.num_rows for b in ds.to_batches(columns=COLS, batch_size=BS1M)
        ),
        "ds.to_table(columns)": lambda: ds.to_table(columns=COLS).num_rows,
        "ds.to_table(columns,batch_size=1Mi)": lambda: (
            ds.to_table(columns=COLS, batch_size=BS1M).num_rows
        ),
    }
    out = {}
    for name, fn in runs.items():
        times, got = timed(fn, repeats)
        med = statistics.median(times)
        out[name] = {"rows": int(n), "median_s": med, "rows_per_s": n / med, "correct": got == n}
    return out


def bench_case_a(ctx: Ctx, ref: Reference, sizes: list[int], repeats: int, rng) -> dict:
    out = {}
    for size in sizes:
        rngs = large_ranges(ref, size, 3, rng)
        key = f"{int((rngs[:, 1] - rngs[:, 0]).mean()):,}_rows_x3"
        out[key] = {}
        for name, m in METHODS_A.items():
            # each timed run reads the 3 ranges one after another
            out[key][name] = bench_method(ctx, m, rngs, ref, repeats)
            log(f"    (a) {key:>18} {name:<58} {fmt_rate(out[key][name])}")
    return out


def bench_case_b(
    ctx: Ctx, ref: Reference, block_cells: list[int], n_ranges: list[int], repeats: int, rng
) -> dict:
    out = {}
    for nr, bc in ((nr, bc) for nr in n_ranges for bc in block_cells):
        rngs = random_blocks(ref, bc, nr, rng)
        key = f"{len(rngs)}x{bc}cells"
        out[key] = {"mean_rows_per_range": float((rngs[:, 1] - rngs[:, 0]).mean())}
        for name, m in METHODS_B.items():
            out[key][name] = bench_method(ctx, m, rngs, ref, repeats)
            log(f"    (b) {key:>18} {name:<58} {fmt_rate(out[key][name])}")
    return out


def bench_call_latency(ctx: Ctx, ref: Reference, n_calls: int, rng) -> dict:
    """Fixed cost per call: read a single cell (~800 rows) ``n_calls`` times."""
    cells = rng.integers(0, ref.n_cells, n_calls)
    rngs = np.stack([ref.indptr[cells], ref.indptr[cells + 1]], axis=1)
    paths = {
        "scanner(offset,limit).to_table()": lambda r: ctx.ds.scanner(
            columns=COLS, offset=r[0], limit=r[1] - r[0]
        ).to_table(),
        "fragment.to_table(offset,limit)": lambda r: per_piece_fragment(True)(ctx, r[None, :]),
        "_ds.take_scan([range])": lambda r: list(
            ctx.ds._ds.take_scan([(int(r[0]), int(r[1]))], columns=COLS)
        ),
        "ds.take(arange)": lambda r: ctx.ds.take(np.arange(r[0], r[1]), columns=COLS),
    }
    out = {}
    for name, fn in paths.items():
        t0 = time.perf_counter()
        for r in rngs:
            fn(r)
        out[name] = {"us_per_call": (time.perf_counter() - t0) / n_calls * 1e6}
    return out


def bench_case_c(
    uri: str,
    ref: Reference,
    threads: list[int],
    block_cells: list[int],
    n_ranges: int,
    reqs_per_thread: int,
    repeats: int,
    rng,
) -> dict:
    """Each of ``n`` threads runs ``reqs_per_thread`` case-(b) requests; aggregate rows/s."""
    shared = Ctx.open(uri)
    local = threading.local()

    def own_ctx() -> Ctx:
        if not hasattr(local, "ctx"):
            local.ctx = Ctx.open(uri)
        return local.ctx

    out: dict = {}
    for bc in block_cells:
        key = f"{n_ranges_used(ref, bc, n_ranges)}x{bc}cells_per_request"
        out[key] = {name: {} for name in METHODS_C}
        for n_threads in threads:
            reqs = [
                random_blocks(ref, bc, n_ranges, rng) for _ in range(n_threads * reqs_per_thread)
            ]
            n_rows = int(sum((r[:, 1] - r[:, 0]).sum() for r in reqs))
            for name in METHODS_C:
                for mode in ("shared_ds", "per_thread_ds"):

                    def job(r, mode=mode, method=METHODS_B[name]):
                        ctx = shared if mode == "shared_ds" else own_ctx()
                        return method(ctx, r)

                    with ThreadPoolExecutor(n_threads) as pool:
                        list(pool.map(job, reqs))  # untimed warm-up (opens per-thread datasets)
                        times, results = timed(
                            lambda pool=pool, job=job, reqs=reqs: list(pool.map(job, reqs)),
                            repeats,
                        )
                    med = statistics.median(times)
                    ok = all(verify(p, ref, r) for p, r in zip(results, reqs, strict=True))
                    res = {
                        "rows": n_rows,
                        "median_s": med,
                        "rows_per_s": n_rows / med,
                        "correct": ok,
                    }
                    out[key][name][f"{n_threads}_threads/{mode}"] = res
                    log(f"    (c) {key} {n_threads}t {mode:<13} {name:<50} {fmt_rate(res)}")
    return out


def thread_stress(uri: str, ref: Reference, n_threads: int, iters: int, seed: int) -> dict:
    """Hammer one shared LanceDataset from several threads with all (b) methods; verify."""
    ctx = Ctx.open(uri)
    names = list(METHODS_B)
    errors: list[str] = []

    def worker(i: int) -> int:
        rng = np.random.default_rng(seed + i)
        bad = 0
        for k in range(iters):
            r = random_blocks(ref, 8, 16, rng)
            try:
                if not verify(METHODS_B[names[(i + k) % len(names)]](ctx, r), ref, r):
                    bad += 1
                ctx.ds.checkout_version(ctx.ds.version)  # copy-on-checkout, must not disturb
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
        return bad

    with ThreadPoolExecutor(n_threads) as pool:
        bad = sum(pool.map(worker, range(n_threads)))
    return {"threads": n_threads, "calls": n_threads * iters, "wrong": bad, "errors": errors[:5]}


def bench_versions(uri: str, n_open: int) -> dict:
    """Open costs and pinning behaviour; appends one small fragment (creates a new version)."""

    def med_us(fn: Callable[[], object]) -> float:
        return statistics.median(timed(fn, n_open)[0]) * 1e6

    ds = lance.dataset(uri)
    v1, n1 = ds.version, ds.count_rows()
    out = {
        "open_latest_us": med_us(lambda: lance.dataset(uri)),
        "open_version_us": med_us(lambda: lance.dataset(uri, version=v1)),
        "open_shared_session_us": med_us(lambda: lance.dataset(uri, session=ds.session())),
        "checkout_version_same_us": med_us(lambda: ds.checkout_version(v1)),
        "ds.version_us": med_us(lambda: ds.version),
        "ds.latest_version_us": med_us(lambda: ds.latest_version),
        "get_fragments+count_rows_us": med_us(lambda: [f.count_rows() for f in ds.get_fragments()]),
    }
    extra = ref_extra_rows()
    lance.write_dataset(extra, uri, mode="append")
    pinned = lance.dataset(uri, version=v1)
    out["after_append"] = {
        "old_object.version": ds.version,
        "old_object.latest_version": ds.latest_version,
        "old_object.count_rows": ds.count_rows(),
        "pinned(version=v1).count_rows": pinned.count_rows(),
        "lance.dataset(uri).version": lance.dataset(uri).version,
        "checkout_version(v1+1).count_rows": ds.checkout_version(v1 + 1).count_rows(),
        "old_object.version_after_checkout_version": ds.version,
        "rows_v1": n1,
    }
    out["checkout_version_other_us"] = med_us(lambda: ds.checkout_version(v1 + 1))
    ds.checkout_latest()  # NB: mutates ds in place (unlike checkout_version, which copies)
    out["after_append"]["old_object.version_after_checkout_latest"] = ds.version
    return out


def ref_extra_rows() -> pa.Table:
    n = 1000
    return pa.table(
        [
            pa.array(np.full(n, 2**31, dtype=np.uint32)),
            pa.array(np.arange(n, dtype=np.uint16)),
            pa.array(np.ones(n, dtype=np.uint16)),
        ],
        schema=SCHEMA,
    )


def bench_conversions(ctx: Ctx, ref: Reference, size: int, repeats: int) -> dict:
    """pyarrow -> numpy / polars costs on a many-chunk table and a single-batch result."""
    size = min(size, ref.n_rows)
    many = ctx.ds.scanner(columns=COLS, offset=0, limit=size).to_table()
    one = pa.Table.from_batches(list(ctx.ds._ds.take_scan([(0, size)], columns=COLS)))
    out: dict = {"rows": size}

    def med_ms(fn: Callable[[], object]) -> float | str:
        try:
            return statistics.median(timed(fn, repeats)[0]) * 1e3
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"[:160]

    for label, tbl in (("default_batches_table", many), ("single_batch_table", one)):
        col = tbl.column("gene_integer_id")
        res = {
            "num_chunks": col.num_chunks,
            "validity_buffer_present": col.chunk(0).buffers()[0] is not None,
            "combine_chunks_ms": med_ms(tbl.combine_chunks),
            "chunked.to_numpy()_all_cols_ms": med_ms(
                lambda tbl=tbl: [tbl.column(c).to_numpy() for c in COLS]
            ),
            "chunk0.to_numpy(zero_copy_only=True)": med_ms(
                lambda col=col: col.chunk(0).to_numpy(zero_copy_only=True)
            ),
            "combine_chunks+zero_copy_all_cols_ms": med_ms(
                lambda tbl=tbl: [
                    c.chunk(0).to_numpy(zero_copy_only=True) for c in tbl.combine_chunks().columns
                ]
            ),
        }
        if pl is not None:
            res["pl.from_arrow_ms"] = med_ms(lambda tbl=tbl: pl.from_arrow(tbl))
            res["pl.from_arrow(rechunk=False)_ms"] = med_ms(
                lambda tbl=tbl: pl.from_arrow(tbl, rechunk=False)
            )
            res["polars_dtypes"] = [str(d) for d in pl.from_arrow(tbl).dtypes]
        res["numpy_dtypes"] = [str(tbl.column(c).to_numpy().dtype) for c in COLS]
        out[label] = res
    return out


# --------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------


def fmt_rate(res: dict) -> str:
    if "error" in res:
        return "ERROR " + res["error"][:60]
    flag = "" if res.get("correct", True) else "  WRONG"
    return f"{res['rows_per_s'] / 1e6:8.1f} Mrows/s{flag}"


def print_table(results: dict) -> None:
    for ds_name, r in results["datasets"].items():
        print(f"\n=== {ds_name}: {r['n_fragments']} fragment(s), {r['rows']:,} rows")
        for name, res in r["floor"].items():
            print(f"  floor  {name:<62} {fmt_rate(res)}")
        for section in ("case_a", "case_b"):
            for key, methods in r[section].items():
                ranked = sorted(
                    ((n, m) for n, m in methods.items() if isinstance(m, dict)),
                    key=lambda kv: -kv[1].get("rows_per_s", 0),
                )
                print(f"  {section} {key}")
                for n, m in ranked:
                    extra = f"  pieces={m['n_pieces']}" if "n_pieces" in m else ""
                    print(f"    {n:<62} {fmt_rate(m)}{extra}")
        print("  per-call latency (1 cell):")
        for n, m in r["call_latency"].items():
            print(f"    {n:<62} {m['us_per_call']:8.0f} us")
        for key, methods in r["case_c"].items():
            print(f"  case_c {key} (aggregate rows/s over all threads)")
            for n, modes in methods.items():
                for mode, m in modes.items():
                    print(f"    {n:<50} {mode:<26} {fmt_rate(m)}")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=20_000_000, help="approximate total rows")
    p.add_argument("--rows-per-cell", type=int, default=800)
    p.add_argument("--fragments", default="1,20", help="comma list of fragment counts")
    p.add_argument("--out", default="benchmarks/results/read_paths.json")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--large-sizes", default="1000000,4000000,8000000")
    p.add_argument("--block-cells", default="16,64")
    p.add_argument("--n-ranges", type=int, default=256, help="ranges per case (b)/(c) request")
    p.add_argument(
        "--sparse-n-ranges",
        default="32",
        help="extra, sparser case (b) requests (ranges per request); '' to skip",
    )
    p.add_argument("--threads", default="1,2,4")
    p.add_argument("--reqs-per-thread", type=int, default=2)
    p.add_argument("--workdir", default=None, help="parent dir for the temporary datasets")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    caught: list[warnings.WarningMessage] = []
    results: dict = {
        "env": {
            "lance": lance.__version__,
            "pyarrow": pa.__version__,
            "polars": pl.__version__ if pl is not None else None,
            "numpy": np.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "LANCE_CPU_THREADS": os.environ.get("LANCE_CPU_THREADS"),
            "LANCE_IO_THREADS": os.environ.get("LANCE_IO_THREADS"),
        },
        "args": vars(args),
        "datasets": {},
    }
    log(f"generating ~{args.rows:,} rows")
    ref = make_reference(args.rows, args.rows_per_cell, args.seed)
    tmp = tempfile.mkdtemp(prefix="read_paths_", dir=args.workdir)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for n_frag in ints(args.fragments):
                uri = str(Path(tmp) / f"expression_f{n_frag}.lance")
                wt = write_dataset(ref, uri, n_frag, block_rows=1 << 20)
                ctx = Ctx.open(uri)
                for _ in ctx.ds.to_batches(columns=COLS):  # warm the page cache
                    pass
                name = f"fragments={len(ctx.fragments)}"
                log(f"== {name} ({ref.n_rows:,} rows, written in {wt:.2f}s)")
                r: dict = {
                    "uri_basename": Path(uri).name,
                    "rows": ref.n_rows,
                    "n_cells": ref.n_cells,
                    "n_fragments": len(ctx.fragments),
                    "data_storage_version": ctx.ds.data_storage_version,
                    "write_s": wt,
                    "size_bytes": sum(f.stat().st_size for f in Path(uri).rglob("*")),
                }
                r["floor"] = bench_floor(ctx, args.repeats)
                r["case_a"] = bench_case_a(ctx, ref, ints(args.large_sizes), args.repeats, rng)
                r["case_b"] = bench_case_b(
                    ctx,
                    ref,
                    ints(args.block_cells),
                    [args.n_ranges, *ints(args.sparse_n_ranges)],
                    args.repeats,
                    rng,
                )
                r["call_latency"] = bench_call_latency(ctx, ref, 200, rng)
                r["case_c"] = bench_case_c(
                    uri,
                    ref,
                    ints(args.threads),
                    ints(args.block_cells),
                    args.n_ranges,
                    args.reqs_per_thread,
                    args.repeats,
                    rng,
                )
                r["thread_stress"] = thread_stress(uri, ref, 4, 30, args.seed)
                r["conversions"] = bench_conversions(ctx, ref, 4_000_000, args.repeats)
                r["versions"] = bench_versions(uri, 20)  # last: appends a version
                results["datasets"][name] = r
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["python_warnings"] = sorted(
        {f"{w.category.__name__}: {w.message} ({Path(w.filename).name})" for w in caught}
    )
    print_table(results)
    if results["python_warnings"]:
        print("\nPython warnings:", *results["python_warnings"], sep="\n  ")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
