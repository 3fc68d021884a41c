"""The update family's specification in plain torch: in-place row updates (SGD, AdaGrad, row-wise
AdaGrad, Adam, lazy AdamW), the per-id gradient sum, and the rounding of float32 values into
half-precision weights, to nearest or stochastically.

Each twin (``*_ref``) computes what its Triton kernel (`ops.update.triton`) computes, with the
same float32 operations in the same order as the torch (or FBGEMM) optimizer it mirrors;
`SpecUpdate` is the family's implementation built on them (`UpdateOps`): the CPU path, the
``torch`` backend everywhere, and what the Triton kernels are tested against. Its operations
check their inputs, for every implementation.

Stochastic rounding keeps an update smaller than half a unit in the last place from vanishing:
``x`` between the two neighbours ``lo`` (toward zero) and ``hi`` (away from zero) of the narrow
type becomes ``hi`` with probability ``(|x| - |lo|) / (|hi| - |lo|)``, so its expected value is
``x`` exactly (FBGEMM rounds fp16 weights this way by default). ``lo`` is the round-to-nearest
result stepped one unit toward zero when that rounded away, ``hi`` the next value away from
zero (bit patterns of a sign-magnitude format: ``bits + 1``), so it is unbiased everywhere,
subnormals included; the fraction is exact in float32. The uniform draw is a counter-based hash
of ``(key, row id, column)``: the same bits in every implementation and run, whatever the order
rows are updated in, and independent of where the row sits (a slot of the cache): the key
(`rounding_key`) mixes the seed with the optimizer step.
"""

from __future__ import annotations

import math
import operator

import torch

from embcache.ops.checks import check_tensor, require
from embcache.ops.update import (
    COLUMN_MUL,
    HASH_MUL,
    M32,
    OptimRule,
    RowUpdate,
    UpdateOps,
    rounding_key,
)

# ----------------------------------------------------------------------------------------------
# the rounding twins
# ----------------------------------------------------------------------------------------------


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in ``[0, 2**32)`` (same shape, same range)."""
    x = (((x >> 16) ^ x) * HASH_MUL) & M32
    x = (((x >> 16) ^ x) * HASH_MUL) & M32
    return (x >> 16) ^ x


def uniform_ref(ids: torch.Tensor, dim: int, key: int) -> torch.Tensor:
    """float32 ``[n, dim]`` in ``[0, 1)`` (24 random bits), a function of ``(key, ids[i], j)``.

    Args:
        ids: int64 ``[n]``, non-negative row ids (fused ids).
        dim: columns.
        key: `rounding_key` of the step.
    """
    row = hash32(hash32((ids & M32) ^ key) ^ ((ids >> 32) & M32))  # [n]
    cols = (torch.arange(dim, dtype=torch.int64, device=ids.device) * COLUMN_MUL) & M32
    bits = hash32(row.unsqueeze(1) ^ cols.unsqueeze(0)) >> 8  # [n, dim], 24 bits
    return bits.to(torch.float32) * (1.0 / (1 << 24))


def stochastic_round_ref(x: torch.Tensor, dtype: torch.dtype, u: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) in ``dtype`` (float16 or bfloat16), rounded up in magnitude where
    ``u < (|x| - |lo|) / (|hi| - |lo|)``, else toward zero; ``u`` uniform in ``[0, 1)`` of
    ``x``'s shape."""
    nearest = x.to(dtype)
    bits = nearest.view(torch.int16)
    away = nearest.to(torch.float32).abs() > x.abs()  # rounded away from zero: step back
    lo_bits = torch.where(away, bits - 1, bits)
    lo = lo_bits.view(dtype)
    hi = (lo_bits + 1).view(dtype)
    lo32, hi32 = lo.to(torch.float32).abs(), hi.to(torch.float32).abs()
    p = (x.abs() - lo32) / (hi32 - lo32)
    return torch.where(u < p, hi, lo)


def store_weights_ref(
    w: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor | None, key: int
) -> torch.Tensor:
    """Updated float32 weights ``[n, dim]`` as ``dtype``: float32 unchanged; half precision
    stochastically rounded with the draws of ``(key, ids)``, or to nearest without ``ids``."""
    if dtype == torch.float32:
        return w
    if ids is None:
        return w.to(dtype)
    return stochastic_round_ref(w, dtype, uniform_ref(ids, w.shape[1], key))


