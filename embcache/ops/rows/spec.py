"""The rows family's specification in plain torch: the step's lock floors and unlock over a
`SlotTable` of several caches, direct mapping's slots, locked, and the host's writes at
positions, unlock, hashed rows and grouping by table.

`SpecRows` is the family's implementation (`RowsOps`): what the Triton kernels
(`ops.rows.triton`) and the compiled passes (`ops.rows.native`) are tested against. It is not
`RowsOps.one_launch`: a cache bound to it runs its own torch code (per cache) instead.

On a CPU, advanced-indexing writes (``t[idx] = v``, ``t[idx] += 1``) take torch's general
indexing path, three to five times slower than ``scatter_`` / ``index_add_`` on the same
positions, and ``index_copy_`` of whole rows about twice as slow as numpy's row assignment
(`benchmarks/bench_step_profile.py` shows where they were): the writes here use those.
"""

from __future__ import annotations

import numpy as np
import torch

from embcache.backend import constant
from embcache.hashing import mix64, row_counters
from embcache.ops.rows import INT32_MAX, RowsOps, SlotTable


def lock_floors_ref(table: SlotTable) -> torch.Tensor:
    """`RowsOps.lock_floors` in plain torch."""
    floors = []
    for slots, locks in zip(table.slots, table.locks, strict=True):
        live = slots[slots >= 0]
        floors.append(int(locks[live].min()) if live.numel() else INT32_MAX)
    return torch.tensor(floors, dtype=torch.int32, device=table.table.device)


def unlock_ref(table: SlotTable, dirty: bool) -> None:
    """`RowsOps.unlock` in plain torch."""
    for slots, locks, flags in zip(table.slots, table.locks, table.dirty, strict=True):
        live = slots[slots >= 0]
        locks.index_add_(0, live, torch.full_like(live, -1, dtype=torch.int32))
        if dirty:
            flags[live] = True


def direct_slots_ref(
    row_offset: torch.Tensor, keys: torch.Tensor, fusion_k: int, locks: torch.Tensor
) -> torch.Tensor:
    """`RowsOps.direct_slots` in plain torch."""
    slots = row_offset[keys >> fusion_k] + (keys & ((1 << fusion_k) - 1))
    locks.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
    return slots


def copy_rows_ref(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """`RowsOps.copy_rows`: on a CPU numpy's row assignment over the same memory (no copy, no
    torch dispatch; about twice as fast as ``index_copy_``), elsewhere and for bfloat16 (which
    numpy lacks) ``index_copy_``."""
    src = src.to(dst.dtype)
    if (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and idx.device.type == "cpu"
        and dst.dtype != torch.bfloat16
        and idx.numel()
    ):
        dst.detach().numpy()[idx.numpy()] = src.detach().numpy()
        return
    dst.index_copy_(0, idx, src)


def unlock_slots_ref(locks: torch.Tensor, slots: torch.Tensor, dirty: torch.Tensor | None) -> None:
    """`RowsOps.unlock_slots` (checked by the caller)."""
    locks.index_add_(0, slots, constant(-1, locks.dtype, locks.device).expand(len(slots)))
    if dirty is not None:
        dirty.index_fill_(0, slots, True)


def hashed_uniform_ref(
    ids: torch.Tensor, salt: int, mid: float, half: float, dim: int
) -> torch.Tensor:
    """`RowsOps.hashed_uniform`: 24 bits of ``mix64(mix64(id ^ salt) + column)`` per value,
    ``(2 u - 1) * half + mid`` in float64, rounded to float32."""
    bits = (mix64(row_counters(ids.cpu(), salt, dim)) >> 40) & 0xFFFFFF
    unit = bits.to(torch.float64) * (1.0 / (1 << 24))  # [0, 1)
    return ((2.0 * unit - 1.0) * half + mid).to(torch.float32)


class SpecRows:
    """The rows family in torch (`RowsOps`): the twins above."""

    name = "spec"
    one_launch = False
    compiled = False

    def lock_floors(self, table: SlotTable) -> torch.Tensor:
        return lock_floors_ref(table)

    def unlock(self, table: SlotTable, dirty: bool) -> None:
        unlock_ref(table, dirty)

    def direct_slots(
        self, row_offset: torch.Tensor, keys: torch.Tensor, fusion_k: int, locks: torch.Tensor
    ) -> torch.Tensor:
        return direct_slots_ref(row_offset, keys, fusion_k, locks)

    def fill_at(self, t: torch.Tensor, idx: torch.Tensor, value: float | int | bool) -> None:
        t.scatter_(0, idx, value)  # the scalar overload: one launch, no values to fill first

    def add_at(self, t: torch.Tensor, idx: torch.Tensor, delta: int) -> None:
        t.index_add_(0, idx, constant(delta, t.dtype, t.device).expand(idx.numel()))

    def copy_rows(self, dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
        copy_rows_ref(dst, idx, src)

    def scatter_split(
        self, weights: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor
    ) -> None:
        dim = weights.shape[1]
        copy_rows_ref(weights, slots, rows[:, :dim])
        copy_rows_ref(state, slots, rows[:, dim:])

    def gather_join(
        self, weights: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, out: torch.Tensor
    ) -> None:
        dim = weights.shape[1]
        torch.index_select(weights, 0, slots, out=out[:, :dim])
        torch.index_select(state, 0, slots, out=out[:, dim:])

    def unlocks_checked(self, slots: torch.Tensor) -> bool:
        return False

    def unlock_slots(
        self, locks: torch.Tensor, slots: torch.Tensor, dirty: torch.Tensor | None
    ) -> None:
        unlock_slots_ref(locks, slots, dirty)

    def hashed_uniform(
        self, ids: torch.Tensor, salt: int, mid: float, half: float, dim: int
    ) -> torch.Tensor:
        return hashed_uniform_ref(ids, salt, mid, half, dim)

    def group_by_table(
        self, fused: torch.Tensor, fusion_k: int, ascending: bool, num_tables: int
    ) -> tuple[np.ndarray, torch.Tensor | None, torch.Tensor] | None:
        return None  # the caller sorts


IMPLEMENTATION: RowsOps = SpecRows()  # checked against the protocol
