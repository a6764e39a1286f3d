"""What a dataset's expression values are: counts, other numbers, or not known.

Presets that normalise (Geneformer's ``count / n_counts * 10_000 / median``, scGPT's
``normalize_total`` + ``log1p``) expect raw counts; fed values that were normalised already,
they normalise them again without a word. ``slafload convert`` therefore records the kind
in ``config.json`` under :data:`CONFIG_KEY`: ``"counts"`` (every value a non-negative integer)
or ``"non-integer"``. Datasets without the record (older converters, slafdb's) are decided
from their value type alone, with no scan: an integer type holds counts; float values are
``"unknown"``, and nothing warns about them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

logger = logging.getLogger(__name__)

CONFIG_KEY = "value_kind"
COUNTS, NON_INTEGER, UNKNOWN = "counts", "non-integer", "unknown"


@dataclass(frozen=True)
class ValueKind:
    """A dataset's value kind (:data:`COUNTS`, :data:`NON_INTEGER` or :data:`UNKNOWN`), and
    how it was decided (``source``, a phrase for messages).
    """

    kind: str
    source: str

    def __str__(self) -> str:
        return f"{self.kind} ({self.source})"


def value_kind(dataset: Any) -> ValueKind:
    """The kind of ``dataset``'s values (a :class:`~slafload.data.dataset.SlafDataset`): its
    ``config.json`` record, else what its value type says.
    """
    recorded = dataset.config.get(CONFIG_KEY)
    if recorded in (COUNTS, NON_INTEGER):
        return ValueKind(recorded, "recorded in config.json")
    if pa.types.is_integer(dataset.value_type):
        return ValueKind(COUNTS, f"{dataset.value_type} values; not recorded in config.json")
    return ValueKind(UNKNOWN, f"{dataset.value_type} values; not recorded in config.json")


def value_range(dataset: Any) -> tuple[float, float] | None:
    """``(min, max)`` of the stored values as ``config.json`` records them (slafdb's and
    slafload's writers do, under ``metadata.expression_stats``), or ``None``.
    """
    stats = (dataset.config.get("metadata") or {}).get("expression_stats") or {}
    lo, hi = stats.get("min_value"), stats.get("max_value")
    if isinstance(lo, int | float) and isinstance(hi, int | float):
        return float(lo), float(hi)
    return None


def warn_unless_counts(dataset: Any, user: str, way_out: str) -> None:
    """Log a warning when ``dataset``'s values are known not to be counts.

    Args:
        dataset: The dataset about to be loaded.
        user: What expects counts, for the message (``"preset 'scgpt-reference'"``).
        way_out: What the user can do instead.
    """
    kind = value_kind(dataset)
    if kind.kind == NON_INTEGER:
        logger.warning(
            "%s expects raw counts, but the values of %r are not counts (%s, %s), e.g. "
            "already normalised or log-transformed: they would be normalised again; %s",
            user, dataset.uri, kind.kind, kind.source, way_out,
        )  # fmt: skip
