"""Training a cached collection the torchrec way: torch optimizers over ``model.parameters()``,
a fused optimizer (``optimizer_type=`` as in torchrec's `FusedEmbeddingBagCollection`), or
``apply_optimizer_in_backward``.

The rows live in caches and tiers, not in parameters, so a collection stands in
``model.parameters()`` with one zero-size parameter (``grad_anchor``). When a torch optimizer
holding it steps, a step pre-hook (registered once, for every optimizer of the process) applies
the collection's recorded gradients with the same rule and the hyper-parameters of the
anchor's param group, read at every step (so an LR scheduler drives them); the optimizer state
lives beside each row, as with embcache's own optimizers. That reproduces the torch optimizer
on the rows exactly where it leaves untouched rows alone, as torchrec's dense-gradient training
does for:

* ``torch.optim.SGD`` (no momentum, no weight decay),
* ``torch.optim.Adagrad`` (no weight decay),
* torchrec's ``RowWiseAdagrad`` (no weight decay, no lr decay),
* ``torch.optim.SparseAdam``.

Any other optimizer or option moves rows a batch never touched (momentum, weight decay, Adam's
moments), which a cache of the touched rows cannot do: its first ``step()`` raises, naming what
to use instead. The same step runs inside backward when ``apply_optimizer_in_backward`` gave
the anchor its optimizer.

A fused collection applies its rule inside backward (`FusedRowOptimizer`); there FBGEMM's
semantics hold, as in torchrec's fused modules: weight decay is applied to the touched rows and
``torch.optim.Adam`` is FBGEMM's row-sparse Adam (`SparseAdam`'s rule).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from embcache.kernels.optim import OptimRule, RowUpdate
from embcache.optim.sparse import SparseOptimizer

_ROWWISE_ADAGRAD = "torchrec.optim.rowwise_adagrad.RowWiseAdagrad"
_HELP = (
    "train the tables with torch.optim.SGD (no momentum), Adagrad, SparseAdam or torchrec's "
    "RowWiseAdagrad over the collection's parameters, build it with optimizer_type=... "
    "(applied in backward, as torchrec's FusedEmbeddingBagCollection), or attach an embcache "
    "optimizer (embcache.SparseAdaGrad([collection], lr=...)) and give the torch optimizer "
    "the other parameters"
)


def _name(optimizer_type: type) -> str:
    return f"{optimizer_type.__module__}.{optimizer_type.__qualname__}"


def _hyper(optimizer_type: type, given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` over the defaults of ``optimizer_type``'s constructor."""
    params = inspect.signature(optimizer_type.__init__).parameters
    defaults = {
        k: p.default
        for k, p in params.items()
        if k not in ("self", "params") and p.default is not inspect.Parameter.empty
    }
    return {**defaults, **given}


