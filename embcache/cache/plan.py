"""Phase (1) of a `HotCache` resolve in a set-associative cache: hits looked up, misses
given ways (or scratch rows), those slots reserved, and the undo of it all.

`SetPlanner` is a part a `HotCache` holds (``HotCache.planner``): the plan's clocks, the
eviction policy and the scratch area are its own; the slots it plans over are the cache's
`storage.SlotStore`. What varies with the policy (the misses' order, the scores, which misses
may displace a row) is the cache's `policy.EvictionPolicy`; the plan family's operations
(`embcache.ops.plan`: the set index, the device path's kernels, the compiled CPU plan) are the
cache's bound implementation (``SlotStore.ops``); the compiled CPU plan (`PlanOps.plan_lru`,
`plan_lfu`, `reserve`) makes the same plan as the torch code here, which is its
specification.

A plan changes the index (keys, scores, dirty flags, locks, the row index, the scratch count)
before the tier is called, and records what it replaced in its `Plan`: a tier that fails
then gets the cache back as it was (`SetPlanner.rollback`).
"""

from __future__ import annotations

import torch

from embcache.cache.lockstep import Counts, Step, first_true
from embcache.cache.policy import EvictionPolicy, orders_padded_misses, scores_by_tick
from embcache.cache.scratch import CacheCapacityError, ScratchArea
from embcache.cache.storage import Plan, SlotStore
from embcache.indexing import put, true_at


