"""Gene vocabularies: one token per gene name, shared by datasets with different gene orders.

A :class:`Vocabulary` is an ordered list of gene names; gene ``i`` of the vocabulary is
*vocabulary id* ``i`` and, through the built-in tokenizers, token ``i + GENE_OFFSET`` (4).
Build it from a dataset's ``genes.lance`` (:meth:`Vocabulary.from_dataset`), save it to a
JSON or TSV file and load it back (:meth:`Vocabulary.save`, :meth:`Vocabulary.load`).

To feed a dataset whose genes are stored in another order to a model trained on a vocabulary,
align it: :meth:`Vocabulary.remap` returns a :class:`GeneRemap`, a chunk transform that
rewrites every expression row's dataset gene id to its vocabulary id with one array lookup,
so the built-in tokenizers then emit vocabulary tokens::

    vocab = Vocabulary.load("vocab.json")
    Loader(ds, transforms=[vocab.remap(ds)])

Genes of the dataset that the vocabulary does not know follow the ``unknown`` rule:

``"drop"`` (default)
    their expression rows are removed, as Geneformer's tokenizer removes genes missing from
    its token dictionary; a cell's remaining genes keep their relative ranks.
``"unk"``
    they all map to one extra vocabulary id, ``len(vocab)`` (token ``len(vocab) + 4``); a
    model must then have ``len(vocab) + 1`` gene tokens. Each unknown gene stays a separate
    entry, so a cell may hold several UNK tokens.
``"error"``
    building the remap raises :class:`VocabularyError` naming the missing genes.

After remapping, each cell's rows are re-sorted by vocabulary id, so ranking breaks ties by
vocabulary id and the same cell stored in two gene orders yields identical tokens.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from slafload.data.dataset import SlafDataset
from slafload.errors import SchemaError, VocabularyError
from slafload.tokenizers import CLS, GENE_OFFSET, MASK, PAD, SEP
from slafload.types import Chunk

logger = logging.getLogger(__name__)

FORMAT = "slafload.vocabulary"
FORMAT_VERSION = 1
UNKNOWN_RULES = ("drop", "unk", "error")
_TSV_HEADER = "token_id\tgene"


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """An ordered list of unique gene names; gene ``genes[i]`` has vocabulary id ``i``.

    Attributes:
        genes: Gene names in vocabulary order.
        source: Where the vocabulary came from (a dataset URI or file), for messages only.
    """

    genes: tuple[str, ...]
    source: str = ""

    def __post_init__(self) -> None:
        genes = tuple(str(g) for g in self.genes)
        object.__setattr__(self, "genes", genes)
        if not genes:
            raise VocabularyError(f"vocabulary from {self.source or 'arguments'} has no genes")
        names, counts = np.unique(np.asarray(genes, dtype=object), return_counts=True)
        if (counts > 1).any():
            dup = names[counts > 1][:5].tolist()
            raise VocabularyError(
                f"vocabulary from {self.source or 'arguments'} repeats gene names {dup}; "
                "every gene name must be unique (pick a unique column such as gene_id)"
            )

    def __len__(self) -> int:
        return len(self.genes)

    @cached_property
    def index(self) -> dict[str, int]:
        """Gene name -> vocabulary id."""
        return {g: i for i, g in enumerate(self.genes)}

    @property
    def unk_id(self) -> int:
        """The vocabulary id unknown genes take under ``unknown="unk"``."""
        return len(self.genes)

    @property
    def special_tokens(self) -> dict[str, int]:
        """The special tokens' ids by name."""
        return {"PAD": PAD, "CLS": CLS, "SEP": SEP, "MASK": MASK}

    def token_ids(self, genes: list[str] | np.ndarray) -> np.ndarray:
        """Tokens (vocabulary id + 4) of gene names; ``-1`` for names not in the vocabulary."""
        ids = self.ids(genes)
        return np.where(ids >= 0, ids + GENE_OFFSET, -1)

    def ids(self, genes: list[str] | np.ndarray) -> np.ndarray:
        """``int64`` vocabulary ids of gene names; ``-1`` for names not in the vocabulary."""
        index = self.index
        return np.fromiter((index.get(str(g), -1) for g in genes), np.int64, count=len(genes))

    # -- construction and files ------------------------------------------------------------

    @classmethod
    def from_dataset(cls, dataset: SlafDataset, *, column: str = "gene_id") -> Vocabulary:
        """The dataset's genes in ``gene_integer_id`` order, named by ``column`` of genes.lance.

        Raises:
            SchemaError: ``genes.lance`` has no such column.
            VocabularyError: the column repeats a name.
        """
        return cls(tuple(_gene_names(dataset, column)), source=f"{dataset.uri!r}:{column}")

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the vocabulary; ``.tsv`` writes ``token_id<TAB>gene`` lines, else JSON."""
        path = Path(path)
        if path.suffix == ".tsv":
            lines = [_TSV_HEADER] + [f"{i + GENE_OFFSET}\t{g}" for i, g in enumerate(self.genes)]
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        else:
            doc = {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "special_tokens": self.special_tokens,
                "gene_offset": GENE_OFFSET,
                "genes": list(self.genes),
            }
            path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        logger.info("saved a vocabulary of %d genes to %s", len(self), path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Vocabulary:
        """Read a file written by :meth:`save` (format chosen by the ``.tsv`` suffix).

        Raises:
            VocabularyError: the file is malformed; the message names the file and line.
        """
        path = Path(path)
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".tsv":
            return cls(tuple(_parse_tsv(text, path)), source=str(path))
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise VocabularyError(f"{path} is not valid JSON ({exc}); rewrite it") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise VocabularyError(
                f"{path} is not a slafload vocabulary (expected a JSON object with "
                f"format={FORMAT!r}); write one with Vocabulary.save"
            )
        if doc.get("gene_offset", GENE_OFFSET) != GENE_OFFSET:
            raise VocabularyError(
                f"{path} uses gene_offset={doc['gene_offset']}, but slafload's tokenizers "
                f"put gene tokens at vocabulary id + {GENE_OFFSET}"
            )
        genes = doc.get("genes")
        if not isinstance(genes, list) or not all(isinstance(g, str) for g in genes):
            raise VocabularyError(f"{path}: 'genes' must be a list of gene-name strings")
        return cls(tuple(genes), source=str(path))

    # -- alignment -------------------------------------------------------------------------

    def mapping(
        self, dataset: SlafDataset, *, column: str = "gene_id", unknown: str = "drop"
    ) -> np.ndarray:
        """``int64[n_genes]``: the vocabulary id of each dataset gene id under ``unknown``.

        Unknown genes get ``-1`` (``"drop"``) or :attr:`unk_id` (``"unk"``).
        """
        if unknown not in UNKNOWN_RULES:
            raise ValueError(f"unknown must be one of {UNKNOWN_RULES}, got {unknown!r}")
        names = _gene_names(dataset, column)
        ids = self.ids(names)
        missing = np.flatnonzero(ids < 0)
        if len(missing):
            if unknown == "error":
                raise VocabularyError(
                    f"{len(missing)} of {len(names)} genes of {dataset.uri!r} (column "
                    f"{column!r}) are not in the vocabulary from {self.source or 'arguments'}, "
                    f"e.g. {[names[i] for i in missing[:5]]}; pass unknown='drop' or 'unk'"
                )
            logger.info(
                "%d of %d genes of %r are not in the vocabulary; rule %r",
                len(missing),
                len(names),
                dataset.uri,
                unknown,
            )
            if unknown == "unk":
                ids[missing] = self.unk_id
        return ids

    def remap(
        self, dataset: SlafDataset, *, column: str = "gene_id", unknown: str = "drop"
    ) -> GeneRemap:
        """A chunk transform putting ``dataset``'s genes into this vocabulary's ids."""
        return GeneRemap(self.mapping(dataset, column=column, unknown=unknown))


@dataclass(frozen=True, eq=False)
class GeneRemap:
    """Chunk transform: dataset gene ids -> ``mapping[gene]``, dropping genes mapped to -1.

    Vectorized over the chunk: one lookup, one boolean mask, one stable sort that restores
    the "genes ascending within a cell" order ranking relies on. Cells are kept (a cell whose
    genes are all dropped becomes an empty sentence).
    """

    mapping: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "mapping", np.asarray(self.mapping, dtype=np.int64))

    @cached_property
    def keeps_order(self) -> bool:
        """Whether the kept genes' vocabulary ids ascend with their dataset ids (e.g. a union
        vocabulary built from this dataset): then no cell needs re-sorting.
        """
        kept = self.mapping[self.mapping >= 0]
        return bool((np.diff(kept) > 0).all())

    def __call__(self, chunk: Chunk) -> Chunk:
        """The chunk with its gene ids mapped through the vocabulary."""
        if len(chunk.genes) and int(chunk.genes.max()) >= len(self.mapping):
            raise VocabularyError(
                f"chunk holds gene id {int(chunk.genes.max())} but the remap covers "
                f"{len(self.mapping)} genes; build it from the dataset being loaded"
            )
        genes, values, indptr = self.mapping[chunk.genes], chunk.values, chunk.indptr
        known = genes >= 0
        if not known.all():
            genes, values = genes[known], values[known]
            indptr = np.concatenate([[0], np.cumsum(known, dtype=np.int64)])[indptr]
        if self.keeps_order:
            return dataclasses.replace(chunk, indptr=indptr, genes=genes, values=values)
        # Cell-major, then vocabulary id: one int64 key sorts every cell's rows at once.
        cell = np.repeat(np.arange(chunk.n_cells, dtype=np.int64), np.diff(indptr))
        order = np.argsort(cell * (int(self.mapping.max()) + 1) + genes, kind="stable")
        return dataclasses.replace(chunk, indptr=indptr, genes=genes[order], values=values[order])


def _gene_names(dataset: SlafDataset, column: str) -> list[str]:
    if column not in dataset.genes.schema.names:
        raise SchemaError(
            f"genes.lance in {dataset.uri!r} has no column {column!r} "
            f"(columns: {dataset.genes.schema.names}); pass column= one of them"
        )
    var = dataset.var(["gene_integer_id", column]).sort("gene_integer_id")
    ids = var.get_column("gene_integer_id").to_numpy()
    if not np.array_equal(ids, np.arange(len(ids))):
        raise SchemaError(
            f"genes.lance in {dataset.uri!r}: gene_integer_id must be 0..n_genes-1 to align "
            "genes by name; rewrite the genes table"
        )
    return [str(g) for g in var.get_column(column).to_list()]


def _parse_tsv(text: str, path: Path) -> list[str]:
    lines = text.splitlines()
    if not lines or lines[0] != _TSV_HEADER:
        raise VocabularyError(f"{path}: the first line must be {_TSV_HEADER!r}")
    genes: list[str] = []
    for n, line in enumerate(lines[1:], start=2):
        token, _, gene = line.partition("\t")
        if not gene or token != str(len(genes) + GENE_OFFSET):
            raise VocabularyError(
                f"{path} line {n}: expected '{len(genes) + GENE_OFFSET}<TAB>gene', got {line!r}"
            )
        genes.append(gene)
    return genes
