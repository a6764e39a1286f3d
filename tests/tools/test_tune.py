"""``slafload tune``: expected gaps from the paper's bounds, and a recommendation that is a
measured point, meets the target and can be recomputed from the JSON report alone."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from slafload.tools.cli import main
from slafload.tools.diversity import entropy_bounds
from slafload.tools.synthetic import write_atlas
from slafload.tools.tune import LabelLayout, expected_gap, recommend


@pytest.fixture(scope="module")
def atlas(tmp_path_factory):
    return write_atlas(
        tmp_path_factory.mktemp("tune") / "a.slaf",
        n_cells=1500, n_genes=200, n_plates=5, mean_nnz=20, n_labels=4,
    )  # fmt: skip


def run_tune(atlas, tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "tune.json"
    argv = ["tune", str(atlas), "--blocks", "1,4,16", "--factors", "2,8", "--seconds", "0.05",
            "--budget-s", "60", "--max-genes", "16", "--no-progress", "--out", str(out), *extra]  # fmt: skip
    code = main(argv)
    return code, json.loads(out.read_text())


@pytest.mark.parametrize("label", [None, "label"])
def test_the_recommendation_is_a_measured_point_within_the_target_gap(atlas, tmp_path, label):
    code, report = run_tune(atlas, tmp_path, *(["--label", label] if label else []))
    assert code == 0
    rec = report["recommendation"]
    measured = [p for p in report["points"] if p["cells_per_s"] is not None]
    chosen = [p for p in measured if (p["block_size"], p["fetch_factor"]) ==
              (rec["block_size"], rec["fetch_factor"])]  # fmt: skip
    assert len(chosen) == 1
    assert chosen[0]["expected_gap_bits"] <= 0.05
    assert rec["cells_per_s"] == max(
        p["cells_per_s"] for p in measured if p["expected_gap_bits"] <= 0.05
    )
    assert recommend(report) == rec
    assert report["inputs"]["label"]["name"] == (label or "plate")
    assert (tmp_path / "tune.png").exists()


def test_the_sparse_tokenizer_is_tuned_without_a_token_budget(atlas, tmp_path):
    # run_tune passes --max-genes, as the command's default does: sparse takes none
    code, report = run_tune(atlas, tmp_path, "--tokenizer", "sparse", "--blocks", "1",
                            "--factors", "2")  # fmt: skip
    assert code == 0
    assert [p["cells_per_s"] is not None for p in report["points"]] == [True]


def test_a_bad_dataset_path_is_a_one_line_error(tmp_path, capsys):
    assert main(["tune", str(tmp_path / "missing.slaf"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slafload tune: error:") and err.count("\n") == 1


def test_a_bad_label_is_a_one_line_error(atlas, tmp_path, capsys):
    out = str(tmp_path / "t.json")
    assert main(["tune", str(atlas), "--label", "nope", "--no-progress", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "no obs column 'nope'" in err and err.count("\n") == 1


def report(points: list[tuple[int, int, float | None]], target: float = 0.05) -> dict:
    layout = LabelLayout.contiguous(14, [1, 16, 64])
    return {
        "inputs": {"n_cells": 10**6, "batch_size": 32, "target_gap_bits": target,
                   "label": layout.to_json()},
        "points": [{"block_size": b, "fetch_factor": f, "cells_per_s": r} for b, f, r in points],
    }  # fmt: skip


def test_recommend_is_a_pure_function_of_the_report_and_can_be_retargeted():
    r = report([(1, 64, 10.0), (16, 256, 50.0), (64, 256, 90.0), (64, 1024, None)])
    assert recommend(r)["block_size"] == 16  # (64, 256) is faster but ~0.07 bits short
    assert recommend(json.loads(json.dumps(r))) == recommend(r)
    r["inputs"]["target_gap_bits"] = 0.1
    assert (recommend(r)["block_size"], recommend(r)["fetch_factor"]) == (64, 256)
    assert recommend(report([(64, 16, 90.0)])) is None


def test_with_one_fetch_per_minibatch_the_gap_is_the_papers_bound_width():
    layout = LabelLayout.contiguous(14, [4, 16])
    for b in (4, 16):
        lower, upper = entropy_bounds(np.full(14, 1 / 14), block_size=b, batch_size=32)
        gap = expected_gap(layout, n_cells=10**9, block_size=b, fetch_factor=1, batch_size=32)
        assert gap == pytest.approx(upper - lower, rel=1e-6)
        assert expected_gap(layout, n_cells=10**9, block_size=1, fetch_factor=1,
                            batch_size=32) == 0  # fmt: skip


def test_the_gap_shrinks_with_the_pool_of_blocks_as_the_docs_say():
    layout = LabelLayout.contiguous(14, [16])
    gap = expected_gap(layout, n_cells=10**9, block_size=16, fetch_factor=256, batch_size=32)
    # the rule of thumb (K-1)/(2 B ln 2) leaves out a within-pool term of relative size ~1/b
    assert gap == pytest.approx(13 / (2 * math.log(2) * 512), rel=0.1)


def test_label_layout_is_k_minus_1_for_sorted_labels_and_about_that_over_b_for_shuffled():
    sorted_codes = np.repeat(np.arange(5), 4000)
    shuffled = np.random.default_rng(0).permutation(sorted_codes)
    variance = LabelLayout.from_codes("x", sorted_codes, [1, 16]).block_variance
    assert variance == {1: pytest.approx(4.0), 16: pytest.approx(4.0)}
    mixed = LabelLayout.from_codes("x", shuffled, [16]).block_variance[16]
    assert mixed == pytest.approx(4 / 16, rel=0.15)
