"""Benchmark helpers: the cached synthetic atlas is reused only when it matches the request."""

from __future__ import annotations

import argparse

from slafload.bench import ensure_atlas


def test_a_cached_atlas_is_reused_when_it_matches_and_rewritten_when_it_does_not(tmp_path):
    args = argparse.Namespace(cells=60, genes=30, plates=3, nnz=5, data=str(tmp_path))
    path = ensure_atlas(args)
    written = (path / "config.json").stat().st_mtime_ns
    assert ensure_atlas(args) == path
    assert (path / "config.json").stat().st_mtime_ns == written  # reused, not rewritten

    (path / "config.json").write_text("{}")  # no generator record: cannot be trusted
    assert ensure_atlas(args) == path
    assert "generator" in (path / "config.json").read_text()
