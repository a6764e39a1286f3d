"""What each layout and tokenize placement costs and saves, for ``benchmarks/throughput.py``.

Three figures per (tokenizer, layout, placement), all on the same dataset in one process:

- **consumer**: the training thread's time in ``next()`` (p50/p99), with a simulated training
  step (``step_s`` of sleep) long enough that the producer keeps the queue full, so it is the
  consumer's own cost (queue hand-off, device move, and device tokenizing when
  ``tokenize_on="device"``), not time spent waiting for the producer;
- **tokens per batch**: the positions a model attends over (``input_ids``/``gene_ids``
  elements: ``batch x width`` padded, ``batch x longest`` for longest, real tokens packed) next
  to the real tokens, i.e. the GPU work packing saves; and **bytes per cell** delivered (every
  tensor of the batch);
- **producer**: microseconds per cell of the producer's tokenizing steps, run synchronously
  on a few fetches (``tokenize``: a piece into rows; ``batch+layout``: cutting batches, laying
  them out, wrapping them as tensors).

Library code never prints; the benchmark driver (:mod:`slafload.tools.bench`) reports these.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import closing
from typing import Any, cast

import numpy as np
import torch

import slafload
from slafload.config import LoaderConfig
from slafload.kernels import Kernels
from slafload.pipeline.batcher import Batcher
from slafload.pipeline.chunk import assemble, shuffle
from slafload.pipeline.ranking import rank
from slafload.pipeline.reader import Reader
from slafload.pipeline.tokenize import HostTokens, make_token_stage
from slafload.tokenizers import make_tokenizer

LAYOUTS = ("padded", "longest", "packed")
PLACEMENTS = ("producer", "device")


def token_counts(batch: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(positions attended over, real tokens) of one batch, in any layout."""
    key = "input_ids" if "input_ids" in batch else "gene_ids"
    positions = batch[key].numel()
    if "cu_seqlens" in batch:
        return positions, positions
    if "attention_mask" in batch:
        return positions, int(batch["attention_mask"].sum())
    return positions, int(batch["lengths"].sum())


def consumer_cost(
    ds: slafload.SlafDataset,
    tokenizer: str,
    layout: str,
    *,
    tokenize_on: str = "producer",
    batch_size: int = 32,
    max_genes: int = 2048,
    token_dtype: str = "int64",
    n_batches: int = 300,
    step_s: float = 0.005,
    device: str | None = None,
) -> dict[str, Any]:
    """Time in ``next()`` and what each batch holds, over ``n_batches`` after a warm-up."""
    times, positions, real, nbytes, cells = [], 0, 0, 0, 0
    with slafload.Loader(
        ds, tokenizer=tokenizer, layout=layout, tokenize_on=tokenize_on, batch_size=batch_size,
        max_genes=max_genes, token_dtype=token_dtype, n_epochs=None, seed=0, device=device,
    ) as loader:  # fmt: skip
        batches = iter(loader)
        for i in range(n_batches + 20):
            start = time.perf_counter()
            batch = next(batches)
            if device is not None and torch.device(device).type == "cuda":
                torch.cuda.synchronize()  # device tokenizing is the consumer's cost too
            elapsed = time.perf_counter() - start
            if i >= 20:  # the first batches wait for the producer to start
                times.append(elapsed)
                tensors = cast(Mapping[str, torch.Tensor], batch)
                p, r = token_counts(tensors)
                positions, real = positions + p, real + r
                nbytes += sum(v.numel() * v.element_size() for v in tensors.values())
                cells += len(batch["cell_integer_id"])
            time.sleep(step_s)  # the training step, during which the producer refills
    ms = np.asarray(times) * 1e3
    return {
        "next_ms_p50": float(np.percentile(ms, 50)),
        "next_ms_p99": float(np.percentile(ms, 99)),
        "tokens_per_batch": positions / len(times),
        "real_tokens_per_batch": real / len(times),
        "bytes_per_cell": nbytes / cells,
    }


