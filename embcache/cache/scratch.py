"""The scratch area behind a `HotCache`'s slots: rows ``num_slots`` and up of its storage,
holding the misses of a batch that found no free way in their set. It grows when a batch
needs more (up to `CacheConfig.max_scratch_rows`, contents kept) and its rows are written back
(when dirty) and freed by the first `release` after their last lock is dropped and a later
batch was resolved.

`ScratchArea` is a part of `HotCache` (its base class, as `snapshot.PolicyState` is).
"""

from __future__ import annotations

import torch

import embcache.native as native
from embcache.cache.fields import CacheFields
from embcache.cache.lockstep import Counts, Step, ToHost, first_true, run_together
from embcache.indexing import fill_at
from embcache.profiling import profiled

_INT64_MAX = torch.iinfo(torch.int64).max


class CacheCapacityError(ValueError):
    """A batch's rows cannot all be held by the cache plus its scratch area."""


class ScratchArea(CacheFields):
    """`HotCache`'s scratch area: its methods read and set the cache's own slots, so they run
    on a `HotCache` only."""

    def _grow_scratch(self, needed_free: int) -> None:
        """Make at least ``needed_free`` scratch rows free, growing the area (kept contents)."""
        free = self.scratch_rows - self._scratch_used
        if free >= needed_free:
            return
        want = max(2 * self.scratch_rows, self._scratch_used + needed_free)
        want = min(want, self.config.max_scratch_rows)
        if want - self._scratch_used < needed_free:
            need = self._scratch_used + needed_free
            raise CacheCapacityError(
                f"cache (dim {self.dim}) cannot hold this batch: {needed_free} rows found no "
                f"free way and the scratch area is limited to {self.config.max_scratch_rows} "
                f"rows ({self._scratch_used} in use); set CacheConfig(max_scratch_rows>={need}) "
                f"or a capacity of at least the batch's unique rows (cache has "
                f"{self.num_slots} slots)"
            )
        grow = want - self.scratch_rows
        dev = self.device
        zeros = torch.zeros(grow, self.dim, dtype=self.dtype, device=dev)
        with self.storage_lock:  # no TBE update writes the old storage while it is copied
            self.weights = torch.cat([self.weights, zeros])
            self.state = torch.cat([self.state, torch.zeros(grow, self.state_dim, device=dev)])
        self.slot_keys = torch.cat(
            [self.slot_keys, torch.full((grow,), -1, dtype=torch.int64, device=dev)]
        )
        self.locks = torch.cat([self.locks, torch.zeros(grow, dtype=torch.int32, device=dev)])
        self.dirty = torch.cat([self.dirty, torch.zeros(grow, dtype=torch.bool, device=dev)])
        self.batch_of = torch.cat(
            [self.batch_of, torch.full((grow,), -1, dtype=torch.int64, device=dev)]
        )

    def _find_in_scratch(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Fill ``slots`` (in place) for the ids held in the scratch area."""
        scratch_keys = self.slot_keys[self.num_slots :]
        sorted_keys, perm = torch.sort(
            torch.where(scratch_keys >= 0, scratch_keys, torch.full_like(scratch_keys, _INT64_MAX))
        )
        pos = torch.searchsorted(sorted_keys, ids).clamp(max=sorted_keys.numel() - 1)
        found = (sorted_keys[pos] == ids) & (slots < 0)
        # torch.where, not a boolean-mask assignment: no host synchronisation.
        slots.copy_(torch.where(found, self.num_slots + perm[pos], slots))

    @profiled("cache.release_scratch")
    def release(self) -> None:
        """Write back and free the scratch rows no batch holds any more (those of the last
        locked batch are kept until the next one). If the write fails the rows stay in
        scratch, dirty, and the error propagates: call again later."""
        with self.lock:
            run_together([self._release_steps()])

    def _release_steps(self) -> Step:
        """`release` as a `lockstep` step, under ``lock``: its host reads (how many scratch
        rows are done and dirty, then their ids) asked once each."""
        if not self._scratch_used:
            return
        compiled = self._where is not None and self.backend.compiled
        if compiled:  # the same rows and writes, in two compiled passes
            done_slots, dirty, dirty_keys = map(torch.from_numpy, native.scratch_done(
                self.slot_keys.numpy(), self.locks.numpy(), self.batch_of.numpy(),
                self.dirty.numpy(), self.num_slots, self._batch_seq,
            ))  # fmt: skip
        else:
            scratch = slice(self.num_slots, None)
            done = (self.slot_keys[scratch] >= 0) & (self.locks[scratch] == 0)
            done &= self.batch_of[scratch] != self._batch_seq  # guarded until the next batch
            done_dirty = done & self.dirty[scratch]
            n_done, n_dirty = yield Counts([done.sum(), done_dirty.sum()])
            done_slots = self.num_slots + first_true(done, n_done)
            dirty = self.num_slots + first_true(done_dirty, n_dirty)
            dirty_keys = self.slot_keys.index_select(0, dirty)
        if not done_slots.numel():
            return
        done_keys = None if compiled and not self.pins else (
            self.slot_keys.index_select(0, done_slots))  # fmt: skip
        if dirty.numel() or self.pins:
            wanted = [dirty_keys]
            if self.pins:
                assert done_keys is not None  # read whenever rows are pinned
                wanted.append(done_keys)
            host = yield ToHost(wanted)
            if dirty.numel():
                self._write_host(host[0], dirty)
            if self.pins:
                self.transfer.unpin(host[1])
        if compiled:
            assert self._where is not None
            native.free_slots(
                done_slots.numpy(), self.slot_keys.numpy(), self.dirty.numpy(),
                self._where.numpy(), self._row_offset.numpy(), self.fusion_k,
            )  # fmt: skip
        else:
            assert done_keys is not None  # read off the compiled path
            self._unindex(done_keys)
            fill_at(self.slot_keys, done_slots, -1)
            fill_at(self.dirty, done_slots, False)
        self._scratch_used -= done_slots.numel()
        self.evictions += done_slots.numel()
