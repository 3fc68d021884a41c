"""Training a cached collection the torchrec way: torch optimizers over ``model.parameters()``,
a fused optimizer (``optimizer_type=`` as in torchrec's `FusedEmbeddingBagCollection`), or
``apply_optimizer_in_backward``.

The rows live in caches and tiers, not in parameters, so a collection stands in
``model.parameters()`` with one zero-size parameter (``grad_anchor``). When a torch optimizer
holding it steps, a step pre-hook (registered once, for every optimizer of the process) applies
the collection's recorded gradients with the same rule and the hyper-parameters of the
anchor's param group, read at every step (so an LR scheduler drives them); the optimizer state
lives beside each row, as with embcache's own optimizers. The gradients it applies are the
anchor's ``.grad`` (`models.row_grads`), so ``GradScaler`` (unscale, skipped steps) and
``clip_grad_norm_``/``clip_grad_value_`` act on them first, as on torchrec's weights. That
reproduces the torch optimizer on the rows exactly where it leaves untouched rows alone, as
torchrec's dense-gradient training does for:

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
``torch.optim.Adam`` is FBGEMM's row-sparse Adam (`SparseAdam`'s rule), ``torch.optim.AdamW``
the same with AdamW's decoupled decay on the touched rows (the ADAMW rule, lazy AdamW).

Which torch class is which rule is the rules' table (`kernels.optim_rules.RULES`:
``torch_class``, ``torch_lazy``, ``fused_aliases``).
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

from embcache.engine.options import CollectionOptions
from embcache.kernels.optim import RowUpdate
from embcache.kernels.optim_rules import RULES, by_torch_class
from embcache.models.row_grads import GradAnchor, RowGradients
from embcache.optim.sparse import SparseOptimizer

_HELP = (
    "train the tables with torch.optim.SGD (no momentum), Adagrad, SparseAdam or torchrec's "
    "RowWiseAdagrad over the collection's parameters, build it with optimizer_type=... "
    "(applied in backward, as torchrec's FusedEmbeddingBagCollection), or attach an embcache "
    "optimizer (embcache.SparseAdaGrad([collection], lr=...)) and give the torch optimizer "
    "the other parameters"
)


# The defaults of FBGEMM's fused optimizers (``SplitTableBatchedEmbeddingBagsCodegen``'s
# ``learning_rate``, ``eps``, ``beta1``, ``beta2``, ``weight_decay``), which torchrec's
# FusedEmbeddingBagCollection takes for whatever ``optimizer_kwargs`` leaves out, whatever the
# torch class's own defaults (torch.optim.Adagrad's eps is 1e-10, SGD's lr 1e-3).
FBGEMM_DEFAULTS: dict[str, Any] = {
    "lr": 0.01,
    "eps": 1e-8,
    "betas": (0.9, 0.999),
    "weight_decay": 0.0,
}


def _hyper(
    optimizer_type: type[torch.optim.Optimizer], given: Mapping[str, Any], fused: bool = False
) -> dict[str, Any]:
    """``given`` over the defaults of ``optimizer_type``'s constructor, or with ``fused``
    over FBGEMM's (`FBGEMM_DEFAULTS`, where the class has the option) and with FBGEMM's names
    ``learning_rate``, ``beta1``, ``beta2`` taken as torch's ``lr`` and ``betas``."""
    params = inspect.signature(optimizer_type.__init__).parameters
    defaults = {
        k: p.default
        for k, p in params.items()
        if k not in ("self", "params") and p.default is not inspect.Parameter.empty
    }
    if not fused:
        return {**defaults, **given}
    defaults.update((k, v) for k, v in FBGEMM_DEFAULTS.items() if k in defaults)
    given = dict(given)
    if "learning_rate" in given:
        given.setdefault("lr", given.pop("learning_rate"))
    if "beta1" in given or "beta2" in given:
        beta1, beta2 = given.get("betas", defaults.get("betas", FBGEMM_DEFAULTS["betas"]))
        given["betas"] = (given.pop("beta1", beta1), given.pop("beta2", beta2))
    return {**defaults, **given}


