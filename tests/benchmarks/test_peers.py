"""The peers benchmark (benchmarks/peers.py): its report's shape on a tiny atlas, and its ratios.

Speed is never asserted: the end-to-end run only checks that every contender either ran in its
own process and reported every figure, or was skipped with a reason.
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import load_script

peers = load_script("benchmarks/peers.py")

FIGURES = {
    "cells_per_s", "cpu_us_per_cell", "peak_rss_mb", "peak_above_torch_mb", "first_batch_s",
    "plate_entropy", "rss_after_torch_mb", "rss_after_imports_mb", "import_s",
}  # fmt: skip
# every peer; one slafload contender is enough for the report's shape (each is a process)
ONLY = ("slafload-raw", "scdataset", "slafdb", "annbatch")


@pytest.mark.slow
def test_the_benchmark_runs_every_contender_or_skips_it_with_a_reason(tmp_path):
    pytest.importorskip("anndata")  # the shared input is an .h5ad
    out = tmp_path / "peers.json"
    report = peers.main([
        "--cells", "400", "--genes", "200", "--plates", "4", "--nnz", "20", "--rounds", "1",
        "--warm-cells", "64", "--min-cells", "256", "--data", str(tmp_path / "data"),
        "--out", str(out), "--only", ",".join(ONLY), "--no-warm-up",
        "--variant", 'small=slafload-raw:{"tuning": {"queue_depth": 2}, "env": {"MALLOC_ARENA_MAX": "2"}}',
        "--variant", 'bad=slafload-raw:{"tuning": {"no_such_field": 1}}',
    ])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert out.with_suffix(".png").exists()
    # a variant's settings reach its child: the unknown Tuning field fails there, as a row
    assert "no_such_field" in report["results"].pop("bad")["errors"][0]
    assert report["variants"]["small"]["contender"] == "slafload-raw"
    ran, skipped = set(report["results"]), set(report["skipped"])
    assert ran | skipped == {*ONLY, "small"} and not ran & skipped
    assert {"slafload-raw", "small"} <= ran  # slafload is never skipped
    assert all(isinstance(why, str) and why for why in report["skipped"].values())
    for name, row in report["results"].items():
        assert "errors" not in row, (name, row)
        assert set(row) >= FIGURES and row["runs"] == 1
        assert 0 <= row["plate_entropy"] <= math.log2(4)
        assert row["peak_rss_mb"] >= row["peak_above_torch_mb"] > 0
    assert 0 < report["random_entropy"] <= math.log2(4)
    for peer in ran - {"slafload-raw"}:
        ratio = report["ratios"][f"slafload-raw / {peer}"]
        assert set(ratio) == {"cells_per_s", "peak_above_torch_mb", "first_batch_s"}


def test_ratios_are_medians_of_same_round_ratios_and_failed_runs_are_kept():
    def run(rate, rss=100.0, first=1.0):
        return {"cells_per_s": rate, "peak_above_torch_mb": rss, "first_batch_s": first}

    runs = {
        "slafload-raw": [run(200), run(100), run(300)],
        "scdataset": [run(100), run(100), {"error": "exit 1: boom"}],
    }
    results, ratios = peers.summarise(runs)
    assert results["scdataset"]["runs"] == 2 and results["scdataset"]["errors"] == ["exit 1: boom"]
    assert results["slafload-raw"]["cells_per_s"] == 200
    # rounds 1 and 2 pair up (2.0 and 1.0); round 3 has no peer figure
    assert ratios["slafload-raw / scdataset"]["cells_per_s"] == 1.5
    assert "slafload-geneformer / scdataset" not in ratios


def test_a_peer_that_its_interpreter_cannot_import_is_skipped_with_the_reason(tmp_path):
    import sys

    assert peers._peer_error("json", sys.executable) is None
    assert "No module named" in peers._peer_error("no_such_peer_module", sys.executable)
    assert "cannot run" in peers._peer_error("json", str(tmp_path / "no-python"))


def test_the_pre_shuffled_store_labels_each_cell_with_its_own_plate(tmp_path):
    pytest.importorskip("anndata")
    import argparse

    import lance
    import numpy as np

    from slafload.tools.optimize import file_format

    args = argparse.Namespace(cells=300, genes=50, plates=5, nnz=10)
    data = tmp_path / "data"
    h5ad = peers.make_h5ad(args, data)
    paths, _, skipped = peers.convert_all(h5ad, data, ["slafload-shuffled"], {})
    store = peers.SLAFLOAD_RUNS["slafload-shuffled"][1]
    assert not skipped and set(paths) == {store}
    # written by convert, then rewritten in Lance 2.0 by optimize (the older version deleted)
    expression = lance.dataset(f"{paths[store]}/expression.lance")
    assert file_format(expression) == "2.0" and len(expression.versions()) == 1
    labels = np.load(peers._plates_of(paths[store], data))
    cells = lance.dataset(f"{paths[store]}/cells.lance").to_table().to_pandas()
    assert not (cells["original_index"].to_numpy() == np.arange(300)).all()  # shuffled
    # plates.npy codes the plates in sorted order; the store keeps each cell's own plate
    plate = cells["plate"].astype(str).to_numpy()
    codes = np.searchsorted(np.unique(plate), plate)
    assert (labels[cells["cell_integer_id"].to_numpy()] == codes).all()
