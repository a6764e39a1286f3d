"""``tokenize_on="device"``: the same tokens as the producer, made with torch ops.

On the CPU device everywhere, and on CUDA too where there is one (the GPU check of the
layouts issue: ``pytest tests/pipeline/test_device_tokenize.py`` on a GPU machine).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import random_counts, write_dense
from resume_conformance import assert_resumes_exactly

from slafload import Loader
from slafload.errors import LayoutError
from slafload.samplers import BlockShuffle, ChunkShuffle
from slafload.tokenizers.binning import ScGPTFixedBins

pytestmark = pytest.mark.usefixtures("no_thread_leak")

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


@pytest.fixture(scope="module", params=["uint16", "float32"])
def atlas(request, tmp_path_factory):
    dense = random_counts(260, 50, seed=4, density=0.35, empty_every=29)
    path = tmp_path_factory.mktemp("device") / "d.slaf"
    if request.param == "float32":  # fractional values with ties: bin edges between values
        return write_dense(path, dense.astype(np.float32) / 3, value_type=pa.float32())
    return write_dense(path, dense, max_rows_per_file=211)


def run(atlas, tokenize_on, **settings):
    with Loader(atlas, tokenize_on=tokenize_on, batch_size=20, **settings) as loader:
        return [{k: v.cpu() for k, v in batch.items()} for batch in loader]


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("token_dtype", ["int64", "int32"])
@pytest.mark.parametrize("layout", ["padded", "longest", "packed"])
@pytest.mark.parametrize(
    ("tokenizer", "options"),
    [("geneformer", {}), ("scgpt", {}), ("scgpt", {"n_bins": 7}), ("raw", {})],
)
def test_device_tokens_equal_the_producers_in_every_layout(
    atlas, tokenizer, options, layout, token_dtype, device
):
    settings = {"tokenizer": tokenizer, "tokenizer_options": options, "layout": layout,
                "token_dtype": token_dtype, "max_genes": 10,
                "sampler": BlockShuffle(block_size=6, fetch_factor=5, batch_size=20),
                "chunk_cells": 45}  # fmt: skip
    on_device = run(atlas, "device", device=device, **settings)
    assert_same_batches(on_device, run(atlas, "producer", **settings))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_genes", [2, 3, 64])  # geneformer's SEP dropped / exactly fits
def test_device_tokens_equal_the_producers_when_rows_fill_up(atlas, max_genes, device):
    for tokenizer in ("geneformer", "scgpt", "raw"):
        settings = {"tokenizer": tokenizer, "max_genes": max_genes,
                    "sampler": ChunkShuffle(chunk_cells=64)}  # fmt: skip
        on_device = run(atlas, "device", device=device, **settings)
        assert_same_batches(on_device, run(atlas, "producer", **settings))


def test_device_tokenizing_resumes_batch_for_batch(atlas):
    def make():
        return Loader(atlas, tokenizer="scgpt", tokenize_on="device", layout="packed",
                      max_genes=10, batch_size=16, chunk_cells=50, seed=3)  # fmt: skip

    assert_resumes_exactly(make, midpoints=3)


def test_device_tokenizing_refuses_tokenizers_it_cannot_reproduce(atlas):
    with pytest.raises(LayoutError, match="tokenize_on='producer'"):
        Loader(atlas, tokenizer=ScGPTFixedBins(), tokenize_on="device")


def test_the_dataloader_face_refuses_device_tokenizing(atlas):
    with (
        Loader(atlas, tokenize_on="device") as loader,
        pytest.raises(LayoutError, match="DataLoader"),
    ):
        loader.as_torch_dataset()
