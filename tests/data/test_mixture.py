"""Mixtures of SLAF datasets: coverage per epoch semantics, shares by weight, tokens through
the shared vocabulary, exact resume, ranks, refusals (slafload.data.mixture, samplers.mixed)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import random_counts, run_cells, write_dense
from resume_conformance import assert_resumes_exactly

from slafload import Loader, Mixture, MixtureError, Source, StateError, VocabularyError
from slafload.data.mixture import MISSING
from slafload.pipeline.epochs import fingerprint
from slafload.samplers import BlockShuffle, Streaming
from slafload.samplers.mixed import quotas
from slafload.transforms import LogNormalize, Vocabulary

SETTINGS = {"batch_size": 16, "max_genes": 12, "chunk_cells": 24, "seed": 3}


@pytest.fixture(scope="module")
def atlases(tmp_path_factory):
    """Two atlases with different, partly overlapping gene lists in different orders."""
    tmp = tmp_path_factory.mktemp("mix")
    a_genes = [f"g{i}" for i in range(30)]
    b_genes = [f"g{i}" for i in range(44, 19, -1)]  # g44..g20: 10 shared with a, reversed
    a = write_dense(
        tmp / "a.slaf", random_counts(203, 30, seed=1, empty_every=29), max_rows_per_file=300,
        obs={"plate": [f"p{i % 3}" for i in range(203)]},
    )  # fmt: skip
    b = write_dense(
        tmp / "b.slaf", random_counts(131, 25, seed=2), max_rows_per_file=300,
        obs={"plate": [f"q{i % 2}" for i in range(131)], "donor": [i % 5 for i in range(131)]},
    )  # fmt: skip
    _rename_genes(a, a_genes)
    _rename_genes(b, b_genes)
    return a, b


def _rename_genes(path, names):
    import lance

    table = pa.table({"gene_id": names, "gene_integer_id": np.arange(len(names), dtype=np.uint16)})
    lance.write_dataset(table, str(path / "genes.lance"), mode="overwrite")


def test_one_pass_delivers_every_cell_of_every_source_exactly_once_per_epoch(atlases):
    with Loader(list(atlases), vocabulary="union", n_epochs=2, **SETTINGS) as loader:
        assert loader.source_names == ("a", "b")
        cells = run_cells(loader)
    expected = sorted([(0, c) for c in range(203)] + [(1, c) for c in range(131)])
    first, second = cells[:334], cells[334:]
    assert sorted(first) == expected and sorted(second) == expected
    assert first != second  # a new interleaving and shuffle each epoch


def test_fixed_size_epochs_draw_each_source_by_weight_without_repeats_within_a_pass(atlases):
    mix = Mixture(list(atlases), weights=[1, 3], vocabulary="union", epoch_cells=100)
    with Loader(mix, n_epochs=6, **{**SETTINGS, "drop_last": False}) as loader:
        cells = run_cells(loader)
    assert len(cells) == 600
    q = quotas(100, [1, 3])  # 25 and 75 cells per epoch
    for e in range(6):
        epoch = np.array(cells[e * 100 : (e + 1) * 100])
        assert np.bincount(epoch[:, 0], minlength=2).tolist() == q.tolist()
    # Source a (203 cells, 25 per epoch): its first 150 cells drawn repeat nothing.
    a = [c for s, c in cells if s == 0]
    assert len(set(a)) == len(a) == 150
    # Source b (131 cells, 75 per epoch): each pass of its stream is every cell once.
    b = [c for s, c in cells if s == 1]
    assert sorted(b[:131]) == list(range(131)) and sorted(b[131:262]) == list(range(131))


def test_each_sources_share_of_the_stream_matches_its_weight_over_a_long_run(atlases):
    # Fixed-size epochs: the share is exact per epoch; within an epoch the running share
    # tracks the weight within 0.1 from the first quarter on (fetches are whole: 24 cells).
    weights = [2, 1]
    mix = Mixture(list(atlases), weights=weights, vocabulary="union", epoch_cells=300)
    with Loader(mix, n_epochs=8, batch_size=8, max_genes=4, chunk_cells=12, seed=1) as loader:
        sources = np.array([s for s, _ in run_cells(loader)])
    target = weights[0] / sum(weights)
    assert abs((sources == 0).mean() - target) < 1e-9
    running = np.cumsum(sources == 0) / np.arange(1, len(sources) + 1)
    assert np.abs(running[75:] - target).max() < 0.1
    # One pass: until a source runs out, shares follow the weights (here 1:3 against sizes
    # 203:131, so b runs out first, after about 4 / 3 * 131 cells).
    mix = Mixture(list(atlases), weights=[1, 3], vocabulary="union")
    with Loader(mix, n_epochs=4, batch_size=8, max_genes=4, chunk_cells=12, seed=1) as loader:
        cells = run_cells(loader)
    for e in range(4):
        head = np.array([s for s, _ in cells[e * 334 : e * 334 + 160]])
        assert abs((head == 1).mean() - 0.75) < 0.1


def _tokens_by_cell(batches, key="input_ids"):
    out = {}
    for b in batches:
        sources = b["source"].tolist() if "source" in b else [None] * len(b[key])
        for s, c, row in zip(sources, b["cell_integer_id"].tolist(), b[key], strict=True):
            out[(s, c)] = row.clone()
    return out


@pytest.mark.parametrize("tokenizer", ["geneformer", "scgpt"])
def test_tokens_of_a_mixed_batch_equal_the_single_source_loaders_through_the_vocabulary(
    atlases, tokenizer
):
    vocab = Vocabulary(tuple(f"g{i}" for i in range(45)))
    key = "values" if tokenizer == "scgpt" else "input_ids"
    mixed_loader = Loader(
        list(atlases), vocabulary=vocab, tokenizer=tokenizer, n_epochs=1, **SETTINGS
    )
    with mixed_loader:
        batches = list(mixed_loader)
        mixed, mixed_ids = _tokens_by_cell(batches, key), _tokens_by_cell(batches)
    for k, path in enumerate(atlases):
        ds = mixed_loader.dataset.datasets[k]
        with Loader(ds, transforms=[vocab.remap(ds)], tokenizer=tokenizer, n_epochs=1,
                    **SETTINGS) as single:  # fmt: skip
            alone = list(single)
        for (_, c), row in _tokens_by_cell(alone, key).items():
            assert torch.equal(mixed[(k, c)], row), (path, c)
        for (_, c), row in _tokens_by_cell(alone).items():
            assert torch.equal(mixed_ids[(k, c)], row), (path, c)
    # and in vocabulary terms: every gene token of source b names a gene of b
    b_genes = {f"g{i}" for i in range(20, 45)}
    for (s, _), row in mixed_ids.items():
        genes = {vocab.genes[t - 4] for t in row.tolist() if t >= 4}
        assert s == 0 or genes <= b_genes


def test_a_single_source_mixture_is_the_single_dataset_loader_batch_for_batch(atlases):
    with Loader(atlases[0], n_epochs=2, **SETTINGS) as single:
        alone = list(single)
    with Loader([atlases[0]], n_epochs=2, **SETTINGS) as mixed:
        together = list(mixed)
    assert len(alone) == len(together)
    for x, y in zip(alone, together, strict=True):
        assert torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["cell_integer_id"], y["cell_integer_id"])
        assert not y["source"].any()


def mixture_loader(atlases, **overrides):
    def make():
        options = {"weights": [1, 2], "vocabulary": "union", **overrides}
        epoch_cells = options.pop("epoch_cells", None)
        mix = Mixture(list(atlases), epoch_cells=epoch_cells, **options)
        return Loader(mix, n_epochs=2, obs_columns=["plate"], **SETTINGS)

    return make


@pytest.mark.parametrize("epoch_cells", [None, 150])
def test_a_mixture_resumes_exactly_at_20_random_midpoints(atlases, epoch_cells):
    assert_resumes_exactly(mixture_loader(atlases, epoch_cells=epoch_cells), midpoints=20)


def test_ranks_get_equal_disjoint_shares_of_a_mixture_without_communication(atlases):
    shares = []
    for rank in range(3):
        with Loader(list(atlases), vocabulary="union", rank=rank, world_size=3, n_epochs=1,
                    drop_last=True, **SETTINGS) as loader:  # fmt: skip
            batches = list(loader)
            assert len(batches) == len(loader)
            shares.append(run_cells(batches))
    assert len({len(s) for s in shares}) == 1
    union = [c for s in shares for c in s]
    assert len(set(union)) == len(union)


def test_a_checkpoint_planned_without_cuts_at_fetch_ends_is_refused_unless_replanned(atlases):
    # a state whose mixed plan did not move cuts to the sources' fetch ends names other cells
    with mixture_loader(atlases)() as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
    assert state["order"].pop("cuts") == "source fetch ends"
    state["fingerprint"] = fingerprint(state["order"])
    with mixture_loader(atlases)() as loader:
        with pytest.raises(StateError, match=r"'cuts': \(None, 'source fetch ends'\)"):
            loader.load_state_dict(state)
        loader.load_state_dict(state, replan=True)
        assert loader.position.epoch == 1 and loader.position.cells == 0


def test_an_appended_source_or_a_changed_weight_is_refused_on_resume_unless_replanned(
    atlases, tmp_path, caplog
):
    with mixture_loader(atlases)() as loader:
        it = iter(loader)
        for _ in range(5):
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
    assert set(state["dataset"]["versions"]) == {"a", "b"}
    with (
        mixture_loader(atlases, weights=[1, 3])() as other,
        pytest.raises(StateError, match="weights"),
    ):
        other.load_state_dict(state)
    third = write_dense(tmp_path / "c.slaf", random_counts(40, 30, seed=4))
    make = mixture_loader((*atlases, third), weights=[1, 2, 1])
    with make() as grown:
        with pytest.raises(StateError, match=r"sources.*replan=True"):
            grown.load_state_dict(state)
        with caplog.at_level(logging.WARNING, logger="slafload.pipeline.epochs"):
            grown.load_state_dict(state, replan=True)
        assert "re-planning" in caplog.text
        assert grown.position.epoch == 1 and grown.position.cells == 0
        cells = run_cells(grown)  # epoch 1, all three sources, each cell once
    assert sorted(cells) == sorted(
        [(0, c) for c in range(203)] + [(1, c) for c in range(131)] + [(2, c) for c in range(40)]
    )


def test_obs_columns_missing_from_a_source_get_the_missing_code(atlases):
    with Loader(list(atlases), vocabulary="union", obs_columns=["plate", "donor"], n_epochs=1,
                **SETTINGS) as loader:  # fmt: skip
        batches = list(loader)
        plates = loader.obs_categories["plate"]
    assert plates == ["p0", "p1", "p2", "q0", "q1"]
    assert loader.obs_categories["donor"] is None
    for b in batches:
        a, b_ = b["source"] == 0, b["source"] == 1
        assert (b["donor"][a] == MISSING).all() and (b["donor"][b_] >= 0).all()
        names = [plates[p] for p in b["plate"].tolist()]
        assert all(
            n[0] == "p" if s == 0 else n[0] == "q" for n, s in zip(names, b["source"], strict=True)
        )
        assert (b["plate"][b_] == 3 + b["cell_integer_id"][b_] % 2).all()


def test_mixing_counts_with_floats_is_refused_where_tokens_depend_on_the_scale(atlases, tmp_path):
    dense = random_counts(50, 30, seed=5).astype(np.float32)
    logged = np.log1p(dense / np.maximum(dense.sum(1, keepdims=True), 1) * 1e4).astype(np.float32)
    f = write_dense(tmp_path / "f.slaf", logged, value_type=pa.float32())
    _rename_genes(f, [f"g{i}" for i in range(30)])
    sources = [atlases[0], f]
    with pytest.raises(MixtureError, match="values='log1p'"):
        Loader(sources, vocabulary="union", tokenizer="raw", **SETTINGS)
    # rank-only tokens do not depend on the scale: allowed
    Loader(sources, vocabulary="union", tokenizer="geneformer", **SETTINGS).close()
    # normalised per source by an explicit option: the counts source becomes log1p(CP10k)
    mix = Mixture(sources, vocabulary="union", values="log1p")
    with Loader(mix, tokenizer="raw", n_epochs=1, shuffle=False, **SETTINGS) as loader:
        rows = {
            (int(s), int(c)): v
            for b in loader
            for s, c, v in zip(b["source"], b["cell_integer_id"], b["values"], strict=True)
        }
    counts = random_counts(203, 30, seed=1, empty_every=29).astype(np.float64)
    row = counts[7]
    want = np.sort(np.log1p(row[row > 0] / row.sum() * 1e4))[::-1][:12]
    np.testing.assert_allclose(rows[(0, 7)][: len(want)].numpy(), want, rtol=1e-6)


def test_log_normalize_keeps_each_cells_gene_order():
    from slafload.types import Chunk

    chunk = Chunk(0, np.arange(3), np.array([0, 2, 2, 5]), np.array([1, 4, 0, 2, 3]),
                  np.array([3, 1, 5, 5, 2], dtype=np.uint16), np.arange(3))  # fmt: skip
    out = LogNormalize(10.0)(chunk)
    np.testing.assert_allclose(
        out.values, np.log1p([7.5, 2.5, 50 / 12, 50 / 12, 20 / 12]), rtol=1e-6
    )


def test_mixture_settings_are_validated_up_front(atlases):
    with pytest.raises(VocabularyError, match="vocabulary="):
        Loader(list(atlases))  # other genes, no vocabulary (a preset would map them)
    with pytest.raises(MixtureError, match="one weight per source"):
        Mixture(list(atlases), weights=[1], vocabulary="union")
    with pytest.raises(MixtureError, match="weight must be positive"):
        Mixture(list(atlases), weights=[1, 0], vocabulary="union")
    with pytest.raises(MixtureError, match="names repeat"):
        Mixture([atlases[0], atlases[0]])
    with pytest.raises(TypeError, match="several datasets"):
        Loader(atlases[0], weights=[1])
    with pytest.raises(TypeError, match="token_dictionary"):
        Loader(list(atlases), tokenizer="geneformer-v2")  # built for each source


def test_each_source_keeps_its_own_sampler(atlases):
    sources = [Source(atlases[0], sampler=Streaming(chunk_cells=50)),
               Source(atlases[1], sampler=BlockShuffle(block_size=4, fetch_factor=2))]  # fmt: skip
    with Loader(Mixture(sources, vocabulary="union"), n_epochs=1, **SETTINGS) as loader:
        cells = run_cells(loader)
    a = [c for s, c in cells if s == 0]
    assert a == list(range(203))  # streamed in storage order
    assert sorted(c for s, c in cells if s == 1) == list(range(131))


def test_a_mixture_resumes_elastically_on_another_number_of_ranks(atlases):
    def make(rank, world_size):
        return Loader(list(atlases), vocabulary="union", rank=rank, world_size=world_size,
                      n_epochs=1, **SETTINGS)  # fmt: skip

    before, states = [], []
    for rank in range(2):
        with make(rank, 2) as loader:
            it = iter(loader)
            before += run_cells([next(it) for _ in range(4)])
            states.append(json.loads(json.dumps(loader.state_dict())))
    assert states[0]["segments"] == states[1]["segments"] == [[2, 64]]
    after = []
    for rank in range(3):
        with make(rank, 3) as loader:
            loader.load_state_dict(states[0])
            after += run_cells(loader)
    seen = before + after
    assert len(set(seen)) == len(seen)  # nothing delivered twice across the resize
    assert 334 - len(seen) < 2 * 15  # complete apart from the per-fetch tails of two segments
