"""``slafload warm-up``: fill numba's on-disk cache with every kernel a loader uses.

For container builds and new cluster nodes: the read kernels (:func:`slafload.kernels.warm_up`,
nearly all the compile time) and the token kernels, compiled by short loader runs on tiny
synthetic atlases (integer counts and float values) with each built-in tokenizer, layout and
token dtype whose kernels differ. numba keys cache entries by CPU model: run it on the machine (or
the kind of machine) that trains.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path
from typing import Any

from slafload.kernels import warm_up
from slafload.tools.progress import progress_bar
from slafload.tools.synthetic import write_atlas

VALUE_DTYPES = ("uint16", "float32")
TOKENIZERS = ("geneformer", "scgpt", "raw", "sparse")
LAYOUTS = ("padded", "packed")
TOKEN_DTYPES = ("int64", "int32")
SMALL: dict[str, Any] = {"batch_size": 32, "n_epochs": 1, "seed": 0}
MAX_GENES = 48


def fill_cache(*, progress: bool = False) -> int:
    """Compile (or load) every kernel into numba's cache; the number of loader runs made.

    Raises:
        ImportError: numba is not installed (``pip install 'slafload[fast]'``).
    """
    from slafload.loader import Loader
    from slafload.tokenizers.builtin import token_budget

    if not warm_up():
        raise ImportError("numba is not installed, so there is nothing to compile: "
                          "pip install 'slafload[fast]'")  # fmt: skip
    runs = [
        (dtype, tokenizer, layout, token_dtype)
        for dtype, tokenizer, layout, token_dtype in itertools.product(
            VALUE_DTYPES, TOKENIZERS, LAYOUTS, TOKEN_DTYPES
        )
        if token_budget(tokenizer, 1) or layout == "packed"  # sparse: CSR, packed only
    ]
    bar = progress_bar(progress, len(runs), "warm-up", unit="run")
    with tempfile.TemporaryDirectory(prefix="slafload-warm-up-") as tmp:
        atlases = {
            dtype: write_atlas(
                Path(tmp) / f"{dtype}.slaf",
                n_cells=200,
                n_genes=64,
                n_plates=2,
                mean_nnz=24,
                value_dtype=dtype,
                seed=0,
            )
            for dtype in VALUE_DTYPES
        }
        for dtype, tokenizer, layout, token_dtype in runs:
            settings: dict[str, Any] = {"layout": layout, "token_dtype": token_dtype,
                                        **token_budget(tokenizer, MAX_GENES)}  # fmt: skip
            loader = Loader(
                atlases[dtype], tokenizer=tokenizer, kernels="numba", **SMALL, **settings
            )
            with loader:
                for _ in loader:
                    pass
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return len(runs)