def producer_cost(
    ds: slafload.SlafDataset,
    tokenizer: str,
    layout: str,
    *,
    tokenize_on: str = "producer",
    batch_size: int = 32,
    max_genes: int = 2048,
    token_dtype: str = "int64",
    n_fetches: int = 4,
    repeats: int = 3,
) -> dict[str, float]:
    """Microseconds per cell of ranking, tokenizing and laying out, over a few fetches.

    Each fetch is processed ``repeats`` times and each step's fastest time kept, which filters
    out other processes' noise on a shared machine.
    """
    config = LoaderConfig(
        layout=layout, tokenize_on=tokenize_on, max_genes=max_genes, token_dtype=token_dtype
    )
    with closing(Kernels(config.kernels)) as kernels:
        stage = make_token_stage(make_tokenizer(tokenizer, max_genes=max_genes), config, kernels)
        plan = slafload.samplers.ChunkShuffle(chunk_cells=config.chunk_cells).plan(
            ds.n_cells, seed=0, epoch=0
        )
        reader, times, cells = (
            Reader(ds),
            dict.fromkeys(["rank", "tokenize", "batch+layout"], 0.0),
            0,
        )
        for fetch in plan[:n_fetches]:
            batches = list(reader.read(fetch))
            chunk = shuffle(assemble(fetch, batches, ds.cell_start), fetch.shuffle_seed)
            best = [float("inf")] * 3
            for _ in range(repeats):
                t0 = time.perf_counter()
                if isinstance(stage, HostTokens):  # the device ranks on the device
                    ranked = rank(chunk)
                    t1 = time.perf_counter()
                    arrays, cell_ids = stage.tokenize(ranked)
                else:
                    t1 = time.perf_counter()
                    arrays, cell_ids = stage.rows(chunk)
                arrays["cell_integer_id"] = cell_ids
                t2 = time.perf_counter()
                batcher = Batcher(batch_size)
                for batch in [*batcher.add(arrays), *batcher.finish()]:
                    {
                        k: torch.from_numpy(np.ascontiguousarray(v))
                        for k, v in stage.finish(batch).items()
                    }
                t3 = time.perf_counter()
                best = [min(b, t) for b, t in zip(best, (t1 - t0, t2 - t1, t3 - t2), strict=True)]
            for key, dt in zip(times, best, strict=True):
                times[key] += dt
            cells += chunk.n_cells
        return {k: v / cells * 1e6 for k, v in times.items()}


def layout_report(
    ds: slafload.SlafDataset,
    tokenizers: tuple[str, ...],
    *,
    batch_size: int,
    max_genes: int,
    token_dtype: str = "int64",
    n_batches: int = 300,
    step_s: float = 0.005,
    device: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Consumer and producer costs of every layout and placement, keyed ``tok/layout/on``."""
    report = {}
    for tok in tokenizers:
        for on in PLACEMENTS:
            for layout in LAYOUTS:
                settings: dict[str, Any] = {"tokenize_on": on, "batch_size": batch_size, "max_genes": max_genes,
                            "token_dtype": token_dtype}  # fmt: skip
                cost = consumer_cost(
                    ds, tok, layout, n_batches=n_batches, step_s=step_s, device=device, **settings
                )
                cost["producer_us_per_cell"] = producer_cost(ds, tok, layout, **settings)
                report[f"{tok}/{layout}/{on}"] = cost
    return report


def layout_table(report: dict[str, dict[str, Any]]) -> str:
    """:func:`layout_report`'s rows as a text table."""
    lines = [
        f"\n{'tokenizer/layout/tokenize_on':<30}{'tokens/batch':>13}{'real':>9}{'B/cell':>9}"
        f"{'next p50 ms':>12}{'p99 ms':>9}  producer us/cell"
    ]
    for name, r in report.items():
        prod = ", ".join(f"{k} {v:.1f}" for k, v in r["producer_us_per_cell"].items())
        lines.append(
            f"{name:<30}{r['tokens_per_batch']:>13,.0f}{r['real_tokens_per_batch']:>9,.0f}"
            f"{r['bytes_per_cell']:>9,.0f}{r['next_ms_p50']:>12.3f}{r['next_ms_p99']:>9.3f}  {prod}"
        )
    return "\n".join(lines)
