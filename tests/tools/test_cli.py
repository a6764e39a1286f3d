"""The `slafload` command line, run through its real entry points in subprocesses."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import random_counts, write_dense

from slafload import open_dataset
from slafload.tools.cli import main

ad = pytest.importorskip("anndata", exc_type=ImportError)
pd = pytest.importorskip("pandas", exc_type=ImportError)
sp = pytest.importorskip("scipy.sparse", exc_type=ImportError)


def slafload_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slafload.tools.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


@pytest.fixture(scope="module")
def h5ads(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    counts = random_counts(40, 12, seed=3, empty_every=9)
    paths = []
    for i, part in enumerate((counts[:25], counts[25:])):
        obs = pd.DataFrame(
            {"plate": pd.Categorical([f"plate_{j % 3}" for j in range(len(part))])},
            index=[f"f{i}_c{j}" for j in range(len(part))],
        )
        adata = ad.AnnData(sp.csr_matrix(part.astype(np.int32)), obs=obs)
        adata.var_names = [f"G{g}" for g in range(12)]
        paths.append(root / f"part{i}.h5ad")
        adata.write_h5ad(paths[-1])
    return counts, paths


def test_importing_slafload_and_its_command_line_leaves_torch_unimported():
    # torch takes seconds to import: `slafload --help`, conversion and inspection skip it
    code = "import sys, slafload, slafload.tools.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_help_describes_every_command(capsys):
    run = slafload_cli("--help")
    assert run.returncode == 0
    for command in ("convert", "info", "optimize", "synth", "bench"):
        assert command in run.stdout
    with pytest.raises(SystemExit) as exited:
        main(["convert", "--help"])
    assert exited.value.code == 0
    convert_help = capsys.readouterr().out
    assert (
        "--shuffle-seed" in convert_help and "--layer" in convert_help and "--raw" in convert_help
    )


def test_convert_then_info_describe_the_same_dataset(tmp_path, h5ads):
    counts, paths = h5ads
    out = tmp_path / "atlas.slaf"
    run = slafload_cli("convert", *paths, out, "--shuffle-seed", "1", "--no-progress")
    assert run.returncode == 0, run.stderr
    assert f"{len(counts)} cells x 12 genes" in run.stdout
    assert "(uint16, counts)" in run.stdout
    ds = open_dataset(out)
    assert ds.n_rows == np.count_nonzero(counts)
    assert sorted(ds.obs()["original_index"].to_list()) == list(range(len(counts)))

    info = slafload_cli("info", out)
    assert info.returncode == 0, info.stderr
    assert "cells      40" in info.stdout and "genes      12" in info.stdout
    assert f"non-zeros  {np.count_nonzero(counts)}" in info.stdout
    assert "plate: String, 3 distinct: plate_0, plate_1, plate_2" in info.stdout
    assert f"kind       counts (recorded in config.json), range [1, {counts.max()}]" in info.stdout
    assert "source: String, 2 distinct: part0, part1" in info.stdout
    assert "expression: version 1, 1 fragment(s)" in info.stdout
    assert "format     Lance 2.2 (the expression table's data files); `slafload optimize`" in (
        info.stdout
    )


def test_convert_and_info_say_when_values_are_not_counts(tmp_path, capsys):
    dense = random_counts(20, 12, seed=5)
    logged = np.log1p(dense / np.maximum(dense.sum(1, keepdims=True), 1) * 1e4)
    h5ad = tmp_path / "logged.h5ad"
    ad.AnnData(sp.csr_matrix(logged.astype(np.float32))).write_h5ad(h5ad)
    assert main(["convert", str(h5ad), str(tmp_path / "l.slaf"), "--no-progress"]) == 0
    assert "(float, not counts: presets that normalise counts warn)" in capsys.readouterr().out
    assert main(["info", str(tmp_path / "l.slaf")]) == 0
    assert "kind       non-integer (recorded in config.json), range [" in capsys.readouterr().out
    write_dense(tmp_path / "old.slaf", dense)  # no record: decided by the value type
    assert main(["info", str(tmp_path / "old.slaf")]) == 0
    assert "kind       counts (uint16 values; not recorded in config.json)" in (
        capsys.readouterr().out
    )


def test_a_missing_input_prints_one_line_and_exits_2(tmp_path):
    run = slafload_cli("convert", tmp_path / "nope.h5ad", tmp_path / "out.slaf")
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "Traceback" not in run.stderr
    assert "nope.h5ad" in run.stderr and "does not exist" in run.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["info", "{tmp}"], "config.json' is missing"),
        (["info", "{tmp}/absent"], "does not exist"),
        (["convert", "only.slaf"], "at least one input"),
        (["convert", "{h5ad}", "{tmp}/x.slaf", "--layer", "counts"], "no layer 'counts'"),
        (["convert", "{h5ad}", "{tmp}"], "already exists"),
        (["convert", "{h5ad}", "x.slaf", "--layer", "a", "--raw"], "not allowed with"),
        (["synth", "{tmp}/s.slaf", "--cells", "0"], "n_cells must be an integer"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_user_mistakes_print_one_clear_line_and_exit_2(tmp_path, h5ads, capsys, args, message):
    args = [a.format(tmp=tmp_path, h5ad=h5ads[1][0]) for a in args]
    try:
        code = main(args)
    except SystemExit as exc:  # argparse reports bad arguments by exiting
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.strip().count("\n") == 0, err


def test_synth_writes_the_requested_atlas(tmp_path, capsys):
    out = tmp_path / "toy.slaf"
    args = ["synth", str(out), "--cells", "300", "--genes", "50", "--plates", "3", "--seed", "2"]
    assert main([*args, "--no-progress"]) == 0
    assert "300 cells x 50 genes" in capsys.readouterr().out
    ds = open_dataset(out)
    assert (ds.n_cells, ds.n_genes) == (300, 50)
    assert ds.obs()["plate"].n_unique() == 3


def test_the_installed_console_script_runs_info(tmp_path):
    # The script of the environment under test, not whichever `slafload` PATH finds first.
    script = shutil.which("slafload", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the slafload script is not installed (pip install -e .)")
    path = write_dense(tmp_path / "d.slaf", random_counts(10, 6, seed=1))
    run = subprocess.run([script, "info", str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "cells      10" in run.stdout


@pytest.mark.parametrize("lead", [[], ["-v"]])
def test_bench_hands_its_arguments_to_the_benchmark(capsys, lead):
    with pytest.raises(SystemExit) as exited:
        main([*lead, "bench", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "--cells" in out and "--no-peers" in out and "--full" in out


def test_version_prints_the_package_version(capsys):
    import slafload

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"slafload {slafload.__version__}"


def test_bare_slafload_prints_help_and_exits_0(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: slafload" in out and "convert" in out


def test_info_json_is_one_object_describing_the_dataset(tmp_path, capsys):
    import json

    path = write_dense(tmp_path / "d.slaf", random_counts(10, 6, seed=1))
    assert main(["info", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["n_cells"], summary["n_genes"]) == (10, 6)
    assert summary["n_nonzeros"] == open_dataset(path).n_rows
    assert set(summary["versions"]) == {"expression", "cells", "genes"}


def test_verbose_is_accepted_after_the_command_as_before_it(tmp_path, capsys):
    path = write_dense(tmp_path / "d.slaf", random_counts(10, 6, seed=1))
    assert main(["info", str(path), "-v"]) == 0
    assert main(["-v", "info", str(path)]) == 0
    assert capsys.readouterr().out.count("cells      10") == 2


def test_every_bench_and_tune_option_has_help_text():
    from slafload.tools.bench_args import parser as bench_parser
    from slafload.tools.cli import _parser

    tune = _parser()._subparsers._group_actions[0].choices["tune"]  # type: ignore[union-attr]
    for name, parser in (("bench", bench_parser()), ("tune", tune)):
        bare = [a.option_strings or a.dest for a in parser._actions if not a.help]
        assert not bare, f"{name} options without help: {bare}"


def test_an_existing_output_asks_for_the_overwrite_flag(tmp_path, h5ads, capsys):
    out = tmp_path / "atlas.slaf"
    out.mkdir()
    assert main(["convert", str(h5ads[1][0]), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "pass --overwrite" in err and "overwrite=True" not in err
    assert main(["synth", str(out), "--cells", "10", "--no-progress"]) == 2
    assert "pass --overwrite" in capsys.readouterr().err


def test_info_on_an_h5ad_file_says_to_convert_it_first(h5ads, capsys):
    assert main(["info", str(h5ads[1][0])]) == 2
    err = capsys.readouterr().err
    assert "convert it first" in err and "slafload convert" in err
