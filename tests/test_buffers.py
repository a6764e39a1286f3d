"""Reused padded arrays: handed out again only once nothing refers to them, re-padded exactly."""

from __future__ import annotations

import gc

import numpy as np
import torch

import slafload
from slafload.buffers import RowBuffers, copy_runs


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_an_array_comes_back_only_after_every_view_and_tensor_of_it_is_released():
    pool = RowBuffers(keep=2)
    ends = np.array([3, 1])
    first = pool.rows("ids", ends, 4, np.dtype(np.int64))
    one = _address(first)
    tensor = torch.from_numpy(first[1:])  # what a batch of it becomes
    del first
    second = pool.rows("ids", ends, 4, np.dtype(np.int64))
    two = _address(second)
    assert two != one  # the tensor still views the first array
    del tensor
    gc.collect()
    third = pool.rows("ids", ends, 4, np.dtype(np.int64))
    assert _address(third) == one  # released: handed out again
    del second
    assert _address(pool.rows("ids", ends, 4, np.dtype(np.int64))) == two


def test_a_full_pool_allocates_rather_than_hands_out_a_held_array():
    pool = RowBuffers(keep=1)
    held = [pool.rows("ids", np.array([2]), 3, np.dtype(np.int64)) for _ in range(3)]
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        assert not np.shares_memory(held[a], held[b])


def test_reused_rows_are_padded_past_their_new_ends():
    pool = RowBuffers()
    out = pool.rows("ids", np.array([4, 1, 0]), 4, np.dtype(np.int64), pad=-1)
    assert (out == -1).all()
    out[0, :4], out[1, :1] = 7, 7
    del out
    out = pool.rows("ids", np.array([1, 3]), 4, np.dtype(np.int64), pad=-1)  # fewer rows
    out[0, :1], out[1, :3] = 5, 5  # the caller writes before the ends
    np.testing.assert_array_equal(out, [[5, -1, -1, -1], [5, 5, 5, -1]])


def test_copy_runs_copies_each_run_with_casting():
    dst = np.zeros(10, dtype=np.int64)
    src = np.arange(6, dtype=np.uint16)
    copy_runs(dst, np.array([0, 6]), src, np.array([1, 4]), np.array([3, 2]))
    np.testing.assert_array_equal(dst, [1, 2, 3, 0, 0, 0, 4, 5, 0, 0])


def test_batches_held_by_the_consumer_keep_their_tokens(tmp_path):
    path = tmp_path / "a.slaf"
    slafload.synthetic.write_atlas(path, n_cells=600, n_genes=300, mean_nnz=40, seed=1)
    options = dict(batch_size=16, max_genes=64, seed=0, n_epochs=2, piece_cells=64)
    for tokenizer in ("geneformer", "scgpt", "raw"):
        with slafload.Loader(path, tokenizer=tokenizer, **options) as loader:
            held = [{k: v.clone() for k, v in b.items()} for b in loader]
        with slafload.Loader(path, tokenizer=tokenizer, **options) as loader:
            kept = list(loader)  # every batch still viewing its piece's array
        assert len(kept) == len(held)
        for a, b in zip(held, kept, strict=True):
            for key in a:
                assert torch.equal(a[key], b[key]), (tokenizer, key)