def row_update(
    optimizer_type: type, hyper: Mapping[str, Any], fused: bool
) -> tuple[RowUpdate, float]:
    """The row rule (and initial state value) that equals ``optimizer_type`` with ``hyper`` on
    the rows a batch touched.

    Args:
        optimizer_type: a torch optimizer class (or torchrec's ``RowWiseAdagrad``).
        hyper: its hyper-parameters (a param group, or the kwargs of a fused collection);
            missing ones take the class's defaults (FBGEMM's when ``fused``).
        fused: FBGEMM's semantics (its defaults, weight decay on the touched rows, Adam
            row-sparse) rather than a torch optimizer's on dense gradients.

    Raises:
        TypeError: an optimizer with no row-wise equivalent.
        ValueError: an option with none (momentum, dense weight decay, amsgrad, maximize).
    """
    h = _hyper(optimizer_type, hyper, fused)
    shown = ", ".join(f"{k}={v!r}" for k, v in hyper.items() if k != "params")
    where = f"{optimizer_type.__name__}({shown})"

    def refuse(option: str, why: str) -> None:
        raise ValueError(f"{where}: {option} {why}, which cached tables cannot do; {_HELP}")

    spec = by_torch_class(optimizer_type, fused=True)
    if spec is None:
        raise TypeError(f"{where} has no row-wise rule for cached tables; {_HELP}")
    if not fused and not (spec.torch_lazy and spec.equals_class(optimizer_type, fused=False)):
        instead = (
            f"use {spec.torch_class} for the collection's parameters (the same rule on the "
            "rows a batch touched)"
            if spec.torch_lazy
            else f"use embcache.{spec.sparse_class}([collection], ...) (the same rule on the "
            f"rows a batch touched), optimizer_type={spec.torch_class} (fused)"
        )
        raise TypeError(
            f"{where} moves every row at every step (its moments decay even where the gradient "
            f"is zero), which cached tables cannot do: {instead}, or {_HELP}"
        )
    if h.get("maximize"):
        refuse("maximize=True", "is not supported")
    decay = float(h.get("weight_decay", 0.0))
    if decay and not fused:
        refuse("weight_decay", "moves every row of a dense gradient, even rows never looked up")
    if h.get("momentum") or h.get("nesterov"):
        refuse("momentum", "moves rows after their last lookup")
    if h.get("amsgrad"):
        refuse("amsgrad", "is not supported")
    if h.get("decoupled_weight_decay") and decay:
        refuse("decoupled_weight_decay=True", "is not supported (AdamW: optimizer_type=AdamW)")
    if h.get("lr_decay") and "lr_decay" not in spec.hyper:
        refuse("lr_decay", f"is not supported by the {spec.rule.name.lower()} rule")
    group = {**spec.hyper, **{k: v for k, v in h.items() if k in spec.hyper}, "lr": h["lr"]}
    group["weight_decay"] = decay
    state_init = float(h.get(spec.state_init, 0.0)) if spec.state_init else 0.0
    return RowUpdate(spec.rule, **spec.update_fields(group)), state_init


class FusedRowOptimizer(SparseOptimizer):
    """The optimizer of a fused collection: ``optimizer_type`` applied inside backward, with
    FBGEMM's defaults for what ``optimizer_kwargs`` leaves out (`FBGEMM_DEFAULTS`: eps 1e-8
    for the AdaGrad family, lr 0.01), as torchrec's ``FusedEmbeddingBagCollection`` has them.

    ``param_group`` holds the hyper-parameters as a torch param group (the one the collection's
    ``fused_optimizer()`` exposes); its ``"lr"`` is read at every update, so an LR scheduler
    stepping that optimizer drives it.
    """

    def __init__(
        self, module: Any, optimizer_type: type, optimizer_kwargs: Mapping[str, Any]
    ) -> None:
        update, state_init = row_update(optimizer_type, optimizer_kwargs, fused=True)
        self.optimizer_type = optimizer_type
        self.param_group: dict[str, Any] = _hyper(optimizer_type, optimizer_kwargs, fused=True)
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


