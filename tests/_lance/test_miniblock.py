"""Mini-block pages of Lance 2.1 and 2.2 files decoded without Lance: every row as Lance reads it."""

from __future__ import annotations

from dataclasses import replace

import lance
import numpy as np
import pyarrow as pa
import pytest
from conftest import random_counts, write_dense
from lance.file import LanceFileReader, LanceFileWriter
from test_encodings import LARGE_CHUNKS, MAJOR

import slafload._lance.flat_reads as flat_reads
from slafload import Loader, open_dataset
from slafload._lance import miniblock
from slafload._lance.data_files import DataFiles
from slafload._lance.file_format import GIVE_UP, FlatFiles
from slafload._lance.flat_pages import FlatFile
from slafload._lance.flat_reads import FlatRange, read_ranges
from slafload.kernels import NUMPY, Kernels, numba_available, prepare_reads
from slafload.pipeline.reader import COLUMNS
from slafload.samplers import BlockShuffle

pytestmark = pytest.mark.usefixtures("no_thread_leak")
BACKENDS = ["numpy"] + (["numba"] if numba_available() else [])
VERSIONS = ["2.1", "2.2"]


@pytest.fixture(params=BACKENDS)
def kernels(request):
    if request.param == "numpy":
        yield NUMPY
        return
    k = Kernels("numba")
    prepare_reads(k)
    yield k
    k.close()


