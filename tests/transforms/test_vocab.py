"""Gene vocabularies: files, alignment of datasets in different gene orders, unknown genes."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from conftest import csr_from_dense, geneformer_reference, random_counts, unsorted_csr

from slafload import Loader, open_dataset
from slafload.errors import SchemaError
from slafload.tools.writer import write_slaf
from slafload.transforms.vocab import Vocabulary, VocabularyError

NAMES = [f"ENSG{g:05d}" for g in range(30)]


def write_named(path, dense, names, store=csr_from_dense):
    return write_slaf(
        path, [store(dense)], n_genes=dense.shape[1], var={"gene_id": pa.array(names)}
    )


def unk_reference(row, n_known, max_genes):
    """Geneformer tokens with every gene id >= n_known replaced by the UNK id n_known."""
    genes = np.flatnonzero(row)
    ids = np.minimum(genes, n_known)
    ids = ids[np.lexsort((ids, -row[genes].astype(np.float64)))]
    tokens = np.concatenate([[1], ids + 4, [2]])[:max_genes]
    return np.pad(tokens, (0, max_genes - len(tokens)))


def all_batches(path, vocab=None, **kwargs):
    ds = open_dataset(path)
    transforms = [vocab.remap(ds, **kwargs)] if vocab is not None else []
    with Loader(ds, batch_size=16, max_genes=12, shuffle=False, transforms=transforms) as loader:
        return np.concatenate([b["input_ids"].numpy() for b in loader])


@pytest.mark.parametrize("suffix", [".json", ".tsv"])
def test_vocabulary_round_trips_through_its_file(tmp_path, suffix):
    dense = random_counts(10, 30, seed=0)
    vocab = Vocabulary.from_dataset(open_dataset(write_named(tmp_path / "a.slaf", dense, NAMES)))
    assert vocab.genes == tuple(NAMES)
    loaded = Vocabulary.load(vocab.save(tmp_path / f"vocab{suffix}"))
    assert loaded.genes == vocab.genes
    np.testing.assert_array_equal(loaded.token_ids(["ENSG00003", "nope"]), [7, -1])


def test_a_malformed_vocabulary_file_names_the_line(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_text("token_id\tgene\n4\tA\n6\tB\n")
    with pytest.raises(VocabularyError, match="line 3"):
        Vocabulary.load(path)
    (tmp_path / "bad.json").write_text('{"genes": ["A"]}')
    with pytest.raises(VocabularyError, match="not a slafload vocabulary"):
        Vocabulary.load(tmp_path / "bad.json")


def test_duplicate_gene_names_are_rejected():
    with pytest.raises(VocabularyError, match="repeats gene names"):
        Vocabulary(("A", "B", "A"))


def test_a_missing_name_column_is_a_schema_error(tmp_path):
    ds = open_dataset(write_named(tmp_path / "a.slaf", random_counts(4, 30), NAMES))
    with pytest.raises(SchemaError, match="no column 'symbol'"):
        Vocabulary.from_dataset(ds, column="symbol")


@pytest.mark.parametrize(
    "store",
    [csr_from_dense, lambda dense: unsorted_csr(dense, seed=5, duplicates=True)],
    ids=["ascending", "shuffled-with-duplicates"],
)
def test_two_gene_orders_give_identical_tokens_once_aligned(tmp_path, store):
    dense = random_counts(70, 30, seed=4, max_count=4, empty_every=9)  # many ties
    perm = np.random.default_rng(1).permutation(30)
    a = write_named(tmp_path / "a.slaf", dense, NAMES)
    # Dataset b numbers the genes differently, and may store each cell's rows in any order.
    b = write_named(tmp_path / "b.slaf", dense[:, perm], [NAMES[p] for p in perm], store)
    vocab = Vocabulary.from_dataset(open_dataset(a))
    want = np.stack([geneformer_reference(row, 12) for row in dense])
    np.testing.assert_array_equal(all_batches(a), want)
    np.testing.assert_array_equal(all_batches(a, vocab), want)
    np.testing.assert_array_equal(all_batches(b, vocab), want)
    assert not np.array_equal(all_batches(b), want)


def test_unknown_genes_are_dropped_mapped_to_unk_or_refused(tmp_path):
    dense = random_counts(40, 30, seed=2, max_count=6)
    path = write_named(tmp_path / "a.slaf", dense, NAMES)
    vocab = Vocabulary(tuple(NAMES[:20]))  # genes 20..29 unknown
    known = dense.copy()
    known[:, 20:] = 0
    dropped = np.stack([geneformer_reference(row, 12) for row in known])
    np.testing.assert_array_equal(all_batches(path, vocab), dropped)

    unk = all_batches(path, vocab, unknown="unk")
    assert vocab.unk_id == 20
    np.testing.assert_array_equal(unk, np.stack([unk_reference(row, 20, 12) for row in dense]))
    assert (unk == 24).any()
    with pytest.raises(VocabularyError, match="10 of 30 genes"):
        vocab.remap(open_dataset(path), unknown="error")


def test_a_remap_that_keeps_gene_order_skips_the_sort_with_the_same_result():
    from slafload.transforms.vocab import GeneRemap
    from slafload.types import Chunk

    rng = np.random.default_rng(0)
    indptr = np.array([0, 3, 3, 7])
    genes = np.array([0, 2, 5, 1, 2, 3, 6])
    chunk = Chunk(0, np.arange(3), indptr, genes, rng.random(7), np.arange(3))
    mapping = np.array([1, 4, -1, 7, 8, 9, 12])  # ascending where kept: order kept
    fast = GeneRemap(mapping)
    slow = GeneRemap(mapping)
    slow.__dict__["keeps_order"] = False
    assert fast.keeps_order and not GeneRemap(mapping[::-1]).keeps_order
    a, b = fast(chunk), slow(chunk)
    for key in ("indptr", "genes", "values"):
        np.testing.assert_array_equal(getattr(a, key), getattr(b, key))
    assert a.genes.tolist() == [1, 9, 4, 7, 12] and a.indptr.tolist() == [0, 2, 2, 5]
