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
scores), and it frees a little more than it must so that it runs once every few calls. The held
rows, their write-back and eviction are a part `TieredKV` holds (`embcache.kv.held_rows`,
`HeldRows`), as is each table's `HeldTable`.

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
from embcache.kv.held_rows import HeldRows, HeldTable


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
        self._lock = threading.RLock()
        self._closed = False
        self._stats = IOStats(("hits", "misses", "evictions", "writebacks"))
        self._held = HeldRows(back, capacity_rows, self._stats)

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
            self._held.declare(spec)

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
            out, hit = held.serve(ids, touch=True)
            miss = ~hit
            if held.directory is None:
                self._held.fetch(held, ids, miss, out)
            else:
                self._held.get_bounded(held, ids, miss, out, pin)
            n_hits = int(hit.sum())
            self._stats["hits"] += n_hits
            self._stats["misses"] += ids.numel() - n_hits
            self._count("read", ids.numel(), held.spec)
            self._held.evict()
            return out

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
            out, hit = held.serve(ids, touch=False)
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
                    positions[new] = self._held.insert_bounded(held, ids[new], positions[~new])
                unpinned = positions[held.directory.pins[positions] == 0]
                held.directory.touch(unpinned)
            held.write(ids, rows)
            self._count("written", ids.numel(), held.spec)
            self._held.evict()

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
            self._held.write_back(held, held.dirty_positions())
            return self.back.row_count(table)

    def keeps_scores(self, table: str) -> bool:
        with self._lock:
            return self._table(table).directory is not None

    def flush(self) -> None:
        """Write every dirty row back (one ``back.put`` per table), then flush ``back``."""
        with self._lock:
            self._check_open()
            for held in self._held.tables.values():
                self._held.write_back(held, held.dirty_positions())
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
            self._held.write_back(held, held.dirty_positions())
            if held.directory is None:
                if scores:
                    raise ValueError(f"table {table!r} is not bounded: it keeps no scores")
                return self.back.export_rows(table, chunk_rows)
            ids, positions = held.directory.items()
        return self._bounded_chunks(held, ids, positions, chunk_rows, scores)

    def _bounded_chunks(
        self,
        held: HeldTable,
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
                    positions[new] = self._held.insert_bounded(held, ids[new], positions[~new])
                if scores is not None:
                    held.directory.set_scores(positions, scores.to(torch.int64))
            self.back.import_rows(table, ids, rows)
            held.refresh(ids, rows)

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
            return sum(len(held) for held in self._held.tables.values())

    def dirty_rows(self, table: str | None = None) -> int:
        """Held rows not yet written back (of one table, or all)."""
        with self._lock:
            helds = [self._table(table)] if table is not None else self._held.tables.values()
            return sum(int(held.index.dirty.sum()) for held in helds)

    def close(self) -> None:
        """Flush, then close ``back``. If the flush fails the store stays open (and every
        dirty row held), so the caller can retry."""
        with self._lock:
            if self._closed:
                return
            self.flush()
            self._closed = True
            self._held.tables.clear()
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

    def _table(self, name: str) -> HeldTable:
        self._check_open()
        return self._held.table(name)

    def _count(self, direction: str, n: int, spec: TableSpec) -> None:
        self._stats.count(direction, n, spec.row_bytes)
