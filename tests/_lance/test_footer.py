"""Lance data file footers walked in Python and compiled alike, and files opened from them."""

from __future__ import annotations

import os

import lance
import numpy as np
import pyarrow as pa
import pytest
from conftest import random_counts, write_dense
from lance.file import LanceFileReader
from test_miniblock import atlas_like, shapes, write

from slafload._lance import footer
from slafload._lance.data_files import DataFiles
from slafload._lance.file_format import FlatFiles
from slafload._lance.flat_pages import FlatFile
from slafload._lance.flat_reads import FlatRange, read_ranges
from slafload._lance.footer import BAD, FULL, MORE, walk
from slafload._lance.footers import open_footers, read_footer
from slafload._lance.miniblock import MiniPage, unpack_table
from slafload.kernels import NUMPY, Kernels, numba_available, prepare_reads
from slafload.pipeline.reader import COLUMNS

needs_numba = pytest.mark.skipif(not numba_available(), reason="numba is not installed")


@pytest.fixture(scope="module")
def numba_kernels():
    if not numba_available():
        pytest.skip("numba is not installed")
    k = Kernels("numba")
    prepare_reads(k)
    yield k
    k.close()


def files(tmp_path, rng) -> list[str]:
    """Data files of every format and page layout the flat reads know, and a 2.0 file."""
    out = []
    for version in ["2.0", "2.1", "2.2"]:
        for name, (columns, options) in shapes(rng, "2.1" if version == "2.0" else version).items():
            path = str(tmp_path / f"{name}_{version}.lance")
            write(path, columns, version, **options)
            out.append(path)
    return out


def tail_of(path: str, n: int = footer.TAIL) -> tuple[bytes, int]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(max(0, size - n))
        return f.read(), size


@pytest.fixture
def compiled_walk(numba_kernels, tmp_path, monkeypatch):
    """The compiled walk of given bytes: ``walk(kernels, tail, size, n)`` writes a file of
    ``size`` bytes ending in ``tail`` (sparse before it) and walks it as opening a file does,
    through :func:`footer.walk_many` with a buffer of ``len(tail)`` bytes (compiled once and
    cached on disk: ``walk_compiled`` called with other argument types would compile again,
    uncached, for 20 s). It reads no chunk words, so its record is the Python walk's."""
    monkeypatch.chdir(tmp_path)  # a short relative name fits the shortest tails
    name = b"w\0"

    def walk(kernels: Kernels, tail: bytes, size: int, n: int = footer.RECORD) -> list[int]:
        assert kernels.ready("walk_many")  # and so numba imported, footer.walk compiled
        assert size >= len(tail) and (len(tail) >= len(name) or size == len(tail))
        with open("w", "wb") as f:
            f.truncate(size - len(tail))
            f.seek(size - len(tail))
            f.write(tail)
        buffers = np.zeros((1, max(len(tail), len(name))), np.uint8)
        buffers[0, : len(name)] = np.frombuffer(name, np.uint8)
        recs = np.full((1, n), 123_456, np.int64)
        none = np.zeros(0, np.uint8), np.zeros(0, np.int32)
        assert kernels.run("walk_many", buffers, recs, *none, os.O_RDONLY)
        rec = recs[0].tolist()
        assert rec[9] >= 0  # it opened the file: the caller's to close
        os.close(rec[9])
        rec[9] = -1  # as the Python walk, given the bytes, records it
        return rec

    return walk


def python_walk(tail: bytes, size: int, n: int = footer.RECORD) -> list[int]:
    rec = [123_456] * n
    walk(tail, size, rec)
    return rec


def used(rec: list[int]) -> list[int]:
    return rec[: rec[0]] if rec[0] > 0 else rec[:1] + (rec[1:2] if rec[0] == MORE else [])


def test_footers_list_the_pages_lance_lists(tmp_path):
    rng = np.random.default_rng(3)
    for path in files(tmp_path, rng):
        fd = os.open(path, os.O_RDONLY)
        try:
            found = read_footer(fd)
        finally:
            os.close(fd)
        meta = LanceFileReader(path).metadata()
        assert found.num_rows == meta.num_rows and found.n_columns == len(meta.columns)
        for (_, pages), theirs in zip(found.columns(), meta.columns, strict=True):
            assert [list(zip(p.positions, p.sizes, strict=True)) for p in pages] == [
                [(b.position, b.size) for b in page.buffers] for page in theirs.pages
            ], path
            assert sum(p.rows for p in pages) == meta.num_rows


