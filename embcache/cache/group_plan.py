"""Phase (1) of a resolve for several set-associative caches at once, on the device path: the
plan each cache's `plan.SetPlanner` would make (its hits found and locked, its misses given
ways, those ways reserved and every slot of the batch touched), in launches shared by all.

A collection keeps one cache per embedding dim, so a resolve of a batch plans several caches.
Planned one by one, each costs about twenty launches (the set index, the lookup, its counts,
the hits' locks, the misses' keys, their sort, their placement, the reservation, the touch,
the selections around them): a collection of three dims launched three times what one dim
does. Here the caches' tensors are one `ops.plan.PlanTable` (their device addresses, uploaded
once), and the plan family's group operations serve every cache in one launch each:

1. `PlanOps.probe_group`: each cache's ids looked up, hits locked, misses counted, and each
   miss given its sort key, its set counted in the group's numbering of sets;
2. one stable sort of those keys: every cache's misses, cache by cache, each cache's in the
   order its own plan gives them (by set, then by the batch's shuffle);
3. `PlanOps.assign_group`: the misses placed in ways, their evictions and write-backs counted;
4. one host read of every cache's counts (with the other caches' reads: `lockstep`);
5. `PlanOps.reserve_group`: the ways of every cache whose misses all got one reserved and the
   batch's slots scored; the selections a plan hands the tier (its misses in the order of its
   ids, its dirty victims) made once for all, each cache's a slice of them.

A cache one of whose misses found no free way (its sets are full of locked rows) goes on alone
from step 5 as `SetPlanner.plan_sets` does (`SetPlanner._reserve`, with scratch rows), from
its slices of the group's arrays, without another read. The plans are the same as each
planner's own, state for state (`tests/cache/test_group_plan.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from embcache.cache.lockstep import Counts, Step, first_true
from embcache.cache.plan import Plan, SetPlanner
from embcache.cache.scratch import CacheCapacityError
from embcache.ops.plan import (
    DIRTY,
    EVICTING,
    HELD,
    MISSES,
    PLACED,
    SCRATCH_HELD,
    PlanCache,
    PlanTable,
)

COUNTS = 8  # columns of a group's counts (`ops.plan.GroupProbe.counts`)


def plan_table(planners: Sequence[SetPlanner], ids: Sequence[torch.Tensor]) -> PlanTable | None:
    """The table of a group plan of ``ids[c]`` in ``planners[c]`` (each `SetPlanner.groups`),
    with each planner's clock for this plan; None where the kernels cannot read a part."""
    parts = []
    for p, i in zip(planners, ids, strict=True):
        store = p.slots
        found = None
        if p.scratch.used:  # the ids its scratch rows hold (none is in a way too)
            found = torch.full_like(i, -1)
            p.scratch.find(i, found)
        parts.append(PlanCache(
            i, store.slot_keys, store.scores, store.locks, store.batch_of, store.dirty,
            p.num_sets, p.ways, p.batch_seq, p.tick + 1, p.num_slots, found,
        ))  # fmt: skip
    return PlanTable.of(parts)


def plan_group(
    planners: Sequence[SetPlanner], table: PlanTable, made: Callable[[int, Plan], None]
) -> Step:
    """The plans of ``table``'s caches (`plan_table`), one per planner, as a `lockstep` step
    that reads the host once; ``made(c, plan)`` is called as each one's plan is made (its
    caller's rollback needs it if another cache fails). A cache whose plan is not made when an
    error ends the step (another cache's failure, a full scratch area) is left as it was."""
    ops = planners[0].ops
    probe = ops.probe_group(table)
    starts = table.starts
    sizes = [c.ids.numel() for c in table.caches]
    slots = [probe.slots[s : s + n] for s, n in zip(starts, sizes, strict=True)]
    pending = set(range(len(planners)))
    ticked = False
    try:
        sorted_keys, order = torch.sort(probe.keys, stable=True)
        place = ops.assign_group(table, sorted_keys, probe.counts)
        values = yield Counts(list(probe.counts.view(-1).unbind(0)))
        counts = [values[c * COUNTS : (c + 1) * COUNTS] for c in range(len(planners))]
        for planner in planners:
            planner.tick += 1  # undone by `_refuse` for a plan not made
            planner.lookups += 1
        ticked = True
        reserved = ops.reserve_group(table, probe, order, place)
        whole = [row[PLACED] == row[MISSES] for row in counts]
        m = sum(row[MISSES] for row in counts)
        # Every cache's misses in the order of its ids (the order the tier reads them in) and
        # the dirty victims and evicted rows of the caches reserved here: one selection each.
        miss_at = first_true(probe.missing, m)
        load_ids = probe.ids.index_select(0, miss_at)
        load_slots = probe.slots.index_select(0, miss_at)
        placed = [row if w else [0] * COUNTS for row, w in zip(counts, whole, strict=True)]
        dirty_at = first_true(reserved.write_back[:m], sum(row[DIRTY] for row in placed))
        victim_slots = place.index_select(0, dirty_at)
        victim_ids = reserved.old_keys.index_select(0, dirty_at)
        evicted = None
        if any(p.pins for p in planners):
            evicted_at = first_true(reserved.resident[:m], sum(row[EVICTING] for row in placed))
            evicted = reserved.old_keys.index_select(0, evicted_at)
        lo = dirty_lo = evicted_lo = 0
        ranges = []
        for c, (planner, row) in enumerate(zip(planners, counts, strict=True)):
            at = slice(lo, lo + row[MISSES])
            ranges.append(at)
            lo += row[MISSES]
            if not whole[c]:
                continue
            ids = table.caches[c].ids
            dirty = slice(dirty_lo, dirty_lo + row[DIRTY])
            dirty_lo += row[DIRTY]
            plan = Plan(ids, slots[c], load_ids[at], load_slots[at], victim_ids[dirty],
                        victim_slots[dirty])  # fmt: skip
            if row[MISSES]:
                plan.reserved, plan.old_keys = place[at], reserved.old_keys[at]
                plan.old_scores, plan.old_dirty = reserved.old_scores[at], reserved.old_dirty[at]
            plan.evicted = row[EVICTING]
            if planner.pins:
                assert evicted is not None
                plan.released = evicted[evicted_lo : evicted_lo + row[EVICTING]]
            evicted_lo += row[EVICTING]
            pending.discard(c)
            made(c, plan)
        for c in sorted(pending):  # misses left without a way: scratch rows, cache by cache
            planner, row, at = planners[c], counts[c], ranges[c]
            start, ids = starts[c], table.caches[c].ids
            misses = miss_at[at] - start, load_ids[at]
            try:
                planner.scratch.grow(row[MISSES] - row[PLACED])
            except CacheCapacityError as full:
                planner._refuse(slots[c])
                pending.discard(c)
                made(c, (yield from planner.plan_unguarded(ids, None, full)))
                continue
            plan = planner._reserve(
                ids, slots[c], misses, order[at] - start, place[at], 0,
                (row[PLACED], row[EVICTING], row[DIRTY]),
                row[HELD] - row[SCRATCH_HELD] + row[PLACED],
            )  # fmt: skip
            pending.discard(c)
            made(c, plan)
    except BaseException:
        for c in pending:  # their hits' locks (and clocks) back
            if ticked:
                planners[c]._refuse(slots[c])
            else:
                planners[c]._lock_hits(slots[c], -1)
        raise
