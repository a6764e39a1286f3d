"""The loader, the front end a training loop iterates.

``Loader`` opens the dataset, resolves the tokenizer, sampler, rank and device, and runs the
rank's :class:`~slafload.pipeline.epochs.Run` (which builds the chain of stages of each epoch,
:mod:`slafload.pipeline.chain`) on one prefetch thread, handing out dicts of torch tensors. ``n_epochs``
counts the epochs of the whole run (``None``: endless): each ``iter(loader)`` continues where
the consumer stopped and ends with epoch ``n_epochs - 1``, so a loader resumed from a
checkpoint delivers exactly what the uninterrupted run had left, and iterating a loader whose
run is complete yields nothing. The position is updated only when a batch is *handed to the consumer*, so batches
the producer had prefetched are produced again after ``close()`` or a break, never lost.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import torch

from slafload.config import LoaderConfig, check_settings
from slafload.data.dataset import SlafDataset
from slafload.data.mixture import Mixture, open_source
from slafload.distributed import resolve_rank
from slafload.errors import LayoutError, MixtureError, StateError
from slafload.pipeline import epochs
from slafload.pipeline.epochs import Delivery, Position
from slafload.pipeline.prefetcher import Prefetcher
from slafload.presets import PRESET_NAMES, Preset, make_preset, mixture_preset
from slafload.samplers import ChunkShuffle, Streaming, bind_batch_size
from slafload.tokenizers import make_tokenizer
from slafload.tokenizers.builtin import token_budget
from slafload.torch_data import SlafIterableDataset
from slafload.transforms.vocab import Vocabulary
from slafload.types import CellSource, ChunkTransform, LoaderBatch, Sampler, Tokenizer

logger = logging.getLogger(__name__)


class Loader:
    """Streams tokenized cells from a SLAF dataset as dicts of torch tensors.

    Args:
        dataset: An opened :class:`SlafDataset`, or a path/URI to open; or several, as a
            list or a :class:`~slafload.data.mixture.Mixture`, streamed as one mixed stream (see
            docs/mixtures.md): batches then carry ``source`` codes (names in
            :attr:`source_names`) and ``cell_integer_id`` within each source.
        weights: With a list of datasets: one positive weight per dataset (default: sizes).
        vocabulary: With a list of datasets: the shared gene
            :class:`~slafload.transforms.vocab.Vocabulary`, or ``"union"``.
        tokenizer: ``"geneformer"``, ``"scgpt"``, ``"raw"``, ``"sparse"`` (CSR batches of
            each cell's whole expression; ``layout="packed"`` by default, no ``max_genes``:
            :mod:`slafload.tokenizers.sparse`), a plugin name, or an instance;
            or a published model's preset (:mod:`slafload.presets`): a :class:`Preset`, or
            ``"geneformer-v2"``, ``"geneformer-v1"``, ``"scgpt-reference"`` built from
            ``tokenizer_options`` (its dictionary files; ``seed`` defaults to the loader's).
            A preset's transforms run before ``transforms``. A mixture takes a preset by
            name: it is built for every source (:func:`~slafload.presets.mixture_preset`).
        tokenizer_options: Extra keyword arguments for a named tokenizer (e.g. ``n_bins``).
        sampler: Plan of cells per epoch; defaults to :class:`ChunkShuffle` or
            :class:`Streaming` according to ``shuffle``.
        device: Move batches there (``non_blocking`` when pinned), e.g. ``"cuda"``.
        pin_memory: Pin batches in the producer thread; default: when ``device`` is CUDA.
        transforms: Chunk transforms run before ranking (e.g. per-gene normalisation).
        obs_columns: Obs columns added to every batch as ``int64`` codes aligned with the
            cells; ``loader.obs_categories[name]`` maps codes back to categories.
        **settings: Fields of :class:`LoaderConfig` (``batch_size``, ``max_genes``, ``seed``,
            ``n_epochs``, ``shuffle``, ``drop_last``, ``chunk_cells``, ``layout``...), and
            ``tuning``, a :class:`~slafload.config.Tuning` of resource limits and read tuning
            (``queue_depth``, ``read_ahead``, ``memory_budget``...). A setting of slafload 0.1
            that moved into :class:`~slafload.config.Tuning` or was removed raises
            ``TypeError`` naming its replacement.

    Each batch (a :class:`~slafload.types.PaddedBatch`, or with ``layout="packed"`` a
    :class:`~slafload.types.PackedBatch`) holds the tokenizer's arrays (``input_ids``,
    ``attention_mask``, ...) and ``cell_integer_id``; ``layout="longest"`` pads them only to the batch's longest cell and
    ``layout="packed"`` puts every cell's tokens back to back with ``cu_seqlens`` and
    ``position_ids`` (see :mod:`slafload.pipeline.layout`). ``tokenize_on="device"`` ships each
    batch's sparse expression instead and tokenizes it on ``device`` in ``next()``, with
    identical results (see :mod:`slafload.pipeline.device_tokenize`). Use as an iterable, and
    ``close()`` it or use ``with``.
    """

    def __init__(
        self,
        dataset: SlafDataset | Mixture | str | os.PathLike[str] | Sequence[Any],
        *,
        weights: Sequence[float] | None = None,
        vocabulary: Vocabulary | str | None = None,
        tokenizer: str | Tokenizer | Preset = "geneformer",
        tokenizer_options: Mapping[str, Any] | None = None,
        sampler: Sampler | None = None,
        device: str | torch.device | None = None,
        pin_memory: bool | None = None,
        transforms: Sequence[ChunkTransform] = (),
        obs_columns: Sequence[str] = (),
        rank: int | None = None,
        world_size: int | None = None,
        **settings: Any,
    ):
        check_settings(settings)
        # A tokenizer taking no budget (`sparse`) makes CSR batches of every gene: packed by
        # default (another layout is refused), and no max_genes unless the user sets one.
        if not token_budget(tokenizer, 1):
            settings = {"layout": "packed", **settings}
        self.config = LoaderConfig(**settings)
        self.dataset: CellSource = open_source(dataset, weights=weights, vocabulary=vocabulary)
        mixture = isinstance(self.dataset, Mixture)
        named_preset = isinstance(tokenizer, str) and tokenizer in PRESET_NAMES
        if mixture and isinstance(tokenizer, Preset):
            raise MixtureError(
                f"the preset {tokenizer.name!r} was built for one dataset; for a mixture pass "
                "its name (e.g. tokenizer='geneformer-v2') with tokenizer_options, and the "
                "loader builds it for every source"
            )
        if named_preset:
            preset_options = {"seed": self.config.seed, **(tokenizer_options or {})}
            if isinstance(self.dataset, Mixture):  # the preset built for each source
                self.dataset, tokenizer = mixture_preset(
                    cast(str, tokenizer), self.dataset, **preset_options
                )
            else:
                tokenizer = make_preset(cast(str, tokenizer), self.dataset, **preset_options)
            tokenizer_options = None
        if isinstance(tokenizer, Preset):  # a model's own tokenizer and its chunk transforms
            self.preset: Preset | None = tokenizer
            transforms = (*tokenizer.transforms, *transforms)
            tokenizer = tokenizer.tokenizer
        else:
            self.preset = None
        budget = {"max_genes": self.config.max_genes}
        if "max_genes" not in settings:
            budget = token_budget(tokenizer, self.config.max_genes)
        options = {**budget, **(tokenizer_options or {})}
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
        # Fetch factors count minibatches: the sampler plans for the loader's batch size.
        self.sampler = bind_batch_size(sampler, self.config.batch_size)
        self.device = torch.device(device) if device is not None else None
        cuda = self.device is not None and self.device.type == "cuda"
        self.pin_memory = cuda if pin_memory is None else pin_memory
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError(
                "pin_memory=True needs a CUDA device, and none is available; "
                "leave pin_memory unset or False on CPU-only machines"
            )
        reserved = {"cell_integer_id", *self.dataset.cell_columns()} & set(obs_columns)
        if reserved:
            raise ValueError(
                f"obs_columns may not include {sorted(reserved)}: every batch "
                "already carries cell_integer_id (and a mixture's, source)"
            )
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self._transforms = tuple(transforms)
        self._obs_columns = tuple(obs_columns)
        self.dataset.check_values(self.tokenizer, self._transforms)
        self._build_run()
        self._position = Position()
        self._active: _LoaderIterator | None = None

    def _build_run(self) -> None:
        self._run, self.obs_categories = epochs.build_run(
            self.dataset,
            self.tokenizer,
            self.config,
            self.sampler,
            transforms=self._transforms,
            obs_columns=self._obs_columns,
            pin_memory=self.pin_memory,
            rank=self.rank,
            world_size=self.world_size,
        )
        self._run.spec.tokens  # noqa: B018  (checks the tokenizer fits layout/tokenize_on now)

    # -- iteration -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[LoaderBatch]:
        self._close_active()
        self._active = _LoaderIterator(self)
        return self._active

    def __len__(self) -> int:
        """Batches this rank yields in one full epoch (the same on every rank)."""
        return self._run.batches_in_epoch(self._position.epoch)

    @property
    def source_names(self) -> tuple[str, ...] | None:
        """A mixture's source names, indexed by the batches' ``source`` codes; else ``None``."""
        return self.dataset.source_names

    @property
    def position(self) -> Position:
        """Epoch, and cells of it handed to this rank's consumer so far."""
        return self._position

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What the consumer has received, as a small JSON-serializable dict.

        Prefetched batches the consumer has not taken are not counted: after
        :meth:`load_state_dict` they are produced again, so nothing is lost or repeated. The
        schema is :func:`slafload.pipeline.epochs.make_state`'s.
        """
        return epochs.make_state(self._run, self._position)

    def load_state_dict(self, state: Mapping[str, Any], *, replan: bool = False) -> None:
        """Continue from ``state`` (possibly taken on another number of ranks).

        The dataset is re-pinned to the Lance versions recorded in the state. Nothing changes
        if the state is refused. ``replan=True`` accepts a state taken with settings that
        order cells differently (a mixture's added source or changed weight): the loader
        then starts the next epoch not yet begun, under its own plan.

        Raises:
            StateError: the state is malformed, is a DataLoader worker's, or was taken with
                settings that change the order of cells (sampler, seed, dataset size, a
                mixture's sources or weights) and ``replan`` is false.
        """
        state = epochs.upgrade(state)
        if state[epochs.N_WORKERS] != 1:
            raise StateError(
                "the state is a DataLoader worker's (each worker counts its own cells); "
                "load it into the dataset from loader.as_torch_dataset() instead"
            )
        dataset = self.dataset.repin(state[epochs.DATASET][epochs.VERSIONS])
        previous = self.dataset, self._run, self.obs_categories
        self.dataset = dataset
        self._build_run()
        try:
            position = epochs.read_state(state, self._run, replan=replan)
        except StateError:
            self.dataset, self._run, self.obs_categories = previous
            raise
        self._close_active()
        self._position = position

    def as_torch_dataset(self) -> SlafIterableDataset:
        """This loader as a ``torch.utils.data.IterableDataset`` (see :mod:`slafload.torch_data`).

        A mixture's worker copies reopen each source at its pinned versions.

        Raises:
            LayoutError: the loader tokenizes on the device (``tokenize_on="device"``), which
                only the training process can do; DataLoader workers are other processes.
        """
        if self.config.tokenize_on == "device":
            raise LayoutError(
                "tokenize_on='device' tokenizes on the training thread's device, which "
                "DataLoader worker processes cannot reach; iterate the Loader itself, or use "
                "tokenize_on='producer' with as_torch_dataset()"
            )
        return SlafIterableDataset(
            uri=self.dataset.uri,
            versions=self.dataset.versions,
            storage_options=self.dataset.storage_options,
            sampler=self.sampler,
            tokenizer=self.tokenizer,
            config=self.config,
            rank=self.rank,
            world_size=self.world_size,
            transforms=self._transforms,
            obs_columns=self._obs_columns,
            epoch=self._position.epoch,
            mixture=self.dataset if isinstance(self.dataset, Mixture) else None,
        )

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


class _LoaderIterator(Iterator[LoaderBatch]):
    """The thin consumer side: takes deliveries, moves them to the device, tracks position."""

    def __init__(self, loader: Loader):
        self._loader = weakref.ref(loader)
        start, run = loader.position, loader._run
        self._prefetcher: Prefetcher[Delivery] = Prefetcher(
            lambda stop: run.run(start, sleep=stop.wait),  # a retry backoff ends on close()
            depth=loader.config.tuning.queue_depth,
        )
        self._device = loader.device
        self._non_blocking = loader.pin_memory
        self._consume = run.spec.tokens.consume  # device move (and device-side tokenizing)
        # Stops the thread if this iterator is dropped without close() (e.g. after `break`).
        self._finalizer = weakref.finalize(self, self._prefetcher.close)

    def __next__(self) -> LoaderBatch:
        delivery = next(self._prefetcher)
        loader = self._loader()
        if loader is not None:
            loader._position = delivery.after
        batch = self._consume(delivery.batch, self._device, self._non_blocking)
        return cast(LoaderBatch, batch)  # the layout's keys (types.PaddedBatch, PackedBatch)

    def close(self) -> None:
        self._finalizer()
