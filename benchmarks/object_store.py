"""Object storage at scale: the atlas served by moto's S3 server through a latency-adding proxy.

The parent starts ``moto.server.ThreadedMotoServer`` on loopback, uploads the atlas once
(progress bar; moto keeps objects in memory), and starts one ``benchmarks/delay_proxy.py``
process per delay (each request held ``--delay-ms`` before it is forwarded: a cloud bucket's
time to first byte; ``0`` is the no-delay baseline). Then, round by round so contenders are
interleaved, each contender runs in its own fresh process (``--child``) that opens the dataset
by ``s3://`` URI through a proxy and reports

* ``first_batch_s``: from ``open_dataset`` (config, manifests, ``cell_start_index``) to the
  first batch in hand (imports done before, as in a training script);
* ``cells_per_s``: steady state after a warm-up of one fetch's worth of cells, over at least
  ``--min-cells`` cells or ``--seconds`` seconds, whichever ends first;
* ``peak_rss_mb`` and the child's CPU seconds;

and the parent adds, per contender, the requests and response bytes the proxy forwarded and
the CPU seconds the S3 server (this process) and the proxy spent: on 2 shared cores the
server's CPU competes with the loader's, so a contender can be limited by the server, not by
latency. Also one local run of each sampler (same atlas, page cache warm) as a reference.

    python benchmarks/object_store.py --atlas /tmp/atlas500k.slaf --rounds 3

Writes ``benchmarks/results/object_store.json`` and ``.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from scale import fetch_cells, make_loader, progress  # noqa: E402

from slafload.tools.bench import machine, save_report  # noqa: E402

KEYS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
REGION = "us-east-1"
BUCKET = "atlas-bucket"
# (label, LoaderConfig settings, extra environment); the first is the default configuration.
OPTION_SETS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "default": ({}, {}),
    "threads=1": ({"read_threads": 1}, {}),
    "threads=32": ({"read_threads": 32}, {}),
    "budget=512MiB": ({"memory_budget": 512 << 20}, {}),
    "read_ahead=2": ({"read_ahead": 2, "memory_budget": 512 << 20}, {}),
    "io_threads=16": ({}, {"LANCE_IO_THREADS": "16"}),
    "take_scan": ({"read_data_files": False}, {}),
    "direct": ({"read_data_files": True}, {}),  # kept-open file readers, whatever the format
    "read_ahead=4": ({"read_ahead": 4, "memory_budget": 1 << 30}, {}),
}

CHILD_ONLY = {"child", "uri", "spec", "settings", "storage_options"}


def child(args: argparse.Namespace) -> dict[str, Any]:
    from slafload import open_dataset

    options = json.loads(args.storage_options) or None
    t0 = time.perf_counter()
    dataset = open_dataset(args.uri, storage_options=options)
    opened = time.perf_counter() - t0
    loader = make_loader(dataset, args, json.loads(args.settings))
    it = iter(loader)
    got = len(next(it)["input_ids"])
    first = time.perf_counter() - t0
    per_fetch = fetch_cells(args.spec, args.batch_size)
    while got < per_fetch:
        got += len(next(it)["input_ids"])
    cpu0, start, cells = cpu_seconds(), time.perf_counter(), 0
    while cells < args.min_cells and time.perf_counter() - start < args.seconds:
        cells += len(next(it)["input_ids"])
    elapsed = time.perf_counter() - start
    cpu = cpu_seconds() - cpu0
    loader.close()
    return {
        "open_s": opened,
        "first_batch_s": first,
        "cells_per_s": cells / elapsed,
        "cells_timed": cells,
        "seconds_timed": elapsed,
        "loader_cpu_s": cpu,
        "peak_rss_mb": peak_rss_mb(),
    }


def peak_rss_mb() -> float:
    """``VmHWM`` of this process: ``ru_maxrss`` survives ``exec`` and would report the parent's
    peak (the S3 server holds the whole atlas in memory) for every child."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_seconds(pid: int | None = None) -> float:
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Proxy:
    """A ``delay_proxy.py`` process in front of ``upstream``; stopped by :meth:`close`."""

    def __init__(self, upstream: str, delay_ms: float, lifetime: float):
        cmd = [sys.executable, str(ROOT / "benchmarks" / "delay_proxy.py"),
               "--upstream", upstream, "--delay-ms", str(delay_ms), "--lifetime", str(lifetime)]  # fmt: skip
        self.delay_ms = delay_ms
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            self.close()
            raise RuntimeError(f"delay proxy did not start: {line!r}")
        self.endpoint = "http://" + line.split()[-1]

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(self.endpoint + "/__proxy_stats", timeout=10) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def start_server():
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"{host}:{port}"


