"""Suite-wide set-up: Triton's interpreter on machines without a GPU, the backend fixture, the
`integration` marker on tests that start processes, and ``EMBCACHE_TEST_SUBSET``."""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import CodeType, FunctionType

import torch

# Must happen before triton is first imported anywhere in the test session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

HAS_CUDA = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device; none on this machine")


@pytest.fixture(params=["torch", "triton", "auto"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test once per backend: the torch twins, the Triton kernels, and ``auto`` (the
    default: Triton on CUDA tensors; on CPU tensors the torch twins with the compiled numba
    kernels of `embcache.native` and FBGEMM's CPU TBE where they apply).

    On a machine without a GPU the Triton kernels run on CPU tensors through the interpreter.
    """
    monkeypatch.setenv("EMBCACHE_BACKEND", request.param)
    return request.param


@pytest.fixture
def device() -> torch.device:
    """The device tests put tensors on: CUDA when present, else the CPU."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


def pytest_configure(config: pytest.Config) -> None:
    # Registered here, not by the plugin, so that --strict-markers accepts it in every run.
    config.addinivalue_line(
        "markers",
        "launch_guard_exempt: not checked by tests/triton_launch_guard.py (a test that never "
        "runs on the GPU, e.g. one that needs the interpreter)",
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    # A Redis tier that a test leaves open releases its leases at interpreter exit (atexit),
    # after the servers the tests started are gone; redis-py's cluster client logs each failed
    # topology refresh then, after pytest's closing line. Nothing is left to check by then.
    logging.getLogger("redis.cluster").disabled = True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if starts_processes(item):
            item.add_marker(pytest.mark.integration)
    subset = os.environ.get("EMBCACHE_TEST_SUBSET")
    if subset:
        _keep_first_per_function(config, items, subset)
    # EMBCACHE_TEST_DEVICE=cpu: tests/test_gpu.py stands in the CPU for CUDA (the GPU check's
    # dry run walks it that way, with Triton through the interpreter).
    if HAS_CUDA or os.environ.get("EMBCACHE_TEST_DEVICE") == "cpu":
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none on this machine"))


# -- the `integration` marker ------------------------------------------------------------------
#
# A test starts another process when its function, one of its fixtures, or a function or class
# of tests/ that they use names one of these: a Redis server (tests/kv/redis_servers.py), ranks
# (embcache.distributed.launch.spawn), a CLI run or a script (subprocess). Read from the code,
# so a new test is marked the day it is written; `make check` deselects the marked ones.
PROCESS_STARTERS = frozenset(
    {"subprocess", "multiprocessing", "running_server", "running_cluster", "spawn"}
)
TESTS = Path(__file__).parent


def starts_processes(item: pytest.Item) -> bool:
    """Whether ``item`` starts a process or a server: its function, its fixtures, and the
    fixtures it looks up by name (``request.getfixturevalue``, by a string its code holds or a
    parameter's value) reach a name in `PROCESS_STARTERS`."""
    # _fixtureinfo and _fixturemanager: pytest's own records of the fixtures a test requests
    # and of where each is defined (no public API gives either at collection).
    fixtures = getattr(item, "_fixtureinfo", None)
    if not isinstance(item, pytest.Function) or fixtures is None:
        return False
    starts, looked_up = _scan(item.function)
    for defs in fixtures.name2fixturedefs.values():
        fixture_starts, fixture_looked_up = _scan(defs[-1].func)
        starts |= fixture_starts
        looked_up |= fixture_looked_up
    if starts or not looked_up:
        return starts
    callspec = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    manager = item.session._fixturemanager
    for name in looked_up | {value for value in params if isinstance(value, str)}:
        defs = manager.getfixturedefs(name, item) if name.isidentifier() else None
        if defs and _scan(defs[-1].func)[0]:
            return True
    return False


def _scan(fn: object) -> tuple[bool, frozenset[str]]:
    """(whether ``fn`` or a function of tests/ it uses reaches a process starter, the strings
    of those that look fixtures up by name)."""
    starts, looked_up = False, frozenset[str]()
    todo, seen = [_function(fn)], set()
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        own_starts, own_looked_up, helpers = _scan_one(f)
        starts |= own_starts
        looked_up |= own_looked_up
        todo.extend(helpers)
    return starts, looked_up


def _function(fn: object) -> FunctionType | None:
    """The plain function of tests/ behind a test, a fixture or a method; None for others."""
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    fn = getattr(getattr(fn, "hypothesis", None), "inner_test", fn)  # a @given test
    return fn if isinstance(fn, FunctionType) and _in_tests(fn) else None


@functools.cache
def _scan_one(fn: FunctionType) -> tuple[bool, frozenset[str], tuple[FunctionType, ...]]:
    """What ``fn``'s own code names: a process starter, the strings it holds if it looks
    fixtures up by name, and the functions of tests/ it uses."""
    starts, looks_up, strings, helpers = False, False, set(), []
    for code in _codes(fn.__code__):
        strings.update(c for c in code.co_consts if isinstance(c, str))
        for name in code.co_names:
            starts |= name in PROCESS_STARTERS
            looks_up |= name == "getfixturevalue"
            helpers += _functions_of(fn.__globals__.get(name))
    return starts, frozenset(strings) if looks_up else frozenset(), tuple(helpers)


def _codes(code: CodeType) -> Iterator[CodeType]:
    """``code`` and the code of the functions, lambdas and comprehensions inside it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _codes(const)


def _functions_of(obj: object) -> list[FunctionType]:
    """The functions of tests/ behind a global name: a function, or a class's methods."""
    if isinstance(obj, type) and _in_tests(obj):
        members = [getattr(m, "__func__", getattr(m, "fget", m)) for m in vars(obj).values()]
        return [m for m in members if isinstance(m, FunctionType)]
    return [obj] if isinstance(obj, FunctionType) and _in_tests(obj) else []


def _in_tests(obj: object) -> bool:
    try:
        return Path(inspect.getfile(obj)).is_relative_to(TESTS)
    except TypeError:  # a builtin
        return False


# -- EMBCACHE_TEST_SUBSET ----------------------------------------------------------------------


def _keep_first_per_function(config: pytest.Config, items: list[pytest.Item], subset: str) -> None:
    """``EMBCACHE_TEST_SUBSET=first-per-function``: keep the first case of each test function
    per ``backend`` (torch twins, Triton, auto), deselect the other cases: every test function
    still runs, each way. `make check` and the GPU check's rehearsal (`make gpu-rehearsal-ci`)
    set it."""
    if subset != "first-per-function":
        raise pytest.UsageError(f"EMBCACHE_TEST_SUBSET={subset!r}: only 'first-per-function'")
    seen: set[tuple[str, str]] = set()
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        which = callspec.params.get("backend") if callspec is not None else None
        base = item.nodeid[: len(item.nodeid) - len(item.name)] + getattr(
            item, "originalname", item.name
        )
        key = (base, repr(which))  # repr: some backends are objects that do not hash
        (drop if key in seen else keep).append(item)
        seen.add(key)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def _tier_records_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`embcache train` records a Redis tier's state in the user's ~/.local/state/embcache; a
    test's runs keep theirs in its own folder, so a record never outlives its test's server."""
    monkeypatch.setenv("EMBCACHE_TIER_RECORDS", str(tmp_path / "tier-records"))
