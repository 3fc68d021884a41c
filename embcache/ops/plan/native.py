"""The plan family on a CPU with numba: the torch specification (`ops.plan.spec`) for the set
index, and the compiled plan of a cache with a row index (`embcache.native`): `plan_lru`,
`plan_lfu` and `touch_lfu`, `reserve`, and the scratch area's release (`scratch_done`,
`free_slots`), each one pass over numpy views of the cache's tensors computing what the torch
code of `cache.plan` and `cache.scratch` computes (their specification).
"""

from __future__ import annotations

import numpy as np

import embcache.native as native
from embcache.ops.plan import PlanOps
from embcache.ops.plan.spec import PlanArrays, SpecPlan


class NativePlan(SpecPlan):
    """The plan family with the compiled CPU plan (module docstring): each compiled operation
    calls `embcache.native`'s function of its name."""

    name = "native"
    compiled = True

    def plan_lru(
        self, ids: np.ndarray, where: np.ndarray, row_offset: np.ndarray, fusion_k: int,
        scores: np.ndarray, locks: np.ndarray, batch_of: np.ndarray, num_slots: int,
        num_sets: int, ways: int, tick: int, batch_seq: int, slots: np.ndarray,
    ) -> PlanArrays:  # fmt: skip
        return native.plan_lru(
            ids, where, row_offset, fusion_k, scores, locks, batch_of, num_slots, num_sets, ways,
            tick, batch_seq, slots,
        )  # fmt: skip

    def plan_lfu(
        self, ids: np.ndarray, where: np.ndarray, row_offset: np.ndarray, fusion_k: int,
        counts: np.ndarray, count_offset: np.ndarray, scores: np.ndarray, locks: np.ndarray,
        batch_of: np.ndarray, num_sets: int, ways: int, tick: int, batch_seq: int,
        slots: np.ndarray,
    ) -> PlanArrays:  # fmt: skip
        return native.plan_lfu(
            ids, where, row_offset, fusion_k, counts, count_offset, scores, locks, batch_of,
            num_sets, ways, tick, batch_seq, slots,
        )  # fmt: skip

    def touch_lfu(
        self, ids: np.ndarray, slots: np.ndarray, counts: np.ndarray, count_offset: np.ndarray,
        fusion_k: int, scores: np.ndarray, num_slots: int,
    ) -> None:  # fmt: skip
        return native.touch_lfu(ids, slots, counts, count_offset, fusion_k, scores, num_slots)

    def reserve(
        self, ids: np.ndarray, slots: np.ndarray, miss_pos: np.ndarray, order: np.ndarray,
        place: np.ndarray, where: np.ndarray, row_offset: np.ndarray, fusion_k: int,
        slot_keys: np.ndarray, scores: np.ndarray, locks: np.ndarray, dirty: np.ndarray,
        num_slots: int, tick: int,
    ) -> tuple[np.ndarray, ...]:  # fmt: skip
        return native.reserve(
            ids, slots, miss_pos, order, place, where, row_offset, fusion_k, slot_keys, scores,
            locks, dirty, num_slots, tick,
        )  # fmt: skip

    def scratch_done(
        self, slot_keys: np.ndarray, locks: np.ndarray, batch_of: np.ndarray,
        dirty: np.ndarray, num_slots: int, batch_seq: int,
    ) -> PlanArrays:  # fmt: skip
        return native.scratch_done(slot_keys, locks, batch_of, dirty, num_slots, batch_seq)

    def free_slots(
        self, slots: np.ndarray, slot_keys: np.ndarray, dirty: np.ndarray, where: np.ndarray,
        row_offset: np.ndarray, fusion_k: int,
    ) -> None:  # fmt: skip
        return native.free_slots(slots, slot_keys, dirty, where, row_offset, fusion_k)


IMPLEMENTATION: PlanOps = NativePlan()  # checked against the protocol
