"""Layouts: ``longest`` and ``packed`` are ``padded`` minus its padding, cell for cell."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_counts, write_dense
from resume_conformance import assert_resumes_exactly

from slafload import Loader
from slafload.errors import LayoutError
from slafload.samplers import BlockShuffle, ChunkShuffle
from slafload.tokenizers import GENE_OFFSET, PAD

pytestmark = pytest.mark.usefixtures("no_thread_leak")

TOKENIZERS = ["geneformer", "scgpt", "raw"]
STREAMS = {"geneformer": ["input_ids"], "scgpt": ["input_ids", "values"],
           "raw": ["gene_ids", "values"]}  # fmt: skip
PAD_OF = {"gene_ids": -1}
SAMPLERS = {  # a shuffled fetch tokenized whole, and fetches cut into pieces
    "chunk": lambda: ChunkShuffle(chunk_cells=50),
    "pieces": lambda: BlockShuffle(block_size=5, fetch_factor=4, batch_size=32),
}


@pytest.fixture(scope="module")
def atlas(tmp_path_factory):
    # ~12 genes per cell: max_genes=8 truncates most cells, some fill a row exactly; every
    # 37th cell is empty.
    dense = random_counts(300, 40, seed=1, empty_every=37)
    return write_dense(tmp_path_factory.mktemp("layout") / "l.slaf", dense, max_rows_per_file=97)


def batches(atlas, tokenizer, layout, *, sampler="chunk", max_genes=8, **settings):
    with Loader(atlas, tokenizer=tokenizer, layout=layout, sampler=SAMPLERS[sampler](),
                max_genes=max_genes, batch_size=32, chunk_cells=64, **settings) as loader:  # fmt: skip
        return list(loader)


def real_tokens(padded: dict, tokenizer: str) -> np.ndarray:
    """``[batch, width]`` bool: the padded layout's real (non-padding) tokens."""
    if tokenizer == "raw":
        width = padded["gene_ids"].shape[1]
        return torch.arange(width)[None, :] < padded["lengths"][:, None]
    return padded["attention_mask"]


