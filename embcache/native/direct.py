"""Compiled CPU passes (numba) for a batch served straight from a direct-mapped cache.

A direct share (`CacheEngine.direct_share`) needs two things of its batch besides FBGEMM's
pooling: every id checked against its table, and the batch's distinct rows (counted as hits
by `HotCache.serve_direct`, marked dirty after the step by `HotCache.mark_dirty_direct`). The
torch path (the specification: `CacheEngine._direct_slots` gives each value's slot, the cache
counts them through a map or stamps) spends a dozen ops and two scatters over the cache's rows
on them; `DistinctRows` does both in one pass over the values, remembering the rows it has
seen in a bit per cache row, and the dirty flags are then set at the distinct rows alone
(`indexing.fill_at`, itself a compiled pass on a CPU). No value's slot is written: only a
share read without its TBE needs them.

The ids family's compiled implementation uses it (`ops.ids.native`, `IdsOps.direct_rows`,
whose torch specification is `ops.ids.direct_rows.DirectRows`): the engine of a cache bound to
it (`IdsOps.compiled`) takes this pass in place of its torch path.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

__all__ = ["DistinctRows"]


def _kernels():
    """The kernels' module (compiled at first call, or loaded from numba's disk cache);
    importing it without numba raises (the native backend runs only where numba imports)."""
    from embcache.native import direct_kernels

    return direct_kernels


class DistinctRows:
    """The pass over a direct share's values, for a cache of ``num_rows`` rows: checked ids
    and distinct rows at once.

    Which rows the batch has shown so far is a bit per cache row (``num_rows / 8`` bytes: a
    table's part stays in the CPU's cache while its feature's values are read, where a byte
    or a stamp per row would miss it), set as rows are found and cleared at those rows before
    the pass returns. A lock keeps two callers from sharing it.

    Args:
        feature_rows: the rows of each feature's table (F entries).
        feature_bases: the slot of row 0 of each feature's table.
        num_rows: the cache's rows (slots).
    """

    def __init__(self, feature_rows: list[int], feature_bases: list[int], num_rows: int) -> None:
        self.feature_rows = np.asarray(feature_rows, dtype=np.int64)
        self.feature_bases = np.asarray(feature_bases, dtype=np.int64)
        self.seen = np.zeros((num_rows + 63) // 64, dtype=np.uint64)
        self.lock = threading.Lock()

    def __call__(
        self, values: torch.Tensor, offsets: torch.Tensor, batch_size: int
    ) -> torch.Tensor | None:
        """The batch's distinct slots, int64 ``[U]`` in order of first sight; None when an id
        is out of its table's range or the offsets do not span the values (the torch path
        then says what is wrong).

        Args:
            values: contiguous int64 ``[nnz]`` raw ids, the F features one after another.
            offsets: contiguous int64 ``[F * B + 1]`` bag offsets into ``values``.
            batch_size: B, bags per feature.
        """
        if offsets.numel() != self.feature_rows.size * batch_size + 1:
            return None
        rows = torch.empty(values.numel(), dtype=torch.int64)
        with self.lock:
            count = _kernels().direct_rows(
                values.numpy(), offsets.numpy(), batch_size, self.feature_rows,
                self.feature_bases, self.seen, rows.numpy(),
            )  # fmt: skip
        return None if count < 0 else rows[:count]
