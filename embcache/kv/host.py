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
grouped call over tables that all chose the compiled passes takes them, rows to create
included, and any other takes the tables one by one: no call tries one implementation and
then another. Every operation is vectorised over the ids of a call: no Python loop over ids, no
``.item()`` per id.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch

import embcache.native as native
from embcache.indexing import copy_rows, true_at
from embcache.kv.base import IOStats, Store, TableSpec, checked_ids, checked_rows
from embcache.kv.host_tables import BoundedTable, DenseTable, Table, make_table


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
        # `_dense_arrays`: per group of tables, their arrays and the kernels' lists of them.
        self._typed: dict[tuple[str, ...], tuple] = {}

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
            self._typed.clear()  # a re-declared table may get new arrays
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
        (`native.gather_tables`, which checks every id first), the rows never created then
        created table by table; any other call (a table of another layout or not yet
        allocated, pins) goes table by table through `get`."""
        if not (pins is not None and any(pins)):
            with self._lock:
                # Not allocated here: a table's first read allocates it through `get` (after
                # its init ran, so that an init that raises changes nothing).
                arrays = self._dense_arrays(tables, ids, counts)
                if arrays is not None:
                    rows, created, limits, bounds, spec = arrays
                    out = self._empty(spec, ids.numel())
                    try:
                        absent = native.gather_tables(
                            tables=rows, created=created, limits=limits, ids=ids.numpy(),
                            bounds=bounds, out=out.numpy(),
                        )  # fmt: skip
                    except native.OutOfRangeError:
                        self._check_ids(tables, ids, counts)  # the error naming the table
                        raise
                    if absent:
                        self._create_missing(tables, ids, bounds, out)
                    for table, n in zip(tables, counts, strict=True):
                        self._count("read", n, self._tables[table].spec)
                    return out
        return super().get_grouped(tables, ids, counts, pins)

    def _create_missing(
        self, tables: Sequence[str], ids: torch.Tensor, bounds: np.ndarray, out: torch.Tensor
    ) -> None:
        """The rows of a grouped read never created, created and written into ``out`` (the
        others gathered there already): every table's fresh rows made before any is stored,
        so that an init that raises changes nothing."""
        missing = []
        for k, name in enumerate(tables):
            t = self._tables[name]
            assert isinstance(t, DenseTable) and t.created is not None
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            at = true_at(~t.created.index_select(0, ids[lo:hi]))
            if at.numel():
                fresh_ids = ids[lo:hi].index_select(0, at)
                missing.append((t, at + lo, fresh_ids, t.spec.initial_rows(fresh_ids)))
        for t, at, fresh_ids, fresh in missing:
            t.put(fresh_ids, fresh.contiguous())
            copy_rows(out, at, fresh)
            self._stats["rows_created"] += fresh_ids.numel()

    def _check_ids(self, tables: Sequence[str], ids: torch.Tensor, counts: Sequence[int]) -> None:
        """`checked_ids` of each table's part of a grouped call: the error `get` and `put`
        give for a bad id."""
        start = 0
        for table, n in zip(tables, counts, strict=True):
            checked_ids(self._tables[table].spec, ids[start : start + n])
            start += n

    def put_grouped(
        self, tables: Sequence[str], ids: torch.Tensor, counts: Sequence[int], rows: torch.Tensor
    ) -> None:
        """`Store.put_grouped`: dense tables that chose the compiled passes take stored
        float32 rows in one (`native.scatter_tables`, which checks every id before writing
        any); any other call goes table by table through `put`."""
        with self._lock:
            arrays = self._dense_arrays(tables, ids, counts, allocate=True)
            if (
                arrays is not None
                and rows.dtype == torch.float32
                and rows.device.type == "cpu"
                and rows.dim() == 2
                and rows.shape == (ids.numel(), arrays[4].stored_width)
            ):
                tables_rows, created, limits, bounds, _ = arrays
                src = rows.detach().numpy()
                try:
                    native.scatter_tables(
                        tables=tables_rows, created=created, limits=limits, ids=ids.numpy(),
                        bounds=bounds, src=src,
                    )  # fmt: skip
                except native.OutOfRangeError:
                    self._check_ids(tables, ids, counts)  # the error naming the table
                    raise
                for table, n in zip(tables, counts, strict=True):
                    self._count("written", n, self._tables[table].spec)
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
        all exist, go to the slots in one (`native.gather_tables_into`), which checks every id
        and slot and that every row exists before moving any; anything else (rows to create,
        a bad id, another layout) is left to `get_grouped` (False)."""
        return self._straight("read", tables, ids, counts, weights, state, slots)

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
        from the slots in one (`native.scatter_tables_from`, which checks every id and slot before
        writing any); anything else is left to `put_grouped` (False)."""
        return self._straight("written", tables, ids, counts, weights, state, slots)

    def _straight(
        self,
        direction: str,
        tables: Sequence[str],
        ids: torch.Tensor,
        counts: Sequence[int],
        weights: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
    ) -> bool:
        """A straight move, ``"read"`` into the slots or ``"written"`` out of them, counted as
        its direction when it moved every row; False, with nothing moved, when it cannot."""
        reading = direction == "read"
        with self._lock:
            arrays = self._slot_arrays(tables, ids, counts, weights, state, slots, not reading)
            if arrays is None:
                return False
            rows, created, limits, bounds, _ = arrays
            move = native.gather_tables_into if reading else native.scatter_tables_from
            try:
                absent = move(
                    tables=rows, created=created, limits=limits, ids=ids.numpy(), bounds=bounds,
                    weights=weights.numpy(), state=state.numpy(), slots=slots.numpy(),
                )  # fmt: skip
            except native.OutOfRangeError:
                return False  # nothing moved: `get_grouped` / `put_grouped` raise as they say
            if absent:
                return False  # rows to create: nothing moved, `get_grouped` creates them
            for table, n in zip(tables, counts, strict=True):
                self._count(direction, n, self._tables[table].spec)
            return True

    def _slot_arrays(
        self,
        tables: Sequence[str],
        ids: torch.Tensor,
        counts: Sequence[int],
        weights: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        allocate: bool = False,
    ) -> tuple | None:
        """`_dense_arrays` for a move between the tables and slot storage, or None when the
        compiled pass cannot take it: storage that is not CPU float32 ``[S, dim]`` and ``[S,
        width]`` (contiguous, not requiring grad) with ``dim + width`` the tables' stored
        width, or ``slots`` that are not contiguous CPU int64 of ``ids``'s length."""
        for t in (weights, state):
            if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2:
                return None
            if not t.is_contiguous() or t.requires_grad:
                return None
        if weights.shape[0] != state.shape[0]:
            return None
        if slots.dtype != torch.int64 or slots.device.type != "cpu" or not slots.is_contiguous():
            return None
        if slots.shape != ids.shape:
            return None
        arrays = self._dense_arrays(tables, ids, counts, allocate=allocate)
        if arrays is None or arrays[4].stored_width != weights.shape[1] + state.shape[1]:
            return None
        return arrays

    def _dense_arrays(
        self,
        tables: Sequence[str],
        ids: torch.Tensor,
        counts: Sequence[int],
        allocate: bool = False,
    ) -> tuple | None:
        """``(rows, created, limits, bounds, spec)`` for `native.gather_tables` /
        `scatter_tables` over ``tables``, or None when a grouped call cannot take the compiled
        pass: a table that is not dense or did not choose the compiled passes when declared
        (`DenseTable.compiled`), ids that are not contiguous CPU int64 matching ``counts``, a
        table (unless ``allocate``) not yet allocated, tables of different row widths, or a
        subclass that overrides `get` or `put` (which then sees every call). The typed lists
        are kept while the arrays live."""
        if not tables:
            return None
        if type(self).get is not HostKV.get or type(self).put is not HostKV.put:
            return None
        if ids.dtype != torch.int64 or ids.device.type != "cpu" or not ids.is_contiguous():
            return None
        if sum(counts) != ids.numel() or len(counts) != len(tables):
            return None
        self._check_open()
        looked_up = [self._tables.get(name) for name in tables]
        found = [t for t in looked_up if isinstance(t, DenseTable) and t.compiled]
        if len(found) != len(looked_up):
            return None
        if len({t.spec.stored_width for t in found}) != 1:
            return None
        if allocate:
            for t in found:
                t.allocate()
        arrays = tuple(
            (t.rows, t.created) for t in found if t.rows is not None and t.created is not None
        )
        if len(arrays) != len(found):  # a table not allocated yet
            return None
        key = tuple(tables)
        kept = self._typed.get(key)
        if kept is None or any(
            a is not b or c is not d for (a, c), (b, d) in zip(kept[0], arrays, strict=True)
        ):
            limits = np.array([t.spec.num_embeddings for t in found], dtype=np.int64)
            lists = (
                native.array_list([r.numpy() for r, _ in arrays]),
                native.array_list([c.numpy() for _, c in arrays]),
            )
            kept = (arrays, lists, limits)
            self._typed[key] = kept
        _, (rows, created), limits = kept
        bounds = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
        return rows, created, limits, bounds, found[0].spec

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
            self._typed.clear()
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
        return torch.empty(n, spec.stored_width, dtype=spec.dtype, pin_memory=self.pin_memory)
