"""The token stage: one producer entry builds rank -> tokenize -> batch -> layout from the
loader's TokenStage, whose work runs ahead on a worker of its own, tags kept."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from slafload import open_dataset
from slafload.config import LoaderConfig
from slafload.kernels import Kernels
from slafload.pipeline.chunk import assemble
from slafload.pipeline.partition import Leg, Tagged
from slafload.pipeline.reader import Reader
from slafload.pipeline.tokenize import TokenWorker, make_token_stage, token_stages
from slafload.samplers import Streaming
from slafload.tokenizers import Geneformer


def test_the_token_worker_works_ahead_and_raises_failures_in_their_turn():
    threads = []

    def work(piece):
        threads.append(threading.current_thread().name)
        if piece == 2:
            raise ValueError("piece 2")
        return piece * 10

    stage = TokenWorker(iter([Tagged(1), Tagged(2), Tagged(3, ends=True)]), work, lookahead=1)
    assert next(stage).item == 10
    with pytest.raises(ValueError, match="piece 2"):
        next(stage)
    last = next(stage)
    assert (last.item, last.ends) == (30, True)  # the piece's tag travels with its result
    stage.close()
    assert set(threads) and all(name.startswith("slafload-tokens") for name in threads)
    assert not [t for t in threading.enumerate() if t.name.startswith("slafload-tokens")]


def test_a_piece_is_prepared_on_the_producer_only_while_the_worker_is_busy():
    go, where = threading.Event(), {}

    def prepare(x):
        if isinstance(x, tuple):
            return x
        where[x] = threading.current_thread().name
        if x == 3:
            go.set()  # prepared here because piece 2's work is still running
        return ("ready", x)

    def work(x):
        _, x = prepare(x)
        if x == 2:
            assert go.wait(10)
        return x * 10

    pieces = iter([Tagged(1), Tagged(2), Tagged(3), Tagged(4, ends=True)])
    stage = TokenWorker(pieces, work, lookahead=1, prepare=prepare)
    assert [next(stage).item for _ in range(4)] == [10, 20, 30, 40]
    stage.close()
    assert where[1].startswith("slafload-tokens")  # the worker was free
    assert where[2].startswith("slafload-tokens")
    assert where[3] == threading.current_thread().name  # the worker was busy with piece 2


def test_two_token_workers_work_on_two_pieces_at_once_and_hand_them_on_in_order():
    both = threading.Barrier(2, timeout=10)  # broken unless two pieces are worked at once

    def work(piece):
        if 1 <= piece <= 4:  # the first piece goes out alone; then two at a time
            both.wait()
        return piece * 10

    pieces = iter([Tagged(i, ends=i == 5) for i in range(6)])
    # One piece ahead: while the producer waits for piece i, piece i + 1 is worked on too.
    stage = TokenWorker(pieces, work, lookahead=1, workers=2)
    assert [t.item for t in stage] == [0, 10, 20, 30, 40, 50]
    stage.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("slafload-tokens")]


def test_built_in_tokenizers_get_two_token_workers_and_others_one(small_slaf):
    config, kernels = LoaderConfig(max_genes=8), Kernels("numpy")
    assert make_token_stage(Geneformer(max_genes=8), config, kernels).workers == 2

    class Mine(Geneformer):
        def __call__(self, ranked, **kw):
            return super().__call__(ranked, **kw)

    assert make_token_stage(Mine(max_genes=8), config, kernels).workers == 1


def test_one_entry_builds_the_token_work_and_batches_each_leg(small_slaf):
    ds = open_dataset(small_slaf)
    config = LoaderConfig(batch_size=16, max_genes=8)
    kernels = Kernels(config.kernels)
    tokens = make_token_stage(Geneformer(max_genes=8), config, kernels)
    plan = Streaming(chunk_cells=50).plan(ds.n_cells, seed=0, epoch=0)
    fetches = [plan[0], plan[1]]
    leg = Leg(0, (), 0, rows=100, cells=100)
    pieces = []
    for i, fetch in enumerate(fetches):
        chunk = assemble(fetch, Reader(ds).read(fetch), ds.cell_start)
        pieces.append(Tagged(chunk, leg, ends=i == 1))
    built = []

    def observe(name, stage):
        built.append(name)
        return stage

    stages = token_stages(
        iter(pieces), tokens, obs={}, batch_size=16, drop_last=False, kernels=kernels,
        observe=observe,
    )  # fmt: skip
    out = list(stages)
    stages.close()
    assert built == ["rank", "batch", "layout"]
    assert [len(b.item["cell_integer_id"]) for b in out] == [16] * 6 + [4]
    assert [b.done for b in out] == [16, 32, 48, 64, 80, 96, 100]
    assert all(b.leg is leg for b in out)
    ids = np.concatenate([b.item["cell_integer_id"] for b in out])
    np.testing.assert_array_equal(ids, np.arange(100))
    assert out[0].item["input_ids"].shape == (16, 8)


def test_the_token_worker_gathers_cut_pieces_as_split_would(small_slaf):
    from slafload.pipeline.chunk import cuts, shuffle

    ds = open_dataset(small_slaf)
    config = LoaderConfig(batch_size=16, max_genes=8)
    kernels = Kernels(config.kernels)
    tokens = make_token_stage(Geneformer(max_genes=8), config, kernels)
    fetch = Streaming(chunk_cells=100).plan(ds.n_cells, seed=0, epoch=0)[0]
    chunk = shuffle(assemble(fetch, Reader(ds).read(fetch), ds.cell_start), 5)

    def batches(pieces):
        stages = token_stages(iter([Tagged(p) for p in pieces]), tokens, obs={}, batch_size=16,
                              drop_last=False, kernels=kernels)  # fmt: skip
        out = [b.item for b in stages]
        stages.close()
        return out

    cut = list(cuts(chunk, 3, 90, 32))
    assert all(c.chunk is chunk for c in cut)  # handed on ungathered
    for got, want in zip(batches(cut), batches([c.gather(kernels) for c in cut]), strict=True):
        assert got.keys() == want.keys()
        for key in got:
            np.testing.assert_array_equal(got[key], want[key])
