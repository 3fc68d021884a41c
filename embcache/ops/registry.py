"""One implementation per op family, bound once: the seam between the code that calls the core
operations (caches, engines) and their implementations.

A family is a folder ``embcache/ops/<family>/`` holding ``spec.py`` (the torch specification)
and, where they exist, ``triton.py`` and ``native.py``, each defining ``IMPLEMENTATION``, an
object of the family's protocol (its ``__init__``). `Ops` is the registry: one field per
family, typed with its protocol, so a new family is its folder and one line here.

`bind` chooses for a `Backend` (`embcache.backend`, which reads ``EMBCACHE_BACKEND``): the
``triton`` family runs ``triton.py``, the compiled ``native`` one ``native.py``, every other
``spec.py``; a family without the chosen module runs its ``spec.py``. A cache binds once when
it is built (``HotCache.ops``) and calls ``self.ops.<family>.<op>(...)``, which goes straight
to the implementation's method; stateless helpers (the public functions of `kernels.ids`,
`kernels.pooling`, ...) bind for each tensor's device at each call (`ops_for`), as the
backend's choice was made before.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, get_type_hints

import torch

from embcache.backend import Backend, for_device
from embcache.ops.gather import GatherOps
from embcache.ops.ids import IdsOps
from embcache.ops.plan import PlanOps
from embcache.ops.pooling import PoolingOps
from embcache.ops.rows import RowsOps
from embcache.ops.update import UpdateOps

IMPLEMENTATIONS = ("spec", "triton", "native")


@dataclass(frozen=True)
class Ops:
    """One implementation of every op family (`bind`). A new family: its folder, a line."""

    ids: IdsOps
    plan: PlanOps
    rows: RowsOps
    pooling: PoolingOps
    gather: GatherOps
    update: UpdateOps


def families() -> list[str]:
    """The registered families, in the registry's order."""
    return [f.name for f in fields(Ops)]


def operations(family: str) -> list[str]:
    """The operations of ``family``: the methods its protocol declares, in its order."""
    protocol = get_type_hints(Ops)[family]
    return [name for name, value in vars(protocol).items()
            if callable(value) and not name.startswith("_")]  # fmt: skip


def triton_kernels(family: str) -> dict[str, Any]:
    """The Triton kernels of ``family``: the ``@triton.jit`` functions of its ``triton.py``
    named ``*_kernel``, the ones launched (a helper a kernel calls, ``_mix64``, is compiled
    into it), by name; none without a ``triton.py``. What `benchmarks/compile_kernels.py`
    must see launched and compiled."""
    module = f"embcache.ops.{family}.triton"
    if importlib.util.find_spec(module) is None:
        return {}
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    kinds = (JITFunction, InterpretedFunction)  # compiled, or under ``TRITON_INTERPRET=1``
    found = vars(importlib.import_module(module)).items()
    return {name: fn for name, fn in found if isinstance(fn, kinds) and name.endswith("_kernel")}


# What `family_preflight` gives: the checks a family's ``preflight.py`` declares (operation ->
# ``check(device, tiny) -> max |diff|``), and its operations no Triton kernel runs (-> why).
PreflightChecks = dict[str, Callable[[torch.device, bool], float]]


def family_preflight(family: str) -> tuple[PreflightChecks, dict[str, str]]:
    """The GPU preflight's part that ``family`` keeps beside its kernels, in its optional
    ``preflight.py``: ``CHECKS`` (each operation's check: it runs the Triton implementation on
    ``device``, small inputs when ``tiny``, against the torch specification, and returns the
    largest difference or raises AssertionError naming the mismatch) and ``ON_HOST`` (its
    operations no Triton kernel runs, each with why). `benchmarks/gpu_preflight.py` runs the
    checks and accepts those reasons, so a new family's kernels are checked on the GPU the day
    it is registered, with no list outside its folder to edit."""
    module = f"embcache.ops.{family}.preflight"
    if importlib.util.find_spec(module) is None:
        return {}, {}
    found = importlib.import_module(module)
    return dict(getattr(found, "CHECKS", {})), dict(getattr(found, "ON_HOST", {}))


def implementation_name(backend: Backend) -> str:
    """Which of `IMPLEMENTATIONS` a `Backend` runs (where its family has that module)."""
    if backend.triton:
        return "triton"
    return "native" if backend.compiled else "spec"


def implementations(family: str) -> dict[str, Any]:
    """Every implementation of ``family`` present, by name (``spec`` first): what the tests,
    the benchmarks and the GPU preflight list (a family's protocol object each)."""
    if family not in families():
        raise ValueError(f"no op family {family!r}; registered: {', '.join(families())}")
    return {
        name: importlib.import_module(module).IMPLEMENTATION
        for name in IMPLEMENTATIONS
        if importlib.util.find_spec(module := f"embcache.ops.{family}.{name}") is not None
    }


# Per backend object (by identity: the backends are a few module constants, and a lookup by
# identity costs no hash of their fields): the backend, kept alive, and its `Ops`.
_BOUND: dict[int, tuple[Backend, Ops]] = {}


def bind(backend: Backend) -> Ops:
    """The implementations ``backend`` runs, one per family (made once per backend)."""
    found = _BOUND.get(id(backend))
    if found is None:
        name = implementation_name(backend)
        chosen = {}
        for family in families():
            present = implementations(family)
            chosen[family] = present.get(name, present["spec"])
        found = _BOUND[id(backend)] = (backend, Ops(**chosen))
    return found[1]


def ops_for(device: torch.device | str) -> Ops:
    """`bind` of the backend that runs on ``device`` under ``EMBCACHE_BACKEND`` (read now:
    a ValueError for a name that is none of the choices)."""
    return bind(for_device(device))
