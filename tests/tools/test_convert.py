"""AnnData -> SLAF conversion: round trips, value storage, obs/var, pre-shuffle, memory, slafdb."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import geneformer_reference, random_counts, scgpt_reference

import slafload
from slafload import Loader, open_dataset
from slafload.tools.diversity import mean_batch_entropy

ad = pytest.importorskip("anndata", exc_type=ImportError)
pd = pytest.importorskip("pandas", exc_type=ImportError)
sp = pytest.importorskip("scipy.sparse", exc_type=ImportError)

MAX_GENES = 12
FORMATS = {"csr": sp.csr_matrix, "csc": sp.csc_matrix, "dense": np.asarray}


def make_adata(dense: np.ndarray, fmt: str = "csr", *, seed: int = 0, prefix: str = "c"):
    rng = np.random.default_rng(seed)
    n_cells, n_genes = dense.shape
    obs = pd.DataFrame(
        {
            "plate": pd.Categorical(rng.choice(["p0", "p1", "p2"], n_cells)),
            "depth": dense.sum(axis=1).astype(np.int64),
            "score": rng.random(n_cells),
            "donor.id": np.array([f"d{i % 4}" for i in range(n_cells)], dtype=object),
        },
        index=[f"{prefix}{i}" for i in range(n_cells)],
    )
    var = pd.DataFrame(
        {"symbol": [f"SYM{g}" for g in range(n_genes)]}, index=[f"G{g}" for g in range(n_genes)]
    )
    return ad.AnnData(FORMATS[fmt](dense), obs=obs, var=var)


def write_h5ad(path: Path, adata) -> Path:
    adata.write_h5ad(path)
    return path


def sentences(path, tokenizer: str, **options) -> dict[int, dict[str, np.ndarray]]:
    rows = {}
    with Loader(path, tokenizer=tokenizer, max_genes=MAX_GENES, batch_size=16, **options) as ld:
        for batch in ld:
            for i, cell in enumerate(batch["cell_integer_id"].tolist()):
                rows[cell] = {k: v[i].numpy() for k, v in batch.items()}
    return rows


@pytest.fixture(scope="module")
def counts() -> np.ndarray:
    return random_counts(90, 30, seed=5, density=0.4, max_count=9, empty_every=13)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_tokens_equal_tokens_computed_from_the_anndata_matrix(tmp_path, counts, fmt):
    h5ad = write_h5ad(tmp_path / "in.h5ad", make_adata(counts, fmt))
    out = slafload.convert(h5ad, tmp_path / "out.slaf", chunk_cells=7)
    assert not counts[0].any()  # a cell with no counts flows through as [CLS] [SEP]
    geneformer = sentences(out, "geneformer")
    scgpt = sentences(out, "scgpt")
    assert sorted(geneformer) == sorted(scgpt) == list(range(len(counts)))
    for cell, row in enumerate(counts):
        np.testing.assert_array_equal(
            geneformer[cell]["input_ids"], geneformer_reference(row, MAX_GENES)
        )
        ids, values = scgpt_reference(row, MAX_GENES, 51)
        np.testing.assert_array_equal(scgpt[cell]["input_ids"], ids)
        np.testing.assert_array_equal(scgpt[cell]["values"], values)


def test_an_in_memory_anndata_converts_like_its_file(tmp_path, counts):
    adata = make_adata(counts, "csc")
    from_memory = open_dataset(slafload.convert(adata, tmp_path / "mem.slaf"))
    from_file = open_dataset(
        slafload.convert(write_h5ad(tmp_path / "f.h5ad", adata), tmp_path / "file.slaf")
    )
    assert from_memory.expression.to_table().equals(from_file.expression.to_table())
    assert from_memory.obs().equals(from_file.obs())


def test_obs_and_var_columns_are_kept_with_categoricals_as_strings(tmp_path, counts):
    adata = make_adata(counts)
    ds = open_dataset(slafload.convert(adata, tmp_path / "o.slaf"))
    obs, var = ds.obs(), ds.var()
    assert obs["cell_id"].to_list() == list(adata.obs_names)
    assert obs["plate"].to_list() == adata.obs["plate"].astype(str).tolist()
    assert obs["donor_id"].to_list() == adata.obs["donor.id"].tolist()  # '.' is not allowed
    np.testing.assert_array_equal(obs["depth"].to_numpy(), adata.obs["depth"].to_numpy())
    np.testing.assert_array_equal(obs["score"].to_numpy(), adata.obs["score"].to_numpy())
    assert var["gene_id"].to_list() == list(adata.var_names)
    assert var["symbol"].to_list() == adata.var["symbol"].tolist()
    codes, categories = ds.obs_codes("plate")
    assert categories == ["p0", "p1", "p2"]
    assert [categories[c] for c in codes] == obs["plate"].to_list()


@pytest.mark.parametrize(
    ("scale", "dtype", "expected"),
    [
        (1, np.int32, "uint16"),
        (1, np.float32, "uint16"),  # float matrices holding whole counts are counts
        (20_000, np.int64, "uint32"),  # max count 180,000 does not fit uint16
        (0.37, np.float64, "float"),
    ],
)
def test_integer_counts_are_stored_compactly_and_floats_as_float32(
    tmp_path, counts, scale, dtype, expected
):
    matrix = (counts.astype(np.float64) * scale).astype(dtype)
    ds = open_dataset(slafload.convert(make_adata(matrix), tmp_path / "v.slaf"))
    assert str(ds.value_type) == expected
    stored = ds.expression.to_table().column("value").to_numpy()
    np.testing.assert_allclose(stored, matrix[matrix > 0].astype(np.float32))


def test_explicit_zeros_are_dropped_and_genes_sorted(tmp_path):
    indptr = np.array([0, 3, 5])
    indices = np.array([4, 1, 2, 0, 3])  # unsorted within cell 0
    data = np.array([2, 0, 5, 7, 0], dtype=np.int32)  # two explicit zeros
    matrix = sp.csr_matrix((data, indices, indptr), shape=(2, 5))
    ds = open_dataset(slafload.convert(ad.AnnData(matrix), tmp_path / "z.slaf"))
    table = ds.expression.to_table().to_pydict()
    assert table == {
        "cell_integer_id": [0, 0, 1],
        "gene_integer_id": [2, 4, 0],
        "value": [5, 2, 7],
    }


def test_layer_and_raw_choose_the_matrix(tmp_path, counts):
    adata = make_adata(counts)
    adata.layers["double"] = sp.csr_matrix(counts.astype(np.int32) * 2)
    adata.raw = make_adata(counts * 3)
    h5ad = write_h5ad(tmp_path / "l.h5ad", adata)
    layer = open_dataset(slafload.convert(h5ad, tmp_path / "layer.slaf", layer="double"))
    raw = open_dataset(slafload.convert(h5ad, tmp_path / "raw.slaf", raw=True))
    x = counts[counts > 0]
    np.testing.assert_array_equal(layer.expression.to_table().column("value").to_numpy(), 2 * x)
    np.testing.assert_array_equal(raw.expression.to_table().column("value").to_numpy(), 3 * x)
    assert raw.var()["symbol"].to_list() == adata.raw.var["symbol"].tolist()
    with pytest.raises(ValueError, match="no layer 'missing'"):
        slafload.convert(h5ad, tmp_path / "x.slaf", layer="missing")
    with pytest.raises(ValueError, match="not both"):
        slafload.convert(h5ad, tmp_path / "x.slaf", layer="double", raw=True)


def test_several_inputs_concatenate_with_a_source_column(tmp_path, counts):
    first = write_h5ad(tmp_path / "one.h5ad", make_adata(counts[:40], prefix="a"))
    second = write_h5ad(tmp_path / "two.h5ad", make_adata(counts[40:], "dense", prefix="b"))
    ds = open_dataset(slafload.convert([first, second], tmp_path / "both.slaf", chunk_cells=16))
    obs = ds.obs()
    assert obs["source"].to_list() == ["one"] * 40 + ["two"] * 50
    assert obs["cell_id"].to_list()[39:41] == ["a39", "b0"]
    tokens = sentences(ds, "geneformer")
    for cell, row in enumerate(counts):
        np.testing.assert_array_equal(tokens[cell]["input_ids"], geneformer_reference(row, 12))


def test_inputs_with_different_genes_are_rejected_with_the_first_difference(tmp_path, counts):
    other = make_adata(counts)
    other.var_names = [f"G{g}" for g in range(29)] + ["OTHER"]
    with pytest.raises(ValueError, match=r"gene 29 is 'OTHER', not 'G29'"):
        slafload.convert([make_adata(counts), other], tmp_path / "x.slaf")
    assert not (tmp_path / "x.slaf").exists()


def test_negative_values_and_user_mistakes_raise_clear_errors(tmp_path, counts):
    scaled = counts.astype(np.float32) - 1
    with pytest.raises(ValueError, match="negative values.*--raw"):
        slafload.convert(make_adata(scaled), tmp_path / "n.slaf")
    with pytest.raises(FileNotFoundError, match="nope.h5ad"):
        slafload.convert(tmp_path / "nope.h5ad", tmp_path / "n.slaf")
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="overwrite"):
        slafload.convert(make_adata(counts), tmp_path / "taken")
    with pytest.raises(ValueError, match="shuffle_block"):
        slafload.convert(make_adata(counts), tmp_path / "n.slaf", shuffle_block=0)


def test_pre_shuffle_writes_seeded_blocks_keeping_ids_obs_and_expression(tmp_path, counts):
    adata = make_adata(counts)
    kwargs = {"shuffle_seed": 3, "shuffle_block": 4, "chunk_cells": 10}
    ds = open_dataset(slafload.convert(adata, tmp_path / "s.slaf", **kwargs))
    again = open_dataset(slafload.convert(adata, tmp_path / "s2.slaf", **kwargs))
    order = ds.obs()["original_index"].to_numpy()
    np.testing.assert_array_equal(order, again.obs()["original_index"].to_numpy())
    assert sorted(order) == list(range(len(counts))) and not (order == np.arange(90)).all()
    blocks = [np.arange(s, min(s + 4, len(order))) for s in order[order % 4 == 0]]
    np.testing.assert_array_equal(order, np.concatenate(blocks))  # whole blocks, inner order kept
    obs = ds.obs()
    assert obs["cell_id"].to_list() == [f"c{i}" for i in order]
    assert obs["plate"].to_list() == adata.obs["plate"].astype(str).to_numpy()[order].tolist()
    tokens = sentences(ds, "geneformer")
    for cell, original in enumerate(order):
        np.testing.assert_array_equal(
            tokens[cell]["input_ids"], geneformer_reference(counts[original], MAX_GENES)
        )


def plate_entropy(path, batch_size: int = 32) -> float:
    """Mean Shannon entropy (bits) of the plate label within each minibatch of plain streaming."""
    with Loader(
        path, shuffle=False, obs_columns=["plate"], batch_size=batch_size, max_genes=8
    ) as loader:
        return mean_batch_entropy(batch["plate"].numpy() for batch in loader)


def test_pre_shuffle_mixes_plates_within_plain_streaming_minibatches(tmp_path):
    atlas = open_dataset(
        slafload.tools.synthetic.write_atlas(
            tmp_path / "atlas.slaf", n_cells=1024, n_genes=64, n_plates=8, mean_nnz=16
        )
    )
    table = atlas.expression.to_table()
    matrix = sp.csr_matrix(
        (
            table.column("value").to_numpy(),
            (
                table.column("cell_integer_id").to_numpy(),
                table.column("gene_integer_id").to_numpy(),
            ),
        ),
        shape=(atlas.n_cells, atlas.n_genes),
    )
    obs = atlas.obs(["cell_id", "plate"]).to_pandas().set_index("cell_id")
    h5ad = write_h5ad(tmp_path / "atlas.h5ad", ad.AnnData(matrix, obs=obs))
    plain = slafload.convert(h5ad, tmp_path / "plain.slaf")
    shuffled = slafload.convert(h5ad, tmp_path / "shuf.slaf", shuffle_seed=0, shuffle_block=4)
    before, after = plate_entropy(plain), plate_entropy(shuffled)
    assert before < 0.2  # plate-ordered: nearly every minibatch holds one plate
    assert after > 2.0  # 8 plates: log2(8) = 3 bits at most


RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import anndata, numpy, scipy.sparse
    import slafload

    def status(key):  # kB -> bytes; VmHWM is this process's peak RSS since exec or reset
        with open("/proc/self/status") as fh:
            line = next(line for line in fh if line.startswith(key + ":"))
        return int(line.split()[1]) * 1024

    # Warm up on a tiny input: imports, Lance's thread pools and allocator arenas are a fixed
    # cost, not memory that grows with the input.
    warm = anndata.AnnData(scipy.sparse.csr_matrix(numpy.ones((512, 2000), numpy.float32)))
    slafload.convert(warm, sys.argv[1] + ".warm", chunk_cells=512)
    growth = []
    for h5ad in sys.argv[2:]:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset VmHWM to the current RSS
        base = status("VmRSS")
        slafload.convert(h5ad, h5ad + ".slaf", chunk_cells=512)
        growth.append(status("VmHWM") - base)
    print(json.dumps(growth))
    """
)


