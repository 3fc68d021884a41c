"""The rows `TieredKV` holds in host memory in front of its back store, a part it holds
(`HeldRows`): per table a `HeldTable` (a row array with a free-slot stack, and a growable
`BucketIndex` from id to slot on one `Clock` for all tables), the write-back of dirty rows to
the back store, the eviction over every table down to ``capacity_rows``, and the directory of a
bounded table (`BoundedIndex`: which ids exist, here or in the back store). The design and its
guarantees are in `embcache.kv.tiered`'s docstring.
"""

from __future__ import annotations

import dataclasses

import torch

from embcache.indexing import true_at
from embcache.kv.base import IOStats, Store, TableSpec
from embcache.kv.bounded import BoundedIndex
from embcache.kv.bucket_index import BucketIndex, Clock, lowest

_MIN_SLOTS = 64
_HELD_WAYS = 32  # ways per bucket of the held rows' index: a find compares 32 ids per id
_EVICT_SLACK = 32  # eviction frees capacity // 32 extra rows, so it runs every few calls


class HeldTable:
    """Rows of one table held in host memory: a row array with a free-slot stack, and a
    growable `BucketIndex` (LRU on the store's shared clock) from id to position, whose value
    is the row's slot and whose dirty flag says the row is newer than the back store."""

    def __init__(self, spec: TableSpec, clock: Clock) -> None:
        self.spec = spec
        self.rows = torch.empty(0, spec.stored_width, dtype=spec.dtype)  # [slots, W]
        self.free = torch.empty(0, dtype=torch.int64)  # free slots: a stack, top at free_top
        self.free_top = 0
        self.index = BucketIndex("lru", _HELD_WAYS, clock=clock, values=True)
        # Bounded tables: which ids exist (held here or in back), at most spec.capacity.
        self.directory = (
            BoundedIndex(spec.capacity, spec.score) if spec.capacity is not None else None
        )

    def __len__(self) -> int:
        return len(self.index)

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, slots)`` of ``ids``, both -1 where the id is not held. The positions
        hold until the next `insert` (which may grow the index)."""
        positions = self.index.find(ids)
        assert self.index.values is not None
        slots = self.index.values[positions.clamp(min=0)]
        return positions, torch.where(positions >= 0, slots, -1)

    def insert(self, ids: torch.Tensor, rows: torch.Tensor, dirty: bool) -> None:
        """Hold rows for ``ids`` (distinct, none held yet), used now (the clock's next tick)."""
        k = ids.numel()
        if k == 0:
            return
        self._reserve(k)
        slots = self.free[self.free_top - k : self.free_top].clone()
        self.index.insert(ids, dirty=dirty, values=slots)  # raises before anything changes
        self.free_top -= k
        self.rows.index_copy_(0, slots, rows)

    def remove(self, positions: torch.Tensor) -> None:
        """Stop holding the rows at index ``positions`` (distinct, held)."""
        k = positions.numel()
        if k == 0:
            return
        assert self.index.values is not None
        slots = self.index.values[positions]
        self.index.remove(positions)
        self.free[self.free_top : self.free_top + k] = slots
        self.free_top += k

    def drop(self, ids: torch.Tensor) -> None:
        """Stop holding the rows of ``ids`` that are held, dirty or not (they were evicted)."""
        positions = self.index.find(ids)
        self.remove(positions[positions >= 0])

    def dirty_positions(self) -> torch.Tensor:
        """Index positions of rows newer than the back store, in ascending id order."""
        positions = true_at(self.index.dirty)
        return positions[torch.argsort(self.index.keys.index_select(0, positions))]

    def serve(self, ids: torch.Tensor, touch: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, hit)``: stored rows ``[n, stored_width]`` of ``ids``, filled where the id
        is held (``hit``), the others left for the caller. ``touch``: count it as a use (LRU),
        before an insert moves positions."""
        positions, slots = self.lookup(ids)
        hit = slots >= 0
        out = torch.empty(ids.numel(), self.spec.stored_width, dtype=self.spec.dtype)
        out[hit] = self.rows[slots[hit]]
        if touch:
            self.index.touch(positions[hit])
        return out, hit

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows written here (dirty, used now): held ones overwritten, the others added."""
        positions, slots = self.lookup(ids)
        hit = slots >= 0
        self.rows[slots[hit]] = rows[hit]
        self.index.dirty[positions[hit]] = True
        self.index.touch(positions[hit])  # before an insert moves positions
        miss = (~hit).nonzero().flatten()
        missing, inverse = torch.unique(ids[miss], return_inverse=True)
        # With repeated ids (the protocol says there are none) one of their rows is kept.
        source = torch.empty_like(missing).scatter_(0, inverse, miss)
        self.insert(missing, rows[source], dirty=True)

    def refresh(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """The rows of ``ids`` that are held take ``rows``' values, clean (the back store
        has them); the others are not added."""
        positions, slots = self.lookup(ids)
        hit = slots >= 0
        self.rows[slots[hit]] = rows[hit]
        self.index.dirty[positions[hit]] = False

    def _reserve(self, k: int) -> None:
        if self.free_top >= k:
            return
        old = self.rows.shape[0]
        size = max(_MIN_SLOTS, 2 * old, len(self) + k)
        rows = torch.empty(size, self.spec.stored_width, dtype=self.spec.dtype)
        rows[:old] = self.rows
        self.rows = rows
        # The new slots go under the free ones already stacked, lowest slot popped first.
        free = torch.empty(size, dtype=torch.int64)
        free[: size - old] = torch.arange(size - 1, old - 1, -1)
        free[size - old : size - old + self.free_top] = self.free[: self.free_top]
        self.free, self.free_top = free, self.free_top + size - old


class HeldRows:
    """Every table's rows held by one `TieredKV`, and what moves them to and from ``back``.
    Called with the store's lock held.

    Args:
        back: the slower store holding every row.
        capacity_rows: most rows held, all tables together (see `TieredKV`).
        stats: the store's counters (``writebacks``, ``evictions``, ``rows_created``,
            ``tier_evictions`` are counted here).
    """

    def __init__(self, back: Store, capacity_rows: int, stats: IOStats) -> None:
        self.back = back
        self.capacity_rows = capacity_rows
        self.tables: dict[str, HeldTable] = {}
        self.clock = Clock()  # the LRU clock of every table's held rows
        self._stats = stats

    def table(self, name: str) -> HeldTable:
        """The held rows of ``name``; a table declared on ``back`` directly is adopted
        (unbounded here)."""
        held = self.tables.get(name)
        if held is None:
            held = HeldTable(dataclasses.replace(self.back.table_spec(name)), self.clock)
            self.tables[name] = held
        return held

    def declare(self, spec: TableSpec) -> None:
        """`TieredKV.init_table`: the table declared on ``back`` (without the capacity, which
        is kept here). A re-declaration that changes the state layout first writes the
        table's dirty rows back and drops the rows held, so ``back`` resets the state of every
        row; the directory of a bounded table (which rows exist) is kept."""
        held = self.tables.get(spec.name)
        if held is not None:
            old = held.spec
            for field in ("dim", "num_embeddings", "dtype", "capacity", "score"):
                if getattr(old, field) != getattr(spec, field):
                    raise ValueError(
                        f"table {spec.name!r} is declared with {field}="
                        f"{getattr(old, field)}; cannot re-declare it with {field}="
                        f"{getattr(spec, field)}"
                    )
            if (old.state_dim, old.state_init) != (spec.state_dim, spec.state_init):
                self.write_back(held, held.dirty_positions())
        self.back.init_table(dataclasses.replace(spec, capacity=None))
        declared = dataclasses.replace(
            self.back.table_spec(spec.name), capacity=spec.capacity, score=spec.score
        )
        if held is not None and (held.spec.state_dim, held.spec.state_init) == (
            declared.state_dim,
            declared.state_init,
        ):
            held.spec = declared
            return
        fresh = HeldTable(declared, self.clock)  # nothing held: `back` has reset every row's state
        if held is not None:
            fresh.directory = held.directory  # which rows exist does not change
        self.tables[spec.name] = fresh

    def fetch(
        self, held: HeldTable, ids: torch.Tensor, miss: torch.Tensor, out: torch.Tensor
    ) -> None:
        """`TieredKV.get`'s misses of an unbounded table: fetched from ``back`` in one call (an
        id given twice once) into ``out``, and held clean."""
        missing, inverse = torch.unique(ids[miss], return_inverse=True)
        if missing.numel():
            fetched = self.back.get(held.spec.name, missing)
            out[miss] = fetched[inverse]
            held.insert(missing, fetched, dirty=False)

    def get_bounded(
        self,
        held: HeldTable,
        ids: torch.Tensor,
        miss: torch.Tensor,
        out: torch.Tensor,
        pin: bool,
    ) -> None:
        """`TieredKV.get` of a bounded table: ids it lists but does not hold come from ``back``, new
        ids from the initialiser (held dirty), making room by evicting (an id given twice is
        fetched or created once)."""
        directory = held.directory
        assert directory is not None
        positions = directory.find(ids)
        new = miss & (positions < 0)
        stored = miss & (positions >= 0)
        new_ids, new_at = torch.unique(ids[new], return_inverse=True)
        fresh = held.spec.initial_rows(new_ids) if new_ids.numel() else None
        if bool(stored.any()):
            stored_ids, stored_at = torch.unique(ids[stored], return_inverse=True)
            fetched = self.back.get(held.spec.name, stored_ids)
            out[stored] = fetched[stored_at]
            held.insert(stored_ids, fetched, dirty=False)
        if fresh is not None:
            placed = self.insert_bounded(held, new_ids, positions[~new])
            positions[new] = placed[new_at]
            out[new] = fresh[new_at]
            held.insert(new_ids, fresh, dirty=True)
            self._stats["rows_created"] += fresh.shape[0]
        if pin:
            directory.pin(positions)
        else:
            directory.touch(positions)

    def insert_bounded(
        self, held: HeldTable, new: torch.Tensor, guard: torch.Tensor
    ) -> torch.Tensor:
        """List new ids in a bounded table's directory; the ids evicted for them are dropped
        here and removed from ``back``. Returns the new ids' positions."""
        assert held.directory is not None
        positions, evicted = held.directory.insert(new, guard)
        if evicted.numel():
            held.drop(evicted)
            self._stats["tier_evictions"] += evicted.numel()
            self.back.remove(held.spec.name, evicted)
        return positions

    def write_back(self, held: HeldTable, positions: torch.Tensor) -> None:
        """Write the rows at index ``positions`` to ``back`` (one call), then mark them clean."""
        if positions.numel() == 0:
            return
        assert held.index.values is not None
        slots = held.index.values.index_select(0, positions)
        rows = held.rows.index_select(0, slots)
        self.back.put(held.spec.name, held.index.keys.index_select(0, positions), rows)
        held.index.dirty[positions] = False
        self._stats["writebacks"] += positions.numel()

    def evict(self) -> None:
        """Over ``capacity_rows``: drop the held rows first in the shared victim order (least
        recently used, then lowest id: `bucket_index.lowest` over every table's index) down
        to a little below it (``capacity // 32``, so that the O(rows held) scan for victims
        runs once every few calls, not on each). The dirty victims of every table are written
        back first; only when every write succeeded is any row dropped."""
        helds = [held for held in self.tables.values() if len(held)]
        total = sum(len(held) for held in helds)
        if total <= self.capacity_rows:
            return
        excess = total - (self.capacity_rows - self.capacity_rows // _EVICT_SLACK)
        victims = lowest([held.index for held in helds], excess)
        for held, positions in zip(helds, victims, strict=True):
            self.write_back(held, positions[held.index.dirty[positions]])
        for held, positions in zip(helds, victims, strict=True):
            held.remove(positions)
            self._stats["evictions"] += positions.numel()
