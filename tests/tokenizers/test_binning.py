"""scGPT fixed-width bins (slafdb's ScGPTWindow formula) and unchanged default tokens."""

from __future__ import annotations

import hashlib

import numpy as np
import polars as pl
import pytest
from conftest import random_counts, ranked_genes, write_dense

from slafload import Loader, open_dataset
from slafload.pipeline.chunk import assemble
from slafload.pipeline.ranking import rank
from slafload.pipeline.reader import Reader
from slafload.samplers import Fetch
from slafload.tokenizers import make_tokenizer
from slafload.tokenizers.binning import ScGPTFixedBins, fixed_bins


def ranked_chunk(path):
    ds = open_dataset(path)
    fetch = Fetch(0, np.array([[0, ds.n_cells]]), None)
    return rank(assemble(fetch, Reader(ds).read(fetch), ds.cell_start))


def fixed_reference(row: np.ndarray, max_genes: int, n_bins: int) -> tuple[np.ndarray, ...]:
    genes = ranked_genes(row)[:max_genes]
    ids = np.zeros(max_genes + 2, dtype=np.int64)
    values = np.zeros(max_genes + 2, dtype=np.int64)
    ids[0], ids[1 + len(genes)] = 1, 2
    ids[1 : 1 + len(genes)] = genes + 4
    if len(genes):
        logs = np.log1p(row[genes].astype(np.float64))
        bins = np.clip(np.floor(logs * n_bins / np.log1p(row.max())), 0, n_bins - 1)
        values[1 : 1 + len(genes)] = bins.astype(np.int64) + 50_000
    return ids, values


@pytest.mark.parametrize(("max_genes", "n_bins"), [(5, 10), (40, 4)])
def test_fixed_bins_match_the_numpy_reference_in_a_loader_run(tmp_path, max_genes, n_bins):
    dense = random_counts(120, 40, seed=8, max_count=300, density=0.4, empty_every=19)
    path = write_dense(tmp_path / "a.slaf", dense)
    tokenizer = ScGPTFixedBins(max_genes=max_genes, n_bins=n_bins)
    with Loader(path, tokenizer=tokenizer, batch_size=50, seed=2) as loader:
        batches = list(loader)
    cells = np.concatenate([b["cell_integer_id"].numpy() for b in batches])
    refs = [fixed_reference(dense[c], max_genes, n_bins) for c in cells]
    for key, i in (("input_ids", 0), ("values", 1)):
        got = np.concatenate([b[key].numpy() for b in batches])
        np.testing.assert_array_equal(got, np.stack([r[i] for r in refs]))


def test_fixed_bins_equal_slafdb_scgpt_window(tmp_path):
    aggregators = pytest.importorskip("slaf.ml.aggregators")
    schema_mod = pytest.importorskip("slaf.core.tabular_schema")
    dense = random_counts(60, 30, seed=9, max_count=500, density=0.5)
    ranked = ranked_chunk(write_dense(tmp_path / "a.slaf", dense))
    rows, cols = np.nonzero(dense)
    frame = pl.DataFrame({"cell": rows, "gene": cols, "value": dense[rows, cols]})
    schema = schema_mod.DataSchema(
        group_key="cell", item_key="gene", value_key="value", group_key_out=None,
        item_list_key="genes", value_list_key="bins",
    )  # fmt: skip
    window = aggregators.ScGPTWindow().apply(
        frame, schema, 30, n_expression_bins=7, use_binned_expressions=True
    )
    theirs = {
        (c, g): int(b)
        for c, genes, bins in window.iter_rows()
        for g, b in zip(genes, bins, strict=True)
    }
    ours = fixed_bins(ranked, 7)
    cells = ranked.cell_ids[ranked.entry_cell]
    assert {
        (int(c), int(g)): int(b) for c, g, b in zip(cells, ranked.genes, ours, strict=True)
    } == theirs


# sha256 prefixes of the built-ins' outputs with no options at the commit that added the
# opt-in options (e5ce0fa): opt-in features must never change what the defaults emit.
DEFAULT_TOKENS = {
    ("geneformer", 8): "dc1684505f1533e1",
    ("geneformer", 64): "bdb309d4332f0238",
    ("scgpt", 8): "2f786f86c3b2f400",
    ("scgpt", 64): "550d04cc7a1cf2c5",
}


@pytest.mark.parametrize(("name", "max_genes"), sorted(DEFAULT_TOKENS))
def test_default_tokens_are_unchanged(tmp_path, name, max_genes):
    dense = random_counts(200, 50, seed=11, max_count=30, density=0.4, empty_every=23)
    out = make_tokenizer(name, max_genes=max_genes)(
        ranked_chunk(write_dense(tmp_path / "a", dense))
    )
    digest = hashlib.sha256()
    for key in sorted(out):
        digest.update(key.encode())
        digest.update(str(out[key].dtype).encode())
        digest.update(np.ascontiguousarray(out[key]).tobytes())
    assert digest.hexdigest()[:16] == DEFAULT_TOKENS[name, max_genes]
