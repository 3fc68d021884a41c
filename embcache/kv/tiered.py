"""TieredKV: a bounded host-memory write-back row cache in front of a slower `Store` (Redis).

The device cache evicts and refetches rows all the time; with a remote tier behind it each of
those trips crosses the network. `TieredKV` keeps the most recently used ``capacity_rows`` rows
(all tables together) in this process's memory:

* `get` serves the rows it holds and fetches the others from the back store in one batched
  call, keeping them (clean);
* `put` writes into the held rows (dirty), adding rows it did not hold;
* when more than ``capacity_rows`` rows are held, the least recently used go: the dirty ones
  are written back in one batched ``back.put`` per table BEFORE anything is dropped. If that
  write fails, nothing is dropped (the cache stays over capacity, every dirty row kept) and
  the error propagates, so a later `flush` can still save every row;
* `flush` writes every dirty row back; `export_rows` flushes first, then reads the back store.

Each table's held rows live in one ``[slots, dim + state_dim]`` tensor with per-slot id, stamp
(last use) and dirty arrays; a vectorised open-addressing index maps ids to slots. Every
operation is vectorised over the ids of a call (no Python work per id); only eviction scans the
held rows (a ``topk`` of their stamps), and it frees a little more than it must so that it runs
once every few calls.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import torch

from embcache.kv.base import IOStats, Store, TableSpec, checked_ids, checked_rows
from embcache.kv.hash_index import HashIndex

_MIN_SLOTS = 64
_FREE = -1  # slot_id of a free slot
_FREE_STAMP = 1 << 62  # stamp of a free slot: never among the least recently used
_EVICT_SLACK = 32  # eviction frees capacity // 32 extra rows, so it runs every few calls


class _HeldTable:
    """Rows of one table held in host memory: slot arrays, a free-slot stack and an id index."""

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        self.rows = torch.empty(0, spec.row_width, dtype=torch.float32)  # [slots, W]
        self.slot_id = torch.empty(0, dtype=torch.int64)  # id held by each slot, -1 when free
        self.stamp = torch.empty(0, dtype=torch.int64)  # last use of each slot
        self.dirty = torch.empty(0, dtype=torch.bool)  # slot newer than the back store
        self.free = torch.empty(0, dtype=torch.int64)  # free slots: a stack, top at free_top
        self.free_top = 0
        self.index = HashIndex()

    def __len__(self) -> int:
        return len(self.index)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id, -1 where the id is not held. int64 ``[n]``."""
        return self.index.find(ids)

    def insert(self, ids: torch.Tensor, rows: torch.Tensor, dirty: bool, stamp: int) -> None:
        """Hold rows for ``ids`` (distinct, none held yet)."""
        k = ids.numel()
        if k == 0:
            return
        self._reserve(k)
        self.free_top -= k
        slots = self.free[self.free_top : self.free_top + k].clone()
        self.rows[slots] = rows
        self.slot_id[slots] = ids
        self.stamp[slots] = stamp
        self.dirty[slots] = dirty
        self.index.insert(ids, slots)

    def remove(self, slots: torch.Tensor) -> None:
        """Stop holding the rows in ``slots`` (distinct, held)."""
        k = slots.numel()
        if k == 0:
            return
        self.index.remove(self.slot_id[slots])
        self.slot_id[slots] = _FREE
        self.stamp[slots] = _FREE_STAMP
        self.dirty[slots] = False
        self.free[self.free_top : self.free_top + k] = slots
        self.free_top += k

    def dirty_slots(self) -> torch.Tensor:
        """Held slots with rows newer than the back store, in ascending id order."""
        slots = self.dirty.nonzero().flatten()
        return slots[torch.argsort(self.slot_id[slots])]

    def _reserve(self, k: int) -> None:
        if self.free_top >= k:
            return
        old = self.slot_id.numel()
        size = max(_MIN_SLOTS, 2 * old, len(self) + k)
        rows = torch.empty(size, self.spec.row_width, dtype=torch.float32)
        rows[:old] = self.rows
        self.rows = rows
        self.slot_id = torch.cat([self.slot_id, torch.full((size - old,), _FREE)])
        self.stamp = torch.cat([self.stamp, torch.full((size - old,), _FREE_STAMP)])
        self.dirty = torch.cat([self.dirty, torch.zeros(size - old, dtype=torch.bool)])
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
        self._clock = 0
        self._closed = False
        self._stats = IOStats(("hits", "misses", "evictions", "writebacks"))

    # -- tables ----------------------------------------------------------------------------

    def init_table(self, spec: TableSpec) -> None:
        """Declare a table on ``back`` (see `Store.init_table`).

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
                for field in ("dim", "num_embeddings"):
                    if getattr(old, field) != getattr(spec, field):
                        raise ValueError(
                            f"table {spec.name!r} is declared with {field}="
                            f"{getattr(old, field)}; cannot re-declare it with {field}="
                            f"{getattr(spec, field)}"
                        )
                if (old.state_dim, old.state_init) != (spec.state_dim, spec.state_init):
                    self._write_back(held, held.dirty_slots())
                    del self._tables[spec.name]
            self.back.init_table(spec)
            spec = self.back.table_spec(spec.name)
            if spec.name in self._tables:
                self._tables[spec.name].spec = spec
            else:
                self._tables[spec.name] = _HeldTable(spec)

    def table_spec(self, table: str) -> TableSpec:
        with self._lock:
            self._check_open()
            return self.back.table_spec(table)

    def tables(self) -> list[str]:
        with self._lock:
            self._check_open()
            return self.back.tables()

    # -- rows ------------------------------------------------------------------------------

    def get(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids``: held ones from memory, the others from ``back`` in one call.

        Returns:
            float32 ``[n, dim + state_dim]``, a copy.
        """
        with self._lock:
            held = self._table(table)
            ids = checked_ids(held.spec, ids)
            stamp = self._tick()
            slots = held.lookup(ids)
            hit = slots >= 0
            out = torch.empty(ids.numel(), held.spec.row_width, dtype=torch.float32)
            out[hit] = held.rows[slots[hit]]
            miss = ~hit
            missing, inverse = torch.unique(ids[miss], return_inverse=True)
            if missing.numel():
                fetched = self.back.get(table, missing)
                out[miss] = fetched[inverse]
                held.insert(missing, fetched, dirty=False, stamp=stamp)
            held.stamp[slots[hit]] = stamp
            n_hits = int(hit.sum())
            self._stats["hits"] += n_hits
            self._stats["misses"] += ids.numel() - n_hits
            self._count("read", ids.numel(), held.spec)
            self._evict()
            return out

    def read(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` without creating any: held ones from memory, the others from
        ``back.read``. Rows read from ``back`` are not held, so a whole-table read
        (``state_dict()``) does not push the working set out.

        Returns:
            float32 ``[n, dim + state_dim]``, a copy.
        """
        with self._lock:
            held = self._table(table)
            ids = checked_ids(held.spec, ids)
            slots = held.lookup(ids)
            hit = slots >= 0
            out = torch.empty(ids.numel(), held.spec.row_width, dtype=torch.float32)
            out[hit] = held.rows[slots[hit]]
            if not bool(hit.all()):
                out[~hit] = self.back.read(table, ids[~hit])
            self._count("read", ids.numel(), held.spec)
            return out

    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write rows into host memory (dirty); they reach ``back`` on eviction or `flush`."""
        with self._lock:
            held = self._table(table)
            ids = checked_ids(held.spec, ids)
            rows = checked_rows(held.spec, ids, rows)
            stamp = self._tick()
            slots = held.lookup(ids)
            hit = slots >= 0
            hit_slots = slots[hit]
            held.rows[hit_slots] = rows[hit]
            held.dirty[hit_slots] = True
            held.stamp[hit_slots] = stamp
            miss = (~hit).nonzero().flatten()
            missing, inverse = torch.unique(ids[miss], return_inverse=True)
            # With repeated ids (the protocol says there are none) one of their rows is kept.
            source = torch.empty_like(missing).scatter_(0, inverse, miss)
            held.insert(missing, rows[source], dirty=True, stamp=stamp)
            self._count("written", ids.numel(), held.spec)
            self._evict()

    def flush(self) -> None:
        """Write every dirty row back (one ``back.put`` per table), then flush ``back``."""
        with self._lock:
            self._check_open()
            for held in self._tables.values():
                self._write_back(held, held.dirty_slots())
            self.back.flush()

    @property
    def lease_owner(self) -> str | None:
        return self.back.lease_owner

    # -- checkpoints -----------------------------------------------------------------------

    def export_rows(
        self, table: str, chunk_rows: int = 65536
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The table's dirty rows are written back, then ``back.export_rows`` (its order)."""
        with self._lock:
            held = self._table(table)
            self._write_back(held, held.dirty_slots())
            return self.back.export_rows(table, chunk_rows)

    def import_rows(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Load rows into ``back``; copies held here take the new values (clean)."""
        with self._lock:
            held = self._table(table)
            ids = checked_ids(held.spec, ids)
            rows = checked_rows(held.spec, ids, rows)
            self.back.import_rows(table, ids, rows)
            slots = held.lookup(ids)
            hit = slots >= 0
            held.rows[slots[hit]] = rows[hit]
            held.dirty[slots[hit]] = False

    # -- accounting and life cycle ---------------------------------------------------------

    def io_stats(self) -> dict[str, int]:
        """Counters since creation or the last `reset_io_stats`.

        ``rows_read``/``rows_written``/``bytes_read``/``bytes_written``/``get_calls``/
        ``put_calls``: traffic through this store's `get`/`read`/`put` (as `HostKV` counts
        it); ``hits``/``misses``: ids of `get` served here or fetched from ``back``;
        ``evictions``: rows dropped for capacity; ``writebacks``: dirty rows written to
        ``back`` (by eviction or flush).
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
            return sum(held.dirty_slots().numel() for held in helds)

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
        if held is None:  # declared on the back store directly: adopt it
            held = _HeldTable(dataclasses.replace(self.back.table_spec(name)))
            self._tables[name] = held
        return held

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _write_back(self, held: _HeldTable, slots: torch.Tensor) -> None:
        """Write the rows in ``slots`` to ``back`` (one call), then mark them clean."""
        if slots.numel() == 0:
            return
        self.back.put(held.spec.name, held.slot_id[slots], held.rows[slots])
        held.dirty[slots] = False
        self._stats["writebacks"] += slots.numel()

    def _evict(self) -> None:
        """Over ``capacity_rows``: drop least recently used rows down to a little below it
        (``capacity // 32``, so that the O(rows held) scan for victims runs once every few
        calls, not on each), writing the dirty ones back first, one table at a time."""
        helds = [held for held in self._tables.values() if len(held)]
        total = sum(len(held) for held in helds)
        if total <= self.capacity_rows:
            return
        excess = total - (self.capacity_rows - self.capacity_rows // _EVICT_SLACK)
        stamps = torch.cat([held.stamp for held in helds])  # free slots: _FREE_STAMP, last
        victims = torch.topk(stamps, excess, largest=False, sorted=False).indices
        starts = torch.tensor([0] + [held.stamp.numel() for held in helds]).cumsum(0)
        for k, held in enumerate(helds):
            mine = victims[(victims >= starts[k]) & (victims < starts[k + 1])] - starts[k]
            if mine.numel() == 0:
                continue
            self._write_back(held, mine[held.dirty[mine]])
            held.remove(mine)
            self._stats["evictions"] += mine.numel()

    def _count(self, direction: str, n: int, spec: TableSpec) -> None:
        self._stats.count(direction, n, spec.row_width * 4)