def atlas_like(n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    counts = rng.integers(1, 1600, size=n // 400 + 2)
    return {
        "cell": np.repeat(np.arange(len(counts), dtype=np.uint32) + 12_345, counts)[:n],
        "gene": rng.integers(0, 20_000, size=n).astype(np.uint16),
        "value": np.minimum(rng.geometric(0.5, size=n), 60_000).astype(np.uint16),
        "f32": rng.standard_normal(n).astype(np.float32),
    }


def shapes(rng: np.random.Generator, version: str) -> dict[str, tuple[dict[str, np.ndarray], dict]]:
    """Columns that make every page layout and chunk shape the decoder knows in ``version``."""
    mixed16 = rng.integers(0, 4, 30_000).astype(np.uint16)
    mixed16[::5_000] = 65_535  # bit widths 2 and 16 side by side
    mixed32 = rng.integers(0, 100, 30_000).astype(np.uint32)
    mixed32[7::3_000] = 2**31 + 5
    runs = np.repeat(np.arange(12, dtype=np.uint32),
                     [1, 255, 256, 700, 5_000, 9_000, 3, 1_023, 1_025, 4_096, 4_097, 1])  # fmt: skip
    zeros = rng.integers(0, 50, 9_000).astype(np.uint16)
    zeros[:3_000] = 0  # bit width 0
    out = {
        "atlas": (atlas_like(40_003, rng), {}),
        "small_pages": (atlas_like(50_003, rng), {"max_page_bytes": 32 << 10}),
        "one_row": ({k: v[:1] for k, v in atlas_like(10, rng).items()}, {}),
        "equal": (
            {
                "u32": np.full(10_000, 7, np.uint32),
                "u16": np.full(10_000, 3, np.uint16),
                "f32": np.full(10_000, 1.5, np.float32),
            },
            {},
        ),
        "wide": (
            {
                "u32": rng.integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32),
                "u16": rng.integers(0, 2**16, 20_000).astype(np.uint16),
                "u32_20bit": rng.integers(0, 2**20, 20_000).astype(np.uint32),
            },
            {},
        ),
        "mixed_widths": ({"u16": mixed16, "u32": mixed32}, {}),
        "long_runs": ({"u32": runs, "u16": (runs % 3).astype(np.uint16)}, {}),
        "odd_lengths": (
            {
                "u16": rng.integers(0, 500, 1_025).astype(np.uint16),
                "u32": np.repeat(np.arange(5, dtype=np.uint32), 205),
            },
            {},
        ),
        "bytes": (  # width 1: bit-packed, runs and plain
            {
                "u8": rng.integers(0, 200, 12_000).astype(np.uint8),
                "u8_runs": np.repeat(rng.integers(0, 256, 3_000).astype(np.uint8), 4),
                "u8_any": rng.integers(0, 256, 12_000).astype(np.uint8),
            },
            {},
        ),
        "zeros_and_float_runs": (
            {"u16": zeros, "f32": np.repeat(rng.standard_normal(36).astype(np.float32), 250)},
            {},
        ),
    }
    if version == "2.1" and LARGE_CHUNKS:
        # Width 8 as runs and plain (2.2, and 2.1 before pylance 2.0, bit-pack or compress them
        # further: those files are left to Lance).
        longs = {"u64_runs": np.repeat(rng.integers(0, 2**62, 400, dtype=np.uint64), 30),
                 "i64": rng.integers(-3, 1_000, 12_000).astype(np.int64)}  # fmt: skip
        out["longs"] = (longs, {})
    # A page of over 2**16 eight-byte units: its chunk offsets wrap in MiniPage.chunk_at.
    wide = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    out["past_512k"] = ({"u32": wide}, {})
    return out


def write(path, columns: dict[str, np.ndarray], version: str, batch: int | None = None,
          **options) -> pa.Table:  # fmt: skip
    table = pa.table(columns)
    with LanceFileWriter(str(path), table.schema, version=version, **options) as writer:
        for start in range(0, table.num_rows, batch or table.num_rows):
            writer.write_batch(table.slice(start, batch or table.num_rows))
    return table


@pytest.mark.parametrize("version", VERSIONS)
def test_every_page_layout_reads_as_lance_reads_it(tmp_path, kernels, version):
    rng = np.random.default_rng(21)
    for name, (columns, options) in shapes(rng, version).items():
        path = tmp_path / f"{name}_{version}.lance"
        table = write(path, columns, version, **options)
        assert table.equals(LanceFileReader(str(path)).read_all().to_table())
        flat = FlatFile.open(str(path), table.column_names)
        assert flat is not None, name
        n = table.num_rows
        (whole,) = read_ranges([FlatRange(flat, 0, n)], kernels)
        assert whole.equals(table), name
        starts = rng.integers(0, n, 40)
        ranges = [FlatRange(flat, int(a), int(min(n - a, rng.choice([1, 17, 1_024, 4_097, 12_800]))))
                  for a in starts] + [FlatRange(flat, n - 1, 1), FlatRange(flat, 0, 0)]  # fmt: skip
        for (_, a, m), got in zip(ranges, read_ranges(ranges, kernels), strict=True):
            assert got.equals(table.slice(a, m)), (name, a, m)
        flat.close()


def test_chunk_tables_give_back_every_offset():
    """A page's chunk offsets, kept as a checkpoint every 16 and the rest in 8-byte units
    modulo 2**16 (2.25 bytes a chunk), come back exactly, and so does each chunk's size as
    the decode kernels take it; chunks, or a checkpoint's chunks, of 512 KiB or more and pages
    of 2 GiB are refused (Lance's reader then reads the file)."""
    rng = np.random.default_rng(31)
    for n_chunks in [1, 2, 15, 16, 17, 31, 32, 33, 1_024, 1_025, 4_097]:
        for top in [8, 4_096, 32_768]:
            sizes = rng.integers(1, top // 8 + 1, n_chunks) * 8
            offsets = np.concatenate([[0], np.cumsum(sizes)])
            table = miniblock.pack_table(10, offsets)
            assert table is not None and len(table) == miniblock.table_size(n_chunks + 1)
            log, base, at = miniblock.unpack_table(table, 0, n_chunks + 1)
            page = miniblock.MiniPage(miniblock.BITPACK, 0, chunk_at=at, chunk_base=base)
            assert log == 10 and at.dtype == np.uint16 and base.dtype == np.int32
            assert [page.offset(c) for c in range(n_chunks + 1)] == offsets.tolist()
            assert np.array_equal((np.diff(at.astype(np.int64)) & 0xFFFF) * 8, sizes)
    assert miniblock.pack_table(10, np.array([0, 1 << 19], np.int64)) is None  # a chunk
    spread = np.arange(17, dtype=np.int64) * (40 << 10)  # 16 chunks of 40 KiB after offset 0
    assert miniblock.pack_table(10, spread) is None
    assert miniblock.pack_table(10, spread[:13]) is not None  # 480 KiB after it
    assert miniblock.pack_table(10, np.array([0, 8, 2**31], np.int64)) is None


@pytest.mark.parametrize("version", VERSIONS)
def test_a_page_past_512_kib_wraps_its_chunk_offsets_and_reads_exactly(tmp_path, kernels, version):
    columns, options = shapes(np.random.default_rng(32), version)["past_512k"]
    table = write(tmp_path / "wide.lance", columns, version, **options)
    flat = FlatFile.open(str(tmp_path / "wide.lance"), table.column_names)
    assert flat is not None
    (page,) = flat._columns[0].mini
    assert page.chunk_at is not None and page.offset(len(page.chunk_at) - 1) > 1 << 19
    assert (np.diff(page.chunk_at.astype(np.int64)) < 0).any()  # the units wrapped
    n = table.num_rows
    ranges = [FlatRange(flat, a, m) for a, m in [(0, n), (1, n - 2), (70_000, 90_000),
                                                 (n - 5_000, 5_000), (123_457, 1)]]  # fmt: skip
    for (_, a, m), got in zip(ranges, read_ranges(ranges, kernels), strict=True):
        assert got.equals(table.slice(a, m)), (a, m)
    flat.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_pages_of_many_batches_and_projections(tmp_path, kernels, version):
    rng = np.random.default_rng(22)
    path = tmp_path / "paged.lance"
    table = write(path, atlas_like(300_001, rng), version, batch=7_777)
    columns = LanceFileReader(str(path)).metadata().columns
    assert max(len(c.pages) for c in columns) > 1
    flat = FlatFile.open(str(path), ["value", "cell"])
    assert flat is not None
    wanted = table.select(["value", "cell"])
    ranges = [FlatRange(flat, int(a), 9_000) for a in rng.integers(0, 300_001 - 9_000, 30)]
    for (_, a, m), got in zip(ranges, read_ranges(ranges, kernels), strict=True):
        assert got.equals(wanted.slice(a, m))
    flat.close()


def test_a_nullable_column_or_mini_false_leaves_the_file_to_lance(tmp_path):
    path = tmp_path / "nulls.lance"
    values = pa.array([None if i % 7 == 0 else i for i in range(5_000)], pa.uint32())
    with LanceFileWriter(str(path), pa.schema([("v", pa.uint32())]), version="2.2") as w:
        w.write_batch(pa.table({"v": values}))
    assert FlatFile.open(str(path), ["v"]) is None
    fine = tmp_path / "fine.lance"
    write(fine, atlas_like(5_000, np.random.default_rng(1)), "2.2")
    assert FlatFile.open(str(fine), ["gene"], mini=False) is None
    assert FlatFiles(mini=False).open(str(fine), ["gene"]) is None
    assert FlatFile.open(str(fine), ["gene"]) is not None


def test_a_damaged_chunk_raises_instead_of_returning_wrong_rows(tmp_path, kernels):
    path = tmp_path / "f.lance"
    table = write(path, atlas_like(20_000, np.random.default_rng(2)), "2.2")
    flat = FlatFile.open(str(path), table.column_names)
    assert flat is not None
    (page,) = flat._columns[0].mini  # the cell ids: run-length chunks
    data = bytearray(path.read_bytes())
    data[page.data_at] = 1  # the first chunk's level count: not 0
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="mini-block chunk"):
        read_ranges([FlatRange(flat, 0, 100)], kernels)
    flat.close()


@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
def test_the_loader_reads_a_2_2_atlas_without_lance_with_identical_tokens(
    tmp_path, flat_opens, read_paths
):
    path = write_dense(tmp_path / "a.slaf", random_counts(600, 80, seed=3, density=0.3),
                       max_rows_per_file=2_000)  # fmt: skip
    expression = lance.dataset(str(path / "expression.lance"))
    assert {f.file_minor_version for x in expression.get_fragments()
            for f in x.metadata.files} <= {1, 2}  # fmt: skip
    kernels = Kernels("numba")
    try:
        assert DataFiles.of(expression, COLUMNS, kernels=kernels, mini=True).flat
        assert not DataFiles.of(expression, COLUMNS, kernels=kernels).flat  # mini=False
        assert not DataFiles.of(expression, COLUMNS, mini=True).flat  # numpy: Lance's decoder
    finally:
        kernels.close()
    opened = flat_opens

    def run(**paths):
        read_paths(**paths)
        with Loader(open_dataset(path), sampler=BlockShuffle(block_size=3, fetch_factor=4),
                    batch_size=16, tokenizer="scgpt", max_genes=24, seed=5,
                    kernels="numba") as loader:  # fmt: skip
            return [{k: v.numpy() for k, v in batch.items()} for batch in loader]

    flat = run()  # on by default
    assert any(isinstance(f, FlatFile) for f in opened)  # the decoder was used
    n_opened = len(opened)
    without = run(mini=False)
    assert len(opened) == n_opened  # off: no 2.1+ file is tried flat
    through_lance = run(flat=False)
    assert len(flat) == len(through_lance) == len(without) > 0
    for x, y, z in zip(flat, through_lance, without, strict=True):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)
            np.testing.assert_array_equal(x[key], z[key], err_msg=key)


