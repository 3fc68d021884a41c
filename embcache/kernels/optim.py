"""The update family's public functions at their old path, for any tensor: each binds the
implementation for its tensor's device (`embcache.ops.registry.ops_for`) and calls it. The
family itself lives in `embcache.ops.update` (`UpdateOps` documents each operation, `RowUpdate`
and `state_dim` the rule's hyper-parameters and state, `rules` the rules); a cache's engine
binds once (``cache.ops.update``) and calls it instead.
"""

from __future__ import annotations

import torch

from embcache.ops.registry import ops_for
from embcache.ops.update import RowUpdate, state_dim
from embcache.ops.update.rules import RULES, OptimRule

__all__ = ["RULES", "OptimRule", "RowUpdate", "aggregate_grads", "apply_row_update", "state_dim"]


def apply_row_update(
    weights: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    grads: torch.Tensor,
    update: RowUpdate,
    step: int,
    check_slots: bool = True,
    ids: torch.Tensor | None = None,
    seed: int = 0,
    may_skip: bool = True,
) -> None:
    """`UpdateOps.apply_row_update` for ``weights``' device."""
    ops_for(weights.device).update.apply_row_update(
        weights, state, slots, grads, update, step, check_slots, ids, seed, may_skip
    )


def aggregate_grads(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`UpdateOps.aggregate_grads` for ``grads``' device."""
    return ops_for(grads.device).update.aggregate_grads(ids, grads)
