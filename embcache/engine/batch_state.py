"""What a collection holds for a batch between its forward and its optimizer step: each cache's
share of the batch (`Prepared`), the forward in flight (`InFlight`), a prefetch issued ahead of
its forward (`FusedPrefetchHandle`) and the gradients a backward recorded (`TraceEntry`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embcache.engine.inputs import JaggedBatch


@dataclass
class Prepared:
    """One cache's share of a batch: unique ids, their slots, and the bag layout."""

    unique: torch.Tensor  # int64 [U] fused ids, ascending
    inverse: torch.Tensor  # int64 [nnz]
    slots: torch.Tensor  # int64 [U]
    offsets: torch.Tensor  # int64 [F*B + 1]
    weights: torch.Tensor | None
    locked: bool
    # (order, segments) of `kernels.ids.dedup_grouped`: the values grouped by unique id, for
    # a one-pass backward on the CPU. None where the cache has several lookups (pooling
    # modes), whose backward sees slices of the values.
    grouping: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class InFlight:
    """A forward in flight: each cache's share (slots locked until the step) and whether its
    backward ran."""

    prepared: list[Prepared]
    backward_done: bool = False


@dataclass
class FusedPrefetchHandle:
    """What `issue_fused_prefetch` resolved for one batch: pass it to
    `set_fused_prefetch_handle` and run the forward on the same features."""

    module_id: int
    generation: int
    keys: list[str]
    lengths: torch.Tensor
    values: torch.Tensor
    prepared: list[Prepared]
    used: bool = False

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


class TraceEntry(tuple):
    """One table's gradients from one backward: the tuple ``(table_name, ids, grads)``
    (RecStore's trace item), which also knows the cache (``engine``, its index in the
    collection) and the forward (``batch``) whose slots hold these rows."""

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
