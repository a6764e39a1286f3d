"""What the presets share: the :class:`Preset` contract, its :class:`Coverage` report, the
hashed draws (:func:`uniforms`) and dictionary loading (see :mod:`slafload.presets`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from slafload.data.dataset import SlafDataset
from slafload.tokenizers import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_SAMPLE_CELLS = 2048
DEFAULT_WARN_BELOW = 0.5

_M1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 finalizer constants
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class Coverage:
    """How much of a dataset a model's vocabulary covers.

    Attributes:
        n_genes: Genes of the dataset (rows of ``genes.lance``).
        n_covered: Of those, genes the model has a token for (after mapping).
        mass_fraction: Fraction of the expression (sum of values) that falls on covered genes,
            estimated on ``cells_sampled`` cells read in evenly spaced blocks; ``nan`` when the
            sample holds no expression.
        cells_sampled: Cells the mass estimate was taken over (all cells of small datasets).
        column: The ``genes.lance`` column the genes were matched by.
        model: The preset's name.
    """

    n_genes: int
    n_covered: int
    mass_fraction: float
    cells_sampled: int
    column: str
    model: str

    @property
    def gene_fraction(self) -> float:
        """Fraction of the dataset's genes the model's vocabulary covers."""
        return self.n_covered / self.n_genes if self.n_genes else float("nan")

    def __str__(self) -> str:
        return (
            f"{self.model}: {self.n_covered:,} of {self.n_genes:,} genes "
            f"({self.gene_fraction:.1%}) matched by column {self.column!r}, carrying "
            f"{self.mass_fraction:.1%} of the expression (estimated on {self.cells_sampled:,} "
            "cells)"
        )


@dataclass(frozen=True, eq=False)
class Preset:
    """A tokenizer and the chunk transforms that must run before ranking, plus coverage.

    Pass it as ``Loader(ds, tokenizer=preset)``: the loader runs ``transforms`` first, then
    any ``transforms=`` given to it. A mixture's preset (:func:`mixed_preset`) holds the
    preset of each source in ``sources``.
    """

    name: str
    tokenizer: Tokenizer
    transforms: tuple[Callable[..., Any], ...]
    coverage: Coverage
    sources: tuple[Preset, ...] = ()


def mixed_preset(name: str, offsets: np.ndarray, presets: Sequence[Preset]) -> Preset:
    """The preset of a mixture from the presets built for its sources (global cell ids
    ``[offsets[k], offsets[k + 1])`` are source ``k``'s).

    Its tokenizer tokenizes each source's cells with that source's preset
    (:class:`~slafload.data.sources.PerSourceTokens`); its transforms are empty (the
    mixture runs each source's, :meth:`~slafload.data.mixture.Mixture.with_presets`); its
    coverage sums the sources' genes and weighs their mass fractions by cells sampled;
    ``sources`` holds the presets.
    """
    from slafload.data.sources import PerSourceTokens

    reports = [p.coverage for p in presets]
    sampled = np.array([r.cells_sampled for r in reports], dtype=np.float64)
    mass = np.array([r.mass_fraction for r in reports])
    known = ~np.isnan(mass) & (sampled > 0)
    coverage = Coverage(
        n_genes=sum(r.n_genes for r in reports),
        n_covered=sum(r.n_covered for r in reports),
        mass_fraction=float(np.average(mass[known], weights=sampled[known]))
        if known.any()
        else float("nan"),
        cells_sampled=int(sampled.sum()),
        column=reports[0].column,
        model=reports[0].model,
    )
    tokenizer = PerSourceTokens(offsets, tuple(p.tokenizer for p in presets), name)
    return Preset(name, tokenizer, (), coverage, tuple(presets))


def measure_coverage(
    dataset: SlafDataset,
    covered: np.ndarray,
    *,
    column: str,
    model: str,
    sample_cells: int = DEFAULT_SAMPLE_CELLS,
    warn_below: float = DEFAULT_WARN_BELOW,
) -> Coverage:
    """Coverage of ``dataset`` by a boolean ``covered[gene_integer_id]`` mask, logged.

    The expression mass is estimated on at most ``sample_cells`` cells read as 16 evenly spaced
    blocks of consecutive cells (cheap contiguous reads); a warning is logged when either the
    gene fraction or the mass fraction is below ``warn_below``.
    """
    covered = np.asarray(covered, dtype=bool)
    n_cells = dataset.n_cells
    take = min(sample_cells, n_cells)
    mass = np.zeros(2)
    if take:
        n_blocks = min(16, take)
        per = -(-take // n_blocks)
        firsts = np.unique(np.linspace(0, max(n_cells - per, 0), n_blocks).astype(np.int64))
        start = dataset.cell_start
        for first in firsts.tolist():
            lo, hi = int(start[first]), int(start[min(first + per, n_cells)])
            if hi <= lo:
                continue
            table = dataset.expression.to_table(
                columns=["gene_integer_id", "value"], offset=lo, limit=hi - lo
            )
            genes = table.column(0).to_numpy().astype(np.int64)
            values = table.column(1).to_numpy().astype(np.float64)
            mass += [values[covered[genes]].sum(), values.sum()]
        take = int(sum(min(per, n_cells - f) for f in firsts.tolist()))
    report = Coverage(
        n_genes=len(covered),
        n_covered=int(covered.sum()),
        mass_fraction=float(mass[0] / mass[1]) if mass[1] > 0 else float("nan"),
        cells_sampled=take,
        column=column,
        model=model,
    )
    low = report.gene_fraction < warn_below or report.mass_fraction < warn_below
    if low:
        logger.warning(
            "%s. Below %.0f%%: check that column %r holds the identifiers the model's "
            "dictionary uses (Ensembl ids for Geneformer, symbols for scGPT) or pass a "
            "mapping file.",
            report,
            100 * warn_below,
            column,
        )
    else:
        logger.info("%s", report)
    return report


def uniforms(seed: int, epoch: int, stream: int, cells: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``float64`` draws in ``[0, 1)``, one per ``(cell, key)`` pair, as ``np.random.rand``.

    A counter-based hash (splitmix64 finalizer) of ``(seed, epoch, stream, cell, key)``: the
    same pair always gets the same draw, independent of which other pairs are drawn with it.
    ``stream`` separates independent uses (tie spreading, subsampling) of the same pairs.
    """
    base = np.random.SeedSequence([seed, epoch, stream]).generate_state(1, np.uint64)
    cells = np.asarray(cells).astype(np.uint64)
    keys = np.asarray(keys).astype(np.uint64)
    z = _mix(base + cells * _GOLDEN)
    z = _mix(z ^ (keys * _M2 + _GOLDEN))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def gene_names(dataset: SlafDataset, column: str) -> list[str]:
    """``column`` of ``genes.lance`` by ``gene_integer_id`` (duplicates allowed)."""
    from slafload.transforms.vocab import _gene_names

    return _gene_names(dataset, column)


def load_dictionary(source: Any, what: str, loader: Callable[[Any], Any]) -> dict:
    """A dictionary given as a mapping, or read from a file with ``loader``."""
    if isinstance(source, dict):
        return source
    if source is None:
        raise ValueError(f"{what} is required: pass the model's file path or a dict")
    from slafload.errors import VocabularyError

    try:
        loaded = loader(source)
    except (OSError, ValueError) as exc:
        raise VocabularyError(f"cannot read {what} from {source!r}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise VocabularyError(
            f"{what} file {source!r} holds a {type(loaded).__name__}, expected a dict"
        )
    return loaded
