"""The optimizer rules, one spec each: every fact about a rule lives here, and every other table
(state layout, param groups, torch classes, FBGEMM types, RecStore names, CLI names and learning
rates, the cache's widest row) is derived from `RULES`.

A spec names its state parts (their widths per row), its hyper-parameters with their defaults
(as torch's optimizers name them in a param group), the torch class it equals on the rows a step
touches, the FBGEMM optimizer whose CPU TBE computes the same numbers (if any), its RecStore name,
its CLI name with the default learning rates of ``embcache train``, the embcache optimizer class
that applies it, and its float64 reference update (`RuleSpec.reference`), which the tests check
every backend against.

A new rule: a member of `OptimRule`, a spec in `RULES`, and its branch of the row-update kernel
and of its torch twin (`ops/update/triton.py`, `ops/update/spec.py`): three files. Its
`SparseOptimizer` class, exported by `embcache.optim` and `embcache` under ``sparse_class``, is
made from the spec (`embcache.optim.sparse.rule_class`) unless `embcache/optim/sparse.py`
writes one of that name.

This module, the update family's registry of rules (`embcache.ops.update`; re-exported at its
old path, `embcache.kernels.optim_rules`), imports no other embcache module and neither torch
nor triton (`embcache --help` reads the CLI's facts from it); the reference updates take
tensors and use their methods only.
"""

from __future__ import annotations

import enum
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class OptimRule(enum.IntEnum):
    """The update rule applied to a row; the value is what the Triton kernel branches on."""

    SGD = 0
    ADAGRAD = 1
    ROWWISE_ADAGRAD = 2
    ADAM = 3
    ADAMW = 4

    @property
    def spec(self) -> RuleSpec:
        """This rule's `RuleSpec`."""
        return RULES[self]


@dataclass(frozen=True)
class StatePart:
    """One named block of a row's state columns: ``dim`` columns (per weight) or one (per
    row)."""

    name: str
    per_weight: bool

    def width(self, dim: int) -> int:
        return dim if self.per_weight else 1


# A float64 reference: (weights [n, dim], {part: [n, width]}, grads [n, dim], update, step) ->
# (new weights, new state parts); ``update`` is a `ops.update.RowUpdate`.
Reference = Callable[[Any, dict[str, Any], Any, Any, int], tuple[Any, dict[str, Any]]]


