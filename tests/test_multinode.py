"""Two torchrun agents on loopback as two nodes (4 ranks), then an elastic resume on 2 ranks."""

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

SCRIPT = Path(__file__).parent / "scripts" / "ddp_nodes.py"
N_CELLS = 211


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nnodes: int, args: list[str], port: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", "--nproc-per-node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=slafload{port}",
        "--local-addr=127.0.0.1", "--max-restarts=0",
        str(SCRIPT), *args,
    ]  # fmt: skip


def run_agents(commands: list[list[str]], env: dict[str, str]) -> None:
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for cmd in commands
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]


def test_two_nodes_cover_the_epoch_exactly_and_resume_elastically_on_two_ranks(tmp_path):
    path = write_dense(tmp_path / "d.slaf", random_counts(N_CELLS, 20, seed=3, empty_every=19))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = free_port()
    epoch = torchrun(2, ["epoch", str(path), str(out), "3"], port)
    run_agents([epoch, epoch], env)  # two agents: node 0 and node 1, rendezvous on loopback

    ranks = [json.loads((out / f"epoch_rank{r}.json").read_text()) for r in range(4)]
    assert [r["world_size"] for r in ranks] == [4] * 4
    assert len({r["batches"] for r in ranks}) == 1  # equal batch counts on every rank
    union = np.concatenate([r["cells"] for r in ranks])
    assert len(np.unique(union)) == len(union)  # no cell twice
    assert N_CELLS - len(union) < 4 * len(ranks)  # all but the documented uneven tail
    states = [r["state"] for r in ranks]
    assert all(s["segments"] == states[0]["segments"] == [[4, 24]] for s in states)

    run_agents([torchrun(1, ["resume", str(path), str(out)], free_port())], env)
    resumed = [json.loads((out / f"resume_rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in resumed] == [2, 2]
    assert resumed[0]["batches"] == resumed[1]["batches"]
    before = np.concatenate([r["taken"] for r in ranks])
    after = np.concatenate([r["cells"] for r in resumed])
    assert len(before) == 4 * 3 * 8 and len(after) > 0
    seen = np.concatenate([before, after])
    assert len(np.unique(seen)) == len(seen)  # the 2-rank run repeats none of the 4-rank cells
    assert N_CELLS - len(seen) < 4 * len(ranks)  # and finishes the epoch (same tail bound)
