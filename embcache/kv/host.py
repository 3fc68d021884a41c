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

from embcache.hashing import mix64
from embcache.kv.base import IOStats, TableSpec, checked_ids, checked_rows

_EMPTY = -1  # key of a free hash slot; ids are non-negative, so it never collides with one
_MAX_LOAD = 0.5  # linear probing stays short (expected ~1.5 probes per hit) up to half full
_MIN_SLOTS = 64
_MIN_ROWS = 64


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class HashIndex:
    """Open-addressing map from non-negative int64 keys to int64 values, vectorised.

    Keys live in a power-of-two array of slots (``-1`` free) with linear probing from
    ``mix64(key) & (slots - 1)``. Lookups and inserts run as rounds over the keys still
    unresolved, each round one gather (or scatter) over all of them, so a batch costs as many
    rounds as its longest probe sequence, not one Python step per key. The index grows by
    rehashing (at least doubling) before an insert would take it past half full.

    Example:
        >>> index = HashIndex()
        >>> index.insert(torch.tensor([7, 2**62]), torch.tensor([0, 1]))
        >>> index.find(torch.tensor([2**62, 5, 7]))
        tensor([ 1, -1,  0])
    """

    def __init__(self, min_slots: int = _MIN_SLOTS) -> None:
        slots = _next_pow2(max(min_slots, 2))
        self._keys = torch.full((slots,), _EMPTY, dtype=torch.int64)
        self._values = torch.empty(slots, dtype=torch.int64)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def num_slots(self) -> int:
        """Slots allocated (a power of two, at least twice the number of keys)."""
        return self._keys.numel()

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._values.nbytes

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Value of each key, or -1 where the key is absent.

        Args:
            keys: int64 ``[n]``, non-negative.

        Returns:
            int64 ``[n]``.
        """
        found = torch.full_like(keys, -1)
        mask = self.num_slots - 1
        pending = torch.arange(keys.numel())  # positions in `keys` still probing
        pending_keys = keys
        slot = mix64(keys) & mask
        while pending.numel():
            held = self._keys.index_select(0, slot)
            hit = (held == pending_keys).nonzero().flatten()
            found[pending[hit]] = self._values.index_select(0, slot[hit])
            # A free slot ends the probe sequence (absent); another key means probe on.
            go_on = ((held != pending_keys) & (held != _EMPTY)).nonzero().flatten()
            pending = pending.index_select(0, go_on)
            pending_keys = pending_keys.index_select(0, go_on)
            slot = (slot.index_select(0, go_on) + 1) & mask
        return found

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``keys -> values``. The keys must be distinct and absent from the index.

        Args:
            keys: int64 ``[n]``, non-negative, distinct, none already present.
            values: int64 ``[n]``.
        """
        needed = self._size + keys.numel()
        if needed > _MAX_LOAD * self.num_slots:
            self._rehash(_next_pow2(int(needed / _MAX_LOAD)))  # at least doubles
        self._place(keys, values)
        self._size = needed

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All ``(keys, values)`` held, in slot order."""
        used = self._keys != _EMPTY
        return self._keys[used], self._values[used]

    def _rehash(self, slots: int) -> None:
        keys, values = self.items()
        self._keys = torch.full((slots,), _EMPTY, dtype=torch.int64)
        self._values = torch.empty(slots, dtype=torch.int64)
        self._place(keys, values)

    def _place(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write distinct absent keys into free slots, resolving collisions among them.

        Each round every pending key looks at its current slot; those that see it free all
        scatter their key there, and a read-back tells which one won each contested slot.
        Winners write their value; losers and keys that saw an occupied slot probe the next
        slot. A loser's slot is now occupied, so its probe chain stays unbroken for `find`.
        """
        mask = self.num_slots - 1
        slot = mix64(keys) & mask
        while keys.numel():
            free = (self._keys.index_select(0, slot) == _EMPTY).nonzero().flatten()
            free_slots, free_keys = slot[free], keys[free]
            # Repeated slots in free_slots: exactly one of their keys lands.
            self._keys.index_copy_(0, free_slots, free_keys)
            won = free[self._keys.index_select(0, free_slots) == free_keys]
            self._values.index_copy_(0, slot[won], values[won])
            lost = torch.ones(keys.numel(), dtype=torch.bool)
            lost[won] = False
            rest = lost.nonzero().flatten()
            keys, values = keys.index_select(0, rest), values.index_select(0, rest)
            slot = (slot.index_select(0, rest) + 1) & mask


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
        capacity = max(_MIN_ROWS, _next_pow2(n))
        rows = torch.empty(capacity, self.spec.row_width, dtype=torch.float32)
        rows[: self.count] = self.rows[: self.count]
        row_ids = torch.empty(capacity, dtype=torch.int64)
        row_ids[: self.count] = self.row_ids[: self.count]
        self.rows, self.row_ids = rows, row_ids

    def get(self, ids: torch.Tensor, out: torch.Tensor) -> int:
        positions, created = self._locate(ids, init=True)
        torch.index_select(self.rows, 0, positions, out=out)
        return created

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


class HostKV:
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
            ValueError: the table exists with another ``dim`` or ``num_embeddings``.
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
        """Traffic through `get`/`put` since creation or the last `reset_io_stats`.

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
