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
construction (a cache decides its structures, a tier table its row moves), a step's first use
of a compiled pass. The variable is read at every `for_device` call, so that tests can switch
it per test; whoever holds a `Backend` made its choice once and keeps it (a cache, a dense
tier table, a step); stateless helpers (`embcache.indexing`) ask at each call.

The families differ in the operations below (each a method: the torch code here is the
specification, `NativeBackend` overrides it with the compiled passes) and in the facts the
code built on them reads: `Backend.compiled` (keep the structures the compiled passes read: a
row index, a bitmap dedup, float32 tier tables moved in one pass, and call them),
`Backend.device_path`, `Backend.triton` and `Backend.tbe`. Nothing else in the package asks
which implementation is present (`tests/test_architecture.py` checks it).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

import embcache.native as native
from embcache.hashing import mix64, row_counters

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

    # -- operations: the torch specification ---------------------------------------------

    def unlocks_checked(self, slots: torch.Tensor) -> bool:
        """Whether `unlock` checks ``slots``' locks itself (in its pass, before dropping any);
        else the caller checks them first (one device read for several caches)."""
        return False

    def unlock(self, locks: torch.Tensor, slots: torch.Tensor, dirty: torch.Tensor | None) -> None:
        """One lock dropped from each of ``slots`` (checked by the caller here), each marked
        in ``dirty`` when given."""
        locks.index_add_(0, slots, constant(-1, locks.dtype, locks.device).expand(len(slots)))
        if dirty is not None:
            dirty.index_fill_(0, slots, True)

    def hashed_uniform(
        self, ids: torch.Tensor, salt: int, mid: float, half: float, dim: int
    ) -> torch.Tensor:
        """Rows of ``dim`` float32 values drawn uniformly in ``[mid - half, mid + half)`` from
        24 bits of a counter hash of ``(salt, id, column)``: the same bits on every backend."""
        bits = (mix64(row_counters(ids.cpu(), salt, dim)) >> 40) & 0xFFFFFF
        unit = bits.to(torch.float64) * (1.0 / (1 << 24))  # [0, 1)
        return ((2.0 * unit - 1.0) * half + mid).to(torch.float32)

    def group_by_table(
        self, fused: torch.Tensor, fusion_k: int, ascending: bool, num_tables: int
    ) -> tuple[np.ndarray, torch.Tensor | None, torch.Tensor] | None:
        """Fused ids grouped by table in one pass, where that is possible:
        ``(ids per table, order or None when already grouped, raw ids in group order)``, or
        None (the caller sorts: the specification)."""
        return None


@dataclass(frozen=True)
class NativeBackend(Backend):
    """The compiled family on a CPU: each operation one numba pass over numpy views of the
    tensors (no copy), computing what `Backend`'s torch code computes."""

    def unlocks_checked(self, slots: torch.Tensor) -> bool:
        return slots.dtype == torch.int64 and slots.is_contiguous()

    def unlock(self, locks: torch.Tensor, slots: torch.Tensor, dirty: torch.Tensor | None) -> None:
        """One lock dropped from each of ``slots`` when every one is locked (checked in the
        same pass: else nothing changes and RuntimeError), each marked in ``dirty`` too."""
        if not self.unlocks_checked(slots):
            super().unlock(locks, slots, dirty)
            return
        if dirty is None:
            bad = native.unlock(locks.numpy(), slots.numpy())
        else:
            bad = native.unlock_dirty(locks.numpy(), dirty.numpy(), slots.numpy())
        if bad >= 0:
            raise RuntimeError("HotCache.unlock: a slot that is not locked was unlocked")

    def hashed_uniform(
        self, ids: torch.Tensor, salt: int, mid: float, half: float, dim: int
    ) -> torch.Tensor:
        out = torch.empty(ids.numel(), dim, dtype=torch.float32)
        if ids.numel():
            host = ids.to(torch.int64).cpu().contiguous()
            native.hashed_uniform(host.numpy(), salt, mid, half, out.numpy())
        return out

    def group_by_table(
        self, fused: torch.Tensor, fusion_k: int, ascending: bool, num_tables: int
    ) -> tuple[np.ndarray, torch.Tensor | None, torch.Tensor] | None:
        n = fused.numel()
        if n < 2 or fused.dtype != torch.int64 or fused.device.type != "cpu":
            return None
        if not fused.is_contiguous():
            return None
        counts = np.zeros(num_tables, dtype=np.int64)
        order = torch.empty(n, dtype=torch.int64)
        raw = torch.empty(n, dtype=torch.int64)
        status = native.group_by_table(
            fused.numpy(), fusion_k, ascending, counts, order.numpy(), raw.numpy()
        )
        if status == native.GROUP_NEEDS_SORT:
            return None
        return counts, (None if status == native.GROUP_SORTED else order), raw


TORCH_CPU = Backend("torch", device_path=False)
TORCH_DEVICE = Backend("torch", device_path=True)
TRITON = Backend("triton", device_path=True, triton=True)
NATIVE = NativeBackend("native", device_path=False, compiled=True, tbe=True)
NATIVE_WITHOUT_NUMBA = Backend("native", device_path=False, tbe=True)  # FBGEMM, torch bookkeeping


_NAMES: dict[str | None, str] = {}  # the variable's values seen, and the choice each names


def for_device(device: torch.device | str) -> Backend:
    """The `Backend` that runs on ``device`` under ``EMBCACHE_BACKEND`` (read now: a
    ValueError for a name that is none of the choices)."""
    on_cpu = (device if isinstance(device, torch.device) else torch.device(device)).type == "cpu"
    return _choose(_name(), on_cpu)


def cpu_backend() -> Backend:
    """`for_device` of the CPU, for the stateless helpers that ask at every call
    (`embcache.indexing`)."""
    return _choose(_name(), True)


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
    """`native.importable`, asked once a process: `cpu_backend` is asked at every call of the
    stateless helpers."""
    return native.importable()
