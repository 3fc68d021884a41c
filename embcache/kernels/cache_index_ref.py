"""Torch twins of the cache-index kernels (`kernels/cache_index.py`): set hashing, lookup
of the way holding an id, and victim choice for a batch's misses.

Each function computes exactly what its Triton kernel computes: the specification, and the CPU
path.
"""

from __future__ import annotations

import numpy as np
import torch

from embcache.hashing import LOW63, mix64


def set_index_ref(ids: torch.Tensor, num_sets: int) -> torch.Tensor:
    """Set of each key: ``(mix64(id) & (2**63 - 1)) % num_sets``.

    Args:
        ids: int64 ``[n]`` fused ids (any value, negative ones included).
        num_sets: number of sets, >= 1.

    Returns:
        int64 ``[n]`` in ``[0, num_sets)``.
    """
    return (mix64(ids) & LOW63) % num_sets


def cache_lookup_ref(keys: torch.Tensor, ids: torch.Tensor, sets: torch.Tensor) -> torch.Tensor:
    """Way holding each id in its set, or -1.

    Args:
        keys: int64 ``[S, W]``, the id held by each way, -1 for an empty way. An id appears in at
            most one way of its set.
        ids: int64 ``[n]``, ids to look up (never -1).
        sets: int64 ``[n]``, ``set_index(ids, S)``.

    Returns:
        int64 ``[n]``: the way in ``[0, W)`` holding ``ids[i]`` in set ``sets[i]``, else -1.
    """
    match = keys.index_select(0, sets) == ids.unsqueeze(1)  # [n, W]
    # One pass finds both: the first largest byte of each row (1 at the way that matches).
    found, way = match.view(torch.uint8).max(dim=1)
    return torch.where(found.bool(), way, torch.full_like(way, -1))


def assign_ways_ref(
    scores: torch.Tensor,
    blocked: torch.Tensor,
    miss_sets: torch.Tensor,
    num_runs: int | None = None,
) -> torch.Tensor:
    """Give each miss a distinct way of its set: the k-th miss of a set gets its k-th best victim.

    Ways of a set are ordered by ``(blocked, score, way)`` ascending: unblocked ways with the
    lowest score first (callers give empty ways the lowest score), ties broken by way index. The
    k-th miss of a set (k counted in the order of ``miss_sets``) takes the k-th way of that order
    when k is below the set's number of unblocked ways, else it overflows (-1).

    Args:
        scores: int64 ``[S, W]`` eviction scores (LRU: last-use tick; LFU: frequency; empty: -1),
            below ``2**57`` (the twin orders ways by ``score * W + way``).
        blocked: bool ``[S, W]``, ways that must not be taken (locked, or hit by this batch).
        miss_sets: int64 ``[m]``, the set of each miss, sorted ascending.
        num_runs: the number of distinct values in ``miss_sets``, when the caller knows it:
            then nothing is read on the host (the runs are found at a known size, and every
            set's ways are sorted whole).

    Returns:
        int64 ``[m]``: the way in ``[0, W)`` assigned to each miss, or -1 for an overflow.
    """
    m = miss_sets.numel()
    if m == 0:
        return torch.empty(0, dtype=torch.int64, device=scores.device)
    W = scores.shape[1]
    if num_runs is not None:
        return _assign_known_runs(scores, blocked, miss_sets, num_runs)
    touched, counts = torch.unique_consecutive(miss_sets, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    owner = torch.repeat_interleave(torch.arange(touched.numel(), device=scores.device), counts)
    rank = torch.arange(m, device=scores.device) - starts[owner]
    if touched.numel() == scores.shape[0]:  # every set has a miss (callers that pre-gather)
        s_blocked, s_scores = blocked, scores
    else:
        s_blocked, s_scores = blocked.index_select(0, touched), scores.index_select(0, touched)
    # Distinct keys (score, then way) make the order total, so any sort of a set's ways, or a
    # partial sort of its first k (k = most misses in one set), equals a stable full sort.
    o_w = torch.arange(W, dtype=torch.int64, device=scores.device)
    key = torch.where(s_blocked, torch.iinfo(torch.int64).max, s_scores * W + o_w)  # [T, W]
    k = min(int(counts.max()), W)
    if key.device.type == "cpu":
        # numpy sorts short rows several times faster than torch's topk picks k of them.
        order = torch.from_numpy(np.argsort(key.numpy(), axis=1)[:, :k])  # [T, k]
    else:
        order = torch.topk(key, k, dim=1, largest=False, sorted=True).indices  # [T, k]
    n_free = (~s_blocked).sum(dim=1)  # [T]
    way = order[owner, rank.clamp(max=k - 1)]
    return torch.where(rank < n_free[owner], way, torch.full_like(way, -1))


def _assign_known_runs(
    scores: torch.Tensor, blocked: torch.Tensor, miss_sets: torch.Tensor, num_runs: int
) -> torch.Tensor:
    """`assign_ways_ref` for ``num_runs`` known runs in ``miss_sets``, without a host read:
    the runs' starts at a known size, and each touched set's ways sorted whole (k = W)."""
    m, W = miss_sets.numel(), scores.shape[1]
    device = scores.device
    first = torch.ones(m, dtype=torch.bool, device=device)
    torch.ne(miss_sets[1:], miss_sets[:-1], out=first[1:])
    owner = torch.cumsum(first, 0) - 1
    starts = torch.nonzero_static(first, size=num_runs).squeeze(1)
    rank = torch.arange(m, device=device) - starts.index_select(0, owner)
    touched = miss_sets.index_select(0, starts)
    s_blocked, s_scores = blocked.index_select(0, touched), scores.index_select(0, touched)
    o_w = torch.arange(W, dtype=torch.int64, device=device)
    key = torch.where(s_blocked, torch.iinfo(torch.int64).max, s_scores * W + o_w)  # [T, W]
    order = torch.sort(key, dim=1).indices  # distinct keys: any sort is the stable one
    n_free = (~s_blocked).sum(dim=1)  # [T]
    way = order[owner, rank.clamp(max=W - 1)]
    return torch.where(rank < n_free.index_select(0, owner), way, torch.full_like(way, -1))
