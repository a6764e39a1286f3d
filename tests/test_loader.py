"""The loader end to end: real Lance datasets, a real producer thread, torch tensors out."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from conftest import geneformer_reference, random_counts, write_dense

from slafload import Loader, LoaderConfig, Tuning, open_dataset
from slafload.pipeline import chain
from slafload.samplers import BlockShuffle, Streaming

pytestmark = pytest.mark.usefixtures("no_thread_leak")


def epoch_cells(loader) -> np.ndarray:
    return np.concatenate([b["cell_integer_id"].numpy() for b in loader])


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("batch_size", [1, 7, 32])
def test_every_cell_appears_exactly_once_per_epoch(small_slaf, shuffle, batch_size):
    with Loader(
        small_slaf, batch_size=batch_size, max_genes=16, chunk_cells=40, shuffle=shuffle, n_epochs=2
    ) as loader:
        both = epoch_cells(loader)  # one iteration runs the whole two-epoch run
    assert len(both) == 600
    for cells in (both[:300], both[300:]):
        np.testing.assert_array_equal(np.sort(cells), np.arange(300))
        if not shuffle:
            np.testing.assert_array_equal(cells, np.arange(300))


def test_batches_are_full_except_the_last_and_drop_last_drops_it(small_slaf):
    with Loader(small_slaf, batch_size=32, chunk_cells=50, max_genes=8) as loader:
        sizes = [len(b["cell_integer_id"]) for b in loader]
        assert sizes == [32] * 9 + [12] and len(loader) == 10
    with Loader(small_slaf, batch_size=32, chunk_cells=50, drop_last=True) as loader:
        assert [len(b["cell_integer_id"]) for b in loader] == [32] * 9 and len(loader) == 9


def test_batches_hold_gpu_ready_tensors_matching_the_reference(small_slaf, small_counts):
    with Loader(small_slaf, batch_size=16, max_genes=10, shuffle=True) as loader:
        batch = next(iter(loader))
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (16, 10)
    assert batch["attention_mask"].dtype == torch.bool
    assert batch["cell_integer_id"].dtype == torch.int64
    want = np.stack(
        [geneformer_reference(small_counts[c], 10) for c in batch["cell_integer_id"].numpy()]
    )
    np.testing.assert_array_equal(batch["input_ids"].numpy(), want)


def test_each_epoch_reshuffles_and_the_same_seed_repeats(small_slaf):
    def orders(seed):
        with Loader(small_slaf, seed=seed, chunk_cells=64, n_epochs=2) as loader:
            cells = epoch_cells(loader)
        return cells[:300], cells[300:]

    e0, e1 = orders(0)
    assert not np.array_equal(e0, e1)
    np.testing.assert_array_equal(np.sort(e1), np.arange(300))
    again0, again1 = orders(0)
    np.testing.assert_array_equal(e0, again0)
    np.testing.assert_array_equal(e1, again1)
    assert not np.array_equal(orders(1)[0], e0)


def test_endless_loader_keeps_going_across_epochs(small_slaf):
    with Loader(small_slaf, batch_size=100, n_epochs=None, chunk_cells=64) as loader:
        it = iter(loader)
        cells = np.concatenate([next(it)["cell_integer_id"].numpy() for _ in range(9)])
        assert loader.position.epoch == 3
    for k in range(3):
        np.testing.assert_array_equal(np.sort(cells[k * 300 : (k + 1) * 300]), np.arange(300))


def test_a_slow_consumer_never_loses_a_batch(small_slaf):
    with Loader(
        small_slaf, batch_size=5, tuning=Tuning(queue_depth=2), chunk_cells=64, max_genes=4
    ) as loader:
        seen = []
        for batch in loader:
            seen.append(batch["cell_integer_id"].numpy())
            if len(seen) < 4:
                time.sleep(0.2)  # the producer fills the 2-slot queue and must wait
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(300))


def test_breaking_out_then_iterating_again_resumes_without_loss(small_slaf):
    with Loader(small_slaf, batch_size=10, chunk_cells=64, tuning=Tuning(queue_depth=16)) as loader:
        it = iter(loader)
        first = [next(it)["cell_integer_id"].numpy() for _ in range(4)]
        time.sleep(0.2)  # let the producer run ahead; prefetched batches must not be lost
        assert loader.position.cells == 40
        rest = epoch_cells(loader)
    cells = np.concatenate([*first, rest])
    np.testing.assert_array_equal(np.sort(cells), np.arange(300))
    with Loader(small_slaf, batch_size=10, chunk_cells=64) as loader:
        np.testing.assert_array_equal(epoch_cells(loader), cells)


class Boom(RuntimeError):
    pass


class FailingTokenizer:
    name = "failing"

    def __init__(self, after: int):
        self.calls, self.after = 0, after

    def __call__(self, ranked):
        self.calls += 1
        if self.calls > self.after:
            raise Boom(f"tokenizer exploded on chunk {self.calls}")
        return {"x": np.zeros((ranked.n_cells, 1), dtype=np.int64)}


class FailingSampler:
    def plan(self, n_cells, *, seed, epoch):
        raise KeyError("plan exploded")


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"tokenizer": FailingTokenizer(after=1)}, Boom, "tokenizer exploded on chunk 2"),
        ({"sampler": FailingSampler()}, KeyError, "plan exploded"),
    ],
)
def test_a_producer_exception_reaches_the_consumer_with_its_type(small_slaf, kwargs, exc, message):
    with Loader(small_slaf, batch_size=8, chunk_cells=64, **kwargs) as loader:
        start = time.monotonic()
        with pytest.raises(exc, match=message):
            for _ in loader:
                pass
        assert time.monotonic() - start < 5


def test_a_read_failure_reaches_the_consumer(small_slaf):
    import shutil

    ds = open_dataset(small_slaf)
    shutil.rmtree(small_slaf / "expression.lance" / "data")
    with Loader(ds, batch_size=8) as loader, pytest.raises(Exception, match="fetch 0"):
        next(iter(loader))


@pytest.mark.parametrize("how", ["close", "with", "break"])
def test_closing_leaves_no_live_thread(small_slaf, how):
    def producers():
        return [t for t in threading.enumerate() if t.name == "slafload-producer"]

    loader = Loader(small_slaf, batch_size=2, tuning=Tuning(queue_depth=1), chunk_cells=32)
    if how == "with":
        with loader:
            next(iter(loader))
            assert producers()
    else:
        for _ in loader:
            break
        assert producers()
        loader.close()
    assert not producers()


def test_dropping_an_iterator_stops_its_thread(small_slaf):
    loader = Loader(small_slaf, batch_size=2, tuning=Tuning(queue_depth=1), chunk_cells=32)
    it = iter(loader)
    next(it)
    loader._active = None  # the only other reference
    del it
    assert not [t for t in threading.enumerate() if t.name == "slafload-producer"]


def test_settings_are_validated_with_clear_messages(small_slaf):
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        Loader(small_slaf, batch_size=0)
    with pytest.raises(ValueError, match="n_epochs must be a positive integer or None"):
        LoaderConfig(n_epochs=0)
    with pytest.raises(ValueError, match=r"reader must be one of \('auto', 'lance'\), got 'yes'"):
        Tuning(reader="yes")
    with pytest.raises(ValueError, match=r"read_threads must be an integer in \[1, 256\] or None"):
        Tuning(read_threads=0)
    with pytest.raises(ValueError, match="queue_depth must be a positive integer, got 0"):
        Loader(small_slaf, tuning=Tuning(queue_depth=0))
    with pytest.raises(ValueError, match="tuning must be a Tuning, got"):
        Loader(small_slaf, tuning={"read_ahead": 0})
    with pytest.raises(TypeError, match="unknown settings \\['batchsize'\\]"):
        Loader(small_slaf, batchsize=3)
    with pytest.raises(TypeError, match="sampler must implement plan"):
        Loader(small_slaf, sampler=object())
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory=True needs a CUDA device"):
            Loader(small_slaf, pin_memory=True)


def test_a_cpu_device_and_an_explicit_sampler_work(tmp_path):
    dense = random_counts(90, 20, seed=8, empty_every=4)
    path = write_dense(tmp_path / "d.slaf", dense)
    with Loader(
        path,
        tokenizer="scgpt",
        max_genes=8,
        device="cpu",
        sampler=Streaming(chunk_cells=25),
        batch_size=30,
    ) as loader:
        batches = list(loader)
    assert [b["values"].shape for b in batches] == [(30, 10)] * 3
    assert all(b["input_ids"].device.type == "cpu" for b in batches)
    np.testing.assert_array_equal(
        np.concatenate([b["cell_integer_id"] for b in batches]), np.arange(90)
    )


def test_batches_carry_requested_obs_columns_as_codes(tmp_path):
    dense = random_counts(60, 8, seed=5)
    plates = [f"plate_{i // 20}" for i in range(60)]
    path = write_dense(
        tmp_path / "o.slaf", dense, obs={"plate": plates, "donor": [i % 3 for i in range(60)]}
    )
    with Loader(path, obs_columns=["plate", "donor"], batch_size=16, chunk_cells=32) as loader:
        assert loader.obs_categories == {"plate": ["plate_0", "plate_1", "plate_2"], "donor": None}
        for batch in loader:
            cells = batch["cell_integer_id"].numpy()
            np.testing.assert_array_equal(batch["plate"].numpy(), cells // 20)
            np.testing.assert_array_equal(batch["donor"].numpy(), cells % 3)
    with pytest.raises(Exception, match="no obs column 'nope'"):
        Loader(path, obs_columns=["nope"])


def test_chunk_transforms_run_before_ranking(tmp_path):
    import dataclasses

    dense = random_counts(30, 6, seed=7)
    path = write_dense(tmp_path / "t.slaf", dense)

    def invert(chunk):  # lowest count becomes the highest rank
        return dataclasses.replace(chunk, values=(100 - chunk.values.astype(np.int64)))

    with Loader(
        path, transforms=[invert], tokenizer="raw", max_genes=6, batch_size=30, shuffle=False
    ) as loader:
        batch = next(iter(loader))
    for row, cell in enumerate(batch["cell_integer_id"].numpy()):
        n = int(batch["lengths"][row])
        got = batch["values"][row, :n].numpy()
        np.testing.assert_array_equal(got, np.sort(100.0 - dense[cell][dense[cell] > 0])[::-1])


@pytest.mark.parametrize(
    ("setting", "replacement"),
    [
        ("queue_depth", r"queue_depth: moved, use tuning=Tuning\(queue_depth=...\)"),
        ("read_ahead", r"read_ahead: moved, use tuning=Tuning\(read_ahead=...\)"),
        ("retry", r"retry: moved, use tuning=Tuning\(retry=...\)"),
        ("read_batch_rows", r"read_batch_rows: moved, use tuning=Tuning\(batch_rows=...\)"),
        ("read_data_files", r"read_data_files: removed.*, use tuning=Tuning\(reader='lance'\)"),
        ("read_flat", r"read_flat: removed.*, use tuning=Tuning\(reader='lance'\)"),
        ("read_mini_blocks", r"read_mini_blocks: removed.*, use tuning=Tuning\(reader='lance'\)"),
    ],
)
def test_a_moved_or_removed_setting_names_its_replacement(small_slaf, setting, replacement):
    with pytest.raises(TypeError, match=replacement):
        Loader(small_slaf, **{setting: 1})


def test_the_user_settings_come_first_and_the_tuning_is_one_nested_object():
    fields = list(LoaderConfig.__dataclass_fields__)
    assert fields[:4] == ["batch_size", "max_genes", "seed", "n_epochs"]
    assert fields[-1] == "tuning" and LoaderConfig().tuning == Tuning()


def test_lances_reader_everywhere_delivers_the_same_batches(small_slaf, monkeypatch):
    sampler = BlockShuffle(block_size=3, fetch_factor=4)
    real, options = chain.ReadOptions, []
    monkeypatch.setattr(
        chain, "ReadOptions", lambda **kw: options.append(real(**kw)) or options[-1]
    )

    def run(tuning: Tuning) -> list[np.ndarray]:
        with Loader(small_slaf, sampler=sampler, batch_size=16, max_genes=8, tuning=tuning) as ld:
            assert ld._run.spec.config.tuning is tuning
            return [b["input_ids"].numpy() for b in ld]

    auto, lance = run(Tuning()), run(Tuning(reader="lance"))
    assert [o.direct for o in options] == [None, False]  # decided by storage; take_scan
    assert len(auto) == len(lance) > 0
    for a, b in zip(auto, lance, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_loads_into_a_loader_with_other_tuning(small_slaf):
    with Loader(small_slaf, batch_size=10, chunk_cells=64, seed=3) as loader:
        it = iter(loader)
        head = [next(it)["cell_integer_id"].numpy() for _ in range(4)]
        state = loader.state_dict()
        rest = [b["cell_integer_id"].numpy() for b in it]
    tuning = Tuning(read_ahead=0, queue_depth=2, piece_cells=7, memory_budget=1 << 16)
    with Loader(small_slaf, batch_size=10, chunk_cells=64, seed=3, tuning=tuning) as loader:
        loader.load_state_dict(state)
        resumed = [b["cell_integer_id"].numpy() for b in loader]
    assert head and len(resumed) == len(rest)
    for a, b in zip(resumed, rest, strict=True):
        np.testing.assert_array_equal(a, b)
