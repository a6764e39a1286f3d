"""Reading an atlas from an object store: moto's S3 server behind a counting forwarder
(``benchmarks/s3_proxy.py``), the same cells and tokens as the local copy.
"""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
from conftest import s3_options, upload

from slafload import Loader, ReadError, RetryPolicy, Tuning, open_dataset, synthetic
from slafload._lance.object_store import StoreOptions, coalesce
from slafload._lance.ranged import StoreFiles
from slafload.pipeline.reader import Reader
from slafload.samplers import BlockShuffle

pytest.importorskip("boto3")
pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def atlas(tmp_path_factory):
    """A 1,500-cell atlas of 1.2M rows in 3 data files (Lance 2.2, as converters write):
    a 16-cell block is ~12.8k rows, as on a real atlas.
    """
    path = tmp_path_factory.mktemp("atlas") / "a.slaf"
    return synthetic.write_atlas(path, n_cells=1500, n_genes=2000, n_plates=3, mean_nnz=800,
                                 empty_fraction=0.02, seed=5, max_rows_per_file=400_000)  # fmt: skip


@pytest.fixture
def remote(atlas, s3_endpoint, s3_proxy):
    """The atlas on S3, opened through the counting proxy (the upload bypasses it)."""
    uri = upload(atlas, s3_endpoint, "atlas-bucket", "a.slaf")
    return open_dataset(uri, storage_options=s3_options(s3_proxy.endpoint))


def blocks(block_size: int, fetch_factor: int = 8) -> dict[str, BlockShuffle]:
    return {"sampler": BlockShuffle(block_size=block_size, fetch_factor=fetch_factor,
                                    batch_size=32)}  # fmt: skip


def batches(dataset, **settings) -> list[dict[str, np.ndarray]]:
    with Loader(dataset, tokenizer="geneformer", batch_size=32, max_genes=64, seed=3,
                **settings) as loader:  # fmt: skip
        return [{k: v.numpy() for k, v in batch.items()} for batch in loader]


def assert_same(want: list[dict[str, np.ndarray]], got: list[dict[str, np.ndarray]]) -> None:
    assert len(want) == len(got) > 0
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    cells = np.concatenate([b["cell_integer_id"] for b in got])
    assert np.array_equal(np.sort(cells), np.arange(len(cells)))  # each cell once


def test_a_chunk_shuffle_epoch_from_s3_is_the_local_epoch_and_its_requests_are_counted(
    atlas, remote, s3_proxy
):
    opened = s3_proxy.reset()
    assert opened.total > 0 and opened.bytes > 0  # config, manifests, cell offsets
    assert_same(batches(open_dataset(atlas)), batches(remote))
    read = s3_proxy.reset()
    assert read.requests.get("GET", 0) > 0 and read.bytes > 0


def test_a_chunk_shuffle_run_from_s3_makes_the_requests_of_take_scan(remote, s3_proxy):
    """Each epoch's first fetch is read as its first cells, then the rest (the first batch
    waits for a few cells): each a span of the whole chunk, read by one Lance scan as
    take_scan reads it: the requests and bytes are take_scan's. Both readers' files are
    opened before counting, so the counts are exact.
    """

    def run(reader: str) -> tuple[int, int, int]:
        s3_proxy.reset()
        with Loader(remote, tokenizer="geneformer", batch_size=32, max_genes=64, seed=0,
                    n_epochs=3, tuning=Tuning(reader=reader)) as loader:  # fmt: skip
            cells = sum(len(batch["cell_integer_id"]) for batch in loader)
        counts = s3_proxy.reset()
        return cells, counts.total, counts.bytes

    run("auto"), run("lance")  # each reader's files opened (the default's kept by the dataset)
    cells, requests, read = run("auto")
    _, lance_requests, lance_read = run("lance")
    assert cells == 3 * remote.n_cells
    assert (requests, read) == (lance_requests, lance_read)


