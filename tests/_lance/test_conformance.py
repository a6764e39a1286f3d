"""Expression tables written in the ways users and converters write them (file formats, id and
value types, Lance's encoding hints), read on every read path exactly as Lance reads them, each
data file by the path expected for its pages: the direct reader's decoder where it recognises
them, Lance's own file reader (with one warning) where it does not."""

from __future__ import annotations

import os
import shutil
import warnings

import lance
import numpy as np
import pyarrow as pa
import pytest
import test_fragments
from conftest import random_counts, write_dense
from test_encodings import CONSTANT_PAGES, LARGE_CHUNKS
from test_fragments import (
    assert_every_path_reads_as_lance,
    delete_rows,
    lance_rows,
    paths,
    read_all,
    slaf_with_other,
)

from slafload import open_dataset
from slafload._lance.encodings import Constant, page_layout
from slafload._lance.flat_pages import FlatFile
from slafload._lance.footers import read_footer
from slafload.errors import ReaderFallbackWarning
from slafload.kernels import numba_available
from slafload.pipeline.reader import COLUMNS, Reader
from slafload.samplers import BlockShuffle

pytestmark = [
    pytest.mark.usefixtures("no_thread_leak"),
    pytest.mark.skipif(not numba_available(), reason="numba is not installed"),
]
N_CELLS, N_GENES = 300, 40
COUNTS = (pa.uint32(), pa.uint16(), pa.uint16())  # slafdb's converter, integer counts
FLOATS = (pa.int32(), pa.int32(), pa.float32())  # slafdb's converter, float data
WIDE = (pa.int64(), pa.int32(), pa.float64())
ZSTD = {"lance-encoding:compression": "zstd"}
numba_kernels = test_fragments.numba_kernels  # the fixture, shared

WAYS = {  # name: format, (cell, gene, value) types, value's field metadata, read flat
    "2.0 counts": ("2.0", COUNTS, None, True),
    "2.0 wide": ("2.0", WIDE, None, True),
    "2.0 zstd hint": ("2.0", FLOATS, ZSTD, True),  # 2.0 ignores the hint: flat pages
    "2.1 counts": ("2.1", COUNTS, None, True),
    "2.1 floats": ("2.1", FLOATS, None, True),
    "2.1 byte stream split": ("2.1", FLOATS, {"lance-encoding:bss": "on"}, True),
    "2.1 zstd": ("2.1", FLOATS, ZSTD, False),  # General(zstd) chunks: Lance decodes
    "2.2 counts": ("2.2", COUNTS, None, True),
    "2.2 floats": ("2.2", FLOATS, None, True),
    "2.2 wide": ("2.2", WIDE, None, not LARGE_CHUNKS),  # then 8-byte values are dictionaries
    "2.2 dictionary": ("2.2", COUNTS, {"lance-encoding:dict-divisor": "1"}, True),
    "2.2 zstd": ("2.2", FLOATS, ZSTD, False),
    "2.2 lz4": ("2.2", FLOATS, {"lance-encoding:compression": "lz4"}, False),
}


def rewrite(path, version: str, types, hint: dict | None) -> None:
    """Rewrite ``path``'s expression table in ``version`` with columns of ``types`` (the
    value's field carrying ``hint``), in many data files; a stretch of equal values makes a
    file's value pages constant where the format has such pages.
    """
    uri = str(path / "expression.lance")
    table = lance.dataset(uri).to_table(columns=COLUMNS)
    shutil.rmtree(uri)
    value = table.column("value").to_numpy().copy()
    value[400:800] = 3  # the second data file's values
    fields = [pa.field(n, t, nullable=False) for n, t in zip(COLUMNS, types, strict=True)]
    fields[2] = fields[2].with_metadata(hint) if hint else fields[2]
    columns = [table.column(0), table.column(1), pa.array(value)]
    table = pa.table([c.cast(f.type) for c, f in zip(columns, fields, strict=True)],
                     schema=pa.schema(fields))  # fmt: skip
    lance.write_dataset(table, uri, data_storage_version=version, max_rows_per_file=400)


