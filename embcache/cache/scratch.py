"""The scratch area behind a `HotCache`'s slots: rows ``num_slots`` and up of its storage,
holding the misses of a batch that found no free way in their set. It grows when a batch
needs more (up to `CacheConfig.max_scratch_rows`, contents kept) and its rows are written back
(when dirty) and freed by the first `HotCache.release` after their last lock is dropped and a
later batch was resolved.

`ScratchArea` counts the rows in use; the rows themselves are the slot store's
(`storage.SlotStore.grow`). The cache's planner (`plan.SetPlanner`) holds it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from embcache.cache.lockstep import Step, ToHost, first_true
from embcache.cache.stats import CacheStats
from embcache.cache.storage import SlotStore
from embcache.cache.transfer import unpadded

_INT64_MAX = torch.iinfo(torch.int64).max


class CacheCapacityError(ValueError):
    """A batch's rows cannot all be held by the cache plus its scratch area."""


class ScratchArea:
    """The scratch rows of a cache.

    Args:
        slots: the cache's slot store, whose rows past ``num_slots`` are the area.
        max_rows: the most rows it may grow to (`CacheConfig.max_scratch_rows`).
        write_rows: writes the rows at some slots to the tier under ids on the host
            (`storage.WriteBack.write_host`), for the dirty rows a release frees.
        pins: the tier bounds a table: a freed row is unpinned there.
        stats: the cache's counters (a freed row is an eviction).

    Attributes:
        used: scratch rows holding a row.
    """

    def __init__(
        self,
        slots: SlotStore,
        max_rows: int,
        write_rows: Callable[[torch.Tensor, torch.Tensor], None],
        pins: bool,
        stats: CacheStats,
    ) -> None:
        self.slots = slots
        self.max_rows = max_rows
        self.write_rows = write_rows
        self.pins = pins
        self.stats = stats
        self.used = 0

    def grow(self, needed_free: int) -> None:
        """Make at least ``needed_free`` scratch rows free, growing the area (kept contents)."""
        store = self.slots
        rows, used = store.scratch_rows, self.used
        if rows - used >= needed_free:
            return
        want = min(max(2 * rows, used + needed_free), self.max_rows)
        if want - used < needed_free:
            raise CacheCapacityError(
                f"cache (dim {store.dim}) cannot hold this batch: {needed_free} rows found no "
                f"free way and the scratch area is limited to {self.max_rows} "
                f"rows ({used} in use); set CacheConfig(max_scratch_rows>={used + needed_free}) "
                f"or a capacity of at least the batch's unique rows (cache has "
                f"{store.num_slots} slots)"
            )
        store.grow(want - rows)

    def find(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Fill ``slots`` (in place) for the ids held in the scratch area."""
        num_slots = self.slots.num_slots
        scratch_keys = self.slots.slot_keys[num_slots:]
        sorted_keys, perm = torch.sort(
            torch.where(scratch_keys >= 0, scratch_keys, torch.full_like(scratch_keys, _INT64_MAX))
        )
        pos = torch.searchsorted(sorted_keys, ids).clamp(max=sorted_keys.numel() - 1)
        found = (sorted_keys[pos] == ids) & (slots < 0)
        # torch.where, not a boolean-mask assignment: no host synchronisation.
        slots.copy_(torch.where(found, num_slots + perm[pos], slots))

    def _release_read(self, batch_seq: int) -> Step:
        """`release_steps` in torch ops (the device path and the torch twins): one host read,
        a copy of the two counts and of every scratch row's key where that row is done and
        dirty (-1 elsewhere; where done, too, when rows are pinned), the scratch area being
        small and its size known, so the numbers and the ids to write come together."""
        store = self.slots
        num_slots = store.num_slots
        scratch = slice(num_slots, None)
        keys = store.slot_keys[scratch]
        done = (keys >= 0) & (store.locks[scratch] == 0)
        done &= store.batch_of[scratch] != batch_seq  # guarded until the next batch
        done_dirty = done & store.dirty[scratch]
        counts = torch.stack([done.sum(), done_dirty.sum()])
        wanted = [torch.cat([counts, torch.where(done_dirty, keys, -1)])]
        if self.pins:
            wanted.append(torch.cat([counts, torch.where(done, keys, -1)]))
        host = yield ToHost(wanted)
        (n_done, n_dirty), dirty_keys = unpadded(host[0])
        if not n_done:
            return
        done_slots = num_slots + first_true(done, n_done, store.numpy_reads)
        if n_dirty:  # in slot order, as `first_true` gives the slots
            self.write_rows(
                dirty_keys, num_slots + first_true(done_dirty, n_dirty, store.numpy_reads)
            )
        if self.pins:
            store.transfer.unpin(unpadded(host[1])[1])
        store.unindex(store.slot_keys.index_select(0, done_slots))
        store.rows.fill_at(store.slot_keys, done_slots, -1)
        store.rows.fill_at(store.dirty, done_slots, False)
        self.used -= n_done
        self.stats.evictions += n_done

    def release_steps(self, batch_seq: int) -> Step:
        """Write back and free the scratch rows no batch holds any more, those of batch
        ``batch_seq`` (the last locked one) excepted, as a `lockstep` step under the cache's
        ``lock``: one host read (`_release_read`; on the compiled CPU path, the ids of the
        rows to write or unpin, when there are any). A failed write leaves the rows in
        scratch, dirty."""
        if not self.used:
            return
        store = self.slots
        if store.where is None or not store.ops.plan.compiled:
            yield from self._release_read(batch_seq)
            return
        # The same rows and writes, in two compiled passes.
        done_slots, dirty, dirty_keys = map(torch.from_numpy, store.ops.plan.scratch_done(
            store.slot_keys.numpy(), store.locks.numpy(), store.batch_of.numpy(),
            store.dirty.numpy(), store.num_slots, batch_seq,
        ))  # fmt: skip
        if not done_slots.numel():
            return
        if dirty.numel() or self.pins:
            wanted = [dirty_keys]
            if self.pins:
                wanted.append(store.slot_keys.index_select(0, done_slots))
            host = yield ToHost(wanted)
            if dirty.numel():
                self.write_rows(host[0], dirty)
            if self.pins:
                store.transfer.unpin(host[1])
        store.ops.plan.free_slots(
            done_slots.numpy(), store.slot_keys.numpy(), store.dirty.numpy(),
            store.where.numpy(), store.row_offset.numpy(), store.fusion_k,
        )  # fmt: skip
        self.used -= done_slots.numel()
        self.stats.evictions += done_slots.numel()
