"""AnnData (``.h5ad`` files or in-memory objects) to the SLAF layout, out of core.

Each input's matrix (``X``, a layer, or ``raw.X``) is read in row chunks from the file, never
whole: CSR and dense matrices read only the requested rows; CSC matrices are row-sliced through
anndata's backed dataset, which scans the compressed columns for every chunk (bounded memory, but
time grows with ``n_chunks * nnz``: convert CSC files to CSR first when they are large). Chunks
become :class:`~slafload.tools.writer.CsrBlock` s (genes strictly ascending, explicit zeros dropped) and
stream through a single :func:`~slafload.tools.writer.write_slaf` call, so peak memory is one chunk plus
the obs/var tables whatever the file size.

Files are opened with ``h5py`` and read with ``anndata.io`` (``read_elem`` for obs/var,
``sparse_dataset`` for matrices) rather than ``read_h5ad(backed="r")``, which loads every layer,
``obsm`` and ``obsp`` into memory. Files in the pre-0.7 format, which ``anndata.io`` cannot read
piecewise, are read whole with ``read_h5ad``.

Within a cell, genes are written strictly ascending, and duplicate entries summed (scipy's
``sum_duplicates``), whatever the input's CSR index order.

Value storage: integer-valued, non-negative data (integer dtypes, or floats holding whole
numbers as many count matrices do) is stored as ``uint16`` when the maximum fits, else
``uint32``; anything else as ``float32``. This is decided by one streaming pass over the stored
values before writing, which also records in ``config.json`` whether they are counts
(``"value_kind"``: ``"counts"`` or ``"non-integer"``, see :mod:`slafload.data.value_kind`).
Negative or NaN values are rejected: SLAF holds expression.

Pre-shuffle (``shuffle_seed``): cells are written in a seeded random order of blocks of
``shuffle_block`` consecutive input cells, so plain sequential streaming already mixes plates.
Each cell keeps its ``cell_id`` and obs; ``original_index`` records its position in the
(concatenated) input.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from slafload.data.value_kind import CONFIG_KEY, COUNTS, NON_INTEGER
from slafload.tools.progress import progress_bar
from slafload.tools.writer import CsrBlock, write_slaf

__all__ = ["convert"]

logger = logging.getLogger(__name__)

_CELL_BUDGET = 2**24  # matrix entries per dense chunk (64 MiB of float32)
_MAX_CHUNK_CELLS = 16_384
_VALUES_PER_SCAN = 2**20
_RESERVED = ("cell_integer_id", "cell_start_index")


@dataclass(frozen=True, eq=False)
class _Source:
    """One input: a row-sliceable matrix plus its obs and var tables."""

    name: str
    matrix: Any  # anndata backed sparse dataset, h5py.Dataset, scipy sparse or numpy array
    obs: Any  # pandas DataFrame, index = cell ids
    var: Any  # pandas DataFrame, index = gene ids
    handle: Any = None  # open h5py.File, closed after writing

    @property
    def n_cells(self) -> int:
        return int(self.matrix.shape[0])


def convert(
    inputs: str | os.PathLike[str] | Any | Sequence[str | os.PathLike[str] | Any],
    output: str | os.PathLike[str],
    *,
    layer: str | None = None,
    raw: bool = False,
    shuffle_seed: int | None = None,
    shuffle_block: int = 8,
    chunk_cells: int | None = None,
    source_column: str = "source",
    max_rows_per_file: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Convert one or more AnnData inputs into one SLAF dataset at ``output``; return its path.

    Args:
        inputs: An ``.h5ad`` path, an ``anndata.AnnData`` object, or a sequence of them. Several
            inputs are concatenated in order and must have identical var names (in order).
        output: Dataset directory to create.
        layer: Convert ``layers[layer]`` instead of ``X``.
        raw: Convert ``raw.X`` (with ``raw.var``) instead of ``X``.
        shuffle_seed: If given, write cells in a seeded random order of blocks (see module doc).
        shuffle_block: Consecutive input cells kept together by the pre-shuffle, >= 1. Smaller
            blocks mix better and read slower.
        chunk_cells: Cells read per chunk; default keeps a dense chunk near 64 MiB.
        source_column: obs column naming each cell's input, added when there are several.
        max_rows_per_file: Lance fragment size of the expression table.
        overwrite: Replace an existing ``output``.
        progress: Show a tqdm bar over cells (if tqdm is installed).

    Raises:
        FileNotFoundError: an input file does not exist.
        FileExistsError: ``output`` exists and ``overwrite`` is false.
        ValueError: bad arguments, a missing layer or raw, mismatched var across inputs, or
            negative/NaN values.
    """
    if layer is not None and raw:
        raise ValueError("pass either layer=... or raw=True, not both")
    if shuffle_seed is not None and (isinstance(shuffle_seed, bool) or int(shuffle_seed) < 0):
        raise ValueError(f"shuffle_seed must be a non-negative integer, got {shuffle_seed!r}")
    _check_positive("shuffle_block", shuffle_block)
    if chunk_cells is not None:
        _check_positive("chunk_cells", chunk_cells)
    output = Path(output)
    if (output.exists() or output.is_symlink()) and not overwrite:
        raise FileExistsError(f"{str(output)!r} already exists; pass overwrite=True to replace it")
    items = [inputs] if isinstance(inputs, str | os.PathLike) or _is_anndata(inputs) else inputs
    if not items:
        raise ValueError("no inputs to convert")
    sources: list[_Source] = []
    try:
        for i, item in enumerate(items):
            sources.append(_open(item, i, layer=layer, raw=raw))
        names = [s.name for s in sources]
        if len(set(names)) < len(names):  # same file name in two folders: use the full paths
            sources = [replace(s, name=str(item)) for s, item in zip(sources, items, strict=True)]
        return _convert(sources, output, layer, raw, shuffle_seed, shuffle_block, chunk_cells,
                        source_column, max_rows_per_file, progress)  # fmt: skip
    finally:
        for source in sources:
            if source.handle is not None:
                source.handle.close()


