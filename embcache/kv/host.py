"""HostKV: the embedded default tier, rows held in this process's host memory.

Two table layouts behind one `Store` interface:

* bounded tables (``num_embeddings`` given): a dense ``[N, dim + state_dim]`` float32 array,
  allocated on first touch with ``torch.empty`` (pages never written cost nothing), plus a bool
  ``created`` mask;
* unbounded tables (``num_embeddings is None``, any non-negative int64 id): a `HashIndex` from id
  to row position, and a growable row array in insertion order.

Either way a row is created on first touch by ``spec.initial_rows`` (one vectorised call per
batch of missing ids), so its initial value is a function of its id alone, never of the order
of access. Every operation is vectorised over the ids of a call: no Python loop over ids, no
``.item()`` per id.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import torch

from embcache.kv.base import (
    IOStats,
    Store,
    TableSpec,
    checked_ids,
    checked_rows,
    host_memory_bytes,
)
from embcache.kv.hash_index import HashIndex, next_pow2

_MIN_ROWS = 64


class _DenseTable:
    """A bounded table: row ``i`` of a dense array holds id ``i``."""

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        self.rows: torch.Tensor | None = None  # [N, W] float32, allocated on first touch
        self.created: torch.Tensor | None = None  # [N] bool

    def _allocate(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rows is None or self.created is None:
            n = self.spec.num_embeddings
            assert n is not None
            _check_dense_fits(self.spec)  # a clear error, not the allocator's
            self.rows = torch.empty(n, self.spec.row_width, dtype=torch.float32)
            self.created = torch.zeros(n, dtype=torch.bool)
        return self.rows, self.created

    def get(self, ids: torch.Tensor, out: torch.Tensor) -> int:
        """Gather rows of ``ids`` into ``out``, creating missing ones; returns rows created."""
        missing = ids if self.created is None else ids[~self.created[ids]]
        # The initialiser runs before anything changes, so an init that raises changes nothing.
        fresh = self.spec.initial_rows(missing) if missing.numel() else None
        rows, created = self._allocate()
        if fresh is not None:
            rows.index_copy_(0, missing, fresh)
            created[missing] = True
        torch.index_select(rows, 0, ids, out=out)
        return missing.numel()

    def read(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Rows of ``ids`` into ``out``, initial values for rows never created (not stored)."""
        if self.rows is None or self.created is None:
            out.copy_(self.spec.initial_rows(ids))
            return
        torch.index_select(self.rows, 0, ids, out=out)
        absent = ~self.created[ids]
        if bool(absent.any()):
            out[absent] = self.spec.initial_rows(ids[absent])

    def put(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        rows, created = self._allocate()
        rows.index_copy_(0, ids, values)
        created[ids] = True

    def existing(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids ascending, positions of their rows)`` of the rows created so far."""
        if self.created is None:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty
        ids = self.created.nonzero().flatten()
        return ids, ids

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        assert self.rows is not None
        return self.rows.index_select(0, positions)

    def redeclare(self, spec: TableSpec) -> None:
        """Adopt ``spec`` (same dim and num_embeddings); reset state columns if they changed."""
        if self.rows is not None and spec.state_dim != self.spec.state_dim:
            _check_dense_fits(spec)  # the array is allocated again, wider
        old, self.spec = self.spec, spec
        if self.rows is None or self.created is None:
            return
        if (old.state_dim, old.state_init) == (spec.state_dim, spec.state_init):
            return
        ids = self.created.nonzero().flatten()
        if spec.state_dim != old.state_dim:
            # Copy only the created rows: a whole-array copy would touch every page.
            rows = torch.empty(self.rows.shape[0], spec.row_width, dtype=torch.float32)
            rows[ids, : spec.dim] = self.rows[ids, : spec.dim]
            self.rows = rows
        self.rows[ids, spec.dim :] = spec.state_init

    def nbytes(self) -> int:
        if self.rows is None or self.created is None:
            return 0
        return self.rows.nbytes + self.created.nbytes


class _HashTable:
    """An unbounded table: a `HashIndex` from id to row, rows in insertion order."""

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        self.index = HashIndex()
        self.count = 0
        self.rows = torch.empty(0, spec.row_width, dtype=torch.float32)
        self.row_ids = torch.empty(0, dtype=torch.int64)  # id of each row, for export

    def _locate(self, ids: torch.Tensor, init: bool) -> tuple[torch.Tensor, int]:
        """Row position of each id, appending rows for new ids; returns (positions, created).

        New rows are filled by the initialiser when ``init``, else left for the caller to write.
        The initialiser runs before anything changes, so an init that raises changes nothing.
        """
        positions = self.index.find(ids)
        absent = positions < 0
        if not bool(absent.any()):
            return positions, 0
        new_ids, inverse = torch.unique(ids[absent], return_inverse=True)
        fresh = self.spec.initial_rows(new_ids) if init else None
        n_new = new_ids.numel()
        self._reserve(self.count + n_new)
        new_positions = torch.arange(self.count, self.count + n_new)
        self.index.insert(new_ids, new_positions)
        self.row_ids[self.count : self.count + n_new] = new_ids
        if fresh is not None:
            self.rows[self.count : self.count + n_new] = fresh
        self.count += n_new
        positions[absent] = new_positions[inverse]
        return positions, n_new

    def _reserve(self, n: int) -> None:
        if n <= self.rows.shape[0]:
            return
        capacity = max(_MIN_ROWS, next_pow2(n))
        rows = torch.empty(capacity, self.spec.row_width, dtype=torch.float32)
        rows[: self.count] = self.rows[: self.count]
        row_ids = torch.empty(capacity, dtype=torch.int64)
        row_ids[: self.count] = self.row_ids[: self.count]
        self.rows, self.row_ids = rows, row_ids

    def get(self, ids: torch.Tensor, out: torch.Tensor) -> int:
        positions, created = self._locate(ids, init=True)
        torch.index_select(self.rows, 0, positions, out=out)
        return created

    def read(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        positions = self.index.find(ids)
        present = positions >= 0
        out[present] = self.rows[positions[present]]
        if not bool(present.all()):
            out[~present] = self.spec.initial_rows(ids[~present])

    def put(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        positions, _ = self._locate(ids, init=False)
        self.rows.index_copy_(0, positions, values)

    def existing(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids, order = torch.sort(self.row_ids[: self.count])
        return ids, order

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        return self.rows.index_select(0, positions)

    def redeclare(self, spec: TableSpec) -> None:
        old, self.spec = self.spec, spec
        if (old.state_dim, old.state_init) == (spec.state_dim, spec.state_init):
            return
        if spec.state_dim != old.state_dim:
            rows = torch.empty(self.rows.shape[0], spec.row_width, dtype=torch.float32)
            rows[: self.count, : spec.dim] = self.rows[: self.count, : spec.dim]
            self.rows = rows
        self.rows[: self.count, spec.dim :] = spec.state_init

    def nbytes(self) -> int:
        return self.rows.nbytes + self.row_ids.nbytes + self.index.nbytes


_Table = _DenseTable | _HashTable


def _check_dense_fits(spec: TableSpec) -> None:
    """A bounded table is one dense array, allocated at its first write (pages committed as
    rows are touched): refuse, before allocating, one larger than this machine's memory, which
    the allocator would refuse with a raw error (declaring it allocates nothing, so a model on
    the meta device may declare any size)."""
    if spec.num_embeddings is None:
        return
    need = spec.num_embeddings * (4 * spec.row_width + 1)  # rows and the `created` mask
    have = host_memory_bytes()
    if need > have:
        raise ValueError(
            f"table {spec.name!r}: {spec.num_embeddings:,} rows of {spec.row_width} float32 "
            f"need {need:,} bytes as a dense host array, more than this machine's {have:,}; "
            "use num_embeddings=None (hashed ids: memory grows with the rows touched) or a "
            "Redis tier"
        )


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
        self._tables: dict[str, _Table] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._stats = IOStats()

    # -- tables ----------------------------------------------------------------------------

    def init_table(self, spec: TableSpec) -> None:
        """Declare a table, or re-declare one (see `Store.init_table`).

        Re-declaring with the same ``dim`` and ``num_embeddings`` adopts the new spec: when
        ``state_dim`` or ``state_init`` differ, every existing row keeps its weights and gets
        fresh state columns of ``state_init``; rows not yet created will use the new spec's
        initialiser.

        Raises:
            TypeError: ``spec`` is not a `TableSpec`.
            ValueError: the table exists with another ``dim`` or ``num_embeddings``, or its
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
                bounded = spec.num_embeddings is not None
                self._tables[spec.name] = _DenseTable(spec) if bounded else _HashTable(spec)
                return
            old = table.spec
            for field in ("dim", "num_embeddings"):
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

    def get(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids``, creating those never touched.

        Args:
            table: a declared table.
            ids: integer ``[n]`` (converted to CPU int64), in range for the table.

        Returns:
            float32 ``[n, dim + state_dim]``, a copy (pinned when the store pins).
        """
        with self._lock:
            t = self._table(table)
            ids = checked_ids(t.spec, ids)
            out = torch.empty(
                ids.numel(), t.spec.row_width, dtype=torch.float32, pin_memory=self.pin_memory
            )
            created = t.get(ids, out)
            self._count("read", ids.numel(), t.spec)
            self._stats["rows_created"] += created
            return out

    def read(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` without creating any: rows never touched read as their initial
        values and stay absent (`export_rows` does not list them).

        Args:
            table: a declared table.
            ids: integer ``[n]`` (converted to CPU int64), in range for the table.

        Returns:
            float32 ``[n, dim + state_dim]``, a copy (pinned when the store pins).
        """
        with self._lock:
            t = self._table(table)
            ids = checked_ids(t.spec, ids)
            out = torch.empty(
                ids.numel(), t.spec.row_width, dtype=torch.float32, pin_memory=self.pin_memory
            )
            t.read(ids, out)
            self._count("read", ids.numel(), t.spec)
            return out

    def put(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Overwrite (creating) the rows of ``ids``.

        Args:
            table: a declared table.
            ids: integer ``[n]`` (converted to CPU int64), in range for the table.
            rows: floating ``[n, dim + state_dim]`` (converted to CPU float32).
        """
        with self._lock:
            t = self._table(table)
            ids = checked_ids(t.spec, ids)
            rows = checked_rows(t.spec, ids, rows)
            t.put(ids, rows)
            self._count("written", ids.numel(), t.spec)

    # -- checkpoints -----------------------------------------------------------------------

    def export_rows(
        self, table: str, chunk_rows: int = 65536
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every created row as ``(ids ascending, rows)`` chunks of at most ``chunk_rows``.

        The set of ids is fixed when this is called; each chunk's rows are read under the lock
        when the chunk is produced. A checkpoint consistent across chunks needs the writers
        quiet (the cache flushed) while it is taken. Not counted by `io_stats`.
        """
        if not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        with self._lock:
            t = self._table(table)
            ids, positions = t.existing()
        return self._chunks(t, ids, positions, chunk_rows)

    def _chunks(
        self, t: _Table, ids: torch.Tensor, positions: torch.Tensor, chunk_rows: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, ids.numel(), chunk_rows):
            stop = start + chunk_rows
            with self._lock:
                self._check_open()
                rows = t.gather(positions[start:stop])
            yield ids[start:stop], rows

    def import_rows(self, table: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Load checkpointed rows: `put` without counting in `io_stats`."""
        with self._lock:
            t = self._table(table)
            ids = checked_ids(t.spec, ids)
            rows = checked_rows(t.spec, ids, rows)
            t.put(ids, rows)

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
            self._closed = True

    # -- helpers (called with the lock held) -----------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("HostKV is closed")

    def _table(self, name: str) -> _Table:
        self._check_open()
        table = self._tables.get(name)
        if table is None:
            raise KeyError(f"unknown table {name!r}; known tables: {sorted(self._tables)}")
        return table

    def _count(self, direction: str, n: int, spec: TableSpec) -> None:
        self._stats.count(direction, n, spec.row_width * 4)
