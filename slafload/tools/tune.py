"""Choose ``BlockShuffle``'s (block size, fetch factor) for one dataset on one machine.

:func:`tune` measures the loader's cells/s at each point of a small ``(b, f)`` grid and
computes each point's *expected* minibatch entropy gap to random sampling for a label, from
the label's layout in storage order; :func:`recommend` then picks the fastest point within a
target gap. The report (:func:`tune`'s return value, written as JSON by ``slafload tune``)
holds every input of that choice, and :func:`recommend` is a pure function of the report, so
anyone can recompute or re-target the recommendation from the JSON alone.

**Expected gap.** The scDataset paper bounds the expected plug-in entropy of a minibatch of
``m`` cells made of blocks of ``b`` contiguous cells by ``H(p) - (K-1) b / (2 m ln 2)`` (blocks
of one class each) and ``H(p) - (K-1) / (2 m ln 2)`` (random sampling). Both are the
first-order (Miller-Madow) bias ``sum_k Var(p_hat_k) / (2 ln 2 p_k)``. With a fetch factor, a
minibatch is ``m`` cells drawn without replacement from a pool of ``B = ceil(f m / b)`` random
blocks (``N = B b`` cells), so

    Var(p_hat_k) = V_k + (p_k (1 - p_k) - V_k) (N - m) / (m (N - 1)),  V_k = s2_k(b) / B * fpc

where ``s2_k(b)`` is the variance over blocks of the share of class ``k`` in a block and
``fpc = (n_blocks - B) / (n_blocks - 1)`` corrects for pools that cover much of a small
dataset. Blocks of one class each (``s2_k = p_k (1 - p_k)``) and ``f = 1`` give the paper's
lower bound, ``b = 1`` its upper bound. The gap to random sampling is the difference of the
bias and ``(K - 1) / (2 m ln 2)``, about ``(K - 1) / (2 B ln 2)`` for one-class blocks. Like the
bounds it is first order: it overstates gaps larger than a few tenths of a bit.

The label is an obs column (its ``s2_k(b)`` estimated from up to ``max_sample_cells`` cells of
randomly chosen blocks), or, by default, the docs' plate order: ``K`` equally large classes
stored one after another, so every block holds one class (``s2_k = p_k (1 - p_k)``, the
worst case for a given ``K``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from slafload.data.dataset import SlafDataset
from slafload.samplers import BlockShuffle
from slafload.tokenizers.builtin import token_budget
from slafload.tools.diversity import entropy
from slafload.tools.progress import progress_bar

__all__ = ["FORMAT", "LabelLayout", "expected_gap", "recommend", "tune"]

logger = logging.getLogger(__name__)

FORMAT = "slafload.tools.tune.v1"


@dataclass(frozen=True)
class LabelLayout:
    """A label's class shares and, per block size, its between-block variance.

    Attributes:
        name: The obs column, or ``"contiguous(K)"`` for the default plate-order model.
        shares: ``p_k`` of every class with at least one cell.
        block_variance: ``{b: sum_k s2_k(b) / p_k}`` (``K - 1`` when blocks hold one class).
    """

    name: str
    shares: tuple[float, ...]
    block_variance: Mapping[int, float]

    @property
    def n_classes(self) -> int:
        """Number of classes."""
        return len(self.shares)

    @classmethod
    def contiguous(cls, n_classes: int, block_sizes: Sequence[int]) -> LabelLayout:
        """``n_classes`` equal classes stored one after another: every block is one class."""
        if isinstance(n_classes, bool) or not isinstance(n_classes, int) or n_classes < 1:
            raise ValueError(f"n_classes must be a positive integer, got {n_classes!r}")
        return cls(
            f"contiguous({n_classes})",
            (1 / n_classes,) * n_classes,
            {int(b): float(n_classes - 1) for b in block_sizes},
        )

    @classmethod
    def from_codes(
        cls,
        name: str,
        codes: np.ndarray,
        block_sizes: Sequence[int],
        *,
        seed: int = 0,
        max_sample_cells: int = 1 << 22,
    ) -> LabelLayout:
        """Measure the layout of integer class ``codes`` given in storage order."""
        codes = np.asarray(codes)
        _, codes = np.unique(codes, return_inverse=True)  # dense 0..K-1 codes
        counts = np.bincount(codes)
        shares = counts / len(codes)
        k = len(counts)
        variance = {}
        rng = np.random.default_rng(seed)
        for b in block_sizes:
            n_full = len(codes) // b  # the short last block is left out
            if b == 1 or n_full == 0:
                variance[int(b)] = float(k - 1)  # a single cell is one class
                continue
            n_sample = min(n_full, max(1, max_sample_cells // b), max(1, (1 << 26) // k))
            blocks = np.sort(rng.choice(n_full, size=n_sample, replace=False))
            cells = (blocks[:, None] * b + np.arange(b)).ravel()
            rows = np.repeat(np.arange(n_sample), b)
            frac = np.bincount(rows * k + codes[cells], minlength=n_sample * k).reshape(-1, k) / b
            variance[int(b)] = float((frac.var(axis=0) / shares).sum())
        return cls(name, tuple(float(s) for s in shares), variance)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (inverse of :meth:`from_json`)."""
        out = asdict(self)
        out["n_classes"] = self.n_classes
        out["block_variance"] = {str(b): v for b, v in self.block_variance.items()}
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LabelLayout:
        """Read a layout written by :meth:`to_json`."""
        variance = {int(b): float(v) for b, v in data["block_variance"].items()}
        return cls(data["name"], tuple(data["shares"]), variance)


