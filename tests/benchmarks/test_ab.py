"""The A/B harness (benchmarks/ab.py) on a tiny git repository with a stand-in benchmark."""

from __future__ import annotations

import json
import subprocess

from conftest import load_script

ab = load_script("benchmarks/ab.py")

STAND_IN = """\
import argparse, json, pathlib, sys
p = argparse.ArgumentParser()
p.add_argument("--scale", type=float, default=1.0)
p.add_argument("--out")
args = p.parse_args()
value = float((pathlib.Path(__file__).parent / "value.txt").read_text()) * args.scale
report = {"results": {"x": {"cells_per_s": value, "first_batch_s": 1.0}}, "ok": True}
pathlib.Path(args.out).write_text(json.dumps(report))
"""


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_the_working_tree_is_compared_with_a_commit_in_interleaved_rounds(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "bench.py").write_text(STAND_IN)
    (repo / "value.txt").write_text("100")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "baseline")
    (repo / "value.txt").write_text("150")  # uncommitted: side B only
    monkeypatch.chdir(repo)

    out = tmp_path / "ab"
    report = ab.main(["HEAD", "--rounds", "2", "--script", "bench.py", "--out", str(out),
                      "--no-warm-up", "--", "--scale", "2"])  # fmt: skip

    assert report["ratios"] == {"results.x.cells_per_s": {"A": 200.0, "B": 300.0, "B_over_A": 1.5}}
    assert json.loads((out / "ab.json").read_text())["ratios"] == report["ratios"]
    assert sorted(p.name for p in out.glob("?_*.json")) == ["A_0.json", "A_1.json", "B_0.json",
                                                            "B_1.json"]  # fmt: skip


def test_rounds_alternate_which_side_runs_first():
    assert ab.order(3) == [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B")]


STAND_IN_CLI = """\
import os, pathlib
def main(argv):
    if "#" + " tree B" not in pathlib.Path(__file__).read_text():
        return 2  # as argparse does for a command a tree does not have
    with open(os.environ["AB_WARMED"], "a") as f:
        f.write(f"{argv}\\n")
    return 0
"""


def test_each_side_fills_its_own_cache_before_the_rounds(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "slafload" / "tools").mkdir(parents=True)
    (repo / "bench.py").write_text(STAND_IN)
    (repo / "value.txt").write_text("100")
    (repo / "slafload" / "__init__.py").write_text("")
    (repo / "slafload" / "tools" / "__init__.py").write_text("")
    (repo / "slafload" / "tools" / "cli.py").write_text(STAND_IN_CLI)
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "baseline")
    with open(repo / "slafload" / "tools" / "cli.py", "a") as f:
        f.write("# tree B\n")  # uncommitted: only the working tree has a warm-up command
    monkeypatch.chdir(repo)
    warmed = tmp_path / "warmed.txt"
    monkeypatch.setenv("AB_WARMED", str(warmed))
    out = tmp_path / "ab"

    report = ab.main(["HEAD", "--rounds", "1", "--script", "bench.py", "--out", str(out)])

    assert warmed.read_text().splitlines() == ["['warm-up']"]  # B's own command, run once
    assert report["warm_up"] == {
        "A": "an untimed run (no slafload warm-up in this tree)",
        "B": "slafload warm-up",
    }
    assert (out / "A_warm.json").exists() and not (out / "B_warm.json").exists()
