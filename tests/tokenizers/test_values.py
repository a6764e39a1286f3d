"""Expression values alongside gene tokens (WithValues)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_counts, write_dense

from slafload import Geneformer, Loader, ScGPT, open_dataset
from slafload.tokenizers.values import WithValues
from slafload.transforms.normalize import MedianNormalize, gene_medians


def value_reference(ids: np.ndarray, cells: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """The value of the gene behind every gene token (ids >= 4), 0 elsewhere."""
    genes = np.where(ids >= 4, ids - 4, 0)
    return np.where(ids >= 4, matrix[cells[:, None], genes], 0).astype(np.float32)


@pytest.mark.parametrize("max_genes", [4, 30])
def test_geneformer_with_values_carries_each_tokens_expression(tmp_path, max_genes):
    dense = random_counts(80, 25, seed=12, max_count=40, empty_every=9)
    path = write_dense(tmp_path / "a.slaf", dense)
    tokenizer = WithValues(Geneformer(max_genes=max_genes))
    with Loader(path, tokenizer=tokenizer, batch_size=80, seed=1) as loader:
        batch = next(iter(loader))
    ids, cells = batch["input_ids"].numpy(), batch["cell_integer_id"].numpy()
    np.testing.assert_array_equal(batch["values"].numpy(), value_reference(ids, cells, dense))
    assert tokenizer.name == "geneformer+values"


def test_values_follow_median_normalisation(tmp_path):
    dense = random_counts(60, 20, seed=13, max_count=15)
    ds = open_dataset(write_dense(tmp_path / "a.slaf", dense))
    medians = gene_medians(ds)
    with Loader(ds, tokenizer=WithValues(ScGPT(max_genes=8), key="expression"), batch_size=60,
                shuffle=False, transforms=[MedianNormalize(medians)]) as loader:  # fmt: skip
        batch = next(iter(loader))
    scaled = dense / medians.medians
    ids = batch["input_ids"].numpy()
    np.testing.assert_allclose(
        batch["expression"].numpy(), value_reference(ids, np.arange(60), scaled), rtol=1e-6
    )
    assert "values" in batch  # scGPT's own bins are kept


def test_a_colliding_key_is_refused(tmp_path):
    path = write_dense(tmp_path / "a.slaf", random_counts(8, 5))
    loader = Loader(path, tokenizer=WithValues(ScGPT(max_genes=4)), batch_size=8)
    with loader, pytest.raises(ValueError, match="pass another key"):
        next(iter(loader))
