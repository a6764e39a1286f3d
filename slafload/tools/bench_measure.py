"""How a benchmark run is timed: a clock counting the cells a run delivers, its steady window
after a warm-up, peak RSS sampled beside it, and repeated runs paired with a raw scan.

Library code never prints; these helpers serve the benchmark drivers, which report.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples this process's RSS every 20 ms while active; ``peak`` in bytes."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss_bytes())

    def __enter__(self) -> PeakRss:
        self.peak = _rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def progress(iterable, **kwargs):
    """``iterable`` with a tqdm progress bar when tqdm is installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, **kwargs)


class Clock:
    """Counts the cells a run delivers as they arrive, from its start (the clock's creation,
    just before the loader is constructed): when the first batch came, and when the first
    ``warmup`` cells were in (the end of the warm-up, where the steady window starts).
    """

    def __init__(self, warmup: int = 0):
        self.warmup = warmup
        self.start = time.perf_counter()
        self.cells = 0
        self.first_batch: float | None = None
        self.warm: tuple[float, int] | None = (self.start, 0) if warmup <= 0 else None

    def add(self, cells: int) -> None:
        """``cells`` more arrived now."""
        now = time.perf_counter()
        if self.first_batch is None:
            self.first_batch = now
        self.cells += cells
        if self.warm is None and self.cells >= self.warmup:
            self.warm = (now, self.cells)

    def timing(self) -> dict[str, float]:
        """End-to-end and steady (after the warm-up) cells/s, and time to the first batch."""
        end = time.perf_counter()
        warm_at, warm_cells = self.warm or (end, self.cells)
        return {
            "end_to_end": self.cells / (end - self.start),
            "steady": (self.cells - warm_cells) / (end - warm_at) if end > warm_at else 0.0,
            "first_batch_s": (self.first_batch or end) - self.start,
        }


def consume(
    batches: Iterator[Mapping[str, Any]], clock: Clock, until: int, key: str = "input_ids"
) -> int:
    """Draw batches until ``clock`` has counted ``until`` cells in all; the cells counted."""
    for batch in batches:
        clock.add(len(batch[key]))
        if clock.cells >= until:
            break
    return clock.cells


def timed_runs(
    label: str,
    run: Callable[[Clock], object],
    repeats: int,
    *,
    warmup: int = 0,
    floor: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """``repeats`` runs of ``run`` (which feeds the :class:`Clock` it is given): median
    cells/s after ``warmup`` cells (``cells_per_s``) and from the start
    (``cells_per_s_end_to_end``), time to the first batch, CPU time per cell (every thread of
    the process, whole run) and peak RSS.

    With ``floor`` (a raw scan's cells/s), the scan runs right before each run, and
    ``fraction_of_raw_scan`` is the median of each run's rate over its own scan's: the machine
    changes speed from minute to minute, so a run is compared with a scan made beside it.
    """
    steady, e2e, firsts, cpu, peaks, floors = [], [], [], [], [], []
    for _ in progress(range(repeats), desc=label, leave=False):
        if floor is not None:
            floors.append(floor())
        gc.collect()
        with PeakRss() as rss:
            cpu_start = time.process_time()
            clock = Clock(warmup)
            run(clock)
            timing, cpu_s = clock.timing(), time.process_time() - cpu_start
        steady.append(timing["steady"])
        e2e.append(timing["end_to_end"])
        firsts.append(timing["first_batch_s"])
        cpu.append(cpu_s / clock.cells * 1e6)
        peaks.append(rss.peak)
    out: dict[str, Any] = {
        "cells_per_s": statistics.median(steady),
        "runs_cells_per_s": steady,
        "cells_per_s_end_to_end": statistics.median(e2e),
        "runs_cells_per_s_end_to_end": e2e,
        "first_batch_s": statistics.median(firsts),
        "cpu_us_per_cell": statistics.median(cpu),
        "peak_rss_mb": max(peaks) / 2**20,
    }
    if floors:
        out["paired_raw_scan_cells_per_s"] = floors
        out["fraction_of_raw_scan"] = statistics.median(
            a / b for a, b in zip(steady, floors, strict=True)
        )
        out["fraction_of_raw_scan_end_to_end"] = statistics.median(
            a / b for a, b in zip(e2e, floors, strict=True)
        )
    return out
