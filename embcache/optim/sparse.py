"""Sparse optimizers: they consume the gradient traces of cached collections and apply one fused
row update in the cache slots, with optimizer state stored beside each row (never in Python).

    opt = SparseAdaGrad([ebc], lr=0.05)
    ebc(kjt).values().sum().backward()   # trace: (table, ids, grads) per table
    opt.step()                           # aggregate per id, update rows + state, clear trace

Rules and the torch optimizer each matches on the rows a batch touches:

* `SparseSGD`: ``torch.optim.SGD`` (``w -= lr * g``).
* `SparseAdaGrad`: ``torch.optim.Adagrad`` (state: per-element sum of squares).
* `SparseRowWiseAdaGrad`: FBGEMM's EXACT_ROWWISE_ADAGRAD (state: one accumulator per row,
  ``acc += mean(g*g)``, ``w -= lr * g / (sqrt(acc) + eps)``).
* `SparseAdam`: ``torch.optim.SparseAdam`` (state: exp_avg and exp_avg_sq; a step count per
  table, advanced on every step in which the table was looked up).

`DistEmbedding` modules are updated the RecStore way (SGD only): read the rows, ``w - lr*g``,
write them back through the KV client.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from embcache.kernels.optim import (
    OptimRule,
    RowUpdate,
    aggregate_grads,
    apply_row_update,
    state_dim,
)

if TYPE_CHECKING:
    from embcache.models.collection import CachedEmbeddingBagCollection, TraceEntry


def _is_collection(m: Any) -> bool:
    """Cached collections and DistEmbedding modules are told apart by a marker attribute, so
    this package does not import the models built on it."""
    return getattr(m, "_sparse_kind", None) == "collection"


def _is_dist_embedding(m: Any) -> bool:
    return getattr(m, "_sparse_kind", None) == "dist_embedding"


_STATE_NAMES = {
    OptimRule.SGD: [],
    OptimRule.ADAGRAD: ["sum"],
    OptimRule.ROWWISE_ADAGRAD: ["sum"],
    OptimRule.ADAM: ["exp_avg", "exp_avg_sq"],
}


class SparseOptimizer:
    """Base of the sparse optimizers.

    Args:
        modules: cached collections (and, for `SparseSGD`, `DistEmbedding` modules).
        update: the rule and its hyper-parameters.
        state_init: initial value of every state column.
        allow_nonfinite: accept NaN/Inf gradients (by default they are refused, nothing
            changes, and the trace is kept for inspection).
    """

    def __init__(
        self,
        modules: Iterable[Any],
        update: RowUpdate,
        state_init: float = 0.0,
        allow_nonfinite: bool = False,
    ) -> None:
        self.modules = list(modules) if not isinstance(modules, torch.nn.Module) else [modules]
        if not self.modules:
            raise ValueError(f"{type(self).__name__} needs at least one module")
        for m in self.modules:
            if _is_dist_embedding(m):
                if update.rule is not OptimRule.SGD:
                    raise TypeError(
                        f"{type(self).__name__} cannot update DistEmbedding {m.name!r}: "
                        "DistEmbedding is updated the RecStore way, by SparseSGD only"
                    )
            elif not _is_collection(m):
                raise TypeError(
                    f"{type(self).__name__} takes CachedEmbeddingBagCollection or DistEmbedding "
                    f"modules, got {type(m).__name__}"
                )
        self.update = update
        self.state_init = float(state_init)
        self.allow_nonfinite = allow_nonfinite
        self._steps: dict[tuple[int, str], int] = {}
        for m in self.modules:
            if _is_collection(m):
                m._attach_optimizer(self, lambda dim: state_dim(update.rule, dim), self.state_init)

    @property
    def lr(self) -> float:
        return self.update.lr

    # ------------------------------------------------------------------------------------------

    def step(self) -> None:
        """Apply every recorded gradient once, then clear the traces and release the slots."""
        for m in self.modules:
            if _is_collection(m):
                self._check_finite(m._trace)
            else:
                self._check_finite([(m.name, ids, g) for ids, g in m._trace])
        for m in self.modules:
            if _is_collection(m):
                entries, m._trace = m._trace, []
                self._apply_entries(m, entries, check=False)
                m._release_all()
            else:
                self._step_dist_embedding(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop recorded gradients (and release the slots of batches in flight)."""
        del set_to_none  # accepted for torch.optim compatibility; traces are always dropped
        for m in self.modules:
            m.zero_grad()

    def _check_finite(self, entries) -> None:
        if self.allow_nonfinite:
            return
        # Trace entries of one backward are slices of one tensor: check each tensor once.
        bases = {}
        for _, _, grads in entries:
            base = grads if grads._base is None else grads._base
            bases[id(base)] = base
        # A finite sum proves every element finite (NaN and Inf propagate); a non-finite sum
        # (NaN/Inf, or a rare overflow) falls through to the exact per-table check.
        if all(bool(torch.isfinite(b.sum())) for b in bases.values()):
            return
        for table, _, grads in entries:
            if grads.numel() and not bool(torch.isfinite(grads).all()):
                raise ValueError(
                    f"{type(self).__name__}.step: gradient of table {table!r} holds NaN or Inf; "
                    "nothing was updated (pass allow_nonfinite=True to apply it anyway, or "
                    "zero_grad() to drop it)"
                )

    def _apply_entries(
        self, module: CachedEmbeddingBagCollection, entries: list[TraceEntry], check: bool = True
    ) -> None:
        """Aggregate trace entries per id and update their rows in the cache, per cache."""
        if check:
            self._check_finite(entries)
        steps: dict[str, int] = {}
        for e in entries:
            if e.table_name not in steps:
                key = (id(module), e.table_name)
                self._steps[key] = steps[e.table_name] = self._steps.get(key, 0) + 1
        for gi, group in enumerate(module._groups):
            mine = [e for e in entries if e.group == gi]
            if not mine:
                continue
            cache = group.cache
            batch = mine[0].batch
            resolved = batch.resolved[gi]
            fast = (
                resolved.locked
                and all(e.batch is batch for e in mine)
                and len({e.table_name for e in mine}) == len(mine)
            )
            if fast:
                slots = resolved.slots
                grads = torch.cat([e.grads for e in mine])
                unique = resolved.unique
            else:
                fused = torch.cat(
                    [e.ids | (module._table_index[e.table_name] << module.fusion_k) for e in mine]
                )
                unique, grads = aggregate_grads(fused, torch.cat([e.grads for e in mine]))
                slots = cache.resolve(unique, lock=True)
            try:
                self._update_rows(module, group, unique, slots, grads, steps)
            finally:
                if fast:
                    cache.unlock(slots)
                    resolved.locked = False
                else:
                    cache.unlock(slots)

    def _update_rows(self, module, group, unique, slots, grads, steps) -> None:
        cache = group.cache
        table_steps = {steps[t.name] for t in group.tables if t.name in steps}
        with cache.lock:
            if len(table_steps) == 1:
                # Slots from a resolve are distinct by construction: skip the sorted check.
                apply_row_update(
                    cache.rows,
                    group.dim,
                    slots,
                    grads,
                    self.update,
                    table_steps.pop(),
                    check_slots=False,
                )
            else:
                bounds = group.table_bounds(unique, module.fusion_k)
                for i, t in enumerate(group.tables):
                    lo, hi = bounds[i], bounds[i + 1]
                    if hi > lo:
                        apply_row_update(
                            cache.rows,
                            group.dim,
                            slots[lo:hi],
                            grads[lo:hi],
                            self.update,
                            steps[t.name],
                            check_slots=False,
                        )
            cache.mark_dirty(slots)

    def _step_dist_embedding(self, m) -> None:
        entries, m._trace = m._trace, []
        if not entries:
            return
        ids = torch.cat([ids for ids, _ in entries])
        grads = torch.cat([g for _, g in entries])
        unique, summed = aggregate_grads(ids, grads)
        rows = m.weight[unique]  # on the host, where the tier is
        m.weight[unique] = rows - self.update.lr * summed.to(rows.device, rows.dtype)

    # ------------------------------------------------------------------------------------------
    # state

    def hyper_state_dict(self) -> dict[str, Any]:
        """The rule, its hyper-parameters and the step counts (per module, per table): what
        a checkpoint needs beside the table rows, which hold the optimizer state."""
        return {
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
        self._check_hyper(state)
        self._steps = {
            (id(m), t): int(n)
            for m, steps in zip(self.modules, state["steps"], strict=True)
            for t, n in steps.items()
        }

    def _check_hyper(self, state: dict[str, Any]) -> None:
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

    def state_dict(self) -> dict[str, Any]:
        """Hyper-parameters, step counts and the state of every row of every table.

        ``"state"`` holds one dict per module (in the optimizer's module order), mapping each
        table to its state tensors (``{"t0": {"sum": [N, D]}}``), read from the tier after a
        flush; they are as large as the tables.
        """
        state: list[dict[str, dict[str, torch.Tensor]]] = []
        for m in self.modules:
            tables = m.tables if _is_collection(m) else []
            state.append(
                {t.name: self._split_state(m.table_rows(t.name)[:, t.dim :], t.dim) for t in tables}
            )
        return {**self.hyper_state_dict(), "state": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned: same rule, same modules in the same order.
        Everything is checked before anything is written."""
        self._check_hyper(state_dict)
        names = _STATE_NAMES[self.update.rule]
        per_module = state_dict["state"]
        writes = []
        for i, (m, parts_by_table) in enumerate(zip(self.modules, per_module, strict=True)):
            tables = {t.name: t for t in m.tables} if _is_collection(m) else {}
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
        names = _STATE_NAMES[self.update.rule]
        if not names:
            return {}
        width = state.shape[1] // len(names)
        return {n: state[:, i * width : (i + 1) * width].clone() for i, n in enumerate(names)}


def _lr(lr: float | None, modules: Iterable[Any], who: str) -> float:
    if lr is None:
        found = {getattr(m, "lr", None) for m in modules} - {None}
        if len(found) != 1:
            raise ValueError(f"{who}: give lr (the modules carry {sorted(found) or 'none'})")
        lr = found.pop()
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"{who}: lr must be a finite float >= 0, got {lr!r}")
    return float(lr)


class SparseSGD(SparseOptimizer):
    """``w -= lr * (g + weight_decay * w)`` on the rows a batch touched.

    Args:
        modules: cached collections and/or `DistEmbedding` modules.
        lr: learning rate; None takes the modules' ``lr`` (RecStore style).
        weight_decay: row-wise L2 on the touched rows (FBGEMM style; torch's SGD refuses
            weight decay with sparse gradients).
    """

    def __init__(self, modules, lr: float | None = None, weight_decay: float = 0.0, **kw) -> None:
        modules = list(modules)
        update = RowUpdate(
            OptimRule.SGD, lr=_lr(lr, modules, "SparseSGD"), weight_decay=weight_decay
        )
        super().__init__(modules, update, **kw)


class SparseAdaGrad(SparseOptimizer):
    """``torch.optim.Adagrad`` on the touched rows: ``acc += g*g``;
    ``w -= clr * g / (sqrt(acc) + eps)`` with ``clr = lr / (1 + (step - 1) * lr_decay)``."""

    def __init__(
        self,
        modules,
        lr: float | None = None,
        eps: float = 1e-10,
        initial_accumulator_value: float = 0.0,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        **kw,
    ) -> None:
        modules = list(modules)
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
    ``w -= lr * g / (sqrt(acc) + eps)``."""

    def __init__(
        self,
        modules,
        lr: float | None = None,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        **kw,
    ) -> None:
        modules = list(modules)
        update = RowUpdate(
            OptimRule.ROWWISE_ADAGRAD,
            lr=_lr(lr, modules, "SparseRowWiseAdaGrad"),
            eps=eps,
            weight_decay=weight_decay,
        )
        super().__init__(modules, update, **kw)


class SparseAdam(SparseOptimizer):
    """``torch.optim.SparseAdam`` on the touched rows (bias corrections from a per-table step
    count advanced on each step in which the table was looked up)."""

    def __init__(
        self,
        modules,
        lr: float | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        **kw,
    ) -> None:
        modules = list(modules)
        update = RowUpdate(
            OptimRule.ADAM,
            lr=_lr(lr, modules, "SparseAdam"),
            eps=eps,
            beta1=betas[0],
            beta2=betas[1],
        )
        super().__init__(modules, update, **kw)
