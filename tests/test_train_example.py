"""examples/train_mlm.py at tiny scale, in subprocesses: the loss falls, resume works, and
packed batches train exactly like padded ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_script

from slafload import Loader
from slafload.transforms import Vocabulary

pytestmark = pytest.mark.slow  # separate processes (torchrun, training runs)

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_mlm.py"


def tiny_args(tmp_path: Path, *extra: str, name: str = "") -> list[str]:
    return ["--tiny", "--data", str(tmp_path / "atlas.slaf"), "--checkpoint",
            str(tmp_path / f"ckpt{name}.pt"), "--metrics", str(tmp_path / f"metrics{name}.jsonl"),
            *extra]  # fmt: skip


def logged(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_training_lowers_the_loss_and_resumes_from_its_checkpoint(tmp_path, capsys):
    # The first half runs the script as a command; the resumed half runs its main() in this
    # process (saving a second interpreter start-up of torch, Lance and Polars).
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *tiny_args(tmp_path, "--steps", "12")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    first = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert first["step"] == 12
    train_mlm = load_script("examples/train_mlm.py")
    train_mlm.main(tiny_args(tmp_path, "--steps", "24", "--resume"))
    assert "resumed at step 12" in capsys.readouterr().out
    last = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert last["step"] == 24

    metrics = logged(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [4, 8, 12, 16, 20, 24]  # no step repeated or lost
    losses = [m["loss"] for m in metrics]
    assert losses[-1] < losses[0] - 0.1, losses

    # Model, optimizer, masking RNG and loader were restored together: the interrupted run's
    # losses are those of one uninterrupted run.
    train_mlm.main(tiny_args(tmp_path, "--steps", "24", name="-whole"))
    whole = [m["loss"] for m in logged(tmp_path / "metrics-whole.jsonl")]
    np.testing.assert_allclose(losses, whole, rtol=1e-5)

    # Packed batches (no padding, a block-diagonal attention mask) carry the same tokens and
    # draw the same masks: the model learns exactly what it learns from padded batches.
    train_mlm.main(tiny_args(tmp_path, "--steps", "24", "--layout", "packed", name="-packed"))
    packed = [m["loss"] for m in logged(tmp_path / "metrics-packed.jsonl")]
    np.testing.assert_allclose(packed, whole, rtol=1e-4)

    # The resumed loader continued where the first run stopped: its state equals that of one
    # loader that handed out all 24 batches without interruption.
    args = last["args"]
    with Loader(args["data"], max_genes=args["max_genes"], batch_size=args["batch_size"],
                chunk_cells=args["chunk_cells"], seed=args["seed"], n_epochs=None,
                drop_last=True) as loader:  # fmt: skip
        batches = iter(loader)
        for _ in range(24):
            next(batches)
        assert last["loader"] == loader.state_dict()
        assert first["loader"] != last["loader"]


def test_training_on_a_mixture_of_two_atlases_with_different_genes_resumes_exactly(tmp_path):
    # Two atlases whose gene lists half overlap, through their union as one vocabulary; the
    # interrupted run's losses are the uninterrupted run's, and the sources share the stream
    # by weight (1:1, in fetches of 64 cells: within 0.1).
    train_mlm = load_script("examples/train_mlm.py")
    mix = ["--mix", "--data-b", str(tmp_path / "atlas_b.slaf"), "--chunk-cells", "64"]
    train_mlm.main(tiny_args(tmp_path, *mix, "--steps", "12"))
    train_mlm.main(tiny_args(tmp_path, *mix, "--steps", "24", "--resume"))
    train_mlm.main(tiny_args(tmp_path, *mix, "--steps", "24", name="-whole"))
    resumed, whole = logged(tmp_path / "metrics.jsonl"), logged(tmp_path / "metrics-whole.jsonl")
    assert [m["step"] for m in resumed] == [4, 8, 12, 16, 20, 24]
    np.testing.assert_allclose([m["loss"] for m in resumed], [m["loss"] for m in whole], rtol=1e-5)
    assert all(np.isfinite(m["loss"]) for m in whole)
    shares = whole[-1]["source_cells"]  # 24 batches of 32 cells
    assert set(shares) == {"atlas", "atlas_b"} and sum(shares.values()) == 24 * 32
    assert abs(shares["atlas_b"] / (24 * 32) - 0.5) < 0.1
    last = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert set(last["loader"]["dataset"]["versions"]) == {"atlas", "atlas_b"}
    assert last["loader"]["order"]["sources"] == ["atlas", "atlas_b"]
    vocab = Vocabulary(tuple(f"GENE{g:06d}" for g in range(1, 49)))  # 32 genes, shifted by 16
    assert len(last["model"]["tokens.weight"]) == len(vocab) + 4
