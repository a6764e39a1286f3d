"""``slafload cache``: copy a SLAF dataset from an object store to local storage, resumably.

For users who would rather stage an atlas on local NVMe than train from the bucket
(docs/object-storage.md). Every file under the URI is copied to the same relative path under
the local directory, by range reads of :data:`PIECE` bytes appended to ``NAME.part``, renamed
to ``NAME`` once whole; ``config.json`` last, so a directory holding it holds every table. An
interrupted copy is resumed where it stopped: a ``.part`` file
continues from its size, and a file already there whole is skipped where Lance never rewrites
it (data, manifest, deletion, transaction and index files: each version writes new ones);
the small files that may change (``config.json``, version hints) are copied again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from slafload._lance.object_store import s3_filesystem, supported
from slafload.errors import ConfigError, DatasetNotFoundError
from slafload.tools.progress import progress_bar

logger = logging.getLogger(__name__)

PIECE = 8 << 20  # bytes a range read copies (what an interrupted copy loses at most)
IMMUTABLE = {"data", "_versions", "_deletions", "_transactions", "_indices"}


@dataclass(frozen=True)
class CacheReport:
    """What :func:`cache` did: files listed, copied (whole or resumed) and skipped (already
    there whole), and the bytes it copied.
    """

    files: int
    copied: int
    skipped: int
    bytes: int


def cache(
    uri: str,
    path: str | os.PathLike,
    *,
    storage_options: Mapping[str, str] | None = None,
    progress: bool = True,
) -> CacheReport:
    """Copy the SLAF dataset at ``uri`` (``s3://bucket/atlas.slaf``) to the local directory
    ``path``, resuming an interrupted copy (see the module docstring); open the copy with
    :func:`slafload.open_dataset` as usual.

    Raises:
        ConfigError: ``uri`` is not an ``s3://`` URI.
        DatasetNotFoundError: there is no ``config.json`` under ``uri``.
    """
    if not supported(uri):
        raise ConfigError(
            f"slafload cache copies from s3:// URIs, got {uri!r}. Copy other stores with "
            "their own tools (gsutil, azcopy), then open the local directory."
        )
    fs = s3_filesystem(storage_options)
    root = uri[len("s3://") :].rstrip("/")
    files = sorted(
        (i for i in fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
         if i.type == pafs.FileType.File),
        key=lambda i: (i.path == f"{root}/config.json", i.path),  # config.json last
    )  # fmt: skip
    if not any(i.path == f"{root}/config.json" for i in files):
        raise DatasetNotFoundError(
            f"No SLAF dataset at {uri!r}: {uri}/config.json is missing. Pass the URI of the "
            "directory that holds config.json and the three .lance tables."
        )
    bar = progress_bar(progress, sum(i.size for i in files), "cache", unit="B")
    copied = skipped = moved = 0
    try:
        for info in files:
            dest = Path(path, info.path[len(root) + 1 :])
            whole = dest.exists() and dest.stat().st_size == info.size
            if whole and not mutable(dest.relative_to(path).as_posix()):
                skipped += 1
                if bar is not None:
                    bar.update(info.size)
                continue
            moved += _copy(fs, info, dest, bar)
            copied += 1
    finally:
        if bar is not None:
            bar.close()
    logger.info("cached %s in %s: %d files copied, %d already there", uri, path, copied, skipped)
    return CacheReport(len(files), copied, skipped, moved)


def mutable(relative: str) -> bool:
    """Whether Lance may rewrite the file at ``relative`` (to the dataset) in place: anything
    but data, manifest, deletion, transaction and index files (a JSON version hint too).
    """
    parts = relative.split("/")
    return not IMMUTABLE & set(parts[:-1]) or parts[-1].endswith(".json")


def _copy(fs: pafs.FileSystem, info: pafs.FileInfo, dest: Path, bar: object | None) -> int:
    """Copy one file to ``dest`` through ``dest.part`` (continued from its size); the bytes
    copied now.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    if have > info.size:  # not a piece of this file
        have = 0
    if bar is not None and have:
        bar.update(have)  # type: ignore[attr-defined]
    with fs.open_input_file(info.path) as src, open(part, "ab" if have else "wb") as out:
        at = have
        while at < info.size:
            data = src.read_at(min(PIECE, info.size - at), at)
            if not data:
                raise OSError(f"{info.path} ended at byte {at} of {info.size}")
            out.write(data)
            at += len(data)
            if bar is not None:
                bar.update(len(data))  # type: ignore[attr-defined]
    os.replace(part, dest)
    return info.size - have
