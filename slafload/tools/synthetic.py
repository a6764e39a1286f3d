"""Seeded synthetic SLAF atlases for tests and benchmarks.

Generative model: every gene has a shared Zipf popularity (over a random permutation of genes);
each plate mixes it with its own Zipf profile over a plate-specific permutation plus a small
uniform floor, so expression profiles differ from plate to plate. A cell draws ``m`` reads from
its plate's profile (multinomial sampling, as in UMI counting): its non-zeros are the distinct
genes drawn and its counts their multiplicities, so popular genes get large counts, most counts
are 1 and ties are plentiful. ``m`` is chosen per cell so that the expected number of distinct
genes follows a lognormal around ``mean_nnz``; a seeded ``empty_fraction`` of cells gets no reads.
With ``value_dtype="float32"`` the counts are log-normalised: ``log1p(1e4 * count / m)``.

Optionally (``n_labels > 0``) every cell also carries a class ``label`` confounded with its
plate, as drug or cell line labels are in Tahoe-100M: each plate draws its label proportions
from a Dirichlet(``label_concentration``), its cells are stored label by label (as wells are),
and a cell's profile is ``(1 - label_weight)`` of its plate's profile plus ``label_weight`` of
its label's own Zipf profile. Plates then differ more than labels do, so a classifier has to
find the weaker label signal under a strong plate effect.
"""

import logging
import math
import numbers
import os
import pathlib
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from slafload.data.value_kind import CONFIG_KEY, COUNTS, NON_INTEGER
from slafload.tools.progress import progress_bar
from slafload.tools.writer import CsrBlock, write_slaf

__all__ = ["write_atlas"]

logger = logging.getLogger(__name__)

_ZIPF_EXPONENT = 1.0
_SHARED_WEIGHT = 0.5  # weight of the shared profile in every plate's mixture
_PLATE_WEIGHT = 0.4  # weight of the plate's own profile; the remainder is uniform
_NNZ_SIGMA = 0.5  # sigma of the lognormal target of distinct genes per cell
_MAX_READS_PER_GENE = 20  # reads per cell are capped at this many times n_genes
_BLOCK_READS = 4_000_000  # reads generated per block (~3M rows); bounds memory
_MAX_PLATES = 256
_VALUE_TYPES = {"uint16": pa.uint16(), "float32": pa.float32()}


@dataclass(frozen=True)
class _Spec:
    """Validated arguments of :func:`write_atlas`, recorded in ``config.json``."""

    n_cells: int
    n_genes: int
    n_plates: int
    mean_nnz: int
    empty_fraction: float
    seed: int
    max_rows_per_file: int | None
    value_dtype: str
    n_labels: int = 0
    label_weight: float = 0.0
    label_concentration: float = 1.0

    def params(self) -> dict[str, object]:
        """Generator parameters for ``config.json`` (the label ones only when labels exist)."""
        out = {k: v for k, v in asdict(self).items() if k != "seed"}
        if not self.n_labels:
            for key in ("n_labels", "label_weight", "label_concentration"):
                del out[key]
        return out


