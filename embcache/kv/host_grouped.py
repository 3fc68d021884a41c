"""`HostKV`'s grouped calls in one compiled pass, a part it holds (`GroupedPasses`).

A grouped call (`Store.get_grouped`, `put_grouped`, `get_grouped_into`, `put_grouped_from`)
over dense tables that all chose the compiled passes when declared (`DenseTable.compiled`), of
one row width, moves every table's rows in one call of `embcache.native`, rows to create
included (`native.gather_tables` reports them; they are made table by table). Anything else (a
table of another layout or not yet allocated, ids or slot storage the kernels cannot take)
answers None or False, and `HostKV` takes the tables one by one: no call tries one
implementation and then another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

import embcache.native as native
from embcache.indexing import copy_rows, true_at
from embcache.kv.base import IOStats, checked_ids
from embcache.kv.host_tables import DenseTable, Table, empty_rows


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
        """`HostKV.get_grouped` in one pass (`native.gather_tables`, which checks every id
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
            absent = native.gather_tables(
                tables=rows, created=created, limits=limits, ids=ids.numpy(), bounds=bounds,
                out=out.numpy(),
            )  # fmt: skip
        except native.OutOfRangeError:
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
        """`HostKV.put_grouped` of stored float32 rows in one pass (`native.scatter_tables`,
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
            native.scatter_tables(
                tables=tables_rows, created=created, limits=limits, ids=ids.numpy(),
                bounds=bounds, src=rows.detach().numpy(),
            )  # fmt: skip
        except native.OutOfRangeError:
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
        the slots (`native.gather_tables_into`, `HostKV.get_grouped_into`) or ``"written"``
        out of them (`native.scatter_tables_from`, `HostKV.put_grouped_from`), counted as its
        direction when it moved every row; False, with nothing moved, when it cannot (rows to
        create, a bad id or slot, another layout)."""
        reading = direction == "read"
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
            copy_rows(out, at, fresh)
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
        """``(rows, created, limits, bounds, spec)`` for `native.gather_tables` /
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
                native.array_list([r.numpy() for r, _ in arrays]),
                native.array_list([c.numpy() for _, c in arrays]),
            )
            kept = (arrays, lists, limits)
            self.typed[key] = kept
        _, (rows, created), limits = kept
        bounds = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
        return rows, created, limits, bounds, found[0].spec
