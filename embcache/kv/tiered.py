"""TieredKV: a bounded host-memory write-back row cache in front of a slower `Store` (Redis).

The device cache evicts and refetches rows all the time; with a remote tier behind it each of
those trips crosses the network. `TieredKV` keeps the most recently used ``capacity_rows`` rows
(all tables together) in this process's memory:

* `get` serves the rows it holds and fetches the others from the back store in one batched
  call, keeping them (clean);
* `put` writes into the held rows (dirty), adding rows it did not hold;
* when more than ``capacity_rows`` rows are held, the least recently used go: the dirty ones
  are written back, one batched ``back.put`` per table, BEFORE any row of any table is
  dropped. If a write fails, nothing is dropped (the cache stays over capacity, every dirty
  row kept; those written already are kept clean) and the error propagates, so a later
  `flush` can still save every row;
* `flush` writes every dirty row back; `export_rows` flushes first, then reads the back store.

Each table's held rows live in one ``[slots, stored_width]`` tensor (the table's dtype) with a
free-slot stack; the shared index and policy core (`kv.bucket_index.BucketIndex`, the one
bounded tables use) maps ids to positions, each with its slot (the position's value), its LRU
score (ticks of one `Clock` for all tables, so scores compare across them) and its dirty flag.
The held rows share the index and the policy code, not the bucket geometry: their index is
growable (a full bucket doubles the buckets, it never evicts), and eviction is global, over
every table: `bucket_index.lowest` picks the held rows of lowest ``(score, id)`` across the
tables' indices, the same victim order a bounded bucket uses. A fixed bucketed cache would
evict the least recently used row of one bucket instead of the whole cache's, could not share
``capacity_rows`` between tables, and would have no room to keep every row when a write-back
fails or a call brings more rows than the capacity. Every operation is vectorised over the ids
of a call (no Python work per id); only eviction scans the held rows (a partition of their
scores), and it frees a little more than it must so that it runs once every few calls.

A bounded table (``spec.capacity``) is bounded here, whatever the back store: a `BoundedIndex`
directory lists the ids that exist (at most the capacity, with their scores and pins); a new id
evicts the unpinned id of lowest score of its bucket, whose row is dropped here and removed from
``back`` (`Store.remove`). A new id's row starts from the initialiser, held dirty, without a call
to ``back``; `read` and `export_rows` consult the directory, so a row that ``back`` still holds
after a failed removal is never seen again (its next write-back overwrites it).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import torch

from embcache.indexing import true_at
from embcache.kv.base import IOStats, Store, TableSpec, checked_ids, checked_rows
from embcache.kv.bounded import BoundedIndex
from embcache.kv.bucket_index import BucketIndex, Clock, lowest

_MIN_SLOTS = 64
_HELD_WAYS = 32  # ways per bucket of the held rows' index: a find compares 32 ids per id
_EVICT_SLACK = 32  # eviction frees capacity // 32 extra rows, so it runs every few calls


class _HeldTable:
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


class TieredKV(Store):
    """A `Store`: a bounded write-back row cache in host memory in front of ``back``.

    Args:
        back: the slower store holding every row (a `RedisKV`, or any `Store`).
        capacity_rows: most rows held here, all tables together (>= 1). One call may hold more
            while it runs; when it returns at most ``capacity_rows`` are held, unless writing
            evicted dirty rows back failed (then the call raised and every row is kept).

    Tables are declared through `init_table` (passed on to ``back``); a table ``back`` already
    knows is adopted on first use. Thread-safe: one lock around each call, back-store calls
    included (a row must not be fetched and written at once). `close` flushes, then closes
    ``back``.

    Example:
        >>> kv = TieredKV(HostKV(pin_memory=False), capacity_rows=2)  # RedisKV in practice
        >>> kv.init_table(TableSpec("t0", dim=2, num_embeddings=100))
        >>> kv.put("t0", torch.tensor([1, 2, 3]), torch.ones(3, 2))  # the LRU row goes back
        >>> kv.held_rows(), kv.dirty_rows(), kv.io_stats()["writebacks"]
        (2, 2, 1)
        >>> kv.flush()
        >>> kv.dirty_rows()
        0
    """

    parallel_io = False  # one lock around every call: concurrent calls would queue

    def __init__(self, back: Store, capacity_rows: int) -> None:
        if not isinstance(back, Store):
            raise TypeError(f"TieredKV back must implement Store, got {type(back).__name__}")
        if not isinstance(capacity_rows, int) or isinstance(capacity_rows, bool):
            raise TypeError(f"capacity_rows must be an int, got {capacity_rows!r}")
        if capacity_rows < 1:
            raise ValueError(f"capacity_rows must be >= 1, got {capacity_rows}")
        self.back = back
        self.capacity_rows = capacity_rows
        self._tables: dict[str, _HeldTable] = {}
        self._lock = threading.RLock()
        self._clock = Clock()  # the LRU clock of every table's held rows
        self._closed = False
        self._stats = IOStats(("hits", "misses", "evictions", "writebacks"))

    # -- tables ----------------------------------------------------------------------------

    def init_table(self, spec: TableSpec) -> None:
        """Declare a table on ``back`` (see `Store.init_table`); a bounded table is bounded
        here (``back`` is given the spec without the capacity).

        A re-declaration that changes the state layout first writes the table's dirty rows
        back and drops the rows held here, so ``back`` resets the state of every row.
        """
        if not isinstance(spec, TableSpec):
            raise TypeError(f"init_table expects a TableSpec, got {type(spec).__name__}")
        with self._lock:
            self._check_open()
            held = self._tables.get(spec.name)
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
                    self._write_back(held, held.dirty_positions())
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
            fresh = _HeldTable(
                declared, self._clock
            )  # nothing held: `back` has reset every row's state
            if held is not None:
                fresh.directory = held.directory  # which rows exist does not change
            self._tables[spec.name] = fresh

    def table_spec(self, table: str) -> TableSpec:
        with self._lock:
            return dataclasses.replace(self._table(table).spec)

    def tables(self) -> list[str]:
        with self._lock:
            self._check_open()
            return self.back.tables()

    # -- rows ------------------------------------------------------------------------------

    def get(self, table: str, ids: torch.Tensor, pin: bool = False) -> torch.Tensor:
        """Rows of ``ids``: held ones from memory, the others from ``back`` in one call (a
        bounded table's new ids from the initialiser, evicting as needed).

        Returns:
            stored rows ``[n, stored_width]``, a copy.
        """
        with self._lock:
            held = self._table(table)
            ids = checked_ids(held.spec, ids)
            positions, slots = held.lookup(ids)
            hit = slots >= 0
            out = torch.empty(ids.numel(), held.spec.stored_width, dtype=held.spec.dtype)
            out[hit] = held.rows[slots[hit]]
            held.index.touch(positions[hit])  # before an insert moves positions
            miss = ~hit
            if held.directory is None:
                missing, inverse = torch.unique(ids[miss], return_inverse=True)
                if missing.numel():
                    fetched = self.back.get(table, missing)
                    out[miss] = fetched[inverse]
                    held.insert(missing, fetched, dirty=False)
            else:
                self._get_bounded(held, ids, miss, out, pin)
            n_hits = int(hit.sum())
            self._stats["hits"] += n_hits
            self._stats["misses"] += ids.numel() - n_hits
            self._count("read", ids.numel(), held.spec)
            self._evict()
            return out

    def _get_bounded(
        self,
        held: _HeldTable,
        ids: torch.Tensor,
        miss: torch.Tensor,
        out: torch.Tensor,
        pin: bool,
    ) -> None:
        """`get` of a bounded table: ids it lists but does not hold come from ``back``, new
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
            placed = self._insert_bounded(held, new_ids, positions[~new])
            positions[new] = placed[new_at]
            out[new] = fresh[new_at]
            held.insert(new_ids, fresh, dirty=True)
            self._stats["rows_created"] += fresh.shape[0]
        if pin:
            directory.pin(positions)
        else:
            directory.touch(positions)

    def _insert_bounded(
        self, held: _HeldTable, new: torch.Tensor, guard: torch.Tensor
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

    def read(self, table: str, ids: torch.Tensor, pin: bool = False) -> torch.Tensor:
        """Rows of ``ids`` without creating any: held ones from memory, the others from
        ``back.read``. Rows read from ``back`` are not held, so a whole-table read
        (``state_dict()``) does not push the working set out. ``pin``: a bounded table's rows
        that exist are pinned until `unpin` (absent ones are not).

        Returns:
            stored rows ``[n, stored_width]``, a copy.
        """
        with self._lock:
            held = self._table(table)
            ids = checked_ids(held.spec, ids)
            _, slots = held.lookup(ids)
            hit = slots >= 0
            out = torch.empty(ids.numel(), held.spec.stored_width, dtype=held.spec.dtype)
            out[hit] = held.rows[slots[hit]]
            absent = torch.zeros_like(hit)
            if held.directory is not None:  # evicted rows read as their initial values
                listed = held.directory.find(ids)
                absent = ~hit & (listed < 0)
                if bool(absent.any()):
                    out[absent] = held.spec.initial_rows(ids[absent])
                if pin:
                    held.directory.pin(listed[listed >= 0])
            rest = ~hit & ~absent
            if bool(rest.any()):
                out[rest] = self.back.read(table, ids[rest])
            self._count("read", ids.numel(), held.spec)
            return out

    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write rows into host memory (dirty); they reach ``back`` on eviction or `flush`."""
        with self._lock:
            held = self._table(table)
            ids = checked_ids(held.spec, ids)
            rows = checked_rows(held.spec, ids, rows)
            if held.directory is not None:
                positions = held.directory.find(ids)
                new = positions < 0
                if bool(new.any()):
                    positions[new] = self._insert_bounded(held, ids[new], positions[~new])
                unpinned = positions[held.directory.pins[positions] == 0]
                held.directory.touch(unpinned)
            positions, slots = held.lookup(ids)
            hit = slots >= 0
            held.rows[slots[hit]] = rows[hit]
            held.index.dirty[positions[hit]] = True
            held.index.touch(positions[hit])  # before an insert moves positions
            miss = (~hit).nonzero().flatten()
            missing, inverse = torch.unique(ids[miss], return_inverse=True)
            # With repeated ids (the protocol says there are none) one of their rows is kept.
            source = torch.empty_like(missing).scatter_(0, inverse, miss)
            held.insert(missing, rows[source], dirty=True)
            self._count("written", ids.numel(), held.spec)
            self._evict()

    def unpin(self, table: str, ids: torch.Tensor) -> None:
        """Release one pin of each of ``ids`` of a bounded table (a no-op for others)."""
        with self._lock:
            held = self._table(table)
            if held.directory is not None:
                positions = held.directory.find(checked_ids(held.spec, ids))
                held.directory.unpin(positions[positions >= 0])

    def remove(self, table: str, ids: torch.Tensor) -> None:
        """Drop the rows of ``ids`` here and in ``back``."""
        with self._lock:
            held = self._table(table)
            ids = checked_ids(held.spec, ids)
            held.drop(ids)
            if held.directory is not None:
                positions = held.directory.find(ids)
                held.directory.remove(positions[positions >= 0])
            self.back.remove(table, ids)

    def row_count(self, table: str) -> int:
        """Rows of ``table`` that exist: a bounded table's directory, else ``back``'s after the
        dirty rows held here are written back."""
        with self._lock:
            held = self._table(table)
            if held.directory is not None:
                return len(held.directory)
            self._write_back(held, held.dirty_positions())
            return self.back.row_count(table)

    def keeps_scores(self, table: str) -> bool:
        with self._lock:
            return self._table(table).directory is not None

    def flush(self) -> None:
        """Write every dirty row back (one ``back.put`` per table), then flush ``back``."""
        with self._lock:
            self._check_open()
            for held in self._tables.values():
                self._write_back(held, held.dirty_positions())
            self.back.flush()

    @property
    def lease_owner(self) -> str | None:
        return self.back.lease_owner

    def tier_state(self, count_rows: bool = True) -> Any:
        """``back``'s (flush first: dirty rows here are not in it yet)."""
        return self.back.tier_state(count_rows)

    def unclean_ends(self) -> list[dict[str, Any]]:
        return self.back.unclean_ends()

    def save_run_record(self, name: str, record: dict[str, Any]) -> None:
        self.back.save_run_record(name, record)

    def run_record(self, name: str) -> dict[str, Any] | None:
        return self.back.run_record(name)

    def expect_state(self, state: Any) -> None:
        self.back.expect_state(state)

    # -- checkpoints -----------------------------------------------------------------------

    def export_rows(
        self, table: str, chunk_rows: int = 65536, scores: bool = False
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """The table's dirty rows are written back, then ``back.export_rows`` (its order); a
        bounded table lists its directory's ids ascending (with their scores on request) and
        reads their rows."""
        with self._lock:
            held = self._table(table)
            self._write_back(held, held.dirty_positions())
            if held.directory is None:
                if scores:
                    raise ValueError(f"table {table!r} is not bounded: it keeps no scores")
                return self.back.export_rows(table, chunk_rows)
            ids, positions = held.directory.items()
        return self._bounded_chunks(held, ids, positions, chunk_rows, scores)

    def _bounded_chunks(
        self,
        held: _HeldTable,
        ids: torch.Tensor,
        positions: torch.Tensor,
        chunk_rows: int,
        scores: bool,
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        assert held.directory is not None
        for start in range(0, ids.numel(), chunk_rows):
            part = ids[start : start + chunk_rows]
            rows = self.read(held.spec.name, part)
            if scores:
                yield part, rows, held.directory.scores[positions[start : start + chunk_rows]]
            else:
                yield part, rows

    def import_rows(
        self, table: str, ids: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor | None = None
    ) -> None:
        """Load rows into ``back``; copies held here take the new values (clean). A bounded
        table lists the ids (evicting as needed) with their scores when given."""
        with self._lock:
            held = self._table(table)
            ids = checked_ids(held.spec, ids)
            rows = checked_rows(held.spec, ids, rows)
            if held.directory is not None:
                positions = held.directory.find(ids)
                new = positions < 0
                if bool(new.any()):
                    positions[new] = self._insert_bounded(held, ids[new], positions[~new])
                if scores is not None:
                    held.directory.set_scores(positions, scores.to(torch.int64))
            self.back.import_rows(table, ids, rows)
            positions, slots = held.lookup(ids)
            hit = slots >= 0
            held.rows[slots[hit]] = rows[hit]
            held.index.dirty[positions[hit]] = False

    # -- accounting and life cycle ---------------------------------------------------------

    def io_stats(self) -> dict[str, int]:
        """Counters since creation or the last `reset_io_stats`.

        ``rows_read``/``rows_written``/``bytes_read``/``bytes_written``/``get_calls``/
        ``put_calls``: traffic through this store's `get`/`read`/`put` (as `HostKV` counts
        it); ``hits``/``misses``: ids of `get` served here or fetched from ``back``;
        ``evictions``: rows this host cache dropped for ``capacity_rows``; ``writebacks``: dirty
        rows written to ``back`` (by eviction or flush); ``rows_created``: new rows of bounded
        tables; ``tier_evictions``: rows of bounded tables evicted for their capacity (gone).
        """
        with self._lock:
            return dict(self._stats)

    def reset_io_stats(self) -> None:
        with self._lock:
            self._stats.reset()

    def held_rows(self, table: str | None = None) -> int:
        """Rows held in host memory (of one table, or all)."""
        with self._lock:
            if table is not None:
                return len(self._table(table))
            return sum(len(held) for held in self._tables.values())

    def dirty_rows(self, table: str | None = None) -> int:
        """Held rows not yet written back (of one table, or all)."""
        with self._lock:
            helds = [self._table(table)] if table is not None else self._tables.values()
            return sum(int(held.index.dirty.sum()) for held in helds)

    def close(self) -> None:
        """Flush, then close ``back``. If the flush fails the store stays open (and every
        dirty row held), so the caller can retry."""
        with self._lock:
            if self._closed:
                return
            self.flush()
            self._closed = True
            self._tables.clear()
            self.back.close()

    def __enter__(self) -> TieredKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TieredKV({self.back!r}, capacity_rows={self.capacity_rows})"

    # -- helpers (called with the lock held) -----------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TieredKV is closed")

    def _table(self, name: str) -> _HeldTable:
        self._check_open()
        held = self._tables.get(name)
        if held is None:  # declared on the back store directly: adopt it (unbounded here)
            held = _HeldTable(dataclasses.replace(self.back.table_spec(name)), self._clock)
            self._tables[name] = held
        return held

    def _write_back(self, held: _HeldTable, positions: torch.Tensor) -> None:
        """Write the rows at index ``positions`` to ``back`` (one call), then mark them clean."""
        if positions.numel() == 0:
            return
        assert held.index.values is not None
        slots = held.index.values.index_select(0, positions)
        rows = held.rows.index_select(0, slots)
        self.back.put(held.spec.name, held.index.keys.index_select(0, positions), rows)
        held.index.dirty[positions] = False
        self._stats["writebacks"] += positions.numel()

    def _evict(self) -> None:
        """Over ``capacity_rows``: drop the held rows first in the shared victim order (least
        recently used, then lowest id: `bucket_index.lowest` over every table's index) down
        to a little below it (``capacity // 32``, so that the O(rows held) scan for victims
        runs once every few calls, not on each). The dirty victims of every table are written
        back first; only when every write succeeded is any row dropped."""
        helds = [held for held in self._tables.values() if len(held)]
        total = sum(len(held) for held in helds)
        if total <= self.capacity_rows:
            return
        excess = total - (self.capacity_rows - self.capacity_rows // _EVICT_SLACK)
        victims = lowest([held.index for held in helds], excess)
        for held, positions in zip(helds, victims, strict=True):
            self._write_back(held, positions[held.index.dirty[positions]])
        for held, positions in zip(helds, victims, strict=True):
            held.remove(positions)
            self._stats["evictions"] += positions.numel()

    def _count(self, direction: str, n: int, spec: TableSpec) -> None:
        self._stats.count(direction, n, spec.row_bytes)
