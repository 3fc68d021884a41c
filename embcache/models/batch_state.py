"""What a collection holds for a batch between its forward and its optimizer step: the resolved
slots of each cache (`_Resolved`), the forward in flight (`_Batch`), a prefetch issued ahead of
its forward (`FusedPrefetchHandle`) and the gradients a backward recorded (`TraceEntry`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embcache.engine.inputs import JaggedBatch


@dataclass
class _Resolved:
    """One cache's share of a batch: unique ids, their slots, and the bag layout."""

    unique: torch.Tensor  # int64 [U] fused ids, ascending
    inverse: torch.Tensor  # int64 [nnz]
    slots: torch.Tensor  # int64 [U]
    offsets: torch.Tensor  # int64 [F*B + 1]
    weights: torch.Tensor | None
    locked: bool
    # (order, segments) of `kernels.ids.dedup_grouped`: the values grouped by unique id, for
    # a one-pass backward on the CPU. None where the group has several lookups (pooling
    # modes), whose backward sees slices of the values.
    grouping: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class FusedPrefetchHandle:
    """What `issue_fused_prefetch` resolved for one batch: pass it to
    `set_fused_prefetch_handle` and run the forward on the same features."""

    module_id: int
    generation: int
    keys: list[str]
    lengths: torch.Tensor
    values: torch.Tensor
    resolved: list[_Resolved]
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


@dataclass
class _Batch:
    """A forward in flight: its locked slots and whether backward ran."""

    resolved: list[_Resolved]
    backward_done: bool = False


class TraceEntry:
    """One table's gradients from one backward; unpacks as ``(table_name, ids, grads)``."""

    __slots__ = ("batch", "grads", "group", "ids", "table_name")

    def __init__(self, table_name, ids, grads, group, batch) -> None:
        self.table_name = table_name
        self.ids = ids  # int64 [n] raw ids, ascending, distinct
        self.grads = grads  # float32 [n, D]
        self.group = group  # index of the cache group
        self.batch = batch  # the _Batch whose slots hold these rows

    def __iter__(self):
        return iter((self.table_name, self.ids, self.grads))

    def __repr__(self) -> str:
        return f"TraceEntry({self.table_name!r}, ids[{self.ids.numel()}])"
