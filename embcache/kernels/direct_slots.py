"""Direct mapping's slots, locked, in one launch (the device path).

A cache whose capacity covers every row of its tables gives row ``r`` of table ``t`` the slot
``row_offset[t] + r`` (`cache.direct`). Its plan for a batch's unique fused ids ``key = (t <<
fusion_k) | r`` is that slot, with one lock taken on it: in torch ops a shift, a gather, a mask
and an add, then an index add on the locks, five launches a cache a step. `direct_slots` does
it in one kernel. The ids are distinct (a dedup's), so each slot gets one lock; the locks are
taken by integer atomics, whatever order the programs run in. `direct_slots_ref` is the
plain-torch specification.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


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


def direct_slots(
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


def direct_slots_ref(
    row_offset: torch.Tensor, keys: torch.Tensor, fusion_k: int, locks: torch.Tensor
) -> torch.Tensor:
    """`direct_slots` in plain torch."""
    slots = row_offset[keys >> fusion_k] + (keys & ((1 << fusion_k) - 1))
    locks.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
    return slots
