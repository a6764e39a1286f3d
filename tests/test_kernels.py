"""Compiled kernels (numba) give the numpy code's results, in the loader and alone."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import slafload
import slafload.kernels
from slafload.kernels import Kernels, numba_available
from slafload.pipeline.buffers import RowBuffers, copy_aligned_runs
from slafload.pipeline.ranking import rank_by_keys, rank_counts
from slafload.tokenizers import quantile_bins
from slafload.tokenizers.builtin import _mask
from slafload.types import RankedChunk

needs_numba = pytest.mark.skipif(not numba_available(), reason="numba is not installed")


def ranked_values(dtype, seed: int, n_cells: int = 300) -> RankedChunk:
    """A piece of cells whose values are in rank order (descending), with empty cells,
    single-value cells, all-equal cells and many ties."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 60, n_cells)
    lengths[::17] = 0
    lengths[1::19] = 1
    cells = []
    for i, n in enumerate(lengths):
        if np.dtype(dtype).kind == "f":
            v = np.round(rng.lognormal(0, 1.2, n), 1) + 0.1
        else:
            v = rng.integers(1, 40 if i % 2 else 3, n)
        if i % 23 == 5:
            v[:] = v[0] if n else v
        cells.append(np.sort(v.astype(dtype))[::-1])
    values = np.concatenate(cells)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    genes = np.arange(len(values), dtype=np.uint16) % 1000
    ids = np.arange(n_cells, dtype=np.int64)
    return RankedChunk(0, ids, indptr, genes, values, rng.permutation(n_cells))


@needs_numba
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.int64, np.float32, np.float64])
@pytest.mark.parametrize(("n_bins", "offset", "out_dtype"), [(3, 0, np.int64), (11, 7, np.uint8),
                                                             (51, 50_000, np.uint16)])  # fmt: skip
def test_compiled_quantile_bins_equal_numpy(dtype, n_bins, offset, out_dtype):
    ranked = ranked_values(dtype, seed=n_bins)
    want = quantile_bins(ranked, n_bins, offset, out_dtype)
    out = np.full(len(ranked.values), 255, dtype=out_dtype)
    got = quantile_bins(ranked, n_bins, offset, out_dtype, out, Kernels("numba"))
    assert got is out
    np.testing.assert_array_equal(got, want)


@needs_numba
@pytest.mark.parametrize(
    ("gene_type", "value_type", "top"),
    [(np.uint16, np.float32, 0), (np.int32, np.float32, 0), (np.uint8, np.uint64, 200),
     (np.int32, np.uint64, 1 << 20)],
)  # fmt: skip  # 48- and 64-bit keys of floats; 32- and 64-bit keys of uint64 (not counts')
def test_compiled_rank_sort_equals_numpy(gene_type, value_type, top):
    rng = np.random.default_rng(top)
    lengths = rng.integers(0, 300, 200)
    lengths[::13], lengths[1::17] = 0, 1  # empty and single-entry cells
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # Genes ascending in most cells, as a chunk holds them, and in any order in every third.
    cells = [rng.permutation(20_000)[:n] for n in lengths]
    cells = [g if i % 3 == 0 else np.sort(g) for i, g in enumerate(cells)]
    genes = np.concatenate(cells).astype(gene_type)
    if top:
        values = rng.integers(1, top, len(genes), endpoint=True).astype(value_type)
    else:
        values = (rng.lognormal(0, 1.5, len(genes)) + 0.01).astype(value_type)
    values[indptr[5] : indptr[6]] = values[indptr[5]]  # a cell of one value: ties by gene
    want = rank_by_keys(indptr, genes, values, Kernels("numpy"))
    got = rank_by_keys(indptr, genes, values, Kernels("numba"))
    assert want is not None and got is not None
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@needs_numba
@pytest.mark.parametrize(
    ("gene_type", "value_type", "top"),
    [(np.uint16, np.uint16, 40), (np.uint16, np.uint16, 65_535), (np.uint16, np.uint8, 255),
     (np.int32, np.int64, 1 << 40), (np.int32, np.int64, (1 << 62) + 12_345),
     (np.int64, np.int32, 300)],
)  # fmt: skip  # counts within one pass's 256 buckets, and far beyond them
def test_compiled_count_ranking_equals_numpy(gene_type, value_type, top):
    rng = np.random.default_rng(top)
    lengths = rng.integers(0, 300, 200)
    lengths[::13], lengths[1::17], lengths[2::19] = 0, 1, 3  # empty, single, under 4 entries
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    genes = np.concatenate([np.sort(rng.permutation(20_000)[:n]) for n in lengths])
    genes = genes.astype(gene_type)  # ascending in each cell, as a chunk holds them
    # Mostly small counts with ties (one bucket each), a few far above a cell's lowest.
    values = rng.geometric(0.4, len(genes))
    high = rng.random(len(genes)) < 0.05
    values[high] = rng.integers(1, top, high.sum(), endpoint=True)
    values = values.astype(value_type)
    values[indptr[5] : indptr[6]] = values[indptr[5]]  # a cell of one value: ties by gene
    values[indptr[7] : indptr[8]] = top  # a cell of one high value
    want = (np.empty_like(genes), np.empty_like(values))
    for start, stop in itertools.pairwise(indptr):  # values down, genes up
        cell = slice(start, stop)
        order = np.lexsort((genes[cell], -values[cell].astype(np.int64)))
        want[0][cell], want[1][cell] = genes[cell][order], values[cell][order]
    got = rank_counts(indptr, genes, values, Kernels("numba"))
    assert got is not None
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    # A cell whose genes do not ascend (never in a chunk): left to rank_by_keys, whole.
    genes[indptr[9] : indptr[10]] = genes[indptr[9] : indptr[10]][::-1]
    assert rank_counts(indptr, genes, values, Kernels("numba")) is None


