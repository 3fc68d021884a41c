"""The lookup seam: one autograd Function for every module, and the step of a collection's
engines that it runs.

`CachedLookup` is the only autograd node embcache records. It knows nothing of caches: it runs
a `LookupStep`, an object whose ``forward()`` gives the outputs and whose ``backward(grads)``
hands their gradients on (as trace entries, a pending TBE update, or rows sent to their
owners). The modules differ only in their step:

* `GroupLookup`: a collection's engines, one process (`CachedEmbeddingBagCollection` pools
  bags, `CachedEmbeddingCollection` gathers one row per value: the engine's `reduction`);
* the sharded collections' exchange step (`embcache.distributed.sharded`);
* `DistEmbedding`'s rows of one tensor (`embcache.recstore.dist_embedding`).

One node per forward, for all of a module's caches, so that one backward sees every cache's
gradient at once (``update_in_backward`` refuses a bad gradient anywhere before any update,
and a sharded backward makes its exchanges in one place, in cache order, on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from embcache.engine.batch_state import InFlight, Prepared
from embcache.engine.engine import CacheEngine, TbeStepLike
from embcache.engine.group import EngineGroup
from embcache.engine.reduction import Saved
from embcache.engine.tbe_step import PendingUpdate

# A TBE step's forward, kept for its update: the TBE's pooled output with its graph, the
# storage that graph is bound to, and its learning rate.
TbeForward = tuple[torch.Tensor, tuple[int, int, int], float]


class LookupStep(Protocol):
    """One forward of a module, as `CachedLookup` runs it."""

    # Whether the module's anchor gets a (zero-size) gradient: hooks on it then run after
    # every backward (apply_optimizer_in_backward) and DDP sees it used.
    anchor_grad: bool

    def forward(self) -> tuple[torch.Tensor, ...]: ...

    def backward(self, grads: tuple[torch.Tensor, ...]) -> None: ...


class CachedLookup(torch.autograd.Function):
    """``CachedLookup.apply(anchor, step)`` -> ``step.forward()``; backward calls
    ``step.backward(grads)``.

    ``anchor`` is a tensor that requires grad, so the node is recorded even though the rows it
    reads are not autograd leaves."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, step: LookupStep) -> tuple[torch.Tensor, ...]:
        outs = step.forward()
        ctx.step = step
        ctx.anchor = (anchor.shape, anchor.dtype, anchor.device)
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        ctx.step.backward(grads)
        if not ctx.step.anchor_grad:
            return None, None
        shape, dtype, device = ctx.anchor
        return torch.zeros(shape, dtype=dtype, device=device), None


