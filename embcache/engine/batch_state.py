"""What a collection holds for a batch between its forward and its optimizer step: each cache's
share of the batch (`Prepared`), the forward in flight (`InFlight`), a prefetch issued ahead of
its forward (`FusedPrefetchHandle`, its `PrefetchState` and what it resolved, `Prefetched`) and
the gradients a backward recorded (`TraceEntry`)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from embcache.engine.inputs import JaggedBatch


@dataclass
class DirectIds:
    """A batch share served by a direct-mapped cache without dedup or resolve (the TBE
    step): the raw ids as the tables number them, and the slot of each or (found by a
    compiled pass, `IdsOps.direct_rows`) the distinct slots; the engine computes the
    slot of each when it needs them (`CacheEngine.value_slots`)."""

    values: torch.Tensor  # int64 [nnz] raw ids, the cache's features in layout order
    slots: torch.Tensor | None  # int64 [nnz] slot of each value (repeats kept)
    rows: torch.Tensor | None = None  # int64 [U] the distinct slots (None: not known)
    batch: int = 0  # its number at the cache (`HotCache.serve_direct`)


@dataclass
class Prepared:
    """One cache's share of a batch: unique ids, their slots, and the bag layout.

    A share served directly (``direct`` set) has no ``unique``, ``inverse`` or ``slots`` until
    something needs per-id rows (`CacheEngine.materialize` fills them in and locks the slots).
    """

    unique: torch.Tensor | None  # int64 [U] fused ids, ascending
    inverse: torch.Tensor | None  # int64 [nnz]
    slots: torch.Tensor | None  # int64 [U]
    offsets: torch.Tensor  # int64 [F*B + 1]
    weights: torch.Tensor | None
    locked: bool
    # (order, segments) of `kernels.ids.dedup_grouped`: the values grouped by unique id, for
    # a one-pass backward on the CPU. None where the cache has several lookups (pooling
    # modes), whose backward sees slices of the values.
    grouping: tuple[torch.Tensor, torch.Tensor] | None = None
    direct: DirectIds | None = None
    # Where each lookup's values start, then nnz (host ints): with several pooling modes,
    # `CacheLayout.bags` cuts the values there. Known on the host when the caches' shares
    # were made together (`EngineGroup.check`); None: read from the offsets when needed.
    cuts: list[int] | None = None
    # `CacheLayout.table_bounds` of ``unique`` (host ints), when the dedup read them with its
    # own read (`IdsOps.dedup_together`): the backward's trace then reads nothing.
    bounds: list[int] | None = None


@dataclass
class InFlight:
    """A forward in flight: each cache's share (slots locked until the step) and whether its
    backward ran.

    A forward whose backward has not run gives its slots back at the next training forward,
    `flush` (and so ``embcache.save``) or ``zero_grad`` (``released``): a validation pass with
    gradients enabled never holds the cache. (A forward under ``torch.no_grad()`` leaves them:
    it may run between a training forward and its backward.) Should its backward come after
    all, the step resolves its rows again (`CacheEngine.locate`), so the update is the
    same."""

    prepared: list[Prepared]
    backward_done: bool = False
    released: bool = False


@dataclass
class Prefetched:
    """What a prefetch resolved: each cache's share of the batch with its slots locked (empty
    when it failed: a failed prefetch holds nothing), what the collection keeps beside them (the
    sharded collection's exchange state) and the error that made it fail, if any."""

    prepared: list[Prepared | None]
    payload: Any = None
    error: Exception | None = None
    # On a GPU: the event after the prefetch's last kernel on the worker's side stream (the
    # stream that takes the result waits for it; `engine.prefetch.StreamHandoff`).
    ready: Any = None


@dataclass(eq=False)
class PrefetchState:
    """A handle's prefetch as its collection tracks it: the handle's finalizer holds this, not
    the handle, so a handle nobody references can still be released."""

    seq: int  # issue order within the collection (every rank issues in the same order)
    future: Future[Prefetched]  # set by the collection's prefetch worker
    used: bool = False  # taken by a forward, whose batch now holds the slots
    released: bool = False  # its slots were given back without a forward
    finalizer: Any = None  # weakref.finalize of the handle

    def result(self) -> Prefetched:
        """Wait for the worker; a prefetch that raised holds nothing."""
        try:
            return self.future.result()
        except Exception as e:
            return Prefetched([], error=e)


class FusedPrefetchHandle:
    """A batch's dedup and cache resolve started ahead of its forward by `issue_fused_prefetch`
    (RecStore's handle). It is returned at once while the work runs on the collection's
    prefetch worker; the forward that uses it waits only for what is left.

    The collection records the newest handle as the one its next forward uses
    (``_fused_prefetch_handle``); `set_fused_prefetch_handle` chooses another. A handle that
    will not be used gives its slots back by itself (see `embcache.engine.prefetch`).
    """

    def __init__(
        self,
        module_id: int,
        generation: int,
        keys: list[str],
        lengths: torch.Tensor,
        values: torch.Tensor,
        state: PrefetchState,
        source: object = None,
        batch: JaggedBatch | None = None,
    ) -> None:
        self.module_id = module_id
        self.generation = generation
        self.keys = keys
        self.lengths = lengths
        self.values = values
        self.state = state
        # The features object it was issued for and the checked batch made of it: a forward
        # given that same object takes the batch instead of checking it again.
        self.source = source
        self.batch = batch

    @property
    def used(self) -> bool:
        """Taken by a forward or released: it cannot be set again."""
        return self.state.used or self.state.released

    def done(self) -> bool:
        """Whether the worker has finished this prefetch."""
        return self.state.future.done()

    def wait(self) -> Exception | None:
        """Wait for the worker; returns the error that made the prefetch fail (then it holds
        nothing and its forward reads synchronously), or None."""
        return self.state.result().error

    def issued_for(self, features: JaggedBatch) -> bool:
        """Whether ``features`` are the ones this handle was issued for (same keys, lengths and
        values; the same tensors need no comparison)."""
        return list(features.keys()) == self.keys and (
            (features.values() is self.values and features.lengths() is self.lengths)
            or (
                torch.equal(features.lengths(), self.lengths)
                and torch.equal(features.values(), self.values)
            )
        )

    def __repr__(self) -> str:
        status = "used" if self.used else "ready" if self.done() else "resolving"
        return f"FusedPrefetchHandle(#{self.state.seq}, {status}, keys={self.keys})"


class TraceEntry(tuple[str, torch.Tensor, torch.Tensor]):
    """One table's gradients from one backward: the tuple ``(table_name, ids, grads)``
    (RecStore's trace item), which also knows the cache (``engine``, its index in the
    collection) and the forward (``batch``) whose slots hold these rows."""

    engine: int
    batch: InFlight | None

    def __new__(
        cls,
        table_name: str,
        ids: torch.Tensor,
        grads: torch.Tensor,
        engine: int,
        batch: InFlight | None,
    ) -> TraceEntry:
        entry = super().__new__(cls, (table_name, ids, grads))
        entry.engine = engine
        entry.batch = batch
        return entry

    @property
    def table_name(self) -> str:
        return self[0]

    @property
    def ids(self) -> torch.Tensor:
        """int64 ``[n]`` raw ids, ascending, distinct."""
        return self[1]

    @property
    def grads(self) -> torch.Tensor:
        """float32 ``[n, dim]``."""
        return self[2]

    def __repr__(self) -> str:
        return f"TraceEntry({self.table_name!r}, ids[{self.ids.numel()}])"
