"""Several SLAF datasets read as one: a weighted mixture over one gene vocabulary.

A :class:`Mixture` is a *source in front of the same chain*. It numbers the cells of its
datasets one after the other (source ``k`` holds the global cell ids
``[offsets[k], offsets[k + 1])``) and offers the chain what it asks of a dataset: a reader
(:class:`MixedReader`, one Lance reader per source), CSR offsets, obs codes. Its sampler
(:class:`~slafload.samplers.mixed.MixtureSampler`) builds mixed fetches: one contiguous
block of each source's own plan per fetch, its cells interleaved by a seeded weighted
schedule, so every batch draws from the sources in proportion to the weights
(``mix="cell"``), or each batch comes from one source (``mix="batch"``). Partitioning among
ranks, positions and resume are those of a single dataset. Per-source work happens in
the chunk transforms (:class:`PerSource`): each source's value handling, then its
:class:`~slafload.transforms.vocab.GeneRemap` into the shared vocabulary; the tokens that come
out are vocabulary tokens. With a published model's preset (:func:`slafload.presets.mixture_preset`) the
preset is built for each source instead: each source's cells go through its own preset's
transforms and tokenizer (:class:`~slafload.data.sources.PerSourceTokens`), and the tokens are
the model's.

Every batch of a mixture carries ``source`` (``int64`` source index per cell; names in
``loader.source_names``) and ``cell_integer_id`` as the cell's id *within its source*. An obs
column that some sources lack gets the code :data:`MISSING` (``-1``) for their cells.

Value types: a source whose expression values are integers holds counts, one with float values
holds something else (often log-normalised). Mixing the two is refused unless the tokenizer
depends only on the order of each cell's values (the built-in ``geneformer`` rank-value
encoding and ``scgpt``'s per-cell quantile bins, with no loader-level chunk transforms), or
``values="log1p"`` normalises every integer source per cell (:class:`LogNormalize`), or
``values="as_is"`` accepts the mix knowingly. See docs/mixtures.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import PurePosixPath
from typing import Any, cast

import numpy as np
import pyarrow as pa

from slafload.data.dataset import SlafDataset, open_dataset
from slafload.data.sources import CellColumn, GlobalOffsets, MixedReader, PerSource
from slafload.errors import MixtureError, SchemaError, StateError, VocabularyError
from slafload.pipeline import budget
from slafload.pipeline.reader import COLUMNS, ReadOptions
from slafload.presets.base import Preset
from slafload.samplers.mixed import MixtureSampler
from slafload.transforms.lognorm import LogNormalize
from slafload.transforms.vocab import UNKNOWN_RULES, Vocabulary, _gene_names
from slafload.types import ChunkTransform, Sampler

logger = logging.getLogger(__name__)

MISSING = -1
"""Obs code of the cells of a source that lacks the column."""
VALUE_RULES = ("check", "log1p", "as_is")
MIX_RULES = ("cell", "batch")
DatasetLike = SlafDataset | str | os.PathLike


@dataclass(frozen=True, eq=False)
class Source:
    """One dataset of a mixture, with its own settings.

    Attributes:
        dataset: An opened dataset, or a path/URI to open.
        weight: Positive weight; default: the dataset's number of cells.
        name: Name in batches' ``source_names`` and checkpoints; default: the directory name
            without ``.slaf``.
        sampler: This source's sampler; default: the loader's.
        transforms: Chunk transforms for this source only, in its own gene and cell ids,
            run before the remap into the vocabulary or the preset's own transforms (e.g. a
            value normalisation).
    """

    dataset: DatasetLike
    weight: float | None = None
    name: str | None = None
    sampler: Sampler | None = None
    transforms: tuple[ChunkTransform, ...] = ()


class Mixture:
    """Several SLAF datasets streamed as one, mixed by weight through one vocabulary.

    Args:
        sources: Datasets (opened, or paths/URIs) or :class:`Source` objects.
        weights: One positive weight per source (overrides :attr:`Source.weight`); default:
            the sources' sizes.
        vocabulary: The shared gene vocabulary; ``"union"`` builds it from the sources' gene
            names (the first source's genes first); ``None`` requires every source to have the
            same genes in the same order (checked when a loader first needs the vocabulary;
            a model preset, :meth:`with_presets`, maps the genes into its own dictionary
            instead).
        unknown: What to do with a source's genes absent from the vocabulary (``"drop"``,
            ``"unk"``, ``"error"``; see :mod:`slafload.transforms.vocab`).
        gene_column: The genes.lance column naming genes.
        epoch_cells: ``None``: an epoch is one pass over every source; an integer: an epoch is
            that many cells, drawn from the sources in proportion to their weights (see
            :mod:`slafload.samplers.mixed`).
        mix: ``"cell"``: every batch draws its cells from the sources in proportion to the
            weights; ``"batch"``: every batch comes from one source, sources taking turns by
            weight (per-source normalisation layers need that).
        values: ``"check"`` refuses mixing integer and float values where it matters,
            ``"log1p"`` normalises integer sources per cell to ``target_sum`` then ``log1p``,
            ``"as_is"`` mixes them knowingly.
        target_sum: Total per cell for ``values="log1p"``.
    """

    def __init__(
        self,
        sources: Sequence[DatasetLike | Source],
        *,
        weights: Sequence[float] | None = None,
        vocabulary: Vocabulary | str | None = None,
        unknown: str = "drop",
        gene_column: str = "gene_id",
        epoch_cells: int | None = None,
        mix: str = "cell",
        values: str = "check",
        target_sum: float = 1e4,
    ):
        specs = [s if isinstance(s, Source) else Source(s) for s in sources]
        if not specs:
            raise MixtureError("a mixture needs at least one source")
        if weights is not None:
            if len(weights) != len(specs):
                raise MixtureError(
                    f"weights has {len(weights)} entries for {len(specs)} sources; give one "
                    "weight per source"
                )
            specs = [
                dataclasses.replace(s, weight=float(w)) for s, w in zip(specs, weights, strict=True)
            ]
        if unknown not in UNKNOWN_RULES:
            raise MixtureError(f"unknown must be one of {UNKNOWN_RULES}, got {unknown!r}")
        if values not in VALUE_RULES:
            raise MixtureError(f"values must be one of {VALUE_RULES}, got {values!r}")
        if epoch_cells is not None and (not isinstance(epoch_cells, int) or epoch_cells < 1):
            raise MixtureError(f"epoch_cells must be a positive int or None, got {epoch_cells!r}")
        if mix not in MIX_RULES:
            raise MixtureError(f"mix must be one of {MIX_RULES}, got {mix!r}")
        if not target_sum > 0:
            raise MixtureError(f"target_sum must be positive, got {target_sum!r}")
        opened = [
            s.dataset if isinstance(s.dataset, SlafDataset) else open_dataset(s.dataset)
            for s in specs
        ]
        self.sources = tuple(
            dataclasses.replace(s, dataset=ds, name=s.name or _default_name(ds.uri))
            for s, ds in zip(specs, opened, strict=True)
        )
        self._options: dict[str, Any] = {
            "vocabulary": vocabulary,
            "unknown": unknown,
            "gene_column": gene_column,
            "epoch_cells": epoch_cells,
            "mix": mix,
            "values": values,
            "target_sum": target_sum,
        }
        self._check_sources()
        self.unknown, self.epoch_cells, self.values = unknown, epoch_cells, values
        self.mix = mix
        self.presets: tuple[Preset, ...] = ()
        self.cell_start = GlobalOffsets(self.offsets, [ds.cell_start for ds in self.datasets])

    @cached_property
    def vocabulary(self) -> Vocabulary:
        """The shared gene vocabulary (``vocabulary=``); raises :class:`VocabularyError`."""
        return self._vocabulary(self._options["vocabulary"], self._options["gene_column"])

    @cached_property
    def transform(self) -> PerSource:
        """Each source's value handling, own transforms, then remap into :attr:`vocabulary`
        (with presets: its own transforms, then its preset's; :meth:`with_presets`).

        Raises:
            VocabularyError: ``vocabulary=None`` and the sources' genes differ.
        """
        pairs = zip(self.sources, self.presets, strict=True)
        if self.presets:
            steps = [(*s.transforms, *p.transforms) for s, p in pairs]
        else:
            remaps = self._remaps(self.unknown, self._options["gene_column"])
            target_sum = self._options["target_sum"]
            steps = [
                (*self._value_transforms(ds, target_sum), *s.transforms, *remap)
                for s, ds, remap in zip(self.sources, self.datasets, remaps, strict=True)
            ]
        return PerSource(self.offsets, tuple(steps))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its sources, settings and presets, reopened at their pinned versions."""
        specs = [dataclasses.replace(s, dataset=s.dataset.uri) for s in self.sources]  # type: ignore[union-attr]
        pins = [(ds.versions, ds.storage_options) for ds in self.datasets]
        return (_reopen, (specs, pins, self._options, self.presets))

    def with_presets(self, presets: Sequence[Preset]) -> Mixture:
        """This mixture with ``presets[k]`` replacing source ``k``'s vocabulary remap and
        value handling (:func:`slafload.presets.mixture_preset`).
        """
        mixed = object.__new__(Mixture)  # a shallow copy (copy.copy would reopen it)
        mixed.__dict__.update(self.__dict__, presets=tuple(presets))
        mixed.__dict__.pop("transform", None)
        return mixed

    # -- what the chain asks of a dataset ----------------------------------------------------

    @property
    def datasets(self) -> tuple[SlafDataset, ...]:
        """The sources' opened datasets, by source code."""
        return tuple(s.dataset for s in self.sources)  # type: ignore[misc]

    @property
    def source_names(self) -> tuple[str, ...]:
        """Source names, by source code."""
        return tuple(str(s.name) for s in self.sources)

    @property
    def offsets(self) -> np.ndarray:
        """``int64[k + 1]``: each source's first global cell id, then the total."""
        return np.concatenate([[0], np.cumsum([ds.n_cells for ds in self.datasets])]).astype(
            np.int64
        )

    @property
    def n_cells(self) -> int:
        """Cells of all sources together."""
        return int(self.offsets[-1])

    @property
    def n_genes(self) -> int:
        """The largest source's gene count: bounds the raw gene ids of every source.

        The model's gene tokens are :attr:`vocab_size` (the remap checks each source's ids).
        """
        return max(ds.n_genes for ds in self.datasets)

    @property
    def vocab_size(self) -> int:
        """Vocabulary ids the tokens can hold (one more than the genes under ``unknown="unk"``)."""
        return len(self.vocabulary) + (self.unknown == "unk")

    @property
    def uri(self) -> str:
        """A name for messages: every source's name and URI."""
        return "mixture(" + ", ".join(f"{s.name}={s.dataset.uri}" for s in self.sources) + ")"  # type: ignore[union-attr]

    @property
    def versions(self) -> dict[str, dict[str, int]]:
        """The pinned Lance versions of every source's tables, by source name."""
        return {str(s.name): ds.versions for s, ds in zip(self.sources, self.datasets, strict=True)}

    @property
    def storage_options(self) -> None:
        """None: each source keeps its own storage options."""
        return None

    def reader(self, options: ReadOptions | None = None) -> MixedReader:
        """The Lance reader of the mixture: each fetch read from its own source."""
        return MixedReader(self.offsets, self.datasets, options)

    def row_bytes(self, columns: list[str]) -> int:
        """Bytes of the widest source's expression row, as the memory budget counts them."""
        return max(ds.row_bytes(columns) for ds in self.datasets)

    def sampler(
        self,
        default: Sampler,
        bind=lambda s: s,
        batch_size: int = 1,
        memory_budget: int | None = None,
    ) -> MixtureSampler:
        """The mixture's sampler: each source's own sampler (``default`` where unset), mixing
        for batches of ``batch_size`` cells, its fetches within half of ``memory_budget`` (the
        other half for the next fetch, read ahead).
        """
        fetch_cells = None
        if memory_budget is not None:
            rows = max(int(ds.cell_start[-1]) / max(ds.n_cells, 1) for ds in self.datasets)
            per_cell = max(rows, 1.0) * self.row_bytes(list(COLUMNS)) * budget.COPIES
            fetch_cells = max(int(memory_budget // 2 // per_cell), batch_size)
        return MixtureSampler(
            names=self.source_names,
            uris=tuple(ds.uri for ds in self.datasets),
            sizes=tuple(ds.n_cells for ds in self.datasets),
            weights=tuple(
                float(s.weight if s.weight is not None else ds.n_cells)
                for s, ds in zip(self.sources, self.datasets, strict=True)
            ),
            samplers=tuple(
                bind(s.sampler) if s.sampler is not None else default for s in self.sources
            ),
            epoch_cells=self.epoch_cells,
            mix=self.mix,
            batch_size=batch_size,
            fetch_cells=fetch_cells,
        )

    def obs_codes(self, column: str) -> tuple[CellColumn, list[Any] | None]:
        """``column`` as codes per global cell id, and the category table (``None``: integer).

        Categories are the union over the sources that have the column; cells of the others
        get :data:`MISSING`.

        Raises:
            SchemaError: no source has the column, or it is integer in one source and
                categorical in another.
        """
        found = {
            k: ds.obs_codes(column)
            for k, ds in enumerate(self.datasets)
            if column in ds.cells.schema.names
        }
        if not found:
            raise SchemaError(f"no source of {self.uri!r} has the obs column {column!r}")
        kinds = {cats is None for _, cats in found.values()}
        if len(kinds) > 1:
            raise SchemaError(
                f"obs column {column!r} is integer in some sources and categorical in others "
                f"({[self.source_names[k] for k in found]}); write it with one type everywhere"
            )
        parts: list[np.ndarray | int | None] = [MISSING] * len(self.datasets)
        if kinds == {True}:
            for k, (codes, _) in found.items():
                parts[k] = codes
            return CellColumn(self.offsets, parts), None
        union = sorted(
            {c for _, cats in found.values() for c in cats or ()},
            key=lambda c: (c is None, str(c)),
        )
        index = {c: i for i, c in enumerate(union)}
        for k, (codes, cats) in found.items():
            parts[k] = np.array([index[c] for c in cats], dtype=np.int64)[codes]  # type: ignore[union-attr]
        return CellColumn(self.offsets, parts), union

    def cell_columns(self) -> dict[str, CellColumn]:
        """``source`` codes and per-source ``cell_integer_id`` of every global cell id."""
        n = len(self.datasets)
        return {
            "source": CellColumn(self.offsets, list(range(n))),
            "cell_integer_id": CellColumn(self.offsets, [None] * n),
        }

    def repin(self, versions: Mapping[str, Any]) -> Mixture:
        """This mixture with each source the checkpoint names reopened at its versions.

        Sources the checkpoint does not name keep their versions, and sources it names that
        this mixture lacks are ignored: the order fingerprint decides whether the state fits.

        Raises:
            StateError: a source cannot be opened at the recorded versions.
        """
        sources, changed = [], False
        for s, ds in zip(self.sources, self.datasets, strict=True):
            want = versions.get(str(s.name))
            if isinstance(want, Mapping) and dict(want) != ds.versions:
                try:
                    ds = open_dataset(
                        ds.uri, version=dict(want), storage_options=ds.storage_options
                    )
                except Exception as exc:
                    raise StateError(
                        f"cannot reopen source {s.name!r} ({ds.uri!r}) at the checkpoint's "
                        f"versions {dict(want)}: {exc}"
                    ) from exc
                changed = True
            sources.append(dataclasses.replace(s, dataset=ds))
        if not changed:
            return self
        return Mixture(sources, **self._options).with_presets(self.presets)

    def check_values(self, tokenizer: Any, transforms: Sequence[ChunkTransform]) -> None:
        """Refuse mixing integer and float values where the tokens would depend on it.

        Raises:
            MixtureError: the sources' value kinds differ, ``values="check"``, and the tokenizer
                or a chunk transform depends on the scale of the values.
        """
        kinds = {s.name: _value_kind(ds) for s, ds in zip(self.sources, self.datasets, strict=True)}
        if len(set(kinds.values())) < 2 or self.values != "check" or self.presets:
            return
        from slafload.tokenizers.builtin import Geneformer, ScGPT

        if type(tokenizer) in (Geneformer, ScGPT) and not transforms:
            logger.info(
                "mixing value kinds %s: %s tokens depend only on each cell's order of values",
                kinds,
                tokenizer.name,
            )
            return
        raise MixtureError(
            f"the sources hold different kinds of values ({kinds}; integer: counts, float: "
            f"e.g. log-normalised) and the {getattr(tokenizer, 'name', tokenizer)!r} tokenizer "
            f"or the loader's chunk transforms depend on their scale. Pass "
            "Mixture(values='log1p') to normalise every integer source per cell and log1p it, "
            "give each Source its own transforms=, or values='as_is' to mix them knowingly."
        )

    # -- construction ------------------------------------------------------------------------

    def _check_sources(self) -> None:
        names = self.source_names
        if len(set(names)) != len(names):
            raise MixtureError(f"source names repeat: {list(names)}; give each Source a name=")
        for s in self.sources:
            if s.weight is not None and not (np.isfinite(s.weight) and s.weight > 0):
                raise MixtureError(f"source {s.name!r}: weight must be positive, got {s.weight!r}")

    def _vocabulary(self, vocabulary: Vocabulary | str | None, column: str) -> Vocabulary:
        genes = [_gene_names(ds, column) for ds in self.datasets]
        if isinstance(vocabulary, Vocabulary):
            return vocabulary
        if vocabulary == "union":
            seen = dict.fromkeys(g for names in genes for g in names)
            return Vocabulary(tuple(seen), source=f"union of {list(self.source_names)}")
        if vocabulary is not None:
            raise MixtureError(
                f"vocabulary must be a Vocabulary, 'union' or None, got {vocabulary!r}"
            )
        for name, names in zip(self.source_names[1:], genes[1:], strict=True):
            if names != genes[0]:
                raise VocabularyError(
                    f"source {name!r} has other genes than {self.source_names[0]!r}; pass "
                    "vocabulary= (a slafload.transforms.Vocabulary, or 'union') to map every "
                    "source into one gene vocabulary"
                )
        return Vocabulary(tuple(genes[0]), source=self.source_names[0])

    def _remaps(self, unknown: str, column: str) -> list[tuple[ChunkTransform, ...]]:
        out: list[tuple[ChunkTransform, ...]] = []
        for ds in self.datasets:
            mapping = self.vocabulary.mapping(ds, column=column, unknown=unknown)
            identity = np.array_equal(mapping, np.arange(len(mapping)))
            out.append(
                () if identity else (self.vocabulary.remap(ds, column=column, unknown=unknown),)
            )
        return out

    def _value_transforms(self, ds: SlafDataset, target_sum: float) -> tuple[ChunkTransform, ...]:
        if self.values == "log1p" and _value_kind(ds) == "integer":
            return (LogNormalize(target_sum),)
        return ()

    def __repr__(self) -> str:
        mode = "one_pass" if self.epoch_cells is None else f"epoch_cells={self.epoch_cells}"
        vocab = self._options["vocabulary"]
        vocab = f"{len(vocab)} genes" if isinstance(vocab, Vocabulary) else repr(vocab)
        genes = f"preset={self.presets[0].name!r}" if self.presets else f"vocabulary={vocab}"
        return f"Mixture({self.uri}, n_cells={self.n_cells:,}, {genes}, {mode}, mix={self.mix})"


def _reopen(sources: Sequence[Source], pins: list, options: dict, presets: tuple) -> Mixture:
    opened = [
        dataclasses.replace(s, dataset=open_dataset(s.dataset, version=dict(v), storage_options=o))  # type: ignore[arg-type]
        for s, (v, o) in zip(sources, pins, strict=True)
    ]
    return Mixture(opened, **options).with_presets(presets)


def _default_name(uri: str) -> str:
    name = PurePosixPath(str(uri).rstrip("/")).name
    return name[: -len(".slaf")] if name.endswith(".slaf") else name


def _value_kind(ds: SlafDataset) -> str:
    return "float" if pa.types.is_floating(ds.value_type) else "integer"


def open_source(
    dataset: DatasetLike | Mixture | Sequence[DatasetLike | Source],
    *,
    weights: Sequence[float] | None = None,
    vocabulary: Vocabulary | str | None = None,
) -> SlafDataset | Mixture:
    """What a loader reads: an opened dataset, or a mixture (a list of datasets becomes one).

    Raises:
        TypeError: ``weights`` or ``vocabulary`` given with a single dataset.
    """
    if isinstance(dataset, (list, tuple)):
        return Mixture(dataset, weights=weights, vocabulary=vocabulary)
    if weights is not None or vocabulary is not None:
        raise TypeError(
            "weights= and vocabulary= mix several datasets: pass a list of datasets, or a "
            "Mixture (to align one dataset to a vocabulary, use transforms=[vocab.remap(ds)])"
        )
    if isinstance(dataset, (SlafDataset, Mixture)):
        return dataset
    return open_dataset(cast("str | os.PathLike[str]", dataset))
