"""Optimizer row updates: one fused kernel reads a row's weights and state and writes both.

A cache row's weights ``[dim]`` and its optimizer state ``[S]`` (``S = state_dim(rule, dim)``)
live in two tensors, ``weights [R, dim]`` (float32, float16 or bfloat16) and float32
``state [R, >= S]``. Half-precision weights are widened to float32, updated in float32, and
stored back rounded stochastically (`kernels.rounding`: unbiased, FBGEMM's default for fp16
weights; the draws are a function of the seed, the step, the row's id and the column, so both
backends give the same bits) or, without ids to draw for, to nearest. The state stays float32.

=================  =========  ===========================================================
rule               S          state columns
=================  =========  ===========================================================
SGD                0          none
ADAGRAD            dim        sum of squared gradients, per element
ROWWISE_ADAGRAD    1          sum of mean squared gradients, per row
ADAM, ADAMW        2 * dim    ``exp_avg`` then ``exp_avg_sq``
=================  =========  ===========================================================

(The rules' facts, state layouts included, live in `optim_rules.RULES`; this table shows them.)

`apply_row_update` updates the rows named by ``slots`` in place with one aggregated gradient row
each, and touches nothing else. On the rows it touches the numbers match, to float32 rounding:

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

`aggregate_grads` sums the gradient rows of equal ids deterministically (a stable sort, then a
fixed-order segment sum per id, no float atomics), as the optimizer needs before
`apply_row_update`.

Layout follows Liger-Kernel: kernels, then launchers (check, allocate, launch), then the public
functions that dispatch through `backend.use_triton`.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from embcache.kernels.backend import use_triton
from embcache.kernels.checks import check_tensor, require
from embcache.kernels.optim_ref import (
    adagrad_update_ref,
    adam_update_ref,
    aggregate_grads_ref,
    rowwise_adagrad_update_ref,
    sgd_update_ref,
)
from embcache.kernels.optim_rules import RULES, OptimRule
from embcache.kernels.rounding import rounding_key, row_hash, store_weights
from embcache.ops.segments import chunk_span, chunk_sum_kernel, split_segments


def state_dim(rule: OptimRule, dim: int) -> int:
    """Number of float32 state columns a row needs after its ``dim`` weights.

    Args:
        rule: the update rule.
        dim: embedding dim.

    Returns:
        The widths of the rule's state parts (`optim_rules.RuleSpec.state`): SGD 0; ADAGRAD
        ``dim``; ROWWISE_ADAGRAD 1; ADAM and ADAMW ``2 * dim``.
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


# The rule values as constexpr globals, so the kernel's branches read by name.
_SGD = tl.constexpr(int(OptimRule.SGD))
_ADAGRAD = tl.constexpr(int(OptimRule.ADAGRAD))
_ROWWISE_ADAGRAD = tl.constexpr(int(OptimRule.ROWWISE_ADAGRAD))
_ADAM = tl.constexpr(int(OptimRule.ADAM))

# Elements of one [BLOCK_N, BLOCK_D] block: wide enough that the interpreter runs few programs,
# small enough that a GPU program keeps its four float32 blocks (w, g, and two states) in
# registers.
_ROW_ELEMS = 2048
_ROW_MAX_BLOCK_D = 256
# Segment sums read [BLOCK_N, BLOCK_D] tiles of gradient rows, as the pooling backward does.
_SUM_ELEMS = 4096
_SUM_MAX_BLOCK_N = 64
_SUM_MAX_BLOCK_D = 256


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _axpy(a, x, y):
    """``y + a * x`` rounded once: what torch's ``y.add(x, alpha=a)`` computes (an FMA)."""
    return tl.fma(tl.zeros_like(x) + a, x, y)


