"""How `HostKV` lays out a table in host memory, behind one interface (`make_table`), and the
compiled passes of its dense tables.

* `DenseTable` (``num_embeddings`` given, no capacity): a dense ``[N, stored_width]`` array of
  the table's dtype, allocated on first touch in huge pages (`embcache.hostmem`: pages never
  written cost nothing, 2 MiB at a time), plus a bool ``created`` mask;
* `HashTable` and `BoundedTable` (`kv.indexed_tables`): no ``num_embeddings`` (any
  non-negative int64 id, through a hash index), or a ``capacity`` (a bounded index whose new
  rows evict the unpinned rows of lowest score of their bucket).

Every layout creates a row on first touch with ``spec.initial_rows`` (one vectorised call per
batch of missing ids, run before anything changes, so an init that raises changes nothing).
The `HostKV` lock is held around every call.

A dense table chooses its row moves once, when declared (`DenseTable.compiled`): the compiled
passes here (float32 rows, where the rows family bound for the CPU is the compiled one), or
torch ops. A read that finds rows never created creates them within the same implementation;
it does not try another.

`GroupedPasses`, a part `HostKV` holds, makes its grouped calls (`Store.get_grouped`,
`put_grouped`, `get_grouped_into`, `put_grouped_from`) over dense tables that all chose the
compiled passes, of one row width, in one compiled pass, rows to create included
(`gather_tables` reports them; they are made table by table). Anything else (a table of
another layout or not yet allocated, ids or slot storage the kernels cannot take) answers None
or False, and `HostKV` takes the tables one by one.

The passes (`gather_created`, `scatter_created`, `gather_tables`, `scatter_tables`,
`gather_tables_into`, `scatter_tables_from`) call numba's kernels (`native.row_kernels`,
imported at the first call) over numpy views (no copy); a position out of range raises
`native.OutOfRangeError` before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from embcache.hostmem import host_zeros
from embcache.indexing import select, true_at
from embcache.kv.base import IOStats, TableSpec, checked_ids, host_memory_bytes
from embcache.kv.indexed_tables import BoundedTable, HashTable, widened
from embcache.native import OutOfRangeError
from embcache.ops.registry import ops_for

_NO_POSITIONS = torch.empty(0, dtype=torch.int64)


def empty_rows(spec: TableSpec, n: int, pin_memory: bool) -> torch.Tensor:
    """Uninitialised stored rows ``[n, stored_width]`` of ``spec.dtype`` (pinned memory when
    ``pin_memory``), for a call to fill and return."""
    return torch.empty(n, spec.stored_width, dtype=spec.dtype, pin_memory=pin_memory)


def check_dense_fits(spec: TableSpec) -> None:
    """A bounded table is one dense array, allocated at its first write (pages committed as
    rows are touched): refuse, before allocating, one larger than this machine's memory, which
    the allocator would refuse with a raw error (declaring it allocates nothing, so a model on
    the meta device may declare any size)."""
    if spec.num_embeddings is None or spec.capacity is not None:
        return
    need = spec.num_embeddings * (spec.row_bytes + 1)  # rows and the `created` mask
    have = host_memory_bytes()
    if need > have:
        raise ValueError(
            f"table {spec.name!r}: {spec.num_embeddings:,} rows of {spec.row_bytes} bytes "
            f"need {need:,} bytes as a dense host array, more than this machine's {have:,}; "
            "use num_embeddings=None (hashed ids: memory grows with the rows touched), a tier "
            "capacity (CacheConfig(tier_capacity=...)) or a Redis tier"
        )


class DenseTable:
    """A table of ``num_embeddings`` rows: row ``i`` of a dense array holds id ``i``.

    ``compiled``: its rows move through the compiled passes (`gather_created`,
    `scatter_created`, and `HostKV`'s grouped passes over several tables), chosen at
    declaration: float32 rows (numba has no half-precision type) where the rows family bound
    for the CPU runs them (``moves``: `ops.registry.ops_for`, which raises on a backend name
    that is none of the choices).
    """

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        self.moves = ops_for("cpu").rows  # rows and flags written at positions
        self.compiled = spec.dtype == torch.float32 and self.moves.compiled
        self.rows: torch.Tensor | None = None  # [N, stored_width], allocated on first touch
        self.created: torch.Tensor | None = None  # [N] bool

    def allocate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The table's rows and ``created`` mask, allocated at the first call."""
        if self.rows is None or self.created is None:
            n = self.spec.num_embeddings
            assert n is not None
            check_dense_fits(self.spec)  # a clear error, not the allocator's
            # Rows are read at random: huge pages spare the TLB (`embcache.hostmem`).
            self.rows = host_zeros((n, self.spec.stored_width), self.spec.dtype)
            self.created = torch.zeros(n, dtype=torch.bool)
        return self.rows, self.created

    def get(self, ids: torch.Tensor, out: torch.Tensor, pin: bool) -> int:
        """Gather rows of ``ids`` into ``out``, creating missing ones; returns rows created."""
        del pin  # nothing is evicted here
        if self.compiled:
            # One pass gathers the rows and counts those never created: at steady state none.
            if self.rows is not None and self.created is not None:
                absent = gather_created(
                    self.rows.numpy(), self.created.numpy(), ids.numpy(), out.numpy()
                )
                if not absent:
                    return 0
            return self.create_missing(ids, out)
        missing = ids if self.created is None else select(ids, ~self.created.index_select(0, ids))
        fresh = self.spec.initial_rows(missing) if missing.numel() else None
        rows, created = self.allocate()
        if fresh is not None:
            self.moves.copy_rows(rows, missing, fresh)
            self.moves.fill_at(created, missing, True)
        torch.index_select(rows, 0, ids, out=out)
        return missing.numel()

    def create_missing(self, ids: torch.Tensor, out: torch.Tensor) -> int:
        """Create the rows of ``ids`` never created and write them into ``out`` (``[n,
        stored_width]``, the rows of the others gathered already, as a compiled read leaves
        it); returns how many were created (a repeated id counted each time)."""
        if self.created is None:  # nothing allocated yet: every row is new
            fresh = self.spec.initial_rows(ids)  # before anything changes: it may raise
            self.put(ids, fresh.contiguous())
            out.copy_(fresh)
            return ids.numel()
        at = true_at(~self.created.index_select(0, ids))
        if not at.numel():
            return 0
        missing = ids.index_select(0, at)
        fresh = self.spec.initial_rows(missing)
        self.put(missing, fresh.contiguous())
        self.moves.copy_rows(out, at, fresh)
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
        rows, created = self.allocate()
        if self.compiled:
            scatter_created(rows.numpy(), created.numpy(), ids.numpy(), values.numpy())
            return
        self.moves.copy_rows(rows, ids, values)
        self.moves.fill_at(created, ids, True)

    def existing(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids ascending, positions of their rows)`` of the rows created so far."""
        if self.created is None:
            return _NO_POSITIONS, _NO_POSITIONS
        ids = self.created.nonzero().flatten()
        return ids, ids

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        assert self.rows is not None
        return self.rows.index_select(0, positions)

    def remove(self, ids: torch.Tensor) -> None:
        if self.created is not None:
            self.created[ids] = False

    def __len__(self) -> int:
        return 0 if self.created is None else int(self.created.sum())

    def redeclare(self, spec: TableSpec) -> None:
        """Adopt ``spec`` (same dim and num_embeddings); reset state columns if they changed."""
        if self.rows is not None and spec.state_dim != self.spec.state_dim:
            check_dense_fits(spec)  # the array is allocated again, wider
        old, self.spec = self.spec, spec
        if self.rows is None or self.created is None:
            return
        if (old.state_dim, old.state_init) != (spec.state_dim, spec.state_init):
            # Only the created rows: a whole-array copy would touch every page.
            self.rows = widened(spec, old, self.rows, self.created.nonzero().flatten())

    def nbytes(self) -> int:
        if self.rows is None or self.created is None:
            return 0
        return self.rows.nbytes + self.created.nbytes


Table = DenseTable | HashTable | BoundedTable


def make_table(spec: TableSpec) -> Table:
    """The layout for ``spec``: bounded by a capacity, dense, or hashed."""
    if spec.capacity is not None:
        return BoundedTable(spec)
    return DenseTable(spec) if spec.num_embeddings is not None else HashTable(spec)


class GroupedPasses:
    """The compiled passes of one `HostKV`'s grouped calls, and the kernels' typed lists of
    each group's arrays (kept while the arrays live). Called with the store's lock held.

    Args:
        tables: the store's tables by name (its own dict: declarations show through).
        stats: the store's traffic counters.
        pin_memory: return rows in pinned memory (as the store's `get` does).
        check_open: raises once the store is closed.
    """

    def __init__(
        self,
        tables: dict[str, Table],
        stats: IOStats,
        pin_memory: bool,
        check_open: Callable[[], None],
    ) -> None:
        self._tables = tables
        self._stats = stats
        self._pin_memory = pin_memory
        self._check_open = check_open
        # Per group of tables (their names), their arrays and the kernels' lists of them.
        self.typed: dict[tuple[str, ...], tuple] = {}

    def forget(self) -> None:
        """Drop every group's lists (a table re-declared may get new arrays)."""
        self.typed.clear()

    def get(
        self, tables: Sequence[str], ids: torch.Tensor, counts: Sequence[int]
    ) -> torch.Tensor | None:
        """`HostKV.get_grouped` in one pass (`gather_tables`, which checks every id
        first), the rows never created then created table by table; None when the pass cannot
        take the call (nothing read). A table not allocated yet is not taken: its first read
        allocates it through `HostKV.get` (after its init ran, so that an init that raises
        changes nothing)."""
        arrays = self._dense_arrays(tables, ids, counts)
        if arrays is None:
            return None
        rows, created, limits, bounds, spec = arrays
        out = empty_rows(spec, ids.numel(), self._pin_memory)
        try:
            absent = gather_tables(
                tables=rows, created=created, limits=limits, ids=ids.numpy(), bounds=bounds,
                out=out.numpy(),
            )  # fmt: skip
        except OutOfRangeError:
            self._check_ids(tables, ids, counts)  # the error naming the table
            raise
        if absent:
            self._create_missing(tables, ids, bounds, out)
        for table, n in zip(tables, counts, strict=True):
            self._stats.count("read", n, self._tables[table].spec.row_bytes)
        return out

    def put(
        self, tables: Sequence[str], ids: torch.Tensor, counts: Sequence[int], rows: torch.Tensor
    ) -> bool:
        """`HostKV.put_grouped` of stored float32 rows in one pass (`scatter_tables`,
        which checks every id before writing any); False when the pass cannot take the call
        (nothing written)."""
        arrays = self._dense_arrays(tables, ids, counts, allocate=True)
        if (
            arrays is None
            or rows.dtype != torch.float32
            or rows.device.type != "cpu"
            or rows.dim() != 2
            or rows.shape != (ids.numel(), arrays[4].stored_width)
        ):
            return False
        tables_rows, created, limits, bounds, _ = arrays
        try:
            scatter_tables(
                tables=tables_rows, created=created, limits=limits, ids=ids.numpy(),
                bounds=bounds, src=rows.detach().numpy(),
            )  # fmt: skip
        except OutOfRangeError:
            self._check_ids(tables, ids, counts)  # the error naming the table
            raise
        for table, n in zip(tables, counts, strict=True):
            self._stats.count("written", n, self._tables[table].spec.row_bytes)
        return True

    def move(
        self,
        direction: str,
        tables: Sequence[str],
        ids: torch.Tensor,
        counts: Sequence[int],
        weights: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
    ) -> bool:
        """A straight move between the tables and a CPU cache's slot storage, ``"read"`` into
        the slots (`gather_tables_into`, `HostKV.get_grouped_into`) or ``"written"``
        out of them (`scatter_tables_from`, `HostKV.put_grouped_from`), counted as its
        direction when it moved every row; False, with nothing moved, when it cannot (rows to
        create, a bad id or slot, another layout)."""
        reading = direction == "read"
        arrays = self._slot_arrays(tables, ids, counts, weights, state, slots, not reading)
        if arrays is None:
            return False
        rows, created, limits, bounds, _ = arrays
        move = gather_tables_into if reading else scatter_tables_from
        try:
            absent = move(
                tables=rows, created=created, limits=limits, ids=ids.numpy(), bounds=bounds,
                weights=weights.numpy(), state=state.numpy(), slots=slots.numpy(),
            )  # fmt: skip
        except OutOfRangeError:
            return False  # nothing moved: `get_grouped` / `put_grouped` raise as they say
        if absent:
            return False  # rows to create: nothing moved, `get_grouped` creates them
        for table, n in zip(tables, counts, strict=True):
            self._stats.count(direction, n, self._tables[table].spec.row_bytes)
        return True

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
            t.moves.copy_rows(out, at, fresh)
            self._stats["rows_created"] += fresh_ids.numel()

    def _check_ids(self, tables: Sequence[str], ids: torch.Tensor, counts: Sequence[int]) -> None:
        """`checked_ids` of each table's part of a grouped call: the error `HostKV.get` and
        `HostKV.put` give for a bad id."""
        start = 0
        for table, n in zip(tables, counts, strict=True):
            checked_ids(self._tables[table].spec, ids[start : start + n])
            start += n

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
        """``(rows, created, limits, bounds, spec)`` for `gather_tables` /
        `scatter_tables` over ``tables``, or None when a grouped call cannot take the compiled
        pass: a table that is not dense or did not choose the compiled passes when declared
        (`DenseTable.compiled`), ids that are not contiguous CPU int64 matching ``counts``, a
        table (unless ``allocate``) not yet allocated, or tables of different row widths. The
        typed lists are kept while the arrays live."""
        if not tables:
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
        kept = self.typed.get(key)
        if kept is None or any(
            a is not b or c is not d for (a, c), (b, d) in zip(kept[0], arrays, strict=True)
        ):
            limits = np.array([t.spec.num_embeddings for t in found], dtype=np.int64)
            lists = (
                array_list([r.numpy() for r, _ in arrays]),
                array_list([c.numpy() for _, c in arrays]),
            )
            kept = (arrays, lists, limits)
            self.typed[key] = kept
        _, (rows, created), limits = kept
        bounds = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
        return rows, created, limits, bounds, found[0].spec


# ----------------------------------------------------------------------------------------------
# the compiled passes of dense tables (numba's `native.row_kernels`, imported at the first call)
# ----------------------------------------------------------------------------------------------

_KERNELS: list[Any] = []  # [row_kernels]


def _kernels() -> Any:
    if not _KERNELS:
        from embcache.native import row_kernels

        _KERNELS.append(row_kernels)
    return _KERNELS[0]


def gather_created(rows: np.ndarray, created: np.ndarray, ids: np.ndarray, out: np.ndarray) -> int:
    """``out = rows[ids]`` (same dtype), returning how many of ``ids`` are not ``created``
    (a dense tier table's read; ids in range)."""
    return _kernels().gather_created(rows, created, ids, out)


def scatter_created(
    rows: np.ndarray, created: np.ndarray, ids: np.ndarray, src: np.ndarray
) -> None:
    """``rows[ids] = src`` and ``created[ids] = True`` (a dense tier table's write; ids in
    range)."""
    _kernels().scatter_created(rows, created, ids, src)


def array_list(arrays: list[np.ndarray]) -> Any:
    """``arrays`` (of one dtype, rank and layout) as a list the kernels can take (numba's typed
    list: building one costs about 2 us an array, so callers keep it while the arrays live)."""
    from numba import typed

    return typed.List(arrays)


def _bad_id(limits: np.ndarray, ids: np.ndarray, bounds: np.ndarray, at: int) -> OutOfRangeError:
    """The error for the kernels' first bad position ``at`` of a grouped call."""
    table = int(np.searchsorted(bounds, at, side="right")) - 1
    return OutOfRangeError(f"id of table {table}", int(ids[at]), at, int(limits[table]))


def gather_tables(
    tables: Any,
    created: Any,
    limits: np.ndarray,
    ids: np.ndarray,
    bounds: np.ndarray,
    out: np.ndarray,
) -> int:
    """`gather_created` over several dense tables in one pass: ids ``bounds[t] .. bounds[t +
    1]`` are rows of ``tables[t]`` (typed lists of `array_list`; ``created[t]`` its mask, ids
    valid below ``limits[t]``), gathered into ``out`` in order. Returns how many are not
    created (their rows are gathered as they stand).

    Raises:
        OutOfRangeError: an id out of its table's range (nothing is written).
    """
    found = _kernels().gather_tables(tables, created, limits, ids, bounds, out)
    if found < 0:
        raise _bad_id(limits, ids, bounds, -1 - found)
    return found


def scatter_tables(
    tables: Any,
    created: Any,
    limits: np.ndarray,
    ids: np.ndarray,
    bounds: np.ndarray,
    src: np.ndarray,
) -> None:
    """`scatter_created` over several dense tables in one pass (ids as `gather_tables` takes
    them), every id checked first.

    Raises:
        OutOfRangeError: an id out of its table's range (nothing is written).
    """
    bad = _kernels().scatter_tables(tables, created, limits, ids, bounds, src)
    if bad >= 0:
        raise _bad_id(limits, ids, bounds, bad)


def _bad_id_or_slot(
    limits: np.ndarray, ids: np.ndarray, bounds: np.ndarray, slots: np.ndarray, rows: int, at: int
) -> OutOfRangeError:
    table = int(np.searchsorted(bounds, at, side="right")) - 1
    if 0 <= ids[at] < limits[table]:
        return OutOfRangeError("slot", int(slots[at]), at, rows)
    return _bad_id(limits, ids, bounds, at)


def gather_tables_into(
    tables: Any,
    created: Any,
    limits: np.ndarray,
    ids: np.ndarray,
    bounds: np.ndarray,
    weights: np.ndarray,
    state: np.ndarray,
    slots: np.ndarray,
) -> int:
    """`gather_tables` straight into a cache's slot storage: the row of id ``i`` goes to
    ``weights[slots[i]]`` (its first ``dim`` values) and ``state[slots[i]]`` (the rest).
    Returns 0 when every row was moved, else how many rows are not created (and nothing is
    moved: every row must exist).

    Raises:
        OutOfRangeError: an id out of its table's range or a slot out of the storage (nothing is
            written).
    """
    found = _kernels().gather_tables_into(
        tables, created, limits, ids, bounds, weights, state, slots
    )
    if found < 0:
        raise _bad_id_or_slot(limits, ids, bounds, slots, weights.shape[0], -1 - found)
    return found


def scatter_tables_from(
    tables: Any,
    created: Any,
    limits: np.ndarray,
    ids: np.ndarray,
    bounds: np.ndarray,
    weights: np.ndarray,
    state: np.ndarray,
    slots: np.ndarray,
) -> None:
    """`scatter_tables` straight out of a cache's slot storage: id ``i``'s row is
    ``weights[slots[i]]`` then ``state[slots[i]]``, every id and slot checked first.

    Raises:
        OutOfRangeError: an id out of its table's range or a slot out of the storage (nothing is
            written).
    """
    bad = _kernels().scatter_tables_from(
        tables, created, limits, ids, bounds, weights, state, slots
    )
    if bad >= 0:
        raise _bad_id_or_slot(limits, ids, bounds, slots, weights.shape[0], bad)