def expected_gap(
    layout: LabelLayout, *, n_cells: int, block_size: int, fetch_factor: int, batch_size: int
) -> float:
    """Expected minibatch entropy (bits) of random sampling minus that of ``BlockShuffle(b, f)``.

    See the module docstring; never negative (``b = 1`` gives 0).
    """
    b, m, k = block_size, batch_size, layout.n_classes
    n_blocks = -(-n_cells // b)
    pool_blocks = min(-(-fetch_factor * m // b), n_blocks)
    pool = min(pool_blocks * b, n_cells)
    fpc = (n_blocks - pool_blocks) / (n_blocks - 1) if n_blocks > 1 else 0.0
    if b == 1:
        variance = k - 1.0  # a single cell is one class
    elif b in layout.block_variance:
        variance = layout.block_variance[b]
    else:
        raise ValueError(
            f"the label layout {layout.name!r} has no block variance for block_size={b}; "
            f"it has {sorted(layout.block_variance)}: build it with that block size"
        )
    between = variance / pool_blocks * fpc
    within = max(pool - m, 0) / (m * max(pool - 1, 1))
    bias = between + (k - 1 - between) * within
    return max(0.0, (bias - (k - 1) / m) / (2 * math.log(2)))


def recommend(report: Mapping[str, Any]) -> dict[str, Any] | None:
    """The fastest measured point whose expected gap is within the target, from a tune report.

    Recomputes every gap from the report's inputs (so a report can be re-targeted by editing
    ``inputs.target_gap_bits``). Ties in cells/s go to the smaller gap, then the smaller
    ``(b, f)``. ``None`` when no measured point meets the target.
    """
    inputs = report["inputs"]
    layout = LabelLayout.from_json(inputs["label"])
    best = None
    for point in report["points"]:
        if point["cells_per_s"] is None:
            continue
        gap = expected_gap(
            layout,
            n_cells=inputs["n_cells"],
            block_size=point["block_size"],
            fetch_factor=point["fetch_factor"],
            batch_size=inputs["batch_size"],
        )
        if gap > inputs["target_gap_bits"]:
            continue
        key = (-point["cells_per_s"], gap, point["block_size"], point["fetch_factor"])
        if best is None or key < best[0]:
            best = (key, {**_point_key(point), "cells_per_s": point["cells_per_s"],
                          "expected_gap_bits": gap})  # fmt: skip
    return None if best is None else best[1]


def _point_key(point: Mapping[str, Any]) -> dict[str, int]:
    return {"block_size": point["block_size"], "fetch_factor": point["fetch_factor"]}


def tune(
    dataset: SlafDataset,
    *,
    label: str | None = None,
    n_classes: int = 14,
    block_sizes: Sequence[int] = (1, 4, 16, 64, 256),
    fetch_factors: Sequence[int] = (16, 64, 256),
    batch_size: int = 32,
    target_gap: float = 0.05,
    seconds: float = 2.0,
    repeats: int = 2,
    budget_s: float = 120.0,
    tokenizer: str = "geneformer",
    max_genes: int = 2048,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Measure a ``(b, f)`` grid on ``dataset`` and recommend a point; return the report.

    Args:
        dataset: The opened dataset to tune for.
        label: Obs column whose minibatch diversity matters; ``None``: the ``plate`` column if
            there is one, else ``n_classes`` classes in contiguous storage order.
        n_classes: ``K`` of the contiguous default.
        block_sizes: The grid's block sizes ``b``.
        fetch_factors: The grid's fetch factors ``f``.
        batch_size: ``m``, the training minibatch size.
        target_gap: Largest acceptable expected entropy gap to random sampling, in bits.
        seconds: Timed seconds per point, after a warm-up of one fetch; a point always times
            at least one whole fetch.
        repeats: Runs of each point expected to meet the target (the others run once);
            a point's ``cells_per_s`` is the median of its runs.
        budget_s: Total time; points still unmeasured when it runs out are reported with
            ``cells_per_s = None``. Points expected to meet the target are measured first.
        tokenizer: As for :class:`~slafload.Loader`.
        max_genes: As for :class:`~slafload.Loader`.
        seed: Seed of the loaders and of the block sample behind the label layout.
        progress: Show a progress bar over the grid points.
    """
    _check_grid(block_sizes, fetch_factors, target_gap, repeats, seconds, budget_s)
    start = time.perf_counter()
    if label is None and "plate" in dataset.cells.schema.names:
        label = "plate"
    if label is None:
        layout = LabelLayout.contiguous(n_classes, block_sizes)
    else:
        codes, _ = dataset.obs_codes(label)
        layout = LabelLayout.from_codes(label, codes, block_sizes, seed=seed)
    inputs = {
        "n_cells": dataset.n_cells, "batch_size": batch_size, "target_gap_bits": target_gap,
        "label": layout.to_json(), "label_entropy_bits": entropy(np.array(layout.shares)),
        "tokenizer": tokenizer, "max_genes": max_genes, "seconds_per_point": seconds,
        "repeats": repeats, "budget_s": budget_s, "seed": seed,
    }  # fmt: skip
    points = _points(dataset.n_cells, layout, block_sizes, fetch_factors, batch_size)
    # Candidates first (larger blocks first: usually faster), so a short budget still decides.
    order = sorted(points, key=lambda p: (p["expected_gap_bits"] > target_gap, -p["block_size"],
                                          -p["fetch_factor"]))  # fmt: skip
    # Every point once, then the candidates again (interleaved, so a busy moment of a shared
    # machine does not decide alone): cells/s is the median of a point's runs.
    candidates = [p for p in order if p["expected_gap_bits"] <= target_gap]
    schedule = order + candidates * (repeats - 1)
    deadline = start + budget_s
    _run(dataset, schedule, inputs, deadline, progress)
    report = {
        "format": FORMAT,
        "dataset": {"uri": dataset.uri, "versions": dataset.versions},
        "inputs": inputs,
        "points": points,
        "elapsed_s": time.perf_counter() - start,
    }
    report["recommendation"] = recommend(report)
    return report


def _check_grid(
    block_sizes: Sequence[int], fetch_factors: Sequence[int], target_gap: float, repeats: int,
    seconds: float, budget_s: float,
) -> None:  # fmt: skip
    """Raise ``ValueError`` naming the first of :func:`tune`'s arguments out of its range."""
    for name, values in (("block_sizes", block_sizes), ("fetch_factors", fetch_factors)):
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                             for v in values):  # fmt: skip
            raise ValueError(f"{name} must be a non-empty list of positive integers, got {values}")
    if not target_gap >= 0:
        raise ValueError(f"target_gap must be >= 0 bits, got {target_gap!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    if not seconds > 0 or not budget_s > 0:
        raise ValueError(f"seconds and budget_s must be > 0, got {seconds!r}, {budget_s!r}")


def _points(
    n_cells: int, layout: LabelLayout, block_sizes: Sequence[int], fetch_factors: Sequence[int],
    batch_size: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """The grid's points, each with its expected entropy gap and no runs yet."""
    points: list[dict[str, Any]] = []
    for b in block_sizes:
        for f in fetch_factors:
            sampler = BlockShuffle(block_size=b, fetch_factor=f, batch_size=batch_size)
            gap = expected_gap(layout, n_cells=n_cells, block_size=b, fetch_factor=f,
                               batch_size=batch_size)  # fmt: skip
            points.append({"block_size": b, "fetch_factor": f,
                           "fetch_cells": min(sampler.blocks_per_fetch * b, n_cells),
                           "expected_gap_bits": gap, "cells_per_s": None,
                           "runs": []})  # fmt: skip
    return points


def _run(
    dataset: SlafDataset, schedule: list[dict[str, Any]], inputs: Mapping[str, Any],
    deadline: float, progress: bool,
) -> None:  # fmt: skip
    """Measure the points of ``schedule`` in order until ``deadline``, each run added to its
    point, whose ``cells_per_s`` is the median of its runs.
    """
    bar = progress_bar(progress, len(schedule), "tune", unit="run")
    try:
        for point in schedule:
            if time.perf_counter() >= deadline:
                logger.info("budget of %.0f s spent; b=%d f=%d not run", inputs["budget_s"],
                            point["block_size"], point["fetch_factor"])  # fmt: skip
                continue
            run = _measure(dataset, point, inputs, deadline)
            logger.info("b=%d f=%d: %s", point["block_size"], point["fetch_factor"], run)
            if run["cells_per_s"] is not None:
                point["runs"].append(run)
                point["cells_per_s"] = float(np.median([r["cells_per_s"] for r in point["runs"]]))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _measure(
    dataset: SlafDataset, point: Mapping[str, Any], inputs: Mapping[str, Any], deadline: float
) -> dict[str, Any]:
    """Steady-state cells/s of one grid point: one fetch of warm-up, then ``seconds`` and at
    least one more fetch, stopping early at the deadline (``cells_per_s = None`` if nothing
    was timed).
    """
    from slafload.loader import Loader

    sampler = BlockShuffle(block_size=point["block_size"], fetch_factor=point["fetch_factor"],
                           batch_size=inputs["batch_size"])  # fmt: skip
    warmup, fetch = point["fetch_cells"], point["fetch_cells"]
    cells, t0, now = 0, None, time.perf_counter()
    with Loader(dataset, sampler=sampler, batch_size=inputs["batch_size"],
                tokenizer=inputs["tokenizer"], n_epochs=None, seed=inputs["seed"],
                **token_budget(inputs["tokenizer"], inputs["max_genes"])) as loader:  # fmt: skip
        for batch in loader:
            n = len(batch["cell_integer_id"])
            now = time.perf_counter()
            if t0 is None:
                warmup -= n
                if warmup <= 0:
                    t0 = now
            else:
                cells += n
                if (now - t0 >= inputs["seconds_per_point"] and cells >= fetch) or now > deadline:
                    break
            if now > deadline:
                break
    elapsed = 0.0 if t0 is None else now - t0
    rate = cells / elapsed if cells and elapsed > 0 else None
    return {"cells_per_s": rate, "timed_cells": cells, "timed_s": elapsed}


def plot(report: Mapping[str, Any], path: str) -> bool:
    """Cells/s against expected gap per point, the target and the recommendation, as a PNG.

    Returns False (and logs) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; no plot written")
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4))
    measured = [p for p in report["points"] if p["cells_per_s"] is not None]
    for b in sorted({p["block_size"] for p in measured}):
        pts = [p for p in measured if p["block_size"] == b]
        ax.plot([max(p["expected_gap_bits"], 1e-4) for p in pts],
                [p["cells_per_s"] for p in pts], marker="o", label=f"b={b}")  # fmt: skip
        for p in pts:
            ax.annotate(f"f={p['fetch_factor']}", (max(p["expected_gap_bits"], 1e-4),
                        p["cells_per_s"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")  # fmt: skip
    target = report["inputs"]["target_gap_bits"]
    ax.axvline(max(target, 1e-4), color="k", linestyle="--", linewidth=1, label="target gap")
    rec = report["recommendation"]
    if rec is not None:
        ax.scatter([max(rec["expected_gap_bits"], 1e-4)], [rec["cells_per_s"]], s=250,
                   facecolors="none", edgecolors="r", linewidths=2,
                   label=f"recommended b={rec['block_size']} f={rec['fetch_factor']}")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("expected entropy gap to random sampling (bits; b=1 drawn at 1e-4)")
    ax.set_ylabel("cells / s")
    ax.set_title(f"slafload tune: label {report['inputs']['label']['name']}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