# ----------------------------------------------------------------------------------------------
# the update twins
# ----------------------------------------------------------------------------------------------

# A cache row's weights and its optimizer state live in two tensors, ``weights [R, dim]``
# (float32, float16 or bfloat16) and float32 ``state [R, S]``. Each twin gathers the touched rows
# of both (weights widened to float32), updates them with the same float32 operations, in the
# same order, as the torch (or FBGEMM) optimizer it mirrors, and scatters them back (weights
# rounded into their dtype, see `store_weights_ref`): rows not in ``slots`` are
# never read or written. ``slots`` must be distinct (checked by `SpecUpdate`).

Rounding = tuple[torch.Tensor | None, int]
"""``(ids, key)`` of half-precision weights' stochastic rounding (``ids`` None: to nearest)."""
_NEAREST: Rounding = (None, 0)


def _gather(t: torch.Tensor, slots: torch.Tensor, width: int) -> torch.Tensor:
    """Copy of the first ``width`` columns of ``t[slots]``: ``[n, width]``."""
    return t.narrow(1, 0, width).index_select(0, slots)


def _scatter(t: torch.Tensor, slots: torch.Tensor, block: torch.Tensor) -> None:
    """Write ``block`` (``[n, width]``) back into the first ``width`` columns of ``t[slots]``."""
    t.narrow(1, 0, block.shape[1]).index_copy_(0, slots, block)


