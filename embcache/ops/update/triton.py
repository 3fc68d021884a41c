"""The update family's Triton kernels: the fused row update (weights and optimizer state read and
written in one pass), the per-id gradient sum (`ops.segments`: a hot id's chunks side by side,
then in chunk order), and the rounding of float32 values into half-precision weights that the
row update stores through (`store_weights`; `_stochastic_round_kernel` runs it alone).

Layout follows Liger-Kernel: kernels, then launchers (check, allocate, launch), then
`TritonUpdate`, the family's implementation over them (`UpdateOps`). Each kernel's torch twin is
in `ops.update.spec`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import embcache.ops.interpreter  # noqa: F401  (the interpreter runs these kernels)
from embcache.ops.segments import add_chunk_sums, chunk_span, split_segments
from embcache.ops.update import OptimRule, RowUpdate, UpdateOps
from embcache.ops.update.spec import SpecUpdate

_ROUND_BLOCK_N = 16
_ROUND_MAX_BLOCK_D = 256

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


# rounding into half-precision weights (the row update stores its weights through these)


@triton.jit
def _hash32(x):
    """`spec.hash32` on int64 values in ``[0, 2**32)``."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    return (x >> 16) ^ x


@triton.jit
def row_hash(b_ids, key):
    """Per-row part of the draws: `spec.uniform_ref`'s ``row``. int64 ``[BLOCK_N]``."""
    return _hash32(_hash32((b_ids & 0xFFFFFFFF) ^ key) ^ ((b_ids >> 32) & 0xFFFFFFFF))


@triton.jit
def _uniform(b_row, o_d):
    """float32 ``[BLOCK_N, BLOCK_D]`` in ``[0, 1)``: `spec.uniform_ref` of the rows'
    hashes ``b_row`` and columns ``o_d``."""
    b_cols = (o_d.to(tl.int64) * 0x9E3779B1) & 0xFFFFFFFF
    b_bits = _hash32(b_row[:, None] ^ b_cols[None, :]) >> 8
    return b_bits.to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _round(b_x, b_u, OUT_DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr):
    """float32 ``b_x`` into ``OUT_DTYPE`` (16-bit): stochastically with the uniform draws
    ``b_u`` (`spec.stochastic_round_ref`), else to nearest, ties to even.

    Both from the two neighbours: a cast gives one of them (Triton's interpreter truncates a
    float32 to bfloat16 where a GPU rounds to nearest; either way), stepped toward zero when it
    went away from it; the other is the next bit pattern.
    """
    b_near = b_x.to(OUT_DTYPE)
    b_bits = b_near.to(tl.int16, bitcast=True)
    m_away = tl.abs(b_near.to(tl.float32)) > tl.abs(b_x)
    b_lo_bits = tl.where(m_away, b_bits - 1, b_bits)
    b_lo = b_lo_bits.to(OUT_DTYPE, bitcast=True)
    b_hi = (b_lo_bits + 1).to(OUT_DTYPE, bitcast=True)
    b_lo32 = tl.abs(b_lo.to(tl.float32))
    b_hi32 = tl.abs(b_hi.to(tl.float32))
    b_p = tl.div_rn(tl.abs(b_x) - b_lo32, b_hi32 - b_lo32)
    m_nearest_up = (b_p > 0.5) | ((b_p == 0.5) & ((b_lo_bits & 1) == 1))  # ties to even
    m_up = b_u < b_p if STOCHASTIC else m_nearest_up
    return tl.where(m_up, b_hi, b_lo)


@triton.jit
def store_weights(p_w, b_w, m_nd, b_row, o_d, STOCHASTIC: tl.constexpr):
    """Store float32 weights ``b_w`` at ``p_w`` in its element type: half precision rounded
    stochastically (draws of the rows' hashes ``b_row``) or to nearest."""
    out_dtype: tl.constexpr = p_w.dtype.element_ty
    if out_dtype == tl.float32:
        tl.store(p_w, b_w, mask=m_nd)
    elif STOCHASTIC:
        tl.store(p_w, _round(b_w, _uniform(b_row, o_d), out_dtype, True), mask=m_nd)
    else:
        tl.store(p_w, _round(b_w, b_w, out_dtype, False), mask=m_nd)