def fused_row_optimizer(
    collection: Any, optimizer_type: type | None, optimizer_kwargs: Mapping[str, Any]
) -> FusedRowOptimizer | None:
    """The `FusedRowOptimizer` of a collection built with ``optimizer_type=`` (None
    without)."""
    if optimizer_type is None:
        return None
    return FusedRowOptimizer(collection, optimizer_type, optimizer_kwargs)


# -- torch optimizers over model.parameters() ------------------------------------------------


def anchor_rows(collection: Any) -> tuple[RowGradients, GradAnchor]:
    """``collection``'s stand-in in ``model.parameters()``: zero rows of a 2-D "table" on its
    device (as optimizers written for embedding weights expect), whose ``.grad`` is the
    rows' gradient (`RowGradients`, which its engines record into)."""
    rows = RowGradients(collection)
    anchor = GradAnchor(torch.empty(0, 1, device=collection.device))
    anchor.rows = rows
    anchor.register_post_accumulate_grad_hook(rows.backward_done)
    collection.engines.gradients = rows
    return rows, anchor


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
                # Asked without making the rows' gradient (`models.row_grads`): a loop that
                # never reads .grad keeps the TBE step's speed.
                torch_step(collection, optimizer, group, has_grad=collection.row_grads.pending())
                # Taken: the optimizer's own update skips the anchor, whatever gradient layout
                # (dense, sparse) it insists on.
                collection.row_grads.take()


