"""Pieces of benchmarks/sampling_quality.py, and the labelled synthetic atlas it trains on."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import load_script

import slafload
from slafload.tools.synthetic import write_atlas

sq = load_script("benchmarks/sampling_quality.py")


def test_macro_f1_matches_a_hand_computed_case():
    y_true = np.array([0, 0, 0, 1, 1, 2])
    y_pred = np.array([0, 0, 1, 1, 2, 3])
    # class 0: TP 2, FP 0, FN 1 -> 4/5; class 1: TP 1, FP 1, FN 1 -> 1/2;
    # class 2: TP 0 -> 0; class 3 (predicted only): 0
    assert sq.macro_f1(y_true, y_pred) == pytest.approx((0.8 + 0.5) / 4)
    assert sq.macro_f1(y_true, y_true) == 1.0


def test_the_held_out_split_takes_every_tenth_run_of_cells():
    test = sq.held_out(3000, run=100, every=10)
    assert test.sum() == 300 and test[900:1000].all() and not test[:900].any()


def test_dense_adds_log1p_values_and_ignores_padding():
    batch = {"gene_ids": torch.tensor([[2, 0, -1], [1, -1, -1]]),
             "values": torch.tensor([[3.0, 1.0, 0.0], [1.0, 0.0, 0.0]])}  # fmt: skip
    x = sq.dense(batch, 4)
    expected = torch.log1p(torch.tensor([[1.0, 0, 3, 0], [0, 1, 0, 0]]))
    torch.testing.assert_close(x, expected)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    path = write_atlas(tmp_path_factory.mktemp("lab") / "a.slaf", n_cells=4000, n_genes=300,
                       n_plates=4, mean_nnz=30, n_labels=5, label_weight=0.2)  # fmt: skip
    return slafload.open_dataset(path)


def test_labels_are_stored_label_by_label_within_plates_with_plate_specific_shares(labelled):
    plates, _ = labelled.obs_codes("plate")
    labels, _ = labelled.obs_codes("label")
    pair = plates * 5 + labels
    changes = np.count_nonzero(np.diff(pair))
    assert changes == len(np.unique(pair)) - 1  # each (plate, label) group is one run
    assert (np.diff(plates) >= 0).all()
    shares = np.stack([np.bincount(labels[plates == p], minlength=5) / np.sum(plates == p)
                       for p in range(4)])  # fmt: skip
    assert (shares.std(axis=0) > 0.02).all()  # every label's share differs between plates


def test_without_labels_the_atlas_records_no_label_parameters(tmp_path):
    path = write_atlas(tmp_path / "a.slaf", n_cells=50, n_genes=20, mean_nnz=3, n_plates=2)
    params = json.loads((path / "config.json").read_text())["generator"]["params"]
    assert "n_labels" not in params
    assert "label" not in slafload.open_dataset(path).cells.schema.names


def test_a_plate_alone_does_not_predict_the_label(labelled):
    plates, _ = labelled.obs_codes("plate")
    labels, _ = labelled.obs_codes("label")
    test = sq.held_out(labelled.n_cells, run=50)
    assert sq.plate_only_f1(plates, labels, test) < 0.5
