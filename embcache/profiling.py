"""Named phases of a training step, visible to ``torch.profiler`` (and on a GPU, in its traces).

    @profiled("cache.plan")
    def _plan_sets(self, ids): ...

While a profiler runs, each call runs inside ``torch.profiler.record_function(name)``, a
labelled range; otherwise the function is called as it is (``record_function`` costs several
microseconds even with no profiler, and a step makes 15-25 of these calls).
`benchmarks/bench_step_profile.py` sums these ranges into a per-phase profile of one step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

_P = ParamSpec("_P")
_profiling = torch.autograd._profiler_enabled  # whether a torch profiler is recording
_R = TypeVar("_R")


def profiled(name: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorate a function so each call is one ``record_function(name)`` range (a fresh one
    per call, so concurrent calls from a prefetch thread do not share state)."""

    def wrap(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def inner(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if not _profiling():
                return fn(*args, **kwargs)
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return inner

    return wrap