def row_update(
    optimizer_type: type, hyper: Mapping[str, Any], fused: bool
) -> tuple[RowUpdate, float]:
    """The row rule (and initial state value) that equals ``optimizer_type`` with ``hyper`` on
    the rows a batch touched.

    Args:
        optimizer_type: a torch optimizer class (or torchrec's ``RowWiseAdagrad``).
        hyper: its hyper-parameters (a param group, or the kwargs of a fused collection);
            missing ones take the class's defaults.
        fused: FBGEMM's semantics (weight decay on the touched rows, Adam row-sparse) rather
            than a torch optimizer's on dense gradients.

    Raises:
        TypeError: an optimizer with no row-wise equivalent.
        ValueError: an option with none (momentum, dense weight decay, amsgrad, maximize).
    """
    name = _name(optimizer_type)
    h = _hyper(optimizer_type, hyper)
    where = f"{optimizer_type.__name__}({', '.join(f'{k}={v!r}' for k, v in hyper.items())})"

    def refuse(option: str, why: str) -> None:
        raise ValueError(f"{where}: {option} {why}, which cached tables cannot do; {_HELP}")

    if h.get("maximize"):
        refuse("maximize=True", "is not supported")
    decay = float(h.get("weight_decay", 0.0))
    if decay and not fused:
        refuse("weight_decay", "moves every row of a dense gradient, even rows never looked up")
    if optimizer_type is torch.optim.SGD:
        if h.get("momentum") or h.get("nesterov"):
            refuse("momentum", "moves rows after their last lookup")
        rule = RowUpdate(OptimRule.SGD, lr=h["lr"], weight_decay=decay)
        return rule, 0.0
    if optimizer_type is torch.optim.Adagrad or name == _ROWWISE_ADAGRAD:
        rowwise = name == _ROWWISE_ADAGRAD
        if rowwise and h.get("lr_decay"):
            refuse("lr_decay", "is not supported by the row-wise rule")
        rule = RowUpdate(
            OptimRule.ROWWISE_ADAGRAD if rowwise else OptimRule.ADAGRAD,
            lr=h["lr"],
            eps=h["eps"],
            lr_decay=0.0 if rowwise else h["lr_decay"],
            weight_decay=decay,
        )
        return rule, float(h["initial_accumulator_value"])
    if optimizer_type is torch.optim.SparseAdam or (
        fused and optimizer_type in (torch.optim.Adam, torch.optim.AdamW)
    ):
        if h.get("amsgrad"):
            refuse("amsgrad", "is not supported")
        beta1, beta2 = h["betas"]
        return RowUpdate(
            OptimRule.ADAM, lr=h["lr"], eps=h["eps"], beta1=beta1, beta2=beta2, weight_decay=decay
        ), 0.0
    if optimizer_type in (torch.optim.Adam, torch.optim.AdamW):
        raise TypeError(
            f"{where} moves every row at every step (its moments decay even where the gradient "
            "is zero), which cached tables cannot do: use torch.optim.SparseAdam for the "
            f"collection's parameters (the same rule on the rows a batch touched), or {_HELP}"
        )
    raise TypeError(f"{where} has no row-wise rule for cached tables; {_HELP}")


class FusedRowOptimizer(SparseOptimizer):
    """The optimizer of a fused collection: ``optimizer_type`` applied inside backward.

    ``param_group`` holds the hyper-parameters as a torch param group (the one the collection's
    ``fused_optimizer()`` exposes); its ``"lr"`` is read at every update, so an LR scheduler
    stepping that optimizer drives it.
    """

    def __init__(
        self, module: Any, optimizer_type: type, optimizer_kwargs: Mapping[str, Any]
    ) -> None:
        update, state_init = row_update(optimizer_type, optimizer_kwargs, fused=True)
        self.optimizer_type = optimizer_type
        self.param_group: dict[str, Any] = _hyper(optimizer_type, optimizer_kwargs)
        super().__init__([module], update, state_init=state_init)

    @property
    def update(self) -> RowUpdate:
        lr = float(self.param_group["lr"])
        if lr != self._update.lr:
            self._update = dataclasses.replace(self._update, lr=lr)
        return self._update

    @update.setter
    def update(self, value: RowUpdate) -> None:
        self._update = value


# -- torch optimizers over model.parameters() ------------------------------------------------

_COLLECTIONS: weakref.WeakSet = weakref.WeakSet()


def register_anchor(collection: Any) -> None:
    """Let torch optimizers holding ``collection.grad_anchor`` train its tables."""
    _install_hook()
    _COLLECTIONS.add(collection)


@functools.cache
def _install_hook() -> None:
    register_optimizer_step_pre_hook(_step_pre_hook)


def _step_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _COLLECTIONS:
        return
    anchors = {id(c.grad_anchor): c for c in list(_COLLECTIONS)}
    for group in optimizer.param_groups:
        for p in group["params"]:
            collection = anchors.get(id(p))
            if collection is not None and collection.grad_anchor is p:
                torch_step(collection, optimizer, group, has_grad=p.grad is not None)
                # Consumed: the optimizer's own update skips the anchor, whatever gradient
                # layout (dense, sparse) it insists on.
                p.grad = None


