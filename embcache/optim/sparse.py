"""Sparse optimizers: they consume the gradient traces of cached collections and apply one fused
row update in the cache slots, with optimizer state stored beside each row (never in Python).

    opt = SparseAdaGrad([ebc], lr=0.05)
    ebc(kjt).values().sum().backward()   # trace: (table, ids, grads) per table
    opt.step()                           # aggregate per id, update rows + state, clear trace

Rules and the torch optimizer each matches on the rows a batch touches:

* `SparseSGD`: ``torch.optim.SGD`` (``w -= lr * g``).
* `SparseAdaGrad`: ``torch.optim.Adagrad`` (state: per-element sum of squares).
* `SparseRowWiseAdaGrad` (RecStore's spelling `SparseRowWiseAdagrad` too): FBGEMM's
  EXACT_ROWWISE_ADAGRAD (state: one accumulator per row, ``acc += mean(g*g)``,
  ``w -= lr * g / (sqrt(acc) + eps)``).
* `SparseAdam`: ``torch.optim.SparseAdam`` (state: exp_avg and exp_avg_sq; a step count per
  table, advanced on every step in which the table was looked up).
* `SparseAdamW`: lazy AdamW: `SparseAdam` after AdamW's decoupled decay
  (``w *= 1 - lr * weight_decay``), both on the touched rows only.

Each rule's facts (state parts, hyper-parameters and defaults, torch class, ...) are its spec in
`kernels.optim_rules.RULES`; the tables here derive from it. So do the classes: `RULE_CLASSES`
holds each spec's ``sparse_class``, the class of that name written here or, for a rule with
none, one `rule_class` makes from the spec (a `RuleOptimizer` taking ``lr`` and the spec's
hyper-parameters by keyword). `embcache.optim` and `embcache` export `RULE_CLASSES`: a new rule
is its spec and its two kernel branches (`embcache.ops.update`), with no list to edit here.

`DistEmbedding` modules are updated the RecStore way (SGD only): read the rows, ``w - lr*g``,
write them back through the KV client. Every optimizer takes its modules positionally or as
``params=`` (RecStore's keyword: ``SparseSGD(params=[module], lr=0.01)``).

Every optimizer is a ``torch.optim.Optimizer`` to LR schedulers: ``param_groups`` is one group,
``{"params": modules, "lr": ..., <the rule's hyper-parameters>}`` (``weight_decay``; ``eps``
but for SGD; ``lr_decay`` for AdaGrad; ``betas`` for Adam and AdamW), and a change to it takes
effect at the next step (a batch already looked up with the TBE step is updated by the
ordinary path then). An optimizer may be built after a backward: the pending gradients are
applied by its first step (with fresh state beside every row, as any new optimizer starts).

    opt = SparseSGD([ebc], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    ...; opt.step(); sched.step()
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import torch

from embcache.kernels.optim import OptimRule, RowUpdate, state_dim
from embcache.kernels.optim_rules import RULES, RuleSpec
from embcache.optim.protocol import ChecksInStep, SparseParameters
from embcache.profiling import profiled


def _as_modules(modules: Any) -> list[Any]:
    """A module, or an iterable of modules, as a list."""
    if isinstance(modules, torch.nn.Module):
        return [modules]
    if isinstance(modules, (str, bytes)) or not isinstance(modules, Iterable):
        raise TypeError(f"expected a module or a list of modules, got {type(modules).__name__}")
    return list(modules)


def _hyper_parameters(update: RowUpdate) -> dict[str, Any]:
    """The param-group entries of ``update``'s rule, as torch's optimizers name them."""
    return RULES[update.rule].param_group(update)


def _sum(t: torch.Tensor) -> torch.Tensor:
    """``t``'s sum as a 0-d tensor, in float32 at least (a half-precision sum overflows)."""
    return t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)


