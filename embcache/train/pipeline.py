"""TrainPipeline: the prefetch of batch i+1 overlaps batch i's forward, backward and step.

    pipe = TrainPipeline(model, sparse_opt, dense_opt,
                         features=lambda batch: batch.sparse,   # a KJT or JaggedBatch
                         loss=lambda model, batch: model(batch))  # forward -> loss
    losses = pipe.run(batches)

Before each step, the training thread issues the next batch's `issue_fused_prefetch` on every
collection, which returns at once: the collection's prefetch worker fuses, dedups and resolves
it — tier writes of dirty victims, tier reads of misses, copies into their slots (on a GPU, on a
side stream with an event) — while the training thread runs the current batch with the handle
prefetched during the previous step. A sharded collection's prefetch also sends the ids to
their owners, who resolve them (its own process group: see
`embcache.distributed.sharded`).

Why the numbers do not change (invariant I5 of docs/design.md), the rules:

* Every row has one authoritative copy. A row that batch i updates and batch i+1 needs is a hit
  for the prefetch (batch i holds its slot locked), so batch i+1 reads the same slot after
  batch i's step has written it: the updated value (a sharded owner sends its rows at the
  forward, not at the prefetch, for this reason).
* The slots of batch i are locked from its resolve to its step, so the prefetch of batch i+1
  never evicts them; the slots the prefetch takes are locked too, so batch i's step never
  evicts them when it re-resolves.
* A victim written back after its prefetch is ready (a CPU cache over an in-process tier: the
  worker makes the write as its next call, `HotCache.resolve(defer_writeback=True)`) is in
  its staged rows meanwhile, and whatever reads the tier through the cache next makes the
  write first: a batch that needs that row again reads the updated value.
* Resolves are serialised (one at a time) and do their tier I/O outside the cache's lock; the
  training thread only pools and updates rows it holds locked, and marks them dirty and unlocks
  them under that lock. The TBE step's update holds the cache's storage lock instead
  (`HotCache.storage_lock`: the storage cannot be replaced under it), so that the next batch's
  resolve runs beside it on the second core.
* A prefetch that does not fit because batch i's locked slots leave too little room (cache plus
  scratch area) is abandoned with a warning that says which capacity would avoid it; the batch
  is then resolved synchronously by its forward, after batch i released its slots. (A sharded
  owner that cannot fit its share makes every rank's forward read synchronously.)

`run` ends cleanly on the last batch, on an exception in the loop and on KeyboardInterrupt:
prefetches still running are waited for, prefetched slots that will not be used are unlocked,
the interrupted batch's gradients are dropped (its slots unlocked), and rows already updated
stay dirty in the cache until `flush()`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from embcache.cache.hot_cache import CacheCapacityError
from embcache.engine.batch_state import FusedPrefetchHandle
from embcache.engine.inputs import JaggedBatch, is_kjt
from embcache.engine.interface import CachedCollectionInterface
from embcache.optim.sparse import SparseOptimizer
from embcache.profiling import profiled

_END = object()


class PrefetchFallbackWarning(UserWarning):
    """A prefetch did not fit beside the batch in flight; the batch ran synchronously."""


class TrainPipeline:
    """Train a model with cached collections, prefetching each next batch on a worker thread.

    Args:
        model: the model; its cached collections (`CachedCollectionInterface` submodules) are
            found by walking it.
        sparse_optimizer: the embcache optimizer of those collections.
        dense_optimizer: a torch optimizer of the dense parameters, or None.
        features: ``features(batch)`` -> the batch's sparse input (a KJT or `JaggedBatch`) for
            one collection, or a sequence of them, one per collection in ``model.modules()``
            order.
        loss: ``loss(model, batch)`` -> scalar loss tensor (runs the forward).
        prefetch: False runs every batch synchronously (same numbers; for comparison).
    """

    def __init__(
        self,
        model: nn.Module,
        sparse_optimizer: SparseOptimizer,
        dense_optimizer: torch.optim.Optimizer | None,
        features: Callable[[Any], Any],
        loss: Callable[[nn.Module, Any], torch.Tensor],
        prefetch: bool = True,
    ) -> None:
        self.model = model
        self.collections = [m for m in model.modules() if isinstance(m, CachedCollectionInterface)]
        if not self.collections:
            raise ValueError(
                "TrainPipeline: the model holds no CachedEmbeddingBagCollection (nor a sharded one)"
            )
        self.sparse_optimizer = sparse_optimizer
        self.dense_optimizer = dense_optimizer
        self.features = features
        self.loss = loss
        self.prefetch = prefetch
        self.fallbacks = 0  # batches whose prefetch did not fit and ran synchronously
        self._pending: list[FusedPrefetchHandle] | None = None  # the next batch's prefetch

    def _features_of(self, batch: Any) -> list[Any]:
        found = self.features(batch)
        kjts = [found] if isinstance(found, JaggedBatch) or is_kjt(found) else list(found)
        if len(kjts) != len(self.collections):
            raise ValueError(
                f"features(batch) gave {len(kjts)} inputs for {len(self.collections)} collections"
            )
        return kjts

    def _issue(self, batch: Any) -> list[FusedPrefetchHandle]:
        """Issue every collection's prefetch of ``batch`` (each returns at once)."""
        handles: list[FusedPrefetchHandle] = []
        try:
            for coll, kjt in zip(self.collections, self._features_of(batch), strict=True):
                handles.append(coll.issue_fused_prefetch(kjt))
        except BaseException:
            self._cancel(handles)
            raise
        return handles

    @profiled("pipeline.wait")
    def _ready(
        self, handles: list[FusedPrefetchHandle]
    ) -> list[FusedPrefetchHandle] | CacheCapacityError | None:
        """Wait for ``handles``; a prefetch that did not fit releases them all and is returned
        (the batch runs synchronously), any other failure is raised. None: a handle was
        released meanwhile (a ``zero_grad`` in the step), so the batch runs synchronously."""
        for handle in handles:
            error = handle.wait()
            if error is not None:
                self._cancel(handles)
                if isinstance(error, CacheCapacityError):
                    return error
                raise error
        if any(handle.used for handle in handles):
            self._cancel(handles)
            return None
        return handles

    def _cancel(self, handles: Sequence[FusedPrefetchHandle]) -> None:
        for coll, handle in zip(self.collections, handles, strict=False):
            coll.cancel_fused_prefetch(handle)

    def _train_step(self, batch: Any) -> torch.Tensor:
        loss = self.loss(self.model, batch)
        loss.backward()
        if self.dense_optimizer is not None:
            self.dense_optimizer.step()
            self.dense_optimizer.zero_grad()
        self.sparse_optimizer.step()
        return loss.detach()

    def run(
        self,
        batches: Iterable[Any],
        max_steps: int | None = None,
        on_step: Callable[[int, torch.Tensor], None] | None = None,
    ) -> list[float]:
        """Train on ``batches`` (at most ``max_steps``); returns the losses.

        ``on_step(step, loss)`` is called after each step (progress bars, logging).
        """
        losses: list[float] = []
        it = iter(batches)
        current = next(it, _END)
        pending: list[FusedPrefetchHandle] | None = None
        try:
            if current is not _END and self.prefetch:
                pending = self._issue(current)
            while current is not _END and (max_steps is None or len(losses) < max_steps):
                prefetched = self._ready(pending) if pending is not None else None
                pending = None
                last = max_steps is not None and len(losses) + 1 >= max_steps
                following = _END if last else next(it, _END)
                fallback = isinstance(prefetched, CacheCapacityError)
                # After a fallback the next prefetch waits for this batch's synchronous resolve,
                # which would otherwise compete with it for the same room.
                if following is not _END and self.prefetch and not fallback:
                    pending = self._issue(following)
                self._pending = pending
                if fallback:
                    self.fallbacks += 1
                    warnings.warn(
                        "the cache is too small for two batches in flight, so this batch runs "
                        f"without prefetch ({prefetched}); a capacity of about twice the unique "
                        "rows of one batch avoids this",
                        PrefetchFallbackWarning,
                        stacklevel=2,
                    )
                elif prefetched is not None:
                    for coll, handle in zip(self.collections, prefetched, strict=True):
                        coll.set_fused_prefetch_handle(handle)
                loss = self._train_step(current)
                if following is not _END and self.prefetch and fallback:
                    pending = self._issue(following)
                losses.append(float(loss))
                if on_step is not None:
                    on_step(len(losses), loss)
                current = following
        finally:
            self._pending = None
            if pending is not None:
                self._cancel(pending)
            for coll in self.collections:
                handle = coll.pending_prefetch
                if handle is not None:
                    coll.cancel_fused_prefetch(handle)
            self.sparse_optimizer.zero_grad()
        return losses
