"""The plan family's set-index functions at their old path, for any tensor: each binds the
implementation for its tensor's device (`embcache.ops.registry.ops_for`) and calls it. The
family itself lives in `embcache.ops.plan` (`PlanOps` documents each operation); a cache binds
once and calls ``ops.plan.<op>`` instead.
"""

from __future__ import annotations

import torch

from embcache.ops.registry import ops_for

__all__ = [
    "add_at_held",
    "assign_ways",
    "cache_lookup",
    "cache_slots",
    "lookup_counts",
    "miss_keys",
    "salted_mix64",
    "set_index",
]


def set_index(ids: torch.Tensor, num_sets: int) -> torch.Tensor:
    """`PlanOps.set_index` for ``ids``' device."""
    return ops_for(ids.device).plan.set_index(ids, num_sets)


def cache_lookup(keys: torch.Tensor, ids: torch.Tensor, sets: torch.Tensor) -> torch.Tensor:
    """`PlanOps.cache_lookup` for ``keys``' device."""
    return ops_for(keys.device).plan.cache_lookup(keys, ids, sets)


def cache_slots(keys: torch.Tensor, ids: torch.Tensor, sets: torch.Tensor) -> torch.Tensor:
    """`PlanOps.cache_slots` for ``keys``' device."""
    return ops_for(keys.device).plan.cache_slots(keys, ids, sets)


def assign_ways(
    scores: torch.Tensor,
    blocked: torch.Tensor,
    miss_sets: torch.Tensor,
    num_runs: int | None = None,
) -> torch.Tensor:
    """`PlanOps.assign_ways` for ``scores``' device."""
    return ops_for(scores.device).plan.assign_ways(scores, blocked, miss_sets, num_runs)


def add_at_held(t: torch.Tensor, slots: torch.Tensor, delta: int) -> None:
    """`PlanOps.add_at_held` for ``slots``' device."""
    ops_for(slots.device).plan.add_at_held(t, slots, delta)


def lookup_counts(
    slots: torch.Tensor, num_slots: int, admitted: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`PlanOps.lookup_counts` for ``slots``' device."""
    return ops_for(slots.device).plan.lookup_counts(slots, num_slots, admitted)


def salted_mix64(ids: torch.Tensor, salt: int) -> torch.Tensor:
    """`PlanOps.salted_mix64` for ``ids``' device."""
    return ops_for(ids.device).plan.salted_mix64(ids, salt)


def miss_keys(
    ids: torch.Tensor, miss_pos: torch.Tensor, salt: int, num_sets: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`PlanOps.miss_keys` for ``ids``' device."""
    return ops_for(ids.device).plan.miss_keys(ids, miss_pos, salt, num_sets)
