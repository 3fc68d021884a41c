"""What a cache's lookup does with the rows of a batch: pool them into bags (`BagPooling`, an
embedding bag collection) or hand each value its row (`RowGather`, an embedding collection:
sequence embeddings). The lookup, the slots each value reads, comes first and is the same for
both (`CacheEngine.prepare`); the reduction is the second half of the forward and the first of
the backward, where the output's gradient becomes one gradient row per unique id.

Both are given the rows and slots they read, so the single-process engines (rows in their own
cache) and the sharded collection (rows other ranks sent) run the same code:

    out = reduction.output(batch_size, nnz, device)
    saved = reduction.forward(rows, slots, share, batch_size, out, columns, start)
    grads = reduction.backward(grad_out, num_unique, share, batch_size, columns, start, saved)

``share`` carries the batch's ``inverse`` (unique index of each value), ``offsets`` (bags,
feature-major), ``weights`` and ``cuts`` (`Prepared` has them). A pooled output is ``[B, F *
dim]``, each feature's bags in its columns; an unpooled one ``[nnz, dim]``, the values' rows in
the order of the cache's features, then samples.
"""

from __future__ import annotations

from typing import Protocol

import torch

from embcache.engine.layout import Bags, CacheLayout
from embcache.ops.gather import GatherOps
from embcache.ops.pooling import PoolingOps
from embcache.ops.registry import Ops

Grouping = tuple[torch.Tensor, torch.Tensor]
# What a reduction's forward gives its backward: per lookup, MAX pooling's argmax rows (else
# None) for pooled bags; None for gathered rows.
Saved = list[torch.Tensor | None] | None


class Share(Protocol):
    """What a reduction reads of a batch's share (`Prepared` is one: its ``inverse`` is None
    only for a direct share not yet materialized, which no reduction is given)."""

    @property
    def inverse(self) -> torch.Tensor | None: ...  # int64 [nnz]

    @property
    def offsets(self) -> torch.Tensor: ...  # int64 [F * B + 1]

    @property
    def weights(self) -> torch.Tensor | None: ...  # float32 [nnz]

    @property
    def cuts(self) -> list[int] | None: ...


def _inverse(share: Share) -> torch.Tensor:
    assert share.inverse is not None  # materialized before any reduction (see `Share`)
    return share.inverse


def pool_bags(
    ops: PoolingOps,
    layout: CacheLayout,
    rows: torch.Tensor,
    slots: torch.Tensor,
    bags: list[Bags],
    batch_size: int,
    out: torch.Tensor,
) -> list[torch.Tensor | None]:
    """Pool one cache's bags from ``rows[slots]`` into their columns of ``out``; returns, per
    lookup, what its backward needs (the argmax rows of MAX pooling, else None)."""
    saved = []
    for lk, b in zip(layout.lookups, bags, strict=True):
        assert lk.mode is not None  # a pooled layout's lookups have a mode
        saved.append(
            ops.pool_forward(
                rows,
                layout.dim,
                slots,
                b.inverse,
                b.offsets,
                b.weights,
                lk.mode,
                out,
                batch_size,
                b.columns,
                b.column_start,
            )
        )
    return saved


def bag_gradients(
    ops: PoolingOps,
    layout: CacheLayout,
    grad_out: torch.Tensor,
    num_unique: int,
    bags: list[Bags],
    batch_size: int,
    argmaxes: list[torch.Tensor | None],
    grouping: Grouping | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One gradient row ``[U, dim]`` per unique id of a cache, summed over its lookups
    (written into ``out`` when given, float32 ``[U, dim]`` contiguous)."""
    grad = None
    for lk, b, argmax in zip(layout.lookups, bags, argmaxes, strict=True):
        assert lk.mode is not None  # a pooled layout's lookups have a mode
        g = ops.pool_backward(
            grad_out,
            layout.dim,
            b.inverse,
            num_unique,
            b.offsets,
            b.weights,
            lk.mode,
            batch_size,
            b.columns,
            argmax,
            grouping,
            b.column_start,
            out if grad is None else None,
        )
        grad = g if grad is None else grad.add_(g)
    assert grad is not None  # a layout has at least one lookup
    return grad


class BagPooling:
    """Bags of rows pooled into ``[B, F * dim]`` (SUM, MEAN, MAX, per-sample weights), each
    feature's bags in its columns (``ops``: the pooling family bound for the cache)."""

    def __init__(self, layout: CacheLayout, ops: PoolingOps) -> None:
        self.layout = layout
        self.ops = ops

    def output(self, batch_size: int, nnz: int, device: torch.device) -> torch.Tensor:
        del nnz
        return torch.empty(batch_size, len(self.layout.features) * self.layout.dim, device=device)

    def bags(
        self, share: Share, batch_size: int, columns: torch.Tensor, start: int | None
    ) -> list[Bags]:
        return self.layout.bags(
            _inverse(share), share.offsets, share.weights, batch_size, columns, start, share.cuts
        )

    def forward(
        self,
        rows: torch.Tensor,
        slots: torch.Tensor,
        share: Share,
        batch_size: int,
        out: torch.Tensor,
        columns: torch.Tensor,
        start: int | None = 0,
    ) -> Saved:
        """Pool into ``out``; returns what `backward` needs (MAX's argmax rows)."""
        bags = self.bags(share, batch_size, columns, start)
        return pool_bags(self.ops, self.layout, rows, slots, bags, batch_size, out)

    def backward(
        self,
        grad_out: torch.Tensor,
        num_unique: int,
        share: Share,
        batch_size: int,
        columns: torch.Tensor,
        start: int | None,
        saved: Saved,
        grouping: Grouping | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One gradient row ``[U, dim]`` per unique id (in ``out`` when given)."""
        assert saved is not None  # `forward` gives a list (one entry per lookup)
        bags = self.bags(share, batch_size, columns, start)
        return bag_gradients(
            self.ops, self.layout, grad_out, num_unique, bags, batch_size, saved, grouping, out
        )


class RowGather:
    """Each value's row, unpooled: ``[nnz, dim]`` in value order (``ops``: the gather family
    bound for the cache); the backward sums each id's rows over its duplicates (no atomics)."""

    def __init__(self, layout: CacheLayout, ops: GatherOps) -> None:
        self.layout = layout
        self.ops = ops

    def output(self, batch_size: int, nnz: int, device: torch.device) -> torch.Tensor:
        del batch_size
        return torch.empty(nnz, self.layout.dim, device=device)

    def forward(
        self,
        rows: torch.Tensor,
        slots: torch.Tensor,
        share: Share,
        batch_size: int,
        out: torch.Tensor,
        columns: torch.Tensor,
        start: int | None = 0,
    ) -> Saved:
        del batch_size, columns, start
        self.ops.gather_rows(rows, self.layout.dim, slots, _inverse(share), out)
        return None

    def backward(
        self,
        grad_out: torch.Tensor,
        num_unique: int,
        share: Share,
        batch_size: int,
        columns: torch.Tensor,
        start: int | None,
        saved: Saved,
        grouping: Grouping | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        del batch_size, columns, start, saved
        grads = self.ops.gather_backward(grad_out, _inverse(share), num_unique, grouping)
        return grads if out is None else out.copy_(grads)


Reduction = BagPooling | RowGather


def reduction_of(layout: CacheLayout, ops: Ops) -> Reduction:
    """The reduction of a cache's layout: pooled bags or one row per value, on the op
    families bound for its cache (``ops``: `HotCache.ops`)."""
    return BagPooling(layout, ops.pooling) if layout.pooled else RowGather(layout, ops.gather)