def torch_step(
    collection: Any, optimizer: torch.optim.Optimizer, group: Mapping[str, Any], has_grad: bool
) -> None:
    """Apply ``collection``'s recorded gradients as ``optimizer`` with ``group``'s
    hyper-parameters would on the touched rows; nothing when an embcache optimizer (or a fused
    one) trains the collection already. Without a gradient on the anchor (``zero_grad()`` ran
    since the backward), the recorded gradients are dropped, as torch drops a parameter's.

    Raises:
        TypeError, ValueError: the optimizer has no row-wise equivalent; nothing is changed.
    """
    engines = collection.engines
    bridge = collection.torch_optimizer_rule
    if engines.optimizer is not None and engines.optimizer is not bridge:
        return
    if not has_grad:
        engines.zero_grad()
        return
    update, state_init = row_update(type(optimizer), group, fused=False)
    if bridge is None or (bridge.update.rule, bridge.state_init) != (update.rule, state_init):
        # A new rule: fresh state beside every row, as a new torch optimizer starts with. The
        # recorded gradients are kept and located again after the rows change shape.
        pending, engines.trace = engines.trace, []
        try:
            bridge = SparseOptimizer([collection], update, state_init=state_init)
        finally:
            engines.trace = pending
        collection.torch_optimizer_rule = bridge
    bridge.update = update
    bridge.step()


# -- torchrec's KeyedOptimizer for fused_optimizer() ------------------------------------------


def keyed_optimizer(collection: Any, fused: FusedRowOptimizer) -> Any:
    """A torchrec ``KeyedOptimizer`` over a fused collection's tables: ``param_groups`` (one,
    the fused optimizer's, which an LR scheduler can drive), ``state`` per table (the state
    columns beside its rows, read and written through ``state_dict()`` /
    ``load_state_dict()``), and ``params`` keyed ``embedding_bags.<table>.weight`` (zero-size
    stand-ins: the rows are not in memory as one tensor). Needs torchrec."""
    cls = _keyed_optimizer_class()
    params: dict[str, torch.Tensor] = {}
    state: dict[torch.Tensor, dict[str, Any]] = {}
    parts = _STATE_PARTS[fused.update.rule]
    for t in collection.tables:
        key = f"embedding_bags.{t.name}.weight"
        params[key] = stand_in = torch.empty(0)
        state[stand_in] = {  # FBGEMM's names, as torchrec's fused optimizers give them
            f"{key}.momentum_{i + 1}": TableState(collection, t, i, parts) for i in range(parts)
        }
    group = fused.param_group
    group["params"] = list(params.values())
    return cls(params, state, [group])


# State tensors per rule (Adam's two moments side by side in the state columns).
_STATE_PARTS = {
    OptimRule.SGD: 0,
    OptimRule.ADAGRAD: 1,
    OptimRule.ROWWISE_ADAGRAD: 1,
    OptimRule.ADAM: 2,
}


class TableState:
    """One state tensor of one table (``part`` of ``parts`` equal blocks of its state
    columns), with the stateful protocol a torchrec ``KeyedOptimizer`` reads and writes."""

    def __init__(self, collection: Any, table: Any, part: int, parts: int) -> None:
        self.collection, self.table, self.part, self.parts = collection, table, part, parts

    def _columns(self) -> slice:
        spec = self.collection.store.table_spec(self.table.name)
        width = spec.state_dim // self.parts
        lo = spec.dim + self.part * width
        return slice(lo, lo + width)

    def state_dict(self) -> torch.Tensor:
        """``[num_embeddings, width]`` float32, read from the tier after a flush."""
        return self.collection.table_rows(self.table.name)[:, self._columns()].clone()

    def load_state_dict(self, value: torch.Tensor) -> None:
        columns = self._columns()
        expected = (self.table.num_embeddings, columns.stop - columns.start)
        if tuple(value.shape) != expected:
            raise ValueError(
                f"optimizer state of table {self.table.name!r}: shape {tuple(value.shape)}, "
                f"expected {expected}"
            )
        self.collection.write_table_rows(self.table.name, value, columns)


@functools.cache
def _keyed_optimizer_class() -> type:
    from torchrec.optim.fused import FusedOptimizer

    class CachedFusedOptimizer(FusedOptimizer):
        """A fused collection's optimizer, as torchrec's fused modules expose theirs: the
        update runs inside backward, so ``step`` and ``zero_grad`` have nothing to do (the
        learning rate is read from ``param_groups`` at every update)."""

        def step(self, closure: Any = None) -> None:
            return None

        def zero_grad(self, set_to_none: bool = False) -> None:
            return None

    return CachedFusedOptimizer
