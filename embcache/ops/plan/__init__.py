"""The plan family: a set-associative cache's index (the set of an id, the way holding it,
victim ways for a batch's misses), the device plan's steps around it, and the compiled CPU
plan of a cache with a row index.

`PlanOps` is the family's protocol; its implementations are `spec.SpecPlan` (torch, the
specification), `triton.TritonPlan` (the Triton kernels) and `native.NativePlan` (numba's
compiled plan), one of them bound per cache by `embcache.ops.registry`. Nothing outside
`embcache.ops` imports an implementation.

The device path plans several caches at once (`PlanOps.probe_group`, `assign_group`,
`reserve_group`): the same plan as each cache's own (`cache.plan.SetPlanner.plan_sets`), in
launches shared by every cache of a `PlanTable` (their tensors' device addresses, uploaded
once a plan), so that a collection of caches of several dims launches what one cache does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

PlanArrays = tuple[np.ndarray, np.ndarray, np.ndarray]

# A `PlanTable` row (int64 each): the ids' address, their count, their first position in the
# group's arrays; the addresses of the slot keys, scores, locks, batch numbers and dirty flags;
# the sets, the ways, the first set in the group's numbering; the batch guarded; the clock; the
# address of slots found already (the scratch area's; 0: none); the slots of the cache proper;
# the address of free scratch rows for the misses left without a way (0: none).
PLAN_FIELDS = 16
# Bits of a group sort key below the set: the 20 low bits of the miss's shuffle.
KEY_SHIFT = 20
# The counts a group plan reads per cache (`GroupProbe.counts` columns).
MISSES, HELD, PLACED, EVICTING, DIRTY, SCRATCH_HELD = range(6)


def padded(n: int) -> int:
    """Room for ``n`` ids in a group's arrays: rounded up to an even count, so that every
    cache's part of them starts 16 bytes aligned (its slots are a view handed to the Triton
    kernels, which compile a variant per pointer alignment). A padding entry is a hit of no
    slot: no miss, no lock, slot -1."""
    return n + (n & 1)


@dataclass
class PlanCache:
    """One cache of a group plan: its batch's ids and its index (slot ``s * ways + w`` of set
    ``s``, way ``w``, below ``num_slots``; scratch rows above), its guarded batch, the plan's
    clock (the planner's tick + 1) and, where its scratch area holds rows, the slot of each id
    found there (``found``, -1 elsewhere); for its reservation, where misses found no way,
    the free scratch rows they take (``free``, ascending, at least as many)."""

    ids: torch.Tensor  # int64 [n], contiguous, distinct
    slot_keys: torch.Tensor  # int64
    scores: torch.Tensor  # int64
    locks: torch.Tensor  # int32
    batch_of: torch.Tensor  # int64
    dirty: torch.Tensor  # bool
    num_sets: int
    ways: int
    batch_seq: int
    tick: int
    num_slots: int
    found: torch.Tensor | None = None  # int64 [n], contiguous
    free: torch.Tensor | None = None  # int64 slots, contiguous


@dataclass
class PlanTable:
    """Several caches planned together: their parts (kept alive while the table is), where
    each one's ids start in the group's arrays, each one's first set in the group's numbering
    of sets (so one sort orders every cache's misses, cache by cache), and the table of device
    addresses and sizes the kernels read (int64 ``[k, PLAN_FIELDS]``)."""

    caches: list[PlanCache]
    starts: list[int]
    set_bases: list[int]
    table: torch.Tensor

    @classmethod
    def of(cls, caches: Sequence[PlanCache]) -> PlanTable | None:
        """The table of ``caches``, all on one device; None when a part is not as the kernels
        read it (the dtypes above, contiguous, at least ``num_sets * ways`` slots), or there
        is none."""
        if not caches:
            return None
        device = caches[0].ids.device
        kinds = (
            ("ids", torch.int64), ("slot_keys", torch.int64), ("scores", torch.int64),
            ("locks", torch.int32), ("batch_of", torch.int64), ("dirty", torch.bool),
        )  # fmt: skip
        rows: list[int] = []
        starts, set_bases = [], []
        start = set_base = 0
        for c in caches:
            for name, dtype in kinds:
                t = getattr(c, name)
                if t.dtype != dtype or not t.is_contiguous() or t.device != device:
                    return None
                if name != "ids" and t.numel() < c.num_sets * c.ways:
                    return None
            n = c.ids.numel()
            found, free = c.found, c.free
            for extra in (found, free):
                if extra is not None and (
                    extra.dtype != torch.int64 or not extra.is_contiguous()
                    or extra.device != device
                ):  # fmt: skip
                    return None
            if found is not None and found.numel() != n:
                return None
            rows += [
                c.ids.data_ptr(), n, start, c.slot_keys.data_ptr(), c.scores.data_ptr(),
                c.locks.data_ptr(), c.batch_of.data_ptr(), c.dirty.data_ptr(), c.num_sets,
                c.ways, set_base, c.batch_seq, c.tick,
                0 if found is None else found.data_ptr(), c.num_slots,
                0 if free is None else free.data_ptr(),
            ]  # fmt: skip
            starts.append(start)
            set_bases.append(set_base)
            start += padded(n)
            set_base += c.num_sets
        if set_base >= 2 ** (63 - KEY_SHIFT):
            return None  # the group's sets do not fit a sort key
        table = torch.tensor(rows, dtype=torch.int64).view(len(caches), PLAN_FIELDS)
        if device.type == "cuda":
            table = table.pin_memory().to(device, non_blocking=True)
        else:
            table = table.to(device)
        return cls(list(caches), starts, set_bases, table)

    @property
    def total(self) -> int:
        """The length of the group's arrays: every cache's ids, each cache's padded
        (`padded`)."""
        return self.starts[-1] + padded(self.caches[-1].ids.numel())

    @property
    def total_sets(self) -> int:
        """The sets of every cache: a sort key's set for a position that is no miss."""
        return self.set_bases[-1] + self.caches[-1].num_sets

    @property
    def max_ids(self) -> int:
        return max(c.ids.numel() for c in self.caches)

    @property
    def max_ways(self) -> int:
        return max(c.ways for c in self.caches)

    @property
    def device(self) -> torch.device:
        return self.table.device


class GroupProbe(NamedTuple):
    """What `PlanOps.probe_group` finds, every cache's ids end to end (cache ``c``'s at
    ``PlanTable.starts[c]``, then a padding entry where its count is odd: `padded`)."""

    ids: torch.Tensor  # int64 [N]: the ids
    slots: torch.Tensor  # int64 [N]: each one's slot, -1 for a miss
    missing: torch.Tensor  # bool [N]: the misses
    keys: torch.Tensor  # int64 [N]: the sort keys (`PlanOps.probe_group`)
    counts: torch.Tensor  # int64 [k, 8]: per cache MISSES, HELD, SCRATCH_HELD; `assign_group`'s


class GroupReserve(NamedTuple):
    """What `PlanOps.reserve_group` saved, per miss in the sorted order (``[N]`` each; the
    first ``M`` entries, M the group's misses, are defined)."""

    old_keys: torch.Tensor  # int64: the key the miss's slot held
    old_scores: torch.Tensor  # int64: its score
    old_dirty: torch.Tensor  # bool: its dirty flag
    resident: torch.Tensor  # bool: it held a row (an eviction)
    write_back: torch.Tensor  # bool: that row was dirty


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
        """An LRU cache's compiled plan (`NativePlan.plan_lru`). Only where `compiled`."""
        ...

    def plan_lfu(
        self, ids: np.ndarray, where: np.ndarray, row_offset: np.ndarray, fusion_k: int,
        counts: np.ndarray, count_offset: np.ndarray, scores: np.ndarray, locks: np.ndarray,
        batch_of: np.ndarray, num_sets: int, ways: int, tick: int, batch_seq: int,
        slots: np.ndarray,
    ) -> PlanArrays:  # fmt: skip
        """An exact LFU cache's compiled plan (`NativePlan.plan_lfu`). Only where `compiled`."""
        ...

    def touch_lfu(
        self, ids: np.ndarray, slots: np.ndarray, counts: np.ndarray, count_offset: np.ndarray,
        fusion_k: int, scores: np.ndarray, num_slots: int,
    ) -> None:  # fmt: skip
        """An exact LFU's counts and scores after a batch (`NativePlan.touch_lfu`). Only where
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

    def probe_group(self, table: PlanTable) -> GroupProbe:
        """Every cache's lookup, its counts and its hits locked, in one pass: for each id of
        every cache of ``table``, its slot (the way holding it, ``set * ways + way``, else its
        ``found`` slot, else -1), whether it misses, and its sort key: for a miss
        ``((set_base + set) << 20) + (mix64(id ^ tick) & (2**20 - 1))`` (`miss_keys`' key,
        the set counted in the group's numbering), else ``total_sets << 20``, so that one
        stable sort puts every cache's misses first, cache by cache, each cache's as its own
        plan orders them. Counts each
        cache's misses, hits and hits in scratch rows (``counts[c, MISSES]``, ``HELD``,
        ``SCRATCH_HELD``) and adds a lock to each hit's slot. Only where `places_misses`."""
        ...

    def assign_group(
        self, table: PlanTable, sorted_keys: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """Every cache's misses placed (`assign_misses`, cache by cache): ``sorted_keys`` are
        `probe_group`'s keys sorted; the k-th miss of a set takes the k-th of the set's ways
        ordered by ``(blocked, score * ways + way)`` (blocked: locked, or the guarded
        batch's), if k is below the unblocked ways. Returns each miss's slot (-1: none), int64
        ``[N]`` in the sorted order (the first M entries, M the misses, are defined), and adds
        to ``counts[c]`` the misses placed, those whose way holds a row, and those rows dirty
        (``PLACED``, ``EVICTING``, ``DIRTY``). Only where `places_misses`."""
        ...

    def reserve_group(
        self, table: PlanTable, probe: GroupProbe, order: torch.Tensor, place: torch.Tensor,
        unplaced: torch.Tensor | None = None,
    ) -> GroupReserve:  # fmt: skip
        """`reserve_placed` and the LRU touch of every cache whose misses all got a way or
        that was given free scratch rows (``PlanCache.free``): miss ``j`` of the sorted order
        (at position ``order[j]`` of the group's arrays) takes slot ``place[j]``, or where that
        is -1 the r-th of its cache's free rows, r its rank among the cache's misses left
        without a way (``unplaced``: int64 ``[M]``, how many entries of ``place`` before each
        are -1; None when none is), as `reserve_placed` says; and every slot of the cache's
        batch in the cache proper, hits and misses, is scored with the plan's clock. Returns
        what each miss's slot held. A cache with a miss left without a way and no free rows
        is changed in nothing (its ``resident`` and ``write_back`` entries are False): its
        caller plans it again. Only where `places_misses`."""
        ...

    def reserve(
        self, ids: np.ndarray, slots: np.ndarray, miss_pos: np.ndarray, order: np.ndarray,
        place: np.ndarray, where: np.ndarray, row_offset: np.ndarray, fusion_k: int,
        slot_keys: np.ndarray, scores: np.ndarray, locks: np.ndarray, dirty: np.ndarray,
        num_slots: int, tick: int,
    ) -> tuple[np.ndarray, ...]:  # fmt: skip
        """A compiled plan's ways reserved (`NativePlan.reserve`). Only where `compiled`."""
        ...

    def scratch_done(
        self, slot_keys: np.ndarray, locks: np.ndarray, batch_of: np.ndarray,
        dirty: np.ndarray, num_slots: int, batch_seq: int,
    ) -> PlanArrays:  # fmt: skip
        """The scratch rows a release writes back and frees (`NativePlan.scratch_done`). Only
        where `compiled`."""
        ...

    def free_slots(
        self, slots: np.ndarray, slot_keys: np.ndarray, dirty: np.ndarray, where: np.ndarray,
        row_offset: np.ndarray, fusion_k: int,
    ) -> None:  # fmt: skip
        """Those scratch rows freed (`NativePlan.free_slots`). Only where `compiled`."""
        ...
