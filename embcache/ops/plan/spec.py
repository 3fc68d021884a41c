"""The plan family's specification in plain torch: the set-associative cache index (hash ids
to sets, find the way holding an id, pick victim ways) and the small steps of a plan around it.

The cache keeps ``S`` sets of ``W`` ways; ``keys[s, w]`` is the id held by way ``w`` of set
``s`` (-1 when empty). Each twin (``*_ref``) computes exactly what its Triton kernel
(`ops.plan.triton`) computes; `SpecPlan` is the family's implementation built on them
(`PlanOps`): the CPU path, the ``torch`` backend everywhere, and what the other
implementations are tested against.
"""

from __future__ import annotations

import numpy as np
import torch

from embcache.hashing import LOW63, mix64
from embcache.ops.checks import check_tensor, require
from embcache.ops.plan import (
    DIRTY,
    EVICTING,
    HELD,
    KEY_SHIFT,
    MISSES,
    PLACED,
    SCRATCH_HELD,
    GroupProbe,
    GroupReserve,
    PlanOps,
    PlanTable,
)

PlanArrays = tuple[np.ndarray, np.ndarray, np.ndarray]

# ----------------------------------------------------------------------------------------------
# the twins
# ----------------------------------------------------------------------------------------------


def set_index_ref(ids: torch.Tensor, num_sets: int) -> torch.Tensor:
    """Set of each key: ``(mix64(id) & (2**63 - 1)) % num_sets``.

    Args:
        ids: int64 ``[n]`` fused ids (any value, negative ones included).
        num_sets: number of sets, >= 1.

    Returns:
        int64 ``[n]`` in ``[0, num_sets)``.
    """
    return (mix64(ids) & LOW63) % num_sets


def cache_lookup_ref(keys: torch.Tensor, ids: torch.Tensor, sets: torch.Tensor) -> torch.Tensor:
    """Way holding each id in its set, or -1.

    Args:
        keys: int64 ``[S, W]``, the id held by each way, -1 for an empty way. An id appears in at
            most one way of its set.
        ids: int64 ``[n]``, ids to look up (never -1).
        sets: int64 ``[n]``, ``set_index(ids, S)``.

    Returns:
        int64 ``[n]``: the way in ``[0, W)`` holding ``ids[i]`` in set ``sets[i]``, else -1.
    """
    match = keys.index_select(0, sets) == ids.unsqueeze(1)  # [n, W]
    # One pass finds both: the first largest byte of each row (1 at the way that matches).
    found, way = match.view(torch.uint8).max(dim=1)
    return torch.where(found.bool(), way, torch.full_like(way, -1))


