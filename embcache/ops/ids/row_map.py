"""A batch's ids deduplicated through a map over its cache's tables' rows instead of a sort.

A set-associative cache of bounded tables on a CPU keeps the slot of every row it holds
(`HotCache`'s row index), so its tables' rows are numbered: ``row_offset[table] + raw id``.
A batch dense enough for that numbering (at least one id per `IDS_PER_ROW_MAP` rows, or
`IDS_PER_ROW_BITMAP` through the compiled bitmap) is deduplicated by marking its rows in a
map and reading the marks back in order, which gives ``torch.unique(ids, sorted=True,
return_inverse=True)`` without sorting the batch. `RowDedup` owns the map and its ranks (the
torch specification, made on first use); the compiled bitmap is `ops.ids.native`'s.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import torch

from embcache.hostmem import host_zeros
from embcache.indexing import put, true_at

# `unique_by_rows` takes a batch through a map over its tables' rows from one id per this many
# rows (a sort of fewer ids is cheaper than passes over the map); through the compiled bitmap
# (`BitmapRowDedup`, a bit a row) from one id per `IDS_PER_ROW_BITMAP` rows.
IDS_PER_ROW_MAP = 40
IDS_PER_ROW_BITMAP = 500


def row_index(row_offset: torch.Tensor, keys: torch.Tensor, fusion_k: int) -> torch.Tensor:
    """Row of each fused key of a bounded table among all the tables' rows (``row_offset``:
    the first row of each table index, -1 for an unbounded one)."""
    return row_offset.index_select(0, keys >> fusion_k) + (keys & ((1 << fusion_k) - 1))


class RowDedup:
    """The dedup of a cache with a row index over ``index_rows`` rows (0: none, nothing is
    deduplicated here), through a map over those rows in torch ops (`IdsOps.row_dedup`).

    Args:
        row_offset: CPU int64 ``[max table index + 1]`` first row of each table.
        index_rows: rows of the cache's tables (0 when it keeps no row index).
        rows: the cache's tables' ``num_embeddings`` by table index (None: unbounded).
        fusion_k: bits of the raw id inside a fused id.
    """

    compiled = False  # the compiled bitmap's subclass (`ops.ids.native`) says True

    def __init__(
        self,
        row_offset: torch.Tensor,
        index_rows: int,
        rows: Mapping[int, int | None],
        fusion_k: int,
    ) -> None:
        self.row_offset = row_offset
        self.index_rows = index_rows
        self.rows = rows
        self.fusion_k = fusion_k
        # The torch path's map and ranks over the tables' rows (5 bytes a row); the compiled
        # dedup's bitmap (a bit a row) and ranks (4 bytes per 64 rows): all made on first use.
        self.row_map: torch.Tensor | None = None
        self.row_rank: torch.Tensor | None = None
        self.row_bits: torch.Tensor | None = None
        self.word_rank: np.ndarray | None = None
        self.row_starts: torch.Tensor | None = None  # first row of each table, ascending
        self.row_tables: torch.Tensor | None = None  # and the table's index
        self.lock = threading.Lock()  # one batch at a time through those

    def unique_by_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``torch.unique(ids, sorted=True, return_inverse=True)`` for valid fused ids of the
        cache's tables, through a map over the tables' rows instead of a sort: a batch that
        holds at least one id per `IDS_PER_ROW_MAP` rows (`IDS_PER_ROW_BITMAP` through the
        compiled bitmap) is deduplicated faster so. None when it holds fewer, or the cache
        keeps no row index (its tables are unbounded, or it is on a GPU or direct)."""
        if not self.dense_batch(ids.numel(), False):
            return None
        with self.lock:
            self.row_buffers(False)
            assert self.row_starts is not None and self.row_tables is not None
            assert self.row_map is not None and self.row_rank is not None
            rows = row_index(self.row_offset, ids, self.fusion_k)
            self.row_map.scatter_(0, rows, True)  # (the compiled dedup is the bitmap's)
            unique_rows = true_at(self.row_map)  # ascending: (table, id) order
            self.row_map.scatter_(0, unique_rows, False)  # all clear for the next batch
            put(self.row_rank, unique_rows, torch.arange(unique_rows.numel()))
            inverse = self.row_rank.index_select(0, rows).to(torch.int64)
        table = torch.searchsorted(self.row_starts, unique_rows, right=True) - 1
        raw = unique_rows - self.row_starts.index_select(0, table)
        unique = raw | (self.row_tables.index_select(0, table) << self.fusion_k)
        return unique, inverse

    def maps_batch(self, n: int) -> bool:
        """Whether `unique_values` takes a batch of ``n`` ids: the compiled kernels run, the
        cache keeps a row index and the batch is dense enough for the map over its rows."""
        return self.compiled and self.dense_batch(n, True)

    def row_ranges(self, tables: list[int] | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """For `unique_values`: the first row (among the cache's tables' rows) and the number
        of valid ids (``num_embeddings``, at most ``2**fusion_k``) of each of ``tables``
        (table indices), int64 ``[len(tables)]`` each."""
        bases = torch.tensor([int(self.row_offset[t]) for t in tables], dtype=torch.int64)
        rows = [self.rows[t] for t in tables]
        if any(r is None for r in rows):
            raise ValueError("row_ranges: unbounded tables have no rows to range over")
        limits = torch.tensor(rows, dtype=torch.int64).clamp(max=1 << self.fusion_k)
        return bases, limits

    def unique_values(
        self,
        values: torch.Tensor,
        bounds: torch.Tensor,
        ranges: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`unique_by_rows` of raw ids, checked and fused in the same compiled pass
        (`HotCache.unique_values` says more); None here, where no compiled pass runs."""
        return None

    def dense_batch(self, n: int, compiled: bool) -> bool:
        """Whether a batch of ``n`` ids is deduplicated through the map over the tables' rows
        (the cache keeps a row index, and the batch has enough ids for the map's size)."""
        per_row = IDS_PER_ROW_BITMAP if compiled else IDS_PER_ROW_MAP
        return bool(self.index_rows) and n * per_row >= self.index_rows

    def row_buffers(self, compiled: bool) -> None:
        """Make the table starts of `unique_by_rows` and, for the torch path (not
        ``compiled``), its map and ranks over the tables' rows (first use)."""
        if not compiled and self.row_map is None:
            self.row_map = torch.zeros(self.index_rows, dtype=torch.bool)
            self.row_rank = host_zeros((self.index_rows,), torch.int32)
        if self.row_starts is None:
            starts = sorted((int(self.row_offset[i]), i) for i in self.rows)
            self.row_starts = torch.tensor([start for start, _ in starts])
            self.row_tables = torch.tensor([idx for _, idx in starts])
