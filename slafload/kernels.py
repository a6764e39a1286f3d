"""Compiled versions of the token worker's per-cell loops (optional: numba), numpy otherwise.

The token worker (:class:`~slafload.pipeline.ranking.RankGenes`) bounds scGPT on a small machine, and
three of its steps are loops over a piece's cells that numpy can only run as one call per cell
(or per block of cells), holding the GIL between calls: copying each cell's tokens into its
output row (:func:`~slafload.pipeline.buffers.copy_aligned_runs`), re-padding reused rows
(:meth:`~slafload.pipeline.buffers.RowBuffers.rows`) and scGPT's per-cell quantile bins
(:func:`~slafload.tokenizers.quantile_bins`). With `numba <https://numba.pydata.org>`_
installed (``pip install slafload[fast]``), :class:`Kernels` runs each as one compiled call per
piece that releases the GIL for its whole duration; the numpy code stays the reference, and
the tokens are identical either way (tests compare both on the same data).

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
from slafload._lance import footer

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
    :func:`slafload._lance.flat_pages.read_ranges`' ``pread_runs`` and ``decode_chunks``, and for
    opening a file from its footer (:meth:`slafload._lance.flat_pages.FileFormat.open`),
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
    # Opening a file from its footer (slafload._lance.flat_pages.FileFormat.open).
    kernels.prepare("walk_many", np.zeros((0, 1), np.uint8), np.zeros((0, 1), np.int64), b,
                    np.zeros(0, np.int32), 0)  # fmt: skip


def _import_numba() -> Any:
    global _pread, _pread_runs_compiled, _decode_chunks_compiled
    import numba

    if _HAS_PREAD and _pread is None:
        t = numba.types
        _pread = t.ExternalFunction("pread", t.intp(t.int32, t.voidptr, t.uintp, t.int64))
        footer.bind(numba)  # the compiled footer walk opens and reads files itself
        _pread_runs_compiled = numba.njit(nogil=True)(_pread_runs)
        _decode_chunks_compiled = numba.njit(nogil=True)(_decode_chunks)
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


# The kernels, as plain Python over arrays (numba compiles them; they are never run as
# Python). Each does what the numpy function named in its docstring does. Each run is copied
# between two slice views indexed from 0: LLVM vectorizes that loop, and not one indexing the
# whole arrays at ``d + k`` and ``s + k`` (0.26 against 1.9 ms for a piece's 2,048 runs).


def _copy_runs_1(out: np.ndarray, src: np.ndarray, dst: np.ndarray, start: np.ndarray,
                 count: np.ndarray) -> None:  # fmt: skip
    """:func:`~slafload.pipeline.buffers.copy_aligned_runs` for one ``(out, src)`` pair."""
    for r in range(len(dst)):
        o, i = out[dst[r] : dst[r] + count[r]], src[start[r] : start[r] + count[r]]
        for k in range(min(len(o), len(i))):  # equal; min keeps a bad run inside both
            o[k] = i[k]


def _copy_runs_2(out: np.ndarray, src: np.ndarray, out2: np.ndarray, src2: np.ndarray,
                 dst: np.ndarray, start: np.ndarray, count: np.ndarray) -> None:  # fmt: skip
    """:func:`~slafload.pipeline.buffers.copy_aligned_runs` for two aligned ``(out, src)`` pairs."""
    for r in range(len(dst)):
        o, i = out[dst[r] : dst[r] + count[r]], src[start[r] : start[r] + count[r]]
        for k in range(min(len(o), len(i))):
            o[k] = i[k]
        o2, i2 = out2[dst[r] : dst[r] + count[r]], src2[start[r] : start[r] + count[r]]
        for k in range(min(len(o2), len(i2))):
            o2[k] = i2[k]


def _fill_runs(flat: np.ndarray, start: np.ndarray, stop: np.ndarray, pad: Any) -> None:
    """``flat[start[i]:stop[i]] = pad`` for every ``i`` (``RowBuffers``' re-pad)."""
    for i in range(len(start)):
        run = flat[start[i] : stop[i]]
        for k in range(len(run)):
            run[k] = pad


def _quantile_bins(values: np.ndarray, indptr: np.ndarray, n_bins: int, offset: int,
                   out: np.ndarray) -> None:  # fmt: skip
    """:func:`~slafload.tokenizers.quantile_bins` of every cell (values in rank order).

    Per cell: its ``n_bins - 1`` edges by numpy's linear quantile interpolation of the
    ascending values (``ascending[a] = values[stop - 1 - a]``), then one walk down the
    descending values, the bin (number of edges ``<=`` the value) never increasing.
    """
    q = np.linspace(0.0, 1.0, n_bins - 1)
    edges = np.empty(n_bins - 1)
    for c in range(len(indptr) - 1):
        start, stop = indptr[c], indptr[c + 1]
        n = stop - start
        if n == 0:
            continue
        for j in range(n_bins - 1):
            virtual = (n - 1) * q[j]
            floor = np.floor(virtual)
            prev = min(int(floor), n - 1)
            nxt = min(prev + 1, n - 1)
            lo, hi = values[stop - 1 - prev], values[stop - 1 - nxt]
            t, diff = virtual - floor, hi - lo  # the difference in the values' type, as numpy
            edges[j] = hi - diff * (1 - t) if t >= 0.5 else lo + diff * t  # numpy's _lerp
        k = n_bins - 1
        for i in range(start, stop):
            while k > 0 and edges[k - 1] > values[i]:
                k -= 1
            out[i] = k + offset


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
_pread: Any = None
"""libc's ``pread(int, void *, size_t, off_t) -> ssize_t`` as numba calls it: declared by
:func:`_import_numba` as an external function found by its name when the kernel is loaded, not
by an address baked into the code, so numba can cache the kernel on disk (loaded in ~2 ms
instead of compiled in 0.1-0.4 s per process; a ctypes function could not be cached)."""


def _pread_runs(fds: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, where: np.ndarray,
                out: np.ndarray, failed: np.ndarray) -> None:  # fmt: skip
    """``sizes[i]`` bytes of file ``fds[i]`` from ``offsets[i]`` into ``out[where[i]:]``, for
    every ``i`` (:func:`~slafload._lance.flat_pages.read_ranges`); ``failed[0]`` is the first run
    not read whole (an error, or the end of the file), else -1.
    """
    base = out.ctypes.data
    for i in range(len(fds)):
        got = 0
        while got < sizes[i]:
            n = _pread(np.int32(fds[i]), base + where[i] + got, sizes[i] - got, offsets[i] + got)
            if n <= 0:
                failed[0] = i
                return
            got += n
    failed[0] = -1


def _decode_chunks(scratch: np.ndarray, jobs: np.ndarray, chunk_at: np.ndarray,
                   chunk_rows: np.ndarray, order: np.ndarray, tmp: np.ndarray, out: np.ndarray,
                   failed: np.ndarray) -> None:  # fmt: skip
    """:func:`slafload._lance.miniblock.decode_chunks` (``scratch`` and ``out`` ``uint8`` whose
    lengths are multiples of 8, every chunk and value 8-byte aligned in them; ``tmp``
    ``uint64[1024]``); ``failed[0]`` is the first job with a chunk that is not what its
    encoding says, else -1. Each value is written straight to ``out`` (bit-packed chunks,
    whose values come out of order, through ``tmp``), and of a run-length chunk only the
    runs the range needs are expanded.
    """
    failed[0] = -1
    # Typed views of the same bytes, and a branch per width at each access: passing them to
    # a helper (a tuple of arrays) made the kernel 15-20x slower. The hot loops index with
    # unsigned ints: numba wraps a negative signed index, and that check kept LLVM from
    # vectorizing them (bit-unpacking compiled to scatter stores, ~10x slower on the 5M atlas).
    s16, s32, s64 = scratch.view(np.uint16), scratch.view(np.uint32), scratch.view(np.uint64)
    o16, o32, o64 = out.view(np.uint16), out.view(np.uint32), out.view(np.uint64)
    for j in range(len(jobs)):
        kind, width, header, size_bytes = jobs[j, 0], jobs[j, 1], jobs[j, 2], jobs[j, 3]
        scratch_at, out_at, skip, rows = jobs[j, 4], jobs[j, 5], jobs[j, 6], jobs[j, 7]
        o = out_at // width  # the next value's index in out's view of this width
        if kind == 4:  # constant
            value = jobs[j, 8]
            for i in range(rows):
                if width == 1:
                    out[o + i] = value
                elif width == 2:
                    o16[o + i] = value
                elif width == 4:
                    o32[o + i] = value
                else:
                    o64[o + i] = value
            continue
        c, row_c, log, rows_left = jobs[j, 9], jobs[j, 10], jobs[j, 11], jobs[j, 12]
        # The job's chunks lie back to back from scratch_at; chunk_at holds their offsets in
        # 8-byte units modulo 2**16 (MiniPage), so each chunk's bytes are a masked difference.
        end = scratch_at
        lo = skip  # values of this chunk before the range
        left = rows  # values still to write
        while left > 0:
            base = end
            end = base + ((chunk_at[c + 1] - chunk_at[c]) & 0xFFFF) * 8
            if row_c < 0:  # alike chunks: 2**log rows each, the last the rest
                count = min(1 << log, rows_left)
                rows_left -= count
            else:
                count = chunk_rows[row_c + 1] - chunk_rows[row_c]
                row_c += 1
            if base + header > end or scratch[base] != 0 or scratch[base + 1] != 0 or lo >= count:
                failed[0] = j
                return
            size0, size1 = 0, 0
            for b in range(size_bytes):
                size0 |= int(scratch[base + 2 + b]) << (8 * b)
                if kind == 2:
                    size1 |= int(scratch[base + 2 + size_bytes + b]) << (8 * b)
            at = base + header  # the first value buffer, 8-byte aligned
            if at + size0 > end or size0 < width or size0 % width:
                failed[0] = j
                return
            n = min(count - lo, left)  # values of this chunk to write
            if kind == 1:  # plain values
                if size0 != count * width:
                    failed[0] = j
                    return
                v0 = at // width + lo
                for i in range(n):
                    if width == 1:
                        out[o + i] = scratch[v0 + i]
                    elif width == 2:
                        o16[o + i] = s16[v0 + i]
                    elif width == 4:
                        o32[o + i] = s32[v0 + i]
                    else:
                        o64[o + i] = s64[v0 + i]
            elif kind == 2:  # runs: run values, then u8 run lengths
                runs = size0 // width
                lengths = at + ((size0 + 7) // 8) * 8
                if size1 != runs or lengths + size1 > end:
                    failed[0] = j
                    return
                # Every run counted and checked, as the numpy code does: a chunk whose runs
                # are too short, or one of them empty, fails.
                total, shortest = 0, 255
                first_length = np.uint64(lengths)
                for r in range(np.uint64(runs)):
                    length = scratch[first_length + r]
                    total += length
                    shortest = min(shortest, length)
                if total < count or shortest == 0:
                    failed[0] = j
                    return
                v0 = at // width
                pos, r = 0, 0  # the first run the range needs, and the value it starts at
                while pos + scratch[lengths + r] <= lo:
                    pos += scratch[lengths + r]
                    r += 1
                # Its values from lo on, then whole runs. A run of at most 8 values, 8 or
                # more values before the range's end, is written as 8 (the next run
                # overwrites the rest): no loop whose length varies run to run (runs average
                # ~4 values in expression values).
                k = min(pos + scratch[lengths + r] - lo, n)
                if width == 2:
                    value16 = s16[v0 + r]
                    for i in range(k):
                        o16[o + i] = value16
                    r += 1
                    while k < n:
                        length = scratch[lengths + r]
                        value16 = s16[v0 + r]
                        if length <= 8 and k + 8 <= n:
                            at_k = np.uint64(o + k)  # unsigned: one vector store
                            for i in range(np.uint64(8)):
                                o16[at_k + i] = value16
                            k += length
                        else:
                            take = min(length, n - k)
                            for i in range(take):
                                o16[o + k + i] = value16
                            k += take
                        r += 1
                elif width == 4:
                    value32 = s32[v0 + r]
                    for i in range(k):
                        o32[o + i] = value32
                    r += 1
                    while k < n:
                        length = scratch[lengths + r]
                        value32 = s32[v0 + r]
                        if length <= 8 and k + 8 <= n:
                            at_k = np.uint64(o + k)  # unsigned: one vector store
                            for i in range(np.uint64(8)):
                                o32[at_k + i] = value32
                            k += length
                        else:
                            take = min(length, n - k)
                            for i in range(take):
                                o32[o + k + i] = value32
                            k += take
                        r += 1
                else:  # 1 or 8 bytes: not what expression tables hold, kept simple
                    done = 0  # values written; k: the next run's, from the first one's
                    while True:
                        for i in range(k):  # numba: a branch per width, not a helper
                            if width == 1:
                                out[o + done + i] = scratch[v0 + r]
                            else:
                                o64[o + done + i] = s64[v0 + r]
                        done, r = done + k, r + 1
                        if done == n:
                            break
                        k = min(int(scratch[lengths + r]), n - done)
            else:  # FastLanes bit-packing: the bit width, then width * lanes words
                bits = 8 * width
                lanes = 1024 // bits
                words = at // width
                w = int(scratch[at])
                if width == 2:
                    w = int(s16[words])
                elif width == 4:
                    w = int(s32[words])
                if w > bits or count > 1024 or size0 != (1 + w * lanes) * width:
                    failed[0] = j
                    return
                mask = (np.uint64(1) << np.uint64(w)) - np.uint64(1)
                if w == 0:
                    for i in range(1024):
                        tmp[i] = 0
                if width == 2 and w > 0:  # u16 (gene ids): 16 rows of 64 lanes, in u32
                    whole = lo == 0 and n == 1024  # straight to out, else through tmp
                    t16 = tmp.view(np.uint16)
                    m16 = np.uint32(mask)
                    for row in range(16):
                        word, shift = (row * w) // 16, (row * w) % 16
                        low = words + 1 + word * 64
                        down16 = np.uint32(shift)
                        up16 = np.uint32(16 - shift)
                        at_row = order[row // 8] * 16 + (row % 8) * 128
                        dst = o + at_row if whole else at_row
                        target = o16 if whole else t16
                        src = np.uint64(low)  # unsigned indices: no negative-index
                        dst_u = np.uint64(dst)  # wraparound, so the lane loop vectorizes
                        if shift + w > 16:
                            for lane in range(np.uint64(64)):
                                v16 = np.uint32(s16[src + lane]) >> down16
                                v16 |= np.uint32(s16[src + np.uint64(64) + lane]) << up16
                                target[dst_u + lane] = v16 & m16
                        else:
                            for lane in range(np.uint64(64)):
                                target[dst_u + lane] = (np.uint32(s16[src + lane]) >> down16) & m16
                    if not whole:
                        for i in range(n):
                            o16[o + i] = t16[lo + i]
                    o += n
                    left -= n
                    lo = 0
                    c += 1
                    continue
                for row in range(bits if w > 0 else 0):  # u8 and u32 (u16 is above)
                    word, shift = (row * w) // bits, (row * w) % bits
                    src = np.uint64(words + 1 + word * lanes)
                    dst = np.uint64(order[row // 8] * 16 + (row % 8) * 128)
                    up = np.uint64(bits - shift)
                    down = np.uint64(shift)
                    if shift + w > bits:  # the value spills into the lane's next word
                        if width == 4:
                            for lane in range(np.uint64(lanes)):
                                v = np.uint64(s32[src + lane]) >> down
                                v |= np.uint64(s32[src + np.uint64(lanes) + lane]) << up
                                tmp[dst + lane] = v & mask
                        else:
                            for lane in range(np.uint64(lanes)):
                                v = np.uint64(scratch[src + lane]) >> down
                                v |= np.uint64(scratch[src + np.uint64(lanes) + lane]) << up
                                tmp[dst + lane] = v & mask
                    elif width == 4:
                        for lane in range(np.uint64(lanes)):
                            tmp[dst + lane] = (np.uint64(s32[src + lane]) >> down) & mask
                    else:
                        for lane in range(np.uint64(lanes)):
                            tmp[dst + lane] = (np.uint64(scratch[src + lane]) >> down) & mask
                for i in range(n):
                    if width == 1:
                        out[o + i] = tmp[lo + i]
                    elif width == 2:
                        o16[o + i] = tmp[lo + i]
                    else:
                        o32[o + i] = tmp[lo + i]
            o += n
            left -= n
            lo = 0
            c += 1


def _read_decode(direct: np.ndarray, buffer: np.ndarray, packed: np.ndarray,
                 scratch: np.ndarray, jobs: np.ndarray, chunk_at: np.ndarray,
                 chunk_rows: np.ndarray, order: np.ndarray, tmp: np.ndarray,
                 failed: np.ndarray) -> None:  # fmt: skip
    """A read window's whole read in one call: :func:`_pread_runs` of the ``direct`` runs
    (``int64[4, n]``: descriptors, offsets, sizes, where) into ``buffer``, of the ``packed``
    runs into ``scratch``, then :func:`_decode_chunks` of ``jobs`` from ``scratch`` into
    ``buffer`` (each call of a kernel returns to Python, which takes the GIL back after the
    other threads' turns). ``failed``: the first direct run, packed run and job that failed,
    each -1 if none; no step runs after one fails.
    """
    failed[1], failed[2] = -1, -1
    _pread_runs_compiled(direct[0], direct[1], direct[2], direct[3], buffer, failed[0:1])
    if failed[0] >= 0:
        return
    _pread_runs_compiled(packed[0], packed[1], packed[2], packed[3], scratch, failed[1:2])
    if failed[1] >= 0 or len(jobs) == 0:
        return
    _decode_chunks_compiled(scratch, jobs, chunk_at, chunk_rows, order, tmp, buffer, failed[2:3])


_pread_runs_compiled: Any = None
_decode_chunks_compiled: Any = None
""":func:`_pread_runs` and :func:`_decode_chunks` compiled (by :func:`_import_numba`): what
:func:`_read_decode` calls."""


_KERNELS = {
    "copy_runs_1": _copy_runs_1,
    "copy_runs_2": _copy_runs_2,
    "fill_runs": _fill_runs,
    "quantile_bins": _quantile_bins,
    "pread_runs": _pread_runs,
    "decode_chunks": _decode_chunks,
    "read_decode": _read_decode,
    "walk_many": footer.walk_many,  # calls footer.walk, written for CPython and numba
}


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
