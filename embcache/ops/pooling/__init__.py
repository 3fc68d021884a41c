"""The pooling family: bags of cache rows -> pooled output, and its gradient -> one row per
unique id.

The forward reads rows straight from the cache slots: value j of a batch is the row
``rows[slots[inverse[j]], :dim]``, float32, float16 or bfloat16, accumulated in float32; a
negative slot (an id the cache has not admitted) reads as a row of zeros. Bags are
feature-major: bag ``q = i * B + b`` is feature i of sample b and writes
``out[b, col_offsets[i] : col_offsets[i] + dim]``, so tables of different dims fill one
``[B, sum(dims)]`` output, one call per table.

Modes, with per-sample weights ``w_j`` (1 when absent) over the values j of a bag of length L:

* SUM: ``Σ w_j x_j``.
* MEAN: ``Σ w_j x_j / L``. Weighted MEAN divides by the bag length, not by ``Σ w_j``: the same
  as a weighted SUM scaled by ``1 / L``, which is what FBGEMM's TBE computes.
* MAX: the elementwise ``max_j w_j x_j``. The forward also returns, per bag and column, the
  first value index j reaching the max; the backward routes that column's gradient to it alone.

An empty bag gives zeros in every mode.

The backward is deterministic: value positions are stably sorted by unique id and each id's
values are cut into chunks of a few tiles (`ops.segments.split_segments`); a program sums one
chunk, so a hot id's chunks run side by side instead of one program walking them all, and the
chunk sums of an id are then added in chunk order. The same inputs give the same bits on every
run; no float atomics, no host read, and nothing of table size is allocated.

`PoolingOps` is the family's protocol; its implementations are `spec.SpecPooling` (torch, the
specification) and `triton.TritonPooling` (the Triton kernels), one of them bound per cache by
`embcache.ops.registry`. Nothing outside `embcache.ops` imports an implementation.
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch


class PoolingMode(enum.IntEnum):
    """How a bag's rows are reduced (values match torch's ``embedding_bag`` modes)."""

    SUM = 0
    MEAN = 1
    MAX = 2


class PoolingOps(Protocol):
    """One implementation of the pooling family.

    Attributes:
        name: ``"spec"`` or ``"triton"``.
    """

    name: str

    def pool_forward(
        self,
        rows: torch.Tensor,
        dim: int,
        slots: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        mode: PoolingMode,
        out: torch.Tensor,
        batch_size: int,
        col_offsets: torch.Tensor,
        col_start: int | None = None,
    ) -> torch.Tensor | None:
        """Pool F * B bags of cache rows into their columns of ``out``, in place.

        Example: a table of dim 4 with features f0, f1 at columns 0 and 4 of an ``out`` of
        ``[B, 12]``, and a table of dim 4 for f2 at column 8: two calls fill the whole output.

        Args:
            rows: ``[R, W]`` float32, float16 or bfloat16, ``W >= dim``, the cache rows (may be a
                strided view); pooled in float32.
            dim: embedding dim of this table; columns ``[0, dim)`` of a row are read.
            slots: int64 ``[U]``, cache row of each unique id; -1 reads as a row of zeros.
            inverse: int64 ``[nnz]``, unique index of each value.
            offsets: int64 ``[F * B + 1]``, CSR over bags, feature-major (bag ``i * B + b``).
            per_sample_weights: float32 ``[nnz]`` or None.
            mode: `PoolingMode` (SUM, MEAN: weighted sum over bag length, MAX).
            out: float32 ``[B, C]``; bag ``i * B + b`` writes every element of
                ``out[b, col_offsets[i] : col_offsets[i] + dim]`` (zeros for an empty bag).
            batch_size: B.
            col_offsets: int64 ``[F]``, first column of each feature in ``out``.
            col_start: when the caller knows that ``col_offsets`` is ``col_start + dim *
                arange(F)`` (features side by side), that start: the torch twin then writes the
                block without reading ``col_offsets`` on the host (a device sync). Not checked.

        Returns:
            MAX: int64 ``[F * B, dim]``, the value index j giving each bag's max per column (-1 for
            an empty bag), to pass to `pool_backward`. Triton gives the first such j; the torch twin
            the first j holding the row that ``embedding_bag`` picked, which differs only when two
            different rows tie exactly. Otherwise None.
        """
        ...

    def pool_backward(
        self,
        grad_out: torch.Tensor,
        dim: int,
        inverse: torch.Tensor,
        num_unique: int,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        mode: PoolingMode,
        batch_size: int,
        col_offsets: torch.Tensor,
        argmax: torch.Tensor | None,
        grouping: tuple[torch.Tensor, torch.Tensor] | None = None,
        col_start: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Gradient of each unique row from the gradient of the pooled output; deterministic.

        Args:
            grad_out: float32 ``[B, C]``, gradient of the loss w.r.t. ``out`` of `pool_forward`.
            dim: embedding dim of this table.
            inverse: int64 ``[nnz]``, unique index of each value, in ``[0, num_unique)``.
            num_unique: U.
            offsets: int64 ``[F * B + 1]``, as in the forward.
            per_sample_weights: float32 ``[nnz]`` or None, as in the forward.
            mode: `PoolingMode`, as in the forward.
            batch_size: B.
            col_offsets: int64 ``[F]``, as in the forward.
            argmax: int64 ``[F * B, dim]`` returned by the forward for MAX; None otherwise.
            grouping: optional ``(order, segments)`` from `ids.dedup_grouped` over these values;
                the CPU path then sums each id's rows in one pass (same result).
            col_start: as in `pool_forward`.
            out: float32 ``[U, dim]``, contiguous: where to write the result (e.g. a view of one
                buffer for several caches' rows), else a new tensor.

        Returns:
            float32 ``[U, dim]`` (``out`` when given): row u sums the gradients of every
            occurrence of unique id u (for MAX, only of the occurrences that won their bag's
            column).
        """
        ...