def test_python_and_compiled_walks_agree_on_real_files(tmp_path, numba_kernels, compiled_walk):
    rng = np.random.default_rng(4)
    paths = files(tmp_path, rng)
    big = str(tmp_path / "many_pages.lance")  # metadata larger than a short tail
    write(big, atlas_like(100_000, rng), "2.2", max_page_bytes=2 << 10)
    for path in [*paths, big]:
        for n in [footer.TAIL, 200, 40]:
            tail, size = tail_of(path, n)
            want = python_walk(tail, size)
            assert used(compiled_walk(numba_kernels, tail, size)) == used(want), (path, n)
            assert want[0] > 0 or (want[0] == MORE and n < footer.TAIL), (path, n)
        # A record too small for the metadata says so, in both
        tail, size = tail_of(path)
        assert python_walk(tail, size, 12)[0] in (FULL, python_walk(tail, size)[0])
        assert compiled_walk(numba_kernels, tail, size, 12)[0] == python_walk(tail, size, 12)[0]
    huge = str(tmp_path / "huge_metadata.lance")  # more metadata than the first read's 16 KB
    with_tables = 0
    write(huge, atlas_like(400_000, rng), "2.0", max_page_bytes=1 << 10)
    for path in [*paths, big, huge]:
        ((fd, compiled),) = open_footers([path], numba_kernels.run)  # it opens and reads it
        try:
            python = read_footer(fd)
        finally:
            os.close(fd)
        assert python.tables.size == 0
        assert (compiled.version, compiled.num_rows, compiled.schema) == (
            python.version,
            python.num_rows,
            python.schema,
        ), path
        assert python.tail.endswith(compiled.tail), path  # it reads fewer bytes first
        assert plain(compiled) == plain(python), path
        built = max(p.tables_at for _, pages in compiled.columns() for p in pages)
        if path == huge or path.endswith("_2.0.lance"):
            assert built == -1 and compiled.tables.size == 0, path  # huge: walked in Python
        else:
            with_tables += built >= 0
    assert with_tables >= len(paths) * 2 // 3 - 2  # all but files of constant pages
    assert len(python.tail) > footer.TAIL  # huge: a second read, in Python


def plain(found) -> list:
    """A footer's columns, but for where the compiled walk put each page's chunk tables."""
    return [(e, [p._replace(tables_at=-1) for p in pages]) for e, pages in found.columns()]


def test_damaged_footers_are_rejected_alike_and_never_read_out_of_bounds(
    tmp_path, numba_kernels, compiled_walk
):
    """(In Python, a read past the bytes would raise IndexError; the walk is the same code.)"""
    rng = np.random.default_rng(5)
    path = str(tmp_path / "a.lance")
    write(path, atlas_like(20_000, rng), "2.2", max_page_bytes=16 << 10)
    tail, size = tail_of(path)
    meta_at = int.from_bytes(tail[-40:-32], "little")
    metadata = size - meta_at  # the column metadata, offset tables, descriptor and footer
    outcomes = set()
    for trial in range(1_500):
        data = bytearray(tail)
        for _ in range(1 + trial % 3):
            at = len(data) - 1 - int(rng.integers(0, metadata))
            data[at] = int(rng.integers(0, 256)) if trial % 2 else data[at] ^ (1 << (trial % 8))
        cut = bytes(data[int(rng.integers(0, 60)) :]) if trial % 7 == 0 else bytes(data)
        grown = size + (len(cut) - len(tail))
        want = python_walk(cut, grown)
        assert used(compiled_walk(numba_kernels, cut, grown)) == used(want), trial
        outcomes.add(want[0] if want[0] <= 0 else "ok")
    assert {BAD, "ok"} <= outcomes  # damage that still walks, and damage that does not
    for short in [b"", b"LANC", tail[-39:]]:
        assert python_walk(short, len(short))[0] == BAD
        assert compiled_walk(numba_kernels, short, len(short))[0] == BAD


def test_layout_keys_are_the_same_for_pages_laid_out_alike_whatever_their_rows(tmp_path):
    rng = np.random.default_rng(6)
    keys = {}
    for n in [3_000, 50_001]:
        path = str(tmp_path / f"{n}.lance")
        write(path, atlas_like(n, rng), "2.2")
        fd = os.open(path, os.O_RDONLY)
        try:
            keys[n] = [[(p.key, p.encoding, p.rows) for p in pages]
                       for _, pages in read_footer(fd).columns()]  # fmt: skip
        finally:
            os.close(fd)
    for small, large in zip(keys[3_000], keys[50_001], strict=True):
        (key_s, enc_s, rows_s), (key_l, enc_l, rows_l) = small[0], large[0]
        assert rows_s != rows_l and enc_s != enc_l  # num_items differs, and so the bytes
        assert key_s == key_l and key_s is not None
        assert key_s[0] == b"/lance.encodings21.PageLayout"
    path = str(tmp_path / "v20.lance")
    write(path, atlas_like(3_000, rng), "2.0")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert all(p.key is None for _, pages in read_footer(fd).columns() for p in pages)
    finally:
        os.close(fd)


