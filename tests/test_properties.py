"""Property tests: generated sparse matrices, written as SLAF, tokenized end to end.

hypothesis draws small count or float matrices with empty cells, ties, all-equal rows, huge
values near the top of ``uint32``/``float32`` and ``max_genes`` around each cell's length; each
is written with :func:`~slafload.tools.writer.write_slaf`, streamed through a :class:`Loader`, and
compared row by row with the independent per-cell numpy references in ``conftest.py``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
from conftest import geneformer_reference, ranked_genes, scgpt_reference, write_dense
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from slafload import Loader

U32_MAX = int(np.iinfo(np.uint32).max)
F32_MAX = float(np.finfo(np.float32).max)

DTYPES = {  # numpy dtype -> (Arrow type, interesting non-zero values)
    "uint16": (pa.uint16(), [1, 2, 3, 65535]),
    "uint32": (pa.uint32(), [1, 2, 7, U32_MAX - 1, U32_MAX]),
    "float32": (pa.float32(), [1e-30, 0.5, 1.0, 2.5, 3.0e38, F32_MAX]),
}


@st.composite
def matrices(draw) -> np.ndarray:
    """A dense cells x genes matrix, mostly zeros, drawn from a few values so ties are common."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    values = DTYPES[dtype][1]
    n_cells = draw(st.integers(1, 9))
    n_genes = draw(st.integers(1, 12))
    nonzero = st.sampled_from(values) | st.integers(1, 9).map(float)
    element = st.one_of(st.just(0), st.just(0), nonzero)
    dense = draw(hnp.arrays(np.float64, (n_cells, n_genes), elements=element))
    if draw(st.booleans()):  # one row of all-equal values
        dense[draw(st.integers(0, n_cells - 1))] = draw(nonzero)
    return dense.astype(dtype)


def stream(dense: np.ndarray, tokenizer: str, max_genes: int, **options) -> dict:
    """Every batch of one epoch through a real dataset on disk, concatenated per key."""
    with tempfile.TemporaryDirectory() as root:
        path = write_dense(Path(root) / "p.slaf", dense, value_type=DTYPES[dense.dtype.name][0])
        with Loader(
            path,
            tokenizer=tokenizer,
            tokenizer_options=options,
            max_genes=max_genes,
            batch_size=4,
            chunk_cells=5,
            seed=1,
        ) as loader:
            batches = list(loader)
    return {k: np.concatenate([b[k].numpy() for b in batches]) for k in batches[0]}


PROPERTY = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def budget(dense: np.ndarray, data, minimum: int) -> int:
    """``max_genes`` at and around the longest cell, or anywhere small."""
    longest = int(np.count_nonzero(dense, axis=1).max())
    near = st.integers(max(minimum, longest - 1), max(minimum, longest + 2))
    return data.draw(near | st.integers(minimum, 6), label="max_genes")


@PROPERTY
@given(dense=matrices(), data=st.data())
def test_geneformer_tokens_equal_the_reference_for_any_matrix(dense, data):
    max_genes = budget(dense, data, 2)
    out = stream(dense, "geneformer", max_genes)
    cells = out["cell_integer_id"]
    np.testing.assert_array_equal(np.sort(cells), np.arange(len(dense)))
    want = np.stack([geneformer_reference(dense[c], max_genes) for c in cells])
    np.testing.assert_array_equal(out["input_ids"], want)
    np.testing.assert_array_equal(out["attention_mask"], want != 0)


@PROPERTY
@given(dense=matrices(), data=st.data(), n_bins=st.sampled_from([3, 5, 51]))
def test_scgpt_tokens_and_bins_equal_the_reference_for_any_matrix(dense, data, n_bins):
    max_genes = budget(dense, data, 1)
    out = stream(dense, "scgpt", max_genes, n_bins=n_bins)
    refs = [scgpt_reference(dense[c], max_genes, n_bins) for c in out["cell_integer_id"]]
    np.testing.assert_array_equal(out["input_ids"], np.stack([r[0] for r in refs]))
    np.testing.assert_array_equal(out["values"], np.stack([r[1] for r in refs]))


@PROPERTY
@given(dense=matrices(), data=st.data())
def test_raw_tokens_keep_the_top_genes_and_their_values_for_any_matrix(dense, data):
    max_genes = budget(dense, data, 1)
    out = stream(dense, "raw", max_genes)
    for row, cell in enumerate(out["cell_integer_id"]):
        genes = ranked_genes(dense[cell])[:max_genes]
        n = len(genes)
        assert out["lengths"][row] == n
        np.testing.assert_array_equal(out["gene_ids"][row, :n], genes)
        np.testing.assert_array_equal(out["values"][row, :n], dense[cell][genes].astype(np.float32))
        assert (out["gene_ids"][row, n:] == -1).all() and not out["values"][row, n:].any()
