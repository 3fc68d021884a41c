"""The pooling family's public functions at their old path, for any tensor: each binds the
implementation for its tensor's device (`embcache.ops.registry.ops_for`) and calls it. The
family itself lives in `embcache.ops.pooling` (`PoolingOps` documents each operation); a cache's
engine binds once (`engine.reduction.BagPooling`) and calls ``ops.pooling.<op>`` instead.
"""

from __future__ import annotations

import torch

from embcache.ops.pooling import PoolingMode
from embcache.ops.registry import ops_for

__all__ = ["PoolingMode", "pool_backward", "pool_forward"]


def pool_forward(
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
    """`PoolingOps.pool_forward` for ``rows``' device."""
    return ops_for(rows.device).pooling.pool_forward(
        rows, dim, slots, inverse, offsets, per_sample_weights, mode, out, batch_size,
        col_offsets, col_start,
    )  # fmt: skip


def pool_backward(
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
    """`PoolingOps.pool_backward` for ``grad_out``'s device."""
    return ops_for(grad_out.device).pooling.pool_backward(
        grad_out, dim, inverse, num_unique, offsets, per_sample_weights, mode, batch_size,
        col_offsets, argmax, grouping, col_start, out,
    )  # fmt: skip