@pytest.mark.parametrize("max_genes", [8, 64])
@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_packed_and_longest_are_padded_minus_its_padding_cell_for_cell(
    atlas, tokenizer, sampler, max_genes
):
    padded = batches(atlas, tokenizer, "padded", sampler=sampler, max_genes=max_genes)
    longest = batches(atlas, tokenizer, "longest", sampler=sampler, max_genes=max_genes)
    packed = batches(atlas, tokenizer, "packed", sampler=sampler, max_genes=max_genes)
    assert len(padded) == len(longest) == len(packed) == 10  # batches of 32 cells, 300 cells
    streams = STREAMS[tokenizer]
    for pad, lng, pck in zip(padded, longest, packed, strict=True):
        real = real_tokens(pad, tokenizer)
        counts = real.sum(dim=1)
        per_cell = set(pad) - set(streams) - {"attention_mask"}
        assert set(lng) == set(pad)
        assert set(pck) == per_cell | set(streams) | {"cu_seqlens", "position_ids"}
        for key in per_cell:  # cell ids (the same cells, in the same order), raw lengths
            assert torch.equal(lng[key], pad[key]) and torch.equal(pck[key], pad[key])
        # longest: padded cut to the batch's longest cell, and nothing real was cut
        width = int(counts.max())
        assert not real[:, width:].any()
        for key in [*streams, *(["attention_mask"] if "attention_mask" in pad else [])]:
            assert torch.equal(lng[key], pad[key][:, :width]), key
            assert lng[key].is_contiguous(), key
        # packed: each cell's real tokens back to back, FlashAttention's cu_seqlens
        cu = pck["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu[0] == 0
        assert torch.equal(cu[1:] - cu[:-1], counts.to(torch.int32))
        for key in streams:
            assert pck[key].ndim == 1 and pck[key].dtype == pad[key].dtype
            assert torch.equal(pck[key], pad[key][real]), key
        for i in range(len(counts)):
            assert torch.equal(pck["position_ids"][cu[i] : cu[i + 1]], torch.arange(counts[i]))
            for key in streams:
                assert torch.equal(pck[key][cu[i] : cu[i + 1]], pad[key][i, : counts[i]])
                assert (pad[key][i, counts[i] :] == PAD_OF.get(key, PAD)).all()


@pytest.mark.parametrize("layout", ["padded", "longest", "packed"])
@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_int32_tokens_hold_the_same_values_in_half_the_bytes(atlas, tokenizer, layout):
    wide = batches(atlas, tokenizer, layout)
    narrow = batches(atlas, tokenizer, layout, token_dtype="int32")
    for w, n in zip(wide, narrow, strict=True):
        assert w.keys() == n.keys()
        for key in w:
            if key in (*STREAMS[tokenizer], "position_ids") and w[key].dtype == torch.int64:
                assert n[key].dtype == torch.int32, key
                assert torch.equal(n[key].long(), w[key]), key
            else:  # cell ids, lengths, masks, float values, cu_seqlens: unchanged
                assert n[key].dtype == w[key].dtype and torch.equal(n[key], w[key]), key


def test_an_embedding_takes_int32_packed_tokens(atlas):
    batch = batches(atlas, "geneformer", "packed", token_dtype="int32")[0]
    embedding = torch.nn.Embedding(40 + GENE_OFFSET, 4)
    assert embedding(batch["input_ids"]).shape == (len(batch["input_ids"]), 4)


@pytest.mark.parametrize("layout", ["longest", "packed"])
@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_every_layout_resumes_batch_for_batch(atlas, tokenizer, layout):
    def make():
        return Loader(atlas, tokenizer=tokenizer, layout=layout, max_genes=8, batch_size=24,
                      chunk_cells=40, seed=5)  # fmt: skip

    assert_resumes_exactly(make, midpoints=3)


@pytest.mark.parametrize("layout", ["padded", "longest", "packed"])
def test_the_torch_dataset_face_yields_the_loaders_batches_in_every_layout(atlas, layout):
    def make():
        return Loader(atlas, tokenizer="scgpt", layout=layout, max_genes=8, batch_size=24,
                      chunk_cells=40, seed=2)  # fmt: skip

    with make() as loader:
        want = list(loader)
    ds = make().as_torch_dataset()
    got = list(ds)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # resume mid-epoch through the dataset's own state
    ds = make().as_torch_dataset()
    it = iter(ds)
    head = [next(it) for _ in range(4)]
    resumed = make().as_torch_dataset()
    resumed.load_state_dict(ds.state_dict())
    for a, b in zip(head + list(resumed), want, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
def test_packed_batches_cross_dataloader_workers(atlas):
    from torch.utils.data import DataLoader

    with Loader(atlas, tokenizer="geneformer", layout="packed", max_genes=8, batch_size=24,
                chunk_cells=40) as loader:  # fmt: skip
        ds = loader.as_torch_dataset()
    got = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn"))
    cells = torch.cat([b["cell_integer_id"] for b in got])
    assert torch.equal(cells.sort().values, torch.arange(300))
    for b in got:
        assert int(b["cu_seqlens"][-1]) == len(b["input_ids"]) == len(b["position_ids"])


class PairTokens:
    """A third-party tokenizer: (gene, count) rows with an attention mask, pad -7."""

    name = "pairs"

    def __call__(self, ranked):
        n, width = ranked.n_cells, 6
        genes = np.full((n, width), -7, dtype=np.int64)
        counts = np.zeros((n, width), dtype=np.float32)
        keep = ranked.top(width)
        genes[ranked.entry_row[keep], ranked.entry_rank[keep]] = ranked.genes[keep]
        counts[ranked.entry_row[keep], ranked.entry_rank[keep]] = ranked.values[keep]
        return {"genes": genes, "counts": counts, "attention_mask": genes != -7}


def test_a_plugin_tokenizer_is_packed_by_its_attention_mask(atlas):
    def run(layout):
        with Loader(atlas, tokenizer=PairTokens(), layout=layout, batch_size=32) as loader:
            return list(loader)

    for pad, lng, pck in zip(run("padded"), run("longest"), run("packed"), strict=True):
        real = pad["attention_mask"]
        width = int(real.sum(1).max())
        for key in ("genes", "counts", "attention_mask"):
            assert torch.equal(lng[key], pad[key][:, :width])
        for key in ("genes", "counts"):
            assert torch.equal(pck[key], pad[key][real])
        assert "attention_mask" not in pck


class Unmasked:
    name = "unmasked"

    def __call__(self, ranked):
        return {"ids": np.zeros((ranked.n_cells, 3), dtype=np.int64)}


@pytest.mark.parametrize("layout", ["longest", "packed"])
def test_a_tokenizer_without_attention_mask_can_only_be_padded(atlas, layout):
    with (
        Loader(atlas, tokenizer=Unmasked(), layout=layout) as loader,
        pytest.raises(LayoutError, match="attention_mask"),
    ):
        next(iter(loader))


@pytest.mark.parametrize(
    ("setting", "value"),
    [("layout", "ragged"), ("token_dtype", "int16"), ("tokenize_on", "gpu")],
)
def test_a_bad_layout_setting_is_refused_up_front_by_name(atlas, setting, value):
    with pytest.raises(ValueError, match=setting):
        Loader(atlas, **{setting: value})


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_position_ids_restart_at_every_row_empty_rows_included(dtype):
    from slafload.pipeline.layout import position_ids

    lengths = [3, 0, 1, 0, 0, 4, 2, 0]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    got = position_ids(offsets, np.dtype(dtype))
    assert got.dtype == dtype
    assert got.tolist() == [i for n in lengths for i in range(n)]
    assert len(position_ids(np.zeros(3, dtype=np.int64), np.dtype(dtype))) == 0


@pytest.mark.parametrize("tokenize_on", ["producer", "device"])
def test_int32_tokens_refuse_scgpt_value_tokens_they_cannot_hold(atlas, tokenize_on):
    from slafload.tokenizers import ScGPT

    too_far = ScGPT(max_genes=8, value_offset=2**31 - 10)  # top token 2**31 + 39
    with pytest.raises(LayoutError, match="token_dtype='int32' cannot hold .* value_offset"):
        Loader(atlas, tokenizer=too_far, token_dtype="int32", tokenize_on=tokenize_on)
    fits = ScGPT(max_genes=8, value_offset=2**31 - 51)  # top token 2**31 - 1
    with Loader(atlas, tokenizer=fits, token_dtype="int32", batch_size=300,
                tokenize_on=tokenize_on) as loader:  # fmt: skip
        values = next(iter(loader))["values"]
    assert int(values.max()) <= 2**31 - 1 and int(values[values != PAD].min()) >= 2**31 - 51
