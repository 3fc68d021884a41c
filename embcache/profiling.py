"""Named phases of a training step, visible to ``torch.profiler`` (and on a GPU, in its traces),
and to `phase_times` on every thread.

    @profiled("cache.plan")
    def _plan_sets(self, ids): ...

While a profiler runs, each call runs inside ``torch.profiler.record_function(name)``, a
labelled range; otherwise the function is called as it is (``record_function`` costs several
microseconds even with no profiler, and a step makes 15-25 of these calls).
`benchmarks/bench_step_profile.py` sums these ranges into a per-phase profile of one step.

A torch profiler records the thread that started it, not a prefetch worker. Inside
``with phase_times() as times:`` every call is also timed on whatever thread makes it, and
``times.seconds[(thread_name, name)]`` sums its wall time (a nested phase counts inside its
caller's too): the per-thread profile of a prefetching step.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

import torch

_P = ParamSpec("_P")
_profiling = torch.autograd._profiler_enabled  # whether a torch profiler is recording
_R = TypeVar("_R")


class PhaseTimes:
    """Wall seconds and calls per ``(thread name, phase name)``, collected by `phase_times`."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        key = (threading.current_thread().name, name)
        with self._lock:
            self.seconds[key] += seconds
            self.calls[key] += 1


_ACTIVE: list[PhaseTimes] = []  # the collector `phase_times` runs, if any (at most one)


@contextmanager
def phase_times() -> Iterator[PhaseTimes]:
    """Time every `profiled` call made meanwhile, on any thread."""
    if _ACTIVE:
        raise RuntimeError("phase_times() is already collecting")
    times = PhaseTimes()
    _ACTIVE.append(times)
    try:
        yield times
    finally:
        _ACTIVE.clear()


def profiled(name: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorate a function so each call is one ``record_function(name)`` range (a fresh one
    per call, so concurrent calls from a prefetch thread do not share state), and one entry
    of `phase_times` while it collects."""

    def wrap(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def inner(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if _ACTIVE:
                times = _ACTIVE[0]
                start = time.perf_counter()
                try:
                    return _call(fn, name, args, kwargs)
                finally:
                    times.add(name, time.perf_counter() - start)
            if not _profiling():  # `_call`'s test inlined: a step makes 15-25 of these calls
                return fn(*args, **kwargs)
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return inner

    return wrap


def _call(fn: Callable[..., _R], name: str, args: tuple, kwargs: dict) -> _R:
    if not _profiling():
        return fn(*args, **kwargs)
    with torch.profiler.record_function(name):
        return fn(*args, **kwargs)