def write_big_h5ad(path: Path, n_cells: int, n_genes: int = 2000, nnz: int = 400) -> int:
    """A CSR h5ad of ``n_cells`` cells with ``nnz`` non-zeros each; returns the matrix bytes."""
    rng = np.random.default_rng(n_cells)
    stride = n_genes // nnz  # each cell: every stride-th gene from a random offset, sorted
    indices = rng.integers(0, stride, size=(n_cells, 1)) + np.arange(nnz) * stride
    data = rng.integers(1, 50, size=n_cells * nnz).astype(np.float32)
    indptr = np.arange(0, n_cells * nnz + 1, nnz, dtype=np.int64)
    matrix = sp.csr_matrix((data, indices.ravel().astype(np.int32), indptr), (n_cells, n_genes))
    ad.AnnData(matrix).write_h5ad(path)
    return data.nbytes + matrix.indices.nbytes + indptr.nbytes


def test_an_h5ad_larger_than_the_memory_cap_converts_with_flat_peak_rss(tmp_path):
    small_size = write_big_h5ad(tmp_path / "small.h5ad", 5_000)
    large_size = write_big_h5ad(tmp_path / "large.h5ad", 40_000)
    run = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, str(tmp_path / "warm"),
         str(tmp_path / "small.h5ad"), str(tmp_path / "large.h5ad")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    small, large = json.loads(run.stdout.strip().splitlines()[-1])
    cap = 96 * 2**20
    assert small_size < cap < large_size  # the larger input does not fit under the cap ...
    assert large < cap  # ... yet converting it stays under it (peak RSS growth)
    assert large < small + 32 * 2**20  # 8x the cells, about the same peak


