"""Where numba caches the kernels, and compiling them in a child process.

A loader's kernels compile in the background (:class:`slafload.kernels.Kernels`). Compiling
one in the loader's own process would hold its GIL for seconds and could not be abandoned:
``close()`` had to wait for it (20 s and more on a loaded machine). So a kernel that is not in
numba's on-disk cache is compiled by a child process (:func:`slafload.kernels.compile_child`), which
writes it to the cache; the loader's compile thread waits for the child, checking its stop
event, then loads the kernel from the cache in milliseconds. ``close()`` kills a child still
running: numba writes each cache file to a temporary name and renames it into place, so a
killed compile leaves at most a stray temporary file, never a torn entry.

Processes starting at once with one empty cache (the ranks of a node) share it: each child
takes an exclusive ``flock`` on a lock file in the cache directory before compiling, and
compiles only what is still missing once it holds it, so the node compiles each kernel once
and numba's index file (one per kernel, rewritten whole by every save) never loses an entry to
two writers. A killed child's lock is released by the kernel.

numba caches a kernel in the first writable place of: ``NUMBA_CACHE_DIR``, the package's
``__pycache__``, the user's cache directory (``~/.cache/numba``). Where none is writable (a
read-only install run by a user without a writable home, as in many containers), numba would
compile in every process; :func:`private_cache_dir` then points numba at a directory of this
user's own under the system's temporary directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_LOCK_NAME = "slafload-compile.lock"
_POLL_S = 0.05


class Abandoned(Exception):
    """A compile stopped because its loader closed (not a failure: nothing is reported)."""


def private_cache_dir(numba: Any) -> bool:
    """Point numba's cache at ``<tmp>/slafload-numba-<uid>`` (made private to this user);
    whether it did. Called when numba finds no writable place for slafload's kernels.

    A directory there that another user owns, or that others can write, is refused: numba
    loads machine code from its cache.
    """
    path = Path(tempfile.gettempdir()) / f"slafload-numba-{_uid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != _uid() or st.st_mode & 0o022:
            logger.warning("not caching kernels in %s: it is not this user's own directory", path)
            return False
        tempfile.TemporaryFile(dir=path).close()
    except OSError as exc:
        logger.warning("no writable place for numba's cache (%s); kernels compile each run", exc)
        return False
    numba.config.CACHE_DIR = str(path)
    logger.info("numba's cache for slafload's kernels: %s (nowhere else is writable)", path)
    return True


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def cache_path(dispatcher: Any) -> str | None:
    """The directory where numba caches ``dispatcher`` (``None`` if it does not cache)."""
    return getattr(getattr(dispatcher, "_cache", None), "_cache_path", None)


def is_cached(dispatcher: Any, signature: tuple) -> bool:
    """Whether numba's on-disk cache holds ``dispatcher`` compiled for ``signature``."""
    load = getattr(getattr(dispatcher, "_cache", None), "load_overload", None)
    if load is None:
        return False
    try:
        return load(signature, dispatcher.targetctx) is not None
    except Exception:  # an unreadable entry is a miss: the child compiles it again
        logger.debug("numba cache entry unreadable", exc_info=True)
        return False


def compile_outside(keys: list[tuple], stop: threading.Event) -> None:
    """Compile kernels ``keys`` (name, then numba argument types) into numba's cache in a
    child process; wait for it, killing it if ``stop`` is set.

    Raises:
        Abandoned: ``stop`` was set first (the child is killed and reaped).
        RuntimeError: the child failed; the message holds the end of its stderr.
        OSError: no child could be started (no ``sys.executable`` in an embedded Python).
    """
    if stop.is_set():
        raise Abandoned
    numba_config = sys.modules["numba"].config
    env = dict(os.environ)
    if numba_config.CACHE_DIR:
        env["NUMBA_CACHE_DIR"] = numba_config.CACHE_DIR
    # The child must import this very slafload (numba's cache is keyed by the source path).
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryFile() as err:
        child = subprocess.Popen(
            [sys.executable, "-c", "from slafload import kernels; kernels.compile_child()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            cwd=root,  # ``-m`` puts the working directory first on sys.path
        )
        try:
            assert child.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                child.stdin.write(pickle.dumps(keys))
                child.stdin.close()
            while True:
                try:
                    rc = child.wait(_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    if stop.is_set():
                        raise Abandoned from None
        finally:
            if child.returncode is None:
                child.kill()
                child.wait()
        if rc != 0:
            err.seek(0)
            tail = err.read()[-2000:].decode(errors="replace").strip()
            names = sorted({k[0] for k in keys})
            raise RuntimeError(f"the compiler process for {names} exited with {rc}: {tail}")


@contextlib.contextmanager
def locked(directory: str | None) -> Iterator[None]:
    """Hold an exclusive lock on ``directory``'s compile lock file (nothing without fcntl)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    if directory is None:
        yield
        return
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, _LOCK_NAME), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
