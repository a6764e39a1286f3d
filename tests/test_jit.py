"""Cold starts: numba's cache empty, as on every new container and cluster node.

Each test runs fresh Python processes with their own empty ``NUMBA_CACHE_DIR`` (this process's
kernels are compiled already); Linux only (``/proc``, ``flock``, user ids). No wall-clock figure
is asserted except that ``close()`` returns within seconds where it used to wait out a whole
compile (20 s and more).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import slafload
from slafload.kernels import numba_available

pytestmark = [
    pytest.mark.skipif(not numba_available(), reason="needs numba"),
    pytest.mark.skipif(sys.platform != "linux", reason="reads /proc, runs as a user id"),
]

ROOT = Path(slafload.__file__).resolve().parent.parent
HANG = 300  # seconds: a child running this long is stuck, not slow

CHILDREN = """
import os
def children():
    me, out = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == me:
                    out.append(pid)
        except OSError:
            pass
    return out
"""

CLOSE_MID_COMPILE = (
    CHILDREN
    + """
import json, logging, sys, threading, time, warnings
warnings.simplefilter("error")
logged = []
class Keep(logging.Handler):
    def emit(self, record):
        logged.append(record.getMessage())
logging.getLogger("slafload").addHandler(Keep())
import slafload
settings = dict(kernels="auto", batch_size=16, max_genes=32, n_epochs=1, seed=0)
report = {}
loader = slafload.Loader(sys.argv[1], tuning=slafload.Tuning(queue_depth=1), **settings)  # the run stays open
it = iter(loader)
next(it)
deadline = time.monotonic() + 120
while not children() and time.monotonic() < deadline:  # the compiler process has started
    time.sleep(0.01)
report["compiling"] = bool(children())
start = time.monotonic()
loader.close()
report["close_s"] = time.monotonic() - start
report["threads"] = [t.name for t in threading.enumerate()]
report["children"] = children()
with slafload.Loader(sys.argv[1], **settings) as loader:  # a whole run ends mid-compile
    batches = [b for b in loader]
    report["compiling_at_end"] = bool(children())
report["batches"] = len(batches)
report["threads_after_run"] = [t.name for t in threading.enumerate()]
report["children_after_run"] = children()
report["logged"] = logged
print(json.dumps(report))
"""
)

FILL_RUNS = """
import json, sys, time
import numpy as np
from slafload import _jit, kernels
k = kernels.Kernels(sys.argv[1])
flat = np.zeros(10, np.int64)
args = (flat, np.array([0, 5]), np.array([2, 9]), 7)
deadline = time.monotonic() + 240
while not k.run("fill_runs", *args) and time.monotonic() < deadline:
    time.sleep(0.01)