@pytest.mark.parametrize("version", VERSIONS)
def test_files_after_the_first_open_from_their_footers(tmp_path, kernels, version, lance_opens):
    rng = np.random.default_rng(23)
    tables = {}
    for i, n in enumerate([30_000, 70_001, 5_000, 300_001]):
        path = str(tmp_path / f"{i}.lance")
        tables[path] = write(path, atlas_like(n, rng), version, batch=7_777)
    odd = str(tmp_path / "odd.lance")  # full-width gene ids: plain chunks, not bit-packed
    columns = atlas_like(20_000, rng)
    columns["gene"] = rng.integers(0, 2**16, 20_000).astype(np.uint16)
    tables[odd] = write(odd, columns, version)
    through_lance = lance_opens
    files = FlatFiles()
    paths = list(tables)
    opened = [files.open(path, ["cell", "gene", "value"]) for path in paths]
    assert files.format is not None and files.format.layouts
    # The first, and (where this pylance lays it out otherwise) the full-width file
    assert through_lance in ([paths[0], odd], [paths[0]])
    for flat, path in zip(opened, paths, strict=True):
        assert flat is not None
        table = tables[path].select(["cell", "gene", "value"])
        n = table.num_rows
        ranges = [FlatRange(flat, int(a), int(min(n - a, 9_000))) for a in rng.integers(0, n, 20)]
        for (_, a, m), got in zip(ranges, read_ranges(ranges, kernels), strict=True):
            assert got.equals(table.slice(a, m)), (path, a, m)
        flat.close()