def _convert(
    sources: list[_Source],
    output: Path,
    layer: str | None,
    raw: bool,
    shuffle_seed: int | None,
    shuffle_block: int,
    chunk_cells: int | None,
    source_column: str,
    max_rows_per_file: int | None,
    progress: bool,
) -> Path:
    var = sources[0].var
    for source in sources[1:]:
        _check_same_var(sources[0], source)
    if not sum(s.n_cells for s in sources):
        raise ValueError(
            f"{'inputs' if len(sources) > 1 else 'input'} {', '.join(s.name for s in sources)} "
            f"{'hold' if len(sources) > 1 else 'holds'} no cells; nothing to convert"
        )
    n_genes = len(var)
    chunk = chunk_cells or int(np.clip(_CELL_BUDGET // max(n_genes, 1), 256, _MAX_CHUNK_CELLS))
    value_type, kind = _value_type(sources)
    units = _units(sources, chunk, shuffle_seed, shuffle_block)
    obs = _obs_table(sources, source_column)
    if shuffle_seed is not None:
        order = np.concatenate([_global_index(sources, u) for u in units])
        obs = obs.take(pa.array(order)).append_column("original_index", pa.array(order))
    matrix = "X" if layer is None and not raw else ("raw/X" if raw else f"layers/{layer}")
    logger.info("converting %d input(s), %s, %d cells x %d genes, values %s (%s) -> %s",
                len(sources), matrix, obs.num_rows, n_genes, value_type, kind, output)  # fmt: skip
    bar = progress_bar(progress, obs.num_rows, "convert")
    try:
        return write_slaf(
            output,
            _blocks(sources, units, chunk, bar, value_type),
            n_genes=n_genes,
            value_type=value_type,
            obs=obs,
            var=_arrow_columns(var, "gene_id"),
            max_rows_per_file=max_rows_per_file,
            overwrite=True,
            extra_config={CONFIG_KEY: kind, "converted_from": {
                "converter": __name__,
                "inputs": [s.name for s in sources],
                "matrix": matrix,
                "shuffle_seed": shuffle_seed,
                "shuffle_block": shuffle_block if shuffle_seed is not None else None,
            }},
        )  # fmt: skip
    finally:
        if bar is not None:
            bar.close()


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _is_anndata(obj: object) -> bool:
    return type(obj).__name__ == "AnnData" and hasattr(obj, "obs") and hasattr(obj, "var")


# -- opening inputs ----------------------------------------------------------------------------


def _open(item: Any, i: int, *, layer: str | None, raw: bool) -> _Source:
    if _is_anndata(item):
        return _from_anndata(item, f"adata_{i}", layer=layer, raw=raw)
    import anndata
    import h5py

    path = Path(item)
    if not path.is_file():
        raise FileNotFoundError(f"input {str(path)!r} does not exist (expected an .h5ad file)")
    try:
        handle = h5py.File(path, "r")
    except OSError as exc:
        raise ValueError(f"{str(path)!r} is not an HDF5/.h5ad file: {exc}") from exc
    if "encoding-type" not in handle.attrs:  # written by anndata < 0.7: no out-of-core reads
        handle.close()
        logger.warning("%s is in the pre-0.7 AnnData format; reading it whole", path)
        with warnings.catch_warnings():
            # Logged above; anndata's FutureWarnings here describe moving old layouts.
            warnings.simplefilter("ignore", anndata.OldFormatWarning)
            warnings.simplefilter("ignore", FutureWarning)
            adata = anndata.read_h5ad(path)
        return _from_anndata(adata, path.name.removesuffix(".h5ad"), layer=layer, raw=raw)
    try:
        key = "X" if layer is None and not raw else ("raw/X" if raw else f"layers/{layer}")
        if key not in handle:
            layers = sorted(handle["layers"].keys()) if "layers" in handle else []
            raise ValueError(_no_matrix(str(path), layer, raw, layers, "raw/X" in handle))
        element = handle[key]
        if not isinstance(element, h5py.Group):
            matrix = element  # dense: h5py reads row slices directly
        elif element.attrs.get("encoding-type") == "csr_matrix":
            matrix = _BackedCsr(element)
        else:
            matrix = anndata.io.sparse_dataset(element)
        obs = anndata.io.read_elem(handle["obs"])
        var = anndata.io.read_elem(handle["raw/var" if raw else "var"])
    except BaseException:
        handle.close()
        raise
    return _checked(_Source(path.name.removesuffix(".h5ad"), matrix, obs, var, handle))


class _BackedCsr:
    """Row slices of an on-disk CSR matrix, read straight from its three HDF5 arrays.

    anndata's ``sparse_dataset`` costs about 1.8 ms per slice, three h5py reads about 0.1 ms;
    the pre-shuffle reads one slice per small block, so this is what makes it affordable.
    """

    format = "csr"

    def __init__(self, group: Any):
        self.group = group
        self.shape = tuple(int(n) for n in group.attrs["shape"])
        self._data, self._indices, self._indptr = group["data"], group["indices"], group["indptr"]
        self.dtype = self._data.dtype

    def __getitem__(self, rows: slice) -> Any:
        import scipy.sparse as sp

        ptr = self._indptr[rows.start : rows.stop + 1].astype(np.int64)
        lo, hi = int(ptr[0]), int(ptr[-1])
        return sp.csr_matrix(
            (self._data[lo:hi], self._indices[lo:hi], ptr - lo),
            shape=(len(ptr) - 1, self.shape[1]),
        )


def _from_anndata(adata: Any, name: str, *, layer: str | None, raw: bool) -> _Source:
    layers, has_raw = sorted(adata.layers), adata.raw is not None
    if raw:
        matrix, var = (adata.raw.X, adata.raw.var) if has_raw else (None, None)
    elif layer is not None:
        matrix, var = (adata.layers[layer] if layer in layers else None), adata.var
    else:
        matrix, var = adata.X, adata.var
    if matrix is None:
        raise ValueError(_no_matrix(f"AnnData input {name}", layer, raw, layers, has_raw))
    return _checked(_Source(name, matrix, adata.obs, var))


def _no_matrix(name: str, layer: str | None, raw: bool, layers: list[str], has_raw: bool) -> str:
    """One line: the matrix asked for is absent; which ones the input does have."""
    missing = "raw.X" if raw else ("X" if layer is None else f"layer {layer!r}")
    found = [f"layers {layers} (--layer NAME)"] if layers else []
    found += ["raw.X (--raw)"] if has_raw else []
    has = f"it has {' and '.join(found)}" if found else "it holds no other matrix"
    return f"{name} has no {missing}; {has}"


def _checked(source: _Source) -> _Source:
    shape = tuple(source.matrix.shape)
    if shape != (len(source.obs), len(source.var)):
        raise ValueError(
            f"input {source.name}: matrix shape {shape} does not match obs x var "
            f"({len(source.obs)} x {len(source.var)})"
        )
    names = source.var.index
    if not names.is_unique:
        repeated = names[names.duplicated()][0]
        raise ValueError(
            f"input {source.name}: var_names are not unique ({repeated!r} appears "
            f"{int((names == repeated).sum())} times), so gene_id could not name a gene; make "
            "them unique first (anndata: adata.var_names_make_unique())"
        )
    return source


def _check_same_var(first: _Source, other: _Source) -> None:
    a, b = first.var.index.astype(str), other.var.index.astype(str)
    if len(a) != len(b) or not (a == b).all():
        where = (
            f"{len(b)} genes instead of {len(a)}"
            if len(a) != len(b)
            else f"gene {int(np.flatnonzero(a != b)[0])} is {b[a != b][0]!r}, not {a[a != b][0]!r}"
        )
        raise ValueError(
            f"inputs {first.name} and {other.name} have different var ({where}); every input "
            "must list the same genes in the same order. Subset or reorder them with anndata first."
        )


# -- values ------------------------------------------------------------------------------------


def _stored_values(matrix: Any, chunk: int) -> Iterator[np.ndarray]:
    """The stored values of a matrix, in pieces, without reading it whole."""
    if hasattr(matrix, "group") and hasattr(matrix, "format"):  # anndata backed sparse dataset
        data = matrix.group["data"]
        for lo in range(0, data.shape[0], _VALUES_PER_SCAN):
            yield np.asarray(data[lo : lo + _VALUES_PER_SCAN])
    elif hasattr(matrix, "tocsr"):  # scipy sparse
        yield np.asarray(matrix.data)
    else:
        for lo in range(0, matrix.shape[0], chunk):
            yield np.asarray(matrix[lo : lo + chunk]).ravel()


def _value_type(sources: list[_Source]) -> tuple[pa.DataType, str]:
    """The Arrow type the values are stored as, and their kind (:mod:`slafload.data.value_kind`)."""
    integral, hi = True, 0.0
    for source in sources:
        chunk = max(1, _CELL_BUDGET // max(len(source.var), 1))
        is_int_dtype = np.issubdtype(np.dtype(source.matrix.dtype), np.integer)
        for values in _stored_values(source.matrix, chunk):
            if not len(values):
                continue
            lo = values.min()
            if np.isnan(lo) or lo < 0:
                raise ValueError(
                    f"input {source.name} holds {'NaN' if np.isnan(lo) else 'negative'} values; "
                    "SLAF stores non-negative expression. Convert raw counts (--raw / raw=True) "
                    "or a counts layer (--layer NAME) instead."
                )
            hi = max(hi, float(values.max()))
            if integral and not is_int_dtype:
                integral = bool(np.all(np.mod(values, 1) == 0))
    kind = COUNTS if integral else NON_INTEGER
    if integral and hi <= np.iinfo(np.uint16).max:
        return pa.uint16(), kind
    if integral and hi <= np.iinfo(np.uint32).max:
        return pa.uint32(), kind
    return pa.float32(), kind


# -- cell order and blocks ---------------------------------------------------------------------


def _units(
    sources: list[_Source], chunk: int, shuffle_seed: int | None, shuffle_block: int
) -> list[tuple[int, int, int]]:
    """``(source, start, stop)`` row ranges in output order."""
    size = chunk if shuffle_seed is None else shuffle_block
    units = [
        (i, lo, min(lo + size, s.n_cells))
        for i, s in enumerate(sources)
        for lo in range(0, s.n_cells, size)
    ]
    if shuffle_seed is not None:
        perm = np.random.default_rng(int(shuffle_seed)).permutation(len(units))
        units = [units[j] for j in perm]
    return units


def _global_index(sources: list[_Source], unit: tuple[int, int, int]) -> np.ndarray:
    i, lo, hi = unit
    offset = sum(s.n_cells for s in sources[:i])
    return np.arange(offset + lo, offset + hi, dtype=np.int64)


def _blocks(
    sources: list[_Source],
    units: list[tuple[int, int, int]],
    chunk: int,
    bar: Any,
    value_type: pa.DataType,
) -> Iterator[CsrBlock]:
    """CSR blocks of up to ``chunk`` cells, reading the units in order."""
    import scipy.sparse as sp

    pending: list[Any] = []
    n_pending = 0
    for i, lo, hi in units:
        pending.append(sp.csr_matrix(sources[i].matrix[lo:hi]))
        n_pending += hi - lo
        if n_pending >= chunk:
            yield _csr_block(pending, value_type)
            if bar is not None:
                bar.update(n_pending)
            pending, n_pending = [], 0
    if pending:
        yield _csr_block(pending, value_type)
        if bar is not None:
            bar.update(n_pending)


def _csr_block(parts: list[Any], value_type: pa.DataType) -> CsrBlock:
    import scipy.sparse as sp

    if len(parts) == 1:
        m = parts[0]
    else:  # plain concatenation: half the cost of sp.vstack for many 1-cell parts
        counts = np.concatenate([np.diff(p.indptr) for p in parts])
        indptr = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        m = sp.csr_matrix(
            (np.concatenate([p.data for p in parts]), np.concatenate([p.indices for p in parts]),
             indptr),
            shape=(len(counts), parts[0].shape[1]),
        )  # fmt: skip
    m.sum_duplicates()  # sorts genes within each cell and sums repeated entries, as scipy does
    m.eliminate_zeros()
    if pa.types.is_integer(value_type) and m.nnz:
        top = np.iinfo(value_type.to_pandas_dtype()).max
        if m.data.max() > top:  # the value type was chosen from the entries, not their sums
            raise ValueError(
                f"repeated entries of a gene in a cell sum to {m.data.max():g}, more than "
                f"{value_type} (chosen from the stored values) holds; sum them first "
                "(scipy: X.sum_duplicates())"
            )
    return CsrBlock(m.indptr.astype(np.int64), m.indices, m.data)


# -- obs and var -------------------------------------------------------------------------------


def _obs_table(sources: list[_Source], source_column: str) -> pa.Table:
    tables = [_arrow_columns(s.obs, "cell_id") for s in sources]
    if len(sources) > 1:
        if source_column in tables[0].column_names:
            raise ValueError(
                f"obs already has a column {source_column!r}; pass another source_column"
            )
        tables = [
            t.append_column(source_column, pa.array([s.name] * t.num_rows, pa.string()))
            for s, t in zip(sources, tables, strict=True)
        ]
    return pa.concat_tables(tables, promote_options="permissive")


def _arrow_columns(frame: Any, id_column: str) -> pa.Table:
    """obs/var as Arrow, as slafdb writes them: categoricals and objects become strings."""
    import pandas as pd

    columns: dict[str, pa.Array] = {id_column: pa.array(frame.index.astype(str), pa.string())}
    for name in frame.columns:
        safe = str(name).replace(".", "_")  # Lance rejects '.' in field names; slafdb does this
        if safe in _RESERVED or safe == id_column:
            logger.warning("dropping input column %r: slafload writes %r itself", name, safe)
            continue
        col = frame[name]
        if isinstance(col.dtype, pd.CategoricalDtype):
            codes = col.cat.codes.to_numpy()
            labels = pa.array(col.cat.categories.astype(str), pa.string())
            columns[safe] = pa.DictionaryArray.from_arrays(
                pa.array(codes, mask=codes < 0), labels
            ).cast(pa.string())
        elif col.dtype == object or pd.api.types.is_string_dtype(col.dtype):
            columns[safe] = pa.array(col.astype(object).where(col.notna(), None).map(
                lambda v: v if v is None else str(v)), pa.string())  # fmt: skip
        else:
            columns[safe] = pa.array(col.to_numpy())
    return pa.table(columns)