def _finite_sums(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One 0-d sum per device whose finiteness says whether every sum of ``tensors`` is: the
    one tensor's sum, or the sum of several tensors' sums (NaN and Inf propagate through it).
    Nothing is read: a float read on the host costs less than ``isfinite`` and ``all`` on the
    device, a few tensor ops of their own (~40 us a step on a CPU). A total of finite sums
    that overflows reads as not finite: the exact check then decides."""
    if len(tensors) == 1:  # one backward's gradient, the usual step
        return [_sum(tensors[0])]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(_sum(t))
    return [sums[0] if len(sums) == 1 else torch.stack(sums).sum() for sums in by_device.values()]


class GradientCheck:
    """A step's finite-gradient check, made on the device and not yet read: `sums` (0-d, one
    per device) are all finite when every gradient is. A module reads them with its own host
    read of the step (`ChecksInStep`) and hands the values to `judge`; `verify` reads them
    itself (one read per device).

    Args:
        sums: the device sums (`_finite_sums`).
        entries: the ``(table, ids, grads)`` they sum, for the exact check.
        who: the optimizer's name, for the error.
    """

    def __init__(
        self,
        sums: list[torch.Tensor],
        entries: Sequence[tuple[str, Any, torch.Tensor]],
        who: str,
    ) -> None:
        self.sums = sums
        self.entries = entries
        self.who = who

    def judge(self, values: Sequence[float]) -> None:
        """Refuse the gradients when a sum read as ``values`` is not finite and the exact
        per-table check (error path only) finds a NaN or Inf.

        Raises:
            ValueError: a non-finite gradient, naming its table; nothing was updated.
        """
        if all(math.isfinite(v) for v in values):
            return
        for table, _, grads in self.entries:
            if grads.numel() and not bool(torch.isfinite(grads).all()):
                raise ValueError(
                    f"{self.who}.step: gradient of table {table!r} holds NaN or Inf; "
                    "nothing was updated (pass allow_nonfinite=True to apply it anyway, or "
                    "zero_grad() to drop it)"
                )

    def verify(self) -> None:
        """`judge` the sums, read here (one host read per device)."""
        self.judge([s.item() for s in self.sums])


class SparseOptimizer(torch.optim.Optimizer):
    """Base of the sparse optimizers: the rule, its hyper-parameters and step counts.

    The optimizer knows the math, not the caches: each module it drives (a `SparseParameters`:
    cached collections, sharded ones, `DistEmbedding`) applies the rule to its own rows when
    ``step()`` asks it to.

    A ``torch.optim.Optimizer`` for LR schedulers only: ``param_groups`` (one group; its
    ``"params"`` are the modules) is where ``update`` reads its hyper-parameters, so a change
    there applies from the next step. Torch's step hooks are not run.

    Args:
        modules: a module or a list of them (`SparseParameters`).
        update: the rule and its hyper-parameters.
        state_init: initial value of every state column.
        allow_nonfinite: accept NaN/Inf gradients (by default they are refused, nothing
            changes, and the trace is kept for inspection).
    """

    # What `update` rebuilds from ``param_groups[0]`` (set by its setter).
    _update: RowUpdate
    _update_keys: tuple[str, ...]
    _update_values: tuple[Any, ...]

    def __init__(
        self,
        modules: Any,
        update: RowUpdate,
        state_init: float = 0.0,
        allow_nonfinite: bool = False,
    ) -> None:
        self.modules = _as_modules(modules)
        if not self.modules:
            raise ValueError(f"{type(self).__name__} needs at least one module")
        for m in self.modules:
            if not isinstance(m, SparseParameters):
                raise TypeError(
                    f"{type(self).__name__} takes cached collections or DistEmbedding "
                    f"modules, got {type(m).__name__}"
                )
        # torch.optim.Optimizer's attributes, set here: its __init__ takes tensors only.
        self.defaults = _hyper_parameters(update)
        self.param_groups = [{"params": self.modules, **self.defaults}]
        self.state = defaultdict(dict)  # torch's per-tensor state: ours lives beside the rows
        self.update = update
        self.state_init = float(state_init)
        self.allow_nonfinite = allow_nonfinite
        self._steps: dict[tuple[int, str], int] = {}
        for m in self.modules:
            m.attach_sparse_optimizer(self)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def update(self) -> RowUpdate:
        """The rule and its hyper-parameters, as ``param_groups[0]`` has them now."""
        if len(self.param_groups) != 1:
            raise ValueError(
                f"{type(self).__name__} has one parameter group, got {len(self.param_groups)}"
            )
        group = self.param_groups[0]
        # Asked several times a step: the group's values compared in one C-level pass, the
        # update made again only when a scheduler (or anyone) changed one of them.
        values = tuple(map(group.get, self._update_keys))
        if values != self._update_values:
            hyper = {k: group[k] for k in self._update_keys}
            betas = hyper.pop("betas", None)
            if betas is not None:
                hyper["beta1"], hyper["beta2"] = betas
            self._update = dataclasses.replace(self._update, **hyper)
            self._update_values = values
        return self._update

    @update.setter
    def update(self, value: RowUpdate) -> None:
        hyper = _hyper_parameters(value)
        if self.param_groups:
            self.param_groups[0].update(hyper)
        self._update, self._update_keys = value, tuple(hyper)
        self._update_values = tuple(hyper.values())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} has one parameter group (all its modules share the rule)"
        )

    @property
    def lr(self) -> float:
        return self.update.lr

    @property
    def rule(self) -> OptimRule:
        return self.update.rule

    def state_dim(self, dim: int) -> int:
        """State columns beside a row of ``dim`` weights."""
        return state_dim(self.update.rule, dim)

    def advance_steps(self, module: Any, tables: Iterable[str]) -> dict[str, int]:
        """Advance and return the step count of each of ``module``'s ``tables`` (once each):
        the bias corrections of Adam and the lr decay of AdaGrad count steps per table."""
        steps: dict[str, int] = {}
        counts, owner = self._steps, id(module)
        for name in tables:
            if name not in steps:
                key = (owner, name)
                counts[key] = steps[name] = counts.get(key, 0) + 1
        return steps

    # ------------------------------------------------------------------------------------------

    # No closure: a sparse step re-evaluates no loss (the modules' traces hold its gradients).
    def step(self) -> None:  # type: ignore[override]
        """Apply every recorded gradient once, then clear the traces and release the slots.
        Every module's gradients are checked before any is applied.

        Retriable: a tier error (reading rows of an accumulated trace) is raised before the
        module it concerns changes, with its trace kept; modules before it are done and their
        traces cleared. Calling ``step()`` again once the tier is back applies each gradient
        exactly once.

        Raises:
            ValueError: a NaN/Inf gradient, or a bad hyper-parameter in ``param_groups``;
                nothing was updated.
        """
        self.update  # noqa: B018 (the param group's values, checked before any update)
        checks = [self.gradient_check(m.sparse_gradients()) for m in self.modules]
        if len(self.modules) == 1 and isinstance(self.modules[0], ChecksInStep):
            # The usual step: the module reads the check with its own host read (its locks'
            # check), after locating its rows and before it changes any.
            self.modules[0].apply_checked_gradients(self, checks[0])
            return
        for check in checks:  # every module's gradients, before any is applied
            if check is not None:
                check.verify()
        for m in self.modules:
            m.apply_sparse_gradients(self)

    def flush(self) -> None:
        """Write every update applied so far to the tier (RecStore's ``optimizer.flush()``,
        which its training loop calls at the end of an epoch): each module's dirty cached
        rows, or for a `DistEmbedding` its KV client's queued calls. Gradients that await a
        ``step()`` are not applied (call ``step()`` first); forwards never backpropagated
        give their slots back."""
        for m in self.modules:
            m.flush()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop recorded gradients (and release the slots of batches in flight)."""
        del set_to_none  # accepted for torch.optim compatibility; traces are always dropped
        for m in self.modules:
            m.zero_grad()

    @profiled("optim.check_gradients")
    def check_gradients(self, entries: Sequence[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Refuse NaN/Inf gradients (unless ``allow_nonfinite``), naming the table.

        Raises:
            ValueError: a non-finite gradient; nothing was updated.
        """
        check = self.gradient_check(entries)
        if check is not None:
            check.verify()

    def gradient_check(
        self, entries: Sequence[tuple[str, Any, torch.Tensor]]
    ) -> GradientCheck | None:
        """`check_gradients` made on the device and not yet read (None: nothing to check, or
        ``allow_nonfinite``): a finite sum proves every element finite (NaN and Inf
        propagate); a non-finite one (NaN/Inf, or a rare overflow) falls through to the exact
        per-table check (`GradientCheck.judge`)."""
        if self.allow_nonfinite:
            return None
        # Trace entries of one backward are slices of one tensor: check each tensor once.
        bases = {}
        for _, _, grads in entries:
            base = grads if grads._base is None else grads._base
            bases[id(base)] = base
        if not bases:
            return None
        return GradientCheck(_finite_sums(list(bases.values())), entries, type(self).__name__)

    # ------------------------------------------------------------------------------------------
    # state

    def hyper_state_dict(self) -> dict[str, Any]:
        """The rule, its hyper-parameters, the param group (what an LR scheduler changed, as
        JSON values) and the step counts (per module, per table): what a checkpoint needs
        beside the table rows, which hold the optimizer state."""
        group = {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in self.param_groups[0].items()
            if k != "params"
        }
        return {
            "param_groups": [group],
            "rule": self.update.rule.name,
            "hyperparameters": {
                k: getattr(self.update, k)
                for k in ("lr", "eps", "beta1", "beta2", "weight_decay", "lr_decay")
            },
            "steps": [
                {t: n for (mid, t), n in self._steps.items() if mid == id(m)} for m in self.modules
            ],
        }

    def load_hyper_state_dict(self, state: dict[str, Any]) -> None:
        """Restore step counts from `hyper_state_dict` (same rule, same module order)."""
        self.check_hyper_state_dict(state)
        for group in state.get("param_groups", ())[:1]:
            self.param_groups[0].update(
                {k: tuple(v) if k == "betas" else v for k, v in group.items() if k != "params"}
            )
        self._steps = {
            (id(m), t): int(n)
            for m, steps in zip(self.modules, state["steps"], strict=True)
            for t, n in steps.items()
        }

    def check_hyper_state_dict(self, state: dict[str, Any]) -> None:
        """Raise `ValueError` unless ``state`` is for this optimizer's rule and modules (what
        `load_hyper_state_dict` would accept); changes nothing."""
        if state.get("rule") != self.update.rule.name:
            raise ValueError(
                f"optimizer state is for rule {state.get('rule')!r}, this optimizer is "
                f"{self.update.rule.name}"
            )
        if len(state["steps"]) != len(self.modules):
            raise ValueError(
                f"optimizer state covers {len(state['steps'])} modules, this optimizer "
                f"{len(self.modules)}"
            )
        if "state" in state and len(state["state"]) != len(self.modules):
            raise ValueError(
                f"optimizer state covers {len(state['state'])} modules, this optimizer "
                f"{len(self.modules)}"
            )
        for group in state.get("param_groups", ())[:1]:
            # The rules the live optimizer enforces (`RowUpdate`), before anything is applied:
            # an lr of -1 loaded would fail every later step, save and load.
            hyper = {k: group[k] for k in self._update_keys if k in group}
            betas = hyper.pop("betas", None)
            try:
                if betas is not None:
                    hyper["beta1"], hyper["beta2"] = betas
                dataclasses.replace(self.update, **hyper)
            except (TypeError, ValueError) as err:
                raise ValueError(f"optimizer state: {err}") from None

    def state_dict(self) -> dict[str, Any]:
        """Hyper-parameters, step counts and the state of every row of every table.

        ``"state"`` holds one dict per module (in the optimizer's module order), mapping each
        table to its state tensors (``{"t0": {"sum": [N, D]}}``), read from the tier after a
        flush; they are as large as the tables.
        """
        state: list[dict[str, dict[str, torch.Tensor]]] = []
        for m in self.modules:
            tables = m.sparse_tables()
            state.append(
                {t.name: self._split_state(m.table_rows(t.name)[:, t.dim :], t.dim) for t in tables}
            )
        return {**self.hyper_state_dict(), "state": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned: same rule, same modules in the same order.
        Everything is checked before anything is written."""
        self.check_hyper_state_dict(state_dict)
        names = RULES[self.update.rule].state_names
        per_module = state_dict["state"]
        writes = []
        for i, (m, parts_by_table) in enumerate(zip(self.modules, per_module, strict=True)):
            tables = {t.name: t for t in m.sparse_tables()}
            if set(parts_by_table) != set(tables):
                raise ValueError(
                    f"optimizer state of module {i} covers tables {sorted(parts_by_table)}, "
                    f"the module has {sorted(tables)}"
                )
            for table, parts in parts_by_table.items():
                t = tables[table]
                if sorted(parts) != sorted(names):
                    raise ValueError(
                        f"module {i}, table {table!r}: expected state {names}, got {sorted(parts)}"
                    )
                width = state_dim(self.update.rule, t.dim) // max(len(names), 1)
                for name in names:
                    if tuple(parts[name].shape) != (t.num_embeddings, width):
                        raise ValueError(
                            f"module {i}, table {table!r}: state {name!r} has shape "
                            f"{tuple(parts[name].shape)}, expected {(t.num_embeddings, width)}"
                        )
                if names:
                    writes.append((m, t, torch.cat([parts[name] for name in names], dim=1)))
        for m, t, joined in writes:
            m.write_table_rows(t.name, joined, slice(t.dim, None))
        self.load_hyper_state_dict(state_dict)

    def _split_state(self, state: torch.Tensor, dim: int) -> dict[str, torch.Tensor]:
        names = RULES[self.update.rule].state_names
        if not names:
            return {}
        width = state.shape[1] // len(names)
        return {n: state[:, i * width : (i + 1) * width].clone() for i, n in enumerate(names)}


def _modules(modules: Any, params: Any, who: str) -> list[Any]:
    """The modules an optimizer drives, given positionally or as ``params=`` (RecStore's
    keyword)."""
    if params is not None:
        if modules is not None:
            raise TypeError(f"{who}: give the modules once, as modules or as params")
        modules = params
    if modules is None:
        raise TypeError(f"{who}: missing the modules to optimize (modules or params=...)")
    return _as_modules(modules)


def _lr(lr: float | None, modules: Iterable[Any], who: str) -> float:
    if lr is None:
        found: set[Any] = {getattr(m, "lr", None) for m in modules} - {None}
        if len(found) != 1:
            raise ValueError(f"{who}: give lr (the modules carry {sorted(found) or 'none'})")
        lr = found.pop()
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"{who}: lr must be a finite float >= 0, got {lr!r}")
    return float(lr)


class SparseSGD(SparseOptimizer):
    """``w -= lr * (g + weight_decay * w)`` on the rows a batch touched.

    Args:
        modules: cached collections and/or `DistEmbedding` modules (or ``params=``, RecStore's
            keyword).
        lr: learning rate; None takes the modules' ``lr`` (RecStore style).
        weight_decay: row-wise L2 on the touched rows (FBGEMM style; torch's SGD refuses
            weight decay with sparse gradients).
    """

    def __init__(
        self,
        modules=None,
        lr: float | None = None,
        weight_decay: float = 0.0,
        *,
        params=None,
        **kw,
    ) -> None:
        modules = _modules(modules, params, "SparseSGD")
        update = RowUpdate(
            OptimRule.SGD, lr=_lr(lr, modules, "SparseSGD"), weight_decay=weight_decay
        )
        super().__init__(modules, update, **kw)


class SparseAdaGrad(SparseOptimizer):
    """``torch.optim.Adagrad`` on the touched rows: ``acc += g*g``;
    ``w -= clr * g / (sqrt(acc) + eps)`` with ``clr = lr / (1 + (step - 1) * lr_decay)``."""

    def __init__(
        self,
        modules=None,
        lr: float | None = None,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        *,
        params=None,
        **kw,
    ) -> None:
        modules = _modules(modules, params, "SparseAdaGrad")
        update = RowUpdate(
            OptimRule.ADAGRAD,
            lr=_lr(lr, modules, "SparseAdaGrad"),
            eps=eps,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
        )
        super().__init__(modules, update, state_init=initial_accumulator_value, **kw)


class SparseRowWiseAdaGrad(SparseOptimizer):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD: one accumulator per row, ``acc += mean(g*g)``,
    ``w -= lr * g / (sqrt(acc) + eps)``, with FBGEMM's default ``eps=1e-8`` (torchrec's
    non-fused ``RowWiseAdagrad`` defaults to 1e-10: pass ``eps=1e-10`` to match that one)."""

    def __init__(
        self,
        modules=None,
        lr: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        params=None,
        **kw,
    ) -> None:
        modules = _modules(modules, params, "SparseRowWiseAdaGrad")
        update = RowUpdate(
            OptimRule.ROWWISE_ADAGRAD,
            lr=_lr(lr, modules, "SparseRowWiseAdaGrad"),
            eps=eps,
            weight_decay=weight_decay,
        )
        super().__init__(modules, update, **kw)


def _adam_update(
    rule: OptimRule,
    modules: list,
    lr: float | None,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float = 0.0,
) -> RowUpdate:
    """The row update of the Adam family (`SparseAdam`, `SparseAdamW`)."""
    name = "SparseAdamW" if rule == OptimRule.ADAMW else "SparseAdam"
    return RowUpdate(
        rule,
        lr=_lr(lr, modules, name),
        eps=eps,
        beta1=betas[0],
        beta2=betas[1],
        weight_decay=weight_decay,
    )


class SparseAdam(SparseOptimizer):
    """``torch.optim.SparseAdam`` on the touched rows (bias corrections from a per-table step
    count advanced on each step in which the table was looked up)."""

    def __init__(
        self,
        modules=None,
        lr: float | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        *,
        params=None,
        **kw,
    ) -> None:
        modules = _modules(modules, params, "SparseAdam")
        super().__init__(modules, _adam_update(OptimRule.ADAM, modules, lr, betas, eps), **kw)


class SparseAdamW(SparseOptimizer):
    """Lazy AdamW on the touched rows: ``w *= 1 - lr * weight_decay`` (AdamW's decoupled
    decay), then `SparseAdam`'s update (bias corrections from the same per-table step count).
    Rows a step does not touch neither decay nor move."""

    def __init__(
        self,
        modules=None,
        lr: float | None = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        params=None,
        **kw,
    ) -> None:
        modules = _modules(modules, params, "SparseAdamW")
        update = _adam_update(OptimRule.ADAMW, modules, lr, betas, eps, weight_decay)
        super().__init__(modules, update, **kw)


SparseRowWiseAdagrad = SparseRowWiseAdaGrad
"""RecStore's spelling of `SparseRowWiseAdaGrad`."""