k.close()
kernel = next(v for key, v in kernels._COMPILED.items() if key[0] == "fill_runs")
print(json.dumps({
    "values": flat.tolist(),
    "hits": sum(kernel.stats.cache_hits.values()),
    "misses": sum(kernel.stats.cache_misses.values()),
    "cache": _jit.cache_path(kernel),
}))
"""
FILLED = [7, 7, 0, 0, 0, 7, 7, 7, 7, 0]


def child_env(cache: Path | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env["PYTHONPATH"] = str(ROOT)
    if cache is not None:
        env["NUMBA_CACHE_DIR"] = str(cache)
    return {**env, **extra}


def report(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cache_files(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.rglob("*") if p.is_file())


def test_close_mid_compile_returns_promptly_and_leaves_nothing_running(tmp_path):
    path = slafload.synthetic.write_atlas(tmp_path / "tiny.slaf", n_cells=200, n_genes=64,
                                          n_plates=2, mean_nnz=24, seed=0)  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", CLOSE_MID_COMPILE, str(path)],
        env=child_env(tmp_path / "cache"),
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    got = report(proc)
    assert got["compiling"], "the loader never started compiling in a child process"
    assert got["close_s"] < 5.0, got
    assert got["threads"] == ["MainThread"] and not got["children"], got
    assert got["batches"] == -(-200 // 16)
    assert got["threads_after_run"] == ["MainThread"] and not got["children_after_run"], got
    assert not got["logged"], got  # no "producer thread did not stop", no warning
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not [n for n in cache_files(tmp_path / "cache") if ".tmp." in n]


@pytest.mark.slow
def test_four_processes_with_one_empty_cache_share_it(tmp_path):
    cache = tmp_path / "cache"
    command = [sys.executable, "-c", FILL_RUNS, "auto"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen(command, env=child_env(cache), **pipes) for _ in range(4)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=HANG)
        results.append(report(subprocess.CompletedProcess(p.args, p.returncode, out, err)))
    for got in results:
        assert got["values"] == FILLED
        # compiled by a child process into the shared cache, loaded from it here
        assert got["hits"] == 1 and got["misses"] == 0, got
    names = [n for n in cache_files(cache) if "fill_runs" in n]
    assert len([n for n in names if n.endswith(".nbi")]) == 1, names
    assert len([n for n in names if n.endswith(".nbc")]) == 1, names
    assert not [n for n in names if ".tmp." in n], names
    again = report(subprocess.run([sys.executable, "-c", FILL_RUNS, "numba"],
                                  env=child_env(cache), capture_output=True, text=True,
                                  timeout=HANG))  # fmt: skip
    assert again["hits"] == 1 and again["misses"] == 0 and again["values"] == FILLED


def test_a_read_only_install_caches_in_a_private_writable_dir(tmp_path):
    """Neither the package's ``__pycache__`` nor the user's cache directory is writable (a
    read-only install, run with no writable home): the kernels are cached in a private
    directory under ``TMPDIR``, and a second process loads them from there. Root writes
    through read-only modes, so as root ``__pycache__`` and ``HOME`` are regular files, which
    no directory can be made in.
    """
    site = tmp_path / "site"
    shutil.copytree(ROOT / "slafload", site / "slafload",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    home = tmp_path / "home"
    if os.geteuid() == 0:
        home.write_text("")
        for package in [site / "slafload", *(site / "slafload").rglob("*")]:
            if package.is_dir():
                (package / "__pycache__").write_text("")
    else:
        home.mkdir(mode=0o555)
    for p in [site, *site.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = child_env(None, PYTHONPATH=str(site), HOME=str(home), TMPDIR=str(tmp))
    env.pop("XDG_CACHE_HOME", None)
    runs = [
        report(subprocess.run([sys.executable, "-c", FILL_RUNS, "numba"], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=HANG))
        for _ in range(2)
    ]  # fmt: skip
    private = tmp / f"slafload-numba-{os.getuid()}"
    assert runs[0]["misses"] == 1 and runs[0]["values"] == FILLED, runs
    assert runs[1]["hits"] == 1 and runs[1]["misses"] == 0, runs  # cached by the first
    assert Path(runs[1]["cache"]).is_relative_to(private), runs
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert (
        not list((site / "slafload").rglob("*.nbi")) and not (tmp_path / "home" / ".cache").exists()
    )


AFTER_WARM_UP = """
import json, sys
import slafload
from slafload import kernels
for dtype in ("uint16", "float32"):
    path = slafload.synthetic.write_atlas(f"{sys.argv[1]}/{dtype}.slaf", n_cells=300,
                                          n_genes=90, n_plates=3, mean_nnz=30, value_dtype=dtype, seed=1)
    for tokenizer, layout in (("geneformer", "padded"), ("scgpt", "packed"), ("sparse", "packed")):
        budget = {} if tokenizer == "sparse" else {"max_genes": 40}
        with slafload.Loader(path, tokenizer=tokenizer, layout=layout, kernels="numba",
                             batch_size=20, n_epochs=1, **budget) as loader:
            n = sum(1 for _ in loader)
used = {k[0]: v for k, v in kernels._COMPILED.items() if k[0] in kernels._KERNELS}
print(json.dumps({name: sum(d.stats.cache_misses.values()) for name, d in used.items()}))
"""


WARMED_UP = "SLAFLOAD_TEST_WARMED_UP"


def warmed_up(tmp_path: Path) -> tuple[Path, str]:
    """A numba cache that ``slafload warm-up`` filled from empty, and what the command printed.

    CI runs that command on an empty ``NUMBA_CACHE_DIR`` before the tests (.ci/run), copies the
    cache as the command ends and names the copy in ``SLAFLOAD_TEST_WARMED_UP`` (its output
    beside it, ``<copy>.log``): this test then checks that copy instead of compiling every
    kernel a second time (~40 s of CPU). Elsewhere the command runs here.
    """
    cache = tmp_path / "cache"
    if made := os.environ.get(WARMED_UP):
        shutil.copytree(made, cache)
        return cache, Path(f"{made}.log").read_text()
    warm = subprocess.run(
        [sys.executable, "-m", "slafload.tools.cli", "warm-up", "--no-progress"],
        env=child_env(cache),
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert warm.returncode == 0, warm.stderr[-3000:]
    return cache, warm.stdout


@pytest.mark.slow
def test_warm_up_command_fills_the_cache_a_first_run_needs(tmp_path):
    cache, printed = warmed_up(tmp_path)
    assert "token kernels of 28 loader runs" in printed
    misses = report(
        subprocess.run(
            [sys.executable, "-c", AFTER_WARM_UP, str(tmp_path)],
            env=child_env(cache),
            capture_output=True,
            text=True,
            timeout=HANG,
        )
    )
    assert {
        "fill_runs",
        "copy_runs_1",
        "copy_runs_2",
        "quantile_bins",
        "sort_runs",
        "rank_counts",
    } <= misses.keys()
    assert not any(misses.values()), misses  # every kernel came from the cache
