"""What `make check` runs: pytest's own collection, read in a subprocess (so this file is itself
one of the tests it leaves out).

tests/conftest.py marks `integration` every test that starts a process or a server, through its
fixtures, its body or a helper of tests/; `make check` deselects them and sets
``EMBCACHE_TEST_SUBSET=first-per-function``, which keeps each test function's first case per
backend.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# How each starts a process: the ways the rule must see.
STARTS_PROCESSES = {
    "tests/kv/test_redis.py::test_io_stats_count_rows_and_bytes": "a redis-server fixture",
    "tests/kv/test_redis.py::test_namespaces_are_isolated[server]": "a redis-server fixture "
    "looked up by the name a parameter holds (request.getfixturevalue)",
    "tests/models/test_exit_flush.py::test_close_flushes_a_given_store_and_leaves_it_open": (
        "a module-scoped redis-server fixture"
    ),
    "tests/test_cli.py::test_train_on_redis": "a redis-server started in the body, imported there",
    "tests/distributed/test_sharded.py::test_one_owner_serves_every_lookup": (
        "ranks spawned by a module-scoped fixture"
    ),
    "tests/distributed/test_sharded.py::test_a_hanging_rank_times_out_the_others": (
        "ranks spawned in the body"
    ),
    "tests/test_cli.py::test_train_on_two_ranks": "the CLI run in a subprocess",
    "tests/test_checkpoint.py::test_resume_in_a_fresh_process_is_exact": (
        "a script run through a helper of the module"
    ),
    "tests/test_gpu_check.py::test_dry_run_walks_every_step": "the GPU check's rehearsal",
    "tests/test_check_selection.py::test_the_subset_keeps_one_case_per_function_and_backend": (
        "pytest in a subprocess (this file)"
    ),
}
IN_PROCESS = [
    "tests/kv/test_redis.py::test_server_down_at_start_fails_fast_naming_the_url",
    "tests/distributed/test_sharded.py::test_owner_hash_is_balanced_and_independent_of_the_cache_set",
    "tests/test_cli.py::test_train_prints_summary",  # the CLI's main() in this process
    "tests/test_gpu_check.py::test_the_launch_guard_names_a_cpu_tensor_for_a_compiled_kernel",
    "tests/kernels/test_cache_index.py::test_set_index_empty[torch]",
]
FILES = sorted({nodeid.split("::")[0] for nodeid in [*STARTS_PROCESSES, *IN_PROCESS]})
# For the subset: kernel tests over the backend fixture, and Backend objects as parameters.
SUBSET_FILES = ["tests/kernels/test_cache_index.py", "tests/test_backend_ops.py"]


def collected(files: list[str], marks: str, subset: bool = False) -> list[str]:
    """The node ids ``pytest --collect-only -q -m marks files`` selects."""
    env = {k: v for k, v in os.environ.items() if k != "EMBCACHE_TEST_SUBSET"}
    if subset:
        env["EMBCACHE_TEST_SUBSET"] = "first-per-function"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", marks, *files],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


@pytest.fixture(scope="module")
def selections() -> dict[str, set[str]]:
    return {marks: set(collected(FILES, marks)) for marks in ("integration", "not integration")}


@pytest.mark.parametrize("nodeid", list(STARTS_PROCESSES))
def test_tests_that_start_processes_are_integration(
    selections: dict[str, set[str]], nodeid: str
) -> None:
    assert nodeid in selections["integration"], f"{nodeid}: {STARTS_PROCESSES[nodeid]}"
    assert nodeid not in selections["not integration"]


@pytest.mark.parametrize("nodeid", IN_PROCESS)
def test_in_process_tests_are_not(selections: dict[str, set[str]], nodeid: str) -> None:
    assert nodeid in selections["not integration"]
    assert nodeid not in selections["integration"]


def _function(nodeid: str) -> str:
    return nodeid.split("[")[0]


def test_the_subset_keeps_one_case_per_function_and_backend() -> None:
    every = collected(SUBSET_FILES, "not integration")
    subset = collected(SUBSET_FILES, "not integration", subset=True)
    assert len(subset) < len(every) / 2, (len(subset), len(every))
    assert set(subset) <= set(every)
    assert {_function(n) for n in subset} == {_function(n) for n in every}  # each still runs
    lookup = [n for n in subset if _function(n).endswith("::test_cache_lookup")]
    assert [n.split("[")[1].split("-")[0] for n in lookup] == ["torch", "triton", "auto"], lookup