class RuleOptimizer(SparseOptimizer):
    """The optimizer of a rule written nowhere but in its spec (`rule_class` makes one class
    per such rule): ``lr`` (None: the modules' ``lr``), then the spec's hyper-parameters by
    keyword with the spec's defaults (``RuleSpec.hyper``; ``betas`` a pair), and its
    ``state_init`` parameter (say ``initial_accumulator_value``) where it has one.

    Raises:
        TypeError: a keyword that is none of these.
    """

    spec: ClassVar[RuleSpec]

    def __init__(
        self,
        modules: Any = None,
        lr: float | None = None,
        *,
        params: Any = None,
        allow_nonfinite: bool = False,
        **hyper: Any,
    ) -> None:
        spec, who = self.spec, type(self).__name__
        modules = _modules(modules, params, who)
        known = [*spec.hyper, *([spec.state_init] if spec.state_init else [])]
        unknown = sorted(set(hyper) - set(known))
        if unknown:
            raise TypeError(f"{who} takes lr and {known}, got {unknown}")
        state_init = float(hyper.pop(spec.state_init, 0.0)) if spec.state_init else 0.0
        group = {**spec.hyper, **hyper, "lr": _lr(lr, modules, who)}
        update = RowUpdate(spec.rule, **spec.update_fields(group))
        super().__init__(modules, update, state_init=state_init, allow_nonfinite=allow_nonfinite)


