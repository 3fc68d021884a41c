"""The ids family's public functions at their old path, for any tensor: each binds the
implementation for its tensor's device (`embcache.ops.registry.ops_for`) and calls it. The
family itself lives in `embcache.ops.ids` (`IdsOps` documents each operation); a cache or a
collection binds once and calls ``ops.ids.<op>`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from embcache.ops.ids import IdsOps
from embcache.ops.ids.shared import Deduped, IdVerdict, Marked
from embcache.ops.registry import ops_for

__all__ = [
    "Deduped",
    "IdVerdict",
    "Marked",
    "dedup",
    "dedup_grouped",
    "dedup_together",
    "fuse_ids",
    "fuse_ids_deferred",
    "unfuse_ids",
]


def _ids(t: torch.Tensor) -> IdsOps:
    return ops_for(t.device).ids


def fuse_ids(
    values: torch.Tensor,
    feature_lengths: torch.Tensor,
    table_idx: torch.Tensor,
    num_embeddings: torch.Tensor,
    fusion_k: int,
    feature_names: Sequence[str],
    table_names: Sequence[str],
) -> torch.Tensor:
    """`IdsOps.fuse_ids` for ``values``' device."""
    return _ids(values).fuse_ids(
        values, feature_lengths, table_idx, num_embeddings, fusion_k, feature_names, table_names
    )


def fuse_ids_deferred(
    values: torch.Tensor,
    feature_lengths: torch.Tensor,
    table_idx: torch.Tensor,
    num_embeddings: torch.Tensor,
    fusion_k: int,
    feature_names: Sequence[str],
    table_names: Sequence[str],
) -> tuple[torch.Tensor, IdVerdict | None]:
    """`IdsOps.fuse_ids_deferred` for ``values``' device."""
    return _ids(values).fuse_ids_deferred(
        values, feature_lengths, table_idx, num_embeddings, fusion_k, feature_names, table_names
    )


def unfuse_ids(fused: torch.Tensor, fusion_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`IdsOps.unfuse_ids` for ``fused``' device."""
    return _ids(fused).unfuse_ids(fused, fusion_k)


def dedup(
    ids: torch.Tensor, with_counts: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`IdsOps.dedup` for ``ids``' device."""
    return _ids(ids).dedup(ids, with_counts)


def dedup_together(
    ids: list[torch.Tensor],
    table_starts: Sequence[torch.Tensor | None] | None = None,
    also_read: torch.Tensor | None = None,
) -> tuple[list[Deduped], list[int]]:
    """`IdsOps.dedup_together` for the device of ``ids`` (a CPU for none)."""
    return ops_for(ids[0].device if ids else "cpu").ids.dedup_together(ids, table_starts, also_read)


def dedup_grouped(
    ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`IdsOps.dedup_grouped` for ``ids``' device."""
    return _ids(ids).dedup_grouped(ids)
