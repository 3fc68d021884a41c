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
   (`kernels.cache_index.assign_ways`);
3. dirty victims are written back to the tier in one batched call per table, then the missing
   rows are read from the tier (created there on first touch) and copied into their slots;
4. misses that find no free way in their set are served from a scratch area behind the cache,
   whose rows are written back (when dirty) and freed by the first `release` after their last
   lock is dropped and a later batch was resolved (each resolve starts with one).

On a CPU, a set-associative cache of bounded tables also records the slot of every row it
holds (``_where``, int32 over its tables' rows, scratch included), so step 1 is one gather. A
direct-mapped cache can serve a batch without a resolve (`serve_direct`: the fused CPU step
reads rows by table and raw id), counting the same hits.

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
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

import embcache.native as native
from embcache.cache.config import EXACT_LFU_MAX_ROWS, CacheConfig, CachePolicy
from embcache.cache.sizing import cache_capacity, check_fits, warn_overflow
from embcache.cache.sketch import Counters
from embcache.cache.snapshot import PolicyState
from embcache.cache.transfer import SlotStorage, Staged, TierTransfer, packed_float32, take
from embcache.hashing import mix64
from embcache.hostmem import host_zeros
from embcache.indexing import add_at, count_true, fill_at, or_flags, put, select, true_at
from embcache.kernels.cache_index import assign_ways, cache_lookup, set_index
from embcache.kv.base import Store, TableSpec
from embcache.profiling import profiled


class CacheCapacityError(ValueError):
    """A batch's rows cannot all be held by the cache plus its scratch area."""


@dataclass
class _Plan:
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


_INT64_MAX = torch.iinfo(torch.int64).max
# A set-associative cache of bounded tables on a CPU keeps the slot of every row it holds in
# an int32 array over all its tables' rows (4 bytes a row), up to this many rows: a lookup is
# then one gather instead of a comparison with every way of the id's set.
ROW_INDEX_MAX_ROWS = 1 << 26
# `serve_direct` maps a batch's slots in a bool array over the cache when it has at least one
# value per this many rows; fewer values are counted by passes over the values alone.
_VALUES_PER_MAP = 8
# `unique_by_rows` takes a batch through a map over its tables' rows from one id per this many
# rows (a sort of fewer ids is cheaper than passes over the map); through the compiled bitmap
# (`native.unique_rows`, a bit a row) from one id per `_IDS_PER_ROW_BITMAP` rows.
_IDS_PER_ROW_MAP = 40
_IDS_PER_ROW_BITMAP = 500


class HotCache(PolicyState):
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
            storage. Read them under ``lock`` or ``storage_lock`` when another thread may resolve
            concurrently (the scratch area may grow, which replaces both tensors).
        storage_lock: held while the slot storage is replaced, and by whoever reads or writes
            rows through a view of it that must stay the storage (the fused CPU step's TBE,
            for its forward's table and its backward's update), without holding ``lock``: the
            update of one batch's locked rows then runs beside a prefetch's resolve of the
            next. Taken after ``lock``, never before it.
        num_slots: slots of the cache proper (scratch excluded).
        direct: True when every row has its own slot.
    """

    def __init__(
        self,
        tables: Sequence[tuple[int, TableSpec]],
        config: CacheConfig,
        store: Store,
        device: torch.device | str,
        fusion_k: int,
    ) -> None:
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
        self.dim = dims.pop()
        self.dtype = dtypes.pop()
        self.config = config
        self.store = store
        self.device = torch.device(device)
        self.fusion_k = fusion_k
        self.lock = threading.RLock()
        self.storage_lock = threading.RLock()  # see the class docstring: after `lock`
        self._resolve_mutex = threading.RLock()  # serialises resolves (and flush, read)
        self._specs = {idx: spec for idx, spec in tables}
        self.transfer = TierTransfer(store, self._specs, fusion_k, self.device)
        self.state_dim = tables[0][1].state_dim
        self.pins = self.transfer.pins()  # bounded tier tables: pin what the cache holds
        self.rounding_seed = tables[0][1].seed
        self.stochastic_rounding = config.stochastic_rounding

        bounded = all(spec.num_embeddings is not None for _, spec in tables)
        total_rows = sum(spec.num_embeddings for _, spec in tables) if bounded else None
        capacity = cache_capacity(config, total_rows, self.dim, self.device, self._names())
        self.direct = total_rows is not None and capacity >= total_rows and not self.pins
        self.policy = CachePolicy(config.policy)

        n_idx = max(self._specs) + 1
        # Built on the CPU whatever torch's default device (`with torch.device("meta")`).
        row_offset = torch.full((n_idx,), -1, dtype=torch.int64, device="cpu")
        thresholds = torch.ones(n_idx, dtype=torch.int64, device="cpu")
        offset = 0
        for idx, spec in sorted(tables, key=lambda t: t[0]):
            if spec.num_embeddings is not None:
                row_offset[idx] = offset
                offset += spec.num_embeddings
            thresholds[idx] = config.admit_after_of(spec.name)
        self._row_offset = row_offset.to(self.device)  # slot (direct) / LFU count base per table
        # The raw ids each table index takes (0: not a table of this cache), for `_check_keys`.
        self._key_limits = torch.zeros(n_idx, dtype=torch.int64)
        for idx, spec in tables:
            rows = spec.num_embeddings
            self._key_limits[idx] = 1 << fusion_k if rows is None else min(rows, 1 << fusion_k)

        if self.direct:
            self.ways, self.num_sets = 1, total_rows
        else:
            self.ways = min(config.ways, capacity)
            self.num_sets = math.ceil(capacity / self.ways)
        self.num_slots = self.ways * self.num_sets
        # Rows indexed by slot (`_where`): set-associative caches of bounded tables on a CPU.
        self._index_rows = (
            total_rows
            if total_rows is not None and not self.direct and self.device.type == "cpu"
            and total_rows <= ROW_INDEX_MAX_ROWS
            else 0
        )  # fmt: skip
        lfu = self.policy is CachePolicy.LFU and not self.direct
        counters = Counters(
            row_offset, offset, thresholds, lfu, config.lfu_counters, EXACT_LFU_MAX_ROWS,
            config.sketch_width, config.sketch_depth, config.effective_admission_window,
        )  # fmt: skip
        names = self._names()
        check_fits(self.num_slots, self.width, counters.nbytes // 8, self.device, names, self.dim)
        self._counts, self._admission = counters.build(self.device, fusion_k)
        self._overflow_warned = False
        self._tick = 0
        self._lookups = 0
        self._batch_seq = 0  # number of the last locked resolve; its rows are guarded
        self._scratch_used = 0
        self._seen: torch.Tensor | None = None  # `serve_direct`'s map of a batch's slots
        self._seen_batch = -1  # the batch `_seen` maps (-1: none)
        self._served = 0  # batches served directly
        self._stamps: torch.Tensor | None = None  # `_distinct`'s positions, made on first use
        # `unique_by_rows`' map and ranks over the tables' rows (5 bytes a row), made on first
        # use; the compiled dedup's bitmap (a bit a row) and ranks (4 bytes per 64 rows).
        self._row_map: torch.Tensor | None = None
        self._row_rank: torch.Tensor | None = None
        self._row_bits: torch.Tensor | None = None
        self._word_rank: np.ndarray | None = None
        self._row_starts: torch.Tensor | None = None  # first row of each table, ascending
        self._row_tables: torch.Tensor | None = None  # and the table's index
        self._rows_lock = threading.Lock()  # one batch at a time through those
        self._deferred: list[Staged] = []  # rows a resolve left to write (`write_deferred`)
        self._allocate(scratch_rows=0)
        self.reset_stats()

    # ------------------------------------------------------------------------------------------
    # storage

    @property
    def admits_all(self) -> bool:
        """Whether every id gets a slot (no admission threshold: no slot is ever -1)."""
        return self._admission is None

    @property
    def counter_bytes(self) -> int:
        """Device bytes of the LFU counts and the admission sketch."""
        total = 0 if self._counts is None else self._counts.nbytes
        return total + (0 if self._admission is None else self._admission.sketch.nbytes)

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
            if self.device.type == "cpu" and packed_float32(self.weights, self.state, rows, slots):
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

    def _names(self) -> str:
        names = [spec.name for spec in self._specs.values()]
        return f"table {names[0]!r}" if len(names) == 1 else f"{len(names)} tables {names[:3]}"

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

    def row_index(self, keys: torch.Tensor) -> torch.Tensor:
        """Row of each fused key of a bounded table among all the cache's tables' rows (in
        ascending table index): under direct mapping, its slot."""
        return self._row_offset.index_select(0, keys >> self.fusion_k) + (
            keys & ((1 << self.fusion_k) - 1)
        )

    def unique_by_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``torch.unique(ids, sorted=True, return_inverse=True)`` for valid fused ids of this
        cache's tables, through a map over the tables' rows instead of a sort: a batch that
        holds at least one id per `_IDS_PER_ROW_MAP` rows (`_IDS_PER_ROW_BITMAP` through the
        compiled bitmap) is deduplicated faster so. None when it holds fewer, or the cache
        keeps no row index (its tables are unbounded, or it is on a GPU or direct)."""
        compiled = native.available()
        if not self._dense_batch(ids.numel(), compiled):
            return None
        with self._rows_lock:  # the map and ranks are this cache's, one batch at a time
            self._row_buffers(compiled)
            if compiled:
                unique, inverse = native.unique_rows(
                    ids.contiguous().numpy(), self._row_offset.numpy(), self.fusion_k,
                    self._bitmap(), self._word_ranks(), self._row_starts.numpy(),
                    self._row_tables.numpy(),
                )  # fmt: skip
                return torch.from_numpy(unique), torch.from_numpy(inverse)
            assert self._row_map is not None and self._row_rank is not None
            rows = self.row_index(ids)
            fill_at(self._row_map, rows, True)
            unique_rows = true_at(self._row_map)  # ascending: (table, id) order
            fill_at(self._row_map, unique_rows, False)  # all clear again for the next batch
            put(self._row_rank, unique_rows, torch.arange(unique_rows.numel()))
            inverse = self._row_rank.index_select(0, rows).to(torch.int64)
        table = torch.searchsorted(self._row_starts, unique_rows, right=True) - 1
        raw = unique_rows - self._row_starts.index_select(0, table)
        unique = raw | (self._row_tables.index_select(0, table) << self.fusion_k)
        return unique, inverse

    def maps_batch(self, n: int) -> bool:
        """Whether `unique_values` takes a batch of ``n`` ids: the compiled kernels run, the
        cache keeps the slot of every row of its tables (a set-associative cache of bounded
        tables on a CPU, up to `ROW_INDEX_MAX_ROWS` rows), and the batch is dense enough for
        the map over those rows."""
        return native.available() and self._dense_batch(n, True)

    def row_ranges(self, tables: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """For `unique_values`: the first row (among this cache's tables' rows) and the number
        of valid ids (``num_embeddings``, at most ``2**fusion_k``) of each of ``tables``
        (table indices), int64 ``[len(tables)]`` each."""
        bases = torch.tensor([int(self._row_offset[t]) for t in tables], dtype=torch.int64)
        rows = [self._specs[t].num_embeddings for t in tables]
        if any(r is None for r in rows):
            raise ValueError("row_ranges: unbounded tables have no rows to range over")
        limits = torch.tensor(rows, dtype=torch.int64).clamp(max=1 << self.fusion_k)
        return bases, limits

    def unique_values(
        self,
        values: torch.Tensor,
        bounds: torch.Tensor,
        ranges: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`unique_by_rows` of raw ids, checked and fused in the same compiled pass
        (`native.unique_values`): the values of feature ``f``, ``values[bounds[f] :
        bounds[f + 1]]``, are ids of a table of the cache whose `row_ranges` are
        ``ranges[0][f], ranges[1][f]``. None when the compiled kernels do not run here, the
        batch is too sparse for the map (`unique_by_rows`), or an id is out of its table's
        range or past ``2**fusion_k`` (`kernels.ids.fuse_ids` then says which).

        Args:
            values: CPU int64 or int32 ``[nnz]`` raw ids, the features one after another.
            bounds: CPU int64 ``[F + 1]`` the first value of each feature, then ``nnz``.
            ranges: `row_ranges` of the features' tables.
        """
        if values.dtype not in (torch.int64, torch.int32) or not self.maps_batch(values.numel()):
            return None
        bases, limits = ranges
        with self._rows_lock:
            self._row_buffers(compiled=True)
            unique, inverse, bad = native.unique_values(
                values.contiguous().numpy(), bounds.contiguous().numpy(), bases.numpy(),
                limits.numpy(), self.fusion_k, self._bitmap(), self._word_ranks(),
                self._row_starts.numpy(), self._row_tables.numpy(),
            )  # fmt: skip
        if bad >= 0:
            return None
        return torch.from_numpy(unique), torch.from_numpy(inverse)

    def _dense_batch(self, n: int, compiled: bool) -> bool:
        """Whether a batch of ``n`` ids is deduplicated through the map over the tables' rows
        (the cache keeps a row index, and the batch has enough ids for the map's size)."""
        per_row = _IDS_PER_ROW_BITMAP if compiled else _IDS_PER_ROW_MAP
        return bool(self._index_rows) and n * per_row >= self._index_rows

    def _row_buffers(self, compiled: bool) -> None:
        """Make the table starts of `unique_by_rows` and, for the torch path (not
        ``compiled``), its map and ranks over the tables' rows (first use)."""
        if not compiled and self._row_map is None:
            self._row_map = torch.zeros(self._index_rows, dtype=torch.bool)
            self._row_rank = host_zeros((self._index_rows,), torch.int32)
        if self._row_starts is None:
            starts = sorted((int(self._row_offset[i]), i) for i in self._specs)
            self._row_starts = torch.tensor([start for start, _ in starts])
            self._row_tables = torch.tensor([idx for _, idx in starts])

    def _bitmap(self) -> np.ndarray:
        """The compiled dedup's bitmap, one bit a row (all clear between batches)."""
        if self._row_bits is None:
            self._row_bits = torch.zeros((self._index_rows + 63) // 64, dtype=torch.int64)
        return self._row_bits.numpy().view(np.uint64)

    def _word_ranks(self) -> np.ndarray:
        """The compiled dedup's rank of each word of `_bitmap` (scratch, int32)."""
        if self._word_rank is None:
            self._word_rank = np.zeros((self._index_rows + 63) // 64, dtype=np.int32)
        return self._word_rank

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

    # ------------------------------------------------------------------------------------------
    # tier transfers (`TierTransfer` on host tensors; every call may raise and must leave the
    # cache unchanged)

    def _write_tier(self, fused: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the rows held at ``slots`` back to the tier under their ``fused`` ids (one
        copy of the ids and one of the rows to the host)."""
        host = fused.cpu()
        self.transfer.exchange(
            host, lambda positions: self._host_rows(take(slots, positions)), host[:0],
            slots=self._slot_storage(slots, None),
        )  # fmt: skip
        self.writebacks += fused.numel()

    # ------------------------------------------------------------------------------------------
    # resolve

    @profiled("cache.resolve")
    def resolve(
        self,
        unique_ids: torch.Tensor,
        lock: bool = True,
        count_sightings: bool = True,
        defer_writeback: bool = False,
        checked: bool = False,
    ) -> torch.Tensor:
        """Slots holding the rows of ``unique_ids``, loading misses from the tier.

        Three phases, so that a resolve running on a prefetch thread overlaps the training
        thread's use of the cache: (1) under ``lock``, hits are found, misses get ways or scratch
        rows, those slots are reserved and locked and the dirty victims' rows are copied out;
        (2) without ``lock``, victims are written to the tier and missing rows read from it;
        (3) under ``lock``, the rows are copied into their slots. Resolves are serialised among
        themselves. A tier error in (2) undoes (1): the cache is as it was.

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

        Returns:
            int64 ``[n]`` slot of each id, on the cache's device: ``rows[slots]`` are its rows;
            -1 for an id not admitted (a row of zeros, whose update is dropped).

        Raises:
            CacheCapacityError: the batch's rows cannot fit the cache plus the scratch area.
            ValueError: on a CPU, an id that is no row of this cache's tables (a table index
                not among them, a raw id past its table's rows): nothing changed.
        """
        ids = unique_ids.to(self.device, torch.int64)
        if self.device.type == "cpu" and not checked:
            self._check_keys(ids)
        if ids.numel() > self.num_slots and not self._overflow_warned:
            self._overflow_warned = True
            warn_overflow(ids.numel(), self.num_slots, self._names(), self.dim)
        with self._resolve_mutex:
            # A deferred write first (this batch may read those rows back). Scratch rows of
            # finished batches next, so they do not crowd this one out; a tier error in
            # either changes nothing (both keep what they cannot write).
            self.write_deferred()
            self.release()
            with self.lock:
                admitted = None
                if self._admission is not None:
                    admitted = self._admission.admit(ids, count_sightings)
                try:
                    plan = self._plan_direct(ids, admitted) if self.direct else (
                        self._plan_sets(ids, admitted))  # fmt: skip
                except CacheCapacityError:
                    if not self._guarding():
                        raise
                    # Too little room beside the last batch's rows: they stop being guarded
                    # (its step is done, or the plan would have met its locks anyway).
                    self._batch_seq += 1
                    self.release()
                    plan = self._plan_sets(ids, admitted)
            # Outside the lock: the reserved slots are locked by this resolve and no other
            # resolve runs (mutex), so nobody else reads or writes them, and `rows` is only
            # ever replaced by a resolve. The training thread keeps using its own slots.
            staged = None
            try:
                n_write, n_read = plan.victim_ids.numel(), plan.load_ids.numel()
                if n_write or n_read:
                    # One copy of all the ids the tier needs, one of the rows it gets.
                    host_ids = torch.cat([plan.victim_ids, plan.load_ids]).cpu()
                    released = None if plan.released is None else plan.released.cpu()
                    write_ids = host_ids[:n_write]

                    def victim_rows(positions: torch.Tensor | slice) -> torch.Tensor:
                        return self._host_rows(take(plan.victim_slots, positions))

                    if n_write and defer_writeback and self.transfer.grouped and not self.pins:
                        staged = self.transfer.stage(write_ids, victim_rows)
                        write_ids = write_ids[:0]
                    loaded = self.transfer.exchange(
                        write_ids, victim_rows, host_ids[n_write:], released,
                        self._slot_storage(plan.victim_slots, plan.load_slots),
                    )  # fmt: skip
                    self.transfer.place(self.weights, self.state, plan.load_slots, loaded)
            except BaseException:
                with self.lock:
                    self._rollback(plan)
                raise
            with self.lock:
                self._commit(plan, lock)
            if staged is not None:
                self._deferred.append(staged)
            return plan.slots

    @profiled("cache.deferred_write")
    def write_deferred(self) -> None:
        """Make the tier writes a resolve with ``defer_writeback`` left staged, in order (a
        no-op when there are none). A tier error propagates and the rows not yet written stay
        staged: the next call, or the next resolve, writes them."""
        with self._resolve_mutex:
            while self._deferred:
                self.transfer.write_staged(self._deferred[0])
                del self._deferred[0]

    def _check_keys(self, ids: torch.Tensor) -> None:
        """A ValueError naming the first of CPU int64 ``ids`` that is no row of this cache's
        tables. Callers above (`CacheEngine.fuse`) check their ids already; this keeps a bad
        one given to `resolve` directly from reaching the row index, which the compiled plan
        reads unchecked."""
        if not ids.numel():
            return
        if native.available() and ids.is_contiguous():
            bad = native.first_bad_key(ids.numpy(), self.fusion_k, self._key_limits.numpy())
        else:
            tables = ids >> self.fusion_k
            n = self._key_limits.numel()
            wrong = (ids < 0) | (tables >= n)
            limits = self._key_limits.index_select(0, tables.clamp(0, n - 1))
            wrong |= (ids & ((1 << self.fusion_k) - 1)) >= limits
            found = true_at(wrong)
            bad = int(found[0]) if found.numel() else -1
        if bad >= 0:
            key = int(ids[bad])
            raise ValueError(
                f"HotCache.resolve: id {key} at position {bad} (table index "
                f"{key >> self.fusion_k}, raw id {key & ((1 << self.fusion_k) - 1)}) is no row "
                f"of this cache's tables {sorted(self._specs)} (rows "
                f"{[self._specs[i].num_embeddings for i in sorted(self._specs)]})"
            )

    def _prefill_direct(self, chunk_rows: int = 1 << 16) -> None:
        """Direct mapping holds every row: read them all from the tier at once, in chunks,
        instead of paying a tier call per batch for first touches over the whole run. Through
        `Store.read`, which creates nothing: a row reaches the tier only once it is written
        back dirty, so a checkpoint holds the rows trained, not the whole table."""
        for idx, spec in self._specs.items():
            base = int(self._row_offset[idx])
            for lo in range(0, spec.num_embeddings, chunk_rows):
                raw = torch.arange(lo, min(lo + chunk_rows, spec.num_embeddings))
                slots = (base + raw).to(self.device)
                rows = self.store.read(spec.name, raw)
                self.transfer.copy_in(self.weights, self.state, slots, rows)
                self.slot_keys[slots] = (raw | (idx << self.fusion_k)).to(self.device)
                self.dirty[slots] = False
        self._filled = True

    @profiled("cache.plan")
    def _plan_direct(self, ids: torch.Tensor, admitted: torch.Tensor | None) -> _Plan:
        if not self._filled:
            self._prefill_direct()
        slots = self.row_index(ids)
        live_ids, live = ids, slots
        if admitted is not None:
            live_ids, live = ids[admitted], slots[admitted]
            slots = torch.where(admitted, slots, -1)
        miss = self.slot_keys[live] < 0
        load_slots = live[miss]
        plan = _Plan(ids, slots, live_ids[miss], load_slots, self._empty_ids(), self._empty_ids())
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
        """A batch served straight from a direct-mapped cache, without a resolve (the fused CPU
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

    def hold(self, slots: torch.Tensor) -> None:
        """Lock ``slots`` (distinct, resident) once each, as a resolve with ``lock`` does: for
        a batch served by `serve_direct` that turns into the ordinary locked form later."""
        with self.lock:
            add_at(self.locks, slots, 1)

    def _live(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots`` without the -1 of ids not admitted (no copy when there is no admission)."""
        return slots if self._admission is None else slots[slots >= 0]

    @profiled("cache.plan")
    def _plan_sets(self, ids: torch.Tensor, admitted: torch.Tensor | None) -> _Plan:
        if self._native_plan(admitted):
            return self._plan_native(ids)
        # Gathers are index_select and writes scatter_/index_add_ (`embcache.indexing`): on a
        # CPU, advanced indexing takes a general path several times slower.
        W = self.ways
        if self._where is not None:  # the slot of every held row, scratch included
            slots = self._where.index_select(0, self.row_index(ids)).to(torch.int64)
        else:
            sets = set_index(ids, self.num_sets)
            keys = self.slot_keys[: self.num_slots].view(self.num_sets, W)
            ways = cache_lookup(keys, ids, sets)
            slots = torch.where(ways >= 0, sets * W + ways, torch.full_like(ways, -1))
            if self._scratch_used:
                self._find_in_scratch(ids, slots)
        missing = slots < 0
        refused = 0
        if admitted is not None:  # ids not admitted keep slot -1 and are no misses
            refused = int((~admitted).sum())
            missing &= admitted
        miss_pos = true_at(missing)
        self._tick += 1  # both undone if the plan is refused
        self._lookups += 1
        if not miss_pos.numel():
            add_at(self.locks, self._live(slots), 1)
            self._touch(ids, slots)
            empty = self._empty_ids()
            plan = _Plan(ids, slots, empty, empty, empty, empty)
            plan.refused = refused
            return plan

        # Ways this batch hits are as good as locked while its misses choose victims.
        self._lock_hits(slots, 1)
        # Misses compete for a set's ways in an order that changes every batch: dedup hands
        # ids sorted, and a fixed order would give the same rows the ways each time. LFU:
        # the most frequent first.
        miss_ids = ids.index_select(0, miss_pos)
        misses = miss_pos, miss_ids  # in the order of ``ids``
        shuffle = mix64(miss_ids ^ self._tick)
        lfu = self.policy is CachePolicy.LFU
        if lfu:
            miss_pos = miss_pos.index_select(0, torch.argsort(shuffle))
            assert self._counts is not None
            miss_freq = self._counts.get(ids.index_select(0, miss_pos)) + 1  # with this request
            by_freq = torch.argsort(miss_freq, descending=True, stable=True)
            miss_pos, miss_freq = miss_pos.index_select(0, by_freq), miss_freq[by_freq]
            miss_sets = set_index(ids.index_select(0, miss_pos), self.num_sets)
            miss_sets, order = torch.sort(miss_sets, stable=True)
        else:
            # One sort: by set, then by the batch's shuffle (20 low bits; num_sets < 2**43).
            miss_sets = set_index(miss_ids, self.num_sets)
            key = (miss_sets << 20) | (shuffle & 0xFFFFF)
            order = torch.sort(key, stable=True).indices
            miss_sets = miss_sets.index_select(0, order)
        miss_pos = miss_pos.index_select(0, order)
        touched, owner = torch.unique_consecutive(miss_sets, return_inverse=True)
        locks_view = self.locks[: self.num_slots].view(self.num_sets, W)
        scores_view = self.scores.view(self.num_sets, W)
        # The last locked batch's rows are as good as locked: under prefetch they are (that
        # batch is in flight), so a run evicts the same rows with and without prefetch.
        guarded = locks_view.index_select(0, touched) > 0
        batch_of = self.batch_of[: self.num_slots].view(self.num_sets, W)
        guarded |= batch_of.index_select(0, touched) == self._batch_seq
        assigned = assign_ways(scores_view.index_select(0, touched), guarded, owner)
        if lfu:
            # Admission: a miss displaces a resident row only if asked for more often (an
            # empty way has score -1); the others are served from scratch for this batch,
            # while their counts keep growing, so popular rows get in and stay.
            victim_score = scores_view[touched[owner], assigned.clamp(min=0)]
            admit = (assigned >= 0) & (victim_score < miss_freq[order])
            assigned = torch.where(admit, assigned, torch.full_like(assigned, -1))
        # The slot each miss (in the order of ``miss_pos``) takes, -1 where its set has none.
        place = torch.where(assigned >= 0, touched.index_select(0, owner) * W + assigned, assigned)
        return self._reserve(ids, slots, misses, miss_pos, place, refused)

    def _native_plan(self, admitted: torch.Tensor | None) -> bool:
        """Whether this plan runs as compiled CPU kernels (`embcache.native`): a CPU cache
        with a row index, admitting every id, LRU or LFU with exact counts (no sketch). The
        torch path is the specification."""
        if self._where is None or admitted is not None or not native.available():
            return False
        if self.policy is CachePolicy.LRU:
            return True
        return self._counts is not None and self._counts.sketch is None

    def _plan_native(self, ids: torch.Tensor) -> _Plan:
        """`_plan_sets` through `native.plan_lru` (or `plan_lfu` and `touch_lfu`) and
        `native.reserve`: the same plan, the same changes to the index, in a few passes over
        the batch's ids."""
        assert self._where is not None
        ids = ids.contiguous()
        slots = torch.empty_like(ids)
        self._tick += 1  # both undone if the plan is refused
        self._lookups += 1
        lfu = self.policy is CachePolicy.LFU
        if lfu:
            assert self._counts is not None
            miss_pos, order, place = native.plan_lfu(
                ids.numpy(), self._where.numpy(), self._row_offset.numpy(), self.fusion_k,
                self._counts.exact.numpy(), self._counts.row_offset.numpy(),
                self.scores.numpy(), self.locks.numpy(), self.batch_of.numpy(), self.num_sets,
                self.ways, self._tick, self._batch_seq, slots.numpy(),
            )  # fmt: skip
        else:
            miss_pos, order, place = native.plan_lru(
                ids.numpy(), self._where.numpy(), self._row_offset.numpy(), self.fusion_k,
                self.scores.numpy(), self.locks.numpy(), self.batch_of.numpy(),
                self.num_slots, self.num_sets, self.ways, self._tick, self._batch_seq,
                slots.numpy(),
            )  # fmt: skip
        if not miss_pos.size:  # every id hit: its slot is locked and touched
            if lfu:
                self._touch(ids, slots)
            empty = self._empty_ids()
            return _Plan(ids, slots, empty, empty, empty, empty)
        miss_pos, order, place = map(torch.from_numpy, (miss_pos, order, place))
        over = true_at(place < 0)  # misses whose set has no free way: scratch rows
        if over.numel():
            try:
                self._grow_scratch(over.numel())  # may replace the arrays: views come after
            except CacheCapacityError:
                self._lock_hits(slots, -1)
                self._tick -= 1
                self._lookups -= 1
                raise
            free = true_at(self.slot_keys[self.num_slots :] < 0)[: over.numel()]
            put(place, over, self.num_slots + free)  # in the planned order, as `_reserve`
            self._scratch_used += over.numel()
        load_slots, victim_ids, victim_slots, evicted, old_keys, old_scores, old_dirty = (
            map(torch.from_numpy, native.reserve(
                ids.numpy(), slots.numpy(), miss_pos.numpy(), order.numpy(), place.numpy(),
                self._where.numpy(), self._row_offset.numpy(), self.fusion_k,
                self.slot_keys.numpy(), self.scores.numpy(), self.locks.numpy(),
                self.dirty.numpy(), self.num_slots, self._tick,
            ))
        )  # fmt: skip
        plan = _Plan(
            ids, slots, ids.index_select(0, miss_pos), load_slots, victim_ids, victim_slots
        )
        plan.reserved, plan.old_keys = place, old_keys
        plan.old_scores, plan.old_dirty = old_scores, old_dirty
        plan.evicted, plan.n_scratch = evicted.numel(), over.numel()
        if self.pins:
            plan.released = evicted
        if lfu:  # `reserve` scored the batch's slots as LRU does: LFU scores replace them
            self._touch(ids, slots)
        return plan

    def _reserve(
        self,
        ids: torch.Tensor,
        slots: torch.Tensor,
        misses: tuple[torch.Tensor, torch.Tensor],
        miss_pos: torch.Tensor,
        place: torch.Tensor,
        refused: int,
    ) -> _Plan:
        """Reserve the planned slots: each miss at ``miss_pos`` takes its ``place``, or a
        scratch row where that is -1; the victims' keys leave the index, the misses' enter
        it, and every slot of the batch is locked and touched. ``misses`` are the misses'
        positions and ids in the order of ``ids``, the order they are read from the tier in.
        """
        placed = place >= 0
        placed_at = true_at(placed)
        if placed_at.numel() == place.numel():  # no overflow: no selection to make
            place_slots, placed_pos, overflow_pos = place, miss_pos, self._empty_ids()
        else:
            place_slots = place.index_select(0, placed_at)
            placed_pos = miss_pos.index_select(0, placed_at)
            overflow_pos = select(miss_pos, ~placed)
        n_over = overflow_pos.numel()
        if n_over:
            try:
                self._grow_scratch(n_over)
            except CacheCapacityError:
                self._lock_hits(slots, -1)
                self._tick -= 1
                self._lookups -= 1
                raise
            free = true_at(self.slot_keys[self.num_slots :] < 0)[:n_over]
            over_slots = self.num_slots + free
        else:
            over_slots = self._empty_ids()

        victims = self.slot_keys.index_select(0, place_slots)
        resident = victims >= 0
        dirty_victims = select(place_slots, resident & self.dirty.index_select(0, place_slots))
        new_slots = torch.cat([place_slots, over_slots]) if n_over else place_slots
        new_pos = torch.cat([placed_pos, overflow_pos]) if n_over else placed_pos
        old_keys = self.slot_keys.index_select(0, new_slots)
        put(slots, new_pos, new_slots)
        # Every miss got a slot: the rows to read, in the order of ``ids`` (sorted ids read
        # from the tier without another sort).
        load_slots = slots.index_select(0, misses[0])
        plan = _Plan(
            ids,
            slots,
            misses[1],
            load_slots,
            self.slot_keys.index_select(0, dirty_victims),
            dirty_victims,
        )
        plan.reserved, plan.old_keys = new_slots, old_keys
        plan.old_scores = self.scores.index_select(0, place_slots)
        plan.old_dirty = self.dirty.index_select(0, new_slots)
        evicted = select(victims, resident)
        plan.n_scratch, plan.evicted = n_over, evicted.numel()
        plan.refused = refused
        if self.pins:
            plan.released = evicted
        self._unindex(evicted)
        put(self.slot_keys, load_slots, plan.load_ids)
        self._index(plan.load_ids, load_slots)
        fill_at(self.dirty, new_slots, False)
        self._scratch_used += n_over
        add_at(self.locks, new_slots, 1)  # now every slot of the batch holds one lock
        self._touch(ids, slots)
        return plan

    def _lock_hits(self, slots: torch.Tensor, delta: int) -> None:
        """Add ``delta`` to the locks of the slots of ``slots`` that are not -1 (without
        selecting them: a -1 adds 0 to slot 0)."""
        hit = slots >= 0
        self.locks.index_add_(0, slots.clamp(min=0), hit.to(self.locks.dtype) * delta)

    def _guarding(self) -> bool:
        """Whether any unlocked row is guarded as the last locked batch's."""
        guarded = (self.batch_of == self._batch_seq) & (self.locks == 0)
        return bool(guarded.any())

    def _empty_ids(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _rollback(self, plan: _Plan) -> None:
        """Undo `_plan_*` after a failed tier transfer (victims stay resident and dirty)."""
        if plan.reserved is not None:
            self.slot_keys[plan.reserved] = plan.old_keys
            self._reindex()
        if plan.old_dirty is not None:  # set together with reserved
            self.dirty[plan.reserved] = plan.old_dirty
        if plan.old_scores is not None:  # of the reserved ways (scratch rows have none)
            reserved = plan.reserved[: plan.old_scores.numel()]
            ways = reserved < self.num_slots
            self.scores[reserved[ways]] = plan.old_scores[ways]
        self._scratch_used -= plan.n_scratch
        self.locks[self._live(plan.slots)] -= 1

    def _commit(self, plan: _Plan, lock: bool) -> None:
        live = self._live(plan.slots)
        if not lock:
            add_at(self.locks, live, -1)
        n_miss = plan.load_ids.numel()
        self.hits += plan.ids.numel() - n_miss - plan.refused
        self.misses += n_miss
        self.admissions_refused += plan.refused
        self.evictions += plan.evicted
        self.writebacks += plan.victim_ids.numel()
        if lock and not self.direct:
            self._batch_seq += 1
            fill_at(self.batch_of, live, self._batch_seq)

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

    def _touch(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Update the eviction scores of the resident slots of a batch."""
        if self.policy is CachePolicy.LRU:
            # Every slot of the batch is resident and in the cache proper unless some went to
            # scratch (or were refused): select only then.
            main_slots = slots if self._scratch_used == 0 and self._admission is None else (
                slots[(slots >= 0) & (slots < self.num_slots)])  # fmt: skip
            fill_at(self.scores, main_slots, self._tick)
            return
        assert self._counts is not None
        if self.device.type == "cpu" and self._counts.sketch is None and native.available():
            # Counted exactly: one compiled pass, the decay (when due) after it, which gives
            # the same counts and scores as before the scores are set (each value is rounded
            # down once either way).
            native.touch_lfu(
                ids.numpy(), slots.numpy(), self._counts.exact.numpy(),
                self._counts.row_offset.numpy(), self.fusion_k, self.scores.numpy(),
                self.num_slots,
            )  # fmt: skip
            self._decay_when_due()
            return
        main = (slots >= 0) & (slots < self.num_slots)
        self._counts.add(ids)
        self._decay_when_due()
        self.scores[slots[main]] = self._counts.get(ids[main])

    def _decay_when_due(self) -> None:
        """LFU with ``lfu_decay``: every ``lfu_decay_interval`` lookups, all frequencies and
        the scores of resident rows are multiplied by it (rounded down)."""
        decay = self.config.lfu_decay
        if decay is not None and self._lookups % self.config.lfu_decay_interval == 0:
            assert self._counts is not None
            self._counts.decay(decay)
            live = self.scores >= 0
            self.scores[live] = (self.scores[live].double() * decay).long()

    # ------------------------------------------------------------------------------------------
    # after the batch

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """Record that the rows at ``slots`` were changed in place (e.g. by an optimizer); a
        slot of -1 is an id not admitted, whose update was dropped (counted)."""
        with self.lock:
            slots = slots.to(self.device)
            if self._admission is not None:
                live = self._live(slots)
                self.gradients_dropped += slots.numel() - live.numel()
                slots = live
            fill_at(self.dirty, slots, True)

    def unlock(self, slots: torch.Tensor, dirty: bool = False) -> None:
        """Drop one lock from each of ``slots`` (distinct); with ``dirty``, also record that
        their rows were changed in place, as `mark_dirty` does (a batch after its update).

        Never calls the tier: scratch rows left without a lock are written back and freed by
        the next `release` (which the next `resolve`, `flush` and unlocked forwards call).

        Raises:
            RuntimeError: a slot is not locked (nothing is changed then).
        """
        with self.lock:
            given = slots.to(self.device)
            slots = self._live(given)
            if (
                native.available()
                and self.device.type == "cpu"
                and slots.dtype == torch.int64
                and slots.is_contiguous()
            ):
                # One compiled pass checks every lock, a second drops them (and marks the rows
                # dirty: `native.unlock_dirty`).
                locks = self.locks.numpy()
                bad = (native.unlock_dirty(locks, self.dirty.numpy(), slots.numpy()) if dirty
                       else native.unlock(locks, slots.numpy()))  # fmt: skip
                if bad >= 0:
                    raise RuntimeError("HotCache.unlock: a slot that is not locked was unlocked")
            else:
                if slots.numel() and int(self.locks.index_select(0, slots).min()) <= 0:
                    raise RuntimeError("HotCache.unlock: a slot that is not locked was unlocked")
                add_at(self.locks, slots, -1)
                if dirty:
                    fill_at(self.dirty, slots, True)
            if dirty:
                self.gradients_dropped += given.numel() - slots.numel()

    @profiled("cache.release_scratch")
    def release(self) -> None:
        """Write back and free the scratch rows no batch holds any more (those of the last
        locked batch are kept until the next one). If the write fails the rows stay in
        scratch, dirty, and the error propagates: call again later."""
        with self.lock:
            if not self._scratch_used:
                return
            compiled = self._where is not None and native.available()
            if compiled:  # the same rows and writes, in two compiled passes
                done_slots, dirty, dirty_keys = map(torch.from_numpy, native.scratch_done(
                    self.slot_keys.numpy(), self.locks.numpy(), self.batch_of.numpy(),
                    self.dirty.numpy(), self.num_slots, self._batch_seq,
                ))  # fmt: skip
            else:
                scratch = slice(self.num_slots, None)
                done = (self.slot_keys[scratch] >= 0) & (self.locks[scratch] == 0)
                done &= self.batch_of[scratch] != self._batch_seq  # guarded until the next batch
                done_slots = self.num_slots + true_at(done)
                dirty = select(done_slots, self.dirty.index_select(0, done_slots))
                dirty_keys = self.slot_keys.index_select(0, dirty)
            if not done_slots.numel():
                return
            if dirty.numel():
                self._write_tier(dirty_keys, dirty)
            if self.pins:
                self.transfer.unpin(self.slot_keys.index_select(0, done_slots).cpu())
            if compiled:
                assert self._where is not None
                native.free_slots(
                    done_slots.numpy(), self.slot_keys.numpy(), self.dirty.numpy(),
                    self._where.numpy(), self._row_offset.numpy(), self.fusion_k,
                )  # fmt: skip
            else:
                self._unindex(self.slot_keys.index_select(0, done_slots))
                fill_at(self.slot_keys, done_slots, -1)
                fill_at(self.dirty, done_slots, False)
            self._scratch_used -= done_slots.numel()
            self.evictions += done_slots.numel()

    @profiled("cache.flush")
    def flush(self) -> None:
        """Write every dirty row back to the tier (rows stay cached, now clean)."""
        with self._resolve_mutex, self.lock:
            self.write_deferred()
            dirty = true_at(self.dirty)
            if dirty.numel():
                self._write_tier(self.slot_keys[dirty], dirty)
                self.dirty[dirty] = False

    def invalidate(self) -> None:
        """Flush, then drop every cached row (the next batch reads all from the tier)."""
        with self._resolve_mutex, self.lock:
            if bool((self.locks > 0).any()):
                raise RuntimeError("HotCache.invalidate: slots are locked by a batch in flight")
            self.flush()
            if self.pins:
                held = self.slot_keys[self.slot_keys >= 0]
                self.transfer.unpin(held.cpu())
            self.slot_keys.fill_(-1)
            if self._where is not None:
                self._where.fill_(-1)
            self.scores.fill_(-1)
            self.batch_of.fill_(-1)
            self._scratch_used = 0
            self._filled = False

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
            self.state_dim = state_dim
            self._allocate(scratch_rows=0)

    def _resident_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each of ``ids`` where it is resident (scratch included), else -1."""
        if self.direct:
            slots = self.row_index(ids)
            return torch.where(self.slot_keys[slots] == ids, slots, -1)
        if self._where is not None:
            return self._where.index_select(0, self.row_index(ids)).to(torch.int64)
        sets = set_index(ids, self.num_sets)
        keys = self.slot_keys[: self.num_slots].view(self.num_sets, self.ways)
        ways = cache_lookup(keys, ids, sets)
        slots = torch.where(ways >= 0, sets * self.ways + ways, -1)
        if self._scratch_used:
            self._find_in_scratch(ids, slots)
        return slots

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
        looked_up = self.hits + self.misses
        stats: dict[str, float] = {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "writebacks": self.writebacks,
        }
        if self._admission is not None:
            stats["admissions_refused"] = self.admissions_refused
            stats["gradients_dropped"] = self.gradients_dropped
        stats["hit_rate"] = self.hits / looked_up if looked_up else 0.0
        return stats

    def reset_stats(self) -> None:
        """Zero the counters of `cache_stats`."""
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.writebacks = 0
        self.admissions_refused = 0
        self.gradients_dropped = 0

    def locked_slots(self) -> int:
        """Number of slots locked by batches in flight."""
        return int((self.locks > 0).sum())
