"""Exception classes raised by slafload.

Every error says what was wrong, where, and what to do. Dataset problems subclass
:class:`DatasetError`; problems while streaming subclass :class:`LoaderError`.
"""

from __future__ import annotations


class SlafloadError(Exception):
    """Base class of every error slafload raises on purpose."""


class DatasetError(SlafloadError, ValueError):
    """A SLAF dataset is missing, malformed or inconsistent."""


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """The dataset path or one of its files does not exist."""


class ConfigError(DatasetError):
    """``config.json`` is missing, unreadable or disagrees with the tables."""


class MissingTableError(DatasetError):
    """One of the three Lance tables of the SLAF layout is missing or cannot be opened."""


class CorruptDataError(DatasetError):
    """A data file of a table is damaged (truncated, overwritten or undecodable); the
    message names the file and its rows. Unlike :class:`MissingTableError`, the file is
    there: restore it from a copy or rewrite the dataset (``slafload verify`` lists them all).
    """


class SchemaError(DatasetError):
    """A table lacks a required column or a column has the wrong type."""


class InconsistentDataError(DatasetError):
    """The tables disagree with each other (ordering, offsets, counts, value ranges)."""


class LanceVersionError(DatasetError):
    """The installed pylance cannot read a table's Lance file format (written by another
    pylance release): not damage to the data.
    """


class VocabularyError(SlafloadError, ValueError):
    """A vocabulary file is malformed, or a dataset's genes do not fit a vocabulary."""


class MixtureError(SlafloadError, ValueError):
    """A mixture of datasets is misconfigured (sources, weights, value types)."""


class MediansError(SlafloadError, ValueError):
    """A medians file is malformed, or medians do not fit the dataset they are used with."""


class LoaderError(SlafloadError, RuntimeError):
    """Streaming failed in a way that is not a property of the dataset itself."""


class ReadError(LoaderError):
    """Reading a fetch from storage failed; the message names the fetch and cell ranges."""


class StateError(LoaderError, ValueError):
    """A ``state_dict`` does not fit the loader it is loaded into."""


class LayoutError(SlafloadError, ValueError):
    """A tokenizer cannot be used with the requested ``layout`` or ``tokenize_on``."""


class ReaderFallbackWarning(UserWarning):
    """A table (or one of its data files) is read through Lance's ``take_scan`` instead of
    slafload's direct data-file path: exact, but each scattered range costs more.
    """
