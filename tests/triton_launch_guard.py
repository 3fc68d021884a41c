"""Launch guard: fail a test whose Triton launches could not run on the GPU.

A pytest plugin, loaded by ``-p tests.triton_launch_guard`` (benchmarks/gpu_check.sh does, in
both its GPU and rehearsal modes). It wraps Triton's launch, ``JITFunction.run`` (compiled) and
``InterpretedFunction.run`` (``TRITON_INTERPRET=1``), the method every ``kernel[grid](...)``
calls in triton 3.6 and 3.8, and checks each launch made while a test runs:

* compiled (on the GPU): no argument may be a CPU tensor. Compiled Triton refuses CPU
  pointers; the guard names the kernel and the argument instead of Triton's bare "cannot be
  accessed from Triton (cpu tensor?)".
* interpreted (the rehearsal, CPU tensors standing in for the device): the test must take the
  ``device`` fixture (directly or through another fixture) or be marked ``gpu`` (tests/test_gpu.py
  puts its tensors on ``EMBCACHE_TEST_DEVICE`` itself). A test that launches Triton with tensors
  it made otherwise hands CPU tensors to compiled Triton on the GPU.

A violation fails the test at the launch (`pytest.fail`, which ``pytest.raises(ValueError)``
and ``except Exception`` do not catch) and again after the test, should a launch on another
thread have been the one to raise.

``EMBCACHE_TEST_SUBSET=first-per-function`` (the CI's rehearsal, `make gpu-rehearsal-ci`) also
deselects every parametrization of a test function but its first one per ``backend`` (torch
twins, Triton): every test function of the GPU check's files still runs, each way.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

_current: list[pytest.Item | None] = [None]
_violations: dict[str, list[str]] = {}
_lock = threading.Lock()


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernel_name(fn: Any) -> str:
    inner = getattr(fn, "fn", fn)
    return getattr(inner, "__name__", repr(fn))


def _check(fn: Any, args: tuple, kwargs: dict, interpreted: bool) -> str | None:
    """Why this launch could not run on the GPU, or None."""
    item = _current[0]
    if item is None:
        return None
    name = _kernel_name(fn)
    if interpreted:
        if "device" in getattr(item, "fixturenames", ()) or item.get_closest_marker("gpu"):
            return None
        return (
            f"{item.nodeid} launches Triton kernel {name!r} without the `device` fixture: on "
            "the GPU its tensors stay on the CPU and compiled Triton refuses them; take "
            "`device` and put the kernel's tensors on it"
        )
    import torch

    arg_names = list(getattr(fn, "arg_names", ()))
    named = list(zip(arg_names, args, strict=False)) + list(kwargs.items())
    named += [(f"arg {i}", a) for i, a in enumerate(args[len(arg_names) :], len(arg_names))]
    for arg, value in named:
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            return (
                f"{item.nodeid} passes a CPU tensor as {arg!r} to compiled Triton kernel "
                f"{name!r} (shape {tuple(value.shape)}, {value.dtype}): put it on the device"
            )
    return None


def _guarded(run: Callable, interpreted: bool) -> Callable:
    def guarded_run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        if not warmup:
            why = _check(self, args, kwargs, interpreted)
            if why is not None:
                with _lock:
                    _violations.setdefault(_current[0].nodeid, []).append(why)
                pytest.fail(f"launch guard: {why}", pytrace=False)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    guarded_run.__wrapped__ = run  # type: ignore[attr-defined]
    return guarded_run


def _install() -> list[tuple[type, Callable]]:
    """Wrap the launch of the Triton this process runs; returns what to restore."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    kernel_class = InterpretedFunction if _interpreted() else JITFunction
    original = kernel_class.run
    kernel_class.run = _guarded(original, _interpreted())
    return [(kernel_class, original)]


def pytest_configure(config: pytest.Config) -> None:
    # Triton is imported here, after tests/conftest.py has set TRITON_INTERPRET where needed
    # (pytest loads the initial conftests before calling pytest_configure).
    # tests/conftest.py registers the marker ``launch_guard_exempt`` (a test that never runs on
    # the GPU, such as one that needs the interpreter): its launches are not checked.
    config.stash[_RESTORE] = _install()


def pytest_unconfigure(config: pytest.Config) -> None:
    for cls, original in config.stash.get(_RESTORE, []):
        cls.run = original


_RESTORE = pytest.StashKey[list]()


def pytest_report_header(config: pytest.Config) -> str:
    mode = (
        "interpreted: a launching test must take the `device` fixture"
        if _interpreted()
        else "compiled: no CPU tensor may reach a kernel"
    )
    subset = os.environ.get("EMBCACHE_TEST_SUBSET")
    return f"triton launch guard on ({mode})" + (f"; subset {subset}" if subset else "")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _current[0] = None if item.get_closest_marker("launch_guard_exempt") else item
    try:
        return (yield)
    finally:
        _current[0] = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    try:
        result = yield
    finally:
        with _lock:
            found = _violations.pop(item.nodeid, [])
    if found:  # a launch failed on another thread, or its failure was swallowed
        pytest.fail("launch guard: " + "; ".join(dict.fromkeys(found)), pytrace=False)
    return result


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    subset = os.environ.get("EMBCACHE_TEST_SUBSET")
    if not subset:
        return
    if subset != "first-per-function":
        raise pytest.UsageError(f"EMBCACHE_TEST_SUBSET={subset!r}: only 'first-per-function'")
    seen: set[tuple[str, str, object]] = set()
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        which = callspec.params.get("backend") if callspec is not None else None
        key = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name), which)
        (drop if key in seen else keep).append(item)
        seen.add(key)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