@pytest.mark.parametrize("block_size, threads", [(4, None), (16, 1)])
def test_a_block_shuffle_epoch_from_s3_is_the_local_epoch(atlas, remote, block_size, threads):
    reader = Reader(remote).data_files()
    assert reader is not None and reader.ranged is not None  # range requests by default
    tuning = Tuning(read_threads=threads)  # one thread: a window opens every file at once
    assert_same(
        batches(open_dataset(atlas), **blocks(block_size)),
        batches(remote, tuning=tuning, **blocks(block_size)),
    )


def test_block_reads_cost_at_most_one_request_per_column_and_block(atlas, remote, s3_proxy):
    """The layout's floor: each block one contiguous row range in three columns (fewer where
    blocks of a fetch lie close). File opens (HEAD, footer, chunk words) and the first
    file's check against Lance's read are counted in the first epoch; a second loader of the
    same dataset opens nothing again.
    """
    stored = sum(p.stat().st_size for p in (atlas / "expression.lance" / "data").iterdir())
    s3_proxy.reset()
    got = batches(remote, **blocks(16, fetch_factor=2))
    n_cells = sum(len(b["cell_integer_id"]) for b in got)
    first = s3_proxy.reset()
    floor = 3 * -(-n_cells // 16)
    assert floor / 2 < first.total <= 1.1 * floor
    assert first.bytes <= 1.5 * stored  # an epoch reads each row once
    assert batches(remote, **blocks(16, fetch_factor=2))[0].keys() == got[0].keys()
    again = s3_proxy.reset()
    assert "HEAD" not in again.requests and again.total < first.total
    assert floor / 2 < again.total <= floor and again.bytes <= 1.5 * stored


def test_coalesced_requests_read_through_the_smallest_gaps_within_half_the_bytes_wanted():
    fds = np.array([0, 0, 0, 0, 1, 0], np.int64)
    offsets = np.array([0, 100, 1_000, 1_400, 150, 50], np.int64)
    sizes = np.array([60, 100, 200, 100, 50, 10], np.int64)
    # File 0 sorted: [0, 60) [50, 60) [100, 200) [1000, 1200) [1400, 1500); gaps 40, 800, 200,
    # wanted 60 + 100 + 200 + 100 = 460 bytes: 40 + 200 fit in half of it, 800 does not.

    def requests(gap: int) -> list[list[int]]:
        order, starts = coalesce(fds, offsets, sizes, gap)
        return [sorted(order[a:b].tolist()) for a, b in itertools.pairwise(starts.tolist())]

    assert requests(1 << 20) == [[0, 1, 5], [2, 3], [4]]  # file 1 never joins file 0
    assert requests(100) == [[0, 1, 5], [2], [3], [4]]  # gaps over 100 bytes stay
    assert requests(0) == [[0, 5], [1], [2], [3], [4]]  # overlapping runs share one always


def test_failed_requests_are_retried_and_no_cell_is_lost_or_repeated(atlas, remote, s3_proxy):
    want = batches(open_dataset(atlas), **blocks(16))
    s3_proxy.fail_next("503", "cut", "503", "cut", agent="aws-sdk-cpp")  # slafload's requests
    got = batches(remote, **blocks(16))
    assert s3_proxy.faults_left == 0
    assert_same(want, got)
    s3_proxy.fail_next("503", agent="aws-sdk-cpp")  # and with retries off, the failure shows
    with pytest.raises(ReadError, match="SLOW_DOWN|SERVICE_UNAVAILABLE"):  # (the SDK says either)
        batches(remote, tuning=Tuning(retry=RetryPolicy(attempts=1)), **blocks(16))


def test_the_files_a_dataset_opened_are_shared_by_its_loaders_but_not_pickled_or_forked():
    shared = StoreFiles()
    options = s3_options("http://127.0.0.1:9")  # nothing is requested here
    first = shared.files(options, StoreOptions())
    assert shared.files(dict(options), StoreOptions()) is first  # the same settings
    assert shared.files(options, StoreOptions(gap=0)) is not first
    assert pickle.loads(pickle.dumps(shared)).files(options, StoreOptions()) is not first
    shared._pid = -1  # as a forked child sees it: the parent's clients are not its own
    assert shared.files(options, StoreOptions()) is not first
