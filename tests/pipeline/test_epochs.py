"""Epochs through one chain: a run's epochs follow each other through one chain of stages
(the next epoch's reads start before this one's last batch is out), delivering exactly what
one chain per epoch delivers, with the same positions; epoch-aware chains are rebuilt."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import slafload.pipeline.epochs
import slafload.pipeline.reader
from slafload import open_dataset
from slafload.config import LoaderConfig
from slafload.data.sources import PerSource
from slafload.errors import LoaderError
from slafload.pipeline.batcher import Batches
from slafload.pipeline.chain import ChainSpec
from slafload.pipeline.epochs import Delivery, Position, Run
from slafload.pipeline.partition import Leg, RankShare, Tagged
from slafload.samplers import BlockShuffle, ChunkShuffle, Streaming
from slafload.tokenizers import Geneformer
from slafload.transforms import LogNormalize
from slafload.types import Chunk

SAMPLERS = {
    "streaming": Streaming(chunk_cells=64),
    "chunk": ChunkShuffle(chunk_cells=48),
    "block": BlockShuffle(block_size=4, fetch_factor=3),
}


def make_run(ds, sampler, *, n_epochs=3, rank=0, world_size=1, transforms=(), **config):
    config = LoaderConfig(batch_size=10, n_epochs=n_epochs, seed=5, **config)
    if isinstance(sampler, BlockShuffle):
        sampler = dataclasses.replace(sampler, batch_size=config.batch_size)
    spec = ChainSpec(ds, Geneformer(max_genes=8), config, transforms=tuple(transforms))
    return Run(spec, sampler, rank=rank, world_size=world_size)


def per_epoch(run: Run) -> list[Delivery]:
    """The run as one chain per epoch: the reference the shared chain must match."""
    out, position = [], Position()
    while not run.complete(position):
        epoch = list(run.epoch(position.epoch, position.history, position.cells))
        if epoch:
            last = epoch[-1]
            out += [*epoch[:-1], Delivery(last.batch, Position(position.epoch + 1))]
        position = Position(position.epoch + 1)
    return out


def assert_same(got: list[Delivery], want: list[Delivery]) -> None:
    assert [d.after for d in got] == [d.after for d in want]
    for a, b in zip(got, want, strict=True):
        assert a.batch.keys() == b.batch.keys()
        for key in a.batch:
            np.testing.assert_array_equal(a.batch[key].numpy(), b.batch[key].numpy())


def count_chains(monkeypatch) -> list[int]:
    built: list[int] = []
    build = slafload.pipeline.epochs.build_chain

    def counting(*args, **kwargs):
        built.append(1)
        return build(*args, **kwargs)

    monkeypatch.setattr(slafload.pipeline.epochs, "build_chain", counting)
    return built


@pytest.mark.parametrize("name", sorted(SAMPLERS))
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("rank", "world_size"), [(0, 1), (1, 3)])
def test_epochs_share_one_chain_and_deliver_what_a_chain_per_epoch_does(
    small_slaf, monkeypatch, name, drop_last, rank, world_size
):
    run = make_run(
        open_dataset(small_slaf), SAMPLERS[name], rank=rank, world_size=world_size,
        drop_last=drop_last,
    )  # fmt: skip
    want = per_epoch(run)
    built = count_chains(monkeypatch)
    got = list(run.run(Position()))
    assert len(built) == 1
    assert_same(got, want)
    share = run.share(0).quota
    per = share // 10 * 10 if drop_last else share
    ends = [d for d in got if d.after.cells == 0]
    assert [d.after.epoch for d in ends] == [1, 2, 3]
    for epoch in range(3):  # every cell of the epoch's share exactly once, no batch across
        cells = np.concatenate(
            [d.batch["cell_integer_id"].numpy() for d in got if _epoch_of(d, got) == epoch]
        )
        assert len(cells) == per and len(np.unique(cells)) == per


def _epoch_of(delivery: Delivery, run: list[Delivery]) -> int:
    """The epoch a delivery belongs to: the one its position is in, or just ended."""
    after = delivery.after
    return after.epoch - 1 if after.cells == 0 else after.epoch


@pytest.mark.parametrize("name", ["chunk", "block"])
def test_resuming_at_any_position_of_a_shared_chain_delivers_the_rest_exactly(small_slaf, name):
    run = make_run(open_dataset(small_slaf), SAMPLERS[name])
    full = list(run.run(Position()))
    for k in range(0, len(full) - 1, 7):
        assert_same(list(run.run(full[k].after)), full[k + 1 :])
    assert list(run.run(full[-1].after)) == []  # the run is complete


def test_an_endless_run_flows_through_one_chain(small_slaf, monkeypatch):
    run = make_run(open_dataset(small_slaf), SAMPLERS["chunk"], n_epochs=None)
    built = count_chains(monkeypatch)
    deliveries = run.run(Position())
    got = [next(deliveries) for _ in range(4 * 30 + 3)]  # 300 cells, 30 batches per epoch
    deliveries.close()
    assert len(built) == 1
    assert [d.after for d in got if d.after.cells == 0] == [Position(e) for e in (1, 2, 3, 4)]


def test_the_next_epoch_is_read_before_this_one_ends(small_slaf, monkeypatch):
    events: list[str] = []
    read = slafload.pipeline.reader.Reader.read

    def recording(self, fetch, **kw):
        events.append("read")
        yield from read(self, fetch, **kw)

    monkeypatch.setattr(slafload.pipeline.reader.Reader, "read", recording)
    ds, sampler = open_dataset(small_slaf), ChunkShuffle(chunk_cells=100)
    for delivery in make_run(ds, sampler, n_epochs=1).run(Position()):
        events.append(f"batch {delivery.after}")
    alone = events.count("read")  # the reads epoch 0 needs (3 fetches, the first split)
    assert alone >= 3
    events.clear()
    for delivery in make_run(ds, sampler, n_epochs=2).run(Position()):
        events.append(f"batch {delivery.after}")
    last_of_epoch_0 = events.index(f"batch {Position(1)}")
    assert events[:last_of_epoch_0].count("read") > alone


class EpochTag:
    """An epoch-aware transform: records which epoch's binding saw which cells."""

    def __init__(self, seen: list, epoch: int | None = None):
        self.seen, self.epoch = seen, epoch

    def for_epoch(self, epoch: int) -> EpochTag:
        return EpochTag(self.seen, epoch)

    def __call__(self, chunk: Chunk) -> Chunk:
        self.seen.append((self.epoch, chunk.cell_ids.copy()))
        return chunk


