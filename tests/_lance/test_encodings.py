"""Page encodings recognised from the protobuf messages of real files, field by field: what
the direct reader decodes, and nothing else (anything else reads through Lance)."""

from __future__ import annotations

import os
import warnings

import lance
import numpy as np
import pyarrow as pa
import pytest
from conftest import random_counts, write_dense
from lance.file import LanceFileReader, LanceFileWriter

from slafload._lance import encodings, miniblock
from slafload._lance.data_files import DataFiles
from slafload._lance.encodings import Constant, MiniBlock, flat_bits, page_layout, parse, unwrap
from slafload._lance.flat_pages import FlatFile
from slafload._lance.footers import read_footer
from slafload.errors import ReaderFallbackWarning
from slafload.kernels import Kernels, numba_available, prepare_reads
from slafload.pipeline.reader import COLUMNS

FLAT, BITPACK, RLE = encodings.FLAT, encodings.INLINE_BITPACKING, encodings.RLE
# What the installed pylance writes, as seen with 0.35.0, 1.0.4, 2.0.1, 3.0.2, 4.0.2, 9.0.1 and
# 14.0.2: from 2.0 on, 2.2 pages have u32 chunk words (has_large_chunk) and 2.1+ plain values
# (8-byte ones too) are flat, where earlier releases bit-pack them; from 3.0 on, a 2.2 page of
# one value is a constant page.
MAJOR = int(lance.__version__.split(".")[0])
LARGE_CHUNKS = MAJOR >= 2
CONSTANT_PAGES = MAJOR >= 3


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field(number: int, value: int | bytes) -> bytes:
    """One protobuf field: a varint, or length-delimited bytes."""
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


def wrapped(name: str, message: bytes) -> bytes:
    """A page's ``Encoding``: direct, an ``Any`` of the message ``name``."""
    return field(2, field(1, field(1, f"/{name}".encode()) + field(2, message)))


def flat21(bits: int) -> bytes:
    return field(FLAT, field(1, bits))


def mini_block(values: bytes, *, buffers=1, items=1000, extra=b"", layers=b"\x01") -> bytes:
    layout = field(3, values) + field(6, layers) + field(7, buffers) + field(9, items) + extra
    return wrapped(encodings.PAGE_LAYOUT, field(1, layout))


