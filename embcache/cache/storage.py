"""The slot store of a `HotCache`: ``weights`` (the tables' dtype) and ``state`` (float32) row
by row, the per-slot arrays beside them (``slot_keys``, ``locks``, ``dirty``, ``scores``,
``batch_of``), the row index of a CPU cache (``where``: the slot of every row of its bounded
tables), the slot locks and dirty flags a batch's step changes, and the rows of slots in the
tier's layout.

`SlotStore` owns those arrays and replaces them together (`allocate`, `grow`, when the scratch
area grows); the cache's other parts (`plan.SetPlanner`, `scratch.ScratchArea`,
`direct.DirectMap`, `writeback.WriteBack`) hold the store and read its arrays through it, so
they always see the current ones.
"""

from __future__ import annotations

import threading

import torch

import embcache.native as native
from embcache.backend import Backend
from embcache.cache.lockstep import first_true
from embcache.cache.stats import CacheStats
from embcache.cache.transfer import SlotStorage, TierTransfer, packed_float32
from embcache.hostmem import host_zeros
from embcache.indexing import add_at, fill_at, put, true_at
from embcache.ops.ids.row_map import row_index
from embcache.ops.registry import bind


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
            if self.device.type == "cpu" and packed_float32(
                self.backend, weights, state, rows, slots
            ):
                native.gather_join(weights.numpy(), state.numpy(), slots.numpy(), rows.numpy())
                return rows
            torch.index_select(weights, 0, slots, out=rows[:, : self.dim])
            torch.index_select(state, 0, slots, out=rows[:, self.dim :])
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
            fill_at(self.where, self.row_index(keys), -1)

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
        return slots.index_select(0, first_true(slots >= 0, n_live))

    def hold(self, slots: torch.Tensor) -> None:
        """Lock ``slots`` (distinct, resident) once each (`HotCache.hold`)."""
        with self.lock:
            add_at(self.locks, slots, 1)

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """Record that the rows at ``slots`` were changed in place (`HotCache.mark_dirty`)."""
        with self.lock:
            slots = slots.to(self.device)
            if not self.admits_all:
                live = self.live(slots)
                self.stats.gradients_dropped += slots.numel() - live.numel()
                slots = live
            fill_at(self.dirty, slots, True)

    def unlock_checked(self, given: torch.Tensor, slots: torch.Tensor, dirty: bool) -> None:
        """`HotCache.unlock` of ``slots`` (``given`` without the -1 of ids not admitted), under
        ``lock``, once a device check found every one locked (`locks.unlock_together`); the
        compiled passes check here themselves."""
        # The backend's pass (compiled: it checks every lock first, raising RuntimeError).
        self.backend.unlock(self.locks, slots, self.dirty if dirty else None)
        if dirty:
            self.stats.gradients_dropped += given.numel() - slots.numel()