class SetPlanner:
    """Phase (1) of a resolve in a set-associative cache, and its undo.

    Args:
        slots: the cache's slot store (its ``num_slots`` slots are ``num_sets`` sets of
            ``ways`` ways, then the scratch rows).
        scratch: the scratch area behind them.
        eviction: the eviction policy.
        ways: ways of a set.
        num_sets: sets of the cache.
        pins: the tier bounds a table: a plan lists every row it evicts (to unpin).

    Attributes:
        tick: plans made (a clock: LRU's scores, the misses' shuffle).
        lookups: plans made (LFU's decay counts them).
        batch_seq: number of the last locked resolve; its rows are guarded (`guarded`).
    """

    def __init__(
        self,
        slots: SlotStore,
        scratch: ScratchArea,
        eviction: EvictionPolicy,
        ways: int,
        num_sets: int,
        pins: bool,
    ) -> None:
        self.slots = slots
        self.scratch = scratch
        self.eviction = eviction
        self.ways, self.num_sets = ways, num_sets
        self.num_slots = slots.num_slots
        self.pins = pins
        self.device = slots.device
        self.ops = slots.ops.plan  # the plan family, bound with the cache
        self.tick = 0
        self.lookups = 0
        self.batch_seq = 0

    def plan(self, ids: torch.Tensor, admitted: torch.Tensor | None) -> Step:
        """`plan_sets`, and when the batch finds too little room beside the last locked
        batch's rows, again with them no longer guarded (its step is done, or the plan would
        have met its locks anyway)."""
        try:
            return (yield from self.plan_sets(ids, admitted))
        except CacheCapacityError as full:
            return (yield from self.plan_unguarded(ids, admitted, full))

    def plan_unguarded(
        self, ids: torch.Tensor, admitted: torch.Tensor | None, full: CacheCapacityError
    ) -> Step:
        """After a plan refused with ``full`` (the cache unchanged): `plan_sets` again with the
        last locked batch's rows no longer guarded, if any are; else ``full`` is raised."""
        guarding = yield Counts([self.guarded().any()])
        if not guarding[0]:
            raise full
        self.batch_seq += 1
        yield from self.release_steps()
        return (yield from self.plan_sets(ids, admitted))

    def groups(self) -> bool:
        """Whether this planner's next plan, of a batch whose every id is admitted, may be
        made with other caches' (`cache.group_plan`): on the device path (the plan family
        `places_misses`, no row index), under a policy whose misses are placed before their
        number is read (`_places_ahead`) and whose touch scores a batch with the clock
        (LRU)."""
        return (
            self.slots.where is None and self._places_ahead(None) and scores_by_tick(self.eviction)
        )

    def release_steps(self) -> Step:
        """The scratch area's release (`ScratchArea.release_steps`), the last locked batch's
        rows kept."""
        return self.scratch.release_steps(self.batch_seq)

    def guard(self, live: torch.Tensor) -> None:
        """A locked batch's commit: its ``live`` slots are the last locked batch's."""
        self.batch_seq += 1
        self.slots.rows.fill_at(self.slots.batch_of, live, self.batch_seq)

    def touch(self, ids: torch.Tensor, slots: torch.Tensor, n_main: int | None = None) -> None:
        """Update the eviction scores of the resident slots of a batch (`EvictionPolicy.touch`);
        ``n_main``: how many of ``slots`` are in the cache proper (not -1, not scratch), when
        known (no host read then)."""
        store = self.slots
        all_main = n_main == slots.numel() or (not self.scratch.used and store.admits_all)
        self.eviction.touch(ids, slots, store.scores, n_main, all_main, self.tick, self.lookups)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each of ``ids`` held in the cache proper or its scratch area, else -1: a
        gather from the row index on a CPU, else the set index, then the scratch area."""
        store = self.slots
        if store.where is not None:  # the slot of every held row, scratch included
            return store.where.index_select(0, store.row_index(ids)).to(torch.int64)
        W = self.ways
        sets = self.ops.set_index(ids, self.num_sets)
        keys = store.slot_keys[: self.num_slots].view(self.num_sets, W)
        slots = self.ops.cache_slots(keys, ids, sets)
        if self.scratch.used:
            self.scratch.find(ids, slots)
        return slots

    def plan_sets(self, ids: torch.Tensor, admitted: torch.Tensor | None) -> Step:
        """The plan of a set-associative cache (a `lockstep` step: its host reads are the
        numbers of misses, of the sets they touch and of the victims, each asked once; on the
        device path under LRU one read answers all of them, `_choose_ways_ahead`).
        Raises CacheCapacityError with the cache unchanged."""
        store = self.slots
        if self._native_plan(admitted):
            return self._plan_native(ids)
        # Gathers are index_select and writes scatter_/index_add_ (`embcache.indexing`): on a
        # CPU, advanced indexing takes a general path several times slower.
        slots = self.lookup(ids)
        # Every number this plan needs before its sort, in one read (with other caches').
        missing, wanted = self.ops.lookup_counts(slots, self.num_slots, admitted)
        ahead = None
        if self._places_ahead(admitted):
            # Ways this batch hits are as good as locked while its misses choose victims.
            self._lock_hits(slots, 1)
            ahead = self._choose_ways_ahead(ids, missing, wanted[0])
            wanted = [*wanted, *ahead[3].unbind(0)]
        try:
            n_miss, n_resident, n_scratch_hits, *rest = yield Counts(wanted)
        except BaseException:  # another cache's failure ends this plan here
            if ahead is not None:
                self._lock_hits(slots, -1)
            raise
        refused = rest[0] if admitted is not None else 0
        self.tick += 1  # both undone if the plan is refused
        self.lookups += 1
        if not n_miss:
            if ahead is None:
                store.rows.add_at(store.locks, store.live(slots, n_resident), 1)
            self.touch(ids, slots, n_resident - n_scratch_hits)
            empty = self.empty_ids()
            plan = Plan(ids, slots, empty, empty, empty, empty)
            plan.refused = refused
            return plan
        if ahead is None:
            miss_pos = first_true(missing, n_miss, store.numpy_reads)
            misses = miss_pos, ids.index_select(0, miss_pos)  # in the order of ``ids``
            self._lock_hits(slots, 1)
        else:  # the misses come first in each padded list
            misses = ahead[0][:n_miss], ahead[1][:n_miss]
        try:
            if ahead is None:
                found = yield from self._choose_ways(ids, misses)
            else:
                found = (ahead[2][0][:n_miss], ahead[2][1][:n_miss], *rest)
            miss_pos, place, n_placed, n_evicted, n_dirty = found
            n_over = n_miss - n_placed
            if n_over:
                self.scratch.grow(n_over)
        except BaseException:  # a refused plan (or one another cache's failure ends)
            self._refuse(slots)
            raise
        return self._reserve(
            ids, slots, misses, miss_pos, place, refused, (n_placed, n_evicted, n_dirty),
            n_resident - n_scratch_hits + n_placed,
        )  # fmt: skip

    def _places_ahead(self, admitted: torch.Tensor | None) -> bool:
        """Whether this plan places its misses before it reads how many there are
        (`_choose_ways_ahead`): on the device path (Triton), for a policy under which every
        miss may displace a row and whose order takes padding (LRU), admitting every id. The
        number of misses then comes with the placement's counts: one read fewer a plan."""
        return (
            admitted is None
            and self.ops.places_misses
            and type(self.eviction).admit is EvictionPolicy.admit
            and orders_padded_misses(self.eviction)
        )

    def _choose_ways_ahead(
        self, ids: torch.Tensor, missing: torch.Tensor, num_misses: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """`_choose_ways` of the device path, made before the number of misses is read: every
        list is as long as ``ids``, its misses first. Returns the misses' positions (ascending)
        and ids, their positions in the order they were placed with each one's slot (-1:
        scratch), and the counts `PlanOps.assign_misses` adds up (placed, evicting, dirty).
        ``num_misses``: the count `lookup_counts` made, still on the device; the salt is the
        clock the plan will read at (`_tick` + 1)."""
        store = self.slots
        n = ids.numel()
        miss_pos = torch.nonzero_static(missing, size=n, fill_value=-1).squeeze(1)
        miss_ids, order_pos, miss_sets = self.eviction.order_padded_misses(
            ids, miss_pos, self.tick + 1, self.num_sets
        )
        place, counts = self.ops.assign_misses(
            miss_sets, store.scores, store.locks, store.batch_of, store.slot_keys, store.dirty,
            self.ways, self.batch_seq, num_misses,
        )  # fmt: skip
        return miss_pos, miss_ids, (order_pos, place), counts

    def _choose_ways(self, ids: torch.Tensor, misses: tuple[torch.Tensor, torch.Tensor]) -> Step:
        """The ways the ``misses`` (their positions in ``ids``, ascending, and their ids)
        take: returns their positions in the order they were placed, the slot each takes (-1:
        scratch), and how many got a way, how many of those evict a row, and how many of
        those rows are dirty."""
        store = self.slots
        W = self.ways
        # Misses compete for a set's ways in an order that changes every batch: dedup hands
        # ids sorted, and a fixed order would give the same rows the ways each time. LFU:
        # the most frequent first.
        miss_pos, miss_ids = misses
        shuffle = self.ops.salted_mix64(miss_ids, self.tick)
        miss_pos, miss_sets, priority = self.eviction.order_misses(
            ids, miss_pos, miss_ids, shuffle, self.num_sets
        )
        if self.ops.places_misses and type(self.eviction).admit is EvictionPolicy.admit:
            # Every miss may displace a row (LRU): one kernel places them and counts, no
            # read of the runs first.
            place, counts = self.ops.assign_misses(
                miss_sets, store.scores, store.locks, store.batch_of, store.slot_keys, store.dirty,
                W, self.batch_seq,
            )  # fmt: skip
            n_placed, n_evicted, n_dirty = yield Counts([counts[0], counts[1], counts[2]])
            return miss_pos, place, n_placed, n_evicted, n_dirty
        # The runs of sets (`torch.unique_consecutive`, their number read with the others').
        first = torch.ones_like(miss_sets, dtype=torch.bool)
        torch.ne(miss_sets[1:], miss_sets[:-1], out=first[1:])
        owner = torch.cumsum(first, 0) - 1
        (n_touched,) = yield Counts([owner[-1] + 1])
        touched = miss_sets.index_select(0, first_true(first, n_touched, store.numpy_reads))
        locks_view = store.locks[: self.num_slots].view(self.num_sets, W)
        scores_view = store.scores.view(self.num_sets, W)
        # The last locked batch's rows are as good as locked: under prefetch they are (that
        # batch is in flight), so a run evicts the same rows with and without prefetch.
        guarded = locks_view.index_select(0, touched) > 0
        batch_of = store.batch_of[: self.num_slots].view(self.num_sets, W)
        guarded |= batch_of.index_select(0, touched) == self.batch_seq
        runs = None if store.numpy_reads else n_touched
        assigned = self.ops.assign_ways(scores_view.index_select(0, touched), guarded, owner, runs)
        # LFU: a miss displaces a resident row only if asked for more often; the others are
        # served from scratch for this batch, while their counts keep growing.
        assigned = self.eviction.admit(assigned, scores_view, touched, owner, priority)
        # The slot each miss (in the order of ``miss_pos``) takes, -1 where its set has none.
        place = torch.where(assigned >= 0, touched.index_select(0, owner) * W + assigned, assigned)
        placed = place >= 0
        at = place.clamp(min=0)
        held = placed & (store.slot_keys.index_select(0, at) >= 0)
        n_placed, n_evicted, n_dirty = yield Counts(
            [placed.sum(), held.sum(), (held & store.dirty.index_select(0, at)).sum()]
        )
        return miss_pos, place, n_placed, n_evicted, n_dirty

    def _native_plan(self, admitted: torch.Tensor | None) -> bool:
        """Whether this plan runs as compiled CPU kernels (`PlanOps.compiled`): a CPU cache
        with a row index, admitting every id, LRU or LFU with exact counts (no sketch). The
        torch path is the specification."""
        store = self.slots
        if store.where is None or admitted is not None or not self.ops.compiled:
            return False
        return self.eviction.compiled()

    def _plan_native(self, ids: torch.Tensor) -> Plan:
        """`_plan_sets` through `PlanOps.plan_lru` (or `plan_lfu` and `touch_lfu`) and
        `PlanOps.reserve`: the same plan, the same changes to the index, in a few passes over
        the batch's ids."""
        store = self.slots
        assert store.where is not None
        ids = ids.contiguous()
        slots = torch.empty_like(ids)
        self.tick += 1  # both undone if the plan is refused
        self.lookups += 1
        rescore = self.eviction.rescores_compiled_plan
        planned = self.eviction.plan_compiled(
            ids, store.where, store.row_offset, store.scores, store.locks, store.batch_of,
            (self.num_slots, self.num_sets, self.ways), self.tick, self.batch_seq, slots,
        )  # fmt: skip
        if not planned[0].size:  # every id hit: its slot is locked and touched
            if rescore:
                self.touch(ids, slots)
            empty = self.empty_ids()
            return Plan(ids, slots, empty, empty, empty, empty)
        miss_pos, order, place = map(torch.from_numpy, planned)
        over = true_at(place < 0)  # misses whose set has no free way: scratch rows
        if over.numel():
            try:
                self.scratch.grow(over.numel())  # may replace the arrays: views come after
            except CacheCapacityError:
                self._refuse(slots)
                raise
            free = true_at(store.slot_keys[self.num_slots :] < 0)[: over.numel()]
            put(place, over, self.num_slots + free)  # in the planned order, as `_reserve`
            self.scratch.used += over.numel()
        load_slots, victim_ids, victim_slots, evicted, old_keys, old_scores, old_dirty = (
            map(torch.from_numpy, self.ops.reserve(
                ids.numpy(), slots.numpy(), miss_pos.numpy(), order.numpy(), place.numpy(),
                store.where.numpy(), store.row_offset.numpy(), store.fusion_k,
                store.slot_keys.numpy(), store.scores.numpy(), store.locks.numpy(),
                store.dirty.numpy(), self.num_slots, self.tick,
            ))
        )  # fmt: skip
        plan = Plan(ids, slots, ids.index_select(0, miss_pos), load_slots, victim_ids, victim_slots)
        plan.reserved, plan.old_keys = place, old_keys
        plan.old_scores, plan.old_dirty = old_scores, old_dirty
        plan.evicted, plan.n_scratch = evicted.numel(), over.numel()
        if self.pins:
            plan.released = evicted
        if rescore:  # `reserve` scored the batch's slots as LRU does: LFU scores replace them
            self.touch(ids, slots)
        return plan

    def _reserve(
        self,
        ids: torch.Tensor,
        slots: torch.Tensor,
        misses: tuple[torch.Tensor, torch.Tensor],
        miss_pos: torch.Tensor,
        place: torch.Tensor,
        refused: int,
        sizes: tuple[int, int, int],
        n_main: int,
    ) -> Plan:
        """Reserve the planned slots: each miss at ``miss_pos`` takes its ``place``, or a
        scratch row where that is -1 (the scratch area has room for them); the victims' keys
        leave the index, the misses' enter it, and every slot of the batch is locked and
        touched. ``misses`` are the misses' positions and ids in the order of ``ids``, the
        order they are read from the tier in. ``sizes``: how many misses got a way, how many
        of those evict a row, how many of those rows are dirty; ``n_main``: how many slots of
        the batch will be in the cache proper (`_choose_ways` read them)."""
        store = self.slots
        n_placed, n_evicted, n_dirty = sizes
        n_over = place.numel() - n_placed
        if not n_over and store.where is None:
            return self._reserve_placed(ids, slots, misses, miss_pos, place, refused, sizes,
                                        n_main)  # fmt: skip
        if not n_over:  # no overflow: no selection to make
            place_slots, placed_pos, overflow_pos = place, miss_pos, self.empty_ids()
        else:
            placed = place >= 0
            placed_at = first_true(placed, n_placed, store.numpy_reads)
            place_slots = place.index_select(0, placed_at)
            placed_pos = miss_pos.index_select(0, placed_at)
            overflow_pos = miss_pos.index_select(0, first_true(~placed, n_over, store.numpy_reads))
        if n_over:
            free = first_true(store.slot_keys[self.num_slots :] < 0, n_over, store.numpy_reads)
            over_slots = self.num_slots + free
        else:
            over_slots = self.empty_ids()

        victims = store.slot_keys.index_select(0, place_slots)
        resident = victims >= 0
        dirty = resident & store.dirty.index_select(0, place_slots)
        dirty_victims = place_slots.index_select(0, first_true(dirty, n_dirty, store.numpy_reads))
        new_slots = torch.cat([place_slots, over_slots]) if n_over else place_slots
        new_pos = torch.cat([placed_pos, overflow_pos]) if n_over else placed_pos
        old_keys = store.slot_keys.index_select(0, new_slots)
        put(slots, new_pos, new_slots)
        # Every miss got a slot: the rows to read, in the order of ``ids`` (sorted ids read
        # from the tier without another sort).
        load_slots = slots.index_select(0, misses[0])
        plan = Plan(
            ids,
            slots,
            misses[1],
            load_slots,
            store.slot_keys.index_select(0, dirty_victims),
            dirty_victims,
        )
        plan.reserved, plan.old_keys = new_slots, old_keys
        plan.old_scores = store.scores.index_select(0, place_slots)
        plan.old_dirty = store.dirty.index_select(0, new_slots)
        evicted = victims.index_select(0, first_true(resident, n_evicted, store.numpy_reads))
        plan.n_scratch, plan.evicted = n_over, n_evicted
        plan.refused = refused
        if self.pins:
            plan.released = evicted
        store.unindex(evicted)
        put(store.slot_keys, load_slots, plan.load_ids)
        store.index(plan.load_ids, load_slots)
        store.rows.fill_at(store.dirty, new_slots, False)
        self.scratch.used += n_over
        store.rows.add_at(store.locks, new_slots, 1)  # now every slot of the batch holds one lock
        self.touch(ids, slots, n_main)
        return plan

    def _reserve_placed(
        self,
        ids: torch.Tensor,
        slots: torch.Tensor,
        misses: tuple[torch.Tensor, torch.Tensor],
        miss_pos: torch.Tensor,
        place: torch.Tensor,
        refused: int,
        sizes: tuple[int, int, int],
        n_main: int,
    ) -> Plan:
        """`_reserve` where every miss got a way and no row index is kept (the device path):
        the ways taken, their old keys, scores and flags saved, the keys, dirty flags and locks
        set, in one operation (`PlanOps.reserve_placed`); then the victims and the dirty ones
        among them are selected by the counts the plan read."""
        store = self.slots
        _, n_evicted, n_dirty = sizes
        old_keys, old_scores, old_dirty, resident, write_back = self.ops.reserve_placed(
            ids, slots, miss_pos, place, store.slot_keys, store.dirty, store.scores, store.locks
        )
        at = first_true(write_back, n_dirty, store.numpy_reads)
        dirty_victims = place.index_select(0, at)
        # Every miss got a slot: the rows to read, in the order of ``ids``.
        load_slots = slots.index_select(0, misses[0])
        plan = Plan(ids, slots, misses[1], load_slots, old_keys.index_select(0, at),
                    dirty_victims)  # fmt: skip
        plan.reserved, plan.old_keys = place, old_keys
        plan.old_scores, plan.old_dirty = old_scores, old_dirty
        evicted = old_keys.index_select(0, first_true(resident, n_evicted, store.numpy_reads))
        plan.n_scratch, plan.evicted = 0, n_evicted
        plan.refused = refused
        if self.pins:
            plan.released = evicted
        self.touch(ids, slots, n_main)
        return plan

    def _lock_hits(self, slots: torch.Tensor, delta: int) -> None:
        """Add ``delta`` to the locks of the slots of ``slots`` that are not -1 (without
        selecting them: a -1 adds 0 to slot 0)."""
        self.ops.add_at_held(self.slots.locks, slots, delta)

    def _refuse(self, slots: torch.Tensor) -> None:
        """Undo what a plan did before it was refused (a full scratch area, or another cache's
        failure): the hits' locks and the clocks it advanced."""
        self._lock_hits(slots, -1)
        self.tick -= 1
        self.lookups -= 1

    def guarded(self) -> torch.Tensor:
        """Which slots hold an unlocked row guarded as the last locked batch's."""
        store = self.slots
        return (store.batch_of == self.batch_seq) & (store.locks == 0)

    def empty_ids(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def rollback(self, plan: Plan) -> None:
        """Undo a plan (this planner's or `DirectMap.plan`'s) after a failed tier transfer:
        victims stay resident and dirty."""
        store = self.slots
        if plan.reserved is not None:
            assert plan.old_keys is not None  # recorded with reserved
            store.slot_keys[plan.reserved] = plan.old_keys
            store.reindex()
            if plan.old_dirty is not None:  # set together with reserved
                store.dirty[plan.reserved] = plan.old_dirty
            if plan.old_scores is not None:  # of the reserved ways (scratch rows have none)
                reserved = plan.reserved[: plan.old_scores.numel()]
                ways = reserved < self.num_slots
                store.scores[reserved[ways]] = plan.old_scores[ways]
        self.scratch.used -= plan.n_scratch
        store.locks[store.live(plan.slots)] -= 1
