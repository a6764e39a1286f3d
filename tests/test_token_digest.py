"""Tokens do not change under refactoring: every byte a loader delivers on a fixed synthetic
atlas hashes to the digest recorded with slafload 0.1 (commit aa629c4), before the stage
chain, the package regrouping and the layout, preset and gene-order work landed.

A change that alters tokens on purpose must update these digests and say why in its commit.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import slafload
from slafload.samplers import BlockShuffle, ChunkShuffle

RECORDED = {  # slafload 0.1, numpy 2.4, pylance 14.0, polars 2.1
    "geneformer/chunk": "5bb855f3c33c7fad",
    "geneformer/block": "e7bd5cbfe9bc0351",
    "scgpt/chunk": "b7db10a39ba708a9",
    "scgpt/block": "3bce3389299da2e8",
    "raw/chunk": "9a8a75d585b25f55",
    "raw/block": "1354d8a4cd966963",
}
SAMPLERS = {
    "chunk": lambda: ChunkShuffle(chunk_cells=512),
    "block": lambda: BlockShuffle(block_size=16, fetch_factor=8),
}


@pytest.fixture(scope="module")
def atlas(tmp_path_factory):
    path = tmp_path_factory.mktemp("digest") / "atlas.slaf"
    slafload.synthetic.write_atlas(
        path, n_cells=3000, n_genes=2000, n_plates=4, mean_nnz=300, seed=7
    )
    return path


@pytest.mark.parametrize("key", sorted(RECORDED))
def test_tokens_are_byte_for_byte_those_of_slafload_0_1(atlas, key):
    tokenizer, sampler = key.split("/")
    h = hashlib.sha256()
    with slafload.Loader(
        atlas,
        tokenizer=tokenizer,
        sampler=SAMPLERS[sampler](),
        batch_size=32,
        max_genes=256,
        seed=3,
        n_epochs=2,
    ) as loader:
        for batch in loader:
            for name in sorted(batch):
                h.update(name.encode())
                h.update(np.ascontiguousarray(batch[name].numpy()).tobytes())
    assert h.hexdigest()[:16] == RECORDED[key]