@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
def test_files_opened_before_the_decoder_is_loaded_are_read_by_lance_then_flat(
    tmp_path, monkeypatch
):
    path = write_dense(tmp_path / "a.slaf", random_counts(300, 40, seed=4, density=0.3),
                       max_rows_per_file=1_000)  # fmt: skip
    expression = lance.dataset(str(path / "expression.lance"))
    kernels = Kernels("numba")
    try:
        prepare_reads(kernels)
        loaded = False
        monkeypatch.setattr(Kernels, "ready", lambda self, name: loaded)
        files = DataFiles.of(expression, COLUMNS, kernels=kernels, mini=True, threads=1)
        assert files is not None and files.flat
        rows = np.array([[10, 500], [1_500, 2_200]], dtype=np.int64)
        want = [pa.Table.from_batches(list(x)) for x in files.read(rows, COLUMNS)]
        assert all(isinstance(e.reader, LanceFileReader) and e.provisional
                   for e in files._open.values())  # fmt: skip
        loaded = True
        got = [pa.Table.from_batches(list(x)) for x in files.read(rows, COLUMNS)]
        assert all(isinstance(e.reader, FlatFile) for e in files._open.values())
        assert all(a.equals(b) for a, b in zip(got, want, strict=True))
    finally:
        kernels.close()


