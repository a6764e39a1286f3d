"""A/B: one benchmark on two versions of slafload, interleaved in rounds, as ratios.

Each side is a checkout: ``A`` is a git ref (commit, branch, tag) extracted with ``git archive``
into a temporary directory; ``B`` is another ref, or by default this working tree as it is
(uncommitted changes included). Each side first fills numba's cache (it caches kernels beside
the sources, so an extracted checkout starts cold): ``slafload warm-up``, or one untimed run of
the benchmark in a tree without that command (``--no-warm-up`` skips it). Every
round runs the benchmark once per side, each run in its own process with that side's
``slafload`` first on ``PYTHONPATH``, in the order A B, then B A the next round, so a machine
that speeds up or slows down during the run favours neither. Both sides run from the current
directory, so they share the benchmark's cached atlas.

The benchmark is a script of the checkout (``benchmarks/throughput.py`` by default) that takes
``--out FILE`` and writes JSON there; the arguments after ``--`` are passed to both sides. Every
number in the JSON whose key path contains ``--metric`` (default ``cells_per_s``; also e.g.
``fraction_of_raw_scan``) is reported as B's median over the rounds divided by A's::

    python benchmarks/ab.py main --rounds 3 -- --no-peers --epochs 0.5
    python benchmarks/ab.py main HEAD --script benchmarks/scale.py -- --atlas /tmp/a.slaf

Writes every run's JSON and the ratios (``ab.json``) under ``--out`` (default
``./slafload-bench/ab/``) and prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OUT_DIR = Path("slafload-bench") / "ab"


def numbers(tree: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a JSON ``tree`` as (``a.b.0.c`` key path, value); booleans are not."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from numbers(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from numbers(value, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(tree, int | float) and not isinstance(tree, bool):
        yield prefix, float(tree)


def ratios(runs: dict[str, list[dict[str, Any]]], metric: str) -> dict[str, dict[str, float]]:
    """Per key path matching ``metric``: each side's median over its runs and B over A."""
    medians: dict[str, dict[str, float]] = {}
    for side in ("A", "B"):
        values: dict[str, list[float]] = {}
        for report in runs[side]:
            for key, value in numbers(report):
                if metric in key:
                    values.setdefault(key, []).append(value)
        for key, vs in values.items():
            medians.setdefault(key, {})[side] = statistics.median(vs)
    return {
        key: {**m, "B_over_A": m["B"] / m["A"]}
        for key, m in medians.items()
        if "A" in m and "B" in m and m["A"] != 0
    }


def order(rounds: int) -> list[tuple[int, str]]:
    """(round, side) in run order: A B, B A, A B, ..."""
    return [(r, side) for r in range(rounds) for side in (("A", "B") if r % 2 == 0 else "BA")]


def checkout(ref: str, repo: Path, into: Path) -> Path:
    """The tree of ``ref`` in ``repo``, extracted under ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", ref], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _env(root: Path) -> dict[str, str]:
    """The environment of a run from checkout ``root``: its ``slafload`` first on the path."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }


def warm_up(root: Path, script: str, args: list[str], out: Path) -> str:
    """Fill numba's cache for checkout ``root``, which caches kernels beside the sources, so a
    checkout extracted here starts cold and its first runs would time numpy code while the
    kernels compile (skewing a short A/B by up to 2x): ``slafload warm-up`` where the tree has
    that command, else one untimed run of the benchmark (written to ``out``). How it warmed.
    """
    code = "import sys; from slafload.tools.cli import main; sys.exit(main(['warm-up']))"
    # from ``root``: ``python -c`` puts the current directory before PYTHONPATH
    done = subprocess.run([sys.executable, "-c", code], env=_env(root), cwd=root)
    if done.returncode == 0:
        return "slafload warm-up"
    run_side(root, script, args, out)
    return "an untimed run (no slafload warm-up in this tree)"


def run_side(root: Path, script: str, args: list[str], out: Path) -> dict[str, Any]:
    """One run of ``script`` from checkout ``root``, in its own process; its JSON report."""
    subprocess.run(
        [sys.executable, str(root / script), *args, "--out", str(out)], env=_env(root), check=True
    )
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the A/B comparison from the command line; the report."""
    argv = sys.argv[1:] if argv is None else argv
    passed = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", metavar="A", help="git ref of the baseline")
    p.add_argument(
        "b", metavar="B", nargs="?", help="git ref to compare (default: this working tree)"
    )
    p.add_argument("--rounds", type=int, default=3, help="runs per side (default: 3)")
    p.add_argument(
        "--script", default="benchmarks/throughput.py", help="benchmark, in each checkout"
    )
    p.add_argument("--metric", default="cells_per_s", help="key paths compared (substring)")
    p.add_argument("--out", default=str(OUT_DIR), help="directory for the runs' JSON and ab.json")
    p.add_argument(
        "--no-warm-up", action="store_true", help="skip filling each side's numba cache first"
    )
    args = p.parse_args(own)

    repo = Path(subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], check=True, capture_output=True, text=True
    ).stdout.strip())  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="slafload-ab-") as tmp:
        roots = {"A": checkout(args.a, repo, Path(tmp, "A"))}
        roots["B"] = repo if args.b is None else checkout(args.b, repo, Path(tmp, "B"))
        warmed = {}
        if not args.no_warm_up:
            for side in ("A", "B"):
                print(f"warm-up: {side}", file=sys.stderr)
                warmed[side] = warm_up(roots[side], args.script, passed, out / f"{side}_warm.json")
        runs: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
        for r, side in order(args.rounds):
            print(f"round {r + 1}/{args.rounds}: {side}", file=sys.stderr)
            path = out / f"{side}_{r}.json"
            runs[side].append(run_side(roots[side], args.script, passed, path))
    report = {
        "a": args.a,
        "b": args.b or "working tree",
        "script": args.script,
        "arguments": passed,
        "rounds": args.rounds,
        "warm_up": warmed,
        "metric": args.metric,
        "ratios": ratios(runs, args.metric),
    }
    (out / "ab.json").write_text(json.dumps(report, indent=2))
    print(f"\nB = {report['b']}, A = {args.a}: medians of {args.rounds} interleaved rounds")
    print(f"{'key':<60}{'A':>12}{'B':>12}{'B / A':>8}")
    for key, m in report["ratios"].items():
        print(f"{key:<60}{m['A']:>12,.1f}{m['B']:>12,.1f}{m['B_over_A']:>8.3f}")
    print(f"\nwrote {out / 'ab.json'}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