@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_chunk_tables_compiled_and_in_numpy_are_the_same(tmp_path, version, numba_kernels):
    rng = np.random.default_rng(7)
    opened = 0
    for name, (columns, options) in shapes(rng, version).items():
        path = str(tmp_path / f"{name}.lance")
        write(path, columns, version, **options)
        files_ = FlatFiles(kernels=numba_kernels)
        first = files_.open(path, list(columns))  # through Lance's metadata: the reference
        form = files_.format
        assert first is not None and form is not None, name
        again = {kernels: form.open(path, list(columns), kernels)
                 for kernels in [numba_kernels, NUMPY]}  # fmt: skip
        assert (again[NUMPY] is None) == (again[numba_kernels] is None), name
        opened += again[NUMPY] is not None
        for flat in again.values():
            if flat is None:  # a constant page: its layout is not learned
                continue
            for ours, theirs in zip(flat._columns, first._columns, strict=True):
                assert ours.rows == theirs.rows and len(ours.mini) == len(theirs.mini)
                for a, b in zip(ours.mini, theirs.mini, strict=True):
                    assert a.kind == b.kind and a.data_at == b.data_at and a.header == b.header
                    assert a.log == b.log, name
                    pairs = [(a.chunk_at, b.chunk_at), (a.chunk_base, b.chunk_base),
                             (a.chunk_rows, b.chunk_rows)]  # fmt: skip
                    for x, y in pairs:
                        assert (x is None) == (y is None), name
                        if x is not None:
                            assert x.dtype == y.dtype and np.array_equal(x, y), name
            (got,) = read_ranges([FlatRange(flat, 0, flat.num_rows)], numba_kernels)
            assert got.equals(LanceFileReader(path).read_all().to_table()), name
            flat.close()
        first.close()
    assert opened >= len(shapes(rng, version)) - 2  # 2.2 writes constant pages of two


def test_chunk_words_that_do_not_add_up_fail_alike(tmp_path, numba_kernels):
    rng = np.random.default_rng(8)
    path = str(tmp_path / "a.lance")
    write(path, atlas_like(40_000, rng), "2.2")
    columns = ["cell", "gene", "value"]
    files_ = FlatFiles(kernels=numba_kernels)
    assert files_.open(path, columns) is not None
    form = files_.format
    ((fd, found),) = open_footers([path], numba_kernels.run)
    os.close(fd)
    page = found.columns()[2][1][0]  # values: mini-block pages
    assert page.tables_at >= 0
    for kernels in [numba_kernels, NUMPY]:
        flat = form.open(path, columns, kernels)
        assert flat is not None
        flat.close()
    with open(path, "rb") as f:
        data = f.read()
    (words_at, _), (words_size, _) = page.positions, page.sizes
    damages = {
        "count": lambda w: w[:-4] + bytes([w[-4] | 0xF]) + w[-3:],  # the last chunk's log2
        "zero log": lambda w: bytes([w[0] & 0xF0]) + w[1:],  # a first chunk of "the rest"
        "size": lambda w: bytes([w[0] ^ 0x10]) + w[1:],  # a chunk 8 bytes more or less
    }
    for name, damage in damages.items():
        broken = str(tmp_path / f"{name}.lance")
        words = data[words_at : words_at + words_size]
        with open(broken, "wb") as f:
            f.write(data[:words_at] + damage(words) + data[words_at + words_size :])
        ((fd, walked),) = open_footers([broken], numba_kernels.run)
        os.close(fd)
        assert walked.columns()[2][1][0].tables_at == -2, name
        for kernels in [numba_kernels, NUMPY]:  # the numpy code (miniblock.load) agrees
            assert form.open(broken, columns, kernels) is None, (name, kernels)


@needs_numba
def test_kernels_called_with_other_argument_types_run_the_kernel_for_those():
    kernels = Kernels("numba")
    try:
        for dtype, pad in [(np.int64, 7), (np.float32, 1.5), (np.int64, -2), (np.uint8, 3)]:
            flat = np.zeros(10, dtype)
            start, stop = np.array([1, 6]), np.array([3, 9])
            assert kernels.run("fill_runs", flat, start, stop, pad)
            want = np.zeros(10, dtype)
            want[1:3] = want[6:9] = pad
            assert np.array_equal(flat, want) and flat.dtype == dtype
        assert not kernels.run("fill_runs", np.zeros(4, np.float16), start, stop, 1.0)
    finally:
        kernels.close()