# -- slafdb interoperability -------------------------------------------------------------------


@pytest.fixture
def slaf_module():
    slaf = pytest.importorskip("slaf", exc_type=ImportError)
    pytest.importorskip("psutil", exc_type=ImportError)  # slafdb's loader needs it
    return slaf


@pytest.mark.peers
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_a_slafload_conversion_opens_in_slafdb_and_its_loader_iterates_it(
    tmp_path, counts, slaf_module
):
    from slaf.ml.dataloaders import SLAFDataLoader

    out = slafload.convert(make_adata(counts), tmp_path / "ours.slaf")
    array = slaf_module.SLAFArray(str(out))
    array.wait_for_metadata()
    assert array.shape == counts.shape
    loader = SLAFDataLoader(array, tokenizer_type="geneformer", batch_size=8, max_genes=16,
                            verbose=False, n_epochs=1)  # fmt: skip
    seen: set[int] = set()
    deadline = time.monotonic() + 60
    try:
        for batch in loader:
            seen.update(np.asarray(batch["cell_ids"]).tolist())
            if len(seen) == int(counts.any(axis=1).sum()) or time.monotonic() > deadline:
                break
    finally:
        loader._dataset.prefetcher.stop()
    assert seen == set(np.flatnonzero(counts.any(axis=1)).tolist())  # slafdb skips empty cells


