"""Rows checked once per loader (Tuning.check_rows): a contiguous fetch of cells whose
rows were already compared with cell_start_index is read without cell_integer_id; the tokens
are the same, and rows that fail the check fail loudly and are never marked checked."""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import random_counts, write_dense

import slafload.pipeline.reader
from slafload import InconsistentDataError, Loader, LoaderConfig, Tuning, open_dataset
from slafload.pipeline.chunk import Assemble
from slafload.pipeline.partition import Part
from slafload.pipeline.ranges import RangeSet
from slafload.pipeline.read import Group
from slafload.pipeline.reader import Reader
from slafload.samplers import BlockShuffle, ChunkShuffle, Fetch


def test_a_range_set_answers_like_a_set_of_integers_and_keeps_runs_merged():
    rng = np.random.default_rng(0)
    for _ in range(50):
        ranges, members = RangeSet(), set()
        for _ in range(int(rng.integers(1, 30))):
            start = int(rng.integers(0, 200))
            stop = start + int(rng.integers(0, 25))
            ranges.add(start, stop)
            members |= set(range(start, stop))
            runs = sum(1 for i in members if i - 1 not in members)
            assert len(ranges) == runs
        for _ in range(200):
            start = int(rng.integers(-5, 230))
            stop = start + int(rng.integers(0, 30))
            assert ranges.covers(start, stop) == (set(range(start, stop)) <= members)


def test_touching_ranges_merge_into_one_run():
    ranges = RangeSet()
    ranges.add(10, 20)
    ranges.add(30, 40)
    assert len(ranges) == 2 and not ranges.covers(15, 35)
    ranges.add(20, 30)
    assert len(ranges) == 1 and ranges.covers(10, 40) and not ranges.covers(9, 11)
    assert ranges.covers(5, 5)  # an empty range


def test_a_full_range_set_adds_only_what_merges():
    ranges = RangeSet(max_runs=2)
    assert ranges.add(0, 10) and ranges.add(20, 30)
    assert not ranges.add(40, 50) and not ranges.covers(40, 50) and len(ranges) == 2
    assert ranges.add(30, 35) and ranges.covers(20, 35)  # touches a run: merged
    assert ranges.add(10, 20) and len(ranges) == 1 and ranges.covers(0, 35)
    assert ranges.add(40, 50) and len(ranges) == 2  # room again


@pytest.fixture
def dataset(tmp_path):
    dense = random_counts(200, 25, seed=5, density=0.4, empty_every=13)
    return open_dataset(write_dense(tmp_path / "c.slaf", dense, max_rows_per_file=150))


def test_a_contiguous_read_leaves_the_cell_ids_out_only_when_allowed(dataset):
    reader = Reader(dataset)
    one = Fetch(0, np.array([[17, 160]]))
    full = pa.Table.from_batches(list(reader.read(one)))
    lean = pa.Table.from_batches(list(reader.read(one, cell_ids=False)))
    assert full.column_names == ["cell_integer_id", "gene_integer_id", "value"]
    assert lean.column_names == ["gene_integer_id", "value"]
    assert lean.equals(full.drop_columns(["cell_integer_id"]))
    # Scattered ranges go through readers opened for all three columns: they keep it.
    many = Fetch(1, np.array([[3, 9], [40, 41], [120, 150]]))
    kept = pa.Table.from_batches(list(reader.read(many, cell_ids=False)))
    assert kept.column_names == full.column_names


def recorded_reads(monkeypatch) -> list[tuple[np.ndarray, bool]]:
    """Every ``Reader.read`` call from now on, as ``(cell ranges, cell_ids)``."""
    calls: list[tuple[np.ndarray, bool]] = []
    read = slafload.pipeline.reader.Reader.read

    def recording(self, fetch, *, cell_ids=True):
        calls.append((fetch.ranges.copy(), cell_ids))
        yield from read(self, fetch, cell_ids=cell_ids)

    monkeypatch.setattr(slafload.pipeline.reader.Reader, "read", recording)
    return calls


