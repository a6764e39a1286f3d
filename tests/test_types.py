"""The batch types: every batch a loader or its DataLoader face yields matches the TypedDict of
its layout, key by key, in dtype and shape."""

from __future__ import annotations

import typing

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import random_counts, write_dense

import slafload
from slafload.types import LoaderBatch, PackedBatch, PaddedBatch, TensorSpec

TOKENIZERS = ("geneformer", "scgpt", "raw")
LAYOUTS = ("padded", "longest", "packed")


def declared(kind: type) -> dict[str, tuple[TensorSpec, bool]]:
    """Each key of ``kind``: its :class:`TensorSpec` and whether every batch has it."""
    hints = typing.get_type_hints(kind, localns={"torch": torch}, include_extras=True)
    out = {}
    for key, hint in hints.items():
        required = typing.get_origin(hint) is typing.Required
        annotated = typing.get_args(hint)[0] if required else hint
        tensor, spec = typing.get_args(annotated)
        assert tensor is torch.Tensor and isinstance(spec, TensorSpec), key
        out[key] = (spec, required)
    return out


def assert_matches(batch: LoaderBatch, kind: type, extra: tuple[str, ...] = ()) -> None:
    """``batch`` holds ``kind``'s required keys, and every key it holds is declared (or one of
    ``extra``, the obs columns) with a declared dtype and the declared shape."""
    fields = declared(kind)
    assert {k for k, (_, required) in fields.items() if required} <= set(batch)
    assert set(batch) <= set(fields) | set(extra), sorted(set(batch) - set(fields))
    tensors = typing.cast(dict[str, torch.Tensor], batch)
    n = len(tensors["cell_integer_id"])
    sizes = {"batch": n, "batch + 1": n + 1}
    if "cu_seqlens" in tensors:
        sizes["tokens"] = int(tensors["cu_seqlens"][-1])
    widths = set()
    for key, value in tensors.items():
        spec = fields[key][0] if key in fields else TensorSpec(("batch",), ("int64",))
        assert str(value.dtype).removeprefix("torch.") in spec.dtypes, (key, value.dtype)
        assert value.ndim == len(spec.dims), (key, value.shape)
        for dim, size in zip(spec.dims, value.shape, strict=True):
            if dim == "width":
                widths.add(size)
            else:
                assert size == sizes[dim], (key, dim, value.shape)
    assert len(widths) <= 1  # every padded stream of a batch has one width


@pytest.fixture
def atlas(tmp_path):
    counts = random_counts(60, 30, seed=3, empty_every=11)
    plates = pa.table({"plate": [f"p{i % 3}" for i in range(60)]})
    return write_dense(tmp_path / "a.slaf", counts, obs=plates)


@pytest.mark.parametrize("on", ["producer", "device"])
@pytest.mark.parametrize("token_dtype", ["int64", "int32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_every_batch_matches_the_typed_dict_of_its_layout(
    atlas, tokenizer, layout, token_dtype, on
):
    kind = PackedBatch if layout == "packed" else PaddedBatch
    with slafload.Loader(
        atlas, tokenizer=tokenizer, layout=layout, token_dtype=token_dtype, batch_size=16,
        max_genes=12, obs_columns=["plate"], n_epochs=1, tokenize_on=on, device="cpu",
    ) as loader:  # fmt: skip
        batches = list(loader)
    assert sum(len(b["cell_integer_id"]) for b in batches) == 60
    for batch in batches:
        assert_matches(batch, kind, extra=("plate",))


@pytest.mark.parametrize("token_dtype", ["int64", "int32"])
def test_sparse_batches_match_the_packed_typed_dict(atlas, token_dtype):
    with slafload.Loader(
        atlas, tokenizer="sparse", token_dtype=token_dtype, batch_size=16, obs_columns=["plate"]
    ) as loader:
        batches = list(loader)
    for batch in batches:
        assert_matches(batch, PackedBatch, extra=("plate",))
        assert "position_ids" not in batch


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_mixtures_batches_carry_source_codes_as_declared(tmp_path, atlas, layout):
    other = write_dense(tmp_path / "b.slaf", random_counts(40, 30, seed=4))
    with slafload.Loader(
        [atlas, other], tokenizer="scgpt", layout=layout, batch_size=16, max_genes=12,
        n_epochs=1,
    ) as loader:  # fmt: skip
        batches = list(loader)
    assert all("source" in batch for batch in batches)
    for batch in batches:
        assert_matches(batch, PackedBatch if layout == "packed" else PaddedBatch)


def test_the_dataloader_face_yields_the_loaders_batch_types(atlas):
    with slafload.Loader(
        atlas, tokenizer="geneformer", layout="packed", batch_size=16, max_genes=12,
        obs_columns=["plate"],
    ) as loader:  # fmt: skip
        dataset = loader.as_torch_dataset()
    batches = list(dataset)
    assert np.concatenate([b["cell_integer_id"].numpy() for b in batches]).size == 60
    for batch in batches:
        assert_matches(batch, PackedBatch, extra=("plate",))


def test_the_layouts_declare_their_own_keys():
    padded, packed = declared(PaddedBatch), declared(PackedBatch)
    assert {"attention_mask"} <= set(padded) - set(packed)
    assert {"cu_seqlens", "position_ids"} <= set(packed) - set(padded)
    assert padded["cell_integer_id"][1] and packed["cu_seqlens"][1]  # in every batch
    assert not padded["source"][1]  # a mixture's only
    assert set(typing.get_args(LoaderBatch)) == {PaddedBatch, PackedBatch}
    assert slafload.PaddedBatch is PaddedBatch and slafload.PackedBatch is PackedBatch
