"""Presets on mixtures: each source's genes mapped into the model's own dictionary, so every
cell's tokens equal those the same preset gives it when its source is loaded alone
(slafload.presets.mixture_preset, slafload.data.sources.PerSourceTokens).

The two sources have different gene tables in different orders; source ``a`` carries an
``n_counts`` obs column and ``b`` does not (Geneformer then normalises ``b``'s cells by their
totals), so a cell of either gets the right tokens only through its own source's preset.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import csr_from_dense, random_counts
from resume_conformance import assert_resumes_exactly

import slafload
from slafload import Loader, Mixture, MixtureError
from slafload.presets import make_preset
from slafload.tools.writer import write_slaf

SETTINGS = {"batch_size": 16, "chunk_cells": 48, "seed": 5}
KEYS = ("input_ids", "attention_mask", "length", "values")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """Sources ``a`` (150 cells, genes 0..39) and ``b`` (90 cells, genes 54..25, reversed),
    Geneformer-format dictionaries and an scGPT vocabulary covering most of their genes.
    """
    tmp = tmp_path_factory.mktemp("preset_mix")
    rng = np.random.default_rng(0)
    genes = {"a": list(range(40)), "b": list(range(54, 24, -1))}
    n_cells = {"a": 150, "b": 90}
    paths = {}
    for seed, name in enumerate(("a", "b")):
        dense = random_counts(n_cells[name], len(genes[name]), seed=seed + 1, density=0.4,
                              max_count=6, empty_every=37)  # fmt: skip
        obs = None
        if name == "a":
            obs = {
                "n_counts": pa.array(
                    (dense.sum(1) + rng.integers(1, 5, len(dense))).astype(np.float32)
                )
            }
        var = {
            "gene_id": pa.array([f"GENE{g}" for g in genes[name]]),
            "ensembl_id": pa.array([f"ENSG{g:011d}" for g in genes[name]]),
        }
        paths[name] = write_slaf(tmp / f"{name}.slaf", [csr_from_dense(dense)],
                                 n_genes=len(genes[name]), obs=obs, var=var,
                                 max_rows_per_file=400)  # fmt: skip
    ensembl = [f"ENSG{g:011d}" for g in range(60) if g % 7 != 3]  # some genes have no token
    tokens = {"<pad>": 0, "<mask>": 1, "<cls>": 2, "<eos>": 3}
    for t, g in enumerate(rng.permutation(ensembl).tolist()):
        tokens[g] = 4 + t
    medians = {g: float(rng.uniform(0.5, 4.0)) for g in ensembl}
    vocab = {"<pad>": 0, "<cls>": 1}
    for g in rng.permutation([f"GENE{g}" for g in range(60) if g % 5 != 1]).tolist():
        vocab[g] = len(vocab)
    files = {"token": tmp / "token.pkl", "median": tmp / "median.pkl", "vocab": tmp / "vocab.json"}
    files["token"].write_bytes(pickle.dumps(tokens))
    files["median"].write_bytes(pickle.dumps(medians))
    files["vocab"].write_text(json.dumps(vocab))
    return {"paths": paths, "files": files}


def options(world: dict, preset: str) -> dict:
    files = world["files"]
    if preset == "scgpt-reference":
        return {"vocab": files["vocab"], "max_len": 14}  # long cells are subsampled
    size = 12 if preset == "geneformer-v2" else 9
    return {"token_dictionary": files["token"], "gene_median_dictionary": files["median"],
            "model_input_size": size}  # fmt: skip


def by_cell(loader: Loader, n_epochs: int = 1) -> tuple[dict, list[np.ndarray]]:
    """``{(epoch, source, cell_integer_id): {key: row}}`` of a run, and each batch's sources
    (a single dataset: source 0).
    """
    rows: dict[tuple[int, int, int], dict[str, np.ndarray]] = {}
    sources, seen = [], 0
    with loader:
        n_cells = loader.dataset.n_cells
        for batch in loader:
            ids = batch["cell_integer_id"].numpy()
            src = batch["source"].numpy() if "source" in batch else np.zeros_like(ids)
            sources.append(src)
            for j, (s, c) in enumerate(zip(src.tolist(), ids.tolist(), strict=True)):
                rows[(seen // n_cells, s, c)] = {k: batch[k][j].numpy() for k in KEYS if k in batch}
                seen += 1
    assert seen == n_epochs * n_cells
    return rows, sources


@pytest.mark.parametrize("preset", ["geneformer-v2", "geneformer-v1", "scgpt-reference"])
def test_every_cell_gets_the_tokens_of_its_source_loaded_alone(world, preset):
    opts = options(world, preset)
    paths = world["paths"]
    got, sources = by_cell(
        Loader(list(paths.values()), tokenizer=preset, tokenizer_options=opts, n_epochs=2,
               **SETTINGS),
        n_epochs=2,
    )  # fmt: skip
    assert sum(len(np.unique(s)) == 2 for s in sources) > len(sources) // 2  # cells mixed
    want = {}
    for k, path in enumerate(paths.values()):
        alone, _ = by_cell(
            Loader(path, tokenizer=preset, tokenizer_options=opts, n_epochs=2, **SETTINGS), 2
        )
        want.update({(e, k, c): row for (e, _, c), row in alone.items()})
    assert got.keys() == want.keys()
    for key, row in want.items():
        for name, array in row.items():
            np.testing.assert_array_equal(got[key][name], array, err_msg=f"{key} {name}")
    if preset == "scgpt-reference":  # the draws are the epoch's, in the mixture as alone
        assert any(
            not np.array_equal(got[(0, s, c)]["values"], got[(1, s, c)]["values"])
            for (e, s, c) in got
            if e == 0
        )


def test_a_mixture_object_takes_a_preset_by_name_in_batch_mode(world):
    paths = world["paths"]
    opts = options(world, "geneformer-v2")
    mix = Mixture(list(paths.values()), weights=[1, 2], mix="batch")
    with Loader(mix, tokenizer="geneformer-v2", tokenizer_options=opts, **SETTINGS) as loader:
        assert loader.preset is not None and len(loader.preset.sources) == 2
        assert loader.preset.coverage.n_genes == 70
        assert [p.coverage.n_genes for p in loader.preset.sources] == [40, 30]
        assert "preset='geneformer-v2'" in repr(loader.dataset)
    got, sources = by_cell(
        Loader(mix, tokenizer="geneformer-v2", tokenizer_options=opts, **SETTINGS)
    )
    assert sum(len(np.unique(s)) > 1 for s in sources) <= 1  # the streams' last cells
    for k, path in enumerate(paths.values()):
        alone, _ = by_cell(Loader(path, tokenizer="geneformer-v2", tokenizer_options=opts,
                                  **SETTINGS))  # fmt: skip
        for (_, _, c), row in alone.items():
            np.testing.assert_array_equal(got[(0, k, c)]["input_ids"], row["input_ids"])


def test_a_preset_mixture_resumes_exactly(world):
    opts = options(world, "scgpt-reference")
    assert_resumes_exactly(
        lambda: Loader(list(world["paths"].values()), tokenizer="scgpt-reference",
                       tokenizer_options=opts, n_epochs=2, **SETTINGS),
        midpoints=6,
    )  # fmt: skip


def test_preset_mixtures_refuse_a_single_dataset_preset_and_double_normalisation(world):
    paths = list(world["paths"].values())
    opts = options(world, "geneformer-v2")
    one = make_preset("geneformer-v2", slafload.open_dataset(paths[0]), **opts)
    with pytest.raises(MixtureError, match="built for one dataset"):
        Loader(paths, tokenizer=one)
    with pytest.raises(MixtureError, match="normalise them twice"):
        Loader(Mixture(paths, values="log1p"), tokenizer="geneformer-v2", tokenizer_options=opts)


def test_source_transforms_see_cell_ids_within_their_source(world, tmp_path: Path):
    seen: list[np.ndarray] = []

    def record(chunk):
        seen.append(chunk.cell_ids)
        return chunk

    b = slafload.Source(world["paths"]["b"], transforms=(record,))
    mix = Mixture([world["paths"]["a"], b], vocabulary="union")
    with Loader(mix, n_epochs=1, **SETTINGS) as loader:
        list(loader)
    assert sorted(np.concatenate(seen).tolist()) == list(range(90))


def test_a_preset_mixtures_torch_dataset_pickles_and_gives_the_loaders_tokens(world):
    import pickle

    opts = options(world, "scgpt-reference")
    make = lambda: Loader(list(world["paths"].values()), tokenizer="scgpt-reference",  # noqa: E731
                          tokenizer_options=opts, n_epochs=1, **SETTINGS)  # fmt: skip
    want, _ = by_cell(make())
    with make() as loader:
        copy = pickle.loads(pickle.dumps(loader.as_torch_dataset()))  # as a worker gets it
    got = {}
    for batch in copy:
        pairs = zip(batch["source"].tolist(), batch["cell_integer_id"].tolist(), strict=True)
        for j, key in enumerate(pairs):
            got[(0, *key)] = {k: batch[k][j].numpy() for k in KEYS}
    assert got.keys() == want.keys()
    for key, row in want.items():
        for name, array in row.items():
            np.testing.assert_array_equal(got[key][name], array)
