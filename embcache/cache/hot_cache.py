"""HotCache: a fixed number of device slots holding the rows a batch needs, backed by a tier.

One cache serves the tables of one embedding dim. A slot holds a row of one table, its weights
(``weights[slot]``, ``dim`` float32) and its optimizer state (``state[slot]``, ``state_dim``
float32), keyed by its fused id
``id | (table_idx << fusion_k)``. Slots form a set-associative index: a key lives in set
``set_index(key)``, in one of that set's ``ways`` slots. When the capacity covers every row of
the cache's tables, each row gets its own slot instead (direct mapping: no lookup, no eviction).

`resolve` maps a batch's unique ids to slots:

1. hits: keys already resident (or in the scratch area) keep their slot;
2. misses take distinct ways of their set, lowest score first (LRU: last use; LFU: frequency),
   skipping locked ways, the ways this batch hits and those of the last locked batch
   (`PlanOps.assign_ways`);
3. dirty victims are written back to the tier in one batched call per table, then the missing
   rows are read from the tier (created there on first touch) and copied into their slots;
4. misses that find no free way in their set are served from a scratch area behind the cache,
   whose rows are written back (when dirty) and freed by the first `release` after their last
   lock is dropped and a later batch was resolved (each resolve starts with one).

On a CPU, a set-associative cache of bounded tables also records the slot of every row it
holds (``SlotStore.where``, int32 over its tables' rows, scratch included), so step 1 is one
gather.
A cache on the device path (``device_path``: a GPU, or a CPU under ``EMBCACHE_BACKEND=triton``,
`embcache.backend.Backend.device_path`) finds hits through the set index and the scratch area
instead, as a GPU does. A direct-mapped cache can serve a batch without a resolve
(`serve_direct`: the TBE step reads rows by table and raw id), counting the same hits.

The last locked batch's rows are guarded like locked ones until the next locked batch is
resolved: under prefetch that batch is in flight then, so guarding it without prefetch too
makes a run evict the same rows and count the same stats either way (dropped when the guard
leaves a batch too little room).

Every tier call happens before any index change, so a tier that fails mid-resolve leaves the
cache as it was: no row is lost, nothing is half-applied, and the call can be retried. `unlock`
never calls the tier, so an optimizer step that has updated rows cannot fail half-way through
releasing them; `release` and `flush` keep every row they could not write (dirty, in its slot)
and can be called again.

Weights may be float16 or bfloat16 (the tables' ``dtype``, `CacheConfig.weight_dtype`): they
travel to and from the tier in that precision, the state stays float32. When a table is bounded
in the tier (a tier capacity), every row the cache holds is pinned there, from its read to its
release (after its write-back), so the tier never evicts a row that is resident, dirty or locked
here; such a cache never maps rows directly. With admission (`CacheConfig.admit_after`), an id
seen in fewer batches than its table asks resolves to slot -1: it reads a row of zeros, its
update is dropped, and nothing is read or created in the tier.

Invariants (docs/design.md, "Cache invariants"): every row has one authoritative copy — its
slot while resident (scratch included), the tier otherwise; a locked slot is never a victim;
`flush` writes every dirty row back, after which the tier alone holds the model.

This module is the coordinator (construction, the three phases of `resolve` and
`resolve_together`, flush, invalidate, stats). A `HotCache` is composed of parts, each an
object with its own state, in its own module of ``embcache.cache``, talking to the others
through the references it was built with:

* `storage`: `SlotStore` (``slot_store``), the slots: rows, keys, locks, dirty flags, scores,
  the row index; `locks`: `unlock_together`, several caches' unlocks at once;
* `plan`: `SetPlanner` (``planner``), the set-associative plan (lookup, ways, reserve), its
  rollback and clocks, holding the eviction policy and the scratch area (`scratch`:
  `ScratchArea`, its growth, lookup and release);
* `policy`: `EvictionPolicy`, `LruPolicy`, `LfuPolicy` (the planner holds one, also
  ``eviction``, the class `policy_registry` names for ``CacheConfig.policy``): miss order,
  scores, LFU's admission of misses over resident rows, the compiled plan's call;
* `writeback`: `WriteBack` (``writeback``), phase (2) of a resolve and every write to the
  tier, over the `transfer.TierTransfer` (``transfer``: tier I/O on host tensors);
* `direct`: `DirectMap` (``direct_map``, a direct cache's), its plan and `serve_direct`;
* `dedup`: `RowDedup` (``dedup``, `ops.ids.row_map`), a batch's dedup through its rows;
* `snapshot`: `PolicySnapshot` (``snapshot``), the checkpointed policy state;
* `stats`: `CacheStats` (``stats``), the counters every part counts into.

The slot store's arrays (``weights``, ``state``, ``slot_keys``, ...) are read through the cache
as attributes of its own: growing the scratch area replaces them, and the cache always gives
the current ones.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from operator import attrgetter
from typing import Generic, TypeVar, cast, overload

import torch

from embcache.backend import for_device
from embcache.cache.config import EXACT_LFU_MAX_ROWS, CacheConfig
from embcache.cache.direct import DirectMap
from embcache.cache.group_plan import plan_group, plan_table
from embcache.cache.lockstep import Step, run_together
from embcache.cache.plan import Plan, SetPlanner
from embcache.cache.policy import make_policy, policy_type
from embcache.cache.scratch import CacheCapacityError, ScratchArea
from embcache.cache.sizing import cache_capacity, check_fits, warn_overflow
from embcache.cache.sketch import Counters
from embcache.cache.snapshot import PolicySnapshot
from embcache.cache.stats import CacheStats
from embcache.cache.storage import SlotStore, WriteBack, unlock_together
from embcache.cache.transfer import Staged, TierTransfer
from embcache.devices import resolve_device
from embcache.kv.base import Store, TableSpec
from embcache.ops.registry import bind
from embcache.profiling import profiled

# A set-associative cache of bounded tables on a CPU keeps the slot of every row it holds in
# an int32 array over all its tables' rows (4 bytes a row), up to this many rows: a lookup is
# then one gather instead of a comparison with every way of the id's set.
ROW_INDEX_MAX_ROWS = 1 << 26


__all__ = [
    "ROW_INDEX_MAX_ROWS",
    "CacheCapacityError",
    "HotCache",
    "resolve_together",
    "unlock_together",
]

T = TypeVar("T")


class _Forward(Generic[T]):
    """A read-only attribute of the cache that is an attribute of one of its parts (a dotted
    path from the cache: ``"slot_store.weights"``), read at each access."""

    def __init__(self, path: str) -> None:
        self._get = attrgetter(path)

    @overload
    def __get__(self, cache: None, owner: type) -> _Forward[T]: ...

    @overload
    def __get__(self, cache: object, owner: type) -> T: ...

    def __get__(self, cache: object | None, owner: type) -> T | _Forward[T]:
        return self if cache is None else self._get(cache)

    def __set__(self, cache: object, value: object) -> None:
        raise AttributeError("a part's attribute: set it on the part")


class HotCache:
    """Device slots for the rows of tables of one dim, with write-back to a `Store`.

    Args:
        tables: ``(table_idx, spec)`` pairs, all with the same ``spec.dim`` and ``state_dim``;
            table_idx is the prefix of the table's fused ids. Each table must be declared in
            ``store``.
        config: capacity and policy.
        store: the tier behind the cache.
        device: where the slots live.
        fusion_k: bits of the raw id inside a fused id.

    Attributes:
        weights: ``[num_slots + scratch_rows, dim]`` of the tables' dtype, the slots' weights,
        and
        state: float32 ``[num_slots + scratch_rows, state_dim]``, their optimizer state: the slot
            storage (`SlotStore`, as ``slot_keys``, ``locks``, ``dirty``, ``scores`` and
            ``batch_of``). Read them under ``lock`` or ``storage_lock`` when another thread may
            resolve concurrently (the scratch area may grow, which replaces both tensors).
        storage_lock: held while the slot storage is replaced, and by whoever reads or writes
            rows through a view of it that must stay the storage (the TBE step,
            for its forward's table and its backward's update), without holding ``lock``: the
            update of one batch's locked rows then runs beside a prefetch's resolve of the
            next. Taken after ``lock``, never before it.
        num_slots: slots of the cache proper (scratch excluded).
        direct: True when every row has its own slot.
        policy: the eviction policy's registered name (``"lru"``, ``"lfu"``, ...).
        eviction: the `policy.EvictionPolicy` of ``policy``.
        dedup: the `RowDedup` of a cache with a row index (`IdsOps.row_dedup`).
        slot_store, planner, writeback, direct_map, snapshot, stats: the parts (see the
            module's docstring).
    """

    # The slot store's arrays and sizes, and the counters (`CacheStats`), read through the
    # cache: the parts replace or change them.
    weights = _Forward[torch.Tensor]("slot_store.weights")
    state = _Forward[torch.Tensor]("slot_store.state")
    slot_keys = _Forward[torch.Tensor]("slot_store.slot_keys")
    locks = _Forward[torch.Tensor]("slot_store.locks")
    dirty = _Forward[torch.Tensor]("slot_store.dirty")
    scores = _Forward[torch.Tensor]("slot_store.scores")
    batch_of = _Forward[torch.Tensor]("slot_store.batch_of")
    state_dim = _Forward[int]("slot_store.state_dim")
    width = _Forward[int]("slot_store.width")
    scratch_rows = _Forward[int]("slot_store.scratch_rows")
    hits = _Forward[int]("stats.hits")
    misses = _Forward[int]("stats.misses")
    evictions = _Forward[int]("stats.evictions")
    writebacks = _Forward[int]("stats.writebacks")
    admissions_refused = _Forward[int]("stats.admissions_refused")
    gradients_dropped = _Forward[int]("stats.gradients_dropped")
    # Read by tests that watch a run from outside the cache package.
    _scratch_used = _Forward[int]("planner.scratch.used")
    _deferred = _Forward[list[Staged]]("writeback.deferred")

    def __init__(
        self,
        tables: Sequence[tuple[int, TableSpec]],
        config: CacheConfig,
        store: Store,
        device: torch.device | str,
        fusion_k: int,
    ) -> None:
        self.dim, self.dtype = _shared_dim_and_dtype(tables)
        self.config = config
        self.store = store
        self.device = resolve_device(device)
        self.fusion_k = fusion_k
        # The implementation family, chosen once (`embcache.backend`): its compiled passes or
        # the torch code, and on the device path the set index (`ops.plan`, a GPU's plan)
        # instead of the row index: off a CPU, and on a CPU under EMBCACHE_BACKEND=triton, so
        # the GPU's plan runs and is tested without a GPU. ``ops``: the op families'
        # implementations for it, bound once (`embcache.ops.registry`).
        self.backend = for_device(self.device)
        self.ops = bind(self.backend)
        self.device_path = self.backend.device_path
        self._resolve_mutex = threading.RLock()  # serialises resolves (and flush, read)
        self._specs = {idx: spec for idx, spec in tables}
        self.transfer = TierTransfer(store, self._specs, fusion_k, self.device, self.backend)
        self.pins = self.transfer.pins()  # bounded tier tables: pin what the cache holds
        self.rounding_seed = tables[0][1].seed
        self.stochastic_rounding = config.stochastic_rounding

        sizes = [spec.num_embeddings for _, spec in tables if spec.num_embeddings is not None]
        total_rows = sum(sizes) if len(sizes) == len(tables) else None  # None: one unbounded
        capacity = cache_capacity(config, total_rows, self.dim, self.device, self._names())
        self.direct = total_rows is not None and capacity >= total_rows and not self.pins
        self.policy = str(config.policy)  # its registered name (`CacheConfig` checked it)
        row_offset, thresholds, bounded_rows, self._key_limits = _table_rows(
            tables, config, fusion_k
        )
        self._row_offset = row_offset.to(self.device)  # slot (direct) / LFU count base per table
        self.ways, self.num_sets, index_rows = _slot_shape(
            config, capacity, total_rows, self.direct, self.device_path
        )
        self.num_slots = self.ways * self.num_sets
        self._make_counters(row_offset, bounded_rows, thresholds, tables[0][1].state_dim)
        self._overflow_warned = False
        self._make_parts(tables[0][1].state_dim, index_rows)

    def _make_counters(
        self, row_offset: torch.Tensor, bounded_rows: int, thresholds: torch.Tensor, state_dim: int
    ) -> None:
        """Sets ``_counts`` (LFU's), ``_admission`` (the admission sketch) and ``eviction``,
        once the slots and the counters are known to fit on the device (`check_fits`)."""
        config = self.config
        lfu = policy_type(self.policy).needs_counts and not self.direct
        counters = Counters(
            row_offset, bounded_rows, thresholds, lfu, config.lfu_counters, EXACT_LFU_MAX_ROWS,
            config.sketch_width, config.sketch_depth, config.effective_admission_window,
        )  # fmt: skip
        which, width = self._names(), self.dim + state_dim
        check_fits(self.num_slots, width, counters.nbytes // 8, self.device, which, self.dim)
        self._counts, self._admission = counters.build(self.device, self.fusion_k)
        self.eviction = make_policy(self.policy, self._counts, config, self.backend, self.fusion_k)

    def _make_parts(self, state_dim: int, index_rows: int) -> None:
        """The parts (see the module's docstring), each given the others it talks to."""
        self.stats = CacheStats()
        self.slot_store = slots = SlotStore(
            self.dim, self.dtype, state_dim, self.num_slots, index_rows, self._row_offset,
            self.fusion_k, self.device, self.backend, self.transfer, self._admission is None,
            self.stats,
        )  # fmt: skip
        self.lock = slots.lock
        self.storage_lock = slots.storage_lock  # see the class docstring: after `lock`
        self.writeback = WriteBack(slots, self.transfer, self.stats, self.pins)
        scratch = ScratchArea(
            slots, self.config.max_scratch_rows, self.writeback.write_host, self.pins, self.stats
        )
        self.planner = SetPlanner(
            slots, scratch, self.eviction, self.ways, self.num_sets, self.pins
        )
        self.direct_map = (
            DirectMap(slots, self._specs, self.store, self.stats) if self.direct else None
        )
        geometry: dict[str, object] = {
            "num_slots": self.num_slots,
            "ways": self.ways,
            "direct": self.direct,
            "policy": self.policy,
            "dtype": str(self.dtype),
            "fusion_k": self.fusion_k,  # slot keys are fused ids: their table bits move with it
        }
        self.snapshot = PolicySnapshot(
            self.planner, self._counts, self._admission, geometry, self._key_limits
        )
        rows = {idx: spec.num_embeddings for idx, spec in self._specs.items()}
        self.dedup = self.ops.ids.row_dedup(self._row_offset, index_rows, rows, self.fusion_k)

    # ------------------------------------------------------------------------------------------
    # tables, rows and ids

    @property
    def admits_all(self) -> bool:
        """Whether every id gets a slot (no admission threshold: no slot is ever -1)."""
        return self._admission is None

    @property
    def counter_bytes(self) -> int:
        """Device bytes of the LFU counts and the admission sketch."""
        total = 0 if self._counts is None else self._counts.nbytes
        return total + (0 if self._admission is None else self._admission.sketch.nbytes)

    def _names(self) -> str:
        names = [spec.name for spec in self._specs.values()]
        return f"table {names[0]!r}" if len(names) == 1 else f"{len(names)} tables {names[:3]}"

    def row_index(self, keys: torch.Tensor) -> torch.Tensor:
        """Row of each fused key of a bounded table among all the cache's tables' rows (in
        ascending table index): under direct mapping, its slot."""
        return self.slot_store.row_index(keys)

    def rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The stored tier rows (`TableSpec.pack`: weights, then state) held at ``slots``."""
        return self.slot_store.rows_of(slots)

    def unique_by_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``torch.unique(ids, sorted=True, return_inverse=True)`` of valid fused ids of this
        cache's tables through a map over their rows, or None (`RowDedup.unique_by_rows`)."""
        return self.dedup.unique_by_rows(ids)

    def maps_batch(self, n: int) -> bool:
        """Whether `unique_values` takes a batch of ``n`` ids (`RowDedup.maps_batch`: the
        compiled kernels run, the cache keeps the slot of every row of its tables, and the
        batch is dense enough for the map over those rows)."""
        return self.dedup.maps_batch(n)

    def row_ranges(self, tables: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """For `unique_values`: the first row (among this cache's tables' rows) and the number
        of valid ids of each of ``tables`` (table indices) (`RowDedup.row_ranges`)."""
        return self.dedup.row_ranges(list(tables))

    def unique_values(
        self,
        values: torch.Tensor,
        bounds: torch.Tensor,
        ranges: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`unique_by_rows` of raw ids, checked and fused in the same compiled pass
        (`RowDedup.unique_values`: the values of feature ``f``, ``values[bounds[f] :
        bounds[f + 1]]``, are ids of a table whose `row_ranges` are ``ranges[0][f],
        ranges[1][f]``), or None where it does not apply or an id is bad (`IdsOps.fuse_ids`
        then says which)."""
        return self.dedup.unique_values(values, bounds, ranges)

    # ------------------------------------------------------------------------------------------
    # resolve

    def resolve(
        self,
        unique_ids: torch.Tensor,
        lock: bool = True,
        count_sightings: bool = True,
        defer_writeback: bool = False,
        checked: bool = False,
        create: bool | None = None,
    ) -> torch.Tensor:
        """Slots holding the rows of ``unique_ids``, loading misses from the tier.

        Three phases, so that a resolve running on a prefetch thread overlaps the training
        thread's use of the cache: (1) under ``lock``, hits are found, misses get ways or scratch
        rows, those slots are reserved and locked and the dirty victims' rows are copied out;
        (2) without ``lock``, victims are written to the tier and missing rows read from it;
        (3) under ``lock``, the rows are copied into their slots. Resolves are serialised among
        themselves. A tier error in (2) undoes (1): the cache is as it was. Several caches at
        once: `resolve_together` (each phase's host reads made once for all of them).

        Args:
            unique_ids: int64 ``[n]`` distinct fused ids (any order), on any device.
            lock: lock every returned slot (one count each) until `unlock`; a locked slot is
                never evicted. Unlocked resolves must use the slots before the next resolve and
                then call `release` so scratch rows they used are written back.
            count_sightings: with admission, count this batch as a sighting of its ids (False
                for ids resolved again, whose batch was counted already).
            defer_writeback: leave the dirty victims' write to the tier for later: their rows
                are copied out at once (their slots take the misses), and `write_deferred`
                writes them, or else whatever reads the tier next through this cache (the next
                resolve, `flush`, `read`, ...) does first. A prefetch worker resolves so: the
                batch is ready a write sooner, and the write runs while the training thread
                starts the next prefetch. Only where the tier's write and read are one grouped
                call each (`TierTransfer.grouped`) and no table is bounded; else ignored.
            checked: the caller checked every id against this cache's tables already (a
                share from `CacheEngine.fuse` or `unique_share`): the check is not repeated.
            create: misses the tier does not hold are created there (`Store.get`); False:
                they are read as their initial values and not created (`Store.read`), and
                stay clean here, so they reach the tier only once updated and written back.
                None (the default): ``torch.is_grad_enabled()`` in the calling thread, so a
                forward under ``torch.no_grad()`` writes nothing to the tier.

        Returns:
            int64 ``[n]`` slot of each id, on the cache's device: ``rows[slots]`` are its rows;
            -1 for an id not admitted (a row of zeros, whose update is dropped).

        Raises:
            CacheCapacityError: the batch's rows cannot fit the cache plus the scratch area.
            ValueError: on a CPU, an id that is no row of this cache's tables (a table index
                not among them, a raw id past its table's rows): nothing changed.
        """
        return resolve_together(
            [self], [unique_ids], lock, count_sightings, defer_writeback, checked, create
        )[0]

    def _prepare_ids(self, unique_ids: torch.Tensor, checked: bool) -> torch.Tensor:
        """A resolve's ids on this cache's device, checked (unless ``checked``)."""
        ids = unique_ids.to(self.device, torch.int64)
        if self.device.type == "cpu" and not checked:
            self._check_keys(ids)
        if ids.numel() > self.num_slots and not self._overflow_warned:
            self._overflow_warned = True
            warn_overflow(ids.numel(), self.num_slots, self._names(), self.dim)
        return ids

    def _plan_steps(
        self, ids: torch.Tensor, count_sightings: bool, plans: list[Plan | None], at: int
    ) -> Step:
        """Phase (1) of a resolve, under ``lock``, as a `lockstep` step: the plan, also kept
        at ``plans[at]`` once made (so that a caller can undo it when another cache fails)."""
        admitted = None
        if self._admission is not None:
            admitted = self._admission.admit(ids, count_sightings)
        if self.direct_map is not None:
            plan = self.direct_map.plan(ids, admitted)
        else:
            plan = yield from self.planner.plan(ids, admitted)
        plans[at] = plan
        return plan

    @profiled("cache.deferred_write")
    def write_deferred(self) -> None:
        """Make the tier writes a resolve with ``defer_writeback`` left staged, in order (a
        no-op when there are none). A tier error propagates and the rows not yet written stay
        staged: the next call, or the next resolve, writes them."""
        with self._resolve_mutex:
            self.writeback.write_deferred()

    def _check_keys(self, ids: torch.Tensor) -> None:
        """A ValueError naming the first of CPU int64 ``ids`` that is no row of this cache's
        tables. Callers above (`CacheEngine.fuse`) check their ids already; this keeps a bad
        one given to `resolve` directly from reaching the row index, which the compiled plan
        reads unchecked."""
        if not ids.numel():
            return
        bad = self.ops.ids.first_bad_key(ids, self.fusion_k, self._key_limits)
        if bad >= 0:
            key = int(ids[bad])
            raise ValueError(
                f"HotCache.resolve: id {key} at position {bad} (table index "
                f"{key >> self.fusion_k}, raw id {key & ((1 << self.fusion_k) - 1)}) is no row "
                f"of this cache's tables {sorted(self._specs)} (rows "
                f"{[self._specs[i].num_embeddings for i in sorted(self._specs)]})"
            )

    def _commit(self, plan: Plan, lock: bool) -> None:
        store, stats = self.slot_store, self.stats
        live = store.live(plan.slots)
        if not lock:
            store.rows.add_at(store.locks, live, -1)
        n_miss = plan.load_ids.numel()
        stats.hits += plan.ids.numel() - n_miss - plan.refused
        stats.misses += n_miss
        stats.admissions_refused += plan.refused
        stats.evictions += plan.evicted
        stats.writebacks += plan.victim_ids.numel()
        if lock and not self.direct:
            self.planner.guard(live)

    # ------------------------------------------------------------------------------------------
    # locks and rows (the slot store's)

    def hold(self, slots: torch.Tensor) -> None:
        """Lock ``slots`` (distinct, resident) once each, as a resolve with ``lock`` does: for
        a batch served by `serve_direct` that turns into the ordinary locked form later."""
        self.slot_store.hold(slots)

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """Record that the rows at ``slots`` were changed in place (e.g. by an optimizer); a
        slot of -1 is an id not admitted, whose update was dropped (counted)."""
        self.slot_store.mark_dirty(slots)

    def unlock(self, slots: torch.Tensor, dirty: bool = False) -> None:
        """Drop one lock from each of ``slots`` (distinct); with ``dirty``, also record that
        their rows were changed in place, as `mark_dirty` does (a batch after its update).

        Never calls the tier: scratch rows left without a lock are written back and freed by
        the next `release` (which the next `resolve`, `flush` and unlocked forwards call).
        Several caches at once: `unlock_together` (one host read for all their checks).

        Raises:
            RuntimeError: a slot is not locked (nothing is changed then).
        """
        unlock_together([(self, slots)], dirty)

    @profiled("cache.release_scratch")
    def release(self) -> None:
        """Write back and free the scratch rows no batch holds any more (those of the last
        locked batch are kept until the next one). If the write fails the rows stay in
        scratch, dirty, and the error propagates: call again later."""
        with self.lock:
            run_together([self.planner.release_steps()])

    def _resident_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each of ``ids`` where it is resident (scratch included), else -1."""
        if self.direct:
            slots = self.row_index(ids)
            return torch.where(self.slot_store.slot_keys[slots] == ids, slots, -1)
        return self.planner.lookup(ids)

    def read(self, fused_ids: torch.Tensor) -> torch.Tensor:
        """Current rows of ``fused_ids`` wherever they live, as float32 ``[n, width]``
        (weights widened, then state); changes nothing.

        Rows resident in a slot (scratch included) are read there, others from the tier.
        """
        with self._resolve_mutex, self.lock:
            self.write_deferred()  # rows that left the cache are in the tier before it is read
            ids = fused_ids.to(self.device, torch.int64)
            slots = self._resident_slots(ids)
            found = slots >= 0
            spec = self.transfer.spec
            out = torch.empty(ids.numel(), self.slot_store.width, device=self.device)
            out[found] = spec.to_float(self.slot_store.rows_of(slots[found]))
            if not bool(found.all()):
                out[~found] = spec.to_float(self.transfer.read(ids[~found].cpu())).to(self.device)
            return out

    def write_weights(self, fused_ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Overwrite the weights of the rows of ``fused_ids`` (distinct) wherever they live,
        keeping their optimizer state: in their slot (scratch included), which becomes dirty,
        or in the tier. The tier is written first, so a tier error changes nothing here.

        Args:
            fused_ids: int64 ``[n]`` distinct fused ids.
            weights: float32 ``[n, dim]`` their new weights.
        """
        with self._resolve_mutex, self.lock:
            self.write_deferred()
            ids = fused_ids.to(self.device, torch.int64)
            weights = weights.to(self.device, torch.float32)
            slots = self._resident_slots(ids)
            found = slots >= 0
            if not bool(found.all()):
                absent = ids[~found].cpu()
                current = self.transfer.read(absent)
                current[:, : self.dim] = weights[~found].cpu()
                self.transfer.write(absent, current)
            resident = slots[found]
            self.slot_store.weights[resident] = weights[found]
            self.slot_store.dirty[resident] = True

    # ------------------------------------------------------------------------------------------
    # direct mapping (`DirectMap`)

    def direct_bases(self) -> dict[int, int]:
        """Direct mapping: the slot of row 0 of each table (by table index); its rows follow
        in order, and the tables lie in the slots in ascending table index."""
        if self.direct_map is None:
            raise RuntimeError("direct_bases: this cache does not map rows directly")
        return self.direct_map.bases()

    def serve_direct(
        self, value_slots: torch.Tensor | None, rows: torch.Tensor | None = None
    ) -> int:
        """A batch served straight from a direct-mapped cache, without a resolve (the TBE
        step reads its slots by table and id): load every row on first use, and count the
        batch's distinct rows as hits, as `resolve` counts its unique ids. No lock is taken:
        a direct-mapped cache evicts nothing.

        Args:
            value_slots: int64 ``[nnz]`` the slot of each value of the batch (repeats allowed),
                or None when ``rows`` is given.
            rows: int64 ``[U]`` the batch's distinct slots, when the caller found them (a
                compiled pass, `ops.ids.native.BitmapDirectRows`); else they are counted here.

        Returns:
            the batch's number, for `mark_dirty_direct` (which marks the same rows faster
            while no other batch was served since).
        """
        if self.direct_map is None:
            raise RuntimeError("serve_direct: this cache does not map rows directly")
        with self._resolve_mutex, self.lock:
            return self.direct_map.serve(value_slots, rows)

    def mark_dirty_direct(
        self, value_slots: torch.Tensor | None, batch: int, rows: torch.Tensor | None = None
    ) -> None:
        """`mark_dirty` for the rows of a batch that `serve_direct` numbered ``batch``
        (``value_slots`` and ``rows`` as given to it)."""
        if self.direct_map is None:
            raise RuntimeError("mark_dirty_direct: this cache does not map rows directly")
        with self.lock:
            self.direct_map.mark_dirty(value_slots, batch, rows)

    # ------------------------------------------------------------------------------------------
    # after the batch

    @profiled("cache.flush")
    def flush(self) -> None:
        """Write every dirty row back to the tier (rows stay cached, now clean)."""
        with self._resolve_mutex, self.lock:
            self.write_deferred()
            self.writeback.flush()

    def invalidate(self) -> None:
        """Flush, then drop every cached row (the next batch reads all from the tier)."""
        with self._resolve_mutex, self.lock:
            store = self.slot_store
            if bool((store.locks > 0).any()):
                raise RuntimeError("HotCache.invalidate: slots are locked by a batch in flight")
            self.flush()
            if self.pins:
                held = store.slot_keys[store.slot_keys >= 0]
                self.transfer.unpin(held.cpu())
            store.clear()
            self.planner.scratch.used = 0
            if self.direct_map is not None:
                self.direct_map.forget()

    def set_state(self, state_dim: int, state_init: float) -> None:
        """Change the optimizer-state columns of every row (tier included), keeping weights.

        Flushes and empties the cache, then re-declares the tables in the tier with the new
        state layout (the tier keeps weights and resets state to ``state_init``).
        """
        check_fits(self.num_slots, self.dim + state_dim, self.counter_bytes // 8, self.device,
                   self._names(), self.dim)  # fmt: skip
        with self._resolve_mutex, self.lock:
            self.invalidate()
            for idx, spec in list(self._specs.items()):
                new = replace(spec, state_dim=state_dim, state_init=state_init)
                self.store.init_table(new)
                self._specs[idx] = new
            self.slot_store.state_dim = state_dim
            self.slot_store.allocate(scratch_rows=0)

    # ------------------------------------------------------------------------------------------
    # policy state (`PolicySnapshot`)

    def policy_state(self) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """The rows the cache holds (their ids, slot by slot), their scores, the LFU and
        admission counts and the clocks: with the tier's rows and scores, what makes a resumed
        run evict the same rows as the run that saved (bit-exact with a bounded tier). Call
        after `flush`, with no batch in flight.

        Returns:
            ``(tensors, meta)``: CPU tensors, and JSON-able numbers (the geometry they fit).
        """
        with self._resolve_mutex, self.lock:
            return self.snapshot.state()

    def load_policy_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, int]) -> bool:
        """Restore `policy_state`: the cache is emptied, then the rows it held are read from
        the tier (pinned where bounded) into the same slots, clean, with the same scores,
        counts and clocks. A direct cache is only emptied (it reads every row again).

        Returns:
            False, having changed nothing, when the saved cache had another geometry (slots,
            ways, policy, dtype, counters): this cache then starts empty.

        Raises:
            ValueError: a state that could not be this cache's (`check_policy_state`),
                before anything changed.
        """
        if not self.check_policy_state(tensors, meta):
            return False
        with self._resolve_mutex, self.lock:
            self.invalidate()
            if not self.direct:
                self.snapshot.restore(tensors, meta)
            return True

    def check_policy_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, int]) -> bool:
        """Whether `load_policy_state` restores this state (False: saved by a cache of another
        geometry, so this one would start empty). Changes nothing; a checkpoint calls it before
        applying anything.

        Raises:
            ValueError: the geometry fits but the state could not be this cache's: a slot key
                that is no row of its tables (another table order), outside its set or held
                twice, a negative clock.
        """
        with self._resolve_mutex, self.lock:
            return self.snapshot.check(tensors, meta)

    def policy_state_shape(self) -> dict[str, object]:
        """What a saved `policy_state` must match to be restored here."""
        return self.snapshot.shape()

    # ------------------------------------------------------------------------------------------
    # statistics

    def cache_stats(self) -> dict[str, float]:
        """Counters since the last `reset_stats`, each counted once per batch, when the batch
        is resolved (by its prefetch or its forward):

        * ``hits``: unique ids of a batch whose row was on the device (a slot or the scratch
          area); ``misses``: the others, read from the tier; ``hit_rate`` = hits / both.
        * ``evictions``: rows that left the device: a slot's row replaced by a miss, or a
          scratch row freed once its batch was done.
        * ``writebacks``: rows written to the tier because they were dirty: at an eviction or
          a `flush`.
        * with admission (`CacheConfig.admit_after`) only: ``admissions_refused``, unique ids
          of a batch not admitted yet (neither hits nor misses: they read zeros and touch no
          tier), and ``gradients_dropped``, the gradient rows of such ids the optimizer dropped.
        """
        return self.stats.as_dict(admission=self._admission is not None)

    def reset_stats(self) -> None:
        """Zero the counters of `cache_stats`."""
        self.stats.reset()

    def locked_slots(self) -> int:
        """Number of slots locked by batches in flight."""
        return int((self.slot_store.locks > 0).sum())


def _table_rows(
    tables: Sequence[tuple[int, TableSpec]], config: CacheConfig, fusion_k: int
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """By table index, on the CPU: each table's first row among the bounded tables' rows (a
    direct slot, an LFU count's base; -1: unbounded) and its admission threshold; the bounded
    tables' rows; and the raw ids each table index takes (0: not a table of the cache, for
    `HotCache._check_keys`)."""
    n_idx = max(idx for idx, _ in tables) + 1
    # Built on the CPU whatever torch's default device (`with torch.device("meta")`).
    row_offset = torch.full((n_idx,), -1, dtype=torch.int64, device="cpu")
    thresholds = torch.ones(n_idx, dtype=torch.int64, device="cpu")
    offset = 0
    for idx, spec in sorted(tables, key=lambda t: t[0]):
        if spec.num_embeddings is not None:
            row_offset[idx] = offset
            offset += spec.num_embeddings
        thresholds[idx] = config.admit_after_of(spec.name)
    key_limits = torch.zeros(n_idx, dtype=torch.int64)
    for idx, spec in tables:
        rows = spec.num_embeddings
        key_limits[idx] = 1 << fusion_k if rows is None else min(rows, 1 << fusion_k)
    return row_offset, thresholds, offset, key_limits


def _slot_shape(
    config: CacheConfig, capacity: int, total_rows: int | None, direct: bool, device_path: bool
) -> tuple[int, int, int]:
    """``(ways, num_sets, index_rows)``: a direct cache has one way and a set per row; the
    rows of the row index (`SlotStore.where`), 0 for none."""
    if direct:
        assert total_rows is not None  # direct mapping needs every table bounded
        ways, num_sets = 1, total_rows
    else:
        ways = min(config.ways, capacity)
        num_sets = math.ceil(capacity / ways)
    # Rows indexed by slot: set-associative caches of bounded tables on a CPU (not on the
    # device path, whose lookup is the set index).
    index_rows = (
        total_rows
        if total_rows is not None and not direct and not device_path
        and total_rows <= ROW_INDEX_MAX_ROWS
        else 0
    )  # fmt: skip
    return ways, num_sets, index_rows


def _shared_dim_and_dtype(tables: Sequence[tuple[int, TableSpec]]) -> tuple[int, torch.dtype]:
    """The one embedding dim and weight dtype of a cache's tables.

    Raises:
        ValueError: no table, or tables of several dims or dtypes.
    """
    if not tables:
        raise ValueError("HotCache needs at least one table")
    dims = {spec.dim for _, spec in tables}
    if len(dims) != 1:
        raise ValueError(f"HotCache serves tables of one dim, got dims {sorted(dims)}")
    dtypes = {spec.dtype for _, spec in tables}
    if len(dtypes) != 1:
        names = [spec.name for _, spec in tables]
        raise ValueError(
            f"tables {names} share a cache (dim {dims.pop()}) but not a weight dtype "
            f"({sorted(str(d) for d in dtypes)}): give them one data_type, or set "
            f"CacheConfig(weight_dtype=...)"
        )
    return dims.pop(), dtypes.pop()


@contextmanager
def _all_locked(caches: Sequence[HotCache]) -> Iterator[None]:
    """Every cache's ``lock``, taken in the given order (a group's engine order, as
    `unlock_together` takes them)."""
    with ExitStack() as held:
        for cache in caches:
            held.enter_context(cache.lock)
        yield


def _release_all(caches: Sequence[HotCache]) -> None:
    """The scratch rows of finished batches released, in every cache whose area holds any
    (the others have nothing to release: not called)."""
    using = [c for c in caches if c.planner.scratch.used]
    if using:
        _release_scratch(using)


@profiled("cache.release_scratch")
def _release_scratch(caches: Sequence[HotCache]) -> None:
    run_together([c.planner.release_steps() for c in caches])


@profiled("cache.plan")
def _plan_all(
    caches: Sequence[HotCache],
    ids: list[torch.Tensor],
    count_sightings: bool,
    plans: list[Plan | None],
) -> list[Plan]:
    """Every cache's plan (each also kept in ``plans`` once made, for the rollback); the
    caches that can are planned as one group (`group_plan`), the others each on its own."""
    grouped = [
        k for k, c in enumerate(caches)
        if c.direct_map is None and c._admission is None and c.planner.groups()
    ]  # fmt: skip
    planners = [caches[k].planner for k in grouped]
    table = plan_table(planners, [ids[k] for k in grouped]) if grouped else None
    in_group = set(grouped) if table is not None else set()
    steps = [
        c._plan_steps(i, count_sightings, plans, k)
        for k, (c, i) in enumerate(zip(caches, ids, strict=True))
        if k not in in_group
    ]
    if table is not None:

        def made(c: int, plan: Plan) -> None:
            plans[grouped[c]] = plan

        steps.append(plan_group(planners, table, made))
    run_together(steps)
    assert all(p is not None for p in plans)
    return cast(list[Plan], plans)


@profiled("cache.resolve")  # every resolve, one cache's (`HotCache.resolve`) or a group's
def resolve_together(
    caches: Sequence[HotCache],
    unique_ids: Sequence[torch.Tensor],
    lock: bool = True,
    count_sightings: bool = True,
    defer_writeback: bool | Sequence[bool] = False,
    checked: bool = False,
    create: bool | None = None,
) -> list[torch.Tensor]:
    """`HotCache.resolve` of ``unique_ids[i]`` in ``caches[i]`` (distinct caches), in
    lockstep: each phase (the scratch rows' release, the plan, the tier transfer) runs for
    every cache, its host reads (numbers of misses, of victims, of scratch rows; the ids the
    tier needs) made once for all the caches (`lockstep.run_together`), so a group's resolve
    reads the host as often for one cache as for many.

    ``defer_writeback``: one flag for all, or one per cache. The other arguments and the
    result are `HotCache.resolve`'s, one slots tensor per cache.

    Raises:
        CacheCapacityError, ValueError: as `HotCache.resolve`; nothing stays locked then: a
            cache whose plan was made is rolled back, or (when its rows were already moved
            into their slots) committed without its locks.
    """
    n = len(caches)
    if create is None:  # a prefetch worker's thread has gradients on: it resolves to train
        create = torch.is_grad_enabled()
    defer = [defer_writeback] * n if isinstance(defer_writeback, bool) else list(defer_writeback)
    ids = [c._prepare_ids(u, checked) for c, u in zip(caches, unique_ids, strict=True)]
    plans: list[Plan | None] = [None] * n
    with ExitStack() as held:
        for cache in caches:
            held.enter_context(cache._resolve_mutex)
        for cache in caches:
            # A deferred write first (this batch may read those rows back); a tier error
            # changes nothing (it keeps what it cannot write).
            cache.write_deferred()
        try:
            with _all_locked(caches):
                # Scratch rows of finished batches first, so they do not crowd this one out.
                _release_all(caches)
                made = _plan_all(caches, ids, count_sightings, plans)
            # Outside the locks: the reserved slots are locked by this resolve and no other
            # resolve runs (mutex), so nobody else reads or writes them, and the storage is
            # only ever replaced by a resolve. The training thread keeps using its own slots.
            run_together(
                [
                    c.writeback.exchange_steps(p, d, create)
                    for c, p, d in zip(caches, made, defer, strict=True)
                ]
            )
        except BaseException:
            with _all_locked(caches):
                for cache, plan in zip(caches, plans, strict=True):
                    if plan is None:
                        continue
                    if plan.exchanged:  # its rows are in their slots: kept, not locked
                        cache._commit(plan, lock=False)
                    else:
                        cache.planner.rollback(plan)
            raise
        with _all_locked(caches):
            for cache, plan in zip(caches, made, strict=True):
                cache._commit(plan, lock)
    return [plan.slots for plan in made]
