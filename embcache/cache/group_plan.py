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

A miss that found no free way (its set full of locked rows) takes a scratch row in the same
reservation: its cache's scratch area grown first, its first free rows handed to the kernel,
the k-th such miss taking the k-th of them, as `SetPlanner._reserve` gives them, and no
other read. A cache whose scratch area cannot grow is planned again on its own, the last
locked batch's rows no longer guarded (`SetPlanner.plan_unguarded`). The plans are the same
as each planner's own, state for state (`tests/cache/test_resolve_together.py`,
`tests/cache/test_device_resolve_path.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from embcache.cache.lockstep import Counts, Step, first_true
from embcache.cache.plan import Plan, SetPlanner
from embcache.cache.scratch import CacheCapacityError
from embcache.ops.plan import (
    DIRTY,
    EVICTING,
    MISSES,
    PLACED,
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
    numpy = planners[0].slots.numpy_reads  # the device path: False
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
        m = sum(row[MISSES] for row in counts)
        # Misses left without a way take scratch rows: the area grown first (its tensors may
        # be replaced: the table is made again), the free rows handed to the reservation.
        full: dict[int, CacheCapacityError] = {}
        unplaced = None
        if any(row[PLACED] < row[MISSES] for row in counts):
            table = _with_scratch_rows(planners, table, counts, full)
            left = (place[:m] < 0).long()
            unplaced = torch.cumsum(left, 0).sub_(left)  # how many are left before each
        reserved = ops.reserve_group(table, probe, order, place, unplaced)
        # Each miss's slot in the sorted order: its way, or the scratch row it took.
        taken = place if unplaced is None else probe.slots.index_select(0, order[:m])
        whole = [c not in full for c in range(len(planners))]
        # Every cache's misses in the order of its ids (the order the tier reads them in) and
        # the dirty victims and evicted rows of the caches reserved here: one selection each.
        miss_at = first_true(probe.missing, m, numpy)
        load_ids = probe.ids.index_select(0, miss_at)
        load_slots = probe.slots.index_select(0, miss_at)
        placed = [row if w else [0] * COUNTS for row, w in zip(counts, whole, strict=True)]
        # The victims of the ways taken (a free scratch row holds none).
        dirty_at = first_true(reserved.write_back[:m], sum(row[DIRTY] for row in placed), numpy)
        victim_slots = place.index_select(0, dirty_at)
        victim_ids = reserved.old_keys.index_select(0, dirty_at)
        evicted = None
        if any(p.pins for p in planners):
            evicted_at = first_true(
                reserved.resident[:m], sum(row[EVICTING] for row in placed), numpy
            )
            evicted = reserved.old_keys.index_select(0, evicted_at)
        lo = dirty_lo = evicted_lo = 0
        for c, (planner, row) in enumerate(zip(planners, counts, strict=True)):
            at = slice(lo, lo + row[MISSES])
            lo += row[MISSES]
            if not whole[c]:
                continue
            ids = table.caches[c].ids
            dirty = slice(dirty_lo, dirty_lo + row[DIRTY])
            dirty_lo += row[DIRTY]
            plan = Plan(ids, slots[c], load_ids[at], load_slots[at], victim_ids[dirty],
                        victim_slots[dirty])  # fmt: skip
            if row[MISSES]:
                # The slots taken: the ways, and scratch rows where a miss found none (their
                # old scores, 0, are not restored: `SetPlanner.rollback` restores ways only).
                plan.reserved, plan.old_keys = taken[at], reserved.old_keys[at]
                plan.old_scores, plan.old_dirty = reserved.old_scores[at], reserved.old_dirty[at]
            over = row[MISSES] - row[PLACED]
            plan.n_scratch = over
            planner.scratch.used += over
            plan.evicted = row[EVICTING]
            if planner.pins:
                assert evicted is not None
                plan.released = evicted[evicted_lo : evicted_lo + row[EVICTING]]
            evicted_lo += row[EVICTING]
            pending.discard(c)
            made(c, plan)
        for c in sorted(pending):  # a full scratch area: planned again alone (`SetPlanner.plan`)
            planners[c]._refuse(slots[c])
            pending.discard(c)
            made(c, (yield from planners[c].plan_unguarded(table.caches[c].ids, None, full[c])))
    except BaseException:
        for c in pending:  # their hits' locks (and clocks) back
            if ticked:
                planners[c]._refuse(slots[c])
            else:
                planners[c]._lock_hits(slots[c], -1)
        raise


def _with_scratch_rows(
    planners: Sequence[SetPlanner],
    table: PlanTable,
    counts: list[list[int]],
    full: dict[int, CacheCapacityError],
) -> PlanTable:
    """``table`` with free scratch rows for each cache's misses left without a way, its area
    grown to hold them (a cache whose area cannot is given none, and its error is put in
    ``full``: the reservation leaves it alone), made again over the caches' tensors as they
    are now (a grown area's are new)."""
    parts = []
    for c, (planner, part, row) in enumerate(zip(planners, table.caches, counts, strict=True)):
        over, free = row[MISSES] - row[PLACED], None
        store = planner.slots
        if over:
            try:
                planner.scratch.grow(over)
            except CacheCapacityError as error:
                full[c] = error
            else:  # the first free rows, in slot order, as `SetPlanner._reserve` takes them
                at = first_true(store.slot_keys[planner.num_slots :] < 0, over, store.numpy_reads)
                free = planner.num_slots + at
        parts.append(replace(
            part, slot_keys=store.slot_keys, locks=store.locks, batch_of=store.batch_of,
            dirty=store.dirty, free=free,
        ))  # fmt: skip
    remade = PlanTable.of(parts)
    assert remade is not None  # tensors of the same kinds as before
    return remade
