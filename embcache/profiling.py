"""Named phases of a training step, visible to ``torch.profiler`` (and on a GPU, in its traces).

    @profiled("cache.plan")
    def _plan_sets(self, ids): ...

Each call runs inside ``torch.profiler.record_function(name)``: a no-op costing about a
microsecond when no profiler runs, and a labelled range when one does.
`benchmarks/bench_step_profile.py` sums these ranges into a per-phase profile of one step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

_P = ParamSpec("_P")
_R = TypeVar("_R")


def profiled(name: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorate a function so each call is one ``record_function(name)`` range (a fresh one
    per call, so concurrent calls from a prefetch thread do not share state)."""

    def wrap(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def inner(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)

        return inner

    return wrap
