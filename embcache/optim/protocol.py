"""What a sparse optimizer can drive: the one seam between the optimizers (the math) and the
modules that own rows (caches, traces, locks).

A module is a `SparseParameters` when it has these methods; the optimizers recognise it
structurally, so this package imports nothing of the modules built on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class SparseParameters(Protocol):
    """Rows trained by a sparse optimizer (cached collections, sharded ones, DistEmbedding).

    The optimizer calls, in this order:

    * `attach_sparse_optimizer` once, at its construction: the module makes room for the
      rule's state beside each row (``optimizer.state_dim(dim)``, ``optimizer.state_init``), or
      refuses a rule it cannot apply (TypeError);
    * per ``step()``: `sparse_gradients` of every module (checked before any update), then
      `apply_sparse_gradients`: the module applies ``optimizer.update`` (the rule and its
      hyper-parameters) to its rows, taking step numbers from ``optimizer.advance_steps``,
      and clears its gradients;
    * `zero_grad` to drop gradients; `sparse_tables`, `table_rows` and `write_table_rows` for
      the optimizer's ``state_dict`` (the state columns beside each row);
    * `flush` (the optimizer's ``flush()``, RecStore's call after training): every update
      applied so far written to the tier (a cache's dirty rows, a KV client's queued calls).
    """

    def attach_sparse_optimizer(self, optimizer: Any) -> None: ...

    def sparse_gradients(self) -> Sequence[tuple[str, torch.Tensor, torch.Tensor]]: ...

    def apply_sparse_gradients(self, optimizer: Any) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def sparse_tables(self) -> Sequence[Any]: ...

    def table_rows(self, table: str) -> torch.Tensor: ...

    def write_table_rows(self, table: str, rows: torch.Tensor, columns: slice) -> None: ...

    def flush(self) -> None: ...


@runtime_checkable
class ChecksInStep(Protocol):
    """A `SparseParameters` that reads the optimizer's gradient check with its own host read
    of the step, so that a step over it makes one read: ``step()`` of an optimizer of this one
    module calls `apply_checked_gradients` instead of checking the gradients and then calling
    `apply_sparse_gradients`. ``check`` (a `embcache.optim.sparse.GradientCheck`, or None when
    nothing is to be checked) holds device ``sums``; the module reads them together with its
    own, after it has located its rows and before it changes any, and hands their values to
    ``check.judge`` (a `ValueError` there must leave everything as it was)."""

    def apply_checked_gradients(self, optimizer: Any, check: Any) -> None: ...
