"""Object storage: a SLAF dataset on an S3-compatible endpoint (moto's server on loopback).

The test starts moto's threaded server itself on a free loopback port, uploads a dataset
written locally, opens it by ``s3://`` URI with Lance storage options, and checks that it
yields exactly the tokens of the local copy.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from conftest import S3_KEYS, S3_REGION, random_counts, upload, write_dense

from slafload import ConfigError, Loader, open_dataset
from slafload._lance.data_files import REMOTE_THREADS
from slafload.pipeline.reader import COLUMNS, Reader, ReadOptions
from slafload.samplers import BlockShuffle

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")

KEYS, REGION = S3_KEYS, S3_REGION


def tokens(dataset, tokenizer: str, **settings) -> list[dict[str, np.ndarray]]:
    with Loader(dataset, tokenizer=tokenizer, batch_size=16, chunk_cells=40, seed=4,
                **settings) as loader:  # fmt: skip
        return [{k: v.numpy() for k, v in batch.items()} for batch in loader]


def test_a_dataset_on_s3_yields_the_tokens_of_its_local_copy(tmp_path, s3_endpoint, read_paths):
    counts = random_counts(90, 30, seed=6, empty_every=11)
    local = write_dense(tmp_path / "atlas.slaf", counts, max_rows_per_file=200)
    uri = upload(local, s3_endpoint, "atlas-bucket", "x.slaf")
    options = {**KEYS, "aws_region": REGION, "aws_endpoint": s3_endpoint, "allow_http": "true"}

    remote = open_dataset(uri, storage_options=options)
    assert remote.uri == uri and remote.n_cells == 90 and remote.n_genes == 30
    np.testing.assert_array_equal(remote.cell_start, open_dataset(local).cell_start)
    # Lance 2.2 files on S3: read by range requests by default...
    ranged = Reader(remote).data_files()
    assert ranged is not None and ranged.ranged is not None and ranged.threads == REMOTE_THREADS
    # ...or by Lance's file readers (each range's page metadata requested again)
    files = Reader(remote, ReadOptions(direct=True, store=None)).data_files()
    assert files is not None and files.n_files > 1 and files.ranged is None
    rows = np.array([[0, 7], [150, 420], [600, 601]], dtype=np.int64)  # across files
    local_files = Reader(open_dataset(local)).data_files()
    for reader in (files, ranged):
        pairs = zip(reader.read(rows, COLUMNS), local_files.read(rows, COLUMNS), strict=True)
        for got, want in pairs:
            assert pa.Table.from_batches(list(got)).equals(pa.Table.from_batches(list(want)))
    assert ranged._session is None  # range requests: no Lance file session made
    blocks = {"sampler": BlockShuffle(block_size=3, fetch_factor=2, batch_size=16)}
    for tokenizer, settings in [("geneformer", {}), ("scgpt", {}), ("scgpt", blocks),
                                ("geneformer", "direct")]:  # fmt: skip
        if settings == "direct":  # the direct path through Lance's file readers too
            read_paths(direct=True, store=None)
            settings = blocks
        want, got = tokens(local, tokenizer, **settings), tokens(remote, tokenizer, **settings)
        assert len(want) == len(got) == 6
        for a, b in zip(want, got, strict=True):
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])


def test_a_missing_s3_dataset_names_the_uri(s3_endpoint):
    boto3.client("s3", endpoint_url=s3_endpoint, region_name=REGION, **KEYS).create_bucket(
        Bucket="empty-bucket"
    )
    options = {**KEYS, "aws_region": REGION, "aws_endpoint": s3_endpoint, "allow_http": "true"}
    with pytest.raises(
        ConfigError, match=r"s3://empty-bucket/nope\.slaf/config\.json.* is missing"
    ):
        open_dataset("s3://empty-bucket/nope.slaf", storage_options=options)


def test_optimize_rewrites_a_dataset_on_s3_and_its_tokens_stay_those_of_the_local_copy(
    tmp_path, s3_endpoint
):
    from slafload.tools.optimize import optimize

    local = write_dense(tmp_path / "o.slaf", random_counts(80, 25, seed=8), max_rows_per_file=150)
    uri = upload(local, s3_endpoint, "opt-bucket", "o.slaf")
    options = {**KEYS, "aws_region": REGION, "aws_endpoint": s3_endpoint, "allow_http": "true"}
    report = optimize(uri, storage_options=options, progress=False)
    assert report.changed and report.storage_versions == ("2.2", "2.0") and report.bytes[1] > 0

    remote = open_dataset(uri, storage_options=options)
    assert remote.versions["expression"] == report.versions[1]
    assert Reader(remote).data_files() is not None  # 2.0 files: the direct path by default
    blocks = {"sampler": BlockShuffle(block_size=3, fetch_factor=2, batch_size=16)}
    want, got = tokens(local, "scgpt", **blocks), tokens(remote, "scgpt", **blocks)
    assert len(want) == len(got) == 5
    for a, b in zip(want, got, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_the_benchmark_runs_on_a_dataset_on_s3(tmp_path, s3_endpoint):
    import json

    from slafload.tools.bench import main

    local = write_dense(tmp_path / "b.slaf", random_counts(120, 30, seed=3), max_rows_per_file=300)
    uri = upload(local, s3_endpoint, "bench-bucket", "b.slaf")
    options = {**KEYS, "aws_region": REGION, "aws_endpoint": s3_endpoint, "allow_http": "true"}
    out = tmp_path / "bench.json"
    main([
        "--dataset", uri, "--storage-options", json.dumps(options), "--epochs", "0.5",
        "--warmup", "0.1", "--repeats", "1", "--no-presets", "--layouts", "",
        "--consumer-batches", "2", "--batch-size", "8", "--max-genes", "16", "--out", str(out),
    ])  # fmt: skip
    report = json.loads(out.read_text())
    assert report["dataset"]["path"] == uri and report["dataset"]["n_cells"] == 120
    assert report["settings"]["page_cache"] == "not warmed (not a local table)"
    assert not any(key.startswith("slafdb") for key in report["results"])  # local only
    for key in ("slafload_geneformer", "slafload_scgpt"):
        assert report["results"][key]["cells_per_s"] > 0
    with pytest.raises(SystemExit):
        main(["--dataset", uri, "--storage-options", "[1]", "--out", str(out)])
