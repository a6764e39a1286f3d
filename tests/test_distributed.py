"""A real ``torchrun --nproc_per_node=2`` run (gloo on CPU): coverage, equal counts, resume."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import random_counts, write_dense

pytestmark = pytest.mark.slow  # separate processes (torchrun, training runs)

SCRIPT = Path(__file__).parent / "scripts" / "ddp_epoch.py"


def _torchrun(script: Path, *args: str | Path) -> subprocess.CompletedProcess:
    """``script ARGS...`` under ``torchrun --nproc_per_node=2`` on a free loopback port."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with socket.socket() as s:  # a free loopback port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        str(script),
        *map(str, args),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_torchrun_ranks_cover_the_epoch_disjointly_with_equal_batches_and_resume(tmp_path):
    path = write_dense(tmp_path / "d.slaf", random_counts(203, 20, seed=2, empty_every=23))
    out = tmp_path / "out"
    out.mkdir()
    proc = _torchrun(SCRIPT, path, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["batches"] == ranks[1]["batches"] == ranks[0]["max_batches"]
    shares = [np.array(r["cells"]) for r in ranks]
    union = np.concatenate(shares)
    assert len(np.unique(union)) == len(union)  # disjoint
    assert 203 - len(union) <= 7  # complete apart from the documented tail (< one per fetch)
    for r in ranks:
        assert r["resumed"] == r["cells"]  # a mid-epoch resume under 2 ranks is exact
        assert r["state"]["segments"] == [[2, 24]] and r["state"]["rank"] == r["rank"]


def test_torchrun_ranks_share_a_mixture_disjointly_with_equal_batches_and_resume(tmp_path):
    a = write_dense(tmp_path / "a.slaf", random_counts(151, 20, seed=3, empty_every=17))
    b = write_dense(tmp_path / "b.slaf", random_counts(97, 20, seed=4))
    out = tmp_path / "out"
    out.mkdir()
    proc = _torchrun(SCRIPT, a, b, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["names"] for r in ranks] == [["a", "b"], ["a", "b"]]
    assert ranks[0]["batches"] == ranks[1]["batches"] == ranks[0]["max_batches"]
    union = [tuple(c) for r in ranks for c in r["cells"]]
    assert len(set(union)) == len(union)  # disjoint
    n_fetches = -(-151 // 30) + -(-97 // 30)
    assert 151 + 97 - len(union) < n_fetches  # complete apart from the tail (< one per fetch)
    assert {s for s, _ in union} == {0, 1}
    for r in ranks:
        assert r["resumed"] == r["cells"]  # a mid-epoch resume under 2 ranks is exact
        assert r["state"]["segments"] == [[2, 24]] and r["state"]["rank"] == r["rank"]
        assert r["state"]["order"]["weights"] == [1.0, 2.0]


def test_the_ddp_example_trains_under_torchrun_and_resumes_from_its_checkpoint(tmp_path):
    example = Path(__file__).parents[1] / "examples" / "train_ddp.py"
    data, checkpoint = tmp_path / "atlas.slaf", tmp_path / "ddp.pt"
    args = ("--data", data, "--checkpoint", checkpoint, "--batch-size", "8", "--log-every", "1")
    first = _torchrun(example, *args, "--steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "step     3" in first.stdout
    assert "rank 0/2: 3 steps, 24 cells" in first.stdout
    assert "rank 1/2: 3 steps, 24 cells" in first.stdout
    resumed = _torchrun(example, *args, "--steps", "5", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "rank 1/2: 5 steps, 16 cells" in resumed.stdout  # 2 more steps after the 3 saved