def value_layouts(path) -> set[type]:
    """The kinds of the value column's pages in every data file (the decoder's reading)."""
    found = set()
    for fragment in lance.dataset(str(path / "expression.lance")).get_fragments():
        for data in fragment.metadata.files:
            fd = os.open(str(path / "expression.lance" / "data" / data.path), os.O_RDONLY)
            try:
                _, pages = read_footer(fd).columns()[COLUMNS.index("value")]
            finally:
                os.close(fd)
            found |= {type(page_layout(page.encoding)) for page in pages}
    return found


@pytest.mark.parametrize("way", sorted(WAYS))
def test_a_table_written_each_way_reads_as_lance_reads_it_on_every_path(
    tmp_path, numba_kernels, way
):
    version, types, hint, flat = WAYS[way]
    dense = random_counts(N_CELLS, N_GENES, seed=11, density=0.35, empty_every=13)
    path = write_dense(tmp_path / "d.slaf", dense)
    rewrite(path, version, types, hint)
    dataset = open_dataset(path)
    plan = list(
        BlockShuffle(block_size=2, fetch_factor=4, batch_size=8).plan(N_CELLS, seed=4, epoch=0)
    )
    if version == "2.2" and hint is None and CONSTANT_PAGES:
        assert Constant in value_layouts(path), way  # the equal stretch: a constant page
    want = lance_rows(dataset, plan)
    for name, options in paths(numba_kernels).items():
        reader = Reader(dataset, options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = read_all(reader, plan)
        fallback = [w for w in caught if issubclass(w.category, ReaderFallbackWarning)]
        files = reader.data_files()
        # the path named is the one taken: every file read flat, or (pages the decoder does
        # not read) some left to Lance, with one warning
        tried_flat = name == "flat numba" or (name == "flat numpy" and version == "2.0")
        if files is not None:
            kinds = {isinstance(e.reader, FlatFile) for e in files._open.values()}
            assert kinds == {True} if tried_flat and flat else False in kinds, (name, kinds)
        assert len(fallback) == (tried_flat and not flat), (name, [str(w.message) for w in caught])
        for column in COLUMNS:
            theirs = want.column(column).to_numpy()
            assert np.array_equal(got.column(column).to_numpy(), theirs), (name, column)
            assert got.column(column).type == want.column(column).type, (name, column)


def compact(path) -> None:
    lance.dataset(str(path / "expression.lance")).optimize.compact_files(
        target_rows_per_fragment=2_000
    )


REWRITES = {  # a table's data files rewritten by Lance after writing
    "compacted": compact,
    "deleted, then compacted": lambda path: (delete_rows(path, "other % 11 = 0"), compact(path)),
}


@pytest.mark.parametrize("version", ["2.0", "2.2"])
@pytest.mark.parametrize("rewrite", sorted(REWRITES))
def test_a_rewritten_table_reads_as_lance_reads_it_on_every_path(
    tmp_path, numba_kernels, version, rewrite
):
    path = slaf_with_other(tmp_path, version)
    uri = str(path / "expression.lance")
    before = len(lance.dataset(uri).get_fragments())
    REWRITES[rewrite](path)
    fragments = lance.dataset(uri).get_fragments()
    assert len(fragments) < before  # merged, the deleted rows left out of the new files
    assert all(f.metadata.deletion_file is None for f in fragments)
    assert_every_path_reads_as_lance(path, numba_kernels, version, warns=False)


@pytest.mark.parametrize("version", ["2.0", "2.2"])
def test_a_pinned_version_reads_its_own_rows_after_later_deletes_and_compaction(
    tmp_path, numba_kernels, version
):
    path = slaf_with_other(tmp_path, version)
    uri = str(path / "expression.lance")
    pinned = lance.dataset(uri).version
    lance.dataset(uri).delete("other % 7 = 0")  # later versions: deletion files, new files
    compact(path)
    lance.dataset(uri).delete("cell_integer_id = 3")
    assert lance.dataset(uri).version > pinned + 2
    assert lance.dataset(uri, version=pinned).count_rows() > lance.dataset(uri).count_rows()
    assert_every_path_reads_as_lance(path, numba_kernels, version, warns=False, pin=pinned)