def upload(atlas: Path, endpoint: str, prefix: str) -> dict[str, Any]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION, **KEYS)
    s3.create_bucket(Bucket=BUCKET)
    files = [p for p in sorted(atlas.rglob("*")) if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    config = TransferConfig(multipart_threshold=64 << 20, max_concurrency=4)
    t = time.perf_counter()
    bar = progress(files, desc="upload", unit="file")
    for path in bar:
        key = f"{prefix}/{path.relative_to(atlas).as_posix()}"
        s3.upload_file(str(path), BUCKET, key, Config=config)
    return {"files": len(files), "bytes": total, "seconds": time.perf_counter() - t}


def run_child(uri: str, spec: str, options: dict, settings: dict, env: dict, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--uri", uri, "--spec", spec,
           "--batch-size", str(args.batch_size), "--max-genes", str(args.max_genes),
           "--seconds", str(args.seconds), "--min-cells", str(args.min_cells),
           "--settings", json.dumps(settings), "--storage-options", json.dumps(options)]  # fmt: skip
    env = {**os.environ, **env, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.child_timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"timed out ({args.child_timeout} s)"}
    if proc.returncode != 0:
        return {"error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--atlas", default="/tmp/atlas500k.slaf", help="local SLAF dataset to serve")
    p.add_argument("--delays", default="20,0", help="per-request delays (ms) to measure")
    p.add_argument("--specs", default="chunk,64x256,16x256", help="chunk or BxF samplers")
    p.add_argument("--options", default=",".join(OPTION_SETS), help="option sets (see source)")
    p.add_argument("--option-specs", default="64x256", help="samplers the option grid runs on")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repeats of every contender")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-genes", type=int, default=2048)
    p.add_argument("--min-cells", type=int, default=30_000, help="cells timed per contender...")
    p.add_argument("--seconds", type=float, default=8, help="...or this long, if shorter")
    p.add_argument("--child-timeout", type=float, default=120)
    p.add_argument("--note", default="", help="what else ran on the machine")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "object_store.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--uri", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--settings", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--storage-options", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}

    atlas = Path(args.atlas)
    if not (atlas / "config.json").exists():
        raise SystemExit(f"{atlas} is not a SLAF dataset (write one with scale.py first)")
    delays = [float(d) for d in args.delays.split(",")]
    specs = args.specs.split(",")
    contenders = [(spec, d, "default") for d in delays for spec in specs]
    contenders += [
        (spec, delays[0], o)
        for spec in args.option_specs.split(",")
        for o in args.options.split(",")
        if o != "default"
    ]
    started = time.perf_counter()
    server, upstream = start_server()
    proxies: dict[float, Proxy] = {}
    runs: list[dict[str, Any]] = []
    try:
        uploaded = upload(atlas, f"http://{upstream}", atlas.name)
        print(f"uploaded {uploaded['bytes'] / 1e9:.2f} GB in {uploaded['seconds']:.1f} s",
              file=sys.stderr)  # fmt: skip
        for d in delays:
            proxies[d] = Proxy(upstream, d, lifetime=3 * 3600)
        uri = f"s3://{BUCKET}/{atlas.name}"
        jobs = [(r, *c) for r in range(args.rounds) for c in contenders]
        jobs += [(0, spec, None, "local") for spec in specs]
        for rnd, spec, delay, label in progress(jobs, desc="contenders"):
            settings, env = OPTION_SETS.get(label, ({}, {}))
            if delay is None:
                target, options, proxy = str(atlas), {}, None
            else:
                proxy = proxies[delay]
                options = {**KEYS, "aws_region": REGION, "aws_endpoint": proxy.endpoint,
                           "allow_http": "true"}  # fmt: skip
                target = uri
            s0 = proxy.stats() if proxy else None
            c0 = cpu_seconds(), cpu_seconds(proxy.proc.pid) if proxy else 0.0
            r = run_child(target, spec, options, settings, env, args)
            c1 = cpu_seconds(), cpu_seconds(proxy.proc.pid) if proxy else 0.0
            r.update(round=rnd, spec=spec, delay_ms=delay, options=label, settings=settings,
                     env=env, load_avg=os.getloadavg()[0])  # fmt: skip
            if proxy is not None:
                s1 = proxy.stats()
                r["requests"] = s1["requests"] - s0["requests"]
                r["response_mb"] = (s1["bytes"] - s0["bytes"]) / 1e6
                r["server_cpu_s"], r["proxy_cpu_s"] = c1[0] - c0[0], c1[1] - c0[1]
            runs.append(r)
            if "error" in r:
                print(f"{spec} {delay} {label}: {r['error'][-400:]}", file=sys.stderr)
    finally:
        for proxy in proxies.values():
            proxy.close()
        server.stop()
    report = {
        "settings": {k: v for k, v in vars(args).items() if k not in CHILD_ONLY},
        "upload": uploaded,
        "wall_s": time.perf_counter() - started,
        "page_cache": "warm (the atlas is read once by the upload; moto holds it in memory)",
        "machine": machine(),
        "option_sets": {k: {"settings": v[0], "env": v[1]} for k, v in OPTION_SETS.items()},
        "runs": runs,
        "summary": summarize(runs),
    }
    out = save_report(report, args.out, print_table, plot)
    print(f"\nwrote {out} ({report['wall_s']:.0f} s in all)", file=sys.stderr)
    return report


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over rounds per (sampler, delay, option set)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if "error" not in r:
            groups.setdefault((r["spec"], r["delay_ms"], r["options"]), []).append(r)
    out = []
    for (spec, delay, label), rs in groups.items():
        cells = sum(r["cells_timed"] for r in rs)
        row = {"spec": spec, "delay_ms": delay, "options": label, "n": len(rs),
               "cells_per_s": statistics.median(r["cells_per_s"] for r in rs),
               "cells_per_s_range": [min(r["cells_per_s"] for r in rs),
                                     max(r["cells_per_s"] for r in rs)],
               "open_s": statistics.median(r["open_s"] for r in rs),
               "first_batch_s": statistics.median(r["first_batch_s"] for r in rs),
               "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
               "loader_cpu_ms_per_1k_cells": 1e6 * sum(r["loader_cpu_s"] for r in rs) / cells}  # fmt: skip
        if delay is not None:
            # whole-child totals (open and warm-up included) per cell timed: a rough ratio
            row["requests_per_1k_cells"] = 1e3 * sum(r["requests"] for r in rs) / cells
            row["server_cpu_s_per_1k_requests"] = (
                1e3 * sum(r["server_cpu_s"] for r in rs) / max(1, sum(r["requests"] for r in rs))
            )
        out.append(row)
    return out


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{'sampler':<10}{'delay':>7}  {'options':<15}{'cells/s':>9}{'range':>16}"
          f"{'open s':>8}{'1st batch s':>12}{'RSS MB':>8}{'req/1k cells':>13}{'srv s/1k req':>13}")  # fmt: skip
    for s in report["summary"]:
        lo, hi = s["cells_per_s_range"]
        delay = where(s["delay_ms"])
        print(f"{s['spec']:<10}{delay:>7}  {s['options']:<15}{s['cells_per_s']:>9,.0f}"
              f"{f'{lo:,.0f}-{hi:,.0f}':>16}{s.get('open_s', float('nan')):>8.2f}{s['first_batch_s']:>12.2f}{s.get('peak_rss_mb', float('nan')):>8,.0f}"
              f"{s.get('requests_per_1k_cells', float('nan')):>13.0f}"
              f"{s.get('server_cpu_s_per_1k_requests', float('nan')):>13.2f}")  # fmt: skip


def where(delay_ms: float | None) -> str:
    return "local" if delay_ms is None else f"{delay_ms:.0f} ms"


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = report["summary"]
    labels = [f"{r['spec']} {where(r['delay_ms'])} {r['options']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * len(rows) + 1.5), sharey=True)
    ys = range(len(rows))
    axes[0].barh(ys, [r["cells_per_s"] for r in rows],
                 xerr=[[r["cells_per_s"] - r["cells_per_s_range"][0] for r in rows],
                       [r["cells_per_s_range"][1] - r["cells_per_s"] for r in rows]])  # fmt: skip
    axes[0].axvline(5000, color="#d62728", linestyle="--", label="goal: 5,000 cells/s")
    axes[0].set_xlabel("cells/s (median, min-max)")
    axes[0].legend(loc="lower right")
    axes[1].barh(ys, [r["first_batch_s"] for r in rows])
    axes[1].set_xlabel("first batch (s, median)")
    axes[0].set_yticks(list(ys), labels)
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
