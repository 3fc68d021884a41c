"""The gather family's public functions at their old path, for any tensor: each binds the
implementation for its tensor's device (`embcache.ops.registry.ops_for`) and calls it. The
family itself lives in `embcache.ops.gather` (`GatherOps` documents each operation); a cache's
engine binds once (`engine.reduction.RowGather`) and calls ``ops.gather.<op>`` instead.
"""

from __future__ import annotations

import torch

from embcache.ops.registry import ops_for

__all__ = ["gather_backward", "gather_rows"]


def gather_rows(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    inverse: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`GatherOps.gather_rows` for ``rows``' device."""
    return ops_for(rows.device).gather.gather_rows(rows, dim, slots, inverse, out)


def gather_backward(
    grad_out: torch.Tensor,
    inverse: torch.Tensor,
    num_unique: int,
    grouping: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`GatherOps.gather_backward` for ``grad_out``'s device."""
    return ops_for(grad_out.device).gather.gather_backward(grad_out, inverse, num_unique, grouping)
