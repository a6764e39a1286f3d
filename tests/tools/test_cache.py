"""``slafload cache``: a dataset on S3 copied to a local directory, an interrupted copy resumed."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import random_counts, s3_options, upload, write_dense

from slafload import ConfigError, DatasetNotFoundError, open_dataset
from slafload.tools.cache import cache, mutable
from slafload.tools.cli import main

pytest.importorskip("boto3")
pytest.importorskip("moto.server")


def files_of(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_copy_cut_short_is_resumed_and_ends_identical_to_the_bucket(tmp_path, s3_endpoint):
    local = write_dense(tmp_path / "a.slaf", random_counts(120, 30, seed=2), max_rows_per_file=300)
    uri = upload(local, s3_endpoint, "cache-bucket", "a.slaf")
    options = s3_options(s3_endpoint)
    out = tmp_path / "copy.slaf"

    first = cache(uri, out, storage_options=options, progress=False)
    assert first.copied == first.files == len(files_of(local)) and first.skipped == 0
    assert files_of(out) == files_of(local)
    want = open_dataset(local)
    assert np.array_equal(open_dataset(out).cell_start, want.cell_start)

    # Cut short: one data file half copied (its .part), another gone, config.json gone.
    data = sorted((out / "expression.lance" / "data").iterdir())
    half = data[0].read_bytes()[: data[0].stat().st_size // 2]
    data[0].with_name(data[0].name + ".part").write_bytes(half)
    data[0].unlink()
    data[1].unlink()
    (out / "config.json").unlink()
    again = cache(uri, out, storage_options=options, progress=False)
    assert files_of(out) == files_of(local)  # no .part left, every byte the bucket's
    resumed = data[0].stat().st_size - len(half) + data[1].stat().st_size
    small = sum(len(b) for k, b in files_of(local).items() if mutable(k))
    assert again.skipped > 0 and again.bytes <= resumed + small + 4096  # not copied again


def test_the_command_copies_and_names_what_is_wrong(tmp_path, s3_endpoint, capsys):
    local = write_dense(tmp_path / "b.slaf", random_counts(40, 10, seed=1))
    uri = upload(local, s3_endpoint, "cli-bucket", "b.slaf")
    options = json.dumps(s3_options(s3_endpoint))
    out = tmp_path / "copy.slaf"
    assert main(["cache", uri, str(out), "--storage-options", options, "--no-progress"]) == 0
    assert "copied" in capsys.readouterr().out and files_of(out) == files_of(local)
    with pytest.raises(DatasetNotFoundError, match="config.json is missing"):
        cache("s3://cli-bucket/nope.slaf", out, storage_options=s3_options(s3_endpoint))
    with pytest.raises(ConfigError, match="s3:// URIs"):
        cache("gs://x/y.slaf", out)
    assert main(["cache", uri, str(out), "--storage-options", "[1]"]) == 2