def _gather_weights(weights: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """float32 copy ``[n, dim]`` of the weights at ``slots``."""
    return weights.index_select(0, slots).to(torch.float32)


def _scatter_weights(
    weights: torch.Tensor, slots: torch.Tensor, w: torch.Tensor, rounding: Rounding
) -> None:
    """Store updated float32 weights ``w`` at ``slots``, rounded into ``weights``' dtype."""
    ids, key = rounding
    weights.index_copy_(0, slots, store_weights_ref(w, weights.dtype, ids, key))


def sgd_update_ref(
    weights: torch.Tensor,
    slots: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    weight_decay: float = 0.0,
    rounding: Rounding = _NEAREST,
) -> None:
    """SGD on the touched rows, in place: ``w += -lr * (g + weight_decay * w)``.

    Args:
        weights: ``[R, dim]`` (SGD keeps no state).
        slots: int64 ``[n]``, distinct rows to update.
        grads: float32 ``[n, dim]``, one gradient row per slot.
        lr: learning rate.
        weight_decay: L2 coefficient added to the gradient (0 disables it).
        rounding: how half-precision weights are stored back.
    """
    if weights.dtype == torch.float32 and weight_decay == 0.0:
        # The same arithmetic torch.optim.SGD applies for a sparse gradient: w + (-lr) * g;
        # gather + scatter of distinct slots is faster on the CPU than index_add_.
        dim = weights.shape[1]
        _scatter(weights, slots, _gather(weights, slots, dim).add_(grads, alpha=-lr))
        return
    block = _gather_weights(weights, slots)  # [n, dim]
    if weight_decay == 0.0:
        block.add_(grads, alpha=-lr)
    else:
        block.add_(grads.add(block, alpha=weight_decay), alpha=-lr)
    _scatter_weights(weights, slots, block, rounding)


def adagrad_update_ref(
    weights: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    grads: torch.Tensor,
    clr: float,
    eps: float,
    weight_decay: float = 0.0,
    rounding: Rounding = _NEAREST,
) -> None:
    """Adagrad on the touched rows, in place, as ``torch.optim.Adagrad``'s sparse branch.

    ``g' = g + weight_decay * w``; ``acc += g' * g'``; ``w += -clr * (g' / (sqrt(acc) + eps))``.

    Args:
        weights: ``[R, dim]``.
        state: float32 ``[R, >= dim]``: the sum of squares in columns ``[0, dim)``.
        slots: int64 ``[n]``, distinct rows to update.
        grads: float32 ``[n, dim]``, one gradient row per slot.
        clr: the step's learning rate, ``lr / (1 + (step - 1) * lr_decay)``.
        eps: added to ``sqrt(acc)``.
        weight_decay: L2 coefficient added to the gradient (0 disables it).
        rounding: how half-precision weights are stored back.
    """
    dim = weights.shape[1]
    w, acc = _gather_weights(weights, slots), _gather(state, slots, dim)  # [n, dim] each
    g = grads if weight_decay == 0.0 else grads.add(w, alpha=weight_decay)
    acc.add_(g * g)
    w.add_(g / acc.sqrt().add_(eps), alpha=-clr)
    _scatter_weights(weights, slots, w, rounding)
    _scatter(state, slots, acc)


def rowwise_adagrad_update_ref(
    weights: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    eps: float,
    weight_decay: float = 0.0,
    rounding: Rounding = _NEAREST,
) -> None:
    """Row-wise Adagrad on the touched rows, in place, as FBGEMM's EXACT_ROWWISE_ADAGRAD.

    With L2 weight decay (FBGEMM's ``weight_decay_mode=L2``), ``g' = g + weight_decay * w``:
    ``acc += mean(g' * g')``; ``mult = lr / (sqrt(acc) + eps)``;
    ``w = (1 - mult * weight_decay) * w - mult * g``, which is ``w - mult * g'``.

    Args:
        weights: ``[R, dim]``.
        state: float32 ``[R, >= 1]``: the sum of mean squares in column 0.
        slots: int64 ``[n]``, distinct rows to update.
        grads: float32 ``[n, dim]``, one gradient row per slot.
        lr: learning rate.
        eps: added to ``sqrt(acc)``.
        weight_decay: L2 coefficient (0 disables it).
        rounding: how half-precision weights are stored back.
    """
    dim = weights.shape[1]
    w, acc2 = _gather_weights(weights, slots), _gather(state, slots, 1)  # [n, dim], [n, 1]
    acc = acc2[:, 0]
    g = grads if weight_decay == 0.0 else grads.add(w, alpha=weight_decay)
    acc.add_((g * g).sum(dim=1) / dim)
    mult = lr / (acc.sqrt() + eps)  # [n]
    if weight_decay != 0.0:
        w.mul_(1.0 - mult.unsqueeze(1) * weight_decay)
    w.sub_(grads * mult.unsqueeze(1))
    _scatter_weights(weights, slots, w, rounding)
    _scatter(state, slots, acc2)


def adam_update_ref(
    weights: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    grads: torch.Tensor,
    step_size: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    rounding: Rounding = _NEAREST,
    decay: float = 1.0,
) -> None:
    """Adam on the touched rows, in place, as ``torch.optim.SparseAdam``; with ``decay`` (lazy
    AdamW's ``1 - lr * weight_decay``) ``w *= decay`` first.

    ``g' = g + weight_decay * w``; ``m += (g' - m) * (1 - beta1)``;
    ``v += (g' * g' - v) * (1 - beta2)``; ``w += -step_size * (m / (sqrt(v) + eps))``.

    Args:
        weights: ``[R, dim]``.
        state: float32 ``[R, >= 2 * dim]``: ``exp_avg`` in ``[0, dim)``, ``exp_avg_sq`` in
            ``[dim, 2 * dim)``.
        slots: int64 ``[n]``, distinct rows to update.
        grads: float32 ``[n, dim]``, one gradient row per slot.
        step_size: ``lr * sqrt(1 - beta2**step) / (1 - beta1**step)``.
        beta1: decay of the first moment.
        beta2: decay of the second moment.
        eps: added to ``sqrt(v)``.
        weight_decay: L2 coefficient added to the gradient (0 disables it).
        rounding: how half-precision weights are stored back.
        decay: AdamW's decoupled weight decay factor (1 disables it).
    """
    dim = weights.shape[1]
    w, mv = _gather_weights(weights, slots), _gather(state, slots, 2 * dim)  # [n, dim], [n, 2D]
    m, v = mv[:, :dim], mv[:, dim:]
    if decay != 1.0:
        w.mul_(decay)
    g = grads if weight_decay == 0.0 else grads.add(w, alpha=weight_decay)
    m.add_((g - m).mul_(1.0 - beta1))
    v.add_((g * g).sub_(v).mul_(1.0 - beta2))
    w.add_(m.div(v.sqrt().add_(eps)).mul_(-step_size))
    _scatter_weights(weights, slots, w, rounding)
    _scatter(state, slots, mv)


def aggregate_grads_ref(
    ids: torch.Tensor, grads: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the gradient rows of equal ids, each id's rows added in their order in ``ids``.

    On CPU ``index_add_`` adds in index order, so the sums are deterministic. (On CUDA tensors
    ``index_add_`` uses atomics; the Triton kernel, which sums tiles of each id's rows in a
    fixed order, is the deterministic CUDA path.)

    Args:
        ids: int64 ``[n]``, any values, duplicates allowed.
        grads: float32 ``[n, dim]``.

    Returns:
        ``unique_ids`` int64 ``[u]`` ascending, and ``summed`` float32 ``[u, dim]``.
    """
    unique_ids, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    summed = grads.new_zeros(unique_ids.numel(), grads.shape[1])
    summed.index_add_(0, inverse, grads)
    return unique_ids, summed


# ----------------------------------------------------------------------------------------------
# the implementation
# ----------------------------------------------------------------------------------------------


def check_step(step: int) -> int:
    """``step`` as an int >= 1 (the step count after incrementing), or TypeError/ValueError."""
    if isinstance(step, bool):
        raise TypeError(f"step must be an int >= 1, got {step!r}")
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an int >= 1, got {step!r}") from None
    if step < 1:
        raise ValueError(f"step must be >= 1 (the step count after incrementing), got {step}")
    return step


def _check_slots(slots: torch.Tensor, rows: int) -> None:
    """Slots in ``[-1, rows)`` and distinct but -1: one host sync; details on the error path."""
    sorted_slots = torch.sort(slots).values
    bad = (sorted_slots[0] < -1) | (sorted_slots[-1] >= rows)
    if slots.numel() > 1:
        repeated = (sorted_slots[1:] == sorted_slots[:-1]) & (sorted_slots[1:] >= 0)
        bad = bad | repeated.any()
    if bool(bad):
        lo, hi = int(sorted_slots[0]), int(sorted_slots[-1])
        if lo < -1 or hi >= rows:
            raise ValueError(
                f"slots must lie in [0, {rows}) (the rows of `weights`; -1 skips a row), got "
                f"min {lo}, max {hi}"
            )
        dup = sorted_slots[1:][(sorted_slots[1:] == sorted_slots[:-1]) & (sorted_slots[1:] >= 0)]
        raise ValueError(f"slots must be distinct; row {int(dup[0])} appears more than once")


def check_row_update(
    weights: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    grads: torch.Tensor,
    update: RowUpdate,
    check_slots: bool = True,
    ids: torch.Tensor | None = None,
) -> None:
    """Raise TypeError/ValueError naming the first bad input; reads rows, never writes."""
    if not isinstance(update, RowUpdate):
        raise TypeError(f"update must be a RowUpdate, got {type(update).__name__}")
    check_tensor("weights", weights, (torch.float32, torch.float16, torch.bfloat16), 2)
    check_tensor("state", state, torch.float32, 2)
    check_tensor("slots", slots, torch.int64)
    check_tensor("grads", grads, torch.float32)
    dim = weights.shape[1]
    require(dim >= 1, f"weights must have at least one column, got shape {tuple(weights.shape)}")
    require(
        state.shape[0] == weights.shape[0],
        f"state has {state.shape[0]} rows, weights {weights.shape[0]}: one state row per row",
    )
    need = update.state_dim(dim)
    if state.shape[1] < need:
        raise ValueError(
            f"state has {state.shape[1]} columns; {update.rule.name} with dim={dim} needs {need}"
        )
    require(slots.dim() == 1, f"slots must be 1-D [n], got shape {tuple(slots.shape)}")
    n = slots.numel()
    if tuple(grads.shape) != (n, dim):
        raise ValueError(f"grads must have shape [n, dim] = [{n}, {dim}], got {tuple(grads.shape)}")
    if ids is not None:
        check_tensor("ids", ids, torch.int64, 1)
        require(ids.numel() == n, f"ids has {ids.numel()} entries, slots {n}: one id per slot")
        require(ids.device == slots.device, f"ids is on {ids.device}, slots on {slots.device}")
    devices = {weights.device, state.device, slots.device, grads.device}
    require(
        len(devices) == 1,
        f"weights, state, slots and grads must share a device, got {weights.device}, "
        f"{state.device}, {slots.device}, {grads.device}",
    )
    if n and check_slots:
        _check_slots(slots, weights.shape[0])


class SpecUpdate:
    """The update family in torch (`UpdateOps`): each operation checks its inputs and works out
    the step's rates, then runs its twins (``_update_rows``, ``_aggregate_grads``,
    ``_stochastic_round``, which `triton.TritonUpdate` replaces)."""

    name = "spec"

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
        step = check_step(step)
        check_row_update(weights, state, slots, grads, update, check_slots, ids)
        if slots.numel() == 0:
            return
        if ids is not None and weights.dtype == torch.float32:
            ids = None  # nothing to round
        rule, lr = update.rule, update.lr
        if rule == OptimRule.ADAGRAD:
            lr = update.lr / (1 + (step - 1) * update.lr_decay)
        elif rule in (OptimRule.ADAM, OptimRule.ADAMW):
            # torch.optim.SparseAdam's step size, computed in double as torch does.
            lr = update.lr * math.sqrt(1 - update.beta2**step) / (1 - update.beta1**step)
        wd, decay = update.weight_decay, 1.0
        if rule == OptimRule.ADAMW:  # decoupled: the weights shrink, the gradient has no L2 term
            wd, decay = 0.0, 1.0 - update.lr * update.weight_decay
        rates = (lr, wd, decay)
        self._update_rows(weights, state, slots, grads, update, rates, ids,
                          rounding_key(seed, step), may_skip)  # fmt: skip

    def _update_rows(
        self,
        weights: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        grads: torch.Tensor,
        update: RowUpdate,
        rates: tuple[float, float, float],
        ids: torch.Tensor | None,
        key: int,
        may_skip: bool,
    ) -> None:
        """The checked update; ``rates``: the step's effective lr, its L2 weight decay and the
        decoupled decay factor (ADAMW's ``1 - lr * weight_decay``, else 1)."""
        lr, wd, decay = rates
        if may_skip:  # the twins drop skipped rows first (a host read of the slots' flags)
            keep = slots >= 0
            if not bool(keep.all()):
                slots, grads = slots[keep], grads[keep]
                ids = None if ids is None else ids[keep]
        rounding = (ids, key)
        rule, eps = update.rule, update.eps
        if rule == OptimRule.SGD:
            sgd_update_ref(weights, slots, grads, lr, wd, rounding)
        elif rule == OptimRule.ADAGRAD:
            adagrad_update_ref(weights, state, slots, grads, lr, eps, wd, rounding)
        elif rule == OptimRule.ROWWISE_ADAGRAD:
            rowwise_adagrad_update_ref(weights, state, slots, grads, lr, eps, wd, rounding)
        else:
            adam_update_ref(weights, state, slots, grads, lr, update.beta1, update.beta2, eps,
                            wd, rounding, decay)  # fmt: skip

    def aggregate_grads(
        self, ids: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_tensor("ids", ids, torch.int64, 1)
        check_tensor("grads", grads, torch.float32)
        require(
            grads.dim() == 2 and grads.shape[0] == ids.numel(),
            f"grads must have shape [n, dim] with n = {ids.numel()}, got {tuple(grads.shape)}",
        )
        require(
            ids.device == grads.device,
            f"ids and grads must share a device, got {ids.device}, {grads.device}",
        )
        return self._aggregate_grads(ids, grads)

    def _aggregate_grads(
        self, ids: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return aggregate_grads_ref(ids, grads)

    def stochastic_round(
        self, x: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor, key: int
    ) -> torch.Tensor:
        check_tensor("x", x, torch.float32, 2)
        check_tensor("ids", ids, torch.int64, 1)
        require(dtype in (torch.float16, torch.bfloat16), f"dtype must be 16-bit, got {dtype}")
        require(ids.numel() == x.shape[0], f"ids has {ids.numel()} entries, x {x.shape[0]} rows")
        require(isinstance(key, int) and 0 <= key < 1 << 32, f"key must be 32-bit, got {key!r}")
        return self._stochastic_round(x, dtype, ids, key)

    def _stochastic_round(
        self, x: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor, key: int
    ) -> torch.Tensor:
        return stochastic_round_ref(x, dtype, uniform_ref(ids, x.shape[1], key))


IMPLEMENTATION: UpdateOps = SpecUpdate()  # checked against the protocol