def write_atlas(
    path: str | os.PathLike,
    *,
    n_cells: int = 10_000,
    n_genes: int = 20_000,
    n_plates: int = 14,
    mean_nnz: int = 800,
    empty_fraction: float = 0.0,
    seed: int = 0,
    max_rows_per_file: int | None = None,
    value_dtype: str = "uint16",
    n_labels: int = 0,
    label_weight: float = 0.3,
    label_concentration: float = 1.0,
    overwrite: bool = False,
    progress: bool = False,
) -> pathlib.Path:
    """Write a synthetic SLAF dataset directory and return its path.

    Parameters
    ----------
    path
        Directory to create: ``config.json``, ``{expression,cells,genes}.lance``.
    n_cells, n_genes
        Matrix shape, each in [1, 2**32 - 1]; gene ids are uint16 up to 65535 genes, else uint32.
    n_plates
        Contiguous, equal-sized (+-1) cell blocks with distinct profiles; in [1, min(n_cells, 256)].
    mean_nnz
        Mean of the lognormal target of non-zeros per non-empty cell; in [1, n_genes].
    empty_fraction
        Exactly ``floor(empty_fraction * n_cells)`` seeded cells have no non-zeros; in [0, 1).
    seed
        Non-negative seed; the same arguments always give identical table contents.
    max_rows_per_file
        Passed to ``lance.write_dataset`` for the expression table (Lance's default if None).
    value_dtype
        ``"uint16"`` counts (clipped to 65535) or ``"float32"`` log-normalised values.
    n_labels
        Classes of an obs column ``label`` confounded with plates (see the module docstring);
        ``0`` (the default) writes no label and leaves every other output unchanged. In
        [0, 256].
    label_weight
        Share of a labelled cell's expression profile that comes from its label; in [0, 1].
    label_concentration
        Dirichlet concentration of each plate's label proportions: small values give plates
        dominated by a few labels, large ones plates with every label in equal shares; > 0.
    overwrite
        Replace an existing ``path`` instead of raising ``FileExistsError``.
    progress
        Show a tqdm bar over cells if tqdm is installed.

    Returns:
    -------
    pathlib.Path
        The dataset directory. Expression rows are sorted by cell then gene with no duplicate
        pair; ``cells.cell_start_index`` is the CSR indptr without its final entry.
    """
    spec = _spec(n_cells=n_cells, n_genes=n_genes, n_plates=n_plates, mean_nnz=mean_nnz,
                 empty_fraction=empty_fraction, seed=seed, max_rows_per_file=max_rows_per_file,
                 value_dtype=value_dtype, n_labels=n_labels, label_weight=label_weight,
                 label_concentration=label_concentration)  # fmt: skip
    path = pathlib.Path(path)
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise FileExistsError(f"{path} already exists; pass overwrite=True to replace it")
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    _write(path, spec, progress)
    return path


def _spec(
    *,
    n_cells: int,
    n_genes: int,
    n_plates: int,
    mean_nnz: int,
    empty_fraction: float,
    seed: int,
    max_rows_per_file: int | None,
    value_dtype: str,
    n_labels: int,
    label_weight: float,
    label_concentration: float,
) -> _Spec:
    """:func:`write_atlas`' arguments checked (each error names the argument and its range)."""
    n_cells = _check_int("n_cells", n_cells, 1, 2**32 - 1)
    n_genes = _check_int("n_genes", n_genes, 1, 2**32 - 1)
    n_plates = _check_int("n_plates", n_plates, 1, min(n_cells, _MAX_PLATES))
    mean_nnz = _check_int("mean_nnz", mean_nnz, 1, n_genes)
    seed = _check_int("seed", seed, 0, 2**63 - 1)
    if max_rows_per_file is not None:
        max_rows_per_file = _check_int("max_rows_per_file", max_rows_per_file, 1, 2**63 - 1)
    if not isinstance(empty_fraction, numbers.Real) or not 0 <= empty_fraction < 1:
        raise ValueError(f"empty_fraction must be a number in [0, 1), got {empty_fraction!r}")
    if value_dtype not in _VALUE_TYPES:
        raise ValueError(f"value_dtype must be one of {sorted(_VALUE_TYPES)}, got {value_dtype!r}")
    n_labels = _check_int("n_labels", n_labels, 0, _MAX_PLATES)
    if not isinstance(label_weight, numbers.Real) or not 0 <= label_weight <= 1:
        raise ValueError(f"label_weight must be a number in [0, 1], got {label_weight!r}")
    if not isinstance(label_concentration, numbers.Real) or not label_concentration > 0:
        raise ValueError(f"label_concentration must be a number > 0, got {label_concentration!r}")
    return _Spec(n_cells, n_genes, n_plates, mean_nnz, float(empty_fraction), seed,
                 max_rows_per_file, value_dtype, n_labels, float(label_weight),
                 float(label_concentration))  # fmt: skip


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or not lo <= int(value) <= hi
    ):
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return int(value)


