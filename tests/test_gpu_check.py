"""`benchmarks/gpu_check.sh --dry-run`: the GPU check's plumbing, proved on the CPU.

The dry run walks every step of the check (preflight, tests/test_gpu.py, a subset of the
kernel and cache tests, the three benchmarks) with the Triton kernels in the interpreter at
tiny sizes, in a Python that cannot import torchrec, fbgemm_gpu, tensordict, iopath or redis
(as on the GPU image). These tests read what a person gets back from the GPU
machine: the summary table and the tarball. A pytest step that passes no test must fail, and
the preflight must stop at a broken kernel and name it.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEPS = ["preflight", "gpu_tests", "kernel_tests", "bench_kernels", "bench_cache_index"]
STEPS.append("bench_pipeline")


def dry_run(out: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """Run the dry run with ``OUT=out``; returns the process and the summary's table rows."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("EMBCACHE_", "GPU_CHECK_"))}
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        cwd=ROOT,
        env={**base, "PY": sys.executable, "OUT": str(out), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    rows = [line.split(None, 3) for line in summary.splitlines()[2:-1]]
    return done, rows


def test_dry_run_walks_every_step(tmp_path: Path) -> None:
    done, rows = dry_run(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    header = summary.splitlines()[0]
    for word in ("# GPU:", "torch 2.", "triton 3.", "dry run", "torchrec/", "redis blocked"):
        assert word in header, header
    assert [r[0] for r in rows] == STEPS, summary
    assert all(r[1] == "pass" for r in rows), summary
    assert summary.splitlines()[-1].endswith("all passed")
    results = {r[0]: r[3] for r in rows}
    assert results["preflight"].startswith("preflight 20 checks ok"), summary
    assert " passed" in results["gpu_tests"] and "failed" not in results["gpu_tests"]
    assert "identical=True" in results["bench_pipeline"]

    # Everything a person needs comes back in one tarball (the machine returns at most 8 files).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.tar.gz", "summary.txt"]
    with tarfile.open(tmp_path / "gpu_check.tar.gz") as tar:
        files = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
        expected = {f"{s}.log" for s in STEPS} | {"summary.txt"}
        for bench in ("kernels", "cache_index", "pipeline"):
            expected |= {f"{bench}.csv", f"{bench}.png"}
        assert set(files) == expected
        assert tar.extractfile(files["kernels.png"]).read(8) == b"\x89PNG\r\n\x1a\n"
        assert tar.extractfile(files["summary.txt"]).read().decode() == summary
        preflight = tar.extractfile(files["preflight.log"]).read().decode()
        gpu_tests = tar.extractfile(files["gpu_tests.log"]).read().decode()
        kernel_tests = tar.extractfile(files["kernel_tests.log"]).read().decode()
    assert len(re.findall(r" ok +[0-9.]+ s ", preflight)) == 20, preflight
    # The GPU image's absence of torchrec was in force: test_gpu.py ran through JaggedBatch.
    assert "passed" in gpu_tests and "ModuleNotFoundError" not in gpu_tests
    # Only what needs CUDA itself was skipped.
    skipped = re.findall(r"^SKIPPED \[\d+\] ([^:]+):\d+: (.*)$", gpu_tests, re.MULTILINE)
    assert [path for path, _ in skipped] == ["tests/test_gpu.py"] * 2, skipped
    assert "auto picks the twins off CUDA" in skipped[0][1]
    assert "no host synchronisations to count" in skipped[1][1]
    # The cache invariants ran beside the kernel tests, by path, with the Triton kernels.
    assert "tests/cache/test_hot_cache.py::" in kernel_tests.splitlines()[1]
    assert re.search(
        r"[1-9]\d* passed, 0 failed, 0 errors, 0 skipped; 3 files", results["kernel_tests"]
    )


def test_a_step_that_passes_no_test_fails(tmp_path: Path) -> None:
    """With the device left at CUDA on a machine without one, every GPU test skips: the step
    ran, pytest exited 0, and nothing was checked, so the check must fail."""
    done, rows = dry_run(tmp_path, GPU_CHECK_STEPS="gpu_tests", EMBCACHE_TEST_DEVICE="cuda")
    assert done.returncode == 1, done.stdout[-3000:]
    assert rows and rows[0][:2] == ["gpu_tests", "NO_TESTS"], rows
    assert "skipped" in rows[0][3]
    assert (tmp_path / "summary.txt").read_text().splitlines()[-1].endswith("FAILED")


@pytest.fixture
def preflight(monkeypatch: pytest.MonkeyPatch):
    """benchmarks/gpu_preflight.py imported in this process (its folder put on sys.path)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_preflight

    # setenv, not delenv: it records the variable's absence, so teardown restores it whatever
    # the preflight leaves (it switches the backend per check).
    monkeypatch.setenv("EMBCACHE_BACKEND", "auto")
    return gpu_preflight


def wrong_sets(original):
    """set_index off by one set: wrong values."""
    return lambda ids, num_sets: (original(ids, num_sets) + 1) % num_sets


def unwritten_bag(original):
    """pool_forward that leaves the last sample's first columns unwritten (NaN-filled)."""

    def run(*args):
        argmax = original(*args)
        args[7][-1, :3] = float("nan")  # args[7] is ``out``
        return argmax

    return run


BROKEN = {
    "wrong-values": ("cache_index", "set_index_triton", wrong_sets, "set_index"),
    "unwritten-output": ("pooling", "pool_forward_triton", unwritten_bag, "pool_forward SUM"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_preflight_stops_at_a_broken_kernel_and_names_it(
    preflight, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, case: str
) -> None:
    module, name, breaker, kernel = BROKEN[case]
    mod = importlib.import_module(f"embcache.kernels.{module}")
    monkeypatch.setattr(mod, name, breaker(getattr(mod, name)))
    assert preflight.main(["--device", "cpu", "--tiny"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    failing = [line for line in lines if "MISMATCH" in line and not line.startswith("summary")]
    assert len(failing) == 1 and failing[0].startswith(kernel), out
    assert lines[-1].startswith("summary: preflight FAILED after") and kernel in lines[-1]
    assert "apply_row_update" not in out  # it stopped there
    assert os.environ["EMBCACHE_BACKEND"] == "auto"  # as it found it