def rule_class(spec: RuleSpec) -> type[SparseOptimizer]:
    """A `RuleOptimizer` subclass named ``spec.sparse_class`` for ``spec``'s rule, whose
    ``__init__`` shows the spec's hyper-parameters and defaults to `inspect.signature`."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    shown = [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("modules", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
        inspect.Parameter("lr", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
        *(inspect.Parameter(k, keyword, default=v) for k, v in spec.hyper.items()),
        *([inspect.Parameter(spec.state_init, keyword, default=0.0)] if spec.state_init else []),
        inspect.Parameter("params", keyword, default=None),
        inspect.Parameter("allow_nonfinite", keyword, default=False),
    ]

    def init(self: RuleOptimizer, modules: Any = None, lr: float | None = None, **kw: Any) -> None:
        RuleOptimizer.__init__(self, modules, lr, **kw)

    init.__signature__ = inspect.Signature(shown)  # type: ignore[attr-defined]
    init.__name__, init.__qualname__ = "__init__", f"{spec.sparse_class}.__init__"
    doc = (
        f"`{spec.torch_class}` on the rows a batch touches: rule {spec.rule.name}, made from "
        f"its spec (state {spec.state_names or 'none'}; see `RuleOptimizer`)."
    )
    namespace = {"spec": spec, "__init__": init, "__doc__": doc, "__module__": __name__}
    return type(spec.sparse_class, (RuleOptimizer,), namespace)


def _rule_classes() -> dict[str, type[SparseOptimizer]]:
    """Each rule's class by its spec's ``sparse_class``, in rule order: the one written in this
    module, else one made by `rule_class` (and bound here, so that it pickles by name)."""
    classes: dict[str, type[SparseOptimizer]] = {}
    for spec in RULES.values():
        cls = globals().get(spec.sparse_class)
        if cls is None:
            cls = globals()[spec.sparse_class] = rule_class(spec)
        assert isinstance(cls, type) and issubclass(cls, SparseOptimizer), spec.sparse_class
        classes[spec.sparse_class] = cls
    return classes


RULE_CLASSES = _rule_classes()
"""Every rule's `SparseOptimizer` class by name (``RuleSpec.sparse_class``), in rule order:
what `embcache.optim` and `embcache` export."""
