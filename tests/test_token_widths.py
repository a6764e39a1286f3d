"""Token rows at every integer-type edge of their width: masks, counts and tokens per cell.

Each dataset holds cells whose gene counts sit around ``max_genes`` (and scGPT's width
``max_genes + 2``), with ``max_genes`` at the edges of ``int8``/``uint8``/``int16``/``uint16``
(a narrow type that holds ``-width`` but not ``width`` turns a full row's ``attention_mask``
all false).
Every batch of every tokenizer x layout x kernels x token dtype is compared with a reference
written from the specification (GUIDE.md section 3) in plain Python, one cell at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from slafload import Loader, Tuning
from slafload.kernels import numba_available
from slafload.tools.writer import CsrBlock, write_slaf

pytestmark = pytest.mark.usefixtures("no_thread_leak")

PAD, CLS, SEP, GENE_OFFSET, VALUE_OFFSET, N_BINS = 0, 1, 2, 4, 50_000, 51
# max_genes at each edge; scGPT's width is max_genes + 2, so 126, 254 and 32766 put its
# width on 128, 256 and 32768.
EDGES = [2, 126, 127, 128, 129, 254, 255, 256, 257, 32766, 32767, 32768, 32769]
# Where tokens are made: on the producer with each kernel backend, or on the (CPU) device.
MAKERS = {
    "numpy": {"kernels": "numpy"},
    "numba": {"kernels": "numba"},
    "device": {"kernels": "numpy", "tokenize_on": "device"},
}
if not numba_available():
    del MAKERS["numba"]


def cells_around(max_genes: int) -> list[int]:
    """Gene counts of the dataset's cells: empty, one gene, and each count where a row's
    layout changes: geneformer's SEP in the last column (``max_genes - 2``), its rows full
    (``max_genes - 1`` on), scGPT's full (``max_genes`` on), one more.
    """
    near = range(max_genes - 2, max_genes + 2)
    return sorted({0, 1, *(n for n in near if n >= 0)})


@dataclass
class Edge:
    """A dataset at ``path`` whose cells are ``{gene: count}`` dicts, and their references."""

    max_genes: int
    path: Path
    cells: list[dict[int, int]]
    _wanted: dict[tuple[str, int], dict[str, np.ndarray]] = field(default_factory=dict)

    def want(self, tokenizer: str, cell: int) -> dict[str, np.ndarray]:
        """:func:`reference` of cell ``cell`` as arrays, computed once per tokenizer."""
        key = (tokenizer, cell)
        if key not in self._wanted:
            wanted = reference(tokenizer, self.cells[cell], self.max_genes)
            self._wanted[key] = {k: np.array(v) for k, v in wanted.items()}
        return self._wanted[key]


@pytest.fixture(scope="module", params=EDGES)
def edge(request, tmp_path_factory) -> Edge:
    """Cells with gene counts around ``max_genes``, unsorted genes, many tied counts."""
    max_genes = request.param
    counts = cells_around(max_genes)
    n_genes = max(counts) + 3
    rng = np.random.default_rng(max_genes)
    cells, indptr, genes, values = [], [0], [], []
    for n in counts:
        chosen = rng.permutation(n_genes)[:n]  # unsorted within the cell, as real files are
        drawn = rng.integers(1, 9, size=n)  # many ties: broken by gene id
        cells.append(dict(zip(chosen.tolist(), drawn.tolist(), strict=True)))
        indptr.append(indptr[-1] + n)
        genes.append(chosen)
        values.append(drawn)
    block = CsrBlock(np.array(indptr), np.concatenate(genes), np.concatenate(values))
    path = tmp_path_factory.mktemp(f"edge{max_genes}") / "e.slaf"
    write_slaf(path, [block], n_genes=n_genes, value_type=pa.uint16())
    return Edge(max_genes, path, cells)


# -- the reference: plain Python over one cell at a time ----------------------------------------


def ranked(cell: dict[int, int]) -> list[int]:
    """The cell's genes, highest count first, ties by gene id ascending."""
    return sorted(cell, key=lambda gene: (-cell[gene], gene))


