"""Torch twins of the optimizer kernels (`kernels/optim.py`): in-place row updates (SGD,
AdaGrad, row-wise AdaGrad, Adam) and the per-id gradient sum.

Each function computes what its Triton kernel computes, with the same float32 operations in the
same order as the torch (or FBGEMM) optimizer it mirrors: the specification, and the CPU path.
"""

from __future__ import annotations

import torch

# A row of the cache is ``[weights (dim) | optimizer state (S)]``. Each twin gathers the first
# ``dim + S`` columns of the touched rows, updates them with the same float32 operations, in the
# same order, as the torch (or FBGEMM) optimizer it mirrors, and scatters them back: rows not in
# ``slots`` are never read or written. ``slots`` must be distinct (checked by kernels/optim.py).


def _optim_gather(rows: torch.Tensor, slots: torch.Tensor, width: int) -> torch.Tensor:
    """Copy of the first ``width`` columns of ``rows[slots]``: ``[n, width]``."""
    return rows.narrow(1, 0, width).index_select(0, slots)


def _optim_scatter(rows: torch.Tensor, slots: torch.Tensor, block: torch.Tensor) -> None:
    """Write ``block`` (``[n, width]``) back into the first ``width`` columns of ``rows[slots]``."""
    rows.narrow(1, 0, block.shape[1]).index_copy_(0, slots, block)


def sgd_update_ref(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    weight_decay: float = 0.0,
) -> None:
    """SGD on the touched rows, in place: ``w += -lr * (g + weight_decay * w)``.

    Args:
        rows: float32 ``[R, >= dim]``; columns ``[0, dim)`` are the weights (no state).
        dim: embedding dim.
        slots: int64 ``[n]``, distinct rows to update.
        grads: float32 ``[n, dim]``, one gradient row per slot.
        lr: learning rate.
        weight_decay: L2 coefficient added to the gradient (0 disables it).
    """
    if weight_decay == 0.0:
        # The same arithmetic torch.optim.SGD applies for a sparse gradient: w + (-lr) * g;
        # gather + scatter of distinct slots is faster on the CPU than index_add_.
        _optim_scatter(rows, slots, _optim_gather(rows, slots, dim).add_(grads, alpha=-lr))
        return
    block = _optim_gather(rows, slots, dim)  # [n, dim]
    block.add_(grads.add(block, alpha=weight_decay), alpha=-lr)
    _optim_scatter(rows, slots, block)


def adagrad_update_ref(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    grads: torch.Tensor,
    clr: float,
    eps: float,
    weight_decay: float = 0.0,
) -> None:
    """Adagrad on the touched rows, in place, as ``torch.optim.Adagrad``'s sparse branch.

    ``g' = g + weight_decay * w``; ``acc += g' * g'``; ``w += -clr * (g' / (sqrt(acc) + eps))``.

    Args:
        rows: float32 ``[R, >= 2 * dim]``: weights ``[0, dim)``, sum of squares ``[dim, 2 * dim)``.
        dim: embedding dim.
        slots: int64 ``[n]``, distinct rows to update.
        grads: float32 ``[n, dim]``, one gradient row per slot.
        clr: the step's learning rate, ``lr / (1 + (step - 1) * lr_decay)``.
        eps: added to ``sqrt(acc)``.
        weight_decay: L2 coefficient added to the gradient (0 disables it).
    """
    block = _optim_gather(rows, slots, 2 * dim)  # [n, 2 * dim]
    w, acc = block[:, :dim], block[:, dim:]
    g = grads if weight_decay == 0.0 else grads.add(w, alpha=weight_decay)
    acc.add_(g * g)
    w.add_(g / acc.sqrt().add_(eps), alpha=-clr)
    _optim_scatter(rows, slots, block)


def rowwise_adagrad_update_ref(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    eps: float,
    weight_decay: float = 0.0,
) -> None:
    """Row-wise Adagrad on the touched rows, in place, as FBGEMM's EXACT_ROWWISE_ADAGRAD.

    With L2 weight decay (FBGEMM's ``weight_decay_mode=L2``), ``g' = g + weight_decay * w``:
    ``acc += mean(g' * g')``; ``mult = lr / (sqrt(acc) + eps)``;
    ``w = (1 - mult * weight_decay) * w - mult * g``, which is ``w - mult * g'``.

    Args:
        rows: float32 ``[R, >= dim + 1]``: weights ``[0, dim)``, sum of mean squares at ``dim``.
        dim: embedding dim.
        slots: int64 ``[n]``, distinct rows to update.
        grads: float32 ``[n, dim]``, one gradient row per slot.
        lr: learning rate.
        eps: added to ``sqrt(acc)``.
        weight_decay: L2 coefficient (0 disables it).
    """
    block = _optim_gather(rows, slots, dim + 1)  # [n, dim + 1]
    w, acc = block[:, :dim], block[:, dim]
    g = grads if weight_decay == 0.0 else grads.add(w, alpha=weight_decay)
    acc.add_((g * g).sum(dim=1) / dim)
    mult = lr / (acc.sqrt() + eps)  # [n]
    if weight_decay != 0.0:
        w.mul_(1.0 - mult.unsqueeze(1) * weight_decay)
    w.sub_(grads * mult.unsqueeze(1))
    _optim_scatter(rows, slots, block)


def adam_update_ref(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    grads: torch.Tensor,
    step_size: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
) -> None:
    """Adam on the touched rows, in place, as ``torch.optim.SparseAdam``.

    ``g' = g + weight_decay * w``; ``m += (g' - m) * (1 - beta1)``;
    ``v += (g' * g' - v) * (1 - beta2)``; ``w += -step_size * (m / (sqrt(v) + eps))``.

    Args:
        rows: float32 ``[R, >= 3 * dim]``: weights ``[0, dim)``, ``exp_avg`` ``[dim, 2 * dim)``,
            ``exp_avg_sq`` ``[2 * dim, 3 * dim)``.
        dim: embedding dim.
        slots: int64 ``[n]``, distinct rows to update.
        grads: float32 ``[n, dim]``, one gradient row per slot.
        step_size: ``lr * sqrt(1 - beta2**step) / (1 - beta1**step)``.
        beta1: decay of the first moment.
        beta2: decay of the second moment.
        eps: added to ``sqrt(v)``.
        weight_decay: L2 coefficient added to the gradient (0 disables it).
    """
    block = _optim_gather(rows, slots, 3 * dim)  # [n, 3 * dim]
    w, m, v = block[:, :dim], block[:, dim : 2 * dim], block[:, 2 * dim :]
    g = grads if weight_decay == 0.0 else grads.add(w, alpha=weight_decay)
    m.add_((g - m).mul_(1.0 - beta1))
    v.add_((g * g).sub_(v).mul_(1.0 - beta2))
    w.add_(m.div(v.sqrt().add_(eps)).mul_(-step_size))
    _optim_scatter(rows, slots, block)


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
