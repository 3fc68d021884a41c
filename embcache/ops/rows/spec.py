"""The rows family's specification in plain torch: the step's lock floors and unlock over a
`SlotTable` of several caches, and direct mapping's slots, locked.

`SpecRows` is the family's implementation (`RowsOps`): what the Triton kernels
(`ops.rows.triton`) are tested against. It is not `RowsOps.one_launch`: a cache bound to it
runs its own torch code (per cache) instead.
"""

from __future__ import annotations

import torch

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


class SpecRows:
    """The rows family in torch (`RowsOps`): the twins above."""

    name = "spec"
    one_launch = False

    def lock_floors(self, table: SlotTable) -> torch.Tensor:
        return lock_floors_ref(table)

    def unlock(self, table: SlotTable, dirty: bool) -> None:
        unlock_ref(table, dirty)

    def direct_slots(
        self, row_offset: torch.Tensor, keys: torch.Tensor, fusion_k: int, locks: torch.Tensor
    ) -> torch.Tensor:
        return direct_slots_ref(row_offset, keys, fusion_k, locks)


IMPLEMENTATION: RowsOps = SpecRows()  # checked against the protocol
