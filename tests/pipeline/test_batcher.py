"""Batcher: fixed-size batches across chunk boundaries, short or dropped last batch; ToTorch's
copies into pinned memory."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from slafload import Loader
from slafload.pipeline.batcher import Batcher, ToTorch, copy_into
from slafload.pipeline.partition import Tagged


def feed(batcher, sizes):
    out, start = [], 0
    for n in sizes:
        ids = np.arange(start, start + n)
        out += list(batcher.add({"id": ids, "x": np.stack([ids, ids], axis=1)}))
        start += n
    return out + list(batcher.finish())


@pytest.mark.parametrize("sizes", [[10], [3, 3, 3, 1], [0, 7, 0, 3], [25]])
def test_rows_carry_over_chunk_boundaries_in_order(sizes):
    batches = feed(Batcher(4), sizes)
    lengths = [len(b["id"]) for b in batches]
    total = sum(sizes)
    assert lengths == [4] * (total // 4) + ([total % 4] if total % 4 else [])
    np.testing.assert_array_equal(np.concatenate([b["id"] for b in batches]), np.arange(total))
    for b in batches:
        np.testing.assert_array_equal(b["x"][:, 0], b["id"])


def test_drop_last_drops_only_the_short_tail_and_resets():
    batcher = Batcher(4, drop_last=True)
    assert [len(b["id"]) for b in feed(batcher, [6, 5])] == [4, 4]
    assert [len(b["id"]) for b in feed(batcher, [4])] == [4]


def test_unequal_columns_and_bad_batch_size_are_rejected():
    with pytest.raises(ValueError, match="equal lengths"):
        list(Batcher(2).add({"a": np.zeros(3), "b": np.zeros(2)}))
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        Batcher(0)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, np.float32, bool])
def test_copy_into_copies_strided_and_read_only_arrays_exactly(dtype):
    rng = np.random.default_rng(0)
    whole = rng.integers(0, 1000, (6, 9)).astype(dtype)
    strided = whole[::2, 1::3]  # neither contiguous nor its own memory
    out = torch.empty(strided.shape, dtype=torch.from_numpy(whole).dtype)
    copy_into(out, strided)
    np.testing.assert_array_equal(out.numpy(), strided)
    flat = whole.reshape(-1)
    arrow = pa.array(flat).to_numpy(zero_copy_only=dtype is not bool)  # a read-only view
    out = torch.empty(arrow.shape, dtype=out.dtype)
    copy_into(out, arrow)
    np.testing.assert_array_equal(out.numpy(), flat)


def test_copy_into_refuses_another_shape_or_dtype():
    with pytest.raises(ValueError, match=r"shape \(3,\) into \(4,\)"):
        copy_into(torch.empty(4, dtype=torch.int64), np.arange(3))
    with pytest.raises(TypeError):
        copy_into(torch.empty(3, dtype=torch.int32), np.arange(3, dtype=np.int64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_pinned_batches_are_page_locked_and_reach_the_device_unchanged(small_slaf):
    arrays = {"input_ids": np.arange(40).reshape(4, 10), "mask": np.ones((4, 10), bool)}
    (tagged,) = ToTorch(iter([Tagged(arrays)]), pin_memory=True)
    batch = tagged.item
    for k, v in batch.items():
        assert v.is_pinned()
        np.testing.assert_array_equal(v.numpy(), arrays[k])
    options = dict(tokenizer="scgpt", batch_size=7, max_genes=16, seed=3, n_epochs=1)
    with Loader(small_slaf, **options) as host, Loader(small_slaf, device="cuda", **options) as gpu:
        pairs = list(zip(host, gpu, strict=True))
    for a, b in pairs:
        assert a.keys() == b.keys()
        for k in a:
            assert b[k].device.type == "cuda"
            torch.testing.assert_close(b[k].cpu(), a[k], rtol=0, atol=0)
