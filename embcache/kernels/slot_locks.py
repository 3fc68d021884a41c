"""Several caches' slot locks checked and dropped with one launch each (the device path).

A training step holds one lock on each slot its batch reads, in every cache of the collection
(one cache per embedding dim). Before the step changes a row it checks that each slot it
updates is locked (the lowest lock among a cache's slots, read with the step's one host read);
after the update it drops those locks and marks the rows dirty. Cache by cache that is a
gather and a min, then an index add and a scatter: four launches a cache. Here one table of
device addresses (`SlotTable`: per cache its slots, their count, its locks and dirty flags) is
uploaded once a step, and two kernels serve every cache:

* `lock_floors`: the lowest lock among each cache's slots, int32 ``[S]`` (``INT32_MAX`` for a
  cache without a live slot);
* `unlock`: one lock dropped from each slot, and (``dirty``) its row marked dirty.

A slot of -1 (an id the cache did not admit) is skipped by both. The slots of one cache are
distinct (a resolve's), and the locks are dropped by integer atomics, so the result does not
depend on the order programs run in. `lock_floors_ref` and `unlock_ref` are the plain-torch
specification.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

import embcache.ops.interpreter  # noqa: F401  (Triton 3.6's interpreter: a loop bound argument)

INT32_MAX = 2**31 - 1
_BLOCK = 1024
# A table row: slots' address, their count, the locks' address, the dirty flags' address.
_FIELDS = 4


@triton.jit
def _segment(table_ptr, s):
    """Cache ``s``'s row of the table: ``(slots, n, locks, dirty)``, the addresses typed."""
    row = table_ptr + s * 4
    slots = tl.load(row).to(tl.pointer_type(tl.int64))
    n = tl.load(row + 1)
    locks = tl.load(row + 2).to(tl.pointer_type(tl.int32))
    dirty = tl.load(row + 3).to(tl.pointer_type(tl.int8))
    return slots, n, locks, dirty


@triton.jit(do_not_specialize=["num_blocks"])  # per step: one variant
def _lock_floors_kernel(table_ptr, floors_ptr, num_blocks, BLOCK: tl.constexpr):
    """Program s: ``floors[s] = min(locks_s[slot])`` over cache s's slots >= 0 (``num_blocks``
    blocks cover the largest cache's slots)."""
    s = tl.program_id(0).to(tl.int64)
    slots, n, locks, _ = _segment(table_ptr, s)
    b_acc = tl.full([BLOCK], 2147483647, tl.int32)
    for k in range(num_blocks):
        o = k * BLOCK + tl.arange(0, BLOCK)
        b_slot = tl.load(slots + o, mask=o < n, other=-1)
        m_live = b_slot >= 0
        b_lock = tl.load(locks + b_slot, mask=m_live, other=2147483647)
        b_acc = tl.minimum(b_acc, b_lock)
    tl.store(floors_ptr + s, tl.min(b_acc, axis=0))


@triton.jit
def _unlock_kernel(table_ptr, MARK_DIRTY: tl.constexpr, BLOCK: tl.constexpr):
    """Program (s, b): one lock dropped from block b of cache s's slots >= 0, each marked
    dirty under MARK_DIRTY."""
    s = tl.program_id(0).to(tl.int64)
    slots, n, locks, dirty = _segment(table_ptr, s)
    o = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    b_slot = tl.load(slots + o, mask=o < n, other=-1)
    m_live = b_slot >= 0
    tl.atomic_add(locks + b_slot, tl.full([BLOCK], -1, tl.int32), mask=m_live)
    if MARK_DIRTY:
        tl.store(dirty + b_slot, tl.full([BLOCK], 1, tl.int8), mask=m_live)


@dataclass
class SlotTable:
    """Several caches' slots with their locks and dirty flags, as the kernels read them: the
    tensors (kept alive while the table is) and their device addresses, uploaded once."""

    slots: list[torch.Tensor]  # int64 [n_s], contiguous, one per cache
    locks: list[torch.Tensor]  # int32 [slots_s]
    dirty: list[torch.Tensor]  # bool [slots_s]
    table: torch.Tensor  # int64 [S, 4] on the device

    @classmethod
    def of(
        cls, parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    ) -> SlotTable | None:
        """The table of ``(slots, locks, dirty)`` per cache, all on one device; None when a
        part is not as the kernels read it (slots int64 contiguous, locks int32, dirty bool,
        each contiguous), or there is none."""
        if not parts:
            return None
        device = parts[0][0].device
        rows: list[int] = []
        for slots, locks, dirty in parts:
            if (
                slots.dtype != torch.int64
                or locks.dtype != torch.int32
                or dirty.dtype != torch.bool
                or not (slots.is_contiguous() and locks.is_contiguous() and dirty.is_contiguous())
                or not slots.device == locks.device == dirty.device == device
            ):
                return None
            rows += [slots.data_ptr(), slots.numel(), locks.data_ptr(), dirty.data_ptr()]
        table = torch.tensor(rows, dtype=torch.int64).view(len(parts), _FIELDS)
        if device.type == "cuda":
            table = table.pin_memory().to(device, non_blocking=True)
        else:
            table = table.to(device)
        return cls([p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts], table)

    @property
    def max_slots(self) -> int:
        return max(s.numel() for s in self.slots)


def lock_floors(table: SlotTable) -> torch.Tensor:
    """The lowest lock among each cache's live slots, int32 ``[S]`` on the device (not read;
    ``INT32_MAX`` where a cache has none): one launch."""
    floors = torch.empty(len(table.slots), dtype=torch.int32, device=table.table.device)
    num_blocks = triton.cdiv(table.max_slots, _BLOCK)
    _lock_floors_kernel[(len(table.slots),)](table.table, floors, num_blocks, BLOCK=_BLOCK)
    return floors


def unlock(table: SlotTable, dirty: bool) -> None:
    """One lock dropped from each live slot of every cache (checked by the caller, e.g. with
    `lock_floors`), each row marked dirty with ``dirty``: one launch."""
    grid = (len(table.slots), max(1, triton.cdiv(table.max_slots, _BLOCK)))
    _unlock_kernel[grid](table.table, MARK_DIRTY=dirty, BLOCK=_BLOCK)


def lock_floors_ref(table: SlotTable) -> torch.Tensor:
    """`lock_floors` in plain torch."""
    floors = []
    for slots, locks in zip(table.slots, table.locks, strict=True):
        live = slots[slots >= 0]
        floors.append(int(locks[live].min()) if live.numel() else INT32_MAX)
    return torch.tensor(floors, dtype=torch.int32, device=table.table.device)


def unlock_ref(table: SlotTable, dirty: bool) -> None:
    """`unlock` in plain torch."""
    for slots, locks, flags in zip(table.slots, table.locks, table.dirty, strict=True):
        live = slots[slots >= 0]
        locks.index_add_(0, live, torch.full_like(live, -1, dtype=torch.int32))
        if dirty:
            flags[live] = True
