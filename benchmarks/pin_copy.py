"""What staging a batch for the GPU costs the producer: torch's copy against numpy's.

``Tensor.pin_memory()`` copies with ``Tensor.copy_``, which hands any tensor of 32,768
elements or more to torch's intra-op (OpenMP) thread pool; every stream of a padded batch is
that large, a packed batch's are not. ``ToTorch`` now pins with :func:`slafload.batcher.pinned`:
numpy copies on the producer thread into memory from torch's pinned allocator.

For each batch layout this times a loop of batches, each a fixed single-threaded stand-in
for the producer's own work (Python and small numpy steps, ~0.1 ms) followed by the copy of
the batch's streams, three ways, interleaved round by round: no copy (the baseline), torch's
copy and numpy's. It reports, per batch over the baseline, the wall time and the process's CPU
time (every thread: OpenMP threads spinning after a parallel copy count there). With a CUDA
device the destinations are pinned and torch's copy is ``pin_memory()`` itself; without one
they are ordinary CPU memory (the same copy kernels, the allocation aside).

    python benchmarks/pin_copy.py [--batches 2000] [--rounds 5] [--threads N]

Writes ``benchmarks/results/pin_copy.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slafload.batcher import copy_into
from slafload.buffers import torch_dtype
from slafload.tools import bench

ROOT = Path(__file__).resolve().parent.parent
# One batch of 32 cells at the benchmark's max_genes=2048 (~796 genes per cell: 25,465
# tokens packed), stream by stream.
BATCHES = {
    "geneformer padded": {
        "input_ids": ((32, 2048), np.int64),
        "attention_mask": ((32, 2048), bool),
    },
    "scgpt padded": {
        "input_ids": ((32, 2050), np.int64),
        "values": ((32, 2050), np.int64),
        "attention_mask": ((32, 2050), bool),
    },
    "geneformer packed": {
        "input_ids": ((25_465,), np.int64),
        "position_ids": ((25_465,), np.int64),
    },
}


def producer_work(scratch: np.ndarray) -> int:
    """A fixed single-threaded stand-in for the producer's own work between two batches."""
    total = 0
    for i in range(64):
        total += int(scratch[i * 16 : i * 16 + 16].sum())
    return total


def run(arrays: dict[str, np.ndarray], how: str, n: int, pin: bool) -> tuple[float, float]:
    """Wall and process CPU seconds of ``n`` batches copied ``how``."""
    scratch = np.arange(4096, dtype=np.int64)
    sources = {k: torch.from_numpy(a) for k, a in arrays.items()}
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        producer_work(scratch)
        for k, a in arrays.items():
            if how == "torch":
                if pin:
                    sources[k].pin_memory()
                else:
                    torch.empty(a.shape, dtype=sources[k].dtype).copy_(sources[k])
            elif how == "numpy":
                copy_into(torch.empty(a.shape, dtype=torch_dtype(a.dtype), pin_memory=pin), a)
    return time.perf_counter() - start, time.process_time() - cpu


def over_baseline(
    got: list[tuple[float, float]], base: list[tuple[float, float]], batches: int
) -> dict[str, Any]:
    """Median wall and CPU microseconds per batch of ``got`` above those of ``base``."""
    wall, cpu = (
        (statistics.median(x[i] for x in got) - statistics.median(x[i] for x in base))
        / batches * 1e6
        for i in (0, 1)
    )  # fmt: skip
    return {"wall_us_per_batch": wall, "cpu_us_per_batch": cpu, "runs": got}


def measure(batches: int, rounds: int) -> dict[str, Any]:
    pin = torch.cuda.is_available()
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {}
    for label, streams in bench.progress(BATCHES.items(), desc="layouts"):
        arrays = {
            k: rng.integers(0, 2, shape).astype(dtype) for k, (shape, dtype) in streams.items()
        }
        runs: dict[str, list[tuple[float, float]]] = {"none": [], "torch": [], "numpy": []}
        run(arrays, "torch", 50, pin)  # warm up the allocators and the thread pool
        for r in range(rounds):
            order = ["none", "torch", "numpy"] if r % 2 == 0 else ["numpy", "torch", "none"]
            for how in order:
                runs[how].append(run(arrays, how, batches, pin))
        results[label] = {
            "elements_per_stream": {k: int(a.size) for k, a in arrays.items()},
            "baseline_us_per_batch": statistics.median(w for w, _ in runs["none"]) / batches * 1e6,
            "torch": over_baseline(runs["torch"], runs["none"], batches),
            "numpy": over_baseline(runs["numpy"], runs["none"], batches),
        }
    return {
        "machine": bench.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pinned": pin,
        "batches": batches,
        "rounds": rounds,
        "layouts": results,
    }


def table(report: dict[str, Any]) -> None:
    print(f"torch {report['torch']}, {report['torch_threads']} intra-op threads, "
          f"{'pinned' if report['pinned'] else 'pageable (no CUDA)'} destinations; "
          "per batch, over the no-copy baseline")  # fmt: skip
    print(f"{'batch':<20}{'torch wall us':>14}{'cpu us':>9}{'numpy wall us':>15}{'cpu us':>9}")
    for label, r in report["layouts"].items():
        t, n = r["torch"], r["numpy"]
        print(f"{label:<20}{t['wall_us_per_batch']:>14.1f}{t['cpu_us_per_batch']:>9.1f}"
              f"{n['wall_us_per_batch']:>15.1f}{n['cpu_us_per_batch']:>9.1f}")  # fmt: skip


def draw(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(report["layouts"])
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ways = [("torch", "Tensor.copy_ (pin_memory)"), ("numpy", "numpy (pinned)")]
    for i, (how, name) in enumerate(ways):
        cpu = [report["layouts"][k][how]["cpu_us_per_batch"] for k in labels]
        ax.bar(x + (i - 0.5) * 0.4, cpu, 0.4, label=name)
    ax.set_xticks(x, labels)
    ax.set_ylabel("process CPU per batch (us)")
    ax.set_title(f"Staging one batch, {report['torch_threads']} torch threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pin_copy.json"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # this benchmark's own process only
    bench.save_report(measure(args.batches, args.rounds), args.out, table, draw)


if __name__ == "__main__":
    main()
