"""Shared fixtures: tiny real SLAF datasets on disk, and independent numpy references."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType

import lance
import numpy as np
import pyarrow as pa
import pytest

from slafload.tools.writer import CsrBlock, write_slaf

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (20-40 s each) run first, the rest in file order: xdist hands
    each worker a contiguous share and idle workers steal from the ends, so the run then
    never waits at its end on one worker finishing a long test."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def worker_context():
    """The ``multiprocessing_context`` for DataLoader workers in tests: a forkserver that has
    imported torch once. Its workers unpickle the dataset and reopen Lance as spawned ones do
    (the documented ``"spawn"``, which tests/test_resume.py and tests/pipeline/test_layout.py
    use), without importing torch again in every worker (~2 s of CPU each).
    """
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch"])
    return context


def load_script(relative: str) -> ModuleType:
    """A script of the repository (``benchmarks/scale.py``, ``examples/train_mlm.py``)
    imported as a module, so tests can call its functions.
    """
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def csr_from_dense(dense: np.ndarray) -> CsrBlock:
    """The non-zeros of a dense cells x genes matrix as one CSR block."""
    rows, cols = np.nonzero(dense)
    indptr = np.zeros(dense.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=dense.shape[0]), out=indptr[1:])
    return CsrBlock(indptr, cols, dense[rows, cols])


def unsorted_csr(dense: np.ndarray, *, seed: int = 0, duplicates: bool = False) -> CsrBlock:
    """Like :func:`csr_from_dense`, but each cell's genes in a seeded random order.

    ``duplicates``: about half the values >= 2 are stored as two entries that sum to them.
    """
    block = csr_from_dense(dense)
    rng = np.random.default_rng(seed)
    cell = np.repeat(np.arange(block.n_cells), np.diff(block.indptr))
    genes, values = block.genes, block.values.copy()
    if duplicates:
        split = np.flatnonzero((values >= 2) & (rng.random(len(values)) < 0.5))
        half = values[split] // 2
        values[split] -= half
        cell, genes = np.concatenate([cell, cell[split]]), np.concatenate([genes, genes[split]])
        values = np.concatenate([values, half])
    order = np.lexsort((rng.random(len(cell)), cell))
    indptr = np.concatenate([[0], np.cumsum(np.bincount(cell, minlength=block.n_cells))])
    return CsrBlock(indptr, genes[order], values[order])


def random_counts(
    n_cells: int,
    n_genes: int,
    *,
    seed: int = 0,
    density: float = 0.3,
    max_count: int = 8,
    empty_every: int = 0,
) -> np.ndarray:
    """Dense integer counts with many ties; every ``empty_every``-th cell is empty."""
    rng = np.random.default_rng(seed)
    dense = rng.integers(1, max_count + 1, size=(n_cells, n_genes))
    dense[rng.random((n_cells, n_genes)) > density] = 0
    if empty_every:
        dense[::empty_every] = 0
    return dense.astype(np.uint16)


def write_dense(
    path: Path,
    dense: np.ndarray,
    *,
    max_rows_per_file: int | None = None,
    value_type=None,
    obs=None,
) -> Path:
    import pyarrow as pa

    return write_slaf(
        path,
        [csr_from_dense(dense)],
        n_genes=dense.shape[1],
        value_type=value_type or pa.uint16(),
        obs=obs,
        max_rows_per_file=max_rows_per_file,
    )


@pytest.fixture
def small_counts() -> np.ndarray:
    return random_counts(300, 40, seed=1, empty_every=37)


@pytest.fixture
def small_slaf(tmp_path: Path, small_counts: np.ndarray) -> Path:
    return write_dense(tmp_path / "small.slaf", small_counts, max_rows_per_file=97)


# -- independent references (deliberately simple per-cell loops) ------------------------------


def ranked_genes(row: np.ndarray) -> np.ndarray:
    """Expressed genes of one dense row, highest value first, ties by gene id ascending."""
    genes = np.flatnonzero(row > 0)
    return genes[np.lexsort((genes, -row[genes].astype(np.float64)))]


def geneformer_reference(row: np.ndarray, max_genes: int) -> np.ndarray:
    genes = ranked_genes(row)
    tokens = np.concatenate([[1], genes + 4, [2]])[:max_genes]
    return np.pad(tokens, (0, max_genes - len(tokens)))


def scgpt_reference(
    row: np.ndarray, max_genes: int, n_bins: int, offset: int = 50_000
) -> tuple[np.ndarray, np.ndarray]:
    genes = ranked_genes(row)
    nonzero = row[row > 0]
    ids = np.zeros(max_genes + 2, dtype=np.int64)
    values = np.zeros(max_genes + 2, dtype=np.int64)
    ids[0] = 1
    kept = genes[:max_genes]
    ids[1 : 1 + len(kept)] = kept + 4
    ids[1 + len(kept)] = 2
    if len(kept):
        edges = np.quantile(nonzero, np.linspace(0, 1, n_bins - 1))
        values[1 : 1 + len(kept)] = np.digitize(row[kept], edges) + offset
    return ids, values


def raw_reference(row: np.ndarray, max_genes: int) -> tuple[np.ndarray, np.ndarray, int]:
    genes = ranked_genes(row)[:max_genes]
    ids = np.full(max_genes, -1, dtype=np.int64)
    values = np.zeros(max_genes, dtype=np.float32)
    ids[: len(genes)], values[: len(genes)] = genes, row[genes]
    return ids, values, len(genes)


def assert_rank_value_tokens(path, dense: np.ndarray, max_genes: int = 16) -> None:
    """geneformer, scgpt and raw tokens of every cell of ``path`` equal the references for
    ``dense`` (cell ``i`` = row ``i``); geneformer also through the torch dataset face."""
    from slafload import Loader

    def rows(tokenizer: str, face: str = "loader") -> dict[int, dict[str, np.ndarray]]:
        out = {}
        with Loader(path, tokenizer=tokenizer, max_genes=max_genes, batch_size=64) as loader:
            for batch in loader if face == "loader" else loader.as_torch_dataset():
                for i, cell in enumerate(batch["cell_integer_id"].tolist()):
                    out[cell] = {k: v[i].numpy() for k, v in batch.items()}
        assert sorted(out) == list(range(len(dense)))
        return out

    geneformer, torch_face = rows("geneformer"), rows("geneformer", "torch")
    scgpt, raw = rows("scgpt"), rows("raw")
    for cell, row in enumerate(dense):
        expected = geneformer_reference(row, max_genes)
        np.testing.assert_array_equal(geneformer[cell]["input_ids"], expected, f"cell {cell}")
        np.testing.assert_array_equal(torch_face[cell]["input_ids"], expected, f"cell {cell}")
        ids, values = scgpt_reference(row, max_genes, 51)
        np.testing.assert_array_equal(scgpt[cell]["input_ids"], ids, f"cell {cell}")
        np.testing.assert_array_equal(scgpt[cell]["values"], values, f"cell {cell}")
        ids, values, length = raw_reference(row, max_genes)
        np.testing.assert_array_equal(raw[cell]["gene_ids"], ids, f"cell {cell}")
        np.testing.assert_array_equal(raw[cell]["values"], values, f"cell {cell}")
        assert raw[cell]["lengths"] == length, f"cell {cell}"


def pbmc68k_path() -> Path:
    """scanpy's real 700-cell pbmc68k_reduced.h5ad (skips without scanpy; not imported).

    An old-format file: ``X`` is scaled (negative values), ``raw.X`` holds log-normalised
    expression as CSR with unsorted indices and many tied values, obs has ``n_genes``.
    """
    spec = importlib.util.find_spec("scanpy")
    if spec is None or spec.origin is None:
        pytest.skip("scanpy (which ships pbmc68k_reduced) is not installed")
    return Path(spec.origin).parent / "datasets" / "10x_pbmc68k_reduced.h5ad"


def read_pbmc68k():
    ad = pytest.importorskip("anndata")
    path = pbmc68k_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ad.OldFormatWarning)
        warnings.simplefilter("ignore", FutureWarning)  # anndata moving old-format elements
        return ad.read_h5ad(path)


@pytest.fixture
def no_thread_leak():
    """Fail the test if it leaves a slafload thread it started alive (threads alive before
    it, such as another test's numba compile thread that ends when its ``Kernels`` is
    collected, are not its own).
    """
    before = set(threading.enumerate())
    yield
    alive = [t for t in threading.enumerate() if t.name.startswith("slafload") and t not in before]
    for t in alive:
        t.join(timeout=2)
    left = [t.name for t in alive if t.is_alive()]
    assert not left, f"slafload threads left running: {left}"


def append_cell(path, genes, values):
    """Append one cell to every table and config.json, as a writer extending an atlas would."""
    cells = lance.dataset(str(path / "cells.lance"))
    n_cells, n_rows = cells.count_rows(), lance.dataset(str(path / "expression.lance")).count_rows()
    lance.write_dataset(
        pa.table(
            {
                "cell_integer_id": pa.array([n_cells] * len(genes), pa.uint32()),
                "gene_integer_id": pa.array(genes, pa.uint16()),
                "value": pa.array(values, pa.uint16()),
            }
        ),
        str(path / "expression.lance"),
        mode="append",
    )
    row = {name: [None] for name in cells.schema.names}
    row.update(cell_id=[f"new_{n_cells}"], cell_integer_id=[n_cells], cell_start_index=[n_rows])
    lance.write_dataset(
        pa.table(row, schema=cells.schema), str(path / "cells.lance"), mode="append"
    )
    config = json.loads((path / "config.json").read_text())
    config["n_cells"] = config["array_shape"][0] = n_cells + 1
    config["metadata"]["expression_count"] = n_rows + len(genes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture
def lance_opens(monkeypatch) -> list[str]:
    """The paths of the data files opened through Lance's metadata by ``FlatFile._open``
    (the rest :class:`~slafload._lance.file_format.FlatFiles` opens from their footers), in order.
    """
    from slafload._lance.flat_pages import FlatFile

    opened: list[str] = []
    real_open = FlatFile._open.__func__  # type: ignore[attr-defined]

    def spy(cls, path, *args, **kwargs):
        opened.append(path)
        return real_open(cls, path, *args, **kwargs)

    monkeypatch.setattr(FlatFile, "_open", classmethod(spy))
    return opened


@pytest.fixture
def flat_opens(monkeypatch) -> list:
    """What every ``FlatFiles.open`` returned (a ``FlatFile`` or ``None``), in order."""
    from slafload._lance.file_format import FlatFiles

    opened: list = []
    real_open = FlatFiles.open

    def spy(self, *args, **kwargs):
        opened.append(real_open(self, *args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(FlatFiles, "open", spy)
    return opened


@pytest.fixture
def read_paths(monkeypatch):
    """Forces the read path of every loader chain built afterwards in the test:
    ``read_paths(flat=False)`` (Lance's file reader on the direct path), ``read_paths(mini=False)``
    or ``read_paths(direct=True)`` set those :class:`~slafload.pipeline.reader.ReadOptions` fields,
    which are not loader settings (``Tuning.reader`` chooses between "auto" and "lance" only).
    """
    from slafload.pipeline import chain

    real = chain.ReadOptions

    def force(**paths) -> None:
        monkeypatch.setattr(chain, "ReadOptions", lambda **kw: real(**{**kw, **paths}))

    return force


def run_cells(batches) -> list[tuple[int, int]]:
    """A mixture's delivered cells as ``(source, cell_integer_id)``, in delivery order."""
    return [
        (int(s), int(c))
        for b in batches
        for s, c in zip(b["source"].tolist(), b["cell_integer_id"].tolist(), strict=True)
    ]


S3 = load_script("benchmarks/s3_proxy.py")  # moto's server behind a counting forwarder
S3_KEYS, S3_REGION, s3_options, upload = S3.KEYS, S3.REGION, S3.storage_options, S3.upload


@pytest.fixture
def s3_endpoint():
    """The URL of moto's S3 server, started on a free loopback port for the test."""
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("boto3")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_proxy(s3_endpoint):
    """A counting forwarder (``benchmarks/s3_proxy.py``) in front of :func:`s3_endpoint`."""
    with S3.S3Proxy(s3_endpoint) as proxy:
        yield proxy
