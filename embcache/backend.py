"""Which implementation of the core operations runs: ``EMBCACHE_BACKEND``, read here and
nowhere else, and the `Backend` object each cache, tier table and step holds.

Three implementation families, one `Backend` each:

* ``native``: on a CPU, the compiled loops (`embcache.native`, numba) for the bookkeeping and
  row moves, and FBGEMM's CPU TBE for the whole-table step where it applies (without numba,
  FBGEMM still, and the torch code for the bookkeeping);
* ``triton``: the Triton kernels (on CPU tensors through ``TRITON_INTERPRET=1``), with the
  cache's set index planned on the device (``device_path``) even on a CPU, so that the GPU's
  code path runs and is tested without a GPU;
* ``torch``: the torch twins, the specification every other implementation matches.

``EMBCACHE_BACKEND`` names the choice:

* ``auto`` (default, also when unset or empty): ``triton`` on a GPU, ``native`` on a CPU;
* ``triton`` or ``torch``: that family on every device.

Anything else is a ValueError, raised where the choice is made (`for_device`): a collection's
construction (a cache decides its structures, a tier table its row moves, an initialiser its
draw). The variable is read at every `for_device` call, so that tests can switch it per test;
whoever holds a `Backend`, or the op families bound for one (`embcache.ops.registry`), made
its choice once and keeps it (a cache, a tier table, an initialiser, a step): a value set
later is read by nothing a built collection's step runs. The public kernel functions
(`embcache.kernels`) bind for their tensors' device at each call.

The families differ in the facts the code built on them reads: `Backend.compiled` (keep the
structures the compiled passes read: a row index, a bitmap dedup, float32 tier tables moved in
one pass), `Backend.device_path`, `Backend.triton` and `Backend.tbe`; their operations are the
op families' implementations `embcache.ops.registry` binds for a `Backend` (each family's
``spec.py``, ``native.py`` or ``triton.py``). Nothing else in the package asks which
implementation is present (`tests/test_architecture.py` checks it).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

import embcache.native as native

CHOICES = ("auto", "triton", "torch")


def backend_name() -> str:
    """The backend asked for by ``EMBCACHE_BACKEND`` (``auto`` when unset), or a ValueError
    naming the choices for any other value."""
    name = os.environ.get("EMBCACHE_BACKEND", "auto").strip().lower() or "auto"
    if name not in CHOICES:
        raise ValueError(f"EMBCACHE_BACKEND={name!r} is not one of {', '.join(CHOICES)}")
    return name


_CONSTANTS: dict[tuple[int | float | bool, torch.dtype, torch.device], torch.Tensor] = {}


def constant(value: int | float | bool, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A one-element tensor of ``value``, made once per value, dtype and device and never
    written: expanded (a view), it is the source of a write of one value at many positions
    with no fill launched each time (``index_add_`` has no scalar overload)."""
    key = (value, dtype, torch.device(device))
    found = _CONSTANTS.get(key)
    if found is None:
        found = torch.full((1,), value, dtype=dtype, device=device)
        if found.is_cuda:  # once per process: no later stream can read it before it is filled
            torch.cuda.current_stream(found.device).synchronize()
        _CONSTANTS[key] = found
    return found


@dataclass(frozen=True)
class Backend:
    """One implementation family on one kind of device (see the module docstring).

    Attributes:
        name: ``"native"``, ``"triton"`` or ``"torch"``.
        device_path: code with a CPU-only branch and a device branch takes the device branch
            (a cache's set index planned by `ops.plan` instead of a row index and
            the compiled CPU plan): off a CPU, and on a CPU under ``triton``.
        triton: the Triton kernels run the tensor ops (`kernels`), else their torch twins.
        compiled: the compiled CPU passes run (numba): the caller keeps the structures they
            read and calls them; else the torch code beside them (their specification).
        tbe: the whole-table step may run as FBGEMM's CPU TBE (`engine.tbe_step`, which
            checks that FBGEMM imports and the step fits it): the ``native`` family, with
            numba or without (its bookkeeping then falls to the torch code).
    """

    name: str
    device_path: bool
    triton: bool = False
    compiled: bool = False
    tbe: bool = False


TORCH_CPU = Backend("torch", device_path=False)
TORCH_DEVICE = Backend("torch", device_path=True)
TRITON = Backend("triton", device_path=True, triton=True)
NATIVE = Backend("native", device_path=False, compiled=True, tbe=True)
NATIVE_WITHOUT_NUMBA = Backend("native", device_path=False, tbe=True)  # FBGEMM, torch bookkeeping


_NAMES: dict[str | None, str] = {}  # the variable's values seen, and the choice each names


def for_device(device: torch.device | str) -> Backend:
    """The `Backend` that runs on ``device`` under ``EMBCACHE_BACKEND`` (read now: a
    ValueError for a name that is none of the choices)."""
    on_cpu = (device if isinstance(device, torch.device) else torch.device(device)).type == "cpu"
    return _choose(_name(), on_cpu)


def _name() -> str:
    """`backend_name`, each value of the variable parsed once."""
    raw = os.environ.get("EMBCACHE_BACKEND")
    name = _NAMES.get(raw)
    if name is None:
        name = _NAMES[raw] = backend_name()
    return name


def _choose(name: str, on_cpu: bool) -> Backend:
    if name == "triton" or (name == "auto" and not on_cpu):
        return TRITON
    if name == "auto":
        return NATIVE if _numba_imports() else NATIVE_WITHOUT_NUMBA
    return TORCH_CPU if on_cpu else TORCH_DEVICE


@functools.cache
def _numba_imports() -> bool:
    """`native.importable`, asked once a process: `for_device` is asked at every call of the
    public kernel functions (`embcache.kernels`)."""
    return native.importable()
