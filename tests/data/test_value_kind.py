"""Value kinds: convert records whether values are counts, presets that normalise say so."""

from __future__ import annotations

import json
import logging

import numpy as np
import pyarrow as pa
import pytest
from conftest import csr_from_dense, random_counts

import slafload
from slafload.data.value_kind import COUNTS, NON_INTEGER, UNKNOWN, value_kind, value_range
from slafload.presets.geneformer import geneformer_v2
from slafload.presets.scgpt import scgpt
from slafload.tools.writer import write_slaf

ad = pytest.importorskip("anndata", exc_type=ImportError)

N_GENES = 10
VOCAB = {"<pad>": 0, "<cls>": 1, **{f"gene_{g}": 2 + g for g in range(N_GENES)}}
ENSEMBL = [f"ENSG{g:011d}" for g in range(N_GENES)]
TOKENS = {
    "<pad>": 0,
    "<mask>": 1,
    "<cls>": 2,
    "<eos>": 3,
    **{e: 4 + g for g, e in enumerate(ENSEMBL)},
}
MEDIANS = dict.fromkeys(ENSEMBL, 1.5)


def counts() -> np.ndarray:
    return random_counts(30, N_GENES, seed=4, density=0.5)


def lognormalised(dense: np.ndarray) -> np.ndarray:
    totals = np.maximum(dense.sum(axis=1, keepdims=True), 1)
    return np.log1p(dense / totals * 1e4).astype(np.float32)


def written(tmp_path, dense, value_type, extra=None):
    """A dataset written without convert (no record unless ``extra`` holds one)."""
    return slafload.open_dataset(write_slaf(
        tmp_path / "w.slaf", [csr_from_dense(dense)], n_genes=N_GENES, value_type=value_type,
        var={"gene_id": list(VOCAB)[2:], "ensembl_id": ENSEMBL}, extra_config=extra,
    ))  # fmt: skip


def converted(tmp_path, matrix):
    adata = ad.AnnData(matrix)
    adata.var_names = list(VOCAB)[2:]
    adata.var["ensembl_id"] = ENSEMBL
    return slafload.open_dataset(slafload.convert(adata, tmp_path / "c.slaf"))


def preset_warnings(ds, caplog) -> list[str]:
    """The value-kind warnings building each normalising preset for ``ds`` logs."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slafload.data.value_kind"):
        scgpt(ds, vocab=VOCAB)
        geneformer_v2(ds, token_dictionary=TOKENS, gene_median_dictionary=MEDIANS)
    return [r.getMessage() for r in caplog.records if r.name == "slafload.data.value_kind"]


def test_convert_records_counts_for_whole_numbers_and_non_integer_for_normalised_values(
    tmp_path,
):
    dense = counts()
    as_floats = converted(tmp_path / "a", dense.astype(np.float32))  # float32 counts
    assert as_floats.config["value_kind"] == COUNTS
    assert value_kind(as_floats).kind == COUNTS
    logged = converted(tmp_path / "b", lognormalised(dense))
    config = json.loads((tmp_path / "b" / "c.slaf" / "config.json").read_text())
    assert config["value_kind"] == NON_INTEGER
    assert str(value_kind(logged)) == "non-integer (recorded in config.json)"
    lo, hi = value_range(logged)
    stored = lognormalised(dense)
    assert (lo, hi) == pytest.approx((stored[stored > 0].min(), stored.max()))


def test_presets_that_normalise_warn_on_non_count_values_with_the_way_out(tmp_path, caplog):
    ds = converted(tmp_path, lognormalised(counts()))
    scgpt_warning, geneformer_warning = preset_warnings(ds, caplog)
    assert "preset 'scgpt-reference'" in scgpt_warning and "not counts" in scgpt_warning
    assert "normalize_total=None, log1p=False" in scgpt_warning
    assert "preset 'geneformer-v2'" in geneformer_warning
    assert "slafload convert --raw" in geneformer_warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slafload.data.value_kind"):
        scgpt(ds, vocab=VOCAB, normalize_total=None, log1p=False)  # the way out: no warning
    assert not caplog.records


def test_counts_give_no_warning(tmp_path, caplog):
    assert preset_warnings(converted(tmp_path, counts()), caplog) == []


@pytest.mark.parametrize(
    ("value_type", "kind"), [(pa.uint16(), COUNTS), (pa.int32(), COUNTS), (pa.float32(), UNKNOWN)]
)
def test_datasets_without_the_record_are_decided_by_value_type_and_float_ones_never_warn(
    tmp_path, caplog, value_type, kind
):
    dense = counts() if kind == COUNTS else lognormalised(counts())
    ds = written(tmp_path, dense, value_type)
    assert "value_kind" not in ds.config
    assert value_kind(ds).kind == kind
    assert "not recorded" in value_kind(ds).source
    assert preset_warnings(ds, caplog) == []


def test_a_record_written_by_another_tool_is_read(tmp_path, caplog):
    ds = written(tmp_path, lognormalised(counts()), pa.float32(), {"value_kind": NON_INTEGER})
    assert len(preset_warnings(ds, caplog)) == 2
