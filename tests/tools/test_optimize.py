"""`slafload optimize`: a new Lance version in the 2.0 format, every token unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_counts, write_dense

from slafload import Loader, open_dataset
from slafload._lance.data_files import DataFiles
from slafload.errors import DatasetError
from slafload.pipeline.reader import COLUMNS
from slafload.samplers import BlockShuffle, ChunkShuffle
from slafload.tools.cli import main
from slafload.tools.optimize import optimize

pytestmark = pytest.mark.usefixtures("no_thread_leak")


@pytest.fixture
def atlas(tmp_path):
    dense = random_counts(400, 50, seed=7, density=0.3, empty_every=23)
    return write_dense(tmp_path / "o.slaf", dense, max_rows_per_file=211)


def batches(path, sampler, tokenizer="scgpt", **open_kwargs) -> list[dict[str, np.ndarray]]:
    ds = open_dataset(path, **open_kwargs)
    with Loader(ds, sampler=sampler, batch_size=32, tokenizer=tokenizer, max_genes=24,
                seed=3) as loader:  # fmt: skip
        return [{k: v.numpy() for k, v in batch.items()} for batch in loader]


def assert_same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


@pytest.mark.parametrize("tokenizer", ["scgpt", "geneformer", "raw"])
def test_optimize_writes_lance_2_0_as_a_new_version_with_identical_tokens(atlas, tokenizer):
    sampler = lambda: BlockShuffle(block_size=3, fetch_factor=4)  # noqa: E731
    before = batches(atlas, sampler(), tokenizer)
    old = open_dataset(atlas)
    report = optimize(atlas, progress=False)

    new = open_dataset(atlas)
    assert report.changed and report.rows == old.n_rows == new.n_rows
    assert report.versions == (old.versions["expression"], new.versions["expression"])
    assert report.versions[1] > report.versions[0]
    assert report.storage_versions == ("2.2", "2.0")
    assert {(f.file_major_version, f.file_minor_version)
            for fr in new.expression.get_fragments() for f in fr.metadata.files} == {(2, 0)}  # fmt: skip
    assert report.data_files == (report.data_files[0], len(new.expression.get_fragments()))
    assert report.bytes[1] > 0 and report.bytes[0] > 0
    assert new.versions["cells"] == old.versions["cells"]  # only expression changes
    np.testing.assert_array_equal(new.cell_start, old.cell_start)
    assert DataFiles.of(new.expression, COLUMNS) is not None  # the direct range-read path

    assert_same(before, batches(atlas, sampler(), tokenizer))
    # The previous version stays readable, with the same tokens.
    assert_same(before, batches(atlas, sampler(), tokenizer, version=report.versions[0]))


def test_rows_per_file_merges_data_files_and_a_second_run_has_nothing_to_do(atlas):
    n_rows = open_dataset(atlas).n_rows
    merged = optimize(atlas, rows_per_file=1000, progress=False)
    assert merged.data_files[1] == -(-n_rows // 1000) < merged.data_files[0]
    again = optimize(atlas, progress=False)
    assert not again.changed and again.versions == (merged.versions[1],) * 2
    back = optimize(atlas, storage_version="2.2", progress=False)
    assert back.changed and back.storage_versions == ("2.0", "2.2")
    assert_same(batches(atlas, ChunkShuffle(chunk_cells=64)),
                batches(atlas, ChunkShuffle(chunk_cells=64), version=merged.versions[0]))  # fmt: skip


def test_a_run_resumed_across_an_optimize_finishes_the_epoch_exactly(atlas):
    def loader():
        return Loader(atlas, sampler=BlockShuffle(block_size=2, fetch_factor=3), batch_size=16,
                      max_genes=12, seed=5)  # fmt: skip

    with loader() as whole:
        want = [b["input_ids"].numpy() for b in whole]
    with loader() as first:
        it = iter(first)
        got = [next(it)["input_ids"].numpy() for _ in range(5)]
        state = first.state_dict()
    optimize(atlas, progress=False)
    with loader() as resumed:
        resumed.load_state_dict(state)
        got += [b["input_ids"].numpy() for b in resumed]
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_bad_arguments_and_non_datasets_fail_before_anything_is_written(atlas, tmp_path):
    version = open_dataset(atlas).versions["expression"]
    with pytest.raises(ValueError, match="storage_version must be one of"):
        optimize(atlas, storage_version="9.9", progress=False)
    with pytest.raises(ValueError, match="rows_per_file must be a positive integer"):
        optimize(atlas, rows_per_file=0, progress=False)
    with pytest.raises(DatasetError):
        optimize(tmp_path, progress=False)
    assert open_dataset(atlas).versions["expression"] == version


def test_the_command_reports_what_it_rewrote(atlas, capsys):
    assert main(["optimize", str(atlas), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "Lance 2.2 -> 2.0" in out and f"{open_dataset(atlas).n_rows:,} rows" in out
    assert "version 1 is kept (--delete-old-versions removes it)" in out
    assert main(["info", str(atlas)]) == 0
    info = capsys.readouterr().out
    assert "format     Lance 2.0 (the expression table's data files)\n" in info
    assert main(["optimize", str(atlas), "--no-progress"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert main(["optimize", str(atlas), "--no-progress", "--delete-old-versions"]) == 0
    assert "already in Lance 2.0; deleted its older versions (0.00 GB)" in capsys.readouterr().out
    assert main(["optimize", str(atlas), "--rows-per-file", "-3", "--no-progress"]) == 2
    assert "rows_per_file must be a positive integer" in capsys.readouterr().err


def test_delete_old_versions_removes_the_previous_version_and_its_files(atlas):
    data = atlas / "expression.lance" / "data"
    before = open_dataset(atlas)
    want = batches(atlas, ChunkShuffle(chunk_cells=64))
    report = optimize(atlas, rows_per_file=700, delete_old_versions=True, progress=False)
    assert report.freed_bytes >= report.bytes[0] > 0  # data files, manifests, transactions
    assert len(list(data.iterdir())) == report.data_files[1]
    with pytest.raises(DatasetError, match="version"):
        open_dataset(atlas, version=before.versions["expression"])
    assert_same(want, batches(atlas, ChunkShuffle(chunk_cells=64)))


def test_delete_old_versions_after_an_optimize_that_kept_them_removes_them(atlas):
    data = atlas / "expression.lance" / "data"
    first = optimize(atlas, progress=False)
    assert first.changed and len(list(data.iterdir())) == first.data_files[0] + first.data_files[1]
    again = optimize(atlas, delete_old_versions=True, progress=False)
    assert not again.changed and again.freed_bytes >= first.bytes[0] > 0
    assert len(list(data.iterdir())) == first.data_files[1]
    assert optimize(atlas, delete_old_versions=True, progress=False).freed_bytes == 0


def test_an_interrupted_optimize_leaves_the_table_as_it_was(atlas, monkeypatch):
    import slafload.tools.optimize as opt

    version = open_dataset(atlas).versions["expression"]
    want = batches(atlas, ChunkShuffle(chunk_cells=64))
    counted = opt._counted

    def interrupted(batches, total, progress):
        for i, batch in enumerate(counted(batches, total, progress)):
            if i == 3:
                raise KeyboardInterrupt  # Ctrl-C mid-rewrite
            yield batch

    monkeypatch.setattr(opt, "_BATCH_ROWS", 500)
    monkeypatch.setattr(opt, "_counted", interrupted)
    with pytest.raises(KeyboardInterrupt):  # itself, not the OSError Lance wraps it in
        optimize(atlas, progress=False)
    assert open_dataset(atlas).versions["expression"] == version  # nothing was committed
    assert_same(want, batches(atlas, ChunkShuffle(chunk_cells=64)))
    monkeypatch.setattr(opt, "_counted", counted)
    assert optimize(atlas, progress=False).versions == (version, version + 1)


def test_a_writer_committing_during_the_rewrite_is_reported_with_the_version_to_restore(
    atlas, monkeypatch
):
    import lance

    import slafload.tools.optimize as opt

    table = atlas / "expression.lance"
    version = open_dataset(atlas).versions["expression"]
    counted = opt._counted

    def with_a_concurrent_append(batches, total, progress):
        for i, batch in enumerate(counted(batches, total, progress)):
            if i == 1:  # another process appends rows while the rewrite is under way
                lance.write_dataset(batch.slice(0, 3), str(table), mode="append")
            yield batch

    monkeypatch.setattr(opt, "_BATCH_ROWS", 500)
    monkeypatch.setattr(opt, "_counted", with_a_concurrent_append)
    with pytest.raises(RuntimeError, match=f"restore version {version + 1} with"):
        optimize(atlas, progress=False)
