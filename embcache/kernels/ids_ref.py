"""Torch twins of the id kernels (`kernels/ids.py`): validate and fuse, unfuse, dedup.

Each function computes exactly what its Triton kernel computes, with vectorised torch ops (no
Python loop over ids, no per-element ``.item()``): the specification, and the CPU path.
"""

from __future__ import annotations

import torch

# Per-value verdict of `fuse_ids_ref`, in the order the checks are made.
ID_OK = 0
ID_NEGATIVE = 1
ID_OUT_OF_RANGE = 2  # >= num_embeddings of a bounded table
ID_OVERFLOWS_K = 3  # >= 2**fusion_k


def fuse_ids_ref(
    values: torch.Tensor,
    value_features: torch.Tensor,
    table_idx: torch.Tensor,
    num_embeddings: torch.Tensor,
    fusion_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fuse each id with its table index and judge it, without raising.

    Args:
        values: int32 or int64 ``[nnz]`` ids.
        value_features: int64 ``[nnz]`` feature of each value, in ``[0, F)``.
        table_idx: int64 ``[F]`` table index of each feature, ``0 <= t < 2**(63 - fusion_k)``.
        num_embeddings: int64 ``[F]`` rows of each feature's table, -1 when unbounded.
        fusion_k: bits kept for the id, in ``[0, 63]``.

    Returns:
        ``(fused, verdict)``: int64 ``[nnz]`` ``values | (table_idx << fusion_k)``, and int8
        ``[nnz]`` ``ID_OK`` or the first failed check (``ID_NEGATIVE``, ``ID_OUT_OF_RANGE``,
        ``ID_OVERFLOWS_K``). ``fused`` is meaningless where the verdict is not ``ID_OK``.
    """
    ids = values.to(torch.int64)
    table = table_idx.index_select(0, value_features)
    fused = ids | (table << fusion_k)
    # Good path: one bound per feature, min(num_embeddings, 2**fusion_k), and one mask.
    fits = (1 << fusion_k) if fusion_k < 63 else torch.iinfo(torch.int64).max
    bound = torch.where(num_embeddings >= 0, num_embeddings.clamp(max=fits), fits)
    bad = (ids < 0) | (ids >= bound.index_select(0, value_features))
    if not bool(bad.any()):
        return fused, torch.zeros_like(ids, dtype=torch.int8)
    limit = num_embeddings.index_select(0, value_features)
    verdict = torch.where(
        ids < 0,
        ID_NEGATIVE,
        torch.where(
            (limit >= 0) & (ids >= limit),
            ID_OUT_OF_RANGE,
            torch.where((ids >> fusion_k) != 0, ID_OVERFLOWS_K, ID_OK),
        ),
    ).to(torch.int8)
    return fused, verdict


def unfuse_ids_ref(fused: torch.Tensor, fusion_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split fused ids into ``(table_idx, ids)``, both int64 ``[n]``; inverse of `fuse_ids_ref`."""
    fused = fused.to(torch.int64)
    return fused >> fusion_k, fused & ((1 << fusion_k) - 1)


def dedup_ref(
    ids: torch.Tensor, with_counts: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Unique ids, sorted ascending, with the inverse index and counts.

    Args:
        ids: int64 ``[n]``.
        with_counts: also count occurrences; else counts is None.

    Returns:
        ``(unique_ids, inverse, counts)``: int64 ``[U]``, int64 ``[n]`` with
        ``unique_ids[inverse] == ids``, and int64 ``[U]`` occurrences of each unique id.
    """
    if not with_counts:
        unique_ids, inverse = torch.unique(ids.to(torch.int64), sorted=True, return_inverse=True)
        return unique_ids, inverse.reshape(-1), None
    unique_ids, inverse, counts = torch.unique(
        ids.to(torch.int64), sorted=True, return_inverse=True, return_counts=True
    )
    return unique_ids, inverse.reshape(-1), counts


def dedup_grouped_ref(
    ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dedup_ref` that also returns the positions grouped by unique id.

    Args:
        ids: int64 ``[n]``.

    Returns:
        ``(unique_ids, inverse, order, segments)``: unique ids ascending ``[U]``, the inverse
        ``[n]``, ``order`` ``[n]``: positions sorted by id (stable: ascending within an id), and
        ``segments`` ``[U + 1]``: unique id u owns ``order[segments[u] : segments[u + 1]]``.
    """
    ids = ids.to(torch.int64)
    n = ids.numel()
    sorted_ids, order = torch.sort(ids, stable=True)
    starts = torch.ones(n, dtype=torch.bool, device=ids.device)
    if n > 1:
        torch.ne(sorted_ids[1:], sorted_ids[:-1], out=starts[1:])
    unique_ids = sorted_ids[starts]
    inverse = torch.empty_like(order)
    inverse[order] = torch.cumsum(starts, 0) - 1
    segments = torch.nonzero(starts).squeeze(1)
    segments = torch.cat([segments, segments.new_full((1,), n)])
    return unique_ids, inverse, order, segments
