"""The slot store of a `HotCache`: ``weights`` (the tables' dtype) and ``state`` (float32) row
by row, the per-slot arrays beside them (``slot_keys``, ``locks``, ``dirty``, ``scores``,
``batch_of``), the row index of a CPU cache (``where``: the slot of every row of its bounded
tables), the slot locks and dirty flags a batch's step changes, and the rows of slots in the
tier's layout.

`SlotStore` owns those arrays and replaces them together (`allocate`, `grow`, when the scratch
area grows); the cache's other parts (`plan.SetPlanner`, `scratch.ScratchArea`,
`direct.DirectMap`, `WriteBack`) hold the store and read its arrays through it, so they always
see the current ones.

Below the store, in the order a step meets them:

* the locks of several caches at once (`lock_floors`, `check_floors`, `unlock_together`): a
  batch in flight holds one lock on each of its slots, and a locked slot is never a victim.
  Unlocking never calls the tier, so an optimizer step that has updated rows cannot fail
  half-way through releasing them; the rows it changed are marked dirty then;
* `WriteBack`, the store's rows to and from its tier: phase (2) of a resolve (a `Plan`'s victims
  written, its misses read into their slots), the victims' writes a resolve left staged, and
  dirty rows written back (a flush, a scratch row's release). It moves rows through the
  cache's `transfer.TierTransfer` (tier I/O on host tensors); every tier call may raise and
  leaves the slots as they were.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Protocol

import torch

from embcache.backend import Backend
from embcache.cache.lockstep import Step, ToHost, first_true
from embcache.cache.stats import CacheStats
from embcache.cache.transfer import SlotStorage, Staged, TierTransfer, take
from embcache.hostmem import host_zeros
from embcache.indexing import put, true_at
from embcache.ops.ids.row_map import row_index
from embcache.ops.registry import bind
from embcache.ops.rows import SlotTable


class SlotStore:
    """A cache's slots: their rows, keys, locks, dirty flags, scores and row index.

    Args:
        dim: weights of a row.
        dtype: the weights' dtype (the state is float32).
        state_dim: optimizer state values of a row (`set_state_dim` changes it).
        num_slots: slots of the cache proper (scratch rows follow them).
        index_rows: rows of the row index (``where``), 0 for none.
        row_offset: int64 ``[max table index + 1]`` on the device, the first row of each
            table among the bounded tables' rows (-1: unbounded).
        fusion_k: bits of the raw id inside a fused id.
        device: where the slots live.
        backend: the cache's implementation family (`embcache.backend`).
        transfer: the cache's `TierTransfer`, whose table layout (`TierTransfer.spec`) packs
            the rows of slots.
        admits_all: no admission: no slot is ever -1.
        stats: the cache's counters (gradients dropped are counted here).

    Attributes:
        weights: ``[num_slots + scratch_rows, dim]`` of ``dtype``, and
        state: float32 ``[num_slots + scratch_rows, state_dim]``: the rows. Replaced (with the
            arrays below) when the scratch area grows, under ``storage_lock``.
        slot_keys: int64 fused id held by each slot, -1 for none.
        locks: int32 locks held on each slot by batches in flight.
        dirty: bool, the slot's row differs from the tier's.
        scores: int64 ``[num_slots]`` the eviction policy's score of each way.
        batch_of: int64 the last locked batch that used each slot.
        where: int32 slot of each row of the tables while held (scratch included), else -1;
            None without a row index.
        lock: guards the index (keys, locks, dirty flags, scores) and every part's state.
        storage_lock: held while the storage is replaced, and by whoever reads or writes rows
            through a view of it that must stay the storage. Taken after ``lock``.
    """

    weights: torch.Tensor
    state: torch.Tensor
    slot_keys: torch.Tensor
    locks: torch.Tensor
    dirty: torch.Tensor
    scores: torch.Tensor
    batch_of: torch.Tensor
    where: torch.Tensor | None

    def __init__(
        self,
        dim: int,
        dtype: torch.dtype,
        state_dim: int,
        num_slots: int,
        index_rows: int,
        row_offset: torch.Tensor,
        fusion_k: int,
        device: torch.device,
        backend: Backend,
        transfer: TierTransfer,
        admits_all: bool,
        stats: CacheStats,
    ) -> None:
        self.dim, self.dtype, self.state_dim = dim, dtype, state_dim
        self.num_slots = num_slots
        self.index_rows = index_rows
        self.row_offset = row_offset
        self.fusion_k = fusion_k
        self.device = device
        self.backend = backend
        # The op families' implementations, bound once for the cache (`embcache.ops`).
        self.ops = bind(backend)
        self.rows = self.ops.rows  # the writes at positions, the unlock
        # Mask positions found through numpy (`lockstep.first_true`): a CPU cache on the
        # compiled passes, where a host read is no synchronisation.
        self.numpy_reads = device.type == "cpu" and self.rows.compiled
        self.transfer = transfer
        self.admits_all = admits_all
        self.stats = stats
        self.lock = threading.RLock()
        self.storage_lock = threading.RLock()
        self.allocate(scratch_rows=0)

    @property
    def width(self) -> int:
        """Values of a row as float32: ``dim + state_dim`` (weights, then state)."""
        return self.dim + self.state_dim

    @property
    def scratch_rows(self) -> int:
        """Rows currently allocated to the scratch area."""
        return self.weights.shape[0] - self.num_slots

    def row_index(self, keys: torch.Tensor) -> torch.Tensor:
        """Row of each fused key of a bounded table among all the cache's tables' rows (in
        ascending table index): under direct mapping, its slot."""
        return row_index(self.row_offset, keys, self.fusion_k)

    def allocate(self, scratch_rows: int) -> None:
        """New, empty storage and arrays: ``num_slots`` slots and ``scratch_rows`` more."""
        total = self.num_slots + scratch_rows
        device = self.device
        if device.type == "cpu":  # rows read at random: huge pages spare the TLB
            weights = host_zeros((total, self.dim), self.dtype)
            state = host_zeros((total, self.state_dim), torch.float32)
        else:
            weights = torch.zeros(total, self.dim, dtype=self.dtype, device=device)
            state = torch.zeros(total, self.state_dim, device=device)
        with self.storage_lock:
            self.weights, self.state = weights, state
        self.slot_keys = torch.full((total,), -1, dtype=torch.int64, device=device)
        self.locks = torch.zeros(total, dtype=torch.int32, device=device)
        self.dirty = torch.zeros(total, dtype=torch.bool, device=device)
        self.scores = torch.full((self.num_slots,), -1, dtype=torch.int64, device=device)
        self.batch_of = torch.full((total,), -1, dtype=torch.int64, device=device)
        self.where = (
            host_zeros((self.index_rows,), torch.int32).fill_(-1) if self.index_rows else None
        )

    def grow(self, rows: int) -> None:
        """Add ``rows`` empty scratch rows behind the storage, keeping its contents."""
        dev = self.device
        zeros = torch.zeros(rows, self.dim, dtype=self.dtype, device=dev)
        with self.storage_lock:  # no TBE update writes the old storage while it is copied
            self.weights = torch.cat([self.weights, zeros])
            self.state = torch.cat([self.state, torch.zeros(rows, self.state_dim, device=dev)])
        self.slot_keys = torch.cat(
            [self.slot_keys, torch.full((rows,), -1, dtype=torch.int64, device=dev)]
        )
        self.locks = torch.cat([self.locks, torch.zeros(rows, dtype=torch.int32, device=dev)])
        self.dirty = torch.cat([self.dirty, torch.zeros(rows, dtype=torch.bool, device=dev)])
        self.batch_of = torch.cat(
            [self.batch_of, torch.full((rows,), -1, dtype=torch.int64, device=dev)]
        )

    def clear(self) -> None:
        """Forget every row held (keys, row index, scores, batches); the storage stays."""
        self.slot_keys.fill_(-1)
        if self.where is not None:
            self.where.fill_(-1)
        self.scores.fill_(-1)
        self.batch_of.fill_(-1)

    # ------------------------------------------------------------------------------------------
    # rows

    def rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The stored tier rows (`TableSpec.pack`: weights, then state) held at ``slots``."""
        # index_select copies whole rows (advanced indexing goes element by element on a CPU).
        spec = self.transfer.spec
        weights, state = self.weights, self.state
        if spec.dtype == weights.dtype == torch.float32:
            # Stored rows are the weights then the float32 state: gathered into their columns
            # directly, without gathering each apart and copying both again.
            rows = torch.empty(slots.numel(), spec.stored_width, device=self.device)
            self.rows.gather_join(weights, state, slots, rows)  # one compiled pass on a CPU
            return rows
        return spec.pack(weights.index_select(0, slots), state.index_select(0, slots))

    def host_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """`rows_of` on the host (one copy from a device; none on a CPU)."""
        rows = self.rows_of(slots)
        return rows if rows.device.type == "cpu" else rows.cpu()

    def slot_storage(
        self, write_slots: torch.Tensor | None, read_slots: torch.Tensor | None
    ) -> SlotStorage | None:
        """On a CPU, the storage and the slots of a tier exchange's rows, for the tier to move
        them straight between its tables and the slots (`TierTransfer.exchange`)."""
        if self.device.type != "cpu":
            return None
        return SlotStorage(self.weights, self.state, write_slots, read_slots)

    # ------------------------------------------------------------------------------------------
    # the row index

    def index(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Record that ``keys`` (resident, distinct) are held at ``slots``."""
        if self.where is not None and keys.numel():
            put(self.where, self.row_index(keys), slots)

    def unindex(self, keys: torch.Tensor) -> None:
        """Record that ``keys`` (resident, distinct) left their slots."""
        if self.where is not None and keys.numel():
            self.rows.fill_at(self.where, self.row_index(keys), -1)

    def reindex(self) -> None:
        """Rebuild ``where`` from ``slot_keys`` (after a restore or a rollback)."""
        if self.where is not None:
            self.where.fill_(-1)
            held = true_at(self.slot_keys >= 0)
            self.index(self.slot_keys.index_select(0, held), held)

    # ------------------------------------------------------------------------------------------
    # locks and dirty flags (a batch in flight holds one lock on each of its slots)

    def live(self, slots: torch.Tensor, n_live: int | None = None) -> torch.Tensor:
        """``slots`` without the -1 of ids not admitted (no copy when there is no admission);
        ``n_live``: how many are not -1, when known (no host read then)."""
        if self.admits_all:
            return slots
        if n_live is None:
            return slots[slots >= 0]
        return slots.index_select(0, first_true(slots >= 0, n_live, self.numpy_reads))

    def hold(self, slots: torch.Tensor) -> None:
        """Lock ``slots`` (distinct, resident) once each (`HotCache.hold`)."""
        with self.lock:
            self.rows.add_at(self.locks, slots, 1)

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """Record that the rows at ``slots`` were changed in place (`HotCache.mark_dirty`)."""
        with self.lock:
            slots = slots.to(self.device)
            if not self.admits_all:
                live = self.live(slots)
                self.stats.gradients_dropped += slots.numel() - live.numel()
                slots = live
            self.rows.fill_at(self.dirty, slots, True)

    def unlock_checked(self, given: torch.Tensor, slots: torch.Tensor, dirty: bool) -> None:
        """`HotCache.unlock` of ``slots`` (``given`` without the -1 of ids not admitted), under
        ``lock``, once a device check found every one locked (`unlock_together`); the
        compiled passes check here themselves."""
        # The backend's pass (compiled: it checks every lock first, raising RuntimeError).
        self.rows.unlock_slots(self.locks, slots, self.dirty if dirty else None)
        if dirty:
            self.stats.gradients_dropped += given.numel() - slots.numel()


# ----------------------------------------------------------------------------------------------
# the locks of several caches at once
# ----------------------------------------------------------------------------------------------


class HoldsSlots(Protocol):
    """What the functions here need of a cache (a `HotCache`): its slot store."""

    @property
    def slot_store(self) -> SlotStore: ...


UNLOCKED = "HotCache.unlock: a slot that is not locked was unlocked"


@dataclass
class Floors:
    """`lock_floors`' answer: the lowest lock among each cache's slots (0-d device tensors,
    to read with the caller's own host read, then `check_floors`), and what `unlock_together`
    then drops without reading anything: each cache's live slots (``slots`` without the -1
    of ids not admitted), or on the device path one `ops.rows.SlotTable` of every
    cache's slots (``live`` None: the kernels skip the -1 themselves)."""

    values: list[torch.Tensor]
    live: list[torch.Tensor] | None
    table: SlotTable | None = None


def lock_floors(pairs: Sequence[tuple[HoldsSlots, torch.Tensor]]) -> Floors:
    """What `unlock_together` checks before it drops any lock, made on the device and not
    read: the lowest lock among each cache's slots (none for a cache on the compiled CPU path,
    which checks in its own pass). On the device path (every cache's rows family runs one
    launch for all: `RowsOps.one_launch`) one launch finds every cache's floor
    (`RowsOps.lock_floors`), and the same table serves `unlock_together`'s one launch."""
    stores = [cache.slot_store for cache, _ in pairs]
    with ExitStack() as held:
        for store in stores:
            held.enter_context(store.lock)
        table = _device_table(stores, [given for _, given in pairs])
        if table is not None:
            floors = stores[0].ops.rows.lock_floors(table)
            return Floors([floors[s] for s in range(len(stores))], None, table)
        live, values = [], []
        for store, (_, given) in zip(stores, pairs, strict=True):
            slots = store.live(given.to(store.device))
            live.append(slots)
            if slots.numel() and not store.rows.unlocks_checked(slots):
                values.append(store.locks.index_select(0, slots).min())
    return Floors(values, live)


def _device_table(stores: Sequence[SlotStore], slots: Sequence[torch.Tensor]) -> SlotTable | None:
    """The caches' `SlotTable` where every one is on the device path (its bound rows family
    runs one launch for all, `RowsOps.one_launch`) on one device, else None."""
    if not stores or not all(store.ops.rows.one_launch for store in stores):
        return None
    if len({store.device for store in stores}) != 1:
        return None
    return SlotTable.of(
        [
            (given.to(store.device), store.locks, store.dirty)
            for store, given in zip(stores, slots, strict=True)
        ]
    )


def check_floors(values: Sequence[float]) -> None:
    """Raise unless every floor of `lock_floors`, read as ``values``, is a held lock.

    Raises:
        RuntimeError: a slot is not locked.
    """
    if any(v <= 0 for v in values):
        raise RuntimeError(UNLOCKED)


def unlock_together(
    pairs: Sequence[tuple[HoldsSlots, torch.Tensor]],
    dirty: bool = False,
    floors: Floors | None = None,
) -> None:
    """`HotCache.unlock` of each ``(cache, slots)``, every cache's locks checked before any
    is dropped: the device checks of all the caches (the lowest lock among each one's slots)
    are read on the host at once, so a step makes one read however many caches it updates.
    ``floors``: `lock_floors` of the same pairs, which the caller read and found held
    (`check_floors`): nothing is read here then. With its device table (the device path),
    one launch drops every cache's locks (and marks the rows dirty with ``dirty``, where
    every cache admits all ids: else each cache marks its own, counting the updates it
    dropped).

    Raises:
        RuntimeError: a slot is not locked; no lock was dropped then (a cache on the compiled
            CPU path checks its own in its pass, before it drops any of its own).
    """
    stores = [cache.slot_store for cache, _ in pairs]
    with ExitStack() as held:
        for store in stores:
            held.enter_context(store.lock)
        if floors is not None and floors.table is not None:
            if dirty and not all(store.admits_all for store in stores):
                for store, (_, given) in zip(stores, pairs, strict=True):
                    store.mark_dirty(given)
                dirty = False
            stores[0].ops.rows.unlock(floors.table, dirty)  # every store's: `_device_table`
            return
        todo = []
        mins_by_device: dict[torch.device, list[torch.Tensor]] = {}
        for k, (store, (_, given)) in enumerate(zip(stores, pairs, strict=True)):
            given = given.to(store.device)
            if floors is not None:
                assert floors.live is not None  # no table: the live slots
                todo.append((store, given, floors.live[k]))
                continue
            slots = store.live(given)
            todo.append((store, given, slots))
            if slots.numel() and not store.rows.unlocks_checked(slots):
                mins = mins_by_device.setdefault(store.device, [])
                mins.append(store.locks.index_select(0, slots).min())
        for mins in mins_by_device.values():
            if int(torch.stack(mins).min()) <= 0:
                raise RuntimeError(UNLOCKED)
        for store, given, slots in todo:
            store.unlock_checked(given, slots, dirty)


# ----------------------------------------------------------------------------------------------
# rows between the slots and the tier
# ----------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What phase 1 of a resolve decided, for the tier transfer and the commit (or rollback)."""

    ids: torch.Tensor  # int64 [n] the batch's ids
    slots: torch.Tensor  # int64 [n] their slots
    load_ids: torch.Tensor  # ids to read from the tier ...
    load_slots: torch.Tensor  # ... into these slots
    victim_ids: torch.Tensor  # dirty rows evicted: ids ...
    victim_slots: torch.Tensor  # ... and the reserved slots still holding them until the commit
    released: torch.Tensor | None = None  # every evicted id (bounded tiers: pins to release)
    reserved: torch.Tensor | None = None  # slots given new keys (None: all hits), for rollback
    old_keys: torch.Tensor | None = None
    old_scores: torch.Tensor | None = None
    old_dirty: torch.Tensor | None = None
    n_scratch: int = 0
    evicted: int = 0
    refused: int = 0  # ids not admitted (slot -1)
    exchanged: bool = False  # the tier transfer is done (the rows are in their slots)


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
