"""The update family: the optimizer's row update, one fused pass reading a row's weights and
state and writing both, with the per-id gradient sum it takes and the rounding of
half-precision weights it stores through.

A cache row's weights ``[dim]`` and its optimizer state ``[S]`` (``S = state_dim(rule, dim)``)
live in two tensors, ``weights [R, dim]`` (float32, float16 or bfloat16) and float32
``state [R, >= S]``. Half-precision weights are widened to float32, updated in float32, and
stored back rounded stochastically (unbiased, FBGEMM's default for fp16 weights; the draws are a
function of the seed, the step, the row's id and the column, so every implementation gives the
same bits) or, without ids to draw for, to nearest. The state stays float32.

=================  =========  ===========================================================
rule               S          state columns
=================  =========  ===========================================================
SGD                0          none
ADAGRAD            dim        sum of squared gradients, per element
ROWWISE_ADAGRAD    1          sum of mean squared gradients, per row
ADAM, ADAMW        2 * dim    ``exp_avg`` then ``exp_avg_sq``
=================  =========  ===========================================================

(The rules' facts, state layouts included, live in `rules.RULES`; this table shows them.)

`UpdateOps.apply_row_update` updates the rows named by ``slots`` in place with one aggregated
gradient row each, and touches nothing else. On the rows it touches the numbers match, to
float32 rounding:

* SGD: ``torch.optim.SGD(lr)`` on a sparse gradient, ``w -= lr * g``.
* ADAGRAD: ``torch.optim.Adagrad(lr, lr_decay, eps, initial_accumulator_value)``'s sparse branch:
  ``acc += g * g``; ``w -= clr * (g / (sqrt(acc) + eps))``, ``clr = lr / (1 + (step - 1) *
  lr_decay)``. The caller fills the state with ``initial_accumulator_value`` on first touch.
* ROWWISE_ADAGRAD: FBGEMM's EXACT_ROWWISE_ADAGRAD: ``acc += mean(g * g)``;
  ``mult = lr / (sqrt(acc) + eps)``; ``w -= mult * g``.
* ADAM: ``torch.optim.SparseAdam(lr, betas, eps)``: ``m += (g - m) * (1 - beta1)``;
  ``v += (g * g - v) * (1 - beta2)``;
  ``w -= lr * sqrt(1 - beta2**step) / (1 - beta1**step) * (m / (sqrt(v) + eps))``.
* ADAMW: lazy AdamW: ADAM after ``w *= 1 - lr * weight_decay`` (AdamW's decoupled decay, on
  the touched rows only).

``weight_decay`` (but ADAMW's) is L2 on the touched rows only (FBGEMM's
``weight_decay_mode=L2``): the gradient becomes ``g + weight_decay * w`` before the rule. torch
refuses ``weight_decay`` with sparse gradients (Adagrad raises, SparseAdam has no such option,
SGD's sparse path raises), so this is an extension there; rows absent from a batch do not decay.
``lr_decay`` applies to ADAGRAD only.

`UpdateOps.aggregate_grads` sums the gradient rows of equal ids deterministically (a stable
sort, then a fixed-order segment sum per id, no float atomics), as the optimizer needs before
the update.

`UpdateOps` is the family's protocol; its implementations are `spec.SpecUpdate` (torch, the
specification) and `triton.TritonUpdate` (the Triton kernels), one of them bound per cache by
`embcache.ops.registry`. Nothing outside `embcache.ops` imports an implementation. This module
and `rules` import no torch (the CLI reads the rules without it).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from embcache.ops.update.rules import RULES, OptimRule

if TYPE_CHECKING:
    import torch

__all__ = ["RULES", "OptimRule", "RowUpdate", "UpdateOps", "rounding_key", "state_dim"]

M32 = 0xFFFFFFFF
HASH_MUL = 0x45D9F3B  # a 32-bit integer hash's multiplier (< 2**27: products fit in int64)
COLUMN_MUL = 0x9E3779B1  # golden-ratio multiplier spreading column numbers over 32 bits


def rounding_key(seed: int, step: int) -> int:
    """The 32-bit key of one optimizer step's stochastic-rounding draws."""
    x = (seed * COLUMN_MUL + step) & M32
    x = (((x >> 16) ^ x) * HASH_MUL) & M32
    x = (((x >> 16) ^ x) * HASH_MUL) & M32
    return (x >> 16) ^ x


def state_dim(rule: OptimRule, dim: int) -> int:
    """Number of float32 state columns a row needs after its ``dim`` weights.

    Args:
        rule: the update rule.
        dim: embedding dim.

    Returns:
        The widths of the rule's state parts (`rules.RuleSpec.state`): SGD 0; ADAGRAD ``dim``;
        ROWWISE_ADAGRAD 1; ADAM and ADAMW ``2 * dim``.
    """
    return RULES[OptimRule(rule)].state_dim(dim)


