"""The chain of stages: read-ahead reads later fetches while the current one is computed;
failures keep their place in the order; the chain names every stage."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest
import torch

import slafload.pipeline.reader
from slafload import Loader, open_dataset
from slafload.config import LoaderConfig, Tuning
from slafload.pipeline import budget
from slafload.pipeline.chain import ChainSpec, build_chain
from slafload.pipeline.chunk import Assemble, Shuffle, Split, Transform
from slafload.pipeline.epochs import Run
from slafload.pipeline.partition import RankShare
from slafload.pipeline.read import Read, RetryingReader
from slafload.pipeline.reader import COLUMNS, Reader
from slafload.pipeline.stage import Stage
from slafload.samplers import BlockShuffle, ChunkShuffle, Streaming
from slafload.tokenizers import Geneformer


def pieces(ds, config, reader):
    """The chain up to compute pieces, as the loader builds it, for epoch 0 of one rank."""
    run = Run(ChainSpec(ds, Geneformer(max_genes=8), config), Streaming(chunk_cells=32))
    read = Read(
        run.share(0).parts(),
        reader,
        ds.cell_start,
        row_bytes=budget.row_bytes(ds.expression.schema, COLUMNS),
        read_ahead=config.tuning.read_ahead,
        memory_budget=config.tuning.memory_budget,
    )
    return Split(Transform(Shuffle(Assemble(read, ds)), ()), config.tuning.piece_cells)


class RecordingReader(Reader):
    """A real Reader that logs when a fetch's read begins (its generator is first advanced)."""

    def __init__(self, dataset, events: list[tuple[str, int]]):
        super().__init__(dataset)
        self.events = events

    def read(self, fetch, **kw):
        self.events.append(("read", fetch.index))
        yield from super().read(fetch, **kw)


@pytest.mark.parametrize("read_ahead", [0, 1, 2])
def test_the_next_fetches_are_read_before_the_current_one_is_computed(small_slaf, read_ahead):
    ds = open_dataset(small_slaf)
    config = LoaderConfig(chunk_cells=32, tuning=Tuning(read_ahead=read_ahead))
    events: list[tuple[str, int]] = []
    reader = RetryingReader(RecordingReader(ds, events), config.tuning.retry)
    for tagged in pieces(ds, config, reader):
        piece, k = tagged.item, tagged.item.fetch_index
        np.testing.assert_array_equal(piece.cell_ids // 32, k)
        # The run's first fetch is handed on before reading ahead (first batch latency);
        # later reads ahead begin on the read thread, without the consumer pulling more.
        last = min(k + (read_ahead if k else 0), 9)
        deadline = time.monotonic() + 10
        while ("read", last) not in events and time.monotonic() < deadline:
            time.sleep(0.001)
        assert max(index for kind, index in events if kind == "read") == last
        events.append(("piece", k))
    assert Counter(kind for kind, _ in events) == {"read": 10, "piece": 10}  # 300 cells / 32


@pytest.mark.parametrize("read_ahead", [0, 1, 3])
@pytest.mark.parametrize(
    "sampler",
    [ChunkShuffle(chunk_cells=48), BlockShuffle(block_size=4, fetch_factor=3)],
    ids=["chunk", "block"],
)
def test_read_ahead_changes_nothing_the_consumer_sees(small_slaf, sampler, read_ahead):
    def run(read_ahead: int) -> list[dict[str, np.ndarray]]:
        with Loader(
            small_slaf,
            sampler=sampler,
            batch_size=16,
            chunk_cells=32,
            n_epochs=2,
            seed=4,
            tuning=Tuning(read_ahead=read_ahead),
        ) as loader:
            return [{k: v.numpy() for k, v in b.items()} for b in loader]

    batches, reference = run(read_ahead), run(1)
    ids = np.concatenate([b["cell_integer_id"] for b in batches])
    for epoch in np.split(ids, 2):
        np.testing.assert_array_equal(np.sort(epoch), np.arange(300))
    assert len(batches) == len(reference)
    for got, want in zip(batches, reference, strict=True):
        assert got.keys() == want.keys()
        assert all(np.array_equal(got[k], want[k]) for k in got)


def test_a_failed_read_ahead_is_retried_when_its_turn_comes(small_slaf, monkeypatch):
    calls: Counter[int] = Counter()

    class FailsOnce(Reader):
        def read(self, fetch, **kw):
            calls[fetch.index] += 1
            if fetch.index == 1 and calls[1] == 1:
                raise OSError("injected fault while reading ahead")
            yield from super().read(fetch, **kw)

    monkeypatch.setattr(slafload.pipeline.reader, "Reader", FailsOnce)
    with Loader(small_slaf, batch_size=16, chunk_cells=32, shuffle=False) as loader:
        ids = np.concatenate([b["cell_integer_id"].numpy() for b in loader])
    np.testing.assert_array_equal(ids, np.arange(300))
    assert calls[1] == 2 and all(calls[i] == 1 for i in calls if i != 1)


@pytest.mark.parametrize("bad", [-1, 9, 1.0, True])
def test_read_ahead_is_validated(bad):
    with pytest.raises(ValueError, match=r"read_ahead must be an integer in \[0, 8\]"):
        Tuning(read_ahead=bad)


def test_a_failure_to_plan_a_later_fetch_comes_after_the_earlier_fetches(small_slaf, monkeypatch):
    part = RankShare.part

    def failing_part(self, j, rank):
        if j == 2:
            raise RuntimeError("planning fetch 2 failed")
        return part(self, j, rank)

    monkeypatch.setattr(RankShare, "part", failing_part)
    ds = open_dataset(small_slaf)
    config = LoaderConfig(chunk_cells=32, tuning=Tuning(read_ahead=2))
    reader = RetryingReader(Reader(ds), config.tuning.retry)
    got = []
    with pytest.raises(RuntimeError, match="planning fetch 2 failed"):
        for piece in pieces(ds, config, reader):
            got.append(piece.item.fetch_index)
    assert got == [0, 1]


STAGES = [
    "read", "assemble", "shuffle", "transform", "split", "rank", "batch", "layout"
]  # fmt: skip


def test_one_function_builds_the_chain_naming_every_stage_in_order(small_slaf):
    ds = open_dataset(small_slaf)
    run = Run(ChainSpec(ds, Geneformer(max_genes=8), LoaderConfig()), Streaming(chunk_cells=32))
    built, closed = [], []

    class Observed(Stage):
        def __init__(self, name, stage):
            super().__init__(stage)
            self.name = name

        def __next__(self):
            return next(self.source)

        def close(self):
            closed.append(self.name)
            super().close()

    def observe(name, stage):
        built.append(name)
        return Observed(name, stage)

    chain = build_chain(run.spec, run.share(0).parts(), observe=observe)
    assert built == [*STAGES, "to_torch"]
    first = next(chain).item
    assert isinstance(first["input_ids"], torch.Tensor) and len(first["cell_integer_id"]) == 32
    chain.close()  # mid-epoch: every stage is closed, from the last back to the first
    assert closed == ["to_torch", *reversed(STAGES)]
    with Loader(small_slaf, max_genes=8, chunk_cells=32, shuffle=False) as loader:
        np.testing.assert_array_equal(first["input_ids"].numpy(), next(iter(loader))["input_ids"])