@dataclass(frozen=True)
class RuleSpec:
    """Everything about one optimizer rule.

    Attributes:
        rule: its `OptimRule`.
        cli: its name on the command line (``embcache train --optimizer``) and in
            `embcache.train.loop.SPARSE_OPTIMIZERS`.
        sparse_class: the `embcache.optim` class that applies it.
        state: its state parts, in column order after the weights.
        hyper: the param-group entries besides ``lr``, with their defaults (the sparse
            optimizer's constructor defaults), as torch names them (``betas`` a pair).
        state_init: the torch hyper-parameter that fills fresh state (Adagrad's
            ``initial_accumulator_value``), or None (zeros).
        torch_class: the torch optimizer it equals on the touched rows (module path; torchrec's
            by its full path, never imported).
        torch_lazy: whether ``torch_class`` itself leaves untouched rows alone, so a torch
            optimizer of that class over a collection's parameters can run this rule (AdamW
            moves every row: only a fused collection takes it, with FBGEMM's row-sparse
            semantics).
        fused_aliases: further torch classes a fused collection (``optimizer_type=``) maps to
            this rule (FBGEMM's Adam is row-sparse).
        fbgemm_cpu: FBGEMM's ``EmbOptimType`` whose CPU TBE computes this rule's numbers (the
            TBE step, `engine.tbe_step`), or None.
        recstore: the backend optimizer's ``type`` in a RecStore configuration.
        lr, dense_lr: ``embcache train``'s default learning rates (tables, dense layers).
        dense_class: the torch optimizer ``embcache train`` gives the dense layers.
        reference: the float64 reference update.
    """

    rule: OptimRule
    cli: str
    sparse_class: str
    state: tuple[StatePart, ...]
    hyper: Mapping[str, Any]
    torch_class: str
    recstore: str
    lr: float
    dense_lr: float
    dense_class: str
    reference: Reference
    state_init: str | None = None
    torch_lazy: bool = True
    fused_aliases: tuple[str, ...] = ()
    fbgemm_cpu: str | None = None

    @property
    def state_names(self) -> list[str]:
        return [p.name for p in self.state]

    def state_dim(self, dim: int) -> int:
        """State columns beside a row of ``dim`` weights."""
        return sum(p.width(dim) for p in self.state)

    @property
    def state_per_weight(self) -> int:
        """State values per weight of a wide row (per-row parts count for nothing)."""
        return sum(p.per_weight for p in self.state)

    def update_fields(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """The `RowUpdate` fields (but ``rule``) of a param group's entries (``lr`` and this
        rule's hyper-parameters; ``betas`` become ``beta1``, ``beta2``)."""
        fields = {"lr": group["lr"]}
        for key in self.hyper:
            if key == "betas":
                fields["beta1"], fields["beta2"] = group[key]
            else:
                fields[key] = group[key]
        return fields

    def param_group(self, update: Any) -> dict[str, Any]:
        """The param-group entries of ``update`` (a `RowUpdate` of this rule)."""
        group: dict[str, Any] = {"lr": update.lr}
        for key in self.hyper:
            group[key] = (update.beta1, update.beta2) if key == "betas" else getattr(update, key)
        return group

    def equals_class(self, cls: type, fused: bool) -> bool:
        """Whether torch optimizer class ``cls`` is this rule (``fused``: as
        ``optimizer_type=`` of a fused collection, aliases included)."""
        paths = (self.torch_class, *self.fused_aliases) if fused else (self.torch_class,)
        return any(_is_class(cls, p) for p in paths)


def _is_class(cls: type, path: str) -> bool:
    """Whether ``cls`` is the class at ``path``, importing nothing: its own path, or the
    attribute ``path`` names of an already imported module (``torch.optim.SGD`` lives in
    ``torch.optim.sgd``)."""
    if f"{cls.__module__}.{cls.__qualname__}" == path:
        return True
    module, _, name = path.rpartition(".")
    return getattr(sys.modules.get(module), name, None) is cls


# -- float64 references ----------------------------------------------------------------------


def _l2(w: Any, g: Any, update: Any) -> Any:
    return g + update.weight_decay * w


def _sgd_reference(w, state, g, update, step):
    return w - update.lr * _l2(w, g, update), {}


def _adagrad_reference(w, state, g, update, step):
    g = _l2(w, g, update)
    clr = update.lr / (1 + (step - 1) * update.lr_decay)
    acc = state["sum"] + g * g
    return w - clr * g / (acc.sqrt() + update.eps), {"sum": acc}


def _rowwise_adagrad_reference(w, state, g, update, step):
    g = _l2(w, g, update)
    acc = state["sum"] + (g * g).mean(1, keepdim=True)
    return w - update.lr * g / (acc.sqrt() + update.eps), {"sum": acc}


def _adam_moments(w, state, g, update, step):
    b1, b2 = update.beta1, update.beta2
    m = b1 * state["exp_avg"] + (1 - b1) * g
    v = b2 * state["exp_avg_sq"] + (1 - b2) * g * g
    step_size = update.lr * math.sqrt(1 - b2**step) / (1 - b1**step)
    return w - step_size * m / (v.sqrt() + update.eps), {"exp_avg": m, "exp_avg_sq": v}


def _adam_reference(w, state, g, update, step):
    return _adam_moments(w, state, _l2(w, g, update), update, step)


def _adamw_reference(w, state, g, update, step):
    return _adam_moments(w * (1 - update.lr * update.weight_decay), state, g, update, step)


_SUM = (StatePart("sum", per_weight=True),)
_MOMENTS = (StatePart("exp_avg", per_weight=True), StatePart("exp_avg_sq", per_weight=True))
_BETAS = (0.9, 0.999)

RULES: dict[OptimRule, RuleSpec] = {
    s.rule: s
    for s in (
        RuleSpec(
            OptimRule.SGD,
            cli="sgd",
            sparse_class="SparseSGD",
            state=(),
            hyper={"weight_decay": 0.0},
            torch_class="torch.optim.SGD",
            fbgemm_cpu="EXACT_SGD",
            recstore="SGD",
            lr=5.0,
            dense_lr=0.1,
            dense_class="torch.optim.SGD",
            reference=_sgd_reference,
        ),
        RuleSpec(
            OptimRule.ADAGRAD,
            cli="adagrad",
            sparse_class="SparseAdaGrad",
            state=_SUM,
            hyper={"weight_decay": 0.0, "eps": 1e-10, "lr_decay": 0.0},
            state_init="initial_accumulator_value",
            torch_class="torch.optim.Adagrad",
            fbgemm_cpu="EXACT_ADAGRAD",
            recstore="AdaGrad",
            lr=0.05,
            dense_lr=0.01,
            dense_class="torch.optim.Adagrad",
            reference=_adagrad_reference,
        ),
        RuleSpec(
            OptimRule.ROWWISE_ADAGRAD,
            cli="rowwise_adagrad",
            sparse_class="SparseRowWiseAdaGrad",
            state=(StatePart("sum", per_weight=False),),
            # FBGEMM's default eps (SplitTableBatchedEmbeddingBagsCodegen's), the rule's origin.
            hyper={"weight_decay": 0.0, "eps": 1e-8},
            state_init="initial_accumulator_value",
            torch_class="torchrec.optim.rowwise_adagrad.RowWiseAdagrad",
            fbgemm_cpu="EXACT_ROWWISE_ADAGRAD",
            recstore="RowWiseAdaGrad",
            lr=0.05,
            dense_lr=0.01,
            dense_class="torch.optim.Adagrad",
            reference=_rowwise_adagrad_reference,
        ),
        RuleSpec(
            OptimRule.ADAM,
            cli="adam",
            sparse_class="SparseAdam",
            state=_MOMENTS,
            hyper={"weight_decay": 0.0, "eps": 1e-8, "betas": _BETAS},
            torch_class="torch.optim.SparseAdam",
            # FBGEMM's Adam is row-sparse (a fused collection's torch.optim.Adam); its CPU TBE
            # has no Adam.
            fused_aliases=("torch.optim.Adam",),
            recstore="Adam",
            lr=0.005,
            dense_lr=0.001,
            dense_class="torch.optim.Adam",
            reference=_adam_reference,
        ),
        RuleSpec(
            OptimRule.ADAMW,
            cli="adamw",
            sparse_class="SparseAdamW",
            state=_MOMENTS,
            hyper={"weight_decay": 1e-2, "eps": 1e-8, "betas": _BETAS},
            # torch's AdamW moves every row every step: only a fused collection takes it.
            torch_class="torch.optim.AdamW",
            torch_lazy=False,
            recstore="AdamW",
            lr=0.005,
            dense_lr=0.001,
            dense_class="torch.optim.AdamW",
            reference=_adamw_reference,
        ),
    )
}
"""Every rule's spec, in `OptimRule` order."""

assert list(RULES) == list(OptimRule), "one spec per rule, in OptimRule order"


def _key(name: str) -> str:
    return str(name).lower().replace("_", "").replace("-", "")


def by_cli(name: str) -> RuleSpec:
    """The rule called ``name`` on the command line.

    Raises:
        ValueError: no such rule (the message lists them).
    """
    for s in RULES.values():
        if s.cli == name:
            return s
    raise ValueError(f"unknown optimizer {name!r}; choose from {[s.cli for s in RULES.values()]}")


def by_recstore(name: str) -> RuleSpec | None:
    """The rule of a RecStore backend optimizer ``type`` (case, ``_`` and ``-`` ignored)."""
    for s in RULES.values():
        if _key(s.recstore) == _key(name):
            return s
    return None


def by_torch_class(cls: type, fused: bool = False) -> RuleSpec | None:
    """The rule torch optimizer class ``cls`` equals on the touched rows (``fused``: as a fused
    collection's ``optimizer_type``), or None."""
    for s in RULES.values():
        if s.equals_class(cls, fused):
            return s
    return None


def by_fbgemm(name: str) -> RuleSpec | None:
    """The rule FBGEMM's CPU TBE computes with ``EmbOptimType`` ``name``, or None."""
    for s in RULES.values():
        if s.fbgemm_cpu == name:
            return s
    return None


CLI_NAMES = tuple(s.cli for s in RULES.values())
"""The CLI's optimizer names, in rule order."""
DEFAULT_LR = {s.cli: s.lr for s in RULES.values()}
"""``embcache train``'s default table learning rate per optimizer."""
DEFAULT_DENSE_LR = {s.cli: s.dense_lr for s in RULES.values()}
"""``embcache train``'s default dense learning rate per optimizer."""
WIDEST_STATE = max(s.state_per_weight for s in RULES.values())
"""State values per weight of the widest rule (what a cache sizes its slots for)."""
