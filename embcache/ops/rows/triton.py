"""The rows family's Triton kernels: every cache's lock floors and unlock over one `SlotTable`
(one launch each a step), and direct mapping's slots with their locks (one launch).

Layout follows Liger-Kernel: kernels, then launchers, then `TritonRows`, the family's
implementation over them (`RowsOps`). Each kernel's torch twin is in `ops.rows.spec`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import embcache.ops.interpreter  # noqa: F401  (Triton 3.6's interpreter: a loop bound argument)
from embcache.ops.rows import RowsOps, SlotTable
from embcache.ops.rows.spec import SpecRows

_BLOCK = 1024

# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


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


@triton.jit(do_not_specialize=["n"])  # per batch: one variant
def _direct_slots_kernel(
    keys_ptr, row_offset_ptr, locks_ptr, slots_ptr, n, FUSION_K: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """``slots[j] = row_offset[keys[j] >> FUSION_K] + (keys[j] & mask)``, and one lock taken
    on each."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    b_key = tl.load(keys_ptr + o, mask=m, other=0)
    b_base = tl.load(row_offset_ptr + (b_key >> FUSION_K), mask=m, other=0)
    b_slot = b_base + (b_key & ((tl.full((), 1, tl.int64) << FUSION_K) - 1))
    tl.store(slots_ptr + o, b_slot, mask=m)
    tl.atomic_add(locks_ptr + b_slot, tl.full([BLOCK], 1, tl.int32), mask=m)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def lock_floors_triton(table: SlotTable) -> torch.Tensor:
    """The lowest lock among each cache's live slots, int32 ``[S]`` on the device (not read;
    ``INT32_MAX`` where a cache has none): one launch."""
    floors = torch.empty(len(table.slots), dtype=torch.int32, device=table.table.device)
    num_blocks = triton.cdiv(table.max_slots, _BLOCK)
    _lock_floors_kernel[(len(table.slots),)](table.table, floors, num_blocks, BLOCK=_BLOCK)
    return floors


def unlock_triton(table: SlotTable, dirty: bool) -> None:
    """One lock dropped from each live slot of every cache (checked by the caller, e.g. with
    `lock_floors_triton`), each row marked dirty with ``dirty``: one launch."""
    grid = (len(table.slots), max(1, triton.cdiv(table.max_slots, _BLOCK)))
    _unlock_kernel[grid](table.table, MARK_DIRTY=dirty, BLOCK=_BLOCK)


def direct_slots_triton(
    row_offset: torch.Tensor, keys: torch.Tensor, fusion_k: int, locks: torch.Tensor
) -> torch.Tensor:
    """The slot of each of ``keys`` (int64 fused ids, distinct, of bounded tables, checked)
    under direct mapping, int64 ``[n]``, each locked once in ``locks`` (int32): one launch.
    ``row_offset``: int64, the first slot of each table index."""
    keys = keys.contiguous()
    n = keys.numel()
    slots = torch.empty(n, dtype=torch.int64, device=keys.device)
    if n:
        _direct_slots_kernel[(triton.cdiv(n, _BLOCK),)](
            keys, row_offset, locks, slots, n, FUSION_K=fusion_k, BLOCK=_BLOCK
        )
    return slots


# ----------------------------------------------------------------------------------------------
# the implementation
# ----------------------------------------------------------------------------------------------


class TritonRows(SpecRows):
    """The rows family on the Triton kernels (`RowsOps`): the launchers above; the host's
    operations are the specification's (torch ops on the tensors' device)."""

    name = "triton"
    one_launch = True

    def lock_floors(self, table: SlotTable) -> torch.Tensor:
        return lock_floors_triton(table)

    def unlock(self, table: SlotTable, dirty: bool) -> None:
        unlock_triton(table, dirty)

    def direct_slots(
        self, row_offset: torch.Tensor, keys: torch.Tensor, fusion_k: int, locks: torch.Tensor
    ) -> torch.Tensor:
        return direct_slots_triton(row_offset, keys, fusion_k, locks)


IMPLEMENTATION: RowsOps = TritonRows()  # checked against the protocol