@pytest.mark.peers
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("tokenizer", ["geneformer", "scgpt"])
def test_a_slafdb_conversion_yields_the_same_sentences_as_slafload_conversion(
    tmp_path, counts, slaf_module, tokenizer
):
    from slaf.data.converter import SLAFConverter

    h5ad = write_h5ad(tmp_path / "in.h5ad", make_adata(counts))
    SLAFConverter().convert(str(h5ad), str(tmp_path / "theirs.slaf"))
    ours = slafload.convert(h5ad, tmp_path / "ours.slaf", chunk_cells=16)
    theirs_ds, ours_ds = open_dataset(tmp_path / "theirs.slaf"), open_dataset(ours)
    ids = {"theirs": theirs_ds.obs()["cell_id"].to_list(), "ours": ours_ds.obs()["cell_id"]}
    a, b = sentences(theirs_ds, tokenizer), sentences(ours_ds, tokenizer)
    by_id_theirs = {ids["theirs"][cell]: row for cell, row in a.items()}
    by_id_ours = {ids["ours"][cell]: row for cell, row in b.items()}
    assert by_id_theirs.keys() == by_id_ours.keys() == set(make_adata(counts).obs_names)
    for cell_id, row in by_id_ours.items():
        for key in ("input_ids", "attention_mask", "values"):
            if key in row:
                np.testing.assert_array_equal(row[key], by_id_theirs[cell_id][key])