def test_count_ranking_leaves_floats_and_uint64_to_the_keys():
    indptr, genes = np.array([0, 2]), np.array([3, 1], dtype=np.uint16)
    for values in (np.array([1.0, 2.0], np.float32), np.array([1, 2], np.uint64)):
        assert rank_counts(indptr, genes, values, Kernels("auto")) is None
    assert rank_counts(indptr, genes, np.array([1, 2], np.uint16), Kernels("numpy")) is None


@needs_numba
@pytest.mark.parametrize("n_pairs", [1, 2, 3])
def test_compiled_run_copies_equal_numpy(n_pairs):
    rng = np.random.default_rng(n_pairs)
    sources = [rng.integers(0, 60_000, 5_000).astype(np.uint16),
               rng.random(5_000).astype(np.float32), np.arange(5_000)]  # fmt: skip
    counts = rng.integers(0, 40, 100)
    src = rng.integers(0, 5_000 - 40, 100)
    dst = np.arange(100, dtype=np.int64) * 50 + 1

    def copied(kernels):
        outs = [np.full(5_000, -1, np.int64), np.zeros(5_000, np.float32), np.zeros(5_000)]
        pairs = list(zip(outs, sources, strict=True))[:n_pairs]
        copy_aligned_runs(pairs, dst, src, counts, kernels)
        return outs

    for got, want in zip(copied(Kernels("numba")), copied(Kernels("numpy")), strict=True):
        np.testing.assert_array_equal(got, want)


@needs_numba
@pytest.mark.parametrize(("dtype", "pad"), [(np.int64, 0), (np.int64, -1), (np.float32, 0),
                                            (bool, False)])  # fmt: skip
def test_compiled_repad_restores_padding_of_reused_rows(dtype, pad):
    rng = np.random.default_rng(0)
    buffers, kernels = RowBuffers(keep=1), Kernels("numba")
    for _ in range(4):
        ends = rng.integers(0, 30, 40)
        rows = buffers.rows("x", ends, 30, np.dtype(dtype), pad, kernels)
        mask = np.arange(30)[None, :] < ends[:, None]
        assert (rows[~mask] == pad).all()
        rows[mask] = not pad if dtype is bool else 7  # write every token, as a tokenizer does
        del rows


@needs_numba
def test_compiled_attention_masks_are_true_exactly_before_each_rows_end():
    # Rows reused piece after piece, longer and shorter: the kernel writes each row's true
    # columns, the re-pad clears what a longer row left.
    rng = np.random.default_rng(2)
    buffers, kernels = RowBuffers(keep=1), Kernels("numba")
    for n in (40, 40, 17, 40, 3):
        ends = rng.integers(0, 31, n)
        ends[: n // 4] = 30  # full rows
        mask = _mask(buffers, ends, 30, kernels)
        np.testing.assert_array_equal(mask, np.arange(30)[None, :] < ends[:, None])
        assert mask.dtype == bool and mask.shape == (n, 30)
        del mask
    numpy = _mask(RowBuffers(), ends, 30)
    np.testing.assert_array_equal(numpy, np.arange(30)[None, :] < ends[:, None])


@needs_numba
def test_auto_compiles_in_the_background_and_close_joins_the_thread():
    ranked = ranked_values(np.float32, seed=3)
    want = quantile_bins(ranked, 51)
    # Compile threads of other tests' Kernels end when those are collected, not here (one
    # was still alive here in one CI run): this test owns the threads started from now on.
    before = _jit_threads()
    kernels = Kernels("auto")
    assert kernels.backend == "numba"
    ran, deadline = False, time.monotonic() + 120
    while not ran and time.monotonic() < deadline:
        out = np.zeros(len(ranked.values), np.int64)
        ran = kernels.run("quantile_bins", ranked.values, ranked.indptr, 51, 0, out)
        if ran:
            np.testing.assert_array_equal(out, want)
        else:
            assert not out.any()  # not touched: the caller runs numpy
            time.sleep(0.01)
    assert ran
    kernels.close()
    assert kernels._compiler is None and not _jit_threads() - before
    out = np.zeros(len(ranked.values), np.int64)  # what was compiled outlives the thread
    assert kernels.run("quantile_bins", ranked.values, ranked.indptr, 51, 0, out)
    assert kernels._compiler is None and not _jit_threads() - before
    np.testing.assert_array_equal(out, want)


def _jit_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("slafload-jit")}