def contiguous_rows(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with unit column stride and rows at least as wide as they are (the kernels'
    layout): a copy only when it is not (e.g. the expanded gradient of a ``.sum()``)."""
    if grad.stride(-1) != 1 or grad.stride(0) < grad.shape[1]:
        return grad.contiguous()
    return grad


@dataclass(frozen=True)
class KeyedOutput:
    """One pooled output ``[B, width]`` for all of a collection's engines: the first column of
    each engine's features in it (int64 ``[F_e]`` each, on the engines' device)."""

    columns: list[torch.Tensor]
    width: int


class GroupLookup:
    """A collection's lookup over its engines, one output per engine: ``[B, F_e * dim_e]``
    pooled (its features' columns side by side, in its layout's order) or ``[nnz_e, dim_e]``
    unpooled (its features' values in its layout's order); or, pooled with ``keyed``, one
    output ``[B, keyed.width]`` that every engine pools into at its features' columns (`keyed`
    after construction: None where an engine's TBE step pools, whose output is its own), so
    that nothing joins the outputs after, nor splits their gradient.

    Args:
        group: the collection's engines.
        prepared: each engine's share of the batch.
        batch: the `InFlight` the gradients belong to (None under ``torch.no_grad``).
        batch_size: B.
        keyed: the one output's columns, or None.
    """

    anchor_grad = True

    def __init__(
        self,
        group: EngineGroup,
        prepared: list[Prepared],
        batch: InFlight | None,
        batch_size: int,
        keyed: KeyedOutput | None = None,
    ) -> None:
        self.group = group
        self.prepared = prepared
        self.batch = batch
        self.batch_size = batch_size
        if keyed is not None and any(
            self._tbe_step(e, p) is not None for e, p in zip(group.engines, prepared, strict=True)
        ):
            keyed = None
        self.keyed = keyed
        # Per engine: what its reduction's backward needs, or its TBE step's forward.
        self.saved: list[Saved] = []
        self.tbe_forwards: list[TbeForward | None] = []

    def _tbe_step(self, engine: CacheEngine, p: Prepared) -> TbeStepLike | None:
        """The engine's TBE step where it pools this share (a training one only)."""
        tbe_step = engine.tbe_step if self.batch is not None else None
        return tbe_step if tbe_step is not None and tbe_step.takes(p.weights) else None

    def forward(self) -> tuple[torch.Tensor, ...]:
        if self.keyed is not None:
            return (self._forward_keyed(self.keyed),)
        outs = []
        B = self.batch_size
        for engine, p in zip(self.group.engines, self.prepared, strict=True):
            tbe_step = self._tbe_step(engine, p)
            if tbe_step is not None:
                assert self.group.optimizer is not None  # a TBE step is made by `attach`
                lr = self.group.optimizer.update.lr
                # The TBE pools [B * F, dim] sample-major (by slot) or [B, F * dim] (by table
                # and raw id): the output as it stands. Its graph is kept for the TBE update.
                pool = tbe_step.pool if p.direct is None else tbe_step.pool_direct
                pooled, bound = pool(p, lr, B)
                out = pooled.detach().view(B, -1)
                self.tbe_forwards.append((pooled, bound, lr))
                self.saved.append(None)
            else:
                # A direct share read without its TBE (a prefetched batch read without
                # gradients): its unique ids and slots first.
                engine.materialize(p)
                out = engine.output(p, B)
                self.saved.append(engine.lookup_rows(p, B, out, engine.columns))
                self.tbe_forwards.append(None)
            outs.append(out)
        return tuple(outs)

    def _forward_keyed(self, keyed: KeyedOutput) -> torch.Tensor:
        B = self.batch_size
        engines = self.group.engines
        out = torch.empty(B, keyed.width, device=engines[0].device)  # every column is written
        for engine, p, columns in zip(engines, self.prepared, keyed.columns, strict=True):
            engine.materialize(p)
            self.saved.append(engine.lookup_rows(p, B, out, columns))
            self.tbe_forwards.append(None)
        return out

    def _gradient_rows(self, device: torch.device) -> list[torch.Tensor | None]:
        """Where each engine writes its gradient rows: on the device path (the caches' rows
        family checks and unlocks every cache in one launch, `RowsOps.one_launch`), consecutive
        views of one buffer (``[U_e, dim_e]`` each, no gap), so that the step's gradient check sums
        them in one launch (`optim.sparse.SparseOptimizer.gradient_check` sums a view's base);
        elsewhere (or a dim not a multiple of 4, whose views would move a kernel's pointer
        alignment from batch to batch) each engine allocates its own."""
        engines = self.group.engines
        if len(engines) < 2 or not all(
            e.cache.ops.rows.one_launch and e.dim % 4 == 0 for e in engines
        ):
            return [None] * len(engines)
        sizes = []
        for e, p in zip(engines, self.prepared, strict=True):
            assert p.unique is not None  # materialized in the forward
            sizes.append((p.unique.numel(), e.dim))
        flat = torch.empty(sum(u * d for u, d in sizes), dtype=torch.float32, device=device)
        views: list[torch.Tensor | None] = []
        at = 0
        for u, d in sizes:
            views.append(flat[at : at + u * d].view(u, d))
            at += u * d
        return views

    def backward(self, grads: tuple[torch.Tensor, ...]) -> None:
        rows: list[torch.Tensor | PendingUpdate] = []
        B = self.batch_size
        if self.keyed is not None:
            (grad_out,) = grads
            grad_out = contiguous_rows(grad_out)
            outs = self._gradient_rows(grad_out.device)
            for engine, p, saved, columns, out in zip(
                self.group.engines, self.prepared, self.saved, self.keyed.columns, outs,
                strict=True,
            ):  # fmt: skip
                rows.append(engine.grad_rows(p, B, grad_out, columns, saved, out))
            self.group.record_backward(self.batch, rows)
            return
        for i, (engine, p, grad_out, saved, tbe_forward) in enumerate(
            zip(
                self.group.engines, self.prepared, grads, self.saved, self.tbe_forwards, strict=True
            )
        ):
            grad_out = contiguous_rows(grad_out)
            cols = engine.columns
            if tbe_forward is not None:
                assert self.batch is not None  # a TBE forward is a training one
                pooled, bound, lr = tbe_forward
                grad = grad_out.reshape(pooled.shape)  # no copy when contiguous
                rows.append(
                    PendingUpdate(i, self.batch, pooled, grad, grad_out, B, cols, bound, lr)
                )
            else:
                rows.append(engine.grad_rows(p, B, grad_out, cols, saved))
        self.group.record_backward(self.batch, rows)


def lookup(anchor: torch.Tensor, step: LookupStep) -> tuple[torch.Tensor, ...]:
    """Run ``step`` as one autograd node (`CachedLookup`)."""
    return CachedLookup.apply(anchor, step)