@pytest.mark.skipif(MAJOR == 2, reason="pylance 2.x writes them as dictionary pages (Lance's)")
def test_eight_byte_constant_pages_with_the_top_bit_set(tmp_path, kernels):
    path = tmp_path / "c.lance"
    n = 3_000
    table = write(path, {"i": np.full(n, -1, np.int64), "f": np.full(n, -1.5, np.float64),
                         "u": np.full(n, 2**63 + 5, np.uint64)}, "2.2")  # fmt: skip
    flat = FlatFile.open(str(path), table.column_names)
    assert flat is not None
    ranges = [FlatRange(flat, 0, n), FlatRange(flat, 17, 100)]
    for (_, a, m), got in zip(ranges, read_ranges(ranges, kernels), strict=True):
        assert got.equals(table.slice(a, m))
    flat.close()


def test_each_kind_of_file_is_checked_once_and_a_table_of_none_is_given_up(tmp_path, lance_opens):
    rng = np.random.default_rng(5)
    v20, v22 = str(tmp_path / "a.lance"), str(tmp_path / "b.lance")
    write(v20, atlas_like(5_000, rng), "2.0")
    write(v22, atlas_like(5_000, rng), "2.2")
    files = FlatFiles()
    assert files.open(v20, ["gene"]) is not None and files.open(v22, ["gene"]) is not None
    assert files._checked == {False, True}  # the 2.2 file was row-checked too
    assert files.format is not None and files.format.open(str(tmp_path / "gone"), ["gene"]) is None
    nulls = str(tmp_path / "nulls.lance")
    with LanceFileWriter(nulls, pa.schema([("v", pa.uint32())]), version="2.2") as w:
        w.write_batch(pa.table({"v": pa.array([None, 1, 2] * 100, pa.uint32())}))
    none = FlatFiles()
    lance_opens.clear()
    assert all(none.open(nulls, ["v"]) is None for _ in range(40))
    assert len(lance_opens) == GIVE_UP  # then no more tries


def rle_chunk(values: list[int], lengths: list[int]) -> np.ndarray:
    """A 2.2 run-length chunk of u16 ``values`` and u8 run ``lengths``, as Lance lays it out."""

    def pad(b: bytes) -> bytes:
        return b + b"\xfe" * (-len(b) % 8)

    raw = np.asarray(values, "<u2").tobytes()
    head = pad(np.uint16(0).tobytes() + np.asarray([len(raw), len(lengths)], "<u4").tobytes())
    return np.frombuffer(head + pad(raw) + pad(bytes(lengths)), np.uint8).copy()


@pytest.mark.parametrize("alike", [False, True])
@pytest.mark.parametrize(
    ("lengths", "ok"), [([2, 3], True), ([2, 0, 3], False), ([2, 2], False), ([250, 250], True)]
)
def test_both_decoders_agree_on_run_length_chunks_good_and_bad(kernels, lengths, ok, alike):
    chunk = rle_chunk(list(range(7, 7 + len(lengths))), lengths)
    count = 5  # the chunk's rows: its page's chunks are alike (2**3 rows, the last 5), or not
    rows_at = [-1, 3, count] if alike else [0, 0, 0]
    job = [miniblock.RLE, 2, 16, 4, 0, 0, 1, 3, 0, 0, *rows_at]  # rows 1..3 of the chunk
    out = np.zeros(8, np.uint8)
    rows = [] if alike else [np.array([0, count])]
    decode = flat_reads._Decode(job, [np.array([0, len(chunk)])], rows)
    if not ok:
        with pytest.raises(ValueError, match="chunk"):
            decode.run(chunk, out, kernels)
        return
    decode.run(chunk, out, kernels)
    expected = np.repeat(np.arange(7, 7 + len(lengths)), lengths)[1:4]
    np.testing.assert_array_equal(out[:6].view("<u2"), expected)


