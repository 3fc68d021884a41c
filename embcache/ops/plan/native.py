"""The plan family on a CPU with numba: the torch specification (`ops.plan.spec`) for the set
index, and the compiled plan of a cache with a row index: `plan_lru`, `plan_lfu` and
`touch_lfu`, `reserve`, and the scratch area's release (`scratch_done`, `free_slots`), each one
pass of `native.plan_kernels` over numpy views of the cache's tensors (no copy) computing what
the torch code of `cache.plan` and `cache.scratch` computes (their specification).

This module is where those kernels are called from: each operation hands its arrays to the
kernel of its name and returns what the kernel returns. The kernels' module is imported at the
first call, not with this one: the registry imports every implementation module, where numba
is absent too (the GPU image).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from embcache.ops.plan import PlanOps
from embcache.ops.plan.spec import PlanArrays, SpecPlan

_KERNELS: list[Any] = []  # [native.plan_kernels], imported at the first call


def _kernels() -> Any:
    """`native.plan_kernels`, imported at the first call (numba compiles each kernel at its
    first call, or loads it from its disk cache)."""
    if not _KERNELS:
        from embcache.native import plan_kernels

        _KERNELS.append(plan_kernels)
    return _KERNELS[0]


class NativePlan(SpecPlan):
    """The plan family with the compiled CPU plan (module docstring): each compiled operation
    calls the kernel of its name in `native.plan_kernels`."""

    name = "native"
    compiled = True

    def plan_lru(
        self, ids: np.ndarray, where: np.ndarray, row_offset: np.ndarray, fusion_k: int,
        scores: np.ndarray, locks: np.ndarray, batch_of: np.ndarray, num_slots: int,
        num_sets: int, ways: int, tick: int, batch_seq: int, slots: np.ndarray,
    ) -> PlanArrays:  # fmt: skip
        """A set-associative LRU cache's plan (`SetPlanner.plan_sets`): ``slots`` filled
        (hits; -1 for misses), the hits locked, and ``(miss_pos, order, place)``: the misses'
        positions, their order by (set, shuffle) and each one's way in that order (-1: none
        free); three empty arrays when there is no miss (every slot locked and touched)."""
        return _kernels().plan_lru(
            ids, where, row_offset, fusion_k, scores, locks, batch_of, num_slots, num_sets, ways,
            tick, batch_seq, slots,
        )  # fmt: skip

    def plan_lfu(
        self, ids: np.ndarray, where: np.ndarray, row_offset: np.ndarray, fusion_k: int,
        counts: np.ndarray, count_offset: np.ndarray, scores: np.ndarray, locks: np.ndarray,
        batch_of: np.ndarray, num_sets: int, ways: int, tick: int, batch_seq: int,
        slots: np.ndarray,
    ) -> PlanArrays:  # fmt: skip
        """`plan_lru` for an LFU cache counted exactly (``counts[count_offset[t] + id]``):
        misses by (set, frequency descending, shuffle), a miss whose way holds a row scored
        no lower left to scratch (-1). No miss: every slot locked (`touch_lfu` does the
        rest)."""
        return _kernels().plan_lfu(
            ids, where, row_offset, fusion_k, counts, count_offset, scores, locks, batch_of,
            num_sets, ways, tick, batch_seq, slots,
        )  # fmt: skip

    def touch_lfu(
        self, ids: np.ndarray, slots: np.ndarray, counts: np.ndarray, count_offset: np.ndarray,
        fusion_k: int, scores: np.ndarray, num_slots: int,
    ) -> None:  # fmt: skip
        """One more request of each (distinct) id counted, each slot of the cache proper
        scored with its row's count (`SetPlanner.touch` for an LFU cache counted exactly)."""
        _kernels().touch_lfu(ids, slots, counts, count_offset, fusion_k, scores, num_slots)

    def reserve(
        self, ids: np.ndarray, slots: np.ndarray, miss_pos: np.ndarray, order: np.ndarray,
        place: np.ndarray, where: np.ndarray, row_offset: np.ndarray, fusion_k: int,
        slot_keys: np.ndarray, scores: np.ndarray, locks: np.ndarray, dirty: np.ndarray,
        num_slots: int, tick: int,
    ) -> tuple[np.ndarray, ...]:  # fmt: skip
        """Every miss given its planned slot, the victims recorded, the slots re-keyed and
        re-indexed, the batch locked and touched. Returns the misses' slots, the dirty
        victims' ids and slots, every evicted id, and each reserved slot's old key, score and
        dirty flag."""
        return _kernels().reserve(
            ids, slots, miss_pos, order, place, where, row_offset, fusion_k, slot_keys, scores,
            locks, dirty, num_slots, tick,
        )  # fmt: skip

    def scratch_done(
        self, slot_keys: np.ndarray, locks: np.ndarray, batch_of: np.ndarray,
        dirty: np.ndarray, num_slots: int, batch_seq: int,
    ) -> PlanArrays:  # fmt: skip
        """The scratch rows (slots from ``num_slots``) no batch holds any more, ascending,
        and the dirty ones' slots and keys (`HotCache.release`)."""
        return _kernels().scratch_done(slot_keys, locks, batch_of, dirty, num_slots, batch_seq)

    def free_slots(
        self, slots: np.ndarray, slot_keys: np.ndarray, dirty: np.ndarray, where: np.ndarray,
        row_offset: np.ndarray, fusion_k: int,
    ) -> None:  # fmt: skip
        """The rows held at ``slots`` leave the cache: row index entries cleared, slots empty
        and clean."""
        _kernels().free_slots(slots, slot_keys, dirty, where, row_offset, fusion_k)


IMPLEMENTATION: PlanOps = NativePlan()  # checked against the protocol