@triton.jit
def _rowwise_adagrad_rows(
    p_row, p_state, p_grad, m_n, b_row, dim, stride_wd, stride_gd, lr, eps, weight_decay,
    HAS_WEIGHT_DECAY: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """`_row_update_kernel`'s ROWWISE_ADAGRAD rows (inlined there): ``a = a + sum(g * g) / dim``;
    ``mult = lr / (sqrt(a) + eps)``; ``w = (1 - mult * weight_decay) * w - g * mult``."""
    # Two passes over the columns: the mean square needs the whole row before any update.
    b_sq = tl.zeros([BLOCK_N], dtype=tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)  # [BLOCK_D]
        m_nd = m_n[:, None] & (o_d < dim)[None, :]  # [BLOCK_N, BLOCK_D]
        p_g = p_grad[:, None] + o_d[None, :] * stride_gd
        b_g = tl.load(p_g, mask=m_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
        if HAS_WEIGHT_DECAY:
            p_w = p_row[:, None] + o_d[None, :] * stride_wd
            b_w = tl.load(p_w, mask=m_nd, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
            b_g = _axpy(weight_decay, b_w, b_g)
        b_sq += tl.sum(b_g * b_g, axis=1)
    p_acc = p_state  # [BLOCK_N]
    b_acc = tl.load(p_acc, mask=m_n, other=0.0)  # [BLOCK_N]
    b_acc = b_acc + tl.div_rn(b_sq, tl.zeros_like(b_sq) + dim)
    tl.store(p_acc, b_acc, mask=m_n)
    b_mult = tl.div_rn(tl.zeros_like(b_acc) + lr, tl.sqrt_rn(b_acc) + eps)  # [BLOCK_N]
    b_corr = 1.0 - b_mult * weight_decay  # [BLOCK_N]
    for d0 in range(0, dim, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)  # [BLOCK_D]
        m_nd = m_n[:, None] & (o_d < dim)[None, :]  # [BLOCK_N, BLOCK_D]
        p_w = p_row[:, None] + o_d[None, :] * stride_wd
        p_g = p_grad[:, None] + o_d[None, :] * stride_gd
        b_w = tl.load(p_w, mask=m_nd, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        b_g = tl.load(p_g, mask=m_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
        if HAS_WEIGHT_DECAY:
            b_w = b_corr[:, None] * b_w
        b_w = b_w - b_g * b_mult[:, None]
        store_weights(p_w, b_w, m_nd, b_row, o_d, STOCHASTIC)


@triton.jit(do_not_specialize=["n", "key"])  # per-batch values: one variant
def _row_update_kernel(
    weights_ptr,
    state_ptr,
    slots_ptr,
    grads_ptr,
    ids_ptr,
    n,
    dim,
    stride_wn,
    stride_wd,
    stride_sn,
    stride_sd,
    stride_gn,
    stride_gd,
    lr,
    eps,
    one_minus_beta1,
    one_minus_beta2,
    weight_decay,
    decay,
    key: tl.int64,  # 32 unsigned bits, always passed as i64
    RULE: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr,
    DECOUPLED: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Update rows ``slots[i]`` of ``weights`` and ``state`` with ``grads[i]`` in place; a
    negative slot is skipped.

    ``lr`` is the step's effective rate (SGD and ROWWISE_ADAGRAD: lr; ADAGRAD: the decayed
    ``clr``; ADAM: ``lr * sqrt(1 - beta2**step) / (1 - beta1**step)``). With weight decay
    ``g = g + weight_decay * w`` first (ROWWISE_ADAGRAD: in the mean square only, the update
    folds it into ``w`` as FBGEMM does). With DECOUPLED (ADAMW, launched as ADAM)
    ``w = w * decay`` first, ``decay = 1 - lr * weight_decay``. State columns:

    * SGD: ``w = w + (-lr) * g``.
    * ADAGRAD: ``a = a + g * g``; ``w = w + (-lr) * (g / (sqrt(a) + eps))``, a = ``[0, dim)``.
    * ROWWISE_ADAGRAD: ``a = a + sum(g * g) / dim``; ``mult = lr / (sqrt(a) + eps)``;
      ``w = (1 - mult * weight_decay) * w - g * mult``, a = column 0.
    * ADAM: ``m = m + (g - m) * (1 - beta1)``; ``v = v + (g * g - v) * (1 - beta2)``;
      ``w = w + (-lr) * (m / (sqrt(v) + eps))``, m = ``[0, dim)``, v = ``[dim, 2dim)``.

    Division and square root are IEEE-rounded (``div_rn``, ``sqrt_rn``), as torch's are; a
    product feeds an add unrounded (an FMA) exactly where torch's op is ``add(x, alpha=a)``:
    the weight decay term and the SGD and ADAGRAD weight updates. Weights are read widened to
    float32 and stored through `rounding.store_weights` (half precision: stochastically, with
    the draws of ``(key, ids[i], column)``, when STOCHASTIC; else to nearest).
    One program per ``BLOCK_N`` slots, ``BLOCK_D`` columns at a time.
    """
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    b_slot = tl.load(slots_ptr + o_n, mask=o_n < n, other=-1).to(tl.int64)  # [BLOCK_N]
    m_n = (o_n < n) & (b_slot >= 0)
    b_row = tl.zeros([BLOCK_N], dtype=tl.int64)
    if STOCHASTIC:
        b_row = row_hash(tl.load(ids_ptr + o_n, mask=m_n, other=0).to(tl.int64), key)
    p_row = weights_ptr + b_slot * stride_wn  # [BLOCK_N]
    p_state = state_ptr + b_slot * stride_sn  # [BLOCK_N]
    p_grad = grads_ptr + o_n * stride_gn  # [BLOCK_N]

    if RULE == _ROWWISE_ADAGRAD:
        _rowwise_adagrad_rows(
            p_row, p_state, p_grad, m_n, b_row, dim, stride_wd, stride_gd, lr, eps,
            weight_decay, HAS_WEIGHT_DECAY, STOCHASTIC, BLOCK_N, BLOCK_D,
        )  # fmt: skip
    else:
        for d0 in range(0, dim, BLOCK_D):
            o_d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)  # [BLOCK_D]
            m_nd = m_n[:, None] & (o_d < dim)[None, :]  # [BLOCK_N, BLOCK_D]
            p_w = p_row[:, None] + o_d[None, :] * stride_wd  # [BLOCK_N, BLOCK_D]
            p_s = p_state[:, None] + o_d[None, :] * stride_sd  # [BLOCK_N, BLOCK_D]
            p_g = p_grad[:, None] + o_d[None, :] * stride_gd
            b_w = tl.load(p_w, mask=m_nd, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
            b_g = tl.load(p_g, mask=m_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
            if DECOUPLED:
                b_w = b_w * decay
            if HAS_WEIGHT_DECAY:
                b_g = _axpy(weight_decay, b_w, b_g)
            if RULE == _SGD:
                b_w = _axpy(-lr, b_g, b_w)
            elif RULE == _ADAGRAD:
                p_acc = p_s
                b_acc = tl.load(p_acc, mask=m_nd, other=0.0) + b_g * b_g  # [BLOCK_N, BLOCK_D]
                tl.store(p_acc, b_acc, mask=m_nd)
                b_w = _axpy(-lr, tl.div_rn(b_g, tl.sqrt_rn(b_acc) + eps), b_w)
            elif RULE == _ADAM:
                p_m = p_s
                p_v = p_s + dim * stride_sd
                b_m = tl.load(p_m, mask=m_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
                b_v = tl.load(p_v, mask=m_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
                b_m = b_m + (b_g - b_m) * one_minus_beta1
                b_v = b_v + (b_g * b_g - b_v) * one_minus_beta2
                tl.store(p_m, b_m, mask=m_nd)
                tl.store(p_v, b_v, mask=m_nd)
                b_w = b_w + (-lr) * tl.div_rn(b_m, tl.sqrt_rn(b_v) + eps)
            store_weights(p_w, b_w, m_nd, b_row, o_d, STOCHASTIC)


@triton.jit(
    do_not_specialize=["num_chunks", "num_unique", "search_steps"]
)  # per-batch values: one variant
def _segment_sum_kernel(
    grads_ptr,
    order_ptr,
    offsets_ptr,
    out_ptr,
    partial_ptr,
    num_chunks,
    num_unique,
    search_steps,
    dim,
    stride_gn,
    stride_gd,
    stride_on,
    stride_od,
    CHUNK: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """BLOCK_U chunks, BLOCK_D columns: the part of ``out[u] = Σ_{k ∈ [offsets[u],
    offsets[u + 1])} grads[order[k]]`` over one chunk of at most CHUNK of those k.

    Id u's k are cut into chunks of at most CHUNK (`pooling.split_segments`), so a hot id's rows are
    summed by many programs side by side. A chunk's rows are read ``BLOCK_N`` at a time in
    ``k`` order; a tile is reduced by ``tl.sum`` (a fixed tree for given block sizes) and added
    to an fp32 running sum. An id of one chunk gets its sum stored in ``out[u]``; the chunks of
    a longer id store theirs in ``partial[c]`` (contiguous ``[num_chunks, dim]``), which
    `pooling.chunk_sum_kernel` adds up in chunk order. The order of every addition depends
    only on the inputs and the block sizes: every run gives the same bits.
    """
    i_c = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D).to(tl.int64)  # [BLOCK_D]
    m_d = o_d < dim
    for k in range(BLOCK_U):
        o_c = i_c * BLOCK_U + k
        u, m_u, seg_start, seg_end, single = chunk_span(
            offsets_ptr, o_c, num_chunks, num_unique, search_steps, CHUNK
        )
        b_sum = tl.zeros([BLOCK_D], dtype=tl.float32)
        for o_start in range(seg_start, seg_end, BLOCK_N):
            o_n = o_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            m_n = o_n < seg_end
            b_src = tl.load(order_ptr + o_n, mask=m_n, other=0).to(tl.int64)  # [BLOCK_N]
            p_g = grads_ptr + b_src[:, None] * stride_gn + o_d[None, :] * stride_gd
            m_g = m_n[:, None] & m_d[None, :]  # [BLOCK_N, BLOCK_D]
            b_g = tl.load(p_g, mask=m_g, other=0.0)  # [BLOCK_N, BLOCK_D]
            b_sum += tl.sum(b_g, axis=0)
        tl.store(out_ptr + u * stride_on + o_d * stride_od, b_sum, mask=m_u & m_d & single)
        tl.store(partial_ptr + o_c * dim + o_d, b_sum, mask=m_u & m_d & ~single)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def row_update_triton(
    weights: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    grads: torch.Tensor,
    rule: OptimRule,
    lr: float,
    eps: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    ids: torch.Tensor | None = None,
    key: int = 0,
    decay: float = 1.0,
) -> None:
    """Launch `_row_update_kernel` on checked inputs (see `apply_row_update`).

    ``lr`` is the step's effective rate, as the kernel's docstring says; ``ids`` (with
    ``key``) make half-precision weights round stochastically. ``weight_decay`` is L2 (added
    to the gradient); ``decay`` multiplies the weights first (ADAMW's ``1 - lr *
    weight_decay``; ADAMW runs the ADAM branch).
    """
    n, dim = slots.numel(), weights.shape[1]
    if n == 0:
        return
    block_d = min(triton.next_power_of_2(dim), _ROW_MAX_BLOCK_D)
    block_n = max(_ROW_ELEMS // block_d, 1)  # fixed per dim: never a batch's count
    grid = (triton.cdiv(n, block_n),)
    stochastic = ids is not None and weights.dtype != torch.float32
    _row_update_kernel[grid](
        weights,
        state,
        slots,
        grads,
        ids if ids is not None else slots,
        n,
        dim,
        weights.stride(0),
        weights.stride(1),
        state.stride(0),
        state.stride(1),
        grads.stride(0),
        grads.stride(1),
        lr,
        eps,
        1.0 - beta1,
        1.0 - beta2,
        weight_decay,
        decay,
        key,
        RULE=int(OptimRule.ADAM if rule == OptimRule.ADAMW else rule),
        HAS_WEIGHT_DECAY=weight_decay != 0.0,
        DECOUPLED=decay != 1.0,
        STOCHASTIC=stochastic,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        # No implicit FMA contraction: a * b + c stays two roundings, as in torch's separate
        # ops; `_axpy` fuses explicitly where torch's add-with-alpha does.
        enable_fp_fusion=False,
    )


def aggregate_grads_triton(
    ids: torch.Tensor, grads: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable-sort ``ids``, then launch `_segment_sum_kernel` over chunks of each id's rows
    (`pooling.split_segments`) and `pooling.chunk_sum_kernel` over the chunk sums of the ids
    of several (see `aggregate_grads`)."""
    sorted_ids, order = torch.sort(ids, stable=True)
    unique_ids, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    u, dim = unique_ids.numel(), grads.shape[1]
    offsets = torch.nn.functional.pad(torch.cumsum(counts, 0), (1, 0))  # [u + 1]
    summed = torch.empty(u, dim, dtype=torch.float32, device=grads.device)
    if u and dim:
        block_d = min(max(triton.next_power_of_2(dim), 16), _SUM_MAX_BLOCK_D)
        block_n = min(max(_SUM_ELEMS // block_d, 1), _SUM_MAX_BLOCK_N)
        # A hot id's rows are cut into chunks, summed side by side, then in chunk order.
        chunk, num_chunks, search_steps = split_segments(offsets, ids.numel(), block_n)
        partial = torch.empty(num_chunks, dim, dtype=torch.float32, device=grads.device)
        # One chunk (or id) per program on a GPU; the interpreter pays per program: wide ones.
        block_u = 1 if grads.is_cuda else 64
        grid = (triton.cdiv(num_chunks, block_u), triton.cdiv(dim, block_d))
        _segment_sum_kernel[grid](
            grads,
            order,
            offsets,
            summed,
            partial,
            num_chunks,
            u,
            search_steps,
            dim,
            grads.stride(0),
            grads.stride(1),
            summed.stride(0),
            summed.stride(1),
            CHUNK=chunk,
            BLOCK_U=block_u,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
        )
        grid = (triton.cdiv(u, block_u), triton.cdiv(dim, block_d))
        chunk_sum_kernel[grid](
            partial, offsets, summed, u, dim, CHUNK=chunk, BLOCK_U=block_u, BLOCK_D=block_d
        )
    else:
        summed.zero_()
    return unique_ids, summed


# ----------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------


def _check_step(step: int) -> int:
    if isinstance(step, bool):
        raise TypeError(f"step must be an int >= 1, got {step!r}")
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an int >= 1, got {step!r}") from None
    if step < 1:
        raise ValueError(f"step must be >= 1 (the step count after incrementing), got {step}")
    return step


def _check_row_update(
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
    if n == 0 or not check_slots:
        return
    rows = weights.shape[0]
    # One host sync for the range and distinctness checks; details only on the error path.
    sorted_slots = torch.sort(slots).values
    bad = (sorted_slots[0] < -1) | (sorted_slots[-1] >= rows)
    if n > 1:
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


def apply_row_update(
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

    Weights and state are read and written by one fused kernel (Triton on CUDA, the torch twin
    on CPU, see `backend`). Rows not in ``slots`` are left bit-identical.

    Args:
        weights: ``[R, dim]`` float32, float16 or bfloat16 (may be a strided view); half
            precision is updated in float32 and rounded back (see ``ids``).
        state: float32 ``[R, C]``, ``C >= state_dim(update.rule, dim)``: the rule's state in
            columns ``[0, S)``; further columns are untouched (``C = 0`` for SGD).
        slots: int64 ``[n]``, distinct row indices in ``[0, R)``, or -1 for a row to skip (an
            id the cache has not admitted: its gradient is dropped).
        grads: float32 ``[n, dim]``, one aggregated gradient row per slot (see
            `aggregate_grads`).
        update: the rule and its hyper-parameters.
        step: the optimizer's step count after incrementing (1 on the first step); used by
            ADAM's and ADAMW's bias corrections and ADAGRAD's ``lr_decay``.
        check_slots: verify that slots are in range and distinct (a sort and a host sync).
            Callers whose slots come from a cache resolve, distinct by construction, skip it.
        ids: int64 ``[n]``, the rows' ids (fused ids): half-precision weights are then rounded
            stochastically with draws of ``(seed, step, id, column)``; None rounds to nearest.
        seed: the seed of those draws.
        may_skip: ``slots`` may hold -1 (rows to skip). False when the caller knows they hold
            none (a cache that admits every id): the CPU twin then reads nothing on the host.

    Raises:
        TypeError: a wrong type or dtype.
        ValueError: a wrong shape, too few state columns for the rule, slots out of range or
            repeated, mismatched devices, ``step < 1``. Nothing is changed when raised.
    """
    step = _check_step(step)
    _check_row_update(weights, state, slots, grads, update, check_slots, ids)
    if slots.numel() == 0:
        return
    if ids is not None and weights.dtype == torch.float32:
        ids = None  # nothing to round
    rule = update.rule
    lr = update.lr
    if rule == OptimRule.ADAGRAD:
        lr = update.lr / (1 + (step - 1) * update.lr_decay)
    elif rule in (OptimRule.ADAM, OptimRule.ADAMW):
        # torch.optim.SparseAdam's step size, computed in double as torch does.
        lr = update.lr * math.sqrt(1 - update.beta2**step) / (1 - update.beta1**step)

    wd, decay = update.weight_decay, 1.0
    if rule == OptimRule.ADAMW:  # decoupled: the weights shrink, the gradient has no L2 term
        wd, decay = 0.0, 1.0 - update.lr * update.weight_decay
    key = rounding_key(seed, step)
    if use_triton(weights):
        row_update_triton(weights, state, slots, grads, rule, lr, update.eps, update.beta1,
                          update.beta2, wd, ids, key, decay)  # fmt: skip
        return
    if may_skip:  # the twins drop skipped rows first (a host read of the slots' flags)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, grads = slots[keep], grads[keep]
            ids = None if ids is None else ids[keep]
    rounding = (ids, key)
    if rule == OptimRule.SGD:
        sgd_update_ref(weights, slots, grads, lr, wd, rounding)
    elif rule == OptimRule.ADAGRAD:
        adagrad_update_ref(weights, state, slots, grads, lr, update.eps, wd, rounding)
    elif rule == OptimRule.ROWWISE_ADAGRAD:
        rowwise_adagrad_update_ref(weights, state, slots, grads, lr, update.eps, wd, rounding)
    else:
        adam_update_ref(weights, state, slots, grads, lr, update.beta1, update.beta2,
                        update.eps, wd, rounding, decay)  # fmt: skip


def aggregate_grads(ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the gradient rows of equal ids, deterministically.

    No float atomics on either backend, so each gives the same bits on every run: the CPU twin
    adds each id's rows one by one in their order in ``ids`` (``index_add_``); the Triton
    kernel sums each id's rows in that order in chunks of a few tiles, one program a chunk (a
    hot id of thousands of rows is summed by many programs side by side), then the chunk sums
    in order. The two agree to float32 rounding of the summation order.

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
    if use_triton(grads):
        return aggregate_grads_triton(ids, grads)
    return aggregate_grads_ref(ids, grads)