def scgpt_bins(cell: dict[int, int], kept: list[int]) -> list[int]:
    """scGPT's bin of each kept gene: digitize against the quantiles of the cell's counts."""
    if not kept:
        return []
    edges = np.quantile(np.array(list(cell.values()), dtype=float), np.linspace(0, 1, N_BINS - 1))
    return np.digitize([cell[gene] for gene in kept], edges).tolist()


def reference(tokenizer: str, cell: dict[int, int], max_genes: int) -> dict[str, list]:
    """The cell's real tokens of each stream, without padding, and the row's width."""
    order = ranked(cell)
    if tokenizer == "geneformer":  # width max_genes; truncation keeps CLS, drops SEP
        tokens = [CLS] + [g + GENE_OFFSET for g in order[: max_genes - 1]]
        if len(tokens) < max_genes:
            tokens.append(SEP)
        return {"input_ids": tokens, "width": [max_genes]}
    kept = order[:max_genes]
    if tokenizer == "scgpt":  # width max_genes + 2; SEP always fits
        values = [PAD] + [b + VALUE_OFFSET for b in scgpt_bins(cell, kept)] + [PAD]
        tokens = [CLS] + [g + GENE_OFFSET for g in kept] + [SEP]
        return {"input_ids": tokens, "values": values, "width": [max_genes + 2]}
    return {"gene_ids": kept, "values": [float(cell[g]) for g in kept], "width": [max_genes]}


PADS = {"input_ids": PAD, "values": PAD, "gene_ids": -1}  # raw's float values pad with 0.0


def check_batch(batch, edge: Edge, tokenizer: str, layout: str, token_dtype: str) -> list[int]:
    """Compare one batch with the reference, cell by cell; return its cell ids."""
    ids = batch["cell_integer_id"].tolist()
    want = [edge.want(tokenizer, c) for c in ids]
    streams = [k for k in want[0] if k != "width"]
    counts = [len(w[streams[0]]) for w in want]
    for key in streams:
        got, floats = batch[key].numpy(), tokenizer == "raw" and key == "values"
        assert got.dtype == ("float32" if floats else token_dtype), key
        if layout == "packed":
            cu = batch["cu_seqlens"].tolist()
            assert [b - a for a, b in pairwise(cu)] == counts
            for i, w in enumerate(want):
                assert np.array_equal(got[cu[i] : cu[i + 1]], w[key]), (ids[i], key)
                positions = batch["position_ids"][cu[i] : cu[i + 1]].numpy()
                assert np.array_equal(positions, np.arange(counts[i])), ids[i]
            continue
        width = want[0]["width"][0] if layout == "padded" else max(counts)
        assert got.shape == (len(ids), width), (key, got.shape)
        for i, w in enumerate(want):
            assert np.array_equal(got[i, : counts[i]], w[key]), (ids[i], key)
            assert (got[i, counts[i] :] == PADS[key]).all(), (ids[i], key)
    if tokenizer == "raw":
        assert batch["lengths"].tolist() == counts
    elif layout != "packed":
        mask = batch["attention_mask"].numpy()
        assert np.array_equal(mask, batch["input_ids"].numpy() != PAD)
        assert mask.sum(axis=1).tolist() == counts
    return ids


@pytest.mark.parametrize("token_dtype", ["int64", "int32"])
@pytest.mark.parametrize("maker", sorted(MAKERS))
@pytest.mark.parametrize("layout", ["padded", "longest", "packed"])
@pytest.mark.parametrize("tokenizer", ["geneformer", "scgpt", "raw"])
def test_every_cell_near_the_width_gets_the_references_tokens_mask_and_count(
    edge, tokenizer, layout, maker, token_dtype
):
    seen = []
    # Pieces of 8 cells: reused row buffers are re-padded from piece to piece.
    with Loader(edge.path, tokenizer=tokenizer, max_genes=edge.max_genes, layout=layout,
                token_dtype=token_dtype, **MAKERS[maker], batch_size=4, chunk_cells=8, tuning=Tuning(piece_cells=8),
                seed=3) as loader:  # fmt: skip
        for batch in loader:
            seen += check_batch(batch, edge, tokenizer, layout, token_dtype)
    assert sorted(seen) == list(range(len(edge.cells)))