def batches(ds, **options) -> list[dict[str, torch.Tensor]]:
    with Loader(ds, batch_size=16, max_genes=12, seed=4, **options) as loader:
        return list(loader)


@pytest.mark.parametrize("tokenizer", ["geneformer", "scgpt"])
def test_a_loader_reads_each_cell_with_its_ids_once_then_without_and_delivers_the_same(
    dataset, monkeypatch, tokenizer
):
    sampler = ChunkShuffle(chunk_cells=48)
    always = batches(dataset, tokenizer=tokenizer, sampler=sampler, n_epochs=3,
                     tuning=Tuning(check_rows="always"))  # fmt: skip
    calls = recorded_reads(monkeypatch)
    once = batches(dataset, tokenizer=tokenizer, sampler=sampler, n_epochs=3)
    assert len(once) == len(always)
    for a, b in zip(always, once, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    seen = np.zeros(dataset.n_cells, dtype=bool)
    lean = 0
    for ranges, cell_ids in calls:
        start, stop = ranges[0].tolist()
        assert len(ranges) == 1
        if cell_ids:
            seen[start:stop] = True
        else:  # never before every one of its cells was read with the column
            assert seen[start:stop].all()
            lean += 1
    assert seen.all()
    assert lean >= len(calls) // 2  # epochs 1 and 2 read without it


def test_check_rows_always_and_block_sampling_read_the_cell_ids_every_time(dataset, monkeypatch):
    calls = recorded_reads(monkeypatch)
    batches(
        dataset,
        sampler=ChunkShuffle(chunk_cells=48),
        n_epochs=2,
        tuning=Tuning(check_rows="always"),
    )
    assert calls and all(cell_ids for _, cell_ids in calls)
    calls.clear()
    batches(dataset, sampler=BlockShuffle(block_size=4, fetch_factor=8), n_epochs=2)
    multi = [cell_ids for ranges, cell_ids in calls if len(ranges) > 1]
    assert multi and all(multi)


def test_a_mixture_reads_its_sources_without_cell_ids_after_the_first_epoch(tmp_path, monkeypatch):
    a = write_dense(tmp_path / "a.slaf", random_counts(90, 20, seed=1), max_rows_per_file=200)
    b = write_dense(tmp_path / "b.slaf", random_counts(70, 20, seed=2), max_rows_per_file=200)
    options = {"batch_size": 16, "max_genes": 10, "chunk_cells": 24, "n_epochs": 2}
    with Loader([a, b], tuning=Tuning(check_rows="always"), **options) as loader:
        always = list(loader)
    calls = recorded_reads(monkeypatch)
    with Loader([a, b], **options) as loader:
        once = list(loader)
    assert any(not cell_ids for _, cell_ids in calls)
    for x, y in zip(always, once, strict=True):
        assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "cell_integer_id", "source"))


def test_rows_that_fail_the_check_raise_and_are_not_marked_checked(tmp_path):
    path = write_dense(tmp_path / "bad.slaf", random_counts(30, 10, seed=2, density=0.9))
    table = lance.dataset(str(path / "expression.lance")).to_table()
    cells = table.column("cell_integer_id").to_numpy().copy()
    cells[40] += 1  # inside cell 4 or 5: the open-time spot check cannot see it
    table = table.set_column(0, "cell_integer_id", pa.array(cells, table.schema.field(0).type))
    lance.write_dataset(table, str(path / "expression.lance"), mode="overwrite")
    ds = open_dataset(path)
    fetch = Fetch(0, np.array([[0, 30]]))
    group = Group(Part(fetch, 0, 30), fetch, list(Reader(ds).read(fetch)), last=True)
    checked = RangeSet()
    with pytest.raises(InconsistentDataError, match="belongs to cell"):
        next(Assemble(iter([group]), ds, checked))
    assert len(checked) == 0
    with Loader(ds, n_epochs=3, chunk_cells=30) as loader, pytest.raises(InconsistentDataError):
        list(loader)


def test_check_rows_takes_once_or_always():
    assert LoaderConfig().tuning.check_rows == "once"
    with pytest.raises(ValueError, match="check_rows must be one of"):
        Tuning(check_rows="never")