def pages(path) -> list[tuple[str, list]]:
    """Each column's name, and its pages' encoding messages (as the footer walk finds them)
    beside pylance's own text of them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        footer = read_footer(fd)
    finally:
        os.close(fd)
    meta = LanceFileReader(str(path)).metadata()
    return [
        (meta.schema.field(i).name,
         [(p.encoding, str(t.encoding)) for p, t in zip(walked, meta.columns[i].pages, strict=True)])
        for i, (_, walked) in enumerate(footer.columns())
    ]  # fmt: skip


def write(path, columns: dict[str, np.ndarray], version: str) -> None:
    table = pa.table(columns)
    with LanceFileWriter(str(path), table.schema, version=version) as writer:
        writer.write_batch(table)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, list[tuple[str, list]]]:
    """Files of every format, with columns whose pages pylance writes flat, bit-packed,
    as runs and (2.2) constant."""
    rng = np.random.default_rng(5)
    n = 20_000
    columns = {
        "runs": np.repeat(np.arange(n // 500, dtype=np.uint32), 500),
        "small": rng.integers(0, 40, n).astype(np.uint16),
        "floats": rng.standard_normal(n).astype(np.float32),
        "same": np.full(n, 9, np.uint16),
        "bytes": rng.integers(0, 256, n).astype(np.uint8),
    }
    out = {}
    for version in ("2.0", "2.1", "2.2"):
        path = tmp_path_factory.mktemp("encodings") / f"{version}.lance"
        write(path, columns, version)
        out[version] = pages(path)
    return out


def test_2_0_pages_are_flat_values_of_their_width(written):
    widths = {"runs": 32, "small": 16, "floats": 32, "same": 16, "bytes": 8}
    for name, found in written["2.0"]:
        for encoding, text in found:
            assert unwrap(encoding)[0] == encodings.ARRAY_ENCODING
            assert flat_bits(encoding) == widths[name], (name, text)
            assert page_layout(encoding) is None  # not a 2.1 message


@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_2_1_pages_are_recognised_as_pylance_describes_them(written, version):
    kinds = {FLAT: "Flat(", BITPACK: "InlineBitpacking(", RLE: "Rle("}
    seen = set()
    for name, found in written[version]:
        for encoding, text in found:
            assert flat_bits(encoding) is None, name  # not a 2.0 message
            layout = page_layout(encoding)
            assert layout is not None, (name, text)
            if isinstance(layout, Constant):
                assert "ConstantLayout" in text and name == "same"
                assert np.frombuffer(layout.value, np.uint16).tolist() == [9]
                seen.add("constant")
                continue
            # pylance's text, as an oracle independent of the decoder
            compressed = text.split("value_compression", 1)[1]
            assert (
                compressed.lstrip(": Some(")
                .split("compression: Some(")[1]
                .strip()
                .startswith(kinds[layout.compression])
            ), (name, text)
            assert (
                f"num_items: {layout.items}," in text
                and f"num_buffers: {layout.n_buffers}," in text
            )
            assert layout.large == ("has_large_chunk: true" in text)
            assert layout.large == (version == "2.2" and LARGE_CHUNKS)
            seen.add(layout.compression)
    assert {BITPACK, RLE} <= seen and (FLAT in seen or not LARGE_CHUNKS), seen
    assert ("constant" in seen) == (version == "2.2" and CONSTANT_PAGES), seen


def test_the_real_messages_round_trip_and_every_truncation_is_declined_not_raised(written):
    for version, columns in written.items():
        for _, found in columns:
            for encoding, _ in found:
                decode = flat_bits if version == "2.0" else page_layout
                assert decode(encoding) is not None
                for cut in range(len(encoding)):  # never an exception, never a wrong guess
                    decode(encoding[:cut])
                assert decode(encoding + b"\x00") is None  # field number 0


def constant_with(extra: bytes) -> bytes:
    """A ``ConstantLayout`` of one all-valid layer and the u16 value 7, and ``extra``."""
    return field(5, b"\x01") + field(6, b"\x07\x00") + extra


def test_each_recognised_layout_from_its_fields():
    rle = field(RLE, field(1, flat21(16)) + field(2, flat21(8)))
    assert page_layout(mini_block(flat21(32))) == MiniBlock(FLAT, 32, 1, False, 1000)
    assert page_layout(mini_block(field(BITPACK, field(1, 16)))) == MiniBlock(BITPACK, 16, 1,
                                                                             False, 1000)  # fmt: skip
    assert page_layout(mini_block(rle, buffers=2, extra=field(10, 1))) == MiniBlock(
        RLE, 16, 2, True, 1000
    )
    unpacked = mini_block(flat21(32), layers=b"", extra=field(6, 1))  # the layer as a varint
    assert page_layout(unpacked) == MiniBlock(FLAT, 32, 1, False, 1000)
    constant = wrapped(encodings.PAGE_LAYOUT, field(2, constant_with(b"")))
    assert page_layout(constant) == Constant(b"\x07\x00")
    # type URLs name the message whatever their prefix
    any_url = field(2, field(1, field(1, b"type.googleapis.com/lance.encodings21.PageLayout")
                             + field(2, field(1, field(3, flat21(8)) + field(6, b"\x01")))))  # fmt: skip
    assert page_layout(any_url) == MiniBlock(FLAT, 8, 0, False, 0)


@pytest.mark.parametrize(
    "message",
    [
        mini_block(flat21(32), extra=field(11, 1)),  # a field this Lance does not define
        mini_block(flat21(32), extra=field(4, flat21(32))),  # a dictionary
        mini_block(flat21(32), extra=field(5, 3)),  # dictionary items
        mini_block(flat21(32), extra=field(1, flat21(16))),  # repetition levels
        mini_block(flat21(32), extra=field(2, flat21(16))),  # definition levels
        mini_block(flat21(32), extra=field(8, 1)),  # a repetition index
        mini_block(flat21(32), layers=b"\x03"),  # nullable items
        mini_block(flat21(32), layers=b"\x01\x01"),  # two layers
        mini_block(flat21(32), extra=varint(6 << 3 | 5) + bytes(4)),  # a layer as a fixed32
        mini_block(flat21(32), extra=field(10, 2)),  # not a bool
        mini_block(field(FLAT, field(1, 32) + field(2, field(1, 2)))),  # zstd-compressed flat
        mini_block(field(BITPACK, field(1, 16) + field(2, b""))),  # compressed bit-packing
        mini_block(field(10, field(1, field(1, 2)) + field(3, flat21(32)))),  # General
        mini_block(field(RLE, field(1, flat21(16)) + field(2, flat21(16))), buffers=2),
        mini_block(field(RLE, field(1, field(BITPACK, field(1, 16))) + field(2, flat21(8)))),
        mini_block(flat21(32) + field(BITPACK, field(1, 16))),  # two compressions at once
        mini_block(field(3, b"")),  # Constant compression
        mini_block(flat21(32))[:-1],  # cut short
        wrapped(encodings.PAGE_LAYOUT, field(3, field(5, 32))),  # FullZipLayout
        wrapped(encodings.PAGE_LAYOUT, field(1, b"") + field(2, b"")),  # two layouts
        wrapped(encodings.PAGE_LAYOUT, field(2, field(5, b"\x01"))),  # all null: no value
        wrapped(encodings.PAGE_LAYOUT, field(2, constant_with(field(8, flat21(16))))),  # levels
        wrapped(encodings.PAGE_LAYOUT, field(2, constant_with(field(9, 3)))),  # rep values
        wrapped(encodings.PAGE_LAYOUT, field(2, constant_with(field(11, 1)))),  # unknown
        wrapped("lance.encodings21.Other", field(1, field(3, flat21(32)) + field(6, b"\x01"))),
        wrapped(encodings.ARRAY_ENCODING, field(1, field(1, 32) + field(2, b""))),  # 2.0
        field(1, field(1, 4) + field(2, 100)),  # an indirect encoding
        b"\xff" * 12,
        b"",
    ],
)
def test_anything_else_is_not_a_layout_the_decoder_reads(message):
    assert page_layout(message) is None
    assert miniblock.layout(message, 4) is None


def flat20(*, index=0, kind=0, compression=None, bits=32) -> bytes:
    buffer = (field(1, index) if index else b"") + (field(2, kind) if kind else b"")
    inner = field(1, bits) + field(2, buffer)
    if compression is not None:
        inner += field(3, field(1, compression))
    return field(1, inner)


def test_2_0_flat_values_bare_or_without_nulls_and_nothing_else():
    def no_nulls(array: bytes) -> bytes:
        return field(2, field(1, field(1, array)))

    name = encodings.ARRAY_ENCODING
    assert flat_bits(wrapped(name, flat20())) == 32
    assert flat_bits(wrapped(name, no_nulls(flat20(bits=16)))) == 16
    assert flat_bits(wrapped(name, no_nulls(flat20(compression=b"zstd")))) is None
    assert flat_bits(wrapped(name, no_nulls(flat20(index=1)))) is None  # another buffer
    assert flat_bits(wrapped(name, no_nulls(flat20(kind=1)))) is None  # a column buffer
    assert flat_bits(wrapped(name, field(2, field(2, field(2, flat20()))))) is None  # some nulls
    assert flat_bits(wrapped(name, field(1, field(1, 32)))) is None  # no buffer
    assert flat_bits(wrapped(name, field(10, field(1, 8) + field(2, 32)))) is None  # bit-packed
    assert flat_bits(wrapped(name, flat20() + field(22, 1))) is None
    assert flat_bits(wrapped(encodings.PAGE_LAYOUT, flat20())) is None


def test_parse_reads_every_wire_type_and_rejects_groups():
    message = field(1, 5) + field(2, b"ab") + varint(3 << 3 | 1) + bytes(8) + varint(4 << 3 | 5)
    assert parse(message + bytes(4)) == {1: [(0, 5)], 2: [(2, b"ab")], 3: [(1, 0)], 4: [(5, 0)]}
    assert parse(message + bytes(3)) is None  # a fixed32 cut short
    assert parse(varint(5 << 3 | 3)) is None  # a group
    assert parse(field(1, 2**64 - 1)) == {1: [(0, 2**64 - 1)]}
    assert parse(varint(1 << 3) + b"\xff" * 10 + b"\x01") is None  # over 10 bytes


@pytest.mark.parametrize("hint", [None, "zstd"])
@pytest.mark.skipif(not numba_available(), reason="numba is not installed")
def test_pages_the_decoder_does_not_read_fall_back_to_lance_with_one_warning(tmp_path, hint):
    dense = random_counts(60, 20, seed=4, density=0.4)
    table = lance.dataset(str(write_dense(tmp_path / "d.slaf", dense) / "expression.lance"))
    table = table.to_table(columns=COLUMNS)
    meta = {"lance-encoding:compression": hint} if hint else None
    value = pa.field("value", pa.float32(), metadata=meta)  # zstd: General(zstd) chunks
    table = table.cast(pa.schema([value if f.name == "value" else f for f in table.schema]))
    uri = str(tmp_path / "t.lance")
    lance.write_dataset(table, uri, data_storage_version="2.2", max_rows_per_file=200)
    kernels = Kernels("numba")  # 2.1+ pages are read flat by its decoder only
    prepare_reads(kernels)
    try:
        files = DataFiles.of(lance.dataset(uri), COLUMNS, kernels=kernels, mini=True)
        assert files is not None and files.flat
        rows = np.array([[3, 50], [180, 420]])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [pa.Table.from_batches(list(b)) for b in files.read(rows, COLUMNS)]
            got += [pa.Table.from_batches(list(b)) for b in files.read(rows, COLUMNS)]
    finally:
        kernels.close()
    if hint:
        (warning,) = caught
        assert warning.category is ReaderFallbackWarning
        assert "flat reader does not decode" in str(warning.message)
    else:
        assert not caught
    readers = [entry.reader for entry in files._open.values()]
    assert readers and all(isinstance(r, FlatFile) != bool(hint) for r in readers)
    for (a, b), part in zip(rows.tolist() * 2, got, strict=True):
        assert part.equals(table.slice(a, b - a))