def _write(path: pathlib.Path, spec: _Spec, progress: bool) -> None:
    n_cells, n_genes, n_plates = spec.n_cells, spec.n_genes, spec.n_plates
    # A third seed stream for labels leaves the first two (and so every unlabelled output) as is.
    streams = np.random.SeedSequence(spec.seed).spawn(3 if spec.n_labels else 2)
    model_rng, reads_rng = map(np.random.default_rng, streams[:2])
    sizes = np.full(n_plates, n_cells // n_plates, dtype=np.int64)
    sizes[: n_cells % n_plates] += 1
    plate_bounds = np.concatenate(([0], np.cumsum(sizes)))
    probs = _plate_profiles(model_rng, n_genes, n_plates)
    obs_labels = {}
    if spec.n_labels:
        # Cells are generated group by group, a group being one label's cells on one plate.
        probs, plate_bounds, labels = _label_groups(np.random.default_rng(streams[2]), probs,
                                                    sizes, spec)  # fmt: skip
        names = np.array([f"label_{k:02d}" for k in range(spec.n_labels)])
        obs_labels["label"] = pa.array(names[labels], pa.string())
    reads = _reads_per_cell(model_rng, probs, plate_bounds, spec.mean_nnz, spec.empty_fraction)
    cdfs = np.cumsum(probs, axis=1)
    cdfs /= cdfs[:, -1:]
    plate_names = np.array([f"plate_{p:02d}" for p in range(n_plates)])
    bar = progress_bar(progress, n_cells, "synthetic atlas")
    kind = COUNTS if spec.value_dtype == "uint16" else NON_INTEGER  # float32: log-normalised
    try:
        write_slaf(
            path,
            _expression_blocks(reads_rng, cdfs, plate_bounds, reads, spec.value_dtype, bar),
            n_genes=n_genes,
            value_type=_VALUE_TYPES[spec.value_dtype],
            obs={
                "cell_id": pa.array([f"cell_{i:07d}" for i in range(1, n_cells + 1)]),
                "plate": pa.array(np.repeat(plate_names, sizes), pa.string()),
                **obs_labels,
            },
            var={
                "gene_id": pa.array([f"GENE{g:06d}" for g in range(1, n_genes + 1)]),
                "gene_symbol": pa.array([f"SYM{g:06d}" for g in range(1, n_genes + 1)]),
            },
            max_rows_per_file=spec.max_rows_per_file,
            overwrite=True,
            extra_config={CONFIG_KEY: kind, "generator": {
                "name": __name__,
                "seed": spec.seed,
                "params": spec.params(),
            }},
        )  # fmt: skip
    finally:
        if bar is not None:
            bar.close()
    logger.info("wrote %s: %d cells x %d genes", path, n_cells, n_genes)


def _plate_profiles(rng: np.random.Generator, n_genes: int, n_plates: int) -> np.ndarray:
    """Gene probabilities per plate, shape (n_plates, n_genes), rows summing to one."""
    zipf = np.arange(1, n_genes + 1, dtype=np.float64) ** -_ZIPF_EXPONENT
    zipf /= zipf.sum()
    shared = _SHARED_WEIGHT * zipf[rng.permutation(n_genes)]
    shared += (1 - _SHARED_WEIGHT - _PLATE_WEIGHT) / n_genes
    own = [_PLATE_WEIGHT * zipf[rng.permutation(n_genes)] for _ in range(n_plates)]
    return shared + np.stack(own)


def _label_groups(
    rng: np.random.Generator, plate_probs: np.ndarray, plate_sizes: np.ndarray, spec: _Spec
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Profiles and cell bounds of the non-empty (plate, label) groups, and each cell's label.

    Groups are stored plate by plate, label by label within a plate.
    """
    n_genes, k = plate_probs.shape[1], spec.n_labels
    zipf = np.arange(1, n_genes + 1, dtype=np.float64) ** -_ZIPF_EXPONENT
    zipf /= zipf.sum()
    label_probs = np.stack([zipf[rng.permutation(n_genes)] for _ in range(k)])
    shares = rng.dirichlet(np.full(k, spec.label_concentration), size=len(plate_sizes))
    counts = np.stack([rng.multinomial(n, s) for n, s in zip(plate_sizes, shares, strict=True)])
    plate, label = np.nonzero(counts)  # row-major: plate by plate, label by label
    w = spec.label_weight
    probs = (1 - w) * plate_probs[plate] + w * label_probs[label]
    sizes = counts[plate, label]
    return probs, np.concatenate(([0], np.cumsum(sizes))), np.repeat(label, sizes)


def _reads_per_cell(
    rng: np.random.Generator,
    probs: np.ndarray,
    plate_bounds: np.ndarray,
    mean_nnz: int,
    empty_fraction: float,
) -> np.ndarray:
    """Reads per cell such that the expected number of distinct genes hits a lognormal target."""
    n_plates, n_genes = probs.shape
    n_cells = int(plate_bounds[-1])
    target = rng.lognormal(math.log(mean_nnz) - _NNZ_SIGMA**2 / 2, _NNZ_SIGMA, size=n_cells)
    np.clip(target, 1, n_genes, out=target)
    grid = np.unique(np.geomspace(1, _MAX_READS_PER_GENE * n_genes, 64).round())
    reads = np.empty(n_cells, np.int64)
    for p in range(n_plates):
        # E[distinct genes among m reads] = sum_g 1 - (1 - p_g)^m, increasing in m.
        with np.errstate(divide="ignore"):  # p_g == 1 when there is a single gene
            log_miss = np.log1p(-probs[p])
        distinct = np.maximum.accumulate(n_genes - np.exp(np.outer(grid, log_miss)).sum(axis=1))
        lo, hi = plate_bounds[p], plate_bounds[p + 1]
        reads[lo:hi] = np.rint(np.interp(target[lo:hi], distinct, grid))
    reads[rng.choice(n_cells, size=int(empty_fraction * n_cells), replace=False)] = 0
    return reads


def _expression_blocks(
    rng: np.random.Generator,
    cdfs: np.ndarray,
    plate_bounds: np.ndarray,
    reads: np.ndarray,
    value_dtype: str,
    bar: Any | None,
) -> Iterator[CsrBlock]:
    """Consecutive cell blocks of about _BLOCK_READS reads each."""
    offsets = np.concatenate(([0], np.cumsum(reads)))
    start = 0
    while start < len(reads):
        stop = int(np.searchsorted(offsets, offsets[start] + _BLOCK_READS, side="right")) - 1
        stop = min(max(stop, start + 1), len(reads))
        # A separate function, so its temporaries are freed before Lance takes the block.
        yield _expression_block(rng, cdfs, plate_bounds, offsets, start, stop, value_dtype)
        if bar is not None:
            bar.update(stop - start)
        start = stop


def _expression_block(
    rng: np.random.Generator,
    cdfs: np.ndarray,
    plate_bounds: np.ndarray,
    offsets: np.ndarray,
    start: int,
    stop: int,
    value_dtype: str,
) -> CsrBlock:
    """Sorted, de-duplicated expression rows of cells [start, stop), with per-cell totals."""
    local = offsets[start : stop + 1] - offsets[start]  # read offsets of the block's cells
    m, n, total = np.diff(local), stop - start, int(local[-1])
    # Sorted uniforms per cell from normalised exponential spacings (no sort needed), so the
    # inverse-CDF genes come out sorted within each cell and de-duplication is a diff.
    spacing = np.cumsum(rng.standard_exponential(total + n))
    ends = local[1:] + np.arange(n)  # each cell's extra spacing, which normalises it
    base = np.concatenate(([0.0], spacing[ends[:-1]]))
    keep = np.ones(total + n, dtype=bool)
    keep[ends] = False
    u = spacing[keep]
    u -= np.repeat(base, m)
    u /= np.repeat(spacing[ends] - base, m)
    del spacing, keep
    gene = np.empty(total, dtype=np.int64)
    first_plate = int(np.searchsorted(plate_bounds, start, side="right")) - 1
    for p in range(first_plate, int(np.searchsorted(plate_bounds, stop, side="left"))):
        lo = local[max(plate_bounds[p], start) - start]
        hi = local[min(plate_bounds[p + 1], stop) - start]
        gene[lo:hi] = np.searchsorted(cdfs[p], u[lo:hi], side="right")
    del u
    np.minimum(gene, cdfs.shape[1] - 1, out=gene)  # guards u rounding to exactly 1.0
    is_first = np.empty(total, dtype=bool)
    np.not_equal(gene[1:], gene[:-1], out=is_first[1:])
    is_first[local[:-1][m > 0]] = True  # a cell's first read always starts a new row
    first = np.flatnonzero(is_first)
    del is_first
    rows = np.searchsorted(first, local)  # row offsets of the block's cells
    nnz = np.diff(rows)
    counts = np.diff(first, append=total)
    if value_dtype == "float32":
        values = np.log1p(counts * (1e4 / np.repeat(m, nnz))).astype(np.float32)
    else:
        values = np.minimum(counts, np.iinfo(np.uint16).max).astype(np.uint16)
    del counts
    running = np.concatenate(([0.0], np.cumsum(values, dtype=np.float64)))
    totals = running[rows[1:]] - running[rows[:-1]]
    return CsrBlock(
        rows,
        gene[first],
        values,
        obs={
            "n_genes_by_counts": nnz,
            "total_counts": totals if value_dtype == "float32" else totals.astype(np.int64),
        },
    )