def torch_step(
    collection: Any, optimizer: torch.optim.Optimizer, group: Mapping[str, Any], has_grad: bool
) -> None:
    """Apply ``collection``'s recorded gradients as ``optimizer`` with ``group``'s
    hyper-parameters would on the touched rows; nothing when an embcache optimizer (or a fused
    one) trains the collection already. The gradients are the anchor's ``.grad`` as torch's
    utilities left it (GradScaler's unscale, clipping: `models.row_grads`). Without a gradient
    on the anchor (``zero_grad()`` ran since the backward, or another optimizer's step took
    it), the locks of forwards never backpropagated are released.

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
        pending = engines.entries()
        engines.replace_entries([])
        try:
            bridge = SparseOptimizer([collection], update, state_init=state_init)
        finally:
            engines.replace_entries(pending)
        collection.torch_optimizer_rule = bridge
    bridge.update = update
    bridge.step()


# -- torchrec's KeyedOptimizer for fused_optimizer() ------------------------------------------


class FusedOptimizerConventions:
    """torchrec's ways to train a cached collection (one process's or a sharded one's): the
    ``grad_anchor`` that stands for its tables in ``parameters()``, so that a torch optimizer
    holding it steps the rows (`register_anchor`), and ``optimizer_type=`` /
    ``optimizer_kwargs=``, a `FusedRowOptimizer` applied inside backward, which
    ``fused_optimizer()`` shows as a torchrec ``KeyedOptimizer``."""

    row_grads: RowGradients
    grad_anchor: torch.Tensor  # a `GradAnchor`

    def _setup_torch_training(self, options: CollectionOptions) -> None:
        """The anchor (its ``.grad`` the rows' gradient: `models.row_grads`), the fused
        optimizer, and the anchor's registration; after the collection's `_setup`."""
        self.row_grads, self.grad_anchor = anchor_rows(self)
        self.torch_optimizer_rule: Any = None  # set by the first torch optimizer step
        self._optimizer_type = options.optimizer_type
        self._optimizer_kwargs = dict(options.optimizer_kwargs or {})
        self._fused = fused_row_optimizer(self, options.optimizer_type, self._optimizer_kwargs)
        self._keyed_optimizer: Any = None
        register_anchor(self)

    def fused_optimizer(self) -> Any:
        """The optimizer applied inside backward, as a torchrec ``KeyedOptimizer``: an LR
        scheduler can drive its ``param_groups``; ``state_dict()`` / ``load_state_dict()``
        carry the optimizer state of every row (a sharded collection's gathers it: a
        collective). Needs torchrec and ``optimizer_type=``."""
        if self._fused is None:
            raise RuntimeError(
                "this collection has no fused optimizer: build it with optimizer_type=... and "
                "optimizer_kwargs=... (as torchrec's FusedEmbeddingBagCollection)"
            )
        if self._keyed_optimizer is None:
            self._keyed_optimizer = keyed_optimizer(self, self._fused)
        return self._keyed_optimizer

    def optimizer_type(self) -> type | None:
        return self._optimizer_type

    def optimizer_kwargs(self) -> dict[str, Any]:
        return dict(self._optimizer_kwargs)


def keyed_optimizer(collection: Any, fused: FusedRowOptimizer) -> Any:
    """A torchrec ``KeyedOptimizer`` over a fused collection's tables, keyed as torchrec's
    ``FusedEmbeddingBagCollection.fused_optimizer()`` keys its own, so checkpoints load either
    way: ``param_groups`` (one, the fused optimizer's, which an LR scheduler can drive),
    ``params`` keyed ``<table>.weight`` (zero-size stand-ins: the rows are not in memory as one
    tensor), and ``state`` per table, FBGEMM's state tensors by FBGEMM's names
    (``<table>.weight.momentum_1``: Adagrad's ``[num_embeddings, dim]`` sum of squares, the
    row-wise one's ``[num_embeddings]``; Adam's moments ``momentum_1`` and ``momentum_2``; SGD
    none), read and written through ``state_dict()`` / ``load_state_dict()``. Needs torchrec."""
    cls = _keyed_optimizer_class()
    params: dict[str, torch.Tensor] = {}
    state: dict[torch.Tensor, dict[str, Any]] = {}
    parts = len(RULES[fused.update.rule].state)
    for t in collection.tables:
        key = f"{t.name}.weight"
        params[key] = stand_in = torch.empty(0)
        if parts:  # a stateless rule has no entry, as torchrec's fused SGD
            state[stand_in] = {
                f"{key}.momentum_{i + 1}": TableState(collection, t, i, parts) for i in range(parts)
            }
    group = fused.param_group
    group["params"] = list(params.values())
    return cls(params, state, [group])


class TableState:
    """One state tensor of one table (``part`` of ``parts`` equal blocks of its state
    columns), with the stateful protocol a torchrec ``KeyedOptimizer`` reads and writes; a
    one-column block (row-wise AdaGrad's) is the 1-D ``[num_embeddings]`` tensor FBGEMM has."""

    def __init__(self, collection: Any, table: Any, part: int, parts: int) -> None:
        self.collection, self.table, self.part, self.parts = collection, table, part, parts

    def _columns(self) -> slice:
        spec = self.collection.store.table_spec(self.table.name)
        width = spec.state_dim // self.parts
        lo = spec.dim + self.part * width
        return slice(lo, lo + width)

    def state_dict(self) -> torch.Tensor:
        """``[num_embeddings, width]`` (``[num_embeddings]`` for one column) float32, read from
        the tier after a flush."""
        value = self.collection.table_rows(self.table.name)[:, self._columns()]
        return (value.squeeze(1) if value.shape[1] == 1 else value).clone()

    def load_state_dict(self, value: torch.Tensor) -> None:
        columns = self._columns()
        width = columns.stop - columns.start
        expected = (self.table.num_embeddings, width)
        if width == 1 and value.dim() == 1:
            value = value.unsqueeze(1)
        if tuple(value.shape) != expected:
            shown = (self.table.num_embeddings,) if width == 1 else expected
            raise ValueError(
                f"optimizer state of table {self.table.name!r}: shape {tuple(value.shape)}, "
                f"expected {shown}"
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
