"""Stage 9: the loader, the only place that knows epochs, positions and devices.

``Loader`` wires the stages together (dataset -> sampler -> reader -> chunk -> shuffle ->
rank -> tokenize -> batch -> prefetch) and hands out dicts of torch tensors. Each
``iter(loader)`` runs ``n_epochs`` epochs (``None``: forever) starting where the consumer
stopped: the position is updated only when a batch is *handed to the consumer*, so batches
the producer had prefetched are produced again after ``close()`` or a break, never lost.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from slafload.config import LoaderConfig
from slafload.dataset import SlafDataset, open_dataset
from slafload.pipeline import Batch, ChunkTransform, Delivery, Pipeline, Position
from slafload.prefetcher import Prefetcher
from slafload.samplers import ChunkShuffle, Sampler, Streaming
from slafload.tokenizers import Tokenizer, make_tokenizer

logger = logging.getLogger(__name__)


class Loader:
    """Streams tokenized cells from a SLAF dataset as dicts of torch tensors.

    Args:
        dataset: An opened :class:`SlafDataset`, or a path/URI to open.
        tokenizer: ``"geneformer"``, ``"scgpt"``, ``"raw"``, a plugin name, or an instance.
        tokenizer_options: Extra keyword arguments for a named tokenizer (e.g. ``n_bins``).
        sampler: Plan of cells per epoch; defaults to :class:`ChunkShuffle` or
            :class:`Streaming` according to ``shuffle``.
        device: Move batches there (``non_blocking`` when pinned), e.g. ``"cuda"``.
        pin_memory: Pin batches in the producer thread; default: when ``device`` is CUDA.
        transforms: Chunk transforms run before ranking (e.g. per-gene normalisation).
        obs_columns: Obs columns added to every batch as ``int64`` codes aligned with the
            cells; ``loader.obs_categories[name]`` maps codes back to categories.
        **settings: Fields of :class:`LoaderConfig` (``batch_size``, ``max_genes``, ``seed``,
            ``n_epochs``, ``shuffle``, ``drop_last``, ``chunk_cells``, ``queue_depth``...).

    Each batch holds the tokenizer's arrays (``input_ids``, ``attention_mask``, ...) and
    ``cell_integer_id``. Use as an iterable, and ``close()`` it or use ``with``.
    """

    def __init__(
        self,
        dataset: SlafDataset | str | os.PathLike[str],
        *,
        tokenizer: str | Tokenizer = "geneformer",
        tokenizer_options: Mapping[str, Any] | None = None,
        sampler: Sampler | None = None,
        device: str | torch.device | None = None,
        pin_memory: bool | None = None,
        transforms: Sequence[ChunkTransform] = (),
        obs_columns: Sequence[str] = (),
        **settings: Any,
    ):
        unknown = set(settings) - set(LoaderConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(
                f"Loader got unknown settings {sorted(unknown)}; allowed: "
                f"{sorted(LoaderConfig.__dataclass_fields__)}"
            )
        self.config = LoaderConfig(**settings)
        self.dataset = dataset if isinstance(dataset, SlafDataset) else open_dataset(dataset)
        options = {"max_genes": self.config.max_genes, **(tokenizer_options or {})}
        self.tokenizer = (
            make_tokenizer(tokenizer, **options)
            if isinstance(tokenizer, str)
            else make_tokenizer(tokenizer)
        )
        if sampler is None:
            kind = ChunkShuffle if self.config.shuffle else Streaming
            sampler = kind(chunk_cells=self.config.chunk_cells)
        elif not isinstance(sampler, Sampler):
            raise TypeError(
                f"sampler must implement plan(n_cells, *, seed, epoch), got "
                f"{type(sampler).__name__}"
            )
        self.sampler = sampler
        self.device = torch.device(device) if device is not None else None
        cuda = self.device is not None and self.device.type == "cuda"
        self.pin_memory = cuda if pin_memory is None else pin_memory
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError(
                "pin_memory=True needs a CUDA device, and none is available; "
                "leave pin_memory unset or False on CPU-only machines"
            )
        reserved = {"cell_integer_id"} & set(obs_columns)
        if reserved:
            raise ValueError(
                f"obs_columns may not include {sorted(reserved)}: every batch "
                "already carries cell_integer_id"
            )
        codes = {name: self.dataset.obs_codes(name) for name in obs_columns}
        self.obs_categories = {name: cats for name, (_, cats) in codes.items()}
        self._pipeline = Pipeline(
            self.dataset,
            self.sampler,
            self.tokenizer,
            self.config,
            pin_memory=self.pin_memory,
            transforms=tuple(transforms),
            obs={name: c for name, (c, _) in codes.items()},
        )
        self._position = Position()
        self._active: _LoaderIterator | None = None

    # -- iteration -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        self._close_active()
        self._active = _LoaderIterator(self)
        return self._active

    def __len__(self) -> int:
        """Batches in one full epoch."""
        n = self.sampler.plan(self.dataset.n_cells, seed=self.config.seed, epoch=0).n_cells
        bs = self.config.batch_size
        return n // bs if self.config.drop_last else -(-n // bs)

    @property
    def position(self) -> Position:
        """Epoch and cells of that epoch handed to the consumer so far."""
        return self._position

    # -- lifecycle -------------------------------------------------------------------------

    def _close_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def close(self) -> None:
        """Stop the producer thread and wait for it. The loader can be iterated again."""
        self._close_active()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Loader({self.dataset.uri!r}, tokenizer={self.tokenizer.name!r}, "
            f"sampler={self.sampler!r}, {self.config})"
        )


class _LoaderIterator(Iterator[Batch]):
    """The thin consumer side: takes deliveries, moves them to the device, tracks position."""

    def __init__(self, loader: Loader):
        self._loader = weakref.ref(loader)
        start, pipeline = loader.position, loader._pipeline
        self._prefetcher: Prefetcher[Delivery] = Prefetcher(
            lambda: pipeline.run(start), depth=loader.config.queue_depth
        )
        self._device = loader.device
        self._non_blocking = loader.pin_memory
        # Stops the thread if this iterator is dropped without close() (e.g. after `break`).
        self._finalizer = weakref.finalize(self, self._prefetcher.close)

    def __next__(self) -> Batch:
        delivery = next(self._prefetcher)
        loader = self._loader()
        if loader is not None:
            loader._position = delivery.after
        batch = delivery.batch
        if self._device is not None and self._device.type != "cpu":
            batch = {
                k: v.to(self._device, non_blocking=self._non_blocking) for k, v in batch.items()
            }
        return batch

    def close(self) -> None:
        self._finalizer()