@triton.jit(do_not_specialize=["n", "key"])  # per-batch values: one variant
def _stochastic_round_kernel(
    x_ptr,
    ids_ptr,
    out_ptr,
    n,
    dim,
    key: tl.int64,  # 32 unsigned bits, always passed as i64
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``out[i, j] = stochastic_round(x[i, j])`` with the draws of ``(key, ids[i], j)``;
    ``x`` and ``out`` contiguous ``[n, dim]``."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    b_row = row_hash(tl.load(ids_ptr + o_n, mask=m_n, other=0).to(tl.int64), key)
    for d0 in range(0, dim, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D).to(tl.int64)  # [BLOCK_D]
        m_nd = m_n[:, None] & (o_d < dim)[None, :]  # [BLOCK_N, BLOCK_D]
        offsets = o_n[:, None] * dim + o_d[None, :]
        b_x = tl.load(x_ptr + offsets, mask=m_nd, other=0.0)
        store_weights(out_ptr + offsets, b_x, m_nd, b_row, o_d, True)


# the row update and the gradient sum


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
    float32 and stored through `store_weights` (half precision: stochastically, with
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

    Id u's k are cut into chunks of at most CHUNK (`segments.split_segments`), so a hot id's
    rows are summed by many programs side by side. A chunk's rows are read ``BLOCK_N`` at a time in
    ``k`` order; a tile is reduced by ``tl.sum`` (a fixed tree for given block sizes) and added
    to an fp32 running sum. An id of one chunk gets its sum stored in ``out[u]``; the chunks of
    a longer id store theirs in ``partial[c]`` (contiguous ``[num_chunks, dim]``), which
    `segments.chunk_sum_kernel` adds up in chunk order. The order of every addition depends
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
    """Launch `_row_update_kernel` on checked inputs (see `UpdateOps.apply_row_update`).

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
    (`segments.split_segments`) and `segments.chunk_sum_kernel` over the chunk sums of the ids
    of several (see `UpdateOps.aggregate_grads`)."""
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
        add_chunk_sums(partial, offsets, summed, u, dim, chunk, block_u, block_d)
    else:
        summed.zero_()
    return unique_ids, summed


def stochastic_round_triton(
    x: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor, key: int
) -> torch.Tensor:
    """Launch `_stochastic_round_kernel` on checked inputs (see `UpdateOps.stochastic_round`)."""
    n, dim = x.shape
    out = torch.empty(n, dim, dtype=dtype, device=x.device)
    if n and dim:
        block_d = min(triton.next_power_of_2(dim), _ROUND_MAX_BLOCK_D)
        grid = (triton.cdiv(n, _ROUND_BLOCK_N),)
        _stochastic_round_kernel[grid](
            x.contiguous(), ids, out, n, dim, key, BLOCK_N=_ROUND_BLOCK_N, BLOCK_D=block_d
        )
    return out


# ----------------------------------------------------------------------------------------------
# the implementation
# ----------------------------------------------------------------------------------------------


class TritonUpdate(SpecUpdate):
    """The update family on the Triton kernels (`UpdateOps`): `SpecUpdate`'s checks and rates,
    then the launchers above."""

    name = "triton"

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
        lr, wd, decay = rates  # the kernel skips negative slots itself: may_skip is moot
        row_update_triton(weights, state, slots, grads, update.rule, lr, update.eps,
                          update.beta1, update.beta2, wd, ids, key, decay)  # fmt: skip

    def _aggregate_grads(
        self, ids: torch.Tensor, grads: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return aggregate_grads_triton(ids, grads)

    def _stochastic_round(
        self, x: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor, key: int
    ) -> torch.Tensor:
        return stochastic_round_triton(x, dtype, ids, key)


IMPLEMENTATION: UpdateOps = TritonUpdate()  # checked against the protocol
