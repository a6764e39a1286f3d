"""slafload: stream single-cell expression from SLAF datasets to GPU-ready token batches.

The package is laid out by role (``docs/pipeline.md`` follows one batch through twelve
modules, from ``Loader(...)`` to the training loop)::

    loader.py       Loader: the front end a training loop iterates; knows epochs and resume
    torch_data.py   SlafIterableDataset: the face for code built around DataLoader
    config.py       LoaderConfig, Tuning, RetryPolicy
    errors.py       every exception class
    types.py        the contracts between stages (Fetch, Plan, Chunk, RankedChunk...) and
                    the batches a training loop receives (PaddedBatch, PackedBatch)
    kernels.py      compiled (numba) per-cell loops, numpy otherwise; warm_up()
    distributed.py  rank and world size, found without communication
    data/           open and validate a dataset (dataset), its cell offsets, mixtures
    samplers/       which cells in which order: a plan of fetches per epoch
    pipeline/       the producer's stages, built in order by pipeline.chain:
                    partition -> read (reader) -> chunk -> tokenize (the token stage:
                    ranking, batcher, layout) -> batcher (to torch) -> prefetcher;
                    pipeline.epochs plans runs and positions
    transforms/     chunk transforms, before ranking (vocabularies, normalisation)
    tokenizers/     the built-in tokenizers and the plugin protocol, after ranking
    presets/        published models' own tokens (Geneformer, scGPT)
    _lance/         private: Lance data files read without Lance's decoder
    tools/          offline: conversion, synthetic atlases, benchmarks, the CLI
    diversity.py, synthetic.py   public faces of tools.diversity and tools.synthetic
"""

from typing import TYPE_CHECKING, Any

from slafload import diversity, samplers, synthetic
from slafload.config import LoaderConfig, RetryPolicy, Tuning
from slafload.data.dataset import SlafDataset, open_dataset
from slafload.data.mixture import Mixture, Source
from slafload.errors import (
    ConfigError,
    CorruptDataError,
    DatasetError,
    DatasetNotFoundError,
    InconsistentDataError,
    LoaderError,
    MediansError,
    MissingTableError,
    MixtureError,
    ReadError,
    SchemaError,
    SlafloadError,
    StateError,
    VocabularyError,
)
from slafload.tokenizers import Geneformer, Raw, ScGPT, Tokenizer, available_tokenizers
from slafload.tools.convert import convert
from slafload.types import LoaderBatch, PackedBatch, PaddedBatch

__version__ = "0.1.0"

# torch takes seconds to import; only the loader needs it, so `slafload --help`, conversion and
# dataset inspection do not pay for it.
_LAZY = {"Loader": "slafload.loader", "SlafIterableDataset": "slafload.torch_data"}
if TYPE_CHECKING:
    from slafload.loader import Loader
    from slafload.torch_data import SlafIterableDataset


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'slafload' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "CorruptDataError",
    "DatasetError",
    "DatasetNotFoundError",
    "Geneformer",
    "InconsistentDataError",
    "Loader",
    "LoaderBatch",
    "LoaderConfig",
    "LoaderError",
    "MediansError",
    "MissingTableError",
    "Mixture",
    "MixtureError",
    "PackedBatch",
    "PaddedBatch",
    "Raw",
    "ReadError",
    "RetryPolicy",
    "ScGPT",
    "SchemaError",
    "SlafDataset",
    "SlafIterableDataset",
    "SlafloadError",
    "Source",
    "StateError",
    "Tokenizer",
    "Tuning",
    "VocabularyError",
    "__version__",
    "available_tokenizers",
    "convert",
    "diversity",
    "open_dataset",
    "samplers",
    "synthetic",
]
