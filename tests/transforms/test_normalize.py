"""Per-gene median normalisation against numpy references."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from conftest import csr_from_dense, random_counts, unsorted_csr, write_dense

from slafload import Loader, open_dataset
from slafload.tools.writer import write_slaf
from slafload.transforms.normalize import GeneMedians, MedianNormalize, MediansError, gene_medians
from slafload.transforms.vocab import Vocabulary


def write_named(path, dense, names):
    var = {"gene_id": pa.array(names)}
    return write_slaf(path, [csr_from_dense(dense)], n_genes=dense.shape[1], var=var)


def nonzero_medians(dense: np.ndarray) -> np.ndarray:
    """np.median of each column's non-zeros (NaN for an all-zero column)."""
    return np.array(
        [np.median(col[col > 0]) if (col > 0).any() else np.nan for col in dense.T.astype(float)]
    )


def normalized_reference(row: np.ndarray, medians: np.ndarray, max_genes: int) -> np.ndarray:
    """Geneformer tokens of ``row / medians``: rank descending, ties by gene id."""
    scaled = row / medians
    genes = np.flatnonzero(row > 0)
    genes = genes[np.lexsort((genes, -scaled[genes]))]
    tokens = np.concatenate([[1], genes + 4, [2]])[:max_genes]
    return np.pad(tokens, (0, max_genes - len(tokens)))


@pytest.fixture
def counts() -> np.ndarray:
    dense = random_counts(90, 25, seed=3, max_count=20, density=0.4, empty_every=17)
    dense[:, 24] = 0  # a gene never expressed
    return dense


@pytest.mark.parametrize("max_values", [10**6, 40, 1])
def test_gene_medians_equal_numpy_medians_of_nonzeros(tmp_path, counts, max_values):
    ds = open_dataset(write_dense(tmp_path / "a.slaf", counts, max_rows_per_file=53))
    medians = gene_medians(ds, max_values=max_values, batch_rows=37)
    np.testing.assert_array_equal(medians.medians, nonzero_medians(counts))
    np.testing.assert_array_equal(medians.nnz, (counts > 0).sum(axis=0))


@pytest.mark.parametrize("max_values", [10**6, 40])
def test_target_sum_takes_medians_of_scaled_cells(tmp_path, counts, max_values):
    ds = open_dataset(write_dense(tmp_path / "a.slaf", counts))
    totals = counts.sum(axis=1, keepdims=True).astype(float)
    scaled = counts / np.where(totals > 0, totals, 1) * 1e4
    got = gene_medians(ds, target_sum=1e4, max_values=max_values).medians
    np.testing.assert_allclose(got, nonzero_medians(scaled), rtol=1e-12)


def test_medians_round_trip_through_their_file_exactly(tmp_path):
    rng = np.random.default_rng(0)
    dense = np.round(rng.lognormal(0, 1, (40, 12)), 3).astype(np.float32)
    dense[rng.random(dense.shape) > 0.5] = 0
    dense[:, 3] = 0
    ds = open_dataset(write_dense(tmp_path / "f.slaf", dense, value_type=pa.float32()))
    medians = gene_medians(ds)
    loaded = GeneMedians.load(medians.save(tmp_path / "medians.json"))
    np.testing.assert_array_equal(loaded.medians, medians.medians)
    np.testing.assert_array_equal(loaded.nnz, medians.nnz)
    assert loaded.genes == medians.genes and np.isnan(loaded.medians[3])


@pytest.mark.parametrize("max_values", [10**6, 40])
def test_genes_stored_out_of_order_and_twice_give_the_medians_and_tokens_of_the_sums(
    tmp_path, counts, max_values
):
    block = unsorted_csr(counts, seed=4, duplicates=True)
    assert len(block.genes) > np.count_nonzero(counts)
    ds = open_dataset(write_slaf(tmp_path / "u.slaf", [block], n_genes=25, max_rows_per_file=53))
    medians = gene_medians(ds, max_values=max_values, batch_rows=37)
    np.testing.assert_array_equal(medians.medians, nonzero_medians(counts))
    np.testing.assert_array_equal(medians.nnz, (counts > 0).sum(axis=0))
    transforms = [MedianNormalize(medians)]
    with Loader(ds, batch_size=32, max_genes=10, seed=3, transforms=transforms) as loader:
        batches = list(loader)
    got = np.concatenate([b["input_ids"].numpy() for b in batches])
    cells = np.concatenate([b["cell_integer_id"].numpy() for b in batches])
    want = [normalized_reference(counts[c], nonzero_medians(counts), 10) for c in cells]
    np.testing.assert_array_equal(got, np.stack(want))


