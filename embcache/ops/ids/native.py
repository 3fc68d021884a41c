"""The ids family on a CPU with numba: the torch specification (`ops.ids.spec`) where a
compiled pass would not pay, and one compiled pass (`embcache.native`) where it does:

* `first_bad_key`: a cache's fused ids checked against its tables in one pass;
* `row_dedup`: `BitmapRowDedup`, a batch deduplicated through a bitmap over its cache's
  tables' rows (`native.unique_rows`), raw ids checked and fused in the same pass
  (`native.unique_values`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

import embcache.native as native
from embcache.ops.ids import IdsOps
from embcache.ops.ids.row_map import RowDedup
from embcache.ops.ids.spec import SpecIds


class BitmapRowDedup(RowDedup):
    """`RowDedup` through the compiled bitmap, a bit a row, and its word ranks."""

    compiled = True

    def unique_by_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.dense_batch(ids.numel(), True):
            return None
        with self.lock:
            self.row_buffers(compiled=True)
            assert self.row_starts is not None and self.row_tables is not None
            unique_np, inverse_np = native.unique_rows(
                ids.contiguous().numpy(), self.row_offset.numpy(), self.fusion_k,
                self.bitmap(), self.word_ranks(), self.row_starts.numpy(),
                self.row_tables.numpy(),
            )  # fmt: skip
        return torch.from_numpy(unique_np), torch.from_numpy(inverse_np)

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
        with self.lock:
            self.row_buffers(compiled=True)
            assert self.row_starts is not None and self.row_tables is not None
            unique, inverse, bad = native.unique_values(
                values.contiguous().numpy(), bounds.contiguous().numpy(), bases.numpy(),
                limits.numpy(), self.fusion_k, self.bitmap(), self.word_ranks(),
                self.row_starts.numpy(), self.row_tables.numpy(),
            )  # fmt: skip
        if bad >= 0:
            return None
        return torch.from_numpy(unique), torch.from_numpy(inverse)

    def bitmap(self) -> np.ndarray:
        """The bitmap, one bit a row (all clear between batches)."""
        if self.row_bits is None:
            self.row_bits = torch.zeros((self.index_rows + 63) // 64, dtype=torch.int64)
        return self.row_bits.numpy().view(np.uint64)

    def word_ranks(self) -> np.ndarray:
        """The rank of each word of `bitmap` (scratch, int32)."""
        if self.word_rank is None:
            self.word_rank = np.zeros((self.index_rows + 63) // 64, dtype=np.int32)
        return self.word_rank


class NativeIds(SpecIds):
    """The ids family with the compiled passes (module docstring)."""

    name = "native"

    def first_bad_key(self, ids: torch.Tensor, fusion_k: int, limits: torch.Tensor) -> int:
        if not ids.is_contiguous():
            return super().first_bad_key(ids, fusion_k, limits)
        return native.first_bad_key(ids.numpy(), fusion_k, limits.numpy())

    def row_dedup(
        self,
        row_offset: torch.Tensor,
        index_rows: int,
        rows: Mapping[int, int | None],
        fusion_k: int,
    ) -> RowDedup:
        return BitmapRowDedup(row_offset, index_rows, rows, fusion_k)


IMPLEMENTATION: IdsOps = NativeIds()  # checked against the protocol
