"""Direct mapping: a cache whose capacity covers every row of its tables gives each row its
own slot (``row_offset[table] + raw id``): no lookup, no eviction, no scratch.

`DirectMap` is a part a direct cache holds (``HotCache.direct_map``): the direct cache's plan
(every row read from the tier once, on first use) and `DirectMap.serve`, the TBE step's way of
serving a batch without a resolve (it reads rows by table and raw id; `HotCache.serve_direct`),
counting the same hits. The rows are the cache's `storage.SlotStore`'s.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from embcache.cache.plan import Plan
from embcache.cache.stats import CacheStats
from embcache.cache.storage import SlotStore
from embcache.indexing import count_true, or_flags, put
from embcache.kv.base import Store, TableSpec
from embcache.profiling import profiled

# `serve_direct` maps a batch's slots in a bool array over the cache when it has at least one
# value per this many rows; fewer values are counted by passes over the values alone.
_VALUES_PER_MAP = 8


class DirectMap:
    """A direct cache's slots: row ``row_offset[table] + raw id`` of each table in its own slot.

    Args:
        slots: the cache's slot store (a slot per row of its tables).
        specs: the cache's tables by table index (read at each call: the cache may change a
            table's state layout).
        store: the tier, whose rows fill the slots on first use.
        stats: the cache's counters (a batch served here counts its hits).

    Attributes:
        filled: every row was read into its slot (cleared by `forget`).
    """

    def __init__(
        self, slots: SlotStore, specs: Mapping[int, TableSpec], store: Store, stats: CacheStats
    ) -> None:
        self.slots = slots
        self.specs = specs
        self.store = store
        self.stats = stats
        self.filled = False
        self._seen: torch.Tensor | None = None  # `serve`'s map of a batch's slots
        self._seen_batch = -1  # the batch `_seen` maps (-1: none)
        self._served = 0  # batches served directly
        self._stamps: torch.Tensor | None = None  # `_distinct`'s positions, made on first use

    def forget(self) -> None:
        """The slots were emptied: the next use reads every row again."""
        self.filled = False

    def _prefill(self, chunk_rows: int = 1 << 16) -> None:
        """Direct mapping holds every row: read them all from the tier at once, in chunks,
        instead of paying a tier call per batch for first touches over the whole run. Through
        `Store.read`, which creates nothing: a row reaches the tier only once it is written
        back dirty, so a checkpoint holds the rows trained, not the whole table."""
        store = self.slots
        device, fusion_k = store.device, store.fusion_k
        for idx, spec in self.specs.items():
            base = int(store.row_offset[idx])
            n_rows = spec.num_embeddings
            assert n_rows is not None  # a direct cache's tables are all bounded
            for lo in range(0, n_rows, chunk_rows):
                raw = torch.arange(lo, min(lo + chunk_rows, n_rows))
                slots = (base + raw).to(device)
                rows = self.store.read(spec.name, raw)
                store.transfer.copy_in(store.weights, store.state, slots, rows)
                store.slot_keys[slots] = (raw | (idx << fusion_k)).to(device)
                store.dirty[slots] = False
        self.filled = True

    @profiled("cache.plan")
    def plan(self, ids: torch.Tensor, admitted: torch.Tensor | None) -> Plan:
        """Phase (1) of a resolve: every row in its slot (read on first use), the admitted
        ones locked."""
        if not self.filled:
            self._prefill()
        store = self.slots
        empty = torch.empty(0, dtype=torch.int64, device=store.device)
        if admitted is None:
            # Prefilled (`filled`), every row is in its slot until the cache is emptied
            # (`HotCache.invalidate`, which calls `forget`): no miss to look for, nothing to
            # read on the host.
            if store.ops.rows.one_launch:  # the slots and their locks in one launch
                slots = store.ops.rows.direct_slots(
                    store.row_offset, ids, store.fusion_k, store.locks
                )
            else:
                slots = store.row_index(ids)
                store.rows.add_at(store.locks, slots, 1)
            return Plan(ids, slots, empty, empty, empty, empty)
        slots = store.row_index(ids)
        live_ids, live = ids[admitted], slots[admitted]
        slots = torch.where(admitted, slots, -1)
        miss = store.slot_keys[live] < 0
        load_slots = live[miss]
        plan = Plan(ids, slots, live_ids[miss], load_slots, empty, empty)
        plan.reserved, plan.old_keys = load_slots, store.slot_keys[load_slots].clone()
        plan.old_scores = plan.old_dirty = None
        plan.refused = ids.numel() - live_ids.numel()
        store.slot_keys[load_slots] = plan.load_ids
        store.locks[live] += 1
        return plan

    def bases(self) -> dict[int, int]:
        """The slot of row 0 of each table (by table index) (`HotCache.direct_bases`)."""
        return {idx: int(self.slots.row_offset[idx]) for idx in sorted(self.specs)}

    def serve(self, value_slots: torch.Tensor | None, rows: torch.Tensor | None = None) -> int:
        """`HotCache.serve_direct`, under the cache's locks: load every row on first use and
        count the batch's distinct rows as hits; returns the batch's number."""
        if not self.filled:
            self._prefill()
        self._served += 1
        num_rows = self.slots.weights.shape[0]
        if rows is not None:
            self.stats.hits += rows.numel()
            self._seen_batch = -1
            return self._served
        assert value_slots is not None
        if value_slots.numel() * _VALUES_PER_MAP < num_rows:
            # Few values for the cache's size: passes over the values beat one over a map.
            self.stats.hits += self._distinct(value_slots)
            self._seen_batch = -1
            return self._served
        # A map of the slots this batch touches: its count is the distinct rows, without
        # sorting them, and it marks them dirty after the step in one pass.
        if self._seen is None or self._seen.numel() != num_rows:
            self._seen = torch.zeros(num_rows, dtype=torch.bool, device=self.slots.device)
        else:
            self._seen.zero_()
        self.slots.rows.fill_at(self._seen, value_slots, True)
        self.stats.hits += count_true(self._seen)
        self._seen_batch = self._served
        return self._served

    def _distinct(self, slots: torch.Tensor) -> int:
        """How many distinct values ``slots`` holds, without sorting: each slot records the
        position of one of its occurrences (the last written wins), and exactly one position
        per distinct slot reads itself back."""
        rows, device = self.slots.weights.shape[0], self.slots.device
        if self._stamps is None or self._stamps.numel() != rows:
            self._stamps = torch.zeros(rows, dtype=torch.int32, device=device)
        at = torch.arange(slots.numel(), dtype=torch.int32, device=device)
        put(self._stamps, slots, at)
        return int(torch.eq(self._stamps.index_select(0, slots), at).sum())

    def mark_dirty(
        self, value_slots: torch.Tensor | None, batch: int, rows: torch.Tensor | None = None
    ) -> None:
        """`HotCache.mark_dirty_direct`, under the cache's ``lock``."""
        dirty = self.slots.dirty
        if rows is not None:
            self.slots.rows.fill_at(dirty, rows, True)  # a compiled pass on a CPU
            return
        assert value_slots is not None
        if batch == self._seen_batch != -1 and self._seen is not None:
            or_flags(dirty, self._seen)
        else:
            self.slots.rows.fill_at(dirty, value_slots, True)

    @property
    def seen_batch(self) -> int:
        """The batch the map of `serve` holds (-1: none), which `mark_dirty` reuses."""
        return self._seen_batch
