"""Rounding float32 values into half-precision weights at its old path: part of the update family
(`embcache.ops.update`, whose row update stores half-precision weights through it).
`stochastic_round` binds the implementation for its tensor's device
(`embcache.ops.registry.ops_for`) and calls it; `rounding_key` is the key of a step's draws.
"""

from __future__ import annotations

import torch

from embcache.ops.registry import ops_for
from embcache.ops.update import rounding_key

__all__ = ["rounding_key", "stochastic_round"]


def stochastic_round(
    x: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor, key: int
) -> torch.Tensor:
    """`UpdateOps.stochastic_round` for ``x``'s device."""
    return ops_for(x.device).update.stochastic_round(x, dtype, ids, key)
