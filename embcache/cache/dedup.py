"""A batch's ids deduplicated through a map over its cache's tables' rows instead of a sort.

A set-associative cache of bounded tables on a CPU keeps the slot of every row it holds
(`HotCache`'s row index), so its tables' rows are numbered: ``row_offset[table] + raw id``.
A batch dense enough for that numbering (at least one id per `IDS_PER_ROW_MAP` rows, or
`IDS_PER_ROW_BITMAP` through the compiled bitmap) is deduplicated by marking its rows in a
map and reading the marks back in order, which gives ``torch.unique(ids, sorted=True,
return_inverse=True)`` without sorting the batch. `RowDedup` owns the map, its ranks and the
compiled bitmap, made on first use.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import torch

import embcache.native as native
from embcache.backend import Backend
from embcache.hostmem import host_zeros
from embcache.indexing import fill_at, put, true_at
from embcache.kv.base import TableSpec

# `unique_by_rows` takes a batch through a map over its tables' rows from one id per this many
# rows (a sort of fewer ids is cheaper than passes over the map); through the compiled bitmap
# (`native.unique_rows`, a bit a row) from one id per `IDS_PER_ROW_BITMAP` rows.
IDS_PER_ROW_MAP = 40
IDS_PER_ROW_BITMAP = 500


def row_index(row_offset: torch.Tensor, keys: torch.Tensor, fusion_k: int) -> torch.Tensor:
    """Row of each fused key of a bounded table among all the tables' rows (``row_offset``:
    the first row of each table index, -1 for an unbounded one)."""
    return row_offset.index_select(0, keys >> fusion_k) + (keys & ((1 << fusion_k) - 1))


class RowDedup:
    """The dedup of a cache with a row index over ``index_rows`` rows (0: none, nothing is
    deduplicated here).

    Args:
        row_offset: CPU int64 ``[max table index + 1]`` first row of each table.
        index_rows: rows of the cache's tables (0 when it keeps no row index).
        specs: the cache's tables by table index.
        fusion_k: bits of the raw id inside a fused id.
        backend: the cache's implementation family (`embcache.backend`): the compiled one
            deduplicates through a bitmap in one pass.
    """

    def __init__(
        self,
        row_offset: torch.Tensor,
        index_rows: int,
        specs: Mapping[int, TableSpec],
        fusion_k: int,
        backend: Backend,
    ) -> None:
        self.compiled = backend.compiled
        self.row_offset = row_offset
        self.index_rows = index_rows
        self.specs = specs
        self.fusion_k = fusion_k
        # The torch path's map and ranks over the tables' rows (5 bytes a row); the compiled
        # dedup's bitmap (a bit a row) and ranks (4 bytes per 64 rows): all made on first use.
        self.row_map: torch.Tensor | None = None
        self.row_rank: torch.Tensor | None = None
        self.row_bits: torch.Tensor | None = None
        self.word_rank: np.ndarray | None = None
        self._row_starts: torch.Tensor | None = None  # first row of each table, ascending
        self._row_tables: torch.Tensor | None = None  # and the table's index
        self._lock = threading.Lock()  # one batch at a time through those

    def unique_by_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``torch.unique(ids, sorted=True, return_inverse=True)`` for valid fused ids of the
        cache's tables, through a map over the tables' rows instead of a sort: a batch that
        holds at least one id per `IDS_PER_ROW_MAP` rows (`IDS_PER_ROW_BITMAP` through the
        compiled bitmap) is deduplicated faster so. None when it holds fewer, or the cache
        keeps no row index (its tables are unbounded, or it is on a GPU or direct)."""
        compiled = self.compiled
        if not self.dense_batch(ids.numel(), compiled):
            return None
        with self._lock:
            self._row_buffers(compiled)
            assert self._row_starts is not None and self._row_tables is not None
            if compiled:
                unique_np, inverse_np = native.unique_rows(
                    ids.contiguous().numpy(), self.row_offset.numpy(), self.fusion_k,
                    self._bitmap(), self._word_ranks(), self._row_starts.numpy(),
                    self._row_tables.numpy(),
                )  # fmt: skip
                return torch.from_numpy(unique_np), torch.from_numpy(inverse_np)
            assert self.row_map is not None and self.row_rank is not None
            rows = row_index(self.row_offset, ids, self.fusion_k)
            fill_at(self.row_map, rows, True)
            unique_rows = true_at(self.row_map)  # ascending: (table, id) order
            fill_at(self.row_map, unique_rows, False)  # all clear again for the next batch
            put(self.row_rank, unique_rows, torch.arange(unique_rows.numel()))
            inverse = self.row_rank.index_select(0, rows).to(torch.int64)
        table = torch.searchsorted(self._row_starts, unique_rows, right=True) - 1
        raw = unique_rows - self._row_starts.index_select(0, table)
        unique = raw | (self._row_tables.index_select(0, table) << self.fusion_k)
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
        rows = [self.specs[t].num_embeddings for t in tables]
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
        (`native.unique_values`); `HotCache.unique_values` says more."""
        if values.dtype not in (torch.int64, torch.int32) or not self.maps_batch(values.numel()):
            return None
        bases, limits = ranges
        with self._lock:
            self._row_buffers(compiled=True)
            assert self._row_starts is not None and self._row_tables is not None
            unique, inverse, bad = native.unique_values(
                values.contiguous().numpy(), bounds.contiguous().numpy(), bases.numpy(),
                limits.numpy(), self.fusion_k, self._bitmap(), self._word_ranks(),
                self._row_starts.numpy(), self._row_tables.numpy(),
            )  # fmt: skip
        if bad >= 0:
            return None
        return torch.from_numpy(unique), torch.from_numpy(inverse)

    def dense_batch(self, n: int, compiled: bool) -> bool:
        """Whether a batch of ``n`` ids is deduplicated through the map over the tables' rows
        (the cache keeps a row index, and the batch has enough ids for the map's size)."""
        per_row = IDS_PER_ROW_BITMAP if compiled else IDS_PER_ROW_MAP
        return bool(self.index_rows) and n * per_row >= self.index_rows

    def _row_buffers(self, compiled: bool) -> None:
        """Make the table starts of `unique_by_rows` and, for the torch path (not
        ``compiled``), its map and ranks over the tables' rows (first use)."""
        if not compiled and self.row_map is None:
            self.row_map = torch.zeros(self.index_rows, dtype=torch.bool)
            self.row_rank = host_zeros((self.index_rows,), torch.int32)
        if self._row_starts is None:
            starts = sorted((int(self.row_offset[i]), i) for i in self.specs)
            self._row_starts = torch.tensor([start for start, _ in starts])
            self._row_tables = torch.tensor([idx for _, idx in starts])

    def _bitmap(self) -> np.ndarray:
        """The compiled dedup's bitmap, one bit a row (all clear between batches)."""
        if self.row_bits is None:
            self.row_bits = torch.zeros((self.index_rows + 63) // 64, dtype=torch.int64)
        return self.row_bits.numpy().view(np.uint64)

    def _word_ranks(self) -> np.ndarray:
        """The compiled dedup's rank of each word of `_bitmap` (scratch, int32)."""
        if self.word_rank is None:
            self.word_rank = np.zeros((self.index_rows + 63) // 64, dtype=np.int32)
        return self.word_rank
