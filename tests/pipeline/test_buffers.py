"""Reused padded arrays: handed out again only once nothing refers to them, re-padded exactly."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest
import torch

import slafload
from slafload.kernels import Kernels, numba_available
from slafload.pipeline.buffers import RowBuffers, copy_aligned_runs, fresh, gather_runs

BACKENDS = ["numpy"] + (["numba"] if numba_available() else [])


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


@pytest.mark.parametrize("width", [4, 1 << 20])  # numpy's array, and torch's (>= 4 MiB)
def test_an_array_comes_back_only_after_every_view_and_tensor_of_it_is_released(width):
    pool = RowBuffers(keep=2)
    ends = np.array([3, 1])
    first = pool.rows("ids", ends, width, np.dtype(np.int64))
    one = _address(first)
    tensor = torch.from_numpy(first[1:])  # what a batch of it becomes
    del first
    second = pool.rows("ids", ends, width, np.dtype(np.int64))
    two = _address(second)
    assert two != one  # the tensor still views the first array
    del tensor
    gc.collect()
    third = pool.rows("ids", ends, width, np.dtype(np.int64))
    assert _address(third) == one  # released: handed out again
    del second
    assert _address(pool.rows("ids", ends, width, np.dtype(np.int64))) == two


def test_kept_arrays_have_the_callers_capacity_and_small_free_ones_make_room():
    pool = RowBuffers(keep=1, rows=8)
    first = pool.rows("ids", np.array([1, 2]), 3, np.dtype(np.int64))  # a small first piece
    one = _address(first)
    del first
    full = pool.rows("ids", np.full(8, 3), 3, np.dtype(np.int64))
    assert _address(full) == one  # the kept array was allocated with 8 rows
    del full
    small = RowBuffers(keep=1)
    first = small.rows("ids", np.array([1]), 3, np.dtype(np.int64))
    del first
    larger = small.rows("ids", np.array([1, 1, 1]), 3, np.dtype(np.int64))
    del larger
    again = small.rows("ids", np.array([1, 1, 1]), 3, np.dtype(np.int64))
    assert again.shape == (3, 3) and len(small._pools[("ids", 3, np.dtype(np.int64), 0)]) == 1


@pytest.mark.parametrize("n", [10, 1 << 20])
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, np.float32, np.bool_])
def test_fresh_arrays_own_their_views_whoever_allocates_them(n, dtype):
    array = fresh((n, 2), dtype, 1)
    assert array.shape == (n, 2) and array.dtype == dtype and (array == 1).all()
    before = sys.getrefcount(array)
    view = array[1:]
    after = sys.getrefcount(array)
    assert after == before + 1 and view.base is array


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


def test_copy_aligned_runs_copies_each_run_with_casting():
    dst = np.zeros(10, dtype=np.int64)
    src = np.arange(6, dtype=np.uint16)
    copy_aligned_runs([(dst, src)], np.array([0, 6]), np.array([1, 4]), np.array([3, 2]))
    np.testing.assert_array_equal(dst, [1, 2, 3, 0, 0, 0, 4, 5, 0, 0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "dtypes", [(np.uint16, np.float32), (np.int32, np.uint16), (np.int64, np.float64)]
)
def test_gather_runs_equals_a_loop_of_slices_with_empty_and_repeated_runs(dtypes, backend):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 9, 50)
    lengths[[0, 7, 49]] = 0  # empty runs, at the ends too
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    arrays = [rng.integers(0, 1000, int(indptr[-1])).astype(t) for t in dtypes]
    for array in arrays:  # as Arrow's zero-copy views are
        array.flags.writeable = False
    rows = np.concatenate([rng.permutation(50), [3, 3, 0, 49]])  # any order, repeats
    kernels = Kernels(backend)  # "numba" compiles before it runs: the kernel path is taken
    try:
        offsets, got = gather_runs(indptr, arrays, rows, kernels)
    finally:
        kernels.close()
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(lengths[rows])]))
    assert offsets.dtype == np.int64
    for array, out in zip(arrays, got, strict=True):
        assert out.dtype == array.dtype
        assert out.flags.writeable == (backend == "numba")  # the kernel's own arrays
        want = np.concatenate([array[indptr[r] : indptr[r + 1]] for r in rows])
        np.testing.assert_array_equal(out, want)
    empty_offsets, empty = gather_runs(indptr, arrays, np.array([], dtype=np.int64))
    np.testing.assert_array_equal(empty_offsets, [0])
    assert [len(e) for e in empty] == [0, 0]


def test_batches_held_by_the_consumer_keep_their_tokens(tmp_path):
    path = tmp_path / "a.slaf"
    slafload.synthetic.write_atlas(path, n_cells=600, n_genes=300, mean_nnz=40, seed=1)
    options = dict(
        batch_size=16, max_genes=64, seed=0, n_epochs=2, tuning=slafload.Tuning(piece_cells=64)
    )
    for tokenizer in ("geneformer", "scgpt", "raw"):
        with slafload.Loader(path, tokenizer=tokenizer, **options) as loader:
            held = [{k: v.clone() for k, v in b.items()} for b in loader]
        with slafload.Loader(path, tokenizer=tokenizer, **options) as loader:
            kept = list(loader)  # every batch still viewing its piece's array
        assert len(kept) == len(held)
        for a, b in zip(held, kept, strict=True):
            for key in a:
                assert torch.equal(a[key], b[key]), (tokenizer, key)
