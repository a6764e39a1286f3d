"""The benchmark's report: the machine it ran on, the JSON written, the table printed and the
bar chart drawn.

Library code never prints; this module serves the benchmark drivers, which report on stdout.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from slafload.tools.bench_layout import layout_table


def machine() -> dict[str, Any]:
    """The machine a benchmark ran on, for its JSON report."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def ratios(
    results: dict[str, Any], ours: Sequence[str], layouts: Sequence[str]
) -> dict[str, float]:
    """Each of slafload's runs as a fraction of the raw scan, and each built-in against slafdb's
    loader (steady and end to end) where slafdb ran.
    """
    out = {}
    for tok in ours:
        keys = [f"slafload_{tok}", f"slafload_{tok}_numpy_kernels"]
        keys += [f"slafload_{tok}_{layout}" for layout in layouts]
        keys += [k for k in results if k.startswith(f"slafload_{tok}_workers")]
        for key in (k for k in keys if k in results):
            name = key.removeprefix("slafload_")
            out[f"{name}_fraction_of_raw_scan"] = results[key]["fraction_of_raw_scan"]
        if f"slafdb_{tok}" in results:
            ours_, peer = results[f"slafload_{tok}"], results[f"slafdb_{tok}"]
            out[f"{tok}_vs_slafdb"] = ours_["cells_per_s"] / peer["cells_per_s"]
            out[f"{tok}_vs_slafdb_end_to_end"] = (
                ours_["cells_per_s_end_to_end"] / peer["cells_per_s_end_to_end"]
            )
    return out


def save_report(
    report: dict[str, Any],
    out: str | Path,
    table: Callable[[dict[str, Any]], None],
    draw: Callable[[dict[str, Any], Path], None],
) -> Path:
    """Write ``report`` as JSON to ``out``, print its table and draw its PNG beside it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    table(report)
    draw(report, out.with_suffix(".png"))
    return out


def print_table(report: dict[str, Any]) -> None:
    """Print the report as a table."""
    d, s = report["dataset"], report["settings"]
    print(
        f"\n{d['n_cells']:,} cells x {d['n_genes']:,} genes, {d['nnz_per_cell']:.0f} "
        f"non-zeros/cell; batch_size={s['batch_size']}, max_genes={s['max_genes']}, "
        f"{s['epochs_per_run']} epochs timed per run after {s['warmup_cells']:,} cells; "
        f"page cache {s['page_cache']}"
    )
    print("cells/s: steady, after the warm-up; x raw scan: median of each run over a raw scan "
          "run beside it; end to end: from constructing the loader")  # fmt: skip
    print(f"{'loader':<44}{'cells/s':>10}{'x raw scan':>11}{'end to end':>11}{'x raw':>7}"
          f"{'1st batch s':>12}{'CPU us/cell':>12}{'RSS MB':>8}")  # fmt: skip
    for name, r in report["results"].items():
        print(
            f"{name:<44}{r['cells_per_s']:>10,.0f}{r.get('fraction_of_raw_scan', 1.0):>11.2f}"
            f"{r['cells_per_s_end_to_end']:>11,.0f}"
            f"{r.get('fraction_of_raw_scan_end_to_end', 1.0):>7.2f}{r['first_batch_s']:>12.2f}"
            f"{r['cpu_us_per_cell']:>12.1f}{r['peak_rss_mb']:>8,.0f}"
        )
    for name, value in report["ratios"].items():
        print(f"{name:<34}{value:>8.2f}")
    for tok, prof in report["profile_us_per_cell"].items():
        parts = ", ".join(f"{k} {v:.1f}" for k, v in prof.items())
        print(f"profile {tok} (us/cell): {parts}")
    if report["layouts"] is not None:
        print(layout_table(report["layouts"]))


def plot(report: dict[str, Any], path: Path) -> None:
    """Plot the report's throughputs to a PNG at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = [n for n in report["results"] if n != "raw_scan"]
    rates = [report["results"][n]["cells_per_s"] for n in names]
    # One bar per contender, each with room for its label: a fixed height made them overlap.
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.32 * len(names)))
    ax.barh(
        names, rates, color=["#3b7dd8" if n.startswith("slafload") else "#999999" for n in names]
    )
    floor = report["results"]["raw_scan"]["cells_per_s"]
    ax.axvline(floor, color="#d62728", linestyle="--", label=f"raw Lance scan {floor:,.0f}")
    ax.set_xlabel("cells / s after the warm-up (higher is better)")
    ax.legend(loc="lower right")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
