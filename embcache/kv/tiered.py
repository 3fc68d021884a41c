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

Each table's held rows live in one ``[slots, stored_width]`` tensor (the table's dtype) with
per-slot id, stamp (last use) and dirty arrays; a vectorised open-addressing index maps ids to
slots. Every operation is vectorised over the ids of a call (no Python work per id); only
eviction scans the held rows (a ``topk`` of their stamps), and it frees a little more than it
must so that it runs once every few calls.

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

from embcache.kv.base import IOStats, Store, TableSpec, checked_ids, checked_rows
from embcache.kv.bounded import BoundedIndex
from embcache.kv.hash_index import HashIndex

_MIN_SLOTS = 64
_FREE = -1  # slot_id of a free slot
_FREE_STAMP = 1 << 62  # stamp of a free slot: never among the least recently used
_EVICT_SLACK = 32  # eviction frees capacity // 32 extra rows, so it runs every few calls


class _HeldTable:
    """Rows of one table held in host memory: slot arrays, a free-slot stack and an id index."""

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        self.rows = torch.empty(0, spec.stored_width, dtype=spec.dtype)  # [slots, W]
        self.slot_id = torch.empty(0, dtype=torch.int64)  # id held by each slot, -1 when free
        self.stamp = torch.empty(0, dtype=torch.int64)  # last use of each slot
        self.dirty = torch.empty(0, dtype=torch.bool)  # slot newer than the back store
        self.free = torch.empty(0, dtype=torch.int64)  # free slots: a stack, top at free_top
        self.free_top = 0
        self.index = HashIndex()
        # Bounded tables: which ids exist (held here or in back), at most spec.capacity.
        self.directory = (
            BoundedIndex(spec.capacity, spec.score)  # type: ignore[arg-type]
            if spec.capacity is not None
            else None
        )

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

    def drop(self, ids: torch.Tensor) -> None:
        """Stop holding the rows of ``ids`` that are held, dirty or not (they were evicted)."""
        slots = self.lookup(ids)
        self.remove(slots[slots >= 0])

    def dirty_slots(self) -> torch.Tensor:
        """Held slots with rows newer than the back store, in ascending id order."""
        slots = self.dirty.nonzero().flatten()
        return slots[torch.argsort(self.slot_id[slots])]

    def _reserve(self, k: int) -> None:
        if self.free_top >= k:
            return
        old = self.slot_id.numel()
        size = max(_MIN_SLOTS, 2 * old, len(self) + k)
        rows = torch.empty(size, self.spec.stored_width, dtype=self.spec.dtype)
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
                    self._write_back(held, held.dirty_slots())
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
            fresh = _HeldTable(declared)  # nothing held: `back` has reset every row's state
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
            stamp = self._tick()
            slots = held.lookup(ids)
            hit = slots >= 0
            out = torch.empty(ids.numel(), held.spec.stored_width, dtype=held.spec.dtype)
            out[hit] = held.rows[slots[hit]]
            miss = ~hit
            if held.directory is None:
                missing, inverse = torch.unique(ids[miss], return_inverse=True)
                if missing.numel():
                    fetched = self.back.get(table, missing)
                    out[miss] = fetched[inverse]
                    held.insert(missing, fetched, dirty=False, stamp=stamp)
            else:
                self._get_bounded(held, ids, miss, out, pin, stamp)
            held.stamp[slots[hit]] = stamp
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
        stamp: int,
    ) -> None:
        """`get` of a bounded table: ids it lists but does not hold come from ``back``, new
        ids from the initialiser (held dirty), making room by evicting."""
        directory = held.directory
        assert directory is not None
        positions = directory.find(ids)
        new = miss & (positions < 0)
        stored = miss & (positions >= 0)
        fresh = held.spec.initial_rows(ids[new]) if bool(new.any()) else None
        if bool(stored.any()):
            fetched = self.back.get(held.spec.name, ids[stored])
            out[stored] = fetched
            held.insert(ids[stored], fetched, dirty=False, stamp=stamp)
        if fresh is not None:
            positions[new] = self._insert_bounded(held, ids[new], positions[~new])
            out[new] = fresh
            held.insert(ids[new], fresh, dirty=True, stamp=stamp)
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

    def read(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` without creating any: held ones from memory, the others from
        ``back.read``. Rows read from ``back`` are not held, so a whole-table read
        (``state_dict()``) does not push the working set out.

        Returns:
            stored rows ``[n, stored_width]``, a copy.
        """
        with self._lock:
            held = self._table(table)
            ids = checked_ids(held.spec, ids)
            slots = held.lookup(ids)
            hit = slots >= 0
            out = torch.empty(ids.numel(), held.spec.stored_width, dtype=held.spec.dtype)
            out[hit] = held.rows[slots[hit]]
            absent = torch.zeros_like(hit)
            if held.directory is not None:  # evicted rows read as their initial values
                absent = ~hit & (held.directory.find(ids) < 0)
                if bool(absent.any()):
                    out[absent] = held.spec.initial_rows(ids[absent])
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
            stamp = self._tick()
            if held.directory is not None:
                positions = held.directory.find(ids)
                new = positions < 0
                if bool(new.any()):
                    positions[new] = self._insert_bounded(held, ids[new], positions[~new])
                unpinned = positions[held.directory.pins[positions] == 0]
                held.directory.touch(unpinned)
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
            self._write_back(held, held.dirty_slots())
            return self.back.row_count(table)

    def keeps_scores(self, table: str) -> bool:
        with self._lock:
            return self._table(table).directory is not None

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

    def tier_state(self, count_rows: bool = True) -> Any:
        """``back``'s (flush first: dirty rows here are not in it yet)."""
        return self.back.tier_state(count_rows)

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
            self._write_back(held, held.dirty_slots())
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
        if held is None:  # declared on the back store directly: adopt it (unbounded here)
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
        self._stats.count(direction, n, spec.row_bytes)