def assign_ways_ref(
    scores: torch.Tensor,
    blocked: torch.Tensor,
    miss_sets: torch.Tensor,
    num_runs: int | None = None,
) -> torch.Tensor:
    """Give each miss a distinct way of its set: the k-th miss of a set gets its k-th best victim.

    Ways of a set are ordered by ``(blocked, score, way)`` ascending: unblocked ways with the
    lowest score first (callers give empty ways the lowest score), ties broken by way index. The
    k-th miss of a set (k counted in the order of ``miss_sets``) takes the k-th way of that order
    when k is below the set's number of unblocked ways, else it overflows (-1).

    Args:
        scores: int64 ``[S, W]`` eviction scores (LRU: last-use tick; LFU: frequency; empty: -1),
            below ``2**57`` (the twin orders ways by ``score * W + way``).
        blocked: bool ``[S, W]``, ways that must not be taken (locked, or hit by this batch).
        miss_sets: int64 ``[m]``, the set of each miss, sorted ascending.
        num_runs: the number of distinct values in ``miss_sets``, when the caller knows it:
            then nothing is read on the host (the runs are found at a known size, and every
            set's ways are sorted whole).

    Returns:
        int64 ``[m]``: the way in ``[0, W)`` assigned to each miss, or -1 for an overflow.
    """
    m = miss_sets.numel()
    if m == 0:
        return torch.empty(0, dtype=torch.int64, device=scores.device)
    W = scores.shape[1]
    if num_runs is not None:
        return _assign_known_runs(scores, blocked, miss_sets, num_runs)
    touched, counts = torch.unique_consecutive(miss_sets, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    owner = torch.repeat_interleave(torch.arange(touched.numel(), device=scores.device), counts)
    rank = torch.arange(m, device=scores.device) - starts[owner]
    if touched.numel() == scores.shape[0]:  # every set has a miss (callers that pre-gather)
        s_blocked, s_scores = blocked, scores
    else:
        s_blocked, s_scores = blocked.index_select(0, touched), scores.index_select(0, touched)
    # Distinct keys (score, then way) make the order total, so any sort of a set's ways, or a
    # partial sort of its first k (k = most misses in one set), equals a stable full sort.
    o_w = torch.arange(W, dtype=torch.int64, device=scores.device)
    key = torch.where(s_blocked, torch.iinfo(torch.int64).max, s_scores * W + o_w)  # [T, W]
    k = min(int(counts.max()), W)
    if key.device.type == "cpu":
        # numpy sorts short rows several times faster than torch's topk picks k of them.
        order = torch.from_numpy(np.argsort(key.numpy(), axis=1)[:, :k])  # [T, k]
    else:
        order = torch.topk(key, k, dim=1, largest=False, sorted=True).indices  # [T, k]
    n_free = (~s_blocked).sum(dim=1)  # [T]
    way = order[owner, rank.clamp(max=k - 1)]
    return torch.where(rank < n_free[owner], way, torch.full_like(way, -1))


def _assign_known_runs(
    scores: torch.Tensor, blocked: torch.Tensor, miss_sets: torch.Tensor, num_runs: int
) -> torch.Tensor:
    """`assign_ways_ref` for ``num_runs`` known runs in ``miss_sets``, without a host read:
    the runs' starts at a known size, and each touched set's ways sorted whole (k = W)."""
    m, W = miss_sets.numel(), scores.shape[1]
    device = scores.device
    first = torch.ones(m, dtype=torch.bool, device=device)
    torch.ne(miss_sets[1:], miss_sets[:-1], out=first[1:])
    owner = torch.cumsum(first, 0) - 1
    starts = torch.nonzero_static(first, size=num_runs).squeeze(1)
    rank = torch.arange(m, device=device) - starts.index_select(0, owner)
    touched = miss_sets.index_select(0, starts)
    s_blocked, s_scores = blocked.index_select(0, touched), scores.index_select(0, touched)
    o_w = torch.arange(W, dtype=torch.int64, device=device)
    key = torch.where(s_blocked, torch.iinfo(torch.int64).max, s_scores * W + o_w)  # [T, W]
    order = torch.sort(key, dim=1).indices  # distinct keys: any sort is the stable one
    n_free = (~s_blocked).sum(dim=1)  # [T]
    way = order[owner, rank.clamp(max=W - 1)]
    return torch.where(rank < n_free.index_select(0, owner), way, torch.full_like(way, -1))


# ----------------------------------------------------------------------------------------------
# the implementation
# ----------------------------------------------------------------------------------------------


def probe_group_ref(table: PlanTable) -> GroupProbe:
    """`PlanOps.probe_group` in torch ops, cache by cache."""
    device, total = table.device, table.total
    pad = table.total_sets << KEY_SHIFT
    ids = torch.zeros(total, dtype=torch.int64, device=device)  # padding: id 0, slot -1, ...
    slots, keys = torch.full_like(ids, -1), torch.full_like(ids, pad)
    missing = torch.zeros(total, dtype=torch.bool, device=device)  # ... no miss
    counts = torch.zeros(len(table.caches), 8, dtype=torch.int64, device=device)
    for c, (part, start) in enumerate(zip(table.caches, table.starts, strict=True)):
        at = slice(start, start + part.ids.numel())
        sets = set_index_ref(part.ids, part.num_sets)
        view = part.slot_keys[: part.num_sets * part.ways].view(part.num_sets, part.ways)
        way = cache_lookup_ref(view, part.ids, sets)
        found = torch.full_like(way, -1) if part.found is None else part.found
        here = torch.where(way >= 0, sets * part.ways + way, found)
        held = here >= 0
        shuffle = mix64(part.ids ^ part.tick) & ((1 << KEY_SHIFT) - 1)
        ids[at] = part.ids
        slots[at] = here
        missing[at] = ~held
        set_key = (table.set_bases[c] + sets) << KEY_SHIFT
        keys[at] = torch.where(held, torch.full_like(sets, pad), set_key + shuffle)
        counts[c, MISSES], counts[c, HELD] = (~held).sum(), held.sum()
        counts[c, SCRATCH_HELD] = (here >= part.num_slots).sum()
        hit_slots = here[held]
        part.locks.index_add_(0, hit_slots, torch.ones_like(hit_slots, dtype=torch.int32))
    return GroupProbe(ids, slots, missing, keys, counts)


def _cache_range(table: PlanTable, c: int, sorted_keys: torch.Tensor) -> tuple[int, int]:
    """Where cache ``c``'s misses are in the sorted keys: ``[lo, hi)``."""
    base, num_sets = table.set_bases[c], table.caches[c].num_sets
    bounds = torch.tensor([base << KEY_SHIFT, (base + num_sets) << KEY_SHIFT],
                          device=sorted_keys.device)  # fmt: skip
    lo, hi = torch.searchsorted(sorted_keys, bounds).tolist()
    return lo, hi


def assign_group_ref(
    table: PlanTable, sorted_keys: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """`PlanOps.assign_group` in torch ops, cache by cache (every entry past the misses -1)."""
    place = torch.full_like(sorted_keys, -1)
    for c, part in enumerate(table.caches):
        lo, hi = _cache_range(table, c, sorted_keys)
        if lo == hi:
            continue
        W = part.ways
        global_sets = sorted_keys[lo:hi] >> KEY_SHIFT
        sets = global_sets - table.set_bases[c]
        rank = torch.arange(hi - lo, device=place.device) - torch.searchsorted(
            global_sets, global_sets
        )  # k: the miss's place in its set's run
        way_slots = sets.unsqueeze(1) * W + torch.arange(W, device=place.device)  # [m, W]
        free = (part.locks[way_slots] <= 0) & (part.batch_of[way_slots] != part.batch_seq)
        ways = torch.arange(W, device=place.device)
        order_key = torch.where(free, part.scores[way_slots] * W + ways, 2**63 - 1)
        ordered = torch.sort(order_key, dim=1, stable=True).indices
        placed = rank < free.sum(1)
        way = ordered.gather(1, rank.clamp(max=W - 1).unsqueeze(1)).squeeze(1)
        here = torch.where(placed, sets * W + way, -1)
        place[lo:hi] = here
        held = placed & (part.slot_keys[here.clamp(min=0)] >= 0)
        dirty = held & part.dirty[here.clamp(min=0)]
        counts[c, PLACED] += placed.sum()
        counts[c, EVICTING] += held.sum()
        counts[c, DIRTY] += dirty.sum()
    return place


def reserve_group_ref(
    table: PlanTable, probe: GroupProbe, order: torch.Tensor, place: torch.Tensor,
    unplaced: torch.Tensor | None = None,
) -> GroupReserve:  # fmt: skip
    """`PlanOps.reserve_group` in torch ops, cache by cache (``unplaced`` is not needed)."""
    n = place.numel()
    old_keys, old_scores = torch.zeros_like(place), torch.zeros_like(place)
    old_dirty, resident, write_back = (torch.zeros(n, dtype=torch.bool, device=place.device)
                                       for _ in range(3))  # fmt: skip
    lo = 0
    for c, (part, start) in enumerate(zip(table.caches, table.starts, strict=True)):
        n_miss, n_placed = int(probe.counts[c, MISSES]), int(probe.counts[c, PLACED])
        hi, lo = lo + n_miss, lo
        if n_placed == n_miss or part.free is not None:
            at = slice(lo, hi)
            here = place[at].clone()
            left = here < 0  # the k-th of them takes the k-th free scratch row
            if bool(left.any()):
                assert part.free is not None
                here[left] = part.free[: int(left.sum())]
            main = here < part.num_slots
            old_keys[at] = part.slot_keys[here]
            old_scores[at] = torch.where(main, part.scores[here.clamp(max=part.num_slots - 1)],
                                         0)  # fmt: skip
            old_dirty[at] = part.dirty[here]
            resident[at] = old_keys[at] >= 0
            write_back[at] = resident[at] & old_dirty[at]
            probe.slots[order[at]] = here
            part.slot_keys[here] = probe.ids[order[at]]
            part.dirty[here] = False
            part.locks.index_add_(0, here, torch.ones_like(here, dtype=torch.int32))
            part.scores[here[main]] = part.tick
            batch = probe.slots[start : start + part.ids.numel()]
            part.scores[batch[batch < part.num_slots]] = part.tick
        lo = hi
    return GroupReserve(old_keys, old_scores, old_dirty, resident, write_back)


def check_table(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    check_tensor(name, t, dtype, 2)
    require(
        t.shape[0] >= 1 and t.shape[1] >= 1,
        f"{name} must have at least one set and one way, got {tuple(t.shape)}",
    )


def check_salt(salt: int) -> int:
    """``salt`` as int64 wraps it (TypeError unless an int)."""
    if isinstance(salt, bool) or not isinstance(salt, int):
        raise TypeError(f"salt must be an int, got {type(salt).__name__}")
    return ((salt + (1 << 63)) % (1 << 64)) - (1 << 63)


def check_lookup(keys: torch.Tensor, ids: torch.Tensor, sets: torch.Tensor) -> None:
    check_table("keys", keys, torch.int64)
    check_tensor("ids", ids, torch.int64, 1)
    check_tensor("sets", sets, torch.int64, 1)
    if ids.shape != sets.shape:
        raise ValueError(f"ids and sets differ in shape: {tuple(ids.shape)} vs {tuple(sets.shape)}")


class SpecPlan:
    """The plan family in torch ops (`PlanOps` documents each operation). The other
    implementations subclass it and replace the hooks (``_set_index``, ``_cache_lookup``,
    ...) or whole operations; the checks of the arguments stay here, one wording for all."""

    name = "spec"
    places_misses = False  # no `assign_misses`: the device path's one-kernel placement
    compiled = False  # no compiled CPU plan (`plan_lru`, ...): numba's

    def set_index(self, ids: torch.Tensor, num_sets: int) -> torch.Tensor:
        check_tensor("ids", ids, torch.int64, None)
        if isinstance(num_sets, bool) or not isinstance(num_sets, int) or not 1 <= num_sets < 2**63:
            raise ValueError(f"num_sets must be an int in [1, 2**63), got {num_sets!r}")
        return self._set_index(ids, num_sets)

    def _set_index(self, ids: torch.Tensor, num_sets: int) -> torch.Tensor:
        return set_index_ref(ids, num_sets)

    def cache_lookup(
        self, keys: torch.Tensor, ids: torch.Tensor, sets: torch.Tensor
    ) -> torch.Tensor:
        check_lookup(keys, ids, sets)
        return self._cache_lookup(keys, ids, sets, False)

    def cache_slots(
        self, keys: torch.Tensor, ids: torch.Tensor, sets: torch.Tensor
    ) -> torch.Tensor:
        check_lookup(keys, ids, sets)
        return self._cache_lookup(keys, ids, sets, True)

    def _cache_lookup(
        self, keys: torch.Tensor, ids: torch.Tensor, sets: torch.Tensor, as_slots: bool
    ) -> torch.Tensor:
        ways = cache_lookup_ref(keys, ids, sets)
        if not as_slots:
            return ways
        return torch.where(ways >= 0, sets * keys.shape[1] + ways, -1)

    def assign_ways(
        self,
        scores: torch.Tensor,
        blocked: torch.Tensor,
        miss_sets: torch.Tensor,
        num_runs: int | None = None,
    ) -> torch.Tensor:
        check_table("scores", scores, torch.int64)
        check_tensor("blocked", blocked, torch.bool, 2)
        check_tensor("miss_sets", miss_sets, torch.int64, 1)
        if blocked.shape != scores.shape:
            raise ValueError(
                f"blocked and scores differ in shape: {tuple(blocked.shape)} vs "
                f"{tuple(scores.shape)}"
            )
        return self._assign_ways(scores, blocked, miss_sets, num_runs)

    def _assign_ways(
        self,
        scores: torch.Tensor,
        blocked: torch.Tensor,
        miss_sets: torch.Tensor,
        num_runs: int | None,
    ) -> torch.Tensor:
        return assign_ways_ref(scores, blocked, miss_sets, num_runs)

    def add_at_held(self, t: torch.Tensor, slots: torch.Tensor, delta: int) -> None:
        # A -1 adds 0 to slot 0.
        hit = slots >= 0
        t.index_add_(0, slots.clamp(min=0), hit.to(t.dtype) * delta)

    def lookup_counts(
        self, slots: torch.Tensor, num_slots: int, admitted: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        missing = slots < 0
        counts = [(slots >= 0).sum(), (slots >= num_slots).sum()]
        if admitted is not None:  # ids not admitted keep slot -1 and are no misses
            missing &= admitted
            counts.append((~admitted).sum())
        return missing, [missing.sum(), *counts]

    def salted_mix64(self, ids: torch.Tensor, salt: int) -> torch.Tensor:
        check_tensor("ids", ids, (torch.int64,))
        return self._salted_mix64(ids, check_salt(salt))

    def _salted_mix64(self, ids: torch.Tensor, salt: int) -> torch.Tensor:
        return mix64(ids ^ salt)

    def miss_keys(
        self, ids: torch.Tensor, miss_pos: torch.Tensor, salt: int, num_sets: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_tensor("ids", ids, (torch.int64,))
        check_tensor("miss_pos", miss_pos, (torch.int64,))
        salt = check_salt(salt)
        require(1 <= num_sets < 1 << 43, f"num_sets must be in [1, 2**43), got {num_sets}")
        return self._miss_keys(ids, miss_pos, salt, num_sets)

    def _miss_keys(
        self, ids: torch.Tensor, miss_pos: torch.Tensor, salt: int, num_sets: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        padding = miss_pos < 0
        miss_ids = ids.index_select(0, miss_pos.clamp(min=0))
        sets = set_index_ref(miss_ids, num_sets).masked_fill_(padding, num_sets)
        key = torch.add(mix64(miss_ids ^ salt) & 0xFFFFF, sets, alpha=1 << 20)
        return miss_ids, sets, key

    # -- the device path's placement (`places_misses`) ----------------------------------

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
        raise NotImplementedError(f"the {self.name} plan places no misses (see `places_misses`)")

    # -- the compiled CPU plan (`compiled`) ---------------------------------------------

    def plan_lru(
        self, ids: np.ndarray, where: np.ndarray, row_offset: np.ndarray, fusion_k: int,
        scores: np.ndarray, locks: np.ndarray, batch_of: np.ndarray, num_slots: int,
        num_sets: int, ways: int, tick: int, batch_seq: int, slots: np.ndarray,
    ) -> PlanArrays:  # fmt: skip
        raise NotImplementedError(f"the {self.name} plan is not compiled (see `compiled`)")

    def plan_lfu(
        self, ids: np.ndarray, where: np.ndarray, row_offset: np.ndarray, fusion_k: int,
        counts: np.ndarray, count_offset: np.ndarray, scores: np.ndarray, locks: np.ndarray,
        batch_of: np.ndarray, num_sets: int, ways: int, tick: int, batch_seq: int,
        slots: np.ndarray,
    ) -> PlanArrays:  # fmt: skip
        raise NotImplementedError(f"the {self.name} plan is not compiled (see `compiled`)")

    def touch_lfu(
        self, ids: np.ndarray, slots: np.ndarray, counts: np.ndarray, count_offset: np.ndarray,
        fusion_k: int, scores: np.ndarray, num_slots: int,
    ) -> None:  # fmt: skip
        raise NotImplementedError(f"the {self.name} plan is not compiled (see `compiled`)")

    def reserve_placed(
        self, ids: torch.Tensor, slots: torch.Tensor, order_pos: torch.Tensor,
        place: torch.Tensor, slot_keys: torch.Tensor, dirty: torch.Tensor,
        scores: torch.Tensor, locks: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        old_keys = slot_keys.index_select(0, place)
        old_scores = scores.index_select(0, place)
        old_dirty = dirty.index_select(0, place)
        resident = old_keys >= 0
        slots.index_copy_(0, order_pos, place)
        slot_keys.index_copy_(0, place, ids.index_select(0, order_pos))
        dirty.index_fill_(0, place, False)
        locks.index_add_(0, place, torch.ones_like(place, dtype=locks.dtype))
        return old_keys, old_scores, old_dirty, resident, resident & old_dirty

    def probe_group(self, table: PlanTable) -> GroupProbe:
        return probe_group_ref(table)

    def assign_group(
        self, table: PlanTable, sorted_keys: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        return assign_group_ref(table, sorted_keys, counts)

    def reserve_group(
        self, table: PlanTable, probe: GroupProbe, order: torch.Tensor, place: torch.Tensor,
        unplaced: torch.Tensor | None = None,
    ) -> GroupReserve:  # fmt: skip
        return reserve_group_ref(table, probe, order, place, unplaced)

    def reserve(
        self, ids: np.ndarray, slots: np.ndarray, miss_pos: np.ndarray, order: np.ndarray,
        place: np.ndarray, where: np.ndarray, row_offset: np.ndarray, fusion_k: int,
        slot_keys: np.ndarray, scores: np.ndarray, locks: np.ndarray, dirty: np.ndarray,
        num_slots: int, tick: int,
    ) -> tuple[np.ndarray, ...]:  # fmt: skip
        raise NotImplementedError(f"the {self.name} plan is not compiled (see `compiled`)")

    def scratch_done(
        self, slot_keys: np.ndarray, locks: np.ndarray, batch_of: np.ndarray,
        dirty: np.ndarray, num_slots: int, batch_seq: int,
    ) -> PlanArrays:  # fmt: skip
        raise NotImplementedError(f"the {self.name} plan is not compiled (see `compiled`)")

    def free_slots(
        self, slots: np.ndarray, slot_keys: np.ndarray, dirty: np.ndarray, where: np.ndarray,
        row_offset: np.ndarray, fusion_k: int,
    ) -> None:  # fmt: skip
        raise NotImplementedError(f"the {self.name} plan is not compiled (see `compiled`)")


IMPLEMENTATION: PlanOps = SpecPlan()  # checked against the protocol