def test_an_epoch_aware_chain_is_rebuilt_for_every_epoch(small_slaf, monkeypatch):
    seen: list = []
    run = make_run(open_dataset(small_slaf), SAMPLERS["chunk"], transforms=[EpochTag(seen)])
    built = count_chains(monkeypatch)
    got = list(run.run(Position()))
    assert len(built) == 3
    assert sorted({epoch for epoch, _ in seen}) == [0, 1, 2]
    for epoch in range(3):
        tagged = np.concatenate([cells for e, cells in seen if e == epoch])
        delivered = np.concatenate(
            [d.batch["cell_integer_id"].numpy() for d in got if _epoch_of(d, got) == epoch]
        )
        np.testing.assert_array_equal(np.sort(tagged), np.sort(delivered))


def test_a_mixture_transform_without_epoch_aware_parts_keeps_the_chain():
    plain = PerSource(np.array([0, 10]), ((),))
    assert plain.for_epoch(3) is plain
    aware = PerSource(np.array([0, 10]), ((EpochTag([]),),))
    assert aware.for_epoch(3).transforms[0][0].epoch == 3


@pytest.mark.parametrize(
    ("n_epochs", "error"),
    [(2, "epoch 0 ended 1 cells short"), (1, "epoch 0 ended 1 cells short")],
)
def test_a_chain_that_loses_cells_fails_loudly(small_slaf, monkeypatch, n_epochs, error):
    cells = RankShare.cells  # plan one cell more per epoch than the parts deliver
    monkeypatch.setattr(RankShare, "cells", lambda self, *a: cells(self, *a) + 1)
    run = make_run(open_dataset(small_slaf), SAMPLERS["chunk"], n_epochs=n_epochs)
    with pytest.raises(LoaderError, match=error):
        list(run.run(Position()))