@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
def test_a_window_is_read_and_decoded_by_one_kernel_call(tmp_path, monkeypatch):
    rng = np.random.default_rng(31)
    path = tmp_path / "a.lance"
    table = write(path, atlas_like(60_000, rng), "2.2")
    flat = FlatFile.open(str(path), table.column_names)
    assert flat is not None
    kernels = Kernels("numba")
    prepare_reads(kernels)
    ran: list[str] = []
    real = Kernels.run

    def spy(self, name, *args, **kw):
        done = real(self, name, *args, **kw)
        ran.append(name if done else f"not {name}")
        return done

    monkeypatch.setattr(Kernels, "run", spy)
    try:
        ranges = [FlatRange(flat, int(a), 3_000) for a in rng.integers(0, 57_000, 30)]
        for (_, a, m), got in zip(ranges, read_ranges(ranges, kernels), strict=True):
            assert got.equals(table.slice(a, m))
        assert ran == ["read_decode"]  # not pread_runs twice, then decode_chunks
    finally:
        kernels.close()
        flat.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_pages_read_the_same_with_each_chunks_rows_kept(tmp_path, kernels, version):
    """Lance's chunks hold 2**log rows each but the last, so an open page keeps its chunk
    offsets alone (MiniPage.log); a page whose chunks are not alike keeps each chunk's first
    row too. The two ways read the same rows."""
    rng = np.random.default_rng(23)
    for name in ["atlas", "small_pages", "odd_lengths", "long_runs", "one_row"]:
        columns, options = shapes(rng, version)[name]
        path = tmp_path / f"{name}.lance"
        table = write(path, columns, version, **options)
        flat = FlatFile.open(str(path), table.column_names)
        assert flat is not None, name
        alike = [m for c in flat._columns for m in c.mini if m.chunk_at is not None]
        assert alike or name == "one_row", name  # 2.2 writes one row as constant pages
        assert all(m.log > 0 and m.chunk_rows is None for m in alike), name
        kept = FlatFile.open(str(path), table.column_names)
        for column in kept._columns:
            pages = []
            for m in column.mini:
                if m.chunk_at is not None:
                    first = np.minimum(np.arange(len(m.chunk_at)) << m.log, m.rows)
                    m = replace(m, chunk_rows=first.astype(np.int32), log=0)
                pages.append(m)
            kept._columns[kept._columns.index(column)] = column._replace(mini=tuple(pages))
        n = table.num_rows
        starts = rng.integers(0, n, 30)
        ranges = [(int(a), int(min(n - a, rng.choice([1, 100, 1_024, 1_025, 5_000]))))
                  for a in starts] + [(0, n), (n - 1, 1)]  # fmt: skip
        for file in (flat, kept):
            got = read_ranges([FlatRange(file, a, m) for a, m in ranges], kernels)
            for (a, m), table_ in zip(ranges, got, strict=True):
                assert table_.equals(table.slice(a, m)), (name, a, m)
        flat.close()
        kept.close()


def test_alike_log_keeps_each_chunks_rows_unless_they_are_alike():
    logs = np.array
    assert miniblock.alike_log(logs([10, 10, 0]), 7) == 10
    assert miniblock.alike_log(logs([10, 10, 10]), 1024) == 10
    assert miniblock.alike_log(logs([10, 11, 0]), 7) == 0  # not alike
    assert miniblock.alike_log(logs([10, 0]), 2000) == 0  # a last chunk of more rows
    assert miniblock.alike_log(logs([0]), 5_000) == 13  # one chunk: 2**13 rows hold it
    assert miniblock.alike_log(logs([0]), 1) == 1
