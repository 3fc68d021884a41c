"""The slot storage of a `HotCache`: ``weights`` (the tables' dtype) and ``state`` (float32)
row by row, the per-slot index arrays beside them (``slot_keys``, ``locks``, ``dirty``,
``scores``, ``batch_of``), the row index of a CPU cache (``_where``: the slot of every row of
its bounded tables), the moves of slot rows to the tier, and the reads and writes of rows
wherever they live (`read`, `write_weights`: a slot or the tier).

`SlotRows` is a part of `HotCache` (its base class, as `snapshot.PolicyState` is): the arrays
are the cache's own attributes, replaced together when the scratch area grows.
"""

from __future__ import annotations

import torch

import embcache.native as native
from embcache.cache.fields import CacheFields
from embcache.cache.transfer import SlotStorage, packed_float32, take
from embcache.hostmem import host_zeros
from embcache.indexing import fill_at, put, true_at


class SlotRows(CacheFields):
    """`HotCache`'s storage methods: they read and set the cache's own arrays, so they run on
    a `HotCache` only."""

    @property
    def width(self) -> int:
        """Values of a row as float32: ``dim + state_dim`` (weights, then state)."""
        return self.dim + self.state_dim

    @property
    def scratch_rows(self) -> int:
        """Rows currently allocated to the scratch area."""
        return self.weights.shape[0] - self.num_slots

    def rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The stored tier rows (`TableSpec.pack`: weights, then state) held at ``slots``."""
        # index_select copies whole rows (advanced indexing goes element by element on a CPU).
        spec = self.transfer.spec
        if spec.dtype == self.weights.dtype == torch.float32:
            # Stored rows are the weights then the float32 state: gathered into their columns
            # directly, without gathering each apart and copying both again.
            rows = torch.empty(slots.numel(), spec.stored_width, device=self.device)
            if self.device.type == "cpu" and packed_float32(
                self.backend, self.weights, self.state, rows, slots
            ):
                native.gather_join(self.weights.numpy(), self.state.numpy(), slots.numpy(),
                                   rows.numpy())  # fmt: skip
                return rows
            torch.index_select(self.weights, 0, slots, out=rows[:, : self.dim])
            torch.index_select(self.state, 0, slots, out=rows[:, self.dim :])
            return rows
        return spec.pack(self.weights.index_select(0, slots), self.state.index_select(0, slots))

    def _host_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """`rows_of` on the host (one copy from a device; none on a CPU)."""
        rows = self.rows_of(slots)
        return rows if rows.device.type == "cpu" else rows.cpu()

    def _slot_storage(
        self, write_slots: torch.Tensor | None, read_slots: torch.Tensor | None
    ) -> SlotStorage | None:
        """On a CPU, this cache's storage and the slots of a tier exchange's rows, for the tier
        to move them straight between its tables and the slots (`TierTransfer.exchange`)."""
        if self.device.type != "cpu":
            return None
        return SlotStorage(self.weights, self.state, write_slots, read_slots)

    def _allocate(self, scratch_rows: int) -> None:
        self._filled = False  # direct mapping: every row loaded
        total = self.num_slots + scratch_rows
        if self.device.type == "cpu":  # rows read at random: huge pages spare the TLB
            weights = host_zeros((total, self.dim), self.dtype)
            state = host_zeros((total, self.state_dim), torch.float32)
        else:
            weights = torch.zeros(total, self.dim, dtype=self.dtype, device=self.device)
            state = torch.zeros(total, self.state_dim, device=self.device)
        with self.storage_lock:
            self.weights, self.state = weights, state
        self.slot_keys = torch.full((total,), -1, dtype=torch.int64, device=self.device)
        self.locks = torch.zeros(total, dtype=torch.int32, device=self.device)
        self.dirty = torch.zeros(total, dtype=torch.bool, device=self.device)
        self.scores = torch.full((self.num_slots,), -1, dtype=torch.int64, device=self.device)
        self.batch_of = torch.full((total,), -1, dtype=torch.int64, device=self.device)
        # Slot of each row of the tables while it is held (scratch included), else -1.
        self._where = (
            host_zeros((self._index_rows,), torch.int32).fill_(-1) if self._index_rows else None
        )

    def _index(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Record that ``keys`` (resident, distinct) are held at ``slots``."""
        if self._where is not None and keys.numel():
            put(self._where, self.row_index(keys), slots)

    def _unindex(self, keys: torch.Tensor) -> None:
        """Record that ``keys`` (resident, distinct) left their slots."""
        if self._where is not None and keys.numel():
            fill_at(self._where, self.row_index(keys), -1)

    def _reindex(self) -> None:
        """Rebuild `_where` from ``slot_keys`` (after a restore or a rollback)."""
        if self._where is not None:
            self._where.fill_(-1)
            held = true_at(self.slot_keys >= 0)
            self._index(self.slot_keys.index_select(0, held), held)

    # Tier writes (`TierTransfer` on host tensors): every call may raise and must leave the
    # cache unchanged.

    def _write_tier(self, fused: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the rows held at ``slots`` back to the tier under their ``fused`` ids (one
        copy of the ids and one of the rows to the host)."""
        self._write_host(fused.cpu(), slots)

    def _write_host(self, host: torch.Tensor, slots: torch.Tensor) -> None:
        """`_write_tier` of ids already on the host."""
        self.transfer.exchange(
            host, lambda positions: self._host_rows(take(slots, positions)), host[:0],
            slots=self._slot_storage(slots, None),
        )  # fmt: skip
        self.writebacks += host.numel()

    # Rows wherever they live: their slot (scratch included) or the tier.

    def _resident_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each of ``ids`` where it is resident (scratch included), else -1."""
        if self.direct:
            slots = self.row_index(ids)
            return torch.where(self.slot_keys[slots] == ids, slots, -1)
        return self._lookup(ids)

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
            out = torch.empty(ids.numel(), self.width, device=self.device)
            out[found] = spec.to_float(self.rows_of(slots[found]))
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
            self.weights[resident] = weights[found]
            self.dirty[resident] = True