@needs_numba
def test_a_kernel_that_fails_to_compile_warns_once_and_leaves_numpy_to_it():
    kernels = Kernels("auto")
    args = (np.zeros(3), np.zeros(3), np.zeros(1, np.int64), np.zeros(1, np.int64),
            np.zeros(1, np.int64))  # fmt: skip
    with pytest.warns(RuntimeWarning, match="could not compile no_such_kernel"):
        deadline = time.monotonic() + 120
        while kernels._background(("no_such_kernel",), slafload.kernels._compile,
                                  ("no_such_kernel",)) is None and time.monotonic() < deadline:  # fmt: skip
            if ("no_such_kernel",) in kernels._failed:
                break
            time.sleep(0.01)
    assert ("no_such_kernel",) in kernels._failed
    assert not kernels.run("no_such_kernel", *args)  # no second warning (filterwarnings=error)
    kernels.close()
    strict = Kernels("numba")
    with pytest.raises(KeyError):
        strict.run("no_such_kernel", *args)
    strict.close()


def test_numpy_backend_and_float16_never_compile():
    before = _jit_threads()
    kernels = Kernels("numpy")
    values = np.array([3, 2, 1], np.float32)
    assert not kernels.run("quantile_bins", values, np.array([0, 3]), 5, 0, np.zeros(3))
    assert not Kernels("auto").run("quantile_bins", values.astype(np.float16),
                                   np.array([0, 3]), 5, 0, np.zeros(3))  # fmt: skip
    assert not _jit_threads() - before


def test_kernels_setting_is_validated(monkeypatch):
    with pytest.raises(ValueError, match="kernels must be one of"):
        slafload.LoaderConfig(kernels="cython")
    monkeypatch.setattr(slafload.kernels, "numba_available", lambda: False)
    with pytest.raises(ImportError, match="slafload\\[fast\\]"):
        Kernels("numba")
    assert Kernels("auto").backend == "numpy"


@pytest.fixture(scope="module")
def atlas(tmp_path_factory):
    path = tmp_path_factory.mktemp("kernels") / "atlas.slaf"
    slafload.synthetic.write_atlas(path, n_cells=1_500, n_genes=800, n_plates=3, seed=2)
    return slafload.open_dataset(path)


def batches(ds, tokenizer: str, layout: str, kernels: str) -> list[dict]:
    opts = dict(batch_size=48, max_genes=96, seed=4, n_epochs=2, tuning=slafload.Tuning(piece_cells=256),
                chunk_cells=512, layout=layout, kernels=kernels)  # fmt: skip
    with slafload.Loader(ds, tokenizer=tokenizer, **opts) as loader:
        return [{k: v.clone() for k, v in b.items()} for b in loader]