def test_epochs_that_deliver_nothing_still_move_the_position_on(small_slaf):
    run = make_run(open_dataset(small_slaf), SAMPLERS["chunk"], drop_last=True)
    got = list(run.run(Position(0, 295)))  # drop_last eats the 5 cells left of epoch 0
    assert got[0].after == Position(1, 10)
    assert [d.after for d in got if d.after.cells == 0] == [Position(2), Position(3)]
    config = LoaderConfig(batch_size=128, n_epochs=3, seed=5, drop_last=True)
    spec = ChainSpec(open_dataset(small_slaf), Geneformer(max_genes=8), config)
    short = Run(spec, SAMPLERS["chunk"], rank=1, world_size=3)  # 100 cells an epoch
    assert list(short.run(Position())) == [] and short.batches_in_epoch() == 0
    # a DataLoader worker with no part of the epoch delivers nothing, and ends
    assert (
        list(
            make_run(open_dataset(small_slaf), SAMPLERS["streaming"]).epoch(
                0, worker=7, n_workers=8
            )
        )
        == []
    )


def test_an_epoch_whose_parts_all_vanish_fails_loudly(small_slaf, monkeypatch):
    parts = RankShare.parts

    def losing(self, skip=0, worker=0, n_workers=1, leg=None):
        return (
            iter(())
            if leg is not None and leg.epoch == 1
            else parts(self, skip, worker, n_workers, leg)
        )

    monkeypatch.setattr(RankShare, "parts", losing)
    run = make_run(open_dataset(small_slaf), SAMPLERS["chunk"], n_epochs=3)
    with pytest.raises(LoaderError, match="epoch 1 ended 300 cells short of its plan"):
        list(run.run(Position()))


def rows(n: int, start: int = 0) -> dict[str, np.ndarray]:
    return {"cell_integer_id": np.arange(start, start + n)}


def piece(leg: Leg, n: int, start: int = 0, *, ends: bool = False) -> Tagged:
    return Tagged(rows(n, start), leg, ends)


def legs(*planned: int, batch_size: int = 4, drop_last: bool = False) -> list[Leg]:
    return [Leg(e, (), 0, n, n - n % batch_size if drop_last else n) for e, n in enumerate(planned)]


@pytest.mark.parametrize(("drop_last", "sizes"), [(False, [4, 1, 4, 3]), (True, [4, 4])])
def test_batches_end_every_epoch_where_its_rows_end(drop_last, sizes):
    a, _, c = legs(5, 0, 7, drop_last=drop_last)  # epoch 1 has no rows: no piece of it comes
    pieces = [piece(a, 3), piece(a, 2, 3, ends=True), piece(c, 6, 5), piece(c, 1, 11, ends=True)]
    out = list(Batches(iter(pieces), 4, drop_last=drop_last))
    assert [len(b.item["cell_integer_id"]) for b in out] == sizes
    ids = np.concatenate([b.item["cell_integer_id"] for b in out])
    want = list(range(12))
    assert ids.tolist() == (want if not drop_last else [0, 1, 2, 3, 5, 6, 7, 8])
    # every batch carries its leg and the leg's cells done after it
    want_tags = [(0, 4), (0, 5), (2, 4), (2, 7)] if not drop_last else [(0, 4), (2, 4)]
    assert [(b.leg.epoch, b.done) for b in out] == want_tags


