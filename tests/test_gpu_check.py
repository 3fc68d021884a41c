"""`benchmarks/gpu_check.sh`: the GPU check's plumbing, proved on the CPU.

``--dry-run`` is the rehearsal (`make gpu-rehearsal`: the GPU's exact commands, the Triton
kernels in the interpreter at tiny sizes) in this Python with torchrec, fbgemm_gpu, tensordict,
iopath, redis-py and numba blocked, and the kernel tests cut to the first of each test function
per backend (all still collected). These tests read what a person gets back from the GPU
machine: the summary table and the tarball, also when a step is killed. A pytest step that
passes no test must fail, a file whose tests are all skipped for a stated reason must not, the
preflight must stop at a broken kernel and name it, and the launch guard must fail a test whose
launches could not run on the GPU.

The dry run here runs every step for real but the kernel tests' pytest runs, which it only
records: `make test` runs those files itself, and CI's `make gpu-rehearsal-ci` runs the whole
rehearsal, kernel tests included, in a Python built like the GPU image's (.ci/run).
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
STEPS = ["preflight", "gpu_tests", "kernel_tests", "bench_kernels", "bench_cache_index"]
STEPS += ["bench_pipeline", "bench_gpu_step", "gpu_profile"]
KERNEL_FILES = sorted((ROOT / "tests" / "kernels").glob("test_*.py"))
HOT_CACHE = ROOT / "tests" / "cache" / "test_hot_cache.py"


def _env(out: Path, **env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("EMBCACHE_", "GPU_CHECK_"))}
    base.pop("TRITON_INTERPRET", None)
    return {**base, "PY": sys.executable, "OUT": str(out), **env}


def dry_run(out: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """Run the dry run with ``OUT=out``; returns the process and the summary's table rows."""
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        cwd=ROOT,
        env=_env(out, **env),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    rows = [line.split(None, 3) for line in summary.splitlines()[2:-1]]
    return done, rows


