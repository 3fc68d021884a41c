"""What a collection's engines ask of a sparse optimizer (`embcache.optim.SparseOptimizer` is
one; RecStore's backend optimizer and a collection's plain SGD are others): the rule with its
hyper-parameters and the step counts to apply a trace (`StepOptimizer`), and, once attached,
the state columns it keeps beside each row and its check of the gradients
(`AttachedOptimizer`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from embcache.kernels.optim import RowUpdate


class DeviceCheck(Protocol):
    """A check made on the device, read on the host with the step's own read
    (`embcache.optim.sparse.GradientCheck`): ``sums`` (0-d device tensors) and ``judge`` of
    their values (raises ValueError, having changed nothing); ``verify`` reads them itself."""

    sums: list[torch.Tensor]

    def judge(self, values: Sequence[float]) -> None: ...

    def verify(self) -> None: ...


class StepOptimizer(Protocol):
    """What applying gradients needs (`EngineGroup.apply`, `EngineGroup.apply_trace`)."""

    @property
    def update(self) -> RowUpdate: ...

    def advance_steps(self, module: object, tables: Sequence[str]) -> dict[str, int]:
        """Advance and return the step count of each of ``module``'s ``tables``."""
        ...


class AttachedOptimizer(StepOptimizer, Protocol):
    """An optimizer attached to a collection (`EngineGroup.attach`)."""

    @property
    def state_init(self) -> float: ...

    def state_dim(self, dim: int) -> int:
        """State columns beside a row of ``dim`` weights."""
        ...

    def check_gradients(self, entries: Sequence[tuple[str, Any, torch.Tensor]]) -> None:
        """Refuse NaN/Inf gradients (ValueError) before any update."""
        ...
