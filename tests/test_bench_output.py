"""Where benchmarks write: ``./embcache-bench/<timestamp>/`` under the current directory, or
``--out DIR`` / ``--out FILE.csv``; the committed ``benchmarks/results/`` only through
``--update-results`` inside the checkout. The scripts run as a person runs them: in their own
process, from a directory outside the checkout. Every script writes a PNG, and its ``--quick``
sizes stay those of a smoke test."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import embcache.cli.bench as bench_cli
from embcache.cli import main

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TIMESTAMP = re.compile(r"\d{8}-\d{6}")
# The cheapest script: one toy cache size, seconds.
CACHE_INDEX_TINY = [str(BENCHMARKS / "bench_cache_index.py"), "--tiny", "--device", "cpu"]


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python argv`` in ``cwd``, importing this checkout's embcache."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _benchmarks_status() -> list[str]:
    """``git status`` of benchmarks/ (ignored files too, bytecode aside); other paths are left
    out, as other work may change them meanwhile."""
    out = subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=all", "--", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if "__pycache__" not in line]


def _runs_in(directory: Path) -> list[str]:
    """The run folders in ``directory/embcache-bench`` (ignored by git, so not in its status)."""
    runs = directory / "embcache-bench"
    return sorted(p.name for p in runs.iterdir()) if runs.is_dir() else []


@pytest.mark.slow
def test_bench_outside_checkout_writes_under_cwd(tmp_path: Path) -> None:
    """`embcache bench hit_rate --quick` from elsewhere: every file lands in that directory's
    embcache-bench/<timestamp>/, none in the checkout."""
    before = _benchmarks_status(), _runs_in(ROOT)
    proc = _run(["-m", "embcache.cli", "bench", "hit_rate", "--quick"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (_benchmarks_status(), _runs_in(ROOT)) == before
    (run,) = (tmp_path / "embcache-bench").iterdir()
    assert TIMESTAMP.fullmatch(run.name), run.name
    assert sorted(p.name for p in run.iterdir()) == ["hit_rate.csv", "hit_rate.png"]
    assert f"results in {run}" in proc.stdout


@pytest.mark.parametrize(
    ("out", "csv"),
    [("given", "given/cache_index.csv"), ("given/run.csv", "given/run.csv")],
    ids=["dir", "file_csv"],
)
def test_script_out(tmp_path: Path, out: str, csv: str) -> None:
    """--out DIR writes DIR/NAME.csv; --out PATH.csv (benchmarks/gpu_check.sh's form) writes
    that file; the PNG goes beside the CSV either way."""
    proc = _run([*CACHE_INDEX_TINY, "--out", str(tmp_path / out)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted([csv, str(Path(csv).with_suffix(".png"))])


def test_script_update_results_refused_outside_checkout(tmp_path: Path) -> None:
    before = _benchmarks_status()
    proc = _run([*CACHE_INDEX_TINY, "--update-results"], tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert "--update-results rewrites the committed results" in lines[-1], proc.stderr
    assert "run it from inside that checkout" in lines[-1]
    assert "Traceback" not in proc.stderr
    assert _benchmarks_status() == before
    assert not any(tmp_path.iterdir())


def test_bench_update_results_refused_outside_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "hit_rate", "--update-results"])
    assert exit_.value.code == 2
    assert "run it from inside that checkout" in capsys.readouterr().err


def test_bench_out_and_update_results_exclude_each_other(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "hit_rate", "--update-results", "--out", "x"])
    assert exit_.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


def test_bench_list_prints_whole_descriptions(capsys: pytest.CaptureFixture[str]) -> None:
    """Each entry is the script's whole first docstring paragraph, wrapped, not cut."""
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    entries = re.split(r"\n(?=\S)", out.strip())
    found = bench_cli.available_benchmarks()
    assert [e.split()[0] for e in entries] == list(found)
    for entry, path in zip(entries, found.values(), strict=True):
        text = " ".join(entry.split()[1:])
        assert text == bench_cli.description(path)
        assert text.endswith((".", "?")), text
    assert max(len(line) for line in out.splitlines()) <= 100


def test_bench_without_a_checkout_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An installed wheel has no benchmarks/ beside the package: one line, exit 2."""
    monkeypatch.setattr(bench_cli, "BENCHMARKS_DIR", tmp_path / "benchmarks")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--list"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "runs the scripts in a checkout's benchmarks/ folder" in err
    assert "clone the embcache repository" in err


@pytest.fixture
def common(monkeypatch: pytest.MonkeyPatch):
    """benchmarks/_common.py imported in this process."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _common

    return _common


def test_output_csv_forms(common, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    default = common.output_csv(None, False, "x.csv")
    assert default.parent.parent == tmp_path / "embcache-bench"
    assert TIMESTAMP.fullmatch(default.parent.name)
    assert default.name == "x.csv"
    assert common.output_csv(Path("d"), False, "x.csv") == Path("d/x.csv")
    assert common.output_csv(Path("d/y.csv"), False, "x.csv") == Path("d/y.csv")
    with pytest.raises(ValueError, match="run it from inside that checkout"):
        common.output_csv(None, True, "x.csv")
    monkeypatch.chdir(BENCHMARKS)
    assert common.output_csv(None, True, "x.csv") == BENCHMARKS / "results" / "x.csv"


def test_e2e_update_of_some_workloads_keeps_the_others(tmp_path: Path, monkeypatch) -> None:
    """``bench_e2e --update-results --workloads sequence`` replaces the sequence rows of the
    committed CSV and keeps every other workload's, read back with their types."""
    pytest.importorskip("torchrec")
    pytest.importorskip("fbgemm_gpu")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_e2e

    committed = BENCHMARKS / "results" / "e2e.csv"
    old = bench_e2e.read_rows(committed)
    assert old and all(isinstance(r.ms_per_step, float) and isinstance(r.rows, int) for r in old)
    fresh = [
        bench_e2e.Row(**{**r.__dict__, "workload": "sequence", "ms_per_step": -1.0})
        for r in old[:2]
    ]
    merged = bench_e2e.merged_rows(old, fresh)
    kept = [r for r in old if r.workload != "sequence"]
    assert [r for r in merged if r.workload != "sequence"] == kept
    assert [r for r in merged if r.workload == "sequence"] == fresh
    out = tmp_path / "e2e.csv"
    bench_e2e.write_csv(merged, out)
    assert bench_e2e.read_rows(out) == merged  # the CSV round-trips


# -- every benchmark writes its PNG; --quick stays a smoke test ---------------------------------
#
# `embcache bench --quick` runs every script, and is meant to take under 2 minutes and 2 GB on a
# quiet 2-core machine (issue 48: it took 22 minutes and 9 GB; benchmarks/README.md, "Quick
# runs", has what it takes now). Bounded here by the sizes each script's --quick takes from its
# module-level configuration, not by seconds (this machine is shared).

SCRIPTS = {p.stem.removeprefix("bench_"): p for p in sorted(BENCHMARKS.glob("bench_*.py"))}


def _bench_module(name: str, monkeypatch: pytest.MonkeyPatch):
    """benchmarks/bench_NAME.py imported in this process (its main() not run)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    if name == "e2e":  # its baselines are torchrec's and FBGEMM's
        pytest.importorskip("torchrec")
        pytest.importorskip("fbgemm_gpu")
    return importlib.import_module(f"bench_{name}")


# name -> {what: (the --quick value, the most it may be)}: tables x rows x dim, samples
# trained, steps... of the run without a GPU (the GPU check runs some scripts' --quick on a GPU,
# at its own sizes: `bench_gpu_step.SIZES["quick"]`, `bench_pipeline.QUICK`).
QUICK_LIMITS: dict[str, Callable[[Any], dict[str, tuple[float, float]]]] = {
    "cache_index": lambda m: {
        "slots": (sum(sets * 32 for sets, _ in m.SIZES["quick"]), 300_000),
        "reps": (m.REPS["quick"], 5),
    },
    "checkpoint": lambda m: {
        "rows": (m.QUICK.tables * m.QUICK.rows, 64_000),
        "reps": (m.QUICK.reps, 1),
    },
    "distributed": lambda m: {
        "rows": (m.QUICK.tables * m.QUICK.rows, 100_000),
        "samples": (m.QUICK.batch * (m.QUICK.steps + m.QUICK.warmup), 4096),
        "repeats": (m.QUICK.repeats, 1),
    },
    "e2e": lambda m: {
        "bag weights": (m.QUICK.bag_tables * m.QUICK.bag_rows * m.QUICK.bag_dim, 2_000_000),
        "sequence weights": (m.QUICK.seq_tables * m.QUICK.seq_rows * m.QUICK.seq_dim, 1_000_000),
        "batch": (max(m.QUICK.long_batch, m.QUICK.criteo_batch), 256),
        "criteo scale": (m.QUICK.criteo_scale, 0.001),
        "batches": (m.QUICK.batches, 12),
    },
    "gpu_step": lambda m: {
        "weights": ((c := m.SIZES["quick_cpu"]).tables * c.rows * c.dim, 3_000_000),
        "samples": (c.batch * c.steps, 4096),
    },
    "hit_rate": lambda m: {
        "rows": (m.QUICK.rows, 50_000),
        "draws": (
            len(m.QUICK.exponents) * m.QUICK.batch * (m.QUICK.measured + m.QUICK.max_warmup),
            1_000_000,
        ),
    },
    "kernels": lambda m: {
        "weights": (m.QUICK_CPU.rows * max(m.QUICK_CPU.dims), 500_000),
        "batch": (m.QUICK_CPU.batch, 256),
        "reps": (m.QUICK_CPU.reps, 2),
    },
    "memory": lambda m: {
        "samples": (m.QUICK.steps * m.QUICK.batch, 50_000),
        "tier rows": (m.QUICK.tier_capacity, 20_000),
        "sketch width": (m.QUICK.sketch_width, 1 << 18),
    },
    "pipeline": lambda m: {
        "weights": (m.QUICK_CPU.tables * m.QUICK_CPU.rows * m.QUICK_CPU.dim, 3_000_000),
        "samples": (m.QUICK_CPU.steps * m.QUICK_CPU.batch, 4096),
    },
    "precision": lambda m: {
        "samples": (
            m.QUICK.synthetic_steps * m.QUICK.synthetic_batch
            + m.QUICK.text_steps * m.QUICK.text_batch,
            16_000,
        ),
    },
    "step_profile": lambda m: {
        "weights": (m.QUICK.bag_tables * m.QUICK.bag_rows * m.QUICK.bag_dim, 2_000_000),
        "batches": (m.QUICK.steps * 2 + m.QUICK.warm + m.QUICK.fill, 12),
        "criteo": (m.QUICK.criteo_scale * m.QUICK.criteo_batch, 0.001 * 512),
    },
    "tiers": lambda m: {"rows": (m.QUICK[0], 50_000), "batches": (m.QUICK[1], 3)},
    "unbounded": lambda m: {
        "ids folded": (max(m.QUICK.folded), 1_000_000),
        "draws": (m.QUICK.draws * (m.QUICK.warmup + m.QUICK.measured), 250_000),
    },
}


def test_quick_limits_cover_every_bench() -> None:
    """A new script declares its --quick sizes here too."""
    assert sorted(QUICK_LIMITS) == sorted(SCRIPTS)


@pytest.mark.parametrize("name", sorted(QUICK_LIMITS))
def test_quick_sizes_stay_small(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    found = QUICK_LIMITS[name](_bench_module(name, monkeypatch))
    grown = {
        what: f"{value:g} > {limit:g}" for what, (value, limit) in found.items() if value > limit
    }
    assert not grown, f"bench_{name} --quick grew: {grown}"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_bench_saves_a_png(name: str) -> None:
    """Each script calls ``savefig`` on a path with the suffix ``.png`` and says so in its
    docstring (read, not run: `test_quick_run_writes_csv_and_png` runs one)."""
    tree = ast.parse(SCRIPTS[name].read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    names = {c.func.attr for c in calls if isinstance(c.func, ast.Attribute)}
    suffixes = {a.value for c in calls for a in c.args if isinstance(a, ast.Constant)}
    assert "savefig" in names and ".png" in suffixes, f"bench_{name} writes no PNG"
    doc = ast.get_docstring(tree) or ""
    assert ".png" in doc or "PNG" in doc, f"bench_{name}'s docstring names no PNG"


def test_quick_run_writes_csv_and_png(tmp_path: Path) -> None:
    """One cheap script end to end: ``--quick --out DIR`` writes DIR/NAME.csv and .png, and says
    that its figures are a smoke test."""
    proc = _run([str(SCRIPTS["unbounded"]), "--quick", "--out", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unbounded.csv", "unbounded.png"]
    assert "quick: sizes too small for conclusions" in proc.stdout


def test_e2e_plot_is_small_multiples(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """e2e.png from the committed CSV: a panel per workload, each with bars (no empty group),
    impls named on the axes and a legend of the families and the target only."""
    e2e = _bench_module("e2e", monkeypatch)
    import matplotlib.pyplot as plt

    figures: list[Any] = []
    close = plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # kept open to be read here
    rows = e2e.read_rows(BENCHMARKS / "results" / "e2e.csv")
    e2e.write_plot(rows, tmp_path / "e2e.png")
    (fig,) = figures
    try:
        assert (tmp_path / "e2e.png").stat().st_size > 0
        panels = [ax for ax in fig.axes if ax.get_visible()]
        assert [ax.get_title() for ax in panels] == list(dict.fromkeys(r.workload for r in rows))
        for ax in panels:
            impls = [t.get_text() for t in ax.get_yticklabels()]
            assert impls and len(ax.patches) == len(impls), ax.get_title()
        (legend,) = fig.legends
        assert len(legend.get_texts()) <= 4
    finally:
        close(fig)
