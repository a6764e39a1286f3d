"""Compiled versions of the token worker's per-cell loops (optional: numba), numpy otherwise.

The token worker (:class:`~slafload.pipeline.tokenize.TokenWorker`) bounds scGPT on a small machine, and
three of its steps are loops over a piece's cells that numpy can only run as one call per cell
(or per block of cells), holding the GIL between calls: copying each cell's tokens into its
output row (:func:`~slafload.pipeline.buffers.copy_aligned_runs`), re-padding reused rows
(:meth:`~slafload.pipeline.buffers.RowBuffers.rows`) and scGPT's per-cell quantile bins
(:func:`~slafload.tokenizers.quantile_bins`). With `numba <https://numba.pydata.org>`_
installed (``pip install slafload[fast]``), :class:`Kernels` runs each as one compiled call per
piece that releases the GIL for its whole duration; the numpy code stays the reference, and
the tokens are identical either way (tests compare both on the same data). The same machinery
runs the flat reads' kernels (``pread`` and the mini-block decoder) and the footer walk. The
kernels themselves are elsewhere, beside the code they speed up: the token worker's in
:mod:`slafload.pipeline.token_kernels`, the reads' in :mod:`slafload._lance.read_kernels` and
:mod:`slafload._lance.footer`; this module compiles, caches and runs them.

Compiling costs 0.1-2.3 s per kernel and argument types the first time a machine uses it (the
footer walk, :func:`slafload._lance.footer.walk_many`, ~17 s: :func:`warm_up` ~23 s on 2 cores), and
a process's first kernel 0.3-0.5 s for numba's start-up once they are in numba's on-disk cache
(then milliseconds each). A loader's kernels are loaded on a background thread of their own, and
each call runs the numpy code until its compiled version is ready, so the first batch never
waits for a compiler. A kernel missing from numba's cache is compiled into it by a child
process, which ``close()`` kills (:mod:`slafload._jit`: the loader's own GIL stays free, and
processes sharing one cache compile each kernel once); the background thread only imports
numba and loads kernels, for the first second or so of a process (:func:`warm_up` does that
work up front). ``backend="numba"`` waits instead, compiling in the process: every call is
compiled, which tests use. ``LoaderConfig.kernels`` picks the backend;
``"auto"`` (the default) uses numba when it is installed. numba and LLVM add ~120 MB to the
process with the kernels loaded from the cache. Compiled in the process instead, they add ~85
MB more: LLVM frees most of what it used (~160 MB for the footer walk alone), and each compile
hands that back to the system (glibc's ``malloc_trim``), where glibc would otherwise keep it
for the life of the process (+223 MB after :func:`warm_up` against a cached start, not +85).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import sys
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from slafload import _jit
from slafload._lance import footer, read_kernels
from slafload.pipeline import token_kernels

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "numba", "numpy")
_IMPORT = ("import",)  # the compile thread's first job: importing numba
_COMPILED: dict[tuple, Any] = {}
"""numba (under ``_IMPORT``) and every kernel compiled in this process, by kernel and argument
types. Compiled code is numba's and lives as long as the process whatever we do (a dispatcher
made per loader leaked ~0.1 MB each, and cost a cache load), so loaders share it: a loader's
:class:`Kernels` owns only its compile thread."""
_KIND = ("kind",)
"""Under ``(*_KIND, kernel, *kinds)``, :data:`_COMPILED` also holds each kernel it has compiled by
:func:`_kind` of each argument: ``numba.typeof`` of an array costs ~15 us, and opening a data
file from its footer calls two kernels (so every open paid ~60 us for that)."""


def _kind(arg: Any) -> Any:
    """What numba types ``arg`` by, cheaply: an array's dtype, dimensions, layout, whether it
    is writeable and aligned; any other value's Python type (the kernels take ints that fit
    an ``int64``: offsets, sizes, file descriptors).
    """
    if isinstance(arg, np.ndarray):
        f = arg.flags
        return arg.dtype.str, arg.ndim, f.c_contiguous, f.f_contiguous, f.writeable, f.aligned
    return type(arg)


def numba_available() -> bool:
    """Whether numba is installed here (found, not imported: importing it takes ~0.15 s)."""
    return importlib.util.find_spec("numba") is not None


class Kernels:
    """One loader's way to the compiled kernels: :meth:`run` calls one if it is ready.

    What is compiled is shared by every loader of the process; a ``Kernels`` owns the thread
    that compiles what its loader needs and nothing else has compiled yet.

    Args:
        backend: ``"auto"`` (numba when it is installed, imported and each kernel compiled
            in the background, the numpy code used until then), ``"numba"`` (required; a
            call waits for numba and its kernel) or ``"numpy"`` (never compile).

    Raises:
        ImportError: ``backend="numba"`` without numba installed.
    """

    def __init__(self, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"kernels must be one of {BACKENDS}, got {backend!r}")
        if backend == "numba" and not numba_available():
            raise ImportError("kernels='numba' needs numba: pip install 'slafload[fast]'")
        self.requested = backend
        self.backend = "numba" if backend != "numpy" and numba_available() else "numpy"
        self._jobs: dict[tuple, Future[Any]] = {}
        self._failed: set[tuple] = set()
        self._lock = threading.Lock()
        self._compiler: ThreadPoolExecutor | None = None
        self._stop = threading.Event()  # set by close(): the compile thread's jobs stop

    def run(self, name: str, *args: Any, start: bool = True) -> bool:
        """Run kernel ``name`` on ``args`` and return ``True``; ``False`` if it did not run
        (numpy backend, or numba still loading or compiling for these argument types): the
        caller then runs its numpy code.

        ``start=False`` runs it only if it is compiled already, and never starts the compile
        thread: for calls from threads that may outlive the loader (the read threads), whose
        kernels :meth:`prepare` compiles.
        """
        if self.backend == "numpy":
            return False
        kinds = (*_KIND, name, *map(_kind, args))
        kernel = _COMPILED.get(kinds)
        if kernel is not None:
            kernel(*args)
            return True
        if any(getattr(a, "dtype", None) == np.float16 for a in args):
            return False  # numba has no float16 arithmetic
        numba = _COMPILED.get(_IMPORT)
        if numba is None and start:
            numba = self._background(_IMPORT, _import_numba)
        if numba is None:
            return False
        key = (name, *(numba.typeof(a) for a in args))
        kernel = _COMPILED.get(key)
        if kernel is None and start:
            kernel = self._background(key, _build, key, self.requested != "numba")
        if kernel is None:
            return False
        _COMPILED[kinds] = kernel
        kernel(*args)
        return True

    def ready(self, name: str) -> bool:
        """Whether kernel ``name`` is compiled (for some argument types) in this process."""
        return self.backend != "numpy" and any(key[0] == name for key in list(_COMPILED))

    def prepare(self, name: str, *args: Any) -> None:
        """Start compiling kernel ``name`` for the types of ``args`` (example arguments, not
        run) on the compile thread, numba's import first if need be; with
        ``backend="numba"``, wait for it (and raise its failure).
        """
        if self.backend != "numpy":
            self._background((name, "prepared"), _prepare, name, args, self.requested != "numba")

    def _background(self, key: tuple, job: Callable[..., Any], *args: Any) -> Any:
        """``job(*args)``'s result once the compile thread has run it (it is started on the
        first request); ``None`` until then, or for good if it failed (with a warning).
        With ``backend="numba"``, waits for it and raises its failure.
        """
        with self._lock:
            if key in self._failed:
                return None
            future = self._jobs.get(key)
            if future is None:
                if self._compiler is None:
                    self._compiler = ThreadPoolExecutor(1, thread_name_prefix="slafload-jit")
                    self._stop = threading.Event()
                if job in (_build, _prepare):
                    args = (*args, self._stop)
                future = self._jobs[key] = self._compiler.submit(job, *args)
        if self.requested != "numba" and not future.done():
            return None
        try:
            result = future.result()
        except _jit.Abandoned:  # the compile thread was closed (a race with close())
            return None
        except Exception as exc:
            if self.requested == "numba":
                raise
            with self._lock:
                self._failed.add(key)
            what = "import" if key is _IMPORT else f"compile {key[0]}"
            warnings.warn(
                f"slafload: numba could not {what} ({exc}); using numpy instead",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        return result

    def close(self) -> None:
        """End the compile thread promptly: a compile in a child process is killed (the
        thread itself only imports numba and loads kernels from the cache, each quick).
        Idempotent; what was compiled stays usable, and a later call starts a new thread if
        it needs one (and compiles again what was abandoned).
        """
        with self._lock:
            compiler, self._compiler = self._compiler, None
            self._stop.set()
        if compiler is not None:
            compiler.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._jobs = {k: f for k, f in self._jobs.items() if _finished(f)}


def _finished(future: Future[Any]) -> bool:
    """Whether ``future`` ran to its end (not cancelled, nor abandoned by close())."""
    if not future.done() or future.cancelled():
        return False
    return not isinstance(future.exception(), _jit.Abandoned)


NUMPY = Kernels("numpy")
"""Kernels that never compile: the numpy code everywhere (the default of every function)."""


def warm_up() -> bool:
    """Import numba and load one kernel now; whether numba is in use (``False``: not installed).

    The first kernel a process loads pays for numba's import and its compiler's start-up
    (0.3-0.5 s with the kernels in numba's on-disk cache, ~1 s more the first time on a
    machine), holding the GIL much of that time: a loader started cold compiles in the
    background and streams at a fraction of its speed for its first second. After this call a
    loader's kernels load in milliseconds. Call it beside your imports where that second
    matters (a benchmark, a short job); a long training run need not.
    """
    if not numba_available():
        return False
    kernels = Kernels("numba")
    empty = np.zeros(0, np.int64)
    kernels.run("fill_runs", np.zeros(1, np.int64), empty, empty, 0)
    prepare_reads(kernels)
    kernels.close()
    return True


def prepare_reads(kernels: Kernels) -> None:
    """Have ``kernels`` compile what the flat reads run (in the background, or now with
    ``backend="numba"``): the read threads use each kernel once it is ready. That is
    :func:`slafload._lance.flat_reads.read_ranges`' ``pread_runs`` and ``decode_chunks``, and for
    opening a file from its footer (:meth:`slafload._lance.file_format.FileFormat.open`),
    ``walk_many`` (:func:`slafload._lance.footer.walk_many`).
    """
    if not _HAS_PREAD:  # no libc pread here: the reads use os.preadv
        return
    z, b = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8)
    kernels.prepare("pread_runs", z, z, z, z, b, np.zeros(1, np.int64))
    kernels.prepare("decode_chunks", b, np.zeros((0, 10), np.int64), z, z, z,
                    np.zeros(0, np.uint64), b, np.zeros(1, np.int64))  # fmt: skip
    runs = np.zeros((4, 0), np.int64)
    kernels.prepare("read_decode", runs, b, runs, b, np.zeros((0, 10), np.int64), z, z, z,
                    np.zeros(0, np.uint64), np.zeros(3, np.int64))  # fmt: skip
    # Opening a file from its footer (slafload._lance.file_format.FileFormat.open).
    kernels.prepare("walk_many", np.zeros((0, 1), np.uint8), np.zeros((0, 1), np.int64), b,
                    np.zeros(0, np.int32), 0)  # fmt: skip


def _import_numba() -> Any:
    import numba

    if _HAS_PREAD and not read_kernels.bound():
        footer.bind(numba)  # the compiled footer walk opens and reads files itself
        read_kernels.bind(numba)
    return _COMPILED.setdefault(_IMPORT, numba)


def _prepare(name: str, args: tuple, outside: bool = False, stop: Any = None) -> Any:
    """Import numba if need be, then :func:`_build` kernel ``name`` for the types of
    ``args``.
    """
    numba = _COMPILED.get(_IMPORT) or _import_numba()
    return _build((name, *(numba.typeof(a) for a in args)), outside, stop)


def _build(key: tuple, outside: bool = False, stop: Any = None) -> Any:
    """:func:`_compile` ``key``; with ``outside``, a kernel not in numba's cache is first
    compiled into it by a child process (:func:`slafload._jit.compile_outside`, abandoned
    when ``stop`` is set), so this thread only loads it.
    """
    if key in _COMPILED:
        return _COMPILED[key]
    dispatcher = _dispatcher(key[0])
    cached = _jit.cache_path(dispatcher) is not None
    if outside and cached and not _jit.is_cached(dispatcher, key[1:]):
        try:
            _jit.compile_outside([key], stop)
        except OSError as exc:  # no child process here: compile in this one
            logger.info("compiling %s in this process: %s", key[0], exc)
    return _compile(key, dispatcher)


def _dispatcher(name: str) -> Any:
    """A new numba dispatcher of kernel ``name``, cached on disk where numba finds a
    writable place (:mod:`slafload._jit`).
    """
    import numba

    kernel: Any = _KERNELS[name]
    try:
        return numba.njit(nogil=True, cache=True)(kernel)
    except RuntimeError:  # "no locator available": nowhere writable numba knows of
        pass
    if _jit.private_cache_dir(numba):
        with contextlib.suppress(RuntimeError):
            return numba.njit(nogil=True, cache=True)(kernel)
    return numba.njit(nogil=True)(kernel)  # compiled in every process


def _compile(key: tuple, dispatcher: Any = None) -> Any:
    """The numba dispatcher of kernel ``key[0]``, compiled (or loaded from numba's cache)
    for argument types ``key[1:]`` (once per process: :data:`_COMPILED`). Compiled rather
    than loaded, it hands the memory LLVM freed back to the system (see the module
    docstring).
    """
    if key in _COMPILED:
        return _COMPILED[key]
    if dispatcher is None:
        dispatcher = _dispatcher(key[0])
    dispatcher.compile(key[1:])
    if not dispatcher.stats.cache_hits and _MALLOC_TRIM is not None:  # compiled, not loaded
        _MALLOC_TRIM(0)
    return _COMPILED.setdefault(key, dispatcher)


def _libc(name: str) -> Any:
    """The C library's function ``name`` as ctypes calls it, or ``None`` where it has none
    (not on Windows; ``malloc_trim`` is glibc's only).
    """
    if sys.platform == "win32":
        return None
    try:
        return getattr(ctypes.CDLL(None), name, None)
    except OSError:
        return None


_HAS_PREAD = _libc("pread") is not None
_MALLOC_TRIM = _libc("malloc_trim")


_KERNELS: dict[str, Any] = {
    **token_kernels.KERNELS,
    **read_kernels.KERNELS,
    "walk_many": footer.walk_many,  # calls footer.walk, written for CPython and numba
}
"""Every kernel, by name: the token worker's (:mod:`slafload.pipeline.token_kernels`) and the
flat reads' (:mod:`slafload._lance.read_kernels`, and the footer walk)."""


def compile_child() -> None:
    """The compile child's entry point (:mod:`slafload._jit`): compile the pickled kernel keys
    read from stdin into numba's cache, each under the cache directory's lock, so processes
    sharing one cache compile each kernel once.
    """
    import pickle

    keys = pickle.loads(sys.stdin.buffer.read())
    _import_numba()
    for key in keys:
        dispatcher = _dispatcher(key[0])
        with _jit.locked(_jit.cache_path(dispatcher)):  # compiled meanwhile elsewhere: loaded
            dispatcher.compile(key[1:])
