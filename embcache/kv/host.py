"""HostKV: the embedded default tier, rows held in this process's host memory.

Three table layouts behind one `Store` interface (`embcache.kv.host_tables`):

* tables of ``num_embeddings`` rows: a dense array of the table's dtype, allocated on first
  touch in huge pages (pages never written cost nothing), plus a bool ``created`` mask;
* unbounded tables (``num_embeddings is None``, any non-negative int64 id): a `HashIndex` from id
  to row position, and a growable row array in insertion order;
* tables with a ``capacity``: at most that many rows in buckets (`BoundedIndex`), evicting the
  unpinned rows of lowest score to make room; memory fixed at the capacity.

Either way a row is created on first touch by ``spec.initial_rows`` (one vectorised call per
batch of missing ids), so its initial value is a function of its id alone, never of the order
of access. A dense table chooses its row moves when declared (`DenseTable.compiled`); a
grouped call over tables that all chose the compiled passes takes them (a part `HostKV` holds,
`embcache.kv.host_tables.GroupedPasses`), rows to create included, and any other takes the
tables one by one: no call tries one implementation and then another. Every operation is
vectorised over the ids of a call: no Python loop over ids, no ``.item()`` per id.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence

import torch

from embcache.kv.base import IOStats, Store, TableSpec, checked_ids, checked_rows
from embcache.kv.host_tables import GroupedPasses, Table, empty_rows, make_table
from embcache.kv.indexed_tables import BoundedTable


class HostKV(Store):
    """The embedded default tier: every table in this process's host memory.

    Args:
        pin_memory: return `get` rows in pinned (page-locked) memory, so the cache's
            host-to-device copies can be asynchronous. None: pinned when CUDA is available.
            The tables themselves stay in pageable memory: pinning commits every page, which
            would defeat the lazy allocation of dense tables, and `get` copies rows out anyway.

    Thread-safe: one lock is held around each call, so a prefetch thread and the training
    thread may share a store.

    Example:
        >>> kv = HostKV(pin_memory=False)
        >>> kv.init_table(TableSpec("t0", dim=4, num_embeddings=100))
        >>> rows = kv.get("t0", torch.tensor([3, 97]))  # created by the initialiser
        >>> kv.put("t0", torch.tensor([3]), torch.ones(1, 4))
        >>> kv.get("t0", torch.tensor([3])).tolist()
        [[1.0, 1.0, 1.0, 1.0]]
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        elif pin_memory and not torch.cuda.is_available():
            raise ValueError("HostKV(pin_memory=True) needs CUDA, which is not available here")
        self.pin_memory = bool(pin_memory)
        self._tables: dict[str, Table] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._stats = IOStats()
        self._grouped = GroupedPasses(self._tables, self._stats, self.pin_memory, self._check_open)

    # -- tables ----------------------------------------------------------------------------

    def init_table(self, spec: TableSpec) -> None:
        """Declare a table, or re-declare one (see `Store.init_table`).

        Re-declaring with the same ``dim``, ``num_embeddings``, ``dtype``, ``capacity`` and
        ``score`` adopts the new spec: when
        ``state_dim`` or ``state_init`` differ, every existing row keeps its weights and gets
        fresh state columns of ``state_init``; rows not yet created will use the new spec's
        initialiser.

        Raises:
            TypeError: ``spec`` is not a `TableSpec`.
            ValueError: the table exists with another of those five fields, or its
                rows are allocated and wider state columns could not fit this machine's memory
                (refused before anything changes).
        """
        if not isinstance(spec, TableSpec):
            raise TypeError(f"init_table expects a TableSpec, got {type(spec).__name__}")
        spec = dataclasses.replace(spec)  # our own copy: the caller may mutate theirs
        with self._lock:
            self._check_open()
            table = self._tables.get(spec.name)
            if table is None:
                self._tables[spec.name] = make_table(spec)
                return
            self._grouped.forget()  # a re-declared table may get new arrays
            old = table.spec
            for field in ("dim", "num_embeddings", "dtype", "capacity", "score"):
                if getattr(old, field) != getattr(spec, field):
                    raise ValueError(
                        f"table {spec.name!r} is declared with {field}={getattr(old, field)}; "
                        f"cannot re-declare it with {field}={getattr(spec, field)}"
                    )
            table.redeclare(spec)

    def table_spec(self, table: str) -> TableSpec:
        """A copy of the spec ``table`` was (last) declared with."""
        with self._lock:
            return dataclasses.replace(self._table(table).spec)

    def tables(self) -> list[str]:
        """Declared table names, in declaration order."""
        with self._lock:
            self._check_open()
            return list(self._tables)

    # -- rows ------------------------------------------------------------------------------

    def get(self, table: str, ids: torch.Tensor, pin: bool = False) -> torch.Tensor:
        """Rows of ``ids``, creating those never touched.

        Args:
            table: a declared table.
            ids: integer ``[n]`` (converted to CPU int64), in range for the table.
            pin: hold the rows until `unpin` (a bounded table never evicts a pinned row).

        Returns:
            stored rows ``[n, stored_width]`` of the table's dtype, a copy (pinned memory when
            the store pins).

        Raises:
            TierCapacityError: a bounded table's bucket holds only pinned rows (nothing
                changed).
        """
        with self._lock:
            t = self._table(table)
            ids = checked_ids(t.spec, ids)
            out = self._empty(t.spec, ids.numel())
            created = t.get(ids, out, pin)
            self._count("read", ids.numel(), t.spec)
            self._stats["rows_created"] += created
            self._count_evictions(t)
            return out

    def read(self, table: str, ids: torch.Tensor, pin: bool = False) -> torch.Tensor:
        """Rows of ``ids`` without creating any: rows never touched read as their initial
        values and stay absent (`export_rows` does not list them).

        Args:
            table: a declared table.
            ids: integer ``[n]`` (converted to CPU int64), in range for the table.
            pin: hold the rows of a bounded table that exist until `unpin` (absent ones are
                not pinned).

        Returns:
            stored rows ``[n, stored_width]``, a copy (pinned when the store pins).
        """
        with self._lock:
            t = self._table(table)
            ids = checked_ids(t.spec, ids)
            out = self._empty(t.spec, ids.numel())
            t.read(ids, out)
            if pin and isinstance(t, BoundedTable):
                t.pin_existing(ids)
            self._count("read", ids.numel(), t.spec)
            return out

    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Overwrite (creating) the rows of ``ids``.

        Args:
            table: a declared table.
            ids: integer ``[n]`` (converted to CPU int64), in range for the table.
            rows: stored rows, or floating ``[n, dim + state_dim]`` (see `checked_rows`).
        """
        with self._lock:
            t = self._table(table)
            ids = checked_ids(t.spec, ids)
            rows = checked_rows(t.spec, ids, rows)
            t.put(ids, rows)
            self._count("written", ids.numel(), t.spec)
            self._count_evictions(t)

    def get_grouped(
        self,
        tables: Sequence[str],
        ids: torch.Tensor,
        counts: Sequence[int],
        pins: Sequence[bool] | None = None,
    ) -> torch.Tensor:
        """`Store.get_grouped`: dense tables that chose the compiled passes are read in one
        (`GroupedPasses.get`), the rows never created then created table by table; any other
        call (a table of another layout or not yet allocated, pins) goes table by table
        through `get`."""
        if not (pins is not None and any(pins)) and self._compiled_calls():
            with self._lock:
                out = self._grouped.get(tables, ids, counts)
            if out is not None:
                return out
        return super().get_grouped(tables, ids, counts, pins)

    def put_grouped(
        self, tables: Sequence[str], ids: torch.Tensor, counts: Sequence[int], rows: torch.Tensor
    ) -> None:
        """`Store.put_grouped`: dense tables that chose the compiled passes take stored
        float32 rows in one (`GroupedPasses.put`); any other call goes table by table through
        `put`."""
        if self._compiled_calls():
            with self._lock:
                if self._grouped.put(tables, ids, counts, rows):
                    return
        super().put_grouped(tables, ids, counts, rows)

    def get_grouped_into(
        self,
        tables: Sequence[str],
        ids: torch.Tensor,
        counts: Sequence[int],
        weights: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
    ) -> bool:
        """`Store.get_grouped_into`: dense tables that chose the compiled passes, whose rows
        all exist, go to the slots in one (`host_tables.gather_tables_into`), which checks every id
        and slot and that every row exists before moving any; anything else (rows to create,
        a bad id, another layout) is left to `get_grouped` (False)."""
        if not self._compiled_calls():
            return False
        with self._lock:
            return self._grouped.move("read", tables, ids, counts, weights, state, slots)

    def put_grouped_from(
        self,
        tables: Sequence[str],
        ids: torch.Tensor,
        counts: Sequence[int],
        weights: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
    ) -> bool:
        """`Store.put_grouped_from`: dense tables that chose the compiled passes take their rows
        from the slots in one (`host_tables.scatter_tables_from`, which checks every id and
        slot before writing any); anything else is left to `put_grouped` (False)."""
        if not self._compiled_calls():
            return False
        with self._lock:
            return self._grouped.move("written", tables, ids, counts, weights, state, slots)

    def _compiled_calls(self) -> bool:
        """Whether grouped calls may take the compiled passes: not in a subclass that
        overrides `get` or `put`, which then sees every call."""
        return type(self).get is HostKV.get and type(self).put is HostKV.put

    def unpin(self, table: str, ids: torch.Tensor) -> None:
        """Release one pin of each of ``ids`` (bounded tables; a no-op for others) and count
        the use in its score."""
        with self._lock:
            t = self._table(table)
            if isinstance(t, BoundedTable):
                t.unpin(checked_ids(t.spec, ids))

    def remove(self, table: str, ids: torch.Tensor) -> None:
        """Drop the rows of ``ids`` (absent ones ignored); touched again, they start from
        their initialiser."""
        with self._lock:
            t = self._table(table)
            t.remove(checked_ids(t.spec, ids))

    def row_count(self, table: str) -> int:
        """Rows of ``table`` that exist (at most its capacity, when bounded)."""
        with self._lock:
            return len(self._table(table))

    def pinned_rows(self, table: str) -> int:
        """Rows of a bounded table held pinned (0 for other tables)."""
        with self._lock:
            t = self._table(table)
            return t.index.pinned() if isinstance(t, BoundedTable) else 0

    def keeps_scores(self, table: str) -> bool:
        with self._lock:
            return isinstance(self._table(table), BoundedTable)

    # -- checkpoints -----------------------------------------------------------------------

    def export_rows(
        self, table: str, chunk_rows: int = 65536, scores: bool = False
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Every created row as ``(ids ascending, rows)`` chunks of at most ``chunk_rows``
        (``(ids, rows, scores)`` with ``scores``, for a bounded table).

        The set of ids is fixed when this is called; each chunk's rows are read under the lock
        when the chunk is produced. A checkpoint consistent across chunks needs the writers
        quiet (the cache flushed) while it is taken. Not counted by `io_stats`.
        """
        if not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        with self._lock:
            t = self._table(table)
            if scores and not isinstance(t, BoundedTable):
                raise ValueError(f"table {table!r} is not bounded: it keeps no scores")
            ids, positions = t.existing()
        return self._chunks(t, ids, positions, chunk_rows, scores)

    def _chunks(
        self, t: Table, ids: torch.Tensor, positions: torch.Tensor, chunk_rows: int, scores: bool
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        for start in range(0, ids.numel(), chunk_rows):
            stop = start + chunk_rows
            with self._lock:
                self._check_open()
                rows = t.gather(positions[start:stop])
                if scores:
                    assert isinstance(t, BoundedTable)
                    yield ids[start:stop], rows, t.scores(positions[start:stop])
                    continue
            yield ids[start:stop], rows

    def import_rows(
        self, table: str, ids: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor | None = None
    ) -> None:
        """Load checkpointed rows: `put` without counting in `io_stats`, restoring a bounded
        table's scores when given."""
        with self._lock:
            t = self._table(table)
            ids = checked_ids(t.spec, ids)
            rows = checked_rows(t.spec, ids, rows)
            t.put(ids, rows)
            if scores is not None and isinstance(t, BoundedTable):
                t.import_scores(ids, scores.to(torch.int64))
            self._count_evictions(t)

    # -- accounting and life cycle ---------------------------------------------------------

    def io_stats(self) -> dict[str, int]:
        """Traffic through `get`/`read`/`put` since creation or the last `reset_io_stats`.

        Keys: ``rows_read``, ``rows_written``, ``bytes_read``, ``bytes_written``, ``get_calls``,
        ``put_calls``, ``rows_created`` (rows made by the initialiser on first touch).
        """
        with self._lock:
            return dict(self._stats)

    def reset_io_stats(self) -> None:
        with self._lock:
            self._stats.reset()

    def memory_bytes(self) -> int:
        """Bytes allocated for all tables (rows, masks, hash index).

        Dense tables count their whole array, although pages never written are not resident.
        """
        with self._lock:
            return sum(t.nbytes() for t in self._tables.values())

    def close(self) -> None:
        """Drop every table. Any later call but `close` raises `RuntimeError`."""
        with self._lock:
            self._tables.clear()
            self._grouped.forget()
            self._closed = True

    # -- helpers (called with the lock held) -----------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("HostKV is closed")

    def _table(self, name: str) -> Table:
        self._check_open()
        table = self._tables.get(name)
        if table is None:
            raise KeyError(f"unknown table {name!r}; known tables: {sorted(self._tables)}")
        return table

    def _count(self, direction: str, n: int, spec: TableSpec) -> None:
        self._stats.count(direction, n, spec.row_bytes)

    def _count_evictions(self, t: Table) -> None:
        if isinstance(t, BoundedTable):
            self._stats["tier_evictions"] += t.evictions
            t.evictions = 0

    def _empty(self, spec: TableSpec, n: int) -> torch.Tensor:
        return empty_rows(spec, n, self.pin_memory)
