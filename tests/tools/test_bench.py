"""Benchmark helpers: the cached synthetic atlas is reused only when it matches the request."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from conftest import load_script

from slafload.tools.bench_args import ensure_atlas


def test_a_cached_atlas_is_reused_when_it_matches_and_rewritten_when_it_does_not(tmp_path):
    args = argparse.Namespace(cells=60, genes=30, plates=3, nnz=5, data=str(tmp_path))
    path = ensure_atlas(args)
    written = (path / "config.json").stat().st_mtime_ns
    assert ensure_atlas(args) == path
    assert (path / "config.json").stat().st_mtime_ns == written  # reused, not rewritten

    (path / "config.json").write_text("{}")  # no generator record: cannot be trusted
    assert ensure_atlas(args) == path
    assert "generator" in (path / "config.json").read_text()


def test_the_layout_report_counts_what_each_layout_delivers(small_slaf):
    from slafload import open_dataset
    from slafload.tools.bench_layout import layout_report

    report = layout_report(
        open_dataset(small_slaf), ("geneformer",), batch_size=32, max_genes=8, n_batches=4,
        step_s=0.0,
    )  # fmt: skip
    assert set(report) == {f"geneformer/{lay}/{on}" for lay in ("padded", "longest", "packed")
                           for on in ("producer", "device")}  # fmt: skip
    padded, packed = report["geneformer/padded/producer"], report["geneformer/packed/producer"]
    assert padded["tokens_per_batch"] == 32 * 8  # every position of [batch, max_genes]
    assert packed["tokens_per_batch"] == packed["real_tokens_per_batch"]
    assert packed["real_tokens_per_batch"] == padded["real_tokens_per_batch"]
    assert report["geneformer/packed/device"]["tokens_per_batch"] == packed["tokens_per_batch"]
    for row in report.values():
        assert row["next_ms_p99"] >= row["next_ms_p50"] > 0
        assert set(row["producer_us_per_cell"]) == {"rank", "tokenize", "batch+layout"}


@pytest.mark.parametrize("workers", [0, 1])
def test_the_dataloader_contender_streams_through_worker_processes_and_ends_them(
    small_slaf, workers
):
    import multiprocessing

    from slafload import open_dataset
    from slafload.tools.bench_measure import Clock
    from slafload.tools.bench_runs import dataloader_run

    ds = open_dataset(small_slaf)
    args = argparse.Namespace(batch_size=16, max_genes=8, token_dtype="int64")
    target = 2 * ds.n_cells + 5  # into the third epoch
    clock = Clock()
    assert dataloader_run(ds, "geneformer", args, target, workers, clock) >= target
    assert multiprocessing.active_children() == []  # the workers were shut down
    assert target <= clock.cells < target + args.batch_size  # stopped at the target's batch


def test_the_steady_window_starts_once_the_warm_up_cells_are_in():
    from slafload.tools.bench_measure import Clock, consume

    clock = Clock(warmup=5)
    batches = iter([{"input_ids": [0] * 3} for _ in range(10)])
    assert consume(batches, clock, until=11) == 12  # stops at the batch that reaches 11
    assert clock.warm is not None and clock.warm[1] == 6  # the batch that passed 5 cells
    assert next(batches)  # the rest were not drawn
    timing = clock.timing()
    assert set(timing) == {"end_to_end", "steady", "first_batch_s"}
    assert clock.first_batch is not None and clock.start <= clock.first_batch <= clock.warm[0]


def test_the_benchmark_runs_on_a_dataset_of_ones_own_for_a_fraction_of_an_epoch(
    small_slaf, tmp_path
):
    import json

    from slafload.tools.bench import main

    out = tmp_path / "bench.json"
    main([
        "--dataset", str(small_slaf), "--epochs", "0.5", "--warmup", "0.1", "--repeats", "1",
        "--no-peers", "--no-presets", "--layouts", "packed", "--consumer-batches", "2",
        "--batch-size", "8", "--max-genes", "16", "--out", str(out),
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert report["dataset"]["path"] == str(small_slaf)
    assert report["dataset"]["n_cells"] == 300
    assert report["settings"]["cells_per_run"] == 30 + 150
    assert report["settings"]["page_cache"].startswith("warm")
    for key in ("slafload_geneformer", "slafload_scgpt_packed"):
        run = report["results"][key]
        assert run["cells_per_s"] > 0 and run["fraction_of_raw_scan"] > 0
        assert len(run["paired_raw_scan_cells_per_s"]) == 1
    assert set(report["ratios"]) >= {"geneformer_fraction_of_raw_scan",
                                     "scgpt_packed_fraction_of_raw_scan"}  # fmt: skip


def test_the_raw_scan_counts_whole_epochs_and_the_cells_of_a_remainder(small_slaf):
    from slafload import open_dataset
    from slafload.tools.bench_measure import Clock
    from slafload.tools.bench_runs import raw_floor

    ds = open_dataset(small_slaf)
    clock = Clock()
    assert raw_floor(ds, 2 * ds.n_cells + 7, clock) == 2 * ds.n_cells + 7
    assert clock.cells == 2 * ds.n_cells + 7


def test_the_scale_benchmark_reports_medians_and_rss_growth_by_atlas_size(tmp_path):
    from pathlib import Path

    import numpy as np
    from conftest import write_dense

    module = load_script("benchmarks/scale.py")
    small, large = str(tmp_path / "small.slaf"), str(tmp_path / "large.slaf")
    write_dense(Path(large), np.ones((30, 4), dtype=np.float32))  # named before the small one
    write_dense(Path(small), np.ones((10, 4), dtype=np.float32))

    def run(atlas, spec_, rss, k):
        return {"dataset": atlas, "spec": spec_, "round": k, "cells_per_s": 100.0 * (k + 1),
                "first_batch_s": 0.1, "peak_rss_mb": rss}  # fmt: skip

    runs = [run(small, "1x64", rss, k) for k, rss in enumerate([700, 650, 720])]
    runs += [run(large, "1x64", rss, k) for k, rss in enumerate([800, 770, 900])]
    runs += [run(large, "chunk", 500, 0), {"dataset": small, "spec": "chunk", "error": "x"}]
    summary = module.summarize(runs)
    medians = {(m["dataset"], m["spec"]): m for m in summary["medians"]}
    assert (
        medians[(small, "1x64")]["peak_rss_mb"] == 700 and medians[(small, "1x64")]["rounds"] == 3
    )
    assert medians[(large, "1x64")]["cells_per_s"] == 200.0
    assert summary["rss_growth"] == {"1x64": 800 / 700}  # chunk failed on the small atlas


def test_the_default_run_is_quick_and_writes_outside_the_tracked_tree():
    from slafload.tools.bench_args import QUICK, parser, wants_full

    assert not wants_full([]) and not wants_full(["--cells", "10"])
    assert wants_full(["--no-peers", "--full"])
    args = parser().parse_args([])
    assert Path(args.out).parts[0] == "slafload-bench" == Path(args.data).parts[0]
    assert QUICK["cells"] < args.cells  # --full keeps the parser's own defaults
    ignored = (Path(__file__).parents[2] / ".gitignore").read_text().splitlines()
    assert "/slafload-bench/" in ignored
