"""Third-party tokenizers: the example plugin package, installed with pip, found by name.

Entry points are read from installed package metadata and cached per process, so the plugin
is installed in one subprocess and exercised in a fresh Python subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import random_counts, ranked_genes, write_dense

from slafload.tokenizers import make_tokenizer

PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "slafload-example-tokenizer"

_CHECK = textwrap.dedent(
    """
    import json, sys
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        dist = distribution("slafload-example-tokenizer")
    except PackageNotFoundError:
        sys.exit(1)
    names = [ep.name for ep in dist.entry_points if ep.group == "slafload.tokenizers"]
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    sys.exit(0 if "gene_count_pairs" in names and url.get("url", "").endswith(sys.argv[1]) else 1)
    """
)

_RUN = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import slafload
    path, out = sys.argv[1], sys.argv[2]
    with slafload.Loader(path, tokenizer="gene_count_pairs", tokenizer_options={"count_cap": 5},
                         max_genes=6, batch_size=16, shuffle=False) as loader:
        batches = list(loader)
        kind = type(loader.tokenizer)
    arrays = {k: np.concatenate([b[k].numpy() for b in batches]) for k in batches[0]}
    np.savez(out, **arrays)
    print(json.dumps({"available": slafload.available_tokenizers(), "module": kind.__module__}))
    """
)


def install_example_plugin() -> None:
    """Install the example package editable from this checkout, unless it already is
    (idempotent, offline; an editable install from another checkout is replaced).
    """
    installed = subprocess.run(
        [sys.executable, "-c", _CHECK, str(PLUGIN.resolve())], capture_output=True, timeout=60
    )
    if installed.returncode == 0:
        return
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-input", "-e", str(PLUGIN)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip


def test_the_example_plugin_is_found_by_name_and_tokenizes_a_real_loader_run(tmp_path):
    install_example_plugin()
    dense = random_counts(40, 20, seed=6, max_count=9, empty_every=7)
    path = write_dense(tmp_path / "a.slaf", dense)
    out = tmp_path / "tokens.npz"
    run = subprocess.run(
        [sys.executable, "-c", _RUN, str(path), str(out)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    info = json.loads(run.stdout.strip().splitlines()[-1])
    assert "gene_count_pairs" in info["available"]
    assert info["module"] == "slafload_example_tokenizer"
    got = np.load(out)
    np.testing.assert_array_equal(got["cell_integer_id"], np.arange(40))
    for cell, row in enumerate(dense):
        genes = ranked_genes(row)[:6]
        want_ids = np.pad(genes + 4, (0, 6 - len(genes)))
        want_counts = np.pad(np.minimum(row[genes], 5), (0, 6 - len(genes)))
        np.testing.assert_array_equal(got["gene_ids"][cell], want_ids)
        np.testing.assert_array_equal(got["counts"][cell], want_counts.astype(np.float32))
        np.testing.assert_array_equal(got["attention_mask"][cell], want_ids != 0)


def test_an_unknown_tokenizer_name_lists_what_is_available():
    with pytest.raises(ValueError, match="unknown tokenizer 'nope'.*geneformer"):
        make_tokenizer("nope")
