"""Damaged data files: ``slafload verify`` names each one, and a loader's error names it too.

Each test damages one expression data file of a small real atlas (three data files) the way
disks and copies do: random bytes written over its middle, bytes flipped, the file cut short.
``verify`` runs as the command does, in its own process under a timeout (none may hang).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import slafload
from slafload import CorruptDataError, DatasetError
from slafload.tools.verify import verify

HANG = 120  # seconds: a verify running this long hangs


@pytest.fixture(scope="module")
def atlas(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("verify") / "atlas.slaf"
    slafload.synthetic.write_atlas(path, n_cells=3_000, n_genes=2_000, n_plates=3,
                                   mean_nnz=100, seed=0, max_rows_per_file=100_000)  # fmt: skip
    return path


def data_files(path: Path, table_name: str = "expression") -> list[Path]:
    table = getattr(slafload.open_dataset(path), table_name)
    return [
        Path(table.uri) / "data" / d.path for f in table.get_fragments() for d in f.data_files()
    ]


def damaged(atlas: Path, tmp_path: Path, how: str, table: str = "expression") -> tuple[Path, Path]:
    """A copy of ``atlas`` with the first data file of ``table`` damaged ``how``."""
    copy = tmp_path / f"{how}.slaf"
    target = data_files(atlas, table)[0]
    shutil.copytree(atlas, copy)
    path = copy / target.relative_to(atlas)
    size = path.stat().st_size
    rng = np.random.default_rng(0)
    with open(path, "r+b") as fh:
        if how == "garbage":
            fh.seek(size // 2)
            fh.write(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
        elif how == "flip":
            data = bytearray(fh.read())
            for at in rng.integers(0, size // 2, 64).tolist():
                data[at] ^= 0xFF
            fh.seek(0)
            fh.write(data)
        else:
            fh.truncate(size // 2)
    return copy, path


def run_verify(path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RUST_BACKTRACE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "slafload.tools.cli", "verify", str(path), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=HANG,
        env=env,
    )


def test_verify_passes_a_healthy_dataset(atlas):
    assert verify(atlas) == []
    done = run_verify(atlas)
    assert done.returncode == 0, done.stderr
    assert "no problem found" in done.stdout


@pytest.mark.parametrize("how", ["garbage", "flip", "truncate"])
def test_verify_names_the_damaged_file_and_only_it(atlas, tmp_path, how):
    copy, bad = damaged(atlas, tmp_path, how)
    done = run_verify(copy)
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stdout.strip().splitlines()
    assert lines and all(line.startswith(f"{bad}: ") for line in lines), lines
    assert "rows" in done.stdout
    assert "stack backtrace" not in done.stderr  # Rust's panic message at most, not its trace
    assert "/rustc/" not in done.stdout


def test_a_truncated_file_is_corrupt_not_missing_and_named(atlas, tmp_path):
    copy, bad = damaged(atlas, tmp_path, "truncate")
    settings = {"batch_size": 64, "max_genes": 32, "n_epochs": 1, "seed": 0}
    with (
        pytest.raises(CorruptDataError, match=f"{bad.name}.*truncated") as caught,
        slafload.Loader(copy, **settings) as loader,
    ):
        for _ in loader:
            pass
    assert "rows 0-" in str(caught.value) and "/rustc/" not in str(caught.value)
    assert not isinstance(caught.value, slafload.MissingTableError)


def test_garbage_in_a_file_stops_the_loader_with_an_error_naming_it(atlas, tmp_path):
    copy, bad = damaged(atlas, tmp_path, "garbage")
    loader = slafload.Loader(copy, batch_size=64, max_genes=32, n_epochs=1, seed=0)
    with loader, pytest.raises(CorruptDataError, match=bad.name) as caught:
        for _ in loader:
            pass
    assert "slafload verify" in str(caught.value)


def test_info_says_it_did_not_verify_the_data(atlas, capsys):
    from slafload.tools.cli import main

    assert main(["info", str(atlas)]) == 0
    assert "slafload verify" in capsys.readouterr().out


def test_verify_of_a_path_that_is_no_dataset_is_a_dataset_error(tmp_path):
    with pytest.raises(DatasetError):
        verify(tmp_path / "nothing.slaf")


def test_flipped_bytes_stop_the_loader_with_an_error_naming_the_file_and_verify(atlas, tmp_path):
    copy, bad = damaged(atlas, tmp_path, "flip")
    loader = slafload.Loader(copy, batch_size=64, max_genes=32, n_epochs=1, seed=0)
    with loader, pytest.raises(DatasetError) as caught:
        for _ in loader:
            pass
    assert bad.name in str(caught.value) and "slafload verify" in str(caught.value)


def test_a_damaged_cells_table_is_named_once_and_hides_nothing_else(atlas, tmp_path):
    copy, bad = damaged(atlas, tmp_path, "truncate", table="cells")
    problems = verify(copy)
    assert [p.where for p in problems] == [str(bad)], problems


def test_a_truncated_cells_table_fails_to_open_naming_its_file(atlas, tmp_path):
    copy, bad = damaged(atlas, tmp_path, "truncate", table="cells")
    with pytest.raises(CorruptDataError, match=f"cells\\.lance: data file .*{bad.name}.*truncated"):
        slafload.open_dataset(copy)
