"""slafload: stream single-cell expression from SLAF datasets to GPU-ready token batches.

The package reads like the pipeline, one module per stage::

    dataset -> samplers -> reader -> chunk -> rank -> tokenizers -> batcher -> prefetcher -> loader
"""

from slafload import diversity, samplers, synthetic
from slafload.config import LoaderConfig
from slafload.convert import convert
from slafload.dataset import SlafDataset, open_dataset
from slafload.errors import (
    ConfigError,
    DatasetError,
    DatasetNotFoundError,
    InconsistentDataError,
    LoaderError,
    MissingTableError,
    ReadError,
    SchemaError,
    SlafloadError,
    StateError,
)
from slafload.loader import Loader
from slafload.tokenizers import Geneformer, Raw, ScGPT, Tokenizer, available_tokenizers

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DatasetError",
    "DatasetNotFoundError",
    "Geneformer",
    "InconsistentDataError",
    "Loader",
    "LoaderConfig",
    "LoaderError",
    "MissingTableError",
    "Raw",
    "ReadError",
    "ScGPT",
    "SchemaError",
    "SlafDataset",
    "SlafloadError",
    "StateError",
    "Tokenizer",
    "__version__",
    "available_tokenizers",
    "convert",
    "diversity",
    "open_dataset",
    "samplers",
    "synthetic",
]
