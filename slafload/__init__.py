"""slafload: stream single-cell expression from SLAF datasets to GPU-ready token batches.

The package reads like the pipeline, one module per stage (the chain is built in
:mod:`slafload.chain`, epochs and resume live in :mod:`slafload.epochs`)::

    dataset -> samplers -> partition -> read (reader) -> chunk -> ranking -> tokenize
            -> batcher (layout) -> prefetcher -> loader

Contracts between stages are in :mod:`slafload.types`. Add-ons plug in at two points:
:mod:`slafload.transforms` (chunk transforms, before ranking) and :mod:`slafload.tokenizers`
(after ranking; published models' presets in :mod:`slafload.presets`). Offline tools
(conversion, synthetic atlases, benchmarks, the CLI) live apart in :mod:`slafload.tools`.
"""

from typing import TYPE_CHECKING, Any

from slafload import diversity, samplers, synthetic
from slafload.config import LoaderConfig, RetryPolicy
from slafload.dataset import SlafDataset, open_dataset
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
from slafload.mixture import Mixture, Source
from slafload.tokenizers import Geneformer, Raw, ScGPT, Tokenizer, available_tokenizers
from slafload.tools.convert import convert

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
    "LoaderConfig",
    "LoaderError",
    "MediansError",
    "MissingTableError",
    "Mixture",
    "MixtureError",
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
    "VocabularyError",
    "__version__",
    "available_tokenizers",
    "convert",
    "diversity",
    "open_dataset",
    "samplers",
    "synthetic",
]