@dataclass(frozen=True)
class RowUpdate:
    """Hyper-parameters of one rule; the step count is passed to `apply_row_update` per call.

    Attributes:
        rule: the update rule.
        lr: learning rate, >= 0.
        eps: added to the square root in the denominator (ADAGRAD, ROWWISE_ADAGRAD, ADAM).
            The default is Adagrad's; ``torch.optim.SparseAdam`` defaults to 1e-8, so pass it.
        beta1: ADAM's first-moment decay, in [0, 1).
        beta2: ADAM's second-moment decay, in [0, 1).
        weight_decay: L2 coefficient added to the gradient on the touched rows (ADAMW:
            AdamW's decoupled decay, ``w *= 1 - lr * weight_decay`` before the update).
        lr_decay: ADAGRAD only, as ``torch.optim.Adagrad``: ``lr / (1 + (step - 1) * lr_decay)``.
    """

    rule: OptimRule
    lr: float
    eps: float = 1e-10
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    lr_decay: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rule, bool) or not isinstance(self.rule, int):
            raise TypeError(f"RowUpdate.rule must be an OptimRule, got {self.rule!r}")
        try:
            object.__setattr__(self, "rule", OptimRule(self.rule))
        except ValueError:
            raise ValueError(
                f"RowUpdate.rule={self.rule!r} is not one of {[r.name for r in OptimRule]}"
            ) from None
        for name in ("lr", "eps", "beta1", "beta2", "weight_decay", "lr_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"RowUpdate.{name} must be a float, got {value!r}")
            value = float(value)
            if not math.isfinite(value) or value < 0.0:
                raise ValueError(f"RowUpdate.{name} must be finite and >= 0, got {value}")
            object.__setattr__(self, name, value)
        for name in ("beta1", "beta2"):
            if not getattr(self, name) < 1.0:
                raise ValueError(f"RowUpdate.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.lr_decay != 0.0 and "lr_decay" not in RULES[self.rule].hyper:
            raise ValueError(f"RowUpdate.lr_decay applies to ADAGRAD only, not {self.rule.name}")

    def state_dim(self, dim: int) -> int:
        """`state_dim` of this update's rule."""
        return state_dim(self.rule, dim)


class UpdateOps(Protocol):
    """One implementation of the update family.

    Attributes:
        name: ``"spec"`` or ``"triton"``.
    """

    name: str

    def apply_row_update(
        self,
        weights: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        grads: torch.Tensor,
        update: RowUpdate,
        step: int,
        check_slots: bool = True,
        ids: torch.Tensor | None = None,
        seed: int = 0,
        may_skip: bool = True,
    ) -> None:
        """Apply one optimizer step to the rows ``slots`` of ``weights`` and ``state``, in place.

        Weights and state are read and written by one fused pass. Rows not in ``slots`` are
        left bit-identical.

        Args:
            weights: ``[R, dim]`` float32, float16 or bfloat16 (may be a strided view); half
                precision is updated in float32 and rounded back (see ``ids``).
            state: float32 ``[R, C]``, ``C >= state_dim(update.rule, dim)``: the rule's state in
                columns ``[0, S)``; further columns are untouched (``C = 0`` for SGD).
            slots: int64 ``[n]``, distinct row indices in ``[0, R)``, or -1 for a row to skip
                (an id the cache has not admitted: its gradient is dropped).
            grads: float32 ``[n, dim]``, one aggregated gradient row per slot (see
                `aggregate_grads`).
            update: the rule and its hyper-parameters.
            step: the optimizer's step count after incrementing (1 on the first step); used by
                ADAM's and ADAMW's bias corrections and ADAGRAD's ``lr_decay``.
            check_slots: verify that slots are in range and distinct (a sort and a host sync).
                Callers whose slots come from a cache resolve, distinct by construction, skip it.
            ids: int64 ``[n]``, the rows' ids (fused ids): half-precision weights are then
                rounded stochastically with draws of ``(seed, step, id, column)``; None rounds
                to nearest.
            seed: the seed of those draws.
            may_skip: ``slots`` may hold -1 (rows to skip). False when the caller knows they
                hold none (a cache that admits every id): the torch twin then reads nothing on
                the host.

        Raises:
            TypeError: a wrong type or dtype.
            ValueError: a wrong shape, too few state columns for the rule, slots out of range or
                repeated, mismatched devices, ``step < 1``. Nothing is changed when raised.
        """
        ...

    def aggregate_grads(
        self, ids: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum the gradient rows of equal ids, deterministically.

        No float atomics in either implementation, so each gives the same bits on every run:
        the torch twin adds each id's rows one by one in their order in ``ids``
        (``index_add_``); the Triton kernel sums each id's rows in that order in chunks of a
        few tiles, one program a chunk (a hot id of thousands of rows is summed by many
        programs side by side), then the chunk sums in order. The two agree to float32
        rounding of the summation order.

        Args:
            ids: int64 ``[n]``, any values, duplicates allowed.
            grads: float32 ``[n, dim]``.

        Returns:
            ``(unique_ids, summed)``: int64 ``[u]`` in ascending order and float32 ``[u, dim]``,
            ``summed[j]`` the sum of ``grads[i]`` over ``ids[i] == unique_ids[j]``.

        Raises:
            TypeError: a wrong type or dtype.
            ValueError: a wrong shape or mismatched devices.
        """
        ...

    def stochastic_round(
        self, x: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor, key: int
    ) -> torch.Tensor:
        """Round float32 ``x`` ``[n, dim]`` into ``dtype`` (float16 or bfloat16) stochastically,
        as `apply_row_update` stores half-precision weights.

        Row i's draws are a function of ``(key, ids[i], column)`` alone, so the result is the
        same in every implementation and run; over many keys its mean is ``x`` (unbiased).

        Args:
            x: float32 ``[n, dim]``.
            dtype: ``torch.float16`` or ``torch.bfloat16``.
            ids: int64 ``[n]``, non-negative row ids.
            key: a 32-bit key (`rounding_key(seed, step)`).

        Returns:
            ``[n, dim]`` of ``dtype``: each value the neighbour of ``x`` toward zero or the one
            away from it, the latter with probability equal to ``x``'s fraction of the gap.
        """
        ...
