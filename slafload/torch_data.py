"""A ``torch.utils.data.IterableDataset`` face, for code built around ``DataLoader``.

``Loader`` is the recommended interface (one producer thread, exact resume). When a training
stack insists on ``torch.utils.data.DataLoader``, ``loader.as_torch_dataset()`` returns an
``IterableDataset`` of ready batches: use ``DataLoader(ds, batch_size=None, num_workers=k,
multiprocessing_context="spawn")`` (Lance is not fork-safe). The rank's share of each epoch is
split among the ``k`` workers by parts, so every cell still comes exactly once per epoch.

Each worker process reopens the dataset at the loader's pinned Lance versions. Every iteration
advances the epoch counter of the object iterated: in-process, and in persistent workers
(``persistent_workers=True``), epochs therefore advance by themselves. Non-persistent workers
iterate fresh copies each epoch, so, as with ``DistributedSampler``, call ``set_epoch(e)``
before each epoch; it is harmless in the other cases.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from slafload.config import LoaderConfig
from slafload.dataset import open_dataset
from slafload.pipeline import Batch, ChunkTransform, Pipeline
from slafload.samplers import Sampler
from slafload.tokenizers import Tokenizer


class SlafIterableDataset(IterableDataset[Batch]):
    """Batches of one epoch per iteration, split among DataLoader workers.

    Built by :meth:`slafload.Loader.as_torch_dataset`; holds only picklable settings.
    """

    def __init__(
        self,
        *,
        uri: str,
        versions: Mapping[str, int],
        storage_options: Mapping[str, str] | None,
        sampler: Sampler,
        tokenizer: Tokenizer,
        config: LoaderConfig,
        rank: int,
        world_size: int,
        transforms: Sequence[ChunkTransform],
        obs_columns: Sequence[str],
        epoch: int = 0,
    ):
        super().__init__()
        self._settings: dict[str, Any] = {
            "uri": uri,
            "versions": dict(versions),
            "storage_options": dict(storage_options) if storage_options else None,
            "sampler": sampler,
            "tokenizer": tokenizer,
            "config": config,
            "rank": rank,
            "world_size": world_size,
            "transforms": tuple(transforms),
            "obs_columns": tuple(obs_columns),
        }
        self.epoch = epoch
        self._pipeline: Pipeline | None = None  # opened lazily, in the process that iterates

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` next (call before each epoch when using workers)."""
        self.epoch = int(epoch)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pipeline": None}

    def _open(self) -> Pipeline:
        if self._pipeline is None:
            s = self._settings
            ds = open_dataset(s["uri"], version=s["versions"], storage_options=s["storage_options"])
            obs = {name: ds.obs_codes(name)[0] for name in s["obs_columns"]}
            self._pipeline = Pipeline(
                ds,
                s["sampler"],
                s["tokenizer"],
                s["config"],
                rank=s["rank"],
                world_size=s["world_size"],
                transforms=s["transforms"],
                obs=obs,
            )
        return self._pipeline

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, n_workers = (0, 1) if info is None else (info.id, info.num_workers)
        pipeline = self._open()
        epoch = self.epoch
        self.epoch += 1  # in-process and persistent workers advance by themselves
        for delivery in pipeline.epoch(epoch, worker=worker, n_workers=n_workers):
            yield delivery.batch

    def __len__(self) -> int:
        bs = self._settings["config"].batch_size
        quota = self._open().stream(self.epoch, ()).quota
        return quota // bs if self._settings["config"].drop_last else -(-quota // bs)