def test_median_normalisation_reorders_exactly_as_the_numpy_reference(tmp_path, counts):
    ds = open_dataset(write_dense(tmp_path / "a.slaf", counts))
    medians = gene_medians(ds)
    transform = MedianNormalize(medians)
    with Loader(ds, batch_size=32, max_genes=10, seed=3, transforms=[transform]) as loader:
        batches = list(loader)
    got = np.concatenate([b["input_ids"].numpy() for b in batches])
    cells = np.concatenate([b["cell_integer_id"].numpy() for b in batches])
    m = nonzero_medians(counts)
    want = np.stack([normalized_reference(counts[c], m, 10) for c in cells])
    np.testing.assert_array_equal(got, want)
    plain = np.stack([normalized_reference(counts[c], np.ones(25), 10) for c in cells])
    assert not np.array_equal(got, plain)  # normalisation did change the order


def test_normalised_values_reach_the_tokenizer_as_floats(tmp_path, counts):
    ds = open_dataset(write_dense(tmp_path / "a.slaf", counts))
    m = nonzero_medians(counts)
    transforms = [MedianNormalize(gene_medians(ds))]
    with Loader(ds, tokenizer="raw", batch_size=90, max_genes=25, shuffle=False,
                transforms=transforms) as loader:  # fmt: skip
        batch = next(iter(loader))
    genes, values = batch["gene_ids"].numpy(), batch["values"].numpy()
    present = genes >= 0
    expected = counts[np.nonzero(present)[0], genes[present]] / m[genes[present]]
    np.testing.assert_allclose(values[present], expected.astype(np.float32))


def test_medians_of_another_dataset_align_by_gene_name(tmp_path, counts):
    a = open_dataset(write_dense(tmp_path / "a.slaf", counts))
    b = open_dataset(write_dense(tmp_path / "b.slaf", counts[:, :10]))
    aligned = gene_medians(a).aligned_to(b)
    np.testing.assert_array_equal(aligned.medians, nonzero_medians(counts)[:10])
    with pytest.raises(MediansError, match="align them"):
        MedianNormalize(gene_medians(b))(_chunk_of(a))


def _chunk_of(ds):
    from slafload.pipeline.chunk import assemble
    from slafload.pipeline.reader import Reader
    from slafload.samplers import Fetch

    fetch = Fetch(0, np.array([[0, ds.n_cells]]), None)
    return assemble(fetch, Reader(ds).read(fetch), ds.cell_start)


def test_normalising_then_remapping_gives_the_same_tokens_for_both_gene_orders(tmp_path, counts):
    names = [f"G{g}" for g in range(25)]
    perm = np.random.default_rng(5).permutation(25)
    a = open_dataset(write_named(tmp_path / "a.slaf", counts, names))
    b = open_dataset(write_named(tmp_path / "b.slaf", counts[:, perm], [names[p] for p in perm]))
    vocab = Vocabulary.from_dataset(a)
    medians_a = gene_medians(a)
    tokens = []
    for ds, medians in ((a, medians_a), (b, medians_a.aligned_to(b))):
        transforms = [MedianNormalize(medians), vocab.remap(ds)]
        with Loader(ds, batch_size=90, max_genes=10, shuffle=False, transforms=transforms) as ld:
            tokens.append(next(iter(ld))["input_ids"].numpy())
    want = np.stack([normalized_reference(row, nonzero_medians(counts), 10) for row in counts])
    np.testing.assert_array_equal(tokens[0], want)
    np.testing.assert_array_equal(tokens[1], want)
