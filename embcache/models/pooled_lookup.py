"""The pooling op of a collection: its forward pools every bag straight from the cache slots, its
backward turns the pooled gradient into one row per unique id (never a table-sized gradient)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from embcache.kernels.pooling import pool_backward, pool_forward
from embcache.models.batch_state import _Batch, _Resolved
from embcache.models.cache_group import _CacheGroup

if TYPE_CHECKING:
    from embcache.models.collection import CachedEmbeddingBagCollection


def lookup_inputs(group: _CacheGroup, r: _Resolved, B: int, device: torch.device) -> list[tuple]:
    """Per lookup of a group: its values' inverse, rebased offsets, weights and columns."""
    if len(group.lookups) == 1:
        cols = torch.arange(len(group.features), device=device) * group.dim
        return [(r.inverse, r.offsets, r.weights, cols)]
    bounds = r.offsets[[lk.feature_lo * B for lk in group.lookups] + [r.offsets.numel() - 1]]
    bounds = bounds.tolist()
    inputs = []
    for i, lk in enumerate(group.lookups):
        lo, hi = bounds[i], bounds[i + 1]
        offsets = r.offsets[lk.feature_lo * B : lk.feature_hi * B + 1] - lo
        weights = None if r.weights is None else r.weights[lo:hi]
        cols = torch.arange(lk.feature_lo, lk.feature_hi, device=device) * group.dim
        inputs.append((r.inverse[lo:hi], offsets, weights, cols))
    return inputs


def pool_group(
    group: _CacheGroup, r: _Resolved, B: int, device: torch.device
) -> tuple[torch.Tensor, list]:
    """A group's pooled bags ``[B, F * dim]`` and, per lookup, what its backward needs (the
    argmax rows of MAX pooling)."""
    out = torch.empty(B, len(group.features) * group.dim, device=device)
    argmaxes = []
    # No cache lock: this batch's slots are locked, so no resolve writes them, and a
    # resolve that replaces `rows` (growing the scratch area) copies them unchanged.
    rows = group.cache.rows
    for lk, inputs in zip(group.lookups, lookup_inputs(group, r, B, device), strict=True):
        inverse, offsets, weights, cols = inputs
        argmaxes.append(
            pool_forward(
                rows,
                group.dim,
                r.slots,
                inverse,
                offsets,
                weights,
                lk.mode,
                out,
                B,
                cols,
            )
        )
    return out, argmaxes


def grad_rows(
    group: _CacheGroup,
    r: _Resolved,
    B: int,
    grad_out: torch.Tensor,
    argmaxes: list,
    device: torch.device,
) -> torch.Tensor:
    """One gradient row ``[U, dim]`` per unique id of a group, summed over its lookups."""
    grad = None
    lookups = zip(group.lookups, lookup_inputs(group, r, B, device), argmaxes, strict=True)
    for lk, (inverse, offsets, weights, cols), argmax in lookups:
        g = pool_backward(
            grad_out,
            group.dim,
            inverse,
            r.unique.numel(),
            offsets,
            weights,
            lk.mode,
            B,
            cols,
            argmax,
            r.grouping,
        )
        grad = g if grad is None else grad + g
    return grad


class _PooledLookup(torch.autograd.Function):
    """Pool every cache group's bags from its slots; backward yields one gradient row per unique
    id and group, handed to the collection (trace or immediate update), never a table-sized
    gradient."""

    @staticmethod
    def forward(
        ctx,
        anchor: torch.Tensor,
        module: CachedEmbeddingBagCollection,
        resolved: list[_Resolved],
        batch: _Batch | None,
        batch_size: int,
    ):
        outs, argmaxes = [], []
        for gi, r in enumerate(resolved):
            out, argmax = pool_group(module._groups[gi], r, batch_size, module.device)
            outs.append(out)
            argmaxes.append(argmax)
        ctx.module, ctx.resolved, ctx.batch = module, resolved, batch
        ctx.batch_size, ctx.argmaxes = batch_size, argmaxes
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        module = ctx.module
        rows = []
        for gi, (r, grad_out) in enumerate(zip(ctx.resolved, grad_outs, strict=True)):
            if grad_out.stride(-1) != 1 or grad_out.stride(0) < grad_out.shape[1]:
                grad_out = grad_out.contiguous()  # e.g. the expanded gradient of a .sum()
            group = module._groups[gi]
            rows.append(
                grad_rows(group, r, ctx.batch_size, grad_out, ctx.argmaxes[gi], module.device)
            )
        module._on_backward(ctx.batch, rows)
        return None, None, None, None, None
