"""The producer's time per stage: the loader's real chain run on this thread with each stage
timed (``slafload bench --full``'s stage profile).
"""

from __future__ import annotations

import itertools
import time
from contextlib import closing
from typing import Any

import numpy as np

import slafload
from slafload.config import Tuning
from slafload.pipeline.chain import build_chain
from slafload.pipeline.epochs import build_run
from slafload.pipeline.stage import Stage
from slafload.presets import make_preset
from slafload.tokenizers import make_tokenizer
from slafload.tools.bench_runs import PRESETS, preset_options
from slafload.types import ChunkTransform


class _Timed(Stage[Any]):
    """Times the ``__next__`` of the stage it wraps (the stages before it included)."""

    def __init__(self, stage: Stage[Any]):
        super().__init__(stage)
        self.seconds = 0.0

    def __next__(self) -> Any:
        t0 = time.perf_counter()
        try:
            return next(self.source)
        finally:
            self.seconds += time.perf_counter() - t0


def profile_stages(ds, tokenizer_name: str, args, n_batches: int = 400) -> dict[str, float]:
    """Microseconds per cell that the producer thread spends in each stage of the real chain.

    Runs :func:`slafload.pipeline.chain.build_chain`, as the loader does, on this thread with no read
    ahead, so each stage's time is its own: time inside a stage's ``__next__`` minus the time
    inside its source's. Work that Lance, Polars and the rank stage's worker (ranking and
    tokenizing, one piece ahead) do on their own threads counts only where the producer waits
    for it: under ``rank``.
    """
    config = slafload.LoaderConfig(
        batch_size=args.batch_size, max_genes=args.max_genes, tuning=Tuning(read_ahead=0)
    )
    transforms: tuple[ChunkTransform, ...] = ()
    if tokenizer_name in PRESETS:  # a model's tokenizer and its transforms (gene mapping...)
        preset = make_preset(tokenizer_name, ds, **preset_options(ds, tokenizer_name))
        tokenizer, transforms = preset.tokenizer, tuple(preset.transforms)
    else:
        tokenizer = make_tokenizer(tokenizer_name, max_genes=args.max_genes)
    sampler = slafload.samplers.ChunkShuffle(chunk_cells=config.chunk_cells)
    run, _ = build_run(ds, tokenizer, config, sampler, transforms=transforms)
    timed: dict[str, _Timed] = {}

    def observe(name: str, stage: Stage[Any]) -> Stage[Any]:
        timed[name] = _Timed(stage)
        return timed[name]

    cells = 0
    with closing(build_chain(run.spec, run.share(0).parts(), observe=observe)) as chain:
        for batch in itertools.islice(chain, n_batches):
            cells += len(batch.item["cell_integer_id"])
    names, inclusive = list(timed), [t.seconds for t in timed.values()]
    own = np.diff([0.0, *inclusive])
    return {name: float(t) / cells * 1e6 for name, t in zip(names, own, strict=True)}