@needs_numba
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("tokenizer", ["geneformer", "scgpt", "raw"])
def test_loader_tokens_are_the_same_with_compiled_kernels(
    atlas, tokenizer, layout, monkeypatch, no_thread_leak
):
    compiled = []
    compile_ = slafload.kernels._compile

    def spy(key, *args):
        compiled.append(key[0])
        return compile_(key, *args)

    monkeypatch.setattr(slafload.kernels, "_compile", spy)
    monkeypatch.setattr(slafload.kernels, "_COMPILED", {})  # as in a new process
    want = batches(atlas, tokenizer, layout, "numpy")
    assert not compiled
    got = batches(atlas, tokenizer, layout, "numba")
    expected = {"copy_runs_1" if tokenizer == "geneformer" else "copy_runs_2", "rank_counts"}
    expected |= {"quantile_bins"} if tokenizer == "scgpt" else set()
    expected |= {"fill_runs"} if layout == "padded" else set()
    assert expected <= set(compiled)
    assert len(got) == len(want) == 2 * -(-1_500 // 48)
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and a[key].equal(b[key]), key


@needs_numba
def test_warm_up_loads_numba_and_leaves_no_thread():
    before = _jit_threads()
    assert slafload.kernels.warm_up()
    assert not _jit_threads() - before
    ranked = ranked_values(np.uint16, seed=5)
    kernels = Kernels("numba")
    out = np.zeros(len(ranked.values), np.int64)
    assert kernels.run("quantile_bins", ranked.values, ranked.indptr, 51, 0, out)
    kernels.close()
    np.testing.assert_array_equal(out, quantile_bins(ranked, 51))


_COLD_COMPILE = """
import json, sys
import numpy as np
import slafload.kernels as k

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

kernels = k.Kernels("numba")
z, b = np.zeros(0, np.int64), np.zeros(0, np.uint8)
kernels.prepare("decode_chunks", b, np.zeros((0, 10), np.int64), z, z, z,
                np.zeros(0, np.uint64), b, np.zeros(1, np.int64))
key = next(key for key in k._COMPILED if key[0] == "decode_chunks")
before = rss()
k._MALLOC_TRIM(0)
print(json.dumps({"misses": sum(k._COMPILED[key].stats.cache_misses.values()),
                  "freed_mb": before - rss()}))
"""


@needs_numba
@pytest.mark.skipif(
    slafload.kernels._MALLOC_TRIM is None or not Path("/proc/self/statm").exists(),
    reason="glibc's malloc_trim and /proc are Linux's",
)
def test_a_kernel_compiled_here_hands_what_the_compiler_freed_back_to_the_system(tmp_path):
    # Compiled rather than loaded from numba's cache (an empty cache directory), a kernel
    # leaves what LLVM freed in glibc's arenas (decode_chunks: ~9 MB, the footer walk ~160):
    # the compile returns it, so a second trim finds next to nothing.
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _COLD_COMPILE], env=env, capture_output=True,
                         text=True, timeout=300, check=True)  # fmt: skip
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["misses"] == 1  # compiled in this process, not loaded
    assert got["freed_mb"] < 3


def test_warm_up_without_numba_says_so(monkeypatch):
    monkeypatch.setattr(slafload.kernels, "numba_available", lambda: False)
    assert not slafload.kernels.warm_up()


@needs_numba
def test_loaders_share_what_was_compiled_so_a_new_loader_runs_it_at_once():
    ranked = ranked_values(np.uint32, seed=8)
    before = _jit_threads()
    first = Kernels("numba")
    out = np.zeros(len(ranked.values), np.int64)
    assert first.run("quantile_bins", ranked.values, ranked.indptr, 11, 0, out)
    first.close()
    later = Kernels("auto")  # would run numpy while compiling, had nothing been shared
    again = np.zeros(len(ranked.values), np.int64)
    assert later.run("quantile_bins", ranked.values, ranked.indptr, 11, 0, again)
    assert not _jit_threads() - before
    np.testing.assert_array_equal(again, out)


@needs_numba
def test_compiled_bins_never_write_past_a_short_out():
    ranked = ranked_values(np.uint16, seed=9)
    big = np.zeros(len(ranked.values) + 100, np.int64)
    with pytest.raises(ValueError):  # numpy's slicing says so; the kernel is not called
        quantile_bins(ranked, 51, 0, np.int64, big[:10], Kernels("numba"))
    assert not big[10:].any()


def test_scgpt_subclass_with_its_own_value_tokens_still_works():
    class Shifted(slafload.tokenizers.ScGPT):
        def value_tokens(self, ranked):  # the signature from before kernels existed
            return super().value_tokens(ranked) + 1

    ranked = ranked_values(np.uint16, seed=10)
    plain = slafload.tokenizers.ScGPT(max_genes=16)(ranked)
    shifted = Shifted(max_genes=16)(ranked, kernels=Kernels("auto"))
    real = plain["attention_mask"] & (np.arange(18) > 0)
    real &= plain["input_ids"] != slafload.tokenizers.SEP
    np.testing.assert_array_equal(shifted["values"][real], plain["values"][real] + 1)


@needs_numba
def test_compiled_copies_never_write_past_their_arrays():
    big = np.zeros(100, np.int64)
    with pytest.raises(ValueError):  # the numpy loop's error; the kernel is not called
        copy_aligned_runs([(big[:10], np.arange(50))], np.array([5]), np.array([0]),
                          np.array([20]), Kernels("numba"))  # fmt: skip
    assert not big[10:].any()
