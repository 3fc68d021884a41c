"""Torch twins of the optimizer kernels (`kernels/optim.py`): in-place row updates (SGD,
AdaGrad, row-wise AdaGrad, Adam, lazy AdamW) and the per-id gradient sum.

Each function computes what its Triton kernel computes, with the same float32 operations in the
same order as the torch (or FBGEMM) optimizer it mirrors: the specification, and the CPU path.
"""

from __future__ import annotations

import torch

from embcache.kernels.rounding_ref import store_weights_ref

# A cache row's weights and its optimizer state live in two tensors, ``weights [R, dim]``
# (float32, float16 or bfloat16) and float32 ``state [R, S]``. Each twin gathers the touched rows
# of both (weights widened to float32), updates them with the same float32 operations, in the
# same order, as the torch (or FBGEMM) optimizer it mirrors, and scatters them back (weights
# rounded into their dtype, see `rounding_ref.store_weights_ref`): rows not in ``slots`` are
# never read or written. ``slots`` must be distinct (checked by kernels/optim.py).

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
