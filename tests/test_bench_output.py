"""Where benchmarks write: ``./embcache-bench/<timestamp>/`` under the current directory, or
``--out DIR`` / ``--out FILE.csv``; the committed ``benchmarks/results/`` only through
``--update-results`` inside the checkout. The scripts run as a person runs them: in their own
process, from a directory outside the checkout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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