def test_files_opened_by_the_compiled_walk_give_the_same_footers_and_no_stray_descriptor(
    tmp_path, numba_kernels
):
    rng = np.random.default_rng(9)
    paths = [str(tmp_path / f"{i}.lance") for i in range(3)]
    for i, path in enumerate(paths):
        write(path, atlas_like(5_000 + 7_000 * i, rng), "2.2")
    junk = tmp_path / "junk.lance"
    junk.write_bytes(bytes(range(256)) * 40)
    open_fds = len(os.listdir("/proc/self/fd"))
    asked = [paths[0], str(tmp_path / "missing.lance"), paths[1], str(junk), paths[2]]
    opened = open_footers(asked, numba_kernels.run)
    assert [fd >= 0 for fd, _ in opened] == [True, False, True, False, True]
    assert isinstance(opened[1][1], OSError) and isinstance(opened[3][1], ValueError)
    for path, (fd, found) in zip(asked[::2], opened[::2], strict=True):
        try:
            assert os.fstat(fd).st_size == os.path.getsize(path) and found.rec[9] == fd
            python = read_footer(fd)
            assert found.rec[1:4] == python.rec[1:4] and found.schema == python.schema
            assert plain(found) == plain(python) and found.tables.size > 0
            for _, pages in found.columns():  # each file's tables, not the one before's
                for page in (p for p in pages if p.tables_at >= 0):
                    chunks = page.sizes[0] // (4 if page.large else 2)
                    log, base, at = unpack_table(found.tables, page.tables_at, chunks + 1)
                    offsets = [MiniPage(0, 0, chunk_at=at, chunk_base=base).offset(c)
                               for c in range(chunks + 1)]  # fmt: skip
                    assert offsets[0] == 0 and offsets[-1] == page.sizes[1]
                    assert np.all(np.diff(offsets) > 0)
                    assert (chunks - 1) << log < page.rows <= chunks << log
        finally:
            os.close(fd)
    assert len(os.listdir("/proc/self/fd")) == open_fds
    assert open_footers(paths, NUMPY.run) is None  # no kernel: the caller opens them


def test_a_read_window_opens_its_files_together_and_reads_as_lance_reads(tmp_path, numba_kernels):
    path = write_dense(tmp_path / "a.slaf", random_counts(2_000, 60, seed=11, density=0.3),
                       max_rows_per_file=700)  # fmt: skip
    expression = lance.dataset(str(path / "expression.lance"))
    flat = DataFiles.of(expression, COLUMNS, kernels=numba_kernels, mini=True, threads=2)
    lance_read = DataFiles.of(expression, COLUMNS, flat=False)
    assert flat is not None and lance_read is not None and flat.n_files > 40
    batches: list[int] = []
    real = FlatFiles.open_many

    def spy(self, paths, columns):
        got = real(self, paths, columns)
        batches.append(sum(f is not None for f in got))
        return got

    rng = np.random.default_rng(12)
    starts = np.sort(rng.choice(expression.count_rows() - 50, 120, replace=False))
    rows = np.stack([starts, starts + rng.integers(1, 50, len(starts))], axis=1)
    rows = rows[np.r_[True, rows[1:, 0] >= rows[:-1, 1]]]  # not overlapping
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FlatFiles, "open_many", spy)
        got = [pa.Table.from_batches(list(x)) for x in flat.read(rows, COLUMNS)]
    want = [pa.Table.from_batches(list(x)) for x in lance_read.read(rows, COLUMNS)]
    assert all(a.equals(b) for a, b in zip(got, want, strict=True))
    assert max(batches) >= 10  # files opened together, by one kernel call
    assert all(isinstance(e.reader, FlatFile) for e in flat._open.values())


def test_sizes_that_would_wrap_a_sum_are_rejected_alike(tmp_path, numba_kernels, compiled_walk):
    rng = np.random.default_rng(13)
    path = str(tmp_path / "a.lance")
    write(path, atlas_like(200_000, rng), "2.2")
    tail, size = tail_of(path, 4096)
    base = size - len(tail)
    cmo_at, gbo_at = (int.from_bytes(tail[-40 + i : -32 + i], "little") for i in (8, 16))
    huge = (2**63 - 1).to_bytes(8, "little")
    for name, at in [("global buffer", gbo_at), ("column", cmo_at)]:
        data = bytearray(tail)
        i = at - base  # the (position, size) pair: at the first bytes read, 2**63 - 1 of them
        data[i : i + 16] = (base + 8).to_bytes(8, "little") + huge
        data[8:11] = b"\x0a\x88\x27"  # there, a field of 5,000 bytes: past the bytes read
        assert python_walk(bytes(data), size)[0] == BAD, name
        assert compiled_walk(numba_kernels, bytes(data), size)[0] == BAD, name