def test_batches_pass_over_an_empty_piece_at_an_epoch_end():
    a, b = legs(5, 2)
    pieces = [piece(a, 5), piece(a, 0, 5, ends=True), piece(b, 2, 5), piece(b, 0, 7, ends=True)]
    out = list(Batches(iter(pieces), 4))
    assert [b.item["cell_integer_id"].tolist() for b in out] == [[0, 1, 2, 3], [4], [5, 6]]


def test_untagged_pieces_are_one_epoch_ended_by_the_end_of_the_stream():
    out = list(Batches(iter([Tagged(rows(3)), Tagged(rows(3, 3))]), 4))
    assert [(b.item["cell_integer_id"].tolist(), b.leg, b.done) for b in out] == [
        ([0, 1, 2, 3], None, 4),
        ([4, 5], None, 6),
    ]


def test_batches_refuse_pieces_that_lose_or_duplicate_cells_of_their_epoch():
    a, b = legs(5, 7)
    with pytest.raises(LoaderError, match="a piece of 3 rows arrived with 2 rows left in epoch 0"):
        list(Batches(iter([piece(a, 3), piece(a, 3, ends=True)]), 4))
    with pytest.raises(LoaderError, match="2 rows arrived after the last planned epoch"):
        list(Batches(iter([piece(a, 5, ends=True), piece(a, 2)]), 4))
    with pytest.raises(LoaderError, match="epoch 0 ended 2 cells short of its plan"):
        list(Batches(iter([piece(a, 3, ends=True)]), 4))
    with pytest.raises(LoaderError, match="epoch 0 ended 2 cells short of its plan"):
        list(Batches(iter([piece(a, 3), piece(b, 7, ends=True)]), 4))  # its end never came
    with pytest.raises(LoaderError, match="epoch 1 ended 1 cells short of its plan"):
        list(Batches(iter([piece(a, 5, ends=True), piece(b, 6)]), 4))  # the stream ended


def test_one_factory_builds_a_datasets_run_from_the_loaders_settings_alone(tmp_path):
    from conftest import random_counts, write_dense

    from slafload.pipeline.epochs import build_run

    plates = {"plate": [f"p{i % 2}" for i in range(30)]}
    ds = open_dataset(write_dense(tmp_path / "a.slaf", random_counts(30, 12), obs=plates))
    mine = LogNormalize()
    sampler = BlockShuffle(block_size=4, fetch_factor=3)
    run, categories = build_run(
        ds, Geneformer(max_genes=8), LoaderConfig(batch_size=10), sampler,
        transforms=[mine], obs_columns=["plate"], rank=1, world_size=2,
    )  # fmt: skip
    assert categories == {"plate": ["p0", "p1"]}
    assert list(run.spec.obs) == ["plate"] and run.spec.transforms == (mine,)
    assert run.sampler == dataclasses.replace(sampler, batch_size=10)  # planned for the batches
    assert (run.rank, run.world_size) == (1, 2)


def test_one_factory_adds_what_a_mixture_brings_after_the_loaders_own(tmp_path):
    from conftest import random_counts, write_dense

    from slafload import Mixture
    from slafload.pipeline.epochs import build_run
    from slafload.samplers.mixed import MixtureSampler

    paths = [write_dense(tmp_path / f"{k}.slaf", random_counts(20, 12, seed=k)) for k in (1, 2)]
    mix = Mixture(paths, vocabulary="union")
    mine = LogNormalize()
    run, categories = build_run(
        mix, Geneformer(max_genes=8), LoaderConfig(batch_size=10), Streaming(chunk_cells=8),
        transforms=[mine],
    )  # fmt: skip
    assert categories == {}
    assert run.spec.transforms == (mix.transform, mine)  # the sources' own work first
    assert set(run.spec.obs) == {"source", "cell_integer_id"}
    assert isinstance(run.sampler, MixtureSampler)
