"""The rows family on a CPU with numba: the torch specification (`ops.rows.spec`) for the
device path's three, and one compiled pass over numpy views of the tensors (no copy) for each
host operation whose arguments it takes, computing what the specification computes:

* `NativeRows.fill_at`, `add_at`: ``row_kernels.write_at``, every position checked first
  (about as fast as ``scatter_`` on arrays in the CPU's caches; it asks for the lines ahead,
  for the cache's bookkeeping arrays that a step's row moves push out of them);
* `NativeRows.copy_rows`: ``row_kernels.scatter_rows`` (half precision moved as its bits);
  `NativeRows.scatter_split`, `gather_join`: a row's weights and state moved in one pass;
* `NativeRows.unlock_slots`: ``plan_kernels.unlock`` / ``unlock_dirty``, which check every
  lock in the same pass before dropping any (`NativeRows.unlocks_checked`);
* `NativeRows.hashed_uniform`: ``row_kernels.hashed_uniform`` (the torch path builds a 64-bit
  temporary per value, several times over);
* `NativeRows.group_by_table`: ``row_kernels.group_by_table``, one pass when the ids are
  grouped already and a counting sort otherwise.

The kernel modules import numba, so they are imported at the first call (`_kernels`), never
with this module (the registry imports every implementation; the GPU image has no numba).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import embcache.native as native
from embcache.ops.rows import RowsOps
from embcache.ops.rows.spec import SpecRows

# The compiled `fill_at` / `add_at` take these dtypes (numba has no half precision), and write
# the value as this numpy scalar type.
_COMPILED_DTYPES = {
    torch.bool: np.bool_,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float32: np.float32,
}

_KERNELS: list[Any] = []  # [plan_kernels, row_kernels], imported at the first call


def _kernels() -> list[Any]:
    if not _KERNELS:
        from embcache.native import plan_kernels, row_kernels

        _KERNELS.extend((plan_kernels, row_kernels))
    return _KERNELS


def _compiled_at(t: torch.Tensor, idx: torch.Tensor) -> bool:
    """Whether a write at ``idx`` into ``t`` goes through the compiled pass: CPU tensors, a
    contiguous 1-D ``t`` of a dtype numba has, contiguous int64 positions. (The write then
    leaves ``t``'s autograd version counter as it was: the cache's bookkeeping is saved by no
    graph.)"""
    return (
        t.device.type == "cpu"
        and idx.device.type == "cpu"
        and t.dim() == 1
        and idx.dtype == torch.int64
        and t.dtype in _COMPILED_DTYPES
        and t.is_contiguous()
        and idx.is_contiguous()
        and not t.requires_grad
    )


def _packed_float32(
    weights: torch.Tensor, state: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor
) -> bool:
    """Whether float32 stored ``rows`` (weights, then state) move between ``slots`` of CPU
    ``weights`` and ``state`` through one compiled pass (``scatter_split`` / ``gather_join``)."""
    return (
        weights.dtype == state.dtype == rows.dtype == torch.float32
        and slots.dtype == torch.int64
        and weights.device.type == rows.device.type == slots.device.type == "cpu"
        and rows.shape[1] == weights.shape[1] + state.shape[1]
        and not (weights.requires_grad or state.requires_grad)
    )


class NativeRows(SpecRows):
    """The rows family with the compiled CPU passes (module docstring); what they cannot take
    goes to the specification."""

    name = "native"
    compiled = True

    def fill_at(self, t: torch.Tensor, idx: torch.Tensor, value: float | int | bool) -> None:
        if not _compiled_at(t, idx):
            super().fill_at(t, idx, value)
            return
        arr, at = t.numpy(), idx.numpy()
        bad = _kernels()[1].write_at(arr, at, _COMPILED_DTYPES[t.dtype](value), False)
        if bad >= 0:  # as torch's ``scatter_`` refuses it (nothing was written)
            raise RuntimeError(str(native.OutOfRangeError("index", int(at[bad]), bad, len(arr))))

    def add_at(self, t: torch.Tensor, idx: torch.Tensor, delta: int) -> None:
        if not _compiled_at(t, idx):
            super().add_at(t, idx, delta)
            return
        arr, at = t.numpy(), idx.numpy()
        bad = _kernels()[1].write_at(arr, at, _COMPILED_DTYPES[t.dtype](delta), True)
        if bad >= 0:  # an IndexError, as ``index_add_``'s (nothing was written)
            raise native.OutOfRangeError("index", int(at[bad]), bad, len(arr))

    def copy_rows(self, dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
        src = src.to(dst.dtype)
        if (
            dst.dim() == 2
            and idx.dtype == torch.int64
            and dst.device.type == src.device.type == idx.device.type == "cpu"
            and dst.dtype != torch.bfloat16
            and idx.numel()
        ):
            d, s = dst.detach().numpy(), src.detach().numpy()
            if d.dtype == np.float16:  # moved as their bits (numba has no float16)
                d, s = d.view(np.int16), s.view(np.int16)
            _kernels()[1].scatter_rows(d, idx.numpy(), s)
            return
        super().copy_rows(dst, idx, src)

    def scatter_split(
        self, weights: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor
    ) -> None:
        if not _packed_float32(weights, state, rows, slots):
            super().scatter_split(weights, state, slots, rows)
            return
        _kernels()[1].scatter_split(weights.numpy(), state.numpy(), slots.numpy(), rows.numpy())

    def gather_join(
        self, weights: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, out: torch.Tensor
    ) -> None:
        if not _packed_float32(weights, state, out, slots):
            super().gather_join(weights, state, slots, out)
            return
        _kernels()[1].gather_join(weights.numpy(), state.numpy(), slots.numpy(), out.numpy())

    def unlocks_checked(self, slots: torch.Tensor) -> bool:
        return slots.dtype == torch.int64 and slots.is_contiguous()

    def unlock_slots(
        self, locks: torch.Tensor, slots: torch.Tensor, dirty: torch.Tensor | None
    ) -> None:
        """One lock dropped from each of ``slots`` when every one is locked (checked in the
        same pass: else nothing changes and RuntimeError), each marked in ``dirty`` too."""
        if not self.unlocks_checked(slots):
            super().unlock_slots(locks, slots, dirty)
            return
        plan_kernels = _kernels()[0]
        if dirty is None:
            bad = plan_kernels.unlock(locks.numpy(), slots.numpy())
        else:
            bad = plan_kernels.unlock_dirty(locks.numpy(), dirty.numpy(), slots.numpy())
        if bad >= 0:
            raise RuntimeError("HotCache.unlock: a slot that is not locked was unlocked")

    def hashed_uniform(
        self, ids: torch.Tensor, salt: int, mid: float, half: float, dim: int
    ) -> torch.Tensor:
        out = torch.empty(ids.numel(), dim, dtype=torch.float32)
        if ids.numel():
            host = ids.to(torch.int64).cpu().contiguous()
            _kernels()[1].hashed_uniform(host.numpy(), salt, mid, half, out.numpy())
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
        status = _kernels()[1].group_by_table(
            fused.numpy(), fusion_k, ascending, counts, order.numpy(), raw.numpy()
        )
        if status == native.GROUP_NEEDS_SORT:
            return None
        return counts, (None if status == native.GROUP_SORTED else order), raw


IMPLEMENTATION: RowsOps = NativeRows()  # checked against the protocol