# This Python, but for pytest over a kernel test file (or the cache invariants), which it
# records with the environment the step gave it and passes at once.
RECORDING_PYTHON = """#!/usr/bin/env bash
file="${@: -1}"
if [[ ${1:-} == -m && ${2:-} == pytest &&
      ( $file == tests/kernels/test_*.py || $file == tests/cache/test_hot_cache.py ) ]]; then
    line="$* |"
    for name in EMBCACHE_BACKEND EMBCACHE_TEST_SUBSET TRITON_INTERPRET EMBCACHE_TEST_DEVICE \\
        PYTHONPATH; do
        line+=" $name=${!name:-}"
    done
    echo "$line" >>"$KERNEL_TEST_CALLS"
    echo "1 passed in 0.01s"
    exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


@pytest.mark.slow
def test_dry_run_walks_every_step(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text(RECORDING_PYTHON)
    python.chmod(0o755)
    calls = tmp_path / "kernel_test_calls.txt"
    out = tmp_path / "out"
    done, rows = dry_run(
        out, PY=str(python), REAL_PYTHON=sys.executable, KERNEL_TEST_CALLS=str(calls)
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    header = summary.splitlines()[0]
    for word in ("# GPU:", "torch 2.", "triton 3.", "rehearsal", "torchrec/", "numba blocked"):
        assert word in header, header
    assert "kernel tests: all collected, first per test function run" in header, header
    assert [r[0] for r in rows] == STEPS, summary
    assert all(r[1] == "pass" for r in rows), summary
    assert summary.splitlines()[-1].endswith("all passed")
    results = {r[0]: r[3] for r in rows}
    assert results["preflight"].startswith(f"preflight {_preflight_checks()} checks ok"), summary
    assert re.match(r"[1-9]\d* passed, 0 failed, 0 errors \(0 collecting\)", results["gpu_tests"])
    assert "identical=True" in results["bench_pipeline"]
    assert re.search(r"step embcache_10 .* vs torch_sparse .* weights match", summary), summary

    # Everything a person needs comes back in one tarball (the machine returns at most 8 files).
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.txt"]
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        files = {Path(m.name).name: m for m in tar.getmembers() if m.isfile()}
        expected = {f"{s}.log" for s in STEPS} | {"summary.txt"}
        for bench in ("kernels", "cache_index", "pipeline", "gpu_step"):
            expected |= {f"{bench}.csv", f"{bench}.png"}
        expected |= {"gpu_profile.csv", "gpu_profile_top.txt"}
        assert set(files) == expected
        # It unpacks into the checkout's results folder.
        assert all(m.name.startswith("benchmarks/results/gpu-rehearsal/") for m in files.values())
        assert tar.extractfile(files["kernels.png"]).read(8) == b"\x89PNG\r\n\x1a\n"
        assert tar.extractfile(files["summary.txt"]).read().decode() == summary
        preflight = tar.extractfile(files["preflight.log"]).read().decode()
        gpu_tests = tar.extractfile(files["gpu_tests.log"]).read().decode()
        kernel_tests = tar.extractfile(files["kernel_tests.log"]).read().decode()
    assert len(re.findall(r" ok +[0-9.]+ s ", preflight)) == _preflight_checks(), preflight
    # The GPU image's absence of torchrec was in force: test_gpu.py ran through JaggedBatch.
    assert "passed" in gpu_tests and "ModuleNotFoundError" not in gpu_tests
    # Only what needs CUDA itself was skipped.
    skipped = re.findall(r"^SKIPPED \[\d+\] ([^:]+):\d+: (.*)$", gpu_tests, re.MULTILINE)
    assert [path for path, _ in skipped] == ["tests/test_gpu.py"] * 4, skipped
    reasons = " | ".join(reason for _, reason in skipped)
    for reason in (
        "auto picks the twins off CUDA",
        "no host synchronisations to count",
        "the CPU has no streams to order",
        "NCCL runs on CUDA only",
    ):
        assert reason in reasons, skipped
    assert "-p tests.triton_launch_guard tests/test_gpu.py" in gpu_tests.splitlines()[1]

    # Every kernel test file and the cache invariants, by path, side by side, each once, under
    # the launch guard, with the Triton backend, the subset, the interpreter, the CPU standing
    # in for the device and the GPU image's missing packages blocked.
    paths = [str(p.relative_to(ROOT)) for p in [*KERNEL_FILES, HOT_CACHE]]
    recorded = calls.read_text().splitlines()
    assert sorted(line.split(" | ")[0].split()[-1] for line in recorded) == sorted(paths)
    for line in recorded:
        argv, env = line.split(" | ")
        assert " -p tests.triton_launch_guard " in f" {argv} ", line
        for word in ("EMBCACHE_BACKEND=triton", "EMBCACHE_TEST_SUBSET=first-per-function"):
            assert word in env.split(), line
        assert "TRITON_INTERPRET=1" in env.split() and "EMBCACHE_TEST_DEVICE=cpu" in env, line
        assert f"PYTHONPATH={ROOT / 'tests' / 'gpu_image'}:" in env, line
    for path in paths:
        assert f"---- {path}\n" in kernel_tests, path
    n = len(paths)
    assert results["kernel_tests"] == (
        f"{n} passed, 0 failed, 0 errors (0 collecting), 0 skipped; {n} files side by side"
    ), results["kernel_tests"]


def test_a_step_that_passes_no_test_fails(tmp_path: Path) -> None:
    """With the device left at CUDA on a machine without one, every GPU test skips: the step
    ran, pytest exited 0, and nothing was checked, so the check must fail."""
    done, rows = dry_run(tmp_path, GPU_CHECK_STEPS="gpu_tests", EMBCACHE_TEST_DEVICE="cuda")
    assert done.returncode == 1, done.stdout[-3000:]
    assert rows and rows[0][:2] == ["gpu_tests", "NO_TESTS"], rows
    assert "skipped" in rows[0][3]
    assert (tmp_path / "summary.txt").read_text().splitlines()[-1].endswith("FAILED")


# The checks `benchmarks/gpu_preflight.py` runs itself; each family's own (its folder's
# ``preflight.py``, `family_preflight`) come on top.
PREFLIGHT_OWN_CHECKS = 39


def _preflight_checks() -> int:
    """How many checks a whole preflight runs: its own and one per check function a family
    keeps in its folder."""
    from embcache.ops.registry import families, family_preflight

    kept = {id(check) for f in families() for check in family_preflight(f)[0].values()}
    return PREFLIGHT_OWN_CHECKS + len(kept)


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
    "wrong-values": ("ops.plan.triton", "set_index_triton", wrong_sets, "set_index"),
    "unwritten-output": (
        "ops.pooling.triton",
        "pool_forward_triton",
        unwritten_bag,
        "pool_forward SUM",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_preflight_stops_at_a_broken_kernel_and_names_it(
    preflight, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, case: str
) -> None:
    module, name, breaker, kernel = BROKEN[case]
    mod = importlib.import_module(f"embcache.{module}")
    monkeypatch.setattr(mod, name, breaker(getattr(mod, name)))
    assert preflight.main(["--device", "cpu", "--tiny"]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    failing = [line for line in lines if "MISMATCH" in line and not line.startswith("summary")]
    assert len(failing) == 1 and failing[0].startswith(kernel), out
    assert lines[-1].startswith("summary: preflight FAILED after") and kernel in lines[-1]
    assert "apply_row_update" not in out  # it stopped there
    assert os.environ["EMBCACHE_BACKEND"] == "auto"  # as it found it


def test_every_operation_is_checked_or_declared_on_host(preflight) -> None:
    """Each registered family's operations are covered: a check here, or its family's own
    ``preflight.py`` (`family_preflight`); what a family declares on the host has a reason and
    names an operation it has."""
    from embcache.ops.registry import families, family_preflight, operations

    assert preflight.unchecked_operations() == []
    for family in families():
        checks, on_host = family_preflight(family)
        assert set(checks) | set(on_host) <= set(operations(family)), family
        assert all(isinstance(why, str) and why for why in on_host.values()), family
    assert "fill_at" in family_preflight("rows")[1]  # the host writes: no Triton kernel


def test_a_family_check_kept_in_its_folder_runs_and_covers_its_operation(
    preflight, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A family that keeps a check for an operation in its folder needs no entry in the
    preflight: the operation counts as covered, `main` runs the check (here the only one: the
    preflight's own are emptied) and a mismatch it raises stops the run naming it. An
    operation with neither a check nor a reason is refused before anything runs."""
    import embcache.ops.registry as registry

    ran: list[tuple[str, bool]] = []

    def floors_check(device: torch.device, tiny: bool) -> float:
        ran.append((device.type, tiny))
        if os.environ.get("PLANTED_MISMATCH"):
            raise AssertionError("lock floors: 3 != 2")
        return 0.0

    def every_op_in_its_folder(family: str):
        on_host = {op: "declared for the test" for op in registry.operations(family)}
        if family == "rows":
            del on_host["lock_floors"]
            return {"lock_floors": floors_check}, on_host
        return {}, on_host

    monkeypatch.setattr(registry, "family_preflight", every_op_in_its_folder)
    monkeypatch.setattr(preflight, "CHECKED", {})
    monkeypatch.setattr(preflight, "run_checks", lambda p: None)
    assert preflight.unchecked_operations() == []
    assert preflight.main(["--device", "cpu", "--tiny"]) == 0
    out = capsys.readouterr().out
    assert ran == [("cpu", True)]
    checks = [line.split()[0] for line in out.splitlines() if " ok " in line]
    assert checks[:-1] == ["rows.lock_floors"] and checks[-1] == "summary:", out
    assert out.splitlines()[-1].startswith("summary: preflight 1 checks ok"), out
    monkeypatch.setenv("PLANTED_MISMATCH", "1")
    assert preflight.main(["--device", "cpu", "--tiny"]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert "rows.lock_floors" in last and "3 != 2" in last, last
    # Neither a check nor a reason: refused before any check runs.
    monkeypatch.setattr(registry, "family_preflight", lambda family: ({}, {}))
    ran.clear()
    assert preflight.main(["--device", "cpu", "--tiny"]) == 1
    assert "no check for ids." in capsys.readouterr().out and not ran


def test_a_killed_run_still_returns_its_finished_steps(tmp_path: Path) -> None:
    """The outer limit ends the check with SIGTERM in the middle of a step: the steps that
    finished, the killed step's log and a summary that says so are in $OUT (and were already
    there before the signal, so a SIGKILL loses only the step under way)."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "--dry-run"],
        cwd=ROOT,
        env=_env(out, GPU_CHECK_STEPS="preflight gpu_tests"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 600
    while "preflight " not in _text(out / "summary.txt") and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.5)
    before = _text(out / "summary.txt")
    assert re.search(r"^preflight +pass ", before, re.MULTILINE), before
    with tarfile.open(out / "gpu_check.tar.gz") as tar:  # what a SIGKILL now would leave
        assert "preflight.log" in {Path(m.name).name for m in tar}
    time.sleep(2)  # gpu_tests is under way
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, stdout[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.txt"]
    summary = (out / "summary.txt").read_text()
    assert re.search(r"^preflight +pass ", summary, re.MULTILINE), summary
    assert re.search(r"^gpu_tests +KILLED .*SIGTERM", summary, re.MULTILINE), summary
    assert summary.splitlines()[-1].endswith("FAILED (SIGTERM: stopped)"), summary
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        members = {Path(m.name).name: m for m in tar if m.isfile()}
        assert set(members) == {"preflight.log", "gpu_tests.log", "summary.txt"}
        assert "# killed by SIGTERM" in tar.extractfile(members["gpu_tests.log"]).read().decode()
    # No step's process outlives the check.
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout
    assert not left.strip(), left


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_a_file_whose_tests_all_skip_for_a_reason_counts_as_skipped(tmp_path: Path) -> None:
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.skipif(True, reason='numba cannot be imported here')\n"
        "def test_a():\n    pass\n"
    )
    (tmp_path / "test_passes.py").write_text("def test_a():\n    pass\n")
    (tmp_path / "test_breaks.py").write_text("import no_such_module\n")

    def parallel(*names: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(SCRIPT), "--parallel-pytest", *(str(tmp_path / n) for n in names)],
            cwd=ROOT,
            env={**os.environ, "PY": sys.executable, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
        )

    done = parallel("test_skips.py", "test_passes.py")
    assert done.returncode == 0, done.stdout
    assert done.stdout.splitlines()[-1] == (
        "summary: 1 passed, 0 failed, 0 errors (0 collecting), 1 skipped; 2 files side by side;"
        " every test skipped in test_skips.py"
    )
    assert parallel("test_skips.py").returncode == 1  # nothing passed: nothing was checked
    done = parallel("test_breaks.py", "test_passes.py")
    assert done.returncode == 1
    assert "1 errors (1 collecting)" in done.stdout.splitlines()[-1]


GUARDED = """
import pytest
import torch
import torch
import triton
import triton.language as tl


@pytest.fixture
def device():
    return torch.device("cpu")


@triton.jit
def add_one_kernel(x_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(x_ptr + o, tl.load(x_ptr + o, mask=o < n) + 1, mask=o < n)


def launch(x):
    add_one_kernel[(1,)](x, x.numel(), BLOCK=8)
    return x


def test_with_device(device):
    assert launch(torch.zeros(3, device=device)).tolist() == [1, 1, 1]


def test_without_device():
    assert launch(torch.zeros(3)).tolist() == [1, 1, 1]


def test_without_device_expecting_an_error():
    with pytest.raises(Exception):
        launch(torch.zeros(3))
        raise ValueError("the launch guard must not be caught here")


@pytest.mark.gpu
def test_marked_gpu():
    assert launch(torch.zeros(3)).tolist() == [1, 1, 1]


def test_without_triton():
    assert torch.zeros(3).sum() == 0
"""


GUARD_ARGS = ("-p", "tests.triton_launch_guard", "test_offender.py")


def test_the_launch_guard_fails_a_test_that_could_not_launch_on_the_gpu(tmp_path: Path) -> None:
    """Rehearsal (interpreter): a launching test without the `device` fixture fails, naming the
    kernel, even inside ``pytest.raises(Exception)``; the others pass."""
    (tmp_path / "test_offender.py").write_text(textwrap.dedent(GUARDED))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: device tests\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", *GUARD_ARGS],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "2 failed, 3 passed" in out, out
    failed = re.findall(r"^FAILED test_offender\.py::(\w+) ", out, re.MULTILINE)
    assert failed == ["test_without_device", "test_without_device_expecting_an_error"], out
    for name in failed:
        assert (
            f"launch guard: test_offender.py::{name} launches Triton kernel 'add_one_kernel' "
            "without the `device` fixture"
        ) in out, out


def test_the_launch_guard_names_a_cpu_tensor_for_a_compiled_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GPU mode (compiled Triton): the check names the kernel and the CPU argument."""
    import tests.triton_launch_guard as guard

    def copy_kernel() -> None: ...

    kernel = SimpleNamespace(fn=copy_kernel, arg_names=("x_ptr", "out_ptr", "n"))
    item = SimpleNamespace(nodeid="tests/test_x.py::test_copy", fixturenames=("device",))
    monkeypatch.setattr(guard, "_current", [item])
    meta = torch.empty(4, device="meta")
    assert guard._check(kernel, (meta, meta, 4), {}, interpreted=False) is None
    why = guard._check(kernel, (meta, torch.zeros(4)), {"n": 4}, interpreted=False)
    assert why is not None
    assert "as 'out_ptr' to compiled Triton kernel 'copy_kernel'" in why, why
    assert "tests/test_x.py::test_copy" in why
