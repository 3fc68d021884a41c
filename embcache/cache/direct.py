"""Direct mapping: a cache whose capacity covers every row of its tables gives each row its
own slot (``row_offset[table] + raw id``): no lookup, no eviction, no scratch.

`DirectMapping` is a part of `HotCache` (its base class, as `snapshot.PolicyState` is): the
direct cache's plan (every row read from the tier once, on first use) and `serve_direct`, the
TBE step's way of serving a batch without a resolve (it reads rows by table and raw id),
counting the same hits.
"""

from __future__ import annotations

import torch

from embcache.cache.fields import CacheFields
from embcache.cache.plan import Plan
from embcache.indexing import add_at, count_true, fill_at, or_flags, put
from embcache.profiling import profiled

# `serve_direct` maps a batch's slots in a bool array over the cache when it has at least one
# value per this many rows; fewer values are counted by passes over the values alone.
_VALUES_PER_MAP = 8


class DirectMapping(CacheFields):
    """`HotCache`'s direct mapping: its methods read and set the cache's own slots and stats,
    so they run on a `HotCache` only."""

    def _prefill_direct(self, chunk_rows: int = 1 << 16) -> None:
        """Direct mapping holds every row: read them all from the tier at once, in chunks,
        instead of paying a tier call per batch for first touches over the whole run. Through
        `Store.read`, which creates nothing: a row reaches the tier only once it is written
        back dirty, so a checkpoint holds the rows trained, not the whole table."""
        for idx, spec in self._specs.items():
            base = int(self._row_offset[idx])
            n_rows = spec.num_embeddings
            assert n_rows is not None  # a direct cache's tables are all bounded
            for lo in range(0, n_rows, chunk_rows):
                raw = torch.arange(lo, min(lo + chunk_rows, n_rows))
                slots = (base + raw).to(self.device)
                rows = self.store.read(spec.name, raw)
                self.transfer.copy_in(self.weights, self.state, slots, rows)
                self.slot_keys[slots] = (raw | (idx << self.fusion_k)).to(self.device)
                self.dirty[slots] = False
        self._filled = True

    @profiled("cache.plan")
    def _plan_direct(self, ids: torch.Tensor, admitted: torch.Tensor | None) -> Plan:
        if not self._filled:
            self._prefill_direct()
        slots = self.row_index(ids)
        if admitted is None:
            # Prefilled (`_filled`), every row is in its slot until the cache is emptied
            # (`invalidate`, which clears `_filled`): no miss to look for, nothing to read on
            # the host.
            add_at(self.locks, slots, 1)
            empty = self._empty_ids()
            return Plan(ids, slots, empty, empty, empty, empty)
        live_ids, live = ids[admitted], slots[admitted]
        slots = torch.where(admitted, slots, -1)
        miss = self.slot_keys[live] < 0
        load_slots = live[miss]
        plan = Plan(ids, slots, live_ids[miss], load_slots, self._empty_ids(), self._empty_ids())
        plan.reserved, plan.old_keys = load_slots, self.slot_keys[load_slots].clone()
        plan.old_scores = plan.old_dirty = None
        plan.refused = ids.numel() - live_ids.numel()
        self.slot_keys[load_slots] = plan.load_ids
        self.locks[live] += 1
        return plan

    def direct_bases(self) -> dict[int, int]:
        """Direct mapping: the slot of row 0 of each table (by table index); its rows follow
        in order, and the tables lie in the slots in ascending table index."""
        if not self.direct:
            raise RuntimeError("direct_bases: this cache does not map rows directly")
        return {idx: int(self._row_offset[idx]) for idx in sorted(self._specs)}

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
                compiled pass, `native.direct.DistinctRows`); else they are counted here.

        Returns:
            the batch's number, for `mark_dirty_direct` (which marks the same rows faster
            while no other batch was served since).
        """
        if not self.direct:
            raise RuntimeError("serve_direct: this cache does not map rows directly")
        with self._resolve_mutex, self.lock:
            if not self._filled:
                self._prefill_direct()
            self._served += 1
            num_rows = self.weights.shape[0]
            if rows is not None:
                self.hits += rows.numel()
                self._seen_batch = -1
                return self._served
            assert value_slots is not None
            if value_slots.numel() * _VALUES_PER_MAP < num_rows:
                # Few values for the cache's size: passes over the values beat one over a map.
                self.hits += self._distinct(value_slots)
                self._seen_batch = -1
                return self._served
            # A map of the slots this batch touches: its count is the distinct rows, without
            # sorting them, and it marks them dirty after the step in one pass.
            if self._seen is None or self._seen.numel() != num_rows:
                self._seen = torch.zeros(num_rows, dtype=torch.bool, device=self.device)
            else:
                self._seen.zero_()
            fill_at(self._seen, value_slots, True)
            self.hits += count_true(self._seen)
            self._seen_batch = self._served
            return self._served

    def _distinct(self, slots: torch.Tensor) -> int:
        """How many distinct values ``slots`` holds, without sorting: each slot records the
        position of one of its occurrences (the last written wins), and exactly one position
        per distinct slot reads itself back."""
        rows = self.weights.shape[0]
        if self._stamps is None or self._stamps.numel() != rows:
            self._stamps = torch.zeros(rows, dtype=torch.int32, device=self.device)
        at = torch.arange(slots.numel(), dtype=torch.int32, device=self.device)
        put(self._stamps, slots, at)
        return int(torch.eq(self._stamps.index_select(0, slots), at).sum())

    def mark_dirty_direct(
        self, value_slots: torch.Tensor | None, batch: int, rows: torch.Tensor | None = None
    ) -> None:
        """`mark_dirty` for the rows of a batch that `serve_direct` numbered ``batch``
        (``value_slots`` and ``rows`` as given to it)."""
        with self.lock:
            if rows is not None:
                fill_at(self.dirty, rows, True)  # a compiled pass on a CPU (`indexing`)
                return
            assert value_slots is not None
            if batch == self._seen_batch != -1 and self._seen is not None:
                or_flags(self.dirty, self._seen)
            else:
                fill_at(self.dirty, value_slots, True)
