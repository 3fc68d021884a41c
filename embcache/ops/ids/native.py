"""The ids family on a CPU with numba: the torch specification (`ops.ids.spec`) where a
compiled pass would not pay, and one compiled pass where it does:

* `first_bad_key`: a cache's fused ids checked against its tables in one pass
  (`native.plan_kernels.first_bad_key`);
* `row_dedup`: `BitmapRowDedup`, a batch deduplicated through a bitmap over its cache's
  tables' rows (`plan_kernels.unique_rows`), raw ids checked and fused in the same pass
  (`plan_kernels.unique_values`);
* `direct_rows`: `BitmapDirectRows`, a direct share's ids checked and its distinct rows found
  in one pass, a bit per cache row remembering the rows seen
  (`native.direct_kernels.direct_rows`);
* `bags_sample_major`: the TBE step's indices, each value's slot with its bags moved to
  sample-major order, in one pass (`native.row_kernels.bags_sample_major`).

`NativeIds.compiled` says so: the engine then takes `direct_rows` for a direct share in place
of its own torch path.

This module is where those kernels are called from: numpy views of the tensors in (no copy),
torch tensors out. The kernels' modules are imported at the first call, not with this one: the
registry imports every implementation module, where numba is absent too (the GPU image).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from embcache.ops.ids import IdsOps
from embcache.ops.ids.direct_rows import DirectRows
from embcache.ops.ids.row_map import RowDedup
from embcache.ops.ids.spec import SpecIds


class BitmapRowDedup(RowDedup):
    """`RowDedup` through the compiled bitmap, a bit a row, and its word ranks."""

    compiled = True

    def unique_by_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.dense_batch(ids.numel(), True):
            return None
        from embcache.native import plan_kernels

        with self.lock:
            self.row_buffers(compiled=True)
            assert self.row_starts is not None and self.row_tables is not None
            unique_np, inverse_np = plan_kernels.unique_rows(
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
        (`plan_kernels.unique_values`): None for a value out of its table's range or bounds
        that do not cover the values (the bitmap left clear); `HotCache.unique_values` says
        more."""
        if values.dtype not in (torch.int64, torch.int32) or not self.maps_batch(values.numel()):
            return None
        from embcache.native import plan_kernels

        bases, limits = ranges
        with self.lock:
            self.row_buffers(compiled=True)
            assert self.row_starts is not None and self.row_tables is not None
            unique, inverse, bad = plan_kernels.unique_values(
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


class BitmapDirectRows(DirectRows):
    """`DirectRows` in one compiled pass over the values (`direct_kernels.direct_rows`): the
    ids checked against their tables and the distinct rows found at once.

    The torch specification spends a dozen ops and two scatters over the cache's rows on
    them; the pass remembers which rows the batch has shown so far in a bit per cache row
    (``num_rows / 8`` bytes: a table's part stays in the CPU's cache while its feature's
    values are read, where a byte or a stamp per row would miss it), set as rows are found and
    cleared at those rows before it returns. The engine then marks the dirty flags at the
    distinct rows alone (`indexing.fill_at`, itself a compiled pass on a CPU). No value's slot
    is written: only a share read without its TBE needs them. A lock keeps two callers from
    sharing the bitmap.
    """

    def __init__(
        self, feature_rows: Sequence[int], feature_bases: Sequence[int], num_rows: int
    ) -> None:
        super().__init__(feature_rows, feature_bases, num_rows)
        self.feature_rows_np = np.asarray(self.feature_rows, dtype=np.int64)
        self.feature_bases_np = np.asarray(self.feature_bases, dtype=np.int64)
        self.seen = np.zeros((num_rows + 63) // 64, dtype=np.uint64)  # all clear between calls
        self.lock = threading.Lock()

    def __call__(
        self, values: torch.Tensor, offsets: torch.Tensor, batch_size: int
    ) -> torch.Tensor | None:
        # What the pass takes, asked here in one expression (the specification's checks cost
        # as much as the pass on a small batch); anything else goes to the specification,
        # which checks it and raises for what is wrong.
        if not (
            isinstance(values, torch.Tensor) and isinstance(offsets, torch.Tensor)
            and values.dtype == offsets.dtype == torch.int64
            and values.dim() == offsets.dim() == 1
            and values.is_cpu and offsets.is_cpu
            and type(batch_size) is int and batch_size >= 0
        ):  # fmt: skip
            return super().__call__(values, offsets, batch_size)
        if offsets.numel() != self.feature_rows_np.size * batch_size + 1:
            return None
        from embcache.native import direct_kernels

        rows = torch.empty(values.numel(), dtype=torch.int64)
        with self.lock:
            count = direct_kernels.direct_rows(
                values.contiguous().numpy(), offsets.contiguous().numpy(), batch_size,
                self.feature_rows_np, self.feature_bases_np, self.seen, rows.numpy(),
            )  # fmt: skip
        return None if count < 0 else rows[:count]


def _compiled_bags(
    slots: torch.Tensor,
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    batch_size: int,
) -> bool:
    """Whether `row_kernels.bags_sample_major` takes these: CPU int64 slots, inverse and offsets,
    float32 weights (one per value), slots and inverse contiguous, B bags per feature. Anything
    else goes to the specification, which checks it (and raises for what is wrong)."""
    return (
        isinstance(slots, torch.Tensor)
        and isinstance(inverse, torch.Tensor)
        and isinstance(offsets, torch.Tensor)
        and slots.is_cpu and inverse.is_cpu and offsets.is_cpu
        and slots.dtype == inverse.dtype == offsets.dtype == torch.int64
        and slots.dim() == inverse.dim() == offsets.dim() == 1
        and (weights is None or (
            isinstance(weights, torch.Tensor) and weights.dtype == torch.float32
            and weights.shape == inverse.shape
        ))
        and slots.is_contiguous()
        and inverse.is_contiguous()
        and type(batch_size) is int
        and batch_size > 0
        and offsets.numel() >= 1
        and (offsets.numel() - 1) % batch_size == 0
    )  # fmt: skip


_NO_WEIGHTS = np.empty(0, dtype=np.float32)  # `row_kernels.bags_sample_major` without weights


class NativeIds(SpecIds):
    """The ids family with the compiled passes (module docstring)."""

    name = "native"
    compiled = True

    def first_bad_key(self, ids: torch.Tensor, fusion_k: int, limits: torch.Tensor) -> int:
        if not ids.is_contiguous():
            return super().first_bad_key(ids, fusion_k, limits)
        from embcache.native import plan_kernels

        return plan_kernels.first_bad_key(ids.numpy(), fusion_k, limits.numpy())

    def row_dedup(
        self,
        row_offset: torch.Tensor,
        index_rows: int,
        rows: Mapping[int, int | None],
        fusion_k: int,
    ) -> RowDedup:
        return BitmapRowDedup(row_offset, index_rows, rows, fusion_k)

    def direct_rows(
        self, feature_rows: Sequence[int], feature_bases: Sequence[int], num_rows: int
    ) -> DirectRows:
        return BitmapDirectRows(feature_rows, feature_bases, num_rows)

    def bags_sample_major(
        self,
        slots: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        batch_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        # What the compiled pass takes passes the specification's checks (`_compiled_bags`
        # asks as much and more); anything else goes to the specification, which checks it.
        if not _compiled_bags(slots, inverse, offsets, weights, batch_size):
            return super().bags_sample_major(slots, inverse, offsets, weights, batch_size)
        num_bags = offsets.numel() - 1
        if num_bags // batch_size <= 1:  # one feature's bags are in sample-major order
            return slots.index_select(0, inverse), offsets, weights
        n = inverse.numel()
        indices = torch.empty(n, dtype=torch.int64)
        moved = torch.empty(num_bags + 1, dtype=torch.int64)
        out_weights = None if weights is None else torch.empty(n, dtype=torch.float32)
        from embcache.native import row_kernels

        row_kernels.bags_sample_major(
            slots.numpy(), inverse.numpy(), offsets.contiguous().numpy(), batch_size,
            _NO_WEIGHTS if weights is None else weights.contiguous().numpy(),
            indices.numpy(), moved.numpy(),
            _NO_WEIGHTS if out_weights is None else out_weights.numpy(),
        )  # fmt: skip
        return indices, moved, out_weights


IMPLEMENTATION: IdsOps = NativeIds()  # checked against the protocol
