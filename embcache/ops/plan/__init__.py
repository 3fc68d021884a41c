"""The plan family: a set-associative cache's index (the set of an id, the way holding it,
victim ways for a batch's misses), the device plan's steps around it, and the compiled CPU
plan of a cache with a row index.

`PlanOps` is the family's protocol; its implementations are `spec.SpecPlan` (torch, the
specification), `triton.TritonPlan` (the Triton kernels) and `native.NativePlan` (numba's
compiled plan), one of them bound per cache by `embcache.ops.registry`. Nothing outside
`embcache.ops` imports an implementation.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

PlanArrays = tuple[np.ndarray, np.ndarray, np.ndarray]


class PlanOps(Protocol):
    """One implementation of the plan family.

    Attributes:
        name: ``"spec"``, ``"triton"`` or ``"native"``.
        places_misses: whether `assign_misses` runs here (the device path's placement of a
            plan's misses in one kernel), else it raises NotImplementedError.
        compiled: whether the compiled CPU plan runs here (`plan_lru`, `plan_lfu`,
            `touch_lfu`, `reserve`, `scratch_done`, `free_slots`: numpy arrays in and out),
            else they raise NotImplementedError and the caller's torch code plans.
    """

    name: str
    places_misses: bool
    compiled: bool

    def set_index(self, ids: torch.Tensor, num_sets: int) -> torch.Tensor:
        """Set of each id: ``(mix64(id) & (2**63 - 1)) % num_sets`` (splitmix64's finaliser).

        Args:
            ids: int64 fused ids, any shape, any value (negative ones included).
            num_sets: number of sets, >= 1.

        Returns:
            int64 tensor of ``ids``' shape, values in ``[0, num_sets)``; the same bits in
            every implementation.
        """
        ...

    def cache_lookup(
        self, keys: torch.Tensor, ids: torch.Tensor, sets: torch.Tensor
    ) -> torch.Tensor:
        """Way holding each id in its set, or -1 for a miss.

        Args:
            keys: int64 ``[S, W]``, the id held by each way, -1 for an empty way; an id
                appears in at most one way of its set.
            ids: int64 ``[n]``, ids to look up (never -1).
            sets: int64 ``[n]`` in ``[0, S)``, usually ``set_index(ids, S)``.

        Returns:
            int64 ``[n]``: the way in ``[0, W)`` holding ``ids[i]`` in set ``sets[i]``, else -1.
        """
        ...

    def cache_slots(
        self, keys: torch.Tensor, ids: torch.Tensor, sets: torch.Tensor
    ) -> torch.Tensor:
        """`cache_lookup` as slots: ``sets[i] * W + way`` where ``ids[i]`` is held, else -1
        (one kernel on the device path, where a lookup's slots are what the plan wants)."""
        ...

    def assign_ways(
        self,
        scores: torch.Tensor,
        blocked: torch.Tensor,
        miss_sets: torch.Tensor,
        num_runs: int | None = None,
    ) -> torch.Tensor:
        """Give each miss a distinct victim way of its set, or -1 where the set runs out.

        The ways of a set are ordered by ``(blocked, score, way)`` ascending; the k-th miss of
        a set (in the order of ``miss_sets``) takes the k-th way of that order when k is below
        the set's number of unblocked ways, else it overflows to -1. Callers give empty ways
        the lowest score.

        Args:
            scores: int64 ``[S, W]`` eviction scores (LRU: last-use tick; LFU: frequency).
            blocked: bool ``[S, W]``, ways that must not be taken (locked, or hit).
            miss_sets: int64 ``[m]``, the set of each miss, sorted ascending (not checked).
            num_runs: the number of distinct values in ``miss_sets``, when the caller knows
                it: the torch twin then reads nothing on the host (the kernel never does).

        Returns:
            int64 ``[m]``: the way in ``[0, W)`` assigned to each miss, or -1 (overflow).
        """
        ...

    def add_at_held(self, t: torch.Tensor, slots: torch.Tensor, delta: int) -> None:
        """``t[s] += delta`` for each slot ``s`` of ``slots`` that is not -1 (a plan's locks of
        its hits): one kernel on the device path (int32 ``t``)."""
        ...

    def lookup_counts(
        self, slots: torch.Tensor, num_slots: int, admitted: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(missing, counts)`` of a lookup's int64 ``slots`` (-1: not held): bool ``[n]``,
        the ids not held (and admitted, when ``admitted`` says which are), and 0-d int64
        counts of the ids missing, held, held in the scratch area (slot >= ``num_slots``)
        and, with ``admitted``, not admitted: what a plan reads before it sorts its misses."""
        ...

    def salted_mix64(self, ids: torch.Tensor, salt: int) -> torch.Tensor:
        """``hashing.mix64(ids ^ salt)`` of int64 ``ids`` (any shape): a batch's shuffle of
        its misses (`SetPlanner._choose_ways`).

        Raises:
            TypeError: ``ids`` not int64, or ``salt`` not an int.
        """
        ...

    def miss_keys(
        self, ids: torch.Tensor, miss_pos: torch.Tensor, salt: int, num_sets: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What an LRU plan sorts its misses by, for positions ``miss_pos`` (int64 ``[m]``)
        into int64 ``ids``, -1 marking padding (`SetPlanner._choose_ways_ahead`):
        ``(miss_ids, sets, key)``, int64 ``[m]`` each: the id at each position (``ids[0]``
        for padding), its set (`set_index`; ``num_sets`` for padding, so that it sorts last)
        and its key, the set above the 20 low bits of ``mix64(id ^ salt)``.

        Raises:
            TypeError: ``ids`` or ``miss_pos`` not int64, or ``salt`` not an int.
            ValueError: ``num_sets`` below 1 or at or above 2**43 (the key's set bits).
        """
        ...

    def assign_misses(
        self,
        miss_sets: torch.Tensor,
        scores: torch.Tensor,
        locks: torch.Tensor,
        batch_of: torch.Tensor,
        keys: torch.Tensor,
        dirty: torch.Tensor,
        ways: int,
        batch_seq: int,
        num_misses: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The place of each miss of a cache whose slot ``s * ways + w`` holds ``scores``,
        ``locks``, ``batch_of``, ``keys`` and ``dirty``, with its counts: ``(place,
        counts)``, int64 ``[m]`` (slot or -1) and int64 ``[3]`` (placed, holding a row,
        dirty); what `SetPlanner._choose_ways` computes with `assign_ways` and the torch ops
        around it (their specification). ``num_misses`` (a one-value device tensor, not
        read): only the first that many of ``miss_sets`` are misses. Only where
        `places_misses`."""
        ...

    def plan_lru(
        self, ids: np.ndarray, where: np.ndarray, row_offset: np.ndarray, fusion_k: int,
        scores: np.ndarray, locks: np.ndarray, batch_of: np.ndarray, num_slots: int,
        num_sets: int, ways: int, tick: int, batch_seq: int, slots: np.ndarray,
    ) -> PlanArrays:  # fmt: skip
        """An LRU cache's compiled plan (`native.plan_lru`). Only where `compiled`."""
        ...

    def plan_lfu(
        self, ids: np.ndarray, where: np.ndarray, row_offset: np.ndarray, fusion_k: int,
        counts: np.ndarray, count_offset: np.ndarray, scores: np.ndarray, locks: np.ndarray,
        batch_of: np.ndarray, num_sets: int, ways: int, tick: int, batch_seq: int,
        slots: np.ndarray,
    ) -> PlanArrays:  # fmt: skip
        """An exact LFU cache's compiled plan (`native.plan_lfu`). Only where `compiled`."""
        ...

    def touch_lfu(
        self, ids: np.ndarray, slots: np.ndarray, counts: np.ndarray, count_offset: np.ndarray,
        fusion_k: int, scores: np.ndarray, num_slots: int,
    ) -> None:  # fmt: skip
        """An exact LFU's counts and scores after a batch (`native.touch_lfu`). Only where
        `compiled`."""
        ...

    def reserve_placed(
        self, ids: torch.Tensor, slots: torch.Tensor, order_pos: torch.Tensor,
        place: torch.Tensor, slot_keys: torch.Tensor, dirty: torch.Tensor,
        scores: torch.Tensor, locks: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """A device plan's misses, every one placed in a way of the cache proper, reserved:
        miss ``j`` (at position ``order_pos[j]`` of ``ids``) takes slot ``place[j]`` (distinct
        slots): ``slots[order_pos[j]] = place[j]``, the slot's key becomes ``ids[order_pos[j]]``,
        its dirty flag is cleared and it gains a lock. Returns, per miss, what the slot held
        before (its key, score and dirty flag: the plan's rollback), whether it held a row (an
        eviction) and whether that row was dirty (a write-back)."""
        ...

    def reserve(
        self, ids: np.ndarray, slots: np.ndarray, miss_pos: np.ndarray, order: np.ndarray,
        place: np.ndarray, where: np.ndarray, row_offset: np.ndarray, fusion_k: int,
        slot_keys: np.ndarray, scores: np.ndarray, locks: np.ndarray, dirty: np.ndarray,
        num_slots: int, tick: int,
    ) -> tuple[np.ndarray, ...]:  # fmt: skip
        """A compiled plan's ways reserved (`native.reserve`). Only where `compiled`."""
        ...

    def scratch_done(
        self, slot_keys: np.ndarray, locks: np.ndarray, batch_of: np.ndarray,
        dirty: np.ndarray, num_slots: int, batch_seq: int,
    ) -> PlanArrays:  # fmt: skip
        """The scratch rows a release writes back and frees (`native.scratch_done`). Only
        where `compiled`."""
        ...

    def free_slots(
        self, slots: np.ndarray, slot_keys: np.ndarray, dirty: np.ndarray, where: np.ndarray,
        row_offset: np.ndarray, fusion_k: int,
    ) -> None:  # fmt: skip
        """Those scratch rows freed (`native.free_slots`). Only where `compiled`."""
        ...
