"""The pooling op of a collection: forward pools every engine's bags straight from its cache
slots; backward turns the pooled gradient into one row per unique id (never a table-sized
gradient) and hands them to `EngineGroup.record_backward`.

One autograd node for all engines, so that one backward sees every cache's gradient at once
(``update_in_backward`` refuses a bad gradient anywhere before any update)."""

from __future__ import annotations

import torch

from embcache.engine.batch_state import InFlight, Prepared
from embcache.engine.fused_cpu import PendingUpdate
from embcache.engine.group import EngineGroup


class PooledLookup(torch.autograd.Function):
    """``PooledLookup.apply(anchor, group, prepared, batch, B)`` -> one ``[B, F_e * dim_e]``
    output per engine (its features' columns side by side, in its layout's order).

    ``anchor`` is a tensor that requires grad, so the node is recorded even though the rows it
    reads are not autograd leaves (it gets a zero-size gradient); ``batch`` is the `InFlight`
    the gradients belong to (None under ``torch.no_grad``)."""

    @staticmethod
    def forward(
        ctx,
        anchor: torch.Tensor,
        group: EngineGroup,
        prepared: list[Prepared],
        batch: InFlight | None,
        batch_size: int,
    ):
        outs, argmaxes, columns, fused = [], [], [], []
        for engine, p in zip(group.engines, prepared, strict=True):
            cols = engine.columns
            f, dim = len(engine.layout.features), engine.dim
            if batch is not None and engine.fused is not None and engine.fused.takes(p.weights):
                lr = group.optimizer.update.lr
                # The TBE pools [B * F, dim] sample-major (by slot) or [B, F * dim] (by table
                # and raw id): the output as it stands. Its graph is kept for the fused update.
                pool = engine.fused.pool if p.direct is None else engine.fused.pool_direct
                pooled, bound = pool(p, lr, batch_size)
                out = pooled.detach().view(batch_size, f * dim)
                fused.append((pooled, bound, lr))
                argmaxes.append([None])
            else:
                # A direct share pooled without its TBE (a prefetched batch read without
                # gradients): its unique ids and slots first.
                engine.materialize(p)
                out = torch.empty(batch_size, f * dim, device=engine.device)
                argmaxes.append(engine.pool(p, batch_size, out, cols))
                fused.append(None)
            outs.append(out)
            columns.append(cols)
        ctx.fused = fused
        ctx.group, ctx.prepared, ctx.batch = group, prepared, batch
        ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)
        ctx.batch_size, ctx.argmaxes, ctx.columns = batch_size, argmaxes, columns
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        rows = []
        for i, (engine, p, grad_out, cols, argmaxes, fused) in enumerate(
            zip(
                ctx.group.engines,
                ctx.prepared,
                grad_outs,
                ctx.columns,
                ctx.argmaxes,
                ctx.fused,
                strict=True,
            )
        ):
            if grad_out.stride(-1) != 1 or grad_out.stride(0) < grad_out.shape[1]:
                grad_out = grad_out.contiguous()  # e.g. the expanded gradient of a .sum()
            if fused is not None:
                pooled, bound, lr = fused
                grad = grad_out.reshape(pooled.shape)  # no copy when contiguous
                B = ctx.batch_size
                rows.append(PendingUpdate(i, ctx.batch, pooled, grad, grad_out, B, cols, bound, lr))
            else:
                rows.append(engine.grad_rows(p, ctx.batch_size, grad_out, cols, argmaxes))
        ctx.group.record_backward(ctx.batch, rows)
        # A (zero-size) gradient for the anchor, so that hooks on it run after every backward
        # (apply_optimizer_in_backward) and DDP sees it used.
        shape, dtype, device = ctx.anchor
        return torch.zeros(shape, dtype=dtype, device=device), None, None, None, None
