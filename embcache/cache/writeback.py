"""The tier side of a `HotCache`: phase (2) of a resolve (a plan's victims written to the tier,
its misses read into their slots), the victims' writes a resolve left staged, and dirty rows
written back (a flush, a scratch row's release).

`WriteBack` moves rows between the cache's `storage.SlotStore` and its tier through the cache's
`transfer.TierTransfer` (tier I/O on host tensors), and owns the writes left staged. Every tier
call may raise and leaves the slots as they were.
"""

from __future__ import annotations

import torch

from embcache.cache.lockstep import Step, ToHost
from embcache.cache.plan import Plan
from embcache.cache.stats import CacheStats
from embcache.cache.storage import SlotStore
from embcache.cache.transfer import Staged, TierTransfer, take
from embcache.indexing import true_at


class WriteBack:
    """Rows between a cache's slots and its tier.

    Args:
        slots: the cache's slot store.
        transfer: the cache's tier I/O.
        stats: the cache's counters (write-backs are counted here).
        pins: the tier bounds a table: what the cache holds is pinned there.

    Attributes:
        deferred: victims' rows a resolve with ``defer_writeback`` copied out and left to
            write (`write_deferred`), in order.
    """

    def __init__(
        self, slots: SlotStore, transfer: TierTransfer, stats: CacheStats, pins: bool
    ) -> None:
        self.slots = slots
        self.transfer = transfer
        self.stats = stats
        self.pins = pins
        self.deferred: list[Staged] = []

    def exchange_steps(self, plan: Plan, defer_writeback: bool, create: bool = True) -> Step:
        """Phase (2) of a resolve, as a `lockstep` step: the victims written to the tier (or
        staged, ``defer_writeback``) and the misses read into their slots (created in the
        tier when missing there, unless not ``create``). A tier error leaves the slots as
        they were (the plan can be rolled back)."""
        n_write, n_read = plan.victim_ids.numel(), plan.load_ids.numel()
        if not (n_write or n_read):
            plan.exchanged = True
            return
        # One copy of all the ids the tier needs (with every other cache's of a group).
        wanted = [plan.victim_ids, plan.load_ids]
        if plan.released is not None:
            wanted.append(plan.released)
        host = yield ToHost(wanted)
        write_ids, read_ids = host[0], host[1]
        released = host[2] if plan.released is not None else None
        slots, transfer = self.slots, self.transfer

        def victim_rows(positions: torch.Tensor | slice) -> torch.Tensor:
            return slots.host_rows(take(plan.victim_slots, positions))

        staged = None
        if n_write and defer_writeback and transfer.grouped and not self.pins:
            staged = transfer.stage(write_ids, victim_rows)
            write_ids = write_ids[:0]
        loaded = transfer.exchange(
            write_ids, victim_rows, read_ids, released,
            slots.slot_storage(plan.victim_slots, plan.load_slots), create,
        )  # fmt: skip
        transfer.place(slots.weights, slots.state, plan.load_slots, loaded)
        if staged is not None:
            self.deferred.append(staged)
        plan.exchanged = True

    def write_deferred(self) -> None:
        """Make the staged writes, in order (`HotCache.write_deferred`, which serialises it
        with resolves). A tier error leaves the rows not yet written staged."""
        while self.deferred:
            self.transfer.write_staged(self.deferred[0])
            del self.deferred[0]

    def write(self, fused: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the rows held at ``slots`` back to the tier under their ``fused`` ids (one
        copy of the ids and one of the rows to the host)."""
        self.write_host(fused.cpu(), slots)

    def write_host(self, host: torch.Tensor, slots: torch.Tensor) -> None:
        """`write` of ids already on the host."""
        store = self.slots
        self.transfer.exchange(
            host, lambda positions: store.host_rows(take(slots, positions)), host[:0],
            slots=store.slot_storage(slots, None),
        )  # fmt: skip
        self.stats.writebacks += host.numel()

    def flush(self) -> None:
        """Write every dirty row back (rows stay cached, now clean)."""
        store = self.slots
        dirty = true_at(store.dirty)
        if dirty.numel():
            self.write(store.slot_keys[dirty], dirty)
            store.dirty[dirty] = False
