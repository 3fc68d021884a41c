"""The pooling family's Triton kernels: bags of cache rows pooled into their columns of the
output, and the backward's segment sums, one gradient row per unique id (`ops.segments`: a hot
id's chunks side by side, then in chunk order).

Layout follows Liger-Kernel: kernels, then launchers (check, allocate, launch), then
`TritonPooling`, the family's implementation over them (`PoolingOps`). Each kernel's torch twin
is in `ops.pooling.spec`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import embcache.ops.interpreter  # noqa: F401  (the interpreter runs these kernels)
from embcache.ops.pooling import PoolingMode, PoolingOps
from embcache.ops.pooling.spec import SpecPooling
from embcache.ops.segments import add_chunk_sums, chunk_span, split_segments, tile_blocks

# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["batch_size"])  # per-batch values: one variant
def _pool_forward_kernel(
    rows_ptr,
    slots_ptr,
    inverse_ptr,
    offsets_ptr,
    weights_ptr,
    col_offsets_ptr,
    out_ptr,
    argmax_ptr,
    batch_size,
    dim,
    stride_row,
    stride_row_col,
    stride_out_b,
    stride_out_col,
    MODE: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One bag, BLOCK_D columns: ``out[b, col + d] = pool_j(w_j * rows[slots[inverse[j]], d])``.

    MODE 0 SUM, 1 MEAN (sum / length), 2 MAX (also stores the first arg-max value index, -1 for
    an empty bag). Rows of any float dtype, accumulated in fp32; a slot < 0 is a zero row.
    """
    i_bag = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_d = o_d < dim
    bag_start = tl.load(offsets_ptr + i_bag)
    bag_end = tl.load(offsets_ptr + i_bag + 1)
    if MODE == 2:
        b_acc = tl.full([BLOCK_D], float("-inf"), tl.float32)
        b_arg = tl.full([BLOCK_D], -1, tl.int64)
    else:
        b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for o_start in range(bag_start, bag_end, BLOCK_N):
        o_n = o_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        m_n = o_n < bag_end
        b_unique = tl.load(inverse_ptr + o_n, mask=m_n, other=0)
        b_slot = tl.load(slots_ptr + b_unique, mask=m_n, other=0).to(tl.int64)
        p_x = rows_ptr + b_slot[:, None] * stride_row + o_d[None, :] * stride_row_col
        m_x = m_n[:, None] & m_d[None, :]  # [BLOCK_N, BLOCK_D]
        m_row = m_x & (b_slot >= 0)[:, None]
        b_x = tl.load(p_x, mask=m_row, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        if HAS_WEIGHTS:
            b_w = tl.load(weights_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)  # [BLOCK_N]
            b_x = b_x * b_w[:, None]
        if MODE == 2:
            b_x = tl.where(m_x, b_x, float("-inf"))
            # Ties go to the lowest index, within the block and (strict >) across blocks.
            b_max, b_idx = tl.max(b_x, axis=0, return_indices=True)  # [BLOCK_D]
            m_new = (b_max > b_acc) | (b_arg < 0)
            b_arg = tl.where(m_new, o_start + b_idx.to(tl.int64), b_arg)
            b_acc = tl.where(m_new, b_max, b_acc)
        else:
            b_acc += tl.sum(b_x, axis=0)
    length = bag_end - bag_start
    if MODE == 1:
        b_acc = b_acc / tl.maximum(length, 1).to(tl.float32)
    if MODE == 2:
        b_acc = tl.where(length > 0, b_acc, 0.0)
        tl.store(argmax_ptr + i_bag * dim + o_d, b_arg, mask=m_d)
    i_feature = i_bag // batch_size
    i_sample = i_bag % batch_size
    col = tl.load(col_offsets_ptr + i_feature)
    p_out = out_ptr + i_sample * stride_out_b + (col + o_d) * stride_out_col
    tl.store(p_out, b_acc, mask=m_d)


@triton.jit(
    do_not_specialize=[
        "num_chunks",
        "num_unique",
        "search_steps",
        "num_bags",
        "bag_steps",
        "batch_size",
    ]
)  # per batch: one variant
def _pool_backward_kernel(
    grad_out_ptr,
    order_ptr,
    segment_starts_ptr,
    offsets_ptr,
    weights_ptr,
    col_offsets_ptr,
    argmax_ptr,
    grad_unique_ptr,
    partial_ptr,
    num_chunks,
    num_unique,
    search_steps,
    num_bags,
    bag_steps,
    batch_size,
    dim,
    stride_grad_b,
    stride_grad_col,
    MODE: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """BLOCK_U chunks, BLOCK_D columns: the part of ``grad_unique[u] = Σ_{j: inverse[j] = u}
    s_j g_bag(j)`` over one chunk of at most CHUNK of u's values.

    ``order[segment_starts[u] : segment_starts[u + 1]]`` are the value positions j of unique id u,
    ascending, cut into chunks of at most CHUNK values (`ops.segments`: `split_segments`,
    `chunk_span`). So a hot id's values are summed by many programs side by side instead of one
    walking them all. An id of one chunk gets its sum stored in ``grad_unique[u]``; the chunks
    of a longer id store theirs in ``partial[c]``, which `chunk_sum_kernel` adds up in chunk
    order. ``s_j`` is ``w_j`` (SUM), ``w_j / L`` (MEAN) or ``w_j [argmax[bag, d] == j]`` (MAX).
    Every sum runs in a fixed order, so the result is bit-reproducible. Accumulates in fp32.
    """
    i_c = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_d = o_d < dim
    for k in range(BLOCK_U):
        o_c = i_c * BLOCK_U + k
        u, m_u, seg_start, seg_end, single = chunk_span(
            segment_starts_ptr, o_c, num_chunks, num_unique, search_steps, CHUNK
        )
        b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for o_start in range(seg_start, seg_end, BLOCK_N):
            o_n = o_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            m_n = o_n < seg_end
            b_j = tl.load(order_ptr + o_n, mask=m_n, other=0)
            # The bag of value j: the last whose offset is <= j (``bag_steps`` halvings).
            b_lo = tl.zeros((BLOCK_N,), dtype=tl.int64)
            b_hi = tl.zeros((BLOCK_N,), dtype=tl.int64) + num_bags + 1
            for _ in range(bag_steps):
                m_open = m_n & (b_lo < b_hi)
                b_mid = (b_lo + b_hi) >> 1
                b_off = tl.load(offsets_ptr + b_mid, mask=m_open, other=0)
                b_lo = tl.where(m_open & (b_off <= b_j), b_mid + 1, b_lo)
                b_hi = tl.where(m_open & (b_off > b_j), b_mid, b_hi)
            b_bag = tl.maximum(b_lo - 1, 0)
            b_col = tl.load(col_offsets_ptr + b_bag // batch_size, mask=m_n, other=0)
            b_sample = b_bag % batch_size
            m_g = m_n[:, None] & m_d[None, :]  # [BLOCK_N, BLOCK_D]
            p_g = (
                grad_out_ptr
                + b_sample[:, None] * stride_grad_b
                + (b_col[:, None] + o_d[None, :]) * stride_grad_col
            )
            b_g = tl.load(p_g, mask=m_g, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
            if MODE == 2:
                p_arg = argmax_ptr + b_bag[:, None] * dim + o_d[None, :]
                b_arg = tl.load(p_arg, mask=m_g, other=-1)  # [BLOCK_N, BLOCK_D]
                b_g = tl.where(b_arg == b_j[:, None], b_g, 0.0)
            if MODE == 1:
                b_bag_start = tl.load(offsets_ptr + b_bag, mask=m_n, other=0)
                b_bag_end = tl.load(offsets_ptr + b_bag + 1, mask=m_n, other=1)
                b_len = tl.maximum(b_bag_end - b_bag_start, 1).to(tl.float32)  # [BLOCK_N]
                b_g = b_g / b_len[:, None]
            if HAS_WEIGHTS:
                b_w = tl.load(weights_ptr + b_j, mask=m_n, other=0.0).to(tl.float32)  # [BLOCK_N]
                b_g = b_g * b_w[:, None]
            b_acc += tl.sum(b_g, axis=0)
        tl.store(grad_unique_ptr + u * dim + o_d, b_acc, mask=m_u & m_d & single)
        tl.store(partial_ptr + o_c * dim + o_d, b_acc, mask=m_u & m_d & ~single)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def pool_forward_triton(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mode: PoolingMode,
    out: torch.Tensor,
    batch_size: int,
    col_offsets: torch.Tensor,
) -> torch.Tensor | None:
    """Triton twin of `spec.pool_forward_ref` (same arguments and results)."""
    num_bags = offsets.numel() - 1
    argmax = None
    if mode == PoolingMode.MAX:
        argmax = torch.empty(num_bags, dim, dtype=torch.int64, device=rows.device)
    if num_bags == 0:
        return argmax
    block_n, block_d = tile_blocks(dim)
    grid = (num_bags, triton.cdiv(dim, block_d))
    _pool_forward_kernel[grid](
        rows,
        slots,
        inverse,
        offsets,
        per_sample_weights if per_sample_weights is not None else rows,
        col_offsets,
        out,
        argmax if argmax is not None else offsets,
        batch_size,
        dim,
        rows.stride(0),
        rows.stride(1),
        out.stride(0),
        out.stride(1),
        MODE=int(mode),
        HAS_WEIGHTS=per_sample_weights is not None,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return argmax


def pool_backward_triton(
    grad_out: torch.Tensor,
    dim: int,
    inverse: torch.Tensor,
    num_unique: int,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    mode: PoolingMode,
    batch_size: int,
    col_offsets: torch.Tensor,
    argmax: torch.Tensor | None,
    grouping: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of `spec.pool_backward_ref`: value positions grouped by unique id
    (``grouping``, the dedup's stable order and runs, else a stable sort of ``inverse``), then
    each id's values summed in chunks (`split_segments`; each value's bag found in the
    kernel) and the chunk sums in order: two launches with a grouping. ``out``: the
    ``[U, dim]`` float32 rows to write (contiguous), else new ones."""
    device = grad_out.device
    nnz = inverse.numel()
    grad_unique = out
    if grad_unique is None:
        grad_unique = torch.empty(num_unique, dim, dtype=torch.float32, device=device)
    if num_unique == 0:
        return grad_unique
    if grouping is not None:
        order, segment_starts = grouping
    else:
        sorted_inverse, order = torch.sort(inverse, stable=True)
        segment_starts = torch.searchsorted(
            sorted_inverse, torch.arange(num_unique + 1, dtype=torch.int64, device=device)
        )  # [U + 1]
    num_bags = offsets.numel() - 1
    block_n, block_d = tile_blocks(dim)
    # A hot id's values are cut into chunks, summed side by side, then in chunk order.
    chunk, num_chunks, search_steps = split_segments(segment_starts, nnz, block_n)
    partial = torch.empty(num_chunks, dim, dtype=torch.float32, device=device)
    # One chunk (or id) per program on a GPU; the interpreter pays per program: wide ones.
    block_u = 1 if device.type == "cuda" else 64
    grid = (triton.cdiv(num_chunks, block_u), triton.cdiv(dim, block_d))
    _pool_backward_kernel[grid](
        grad_out,
        order,
        segment_starts,
        offsets,
        per_sample_weights if per_sample_weights is not None else grad_out,
        col_offsets,
        argmax if argmax is not None else offsets,
        grad_unique,
        partial,
        num_chunks,
        num_unique,
        search_steps,
        num_bags,
        (num_bags + 1).bit_length(),
        batch_size,
        dim,
        grad_out.stride(0),
        grad_out.stride(1),
        MODE=int(mode),
        HAS_WEIGHTS=per_sample_weights is not None,
        CHUNK=chunk,
        BLOCK_U=block_u,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    add_chunk_sums(partial, segment_starts, grad_unique, num_unique, dim, chunk, block_u, block_d)
    return grad_unique


# ----------------------------------------------------------------------------------------------
# the implementation
# ----------------------------------------------------------------------------------------------


class TritonPooling(SpecPooling):
    """The pooling family on the Triton kernels (`PoolingOps`): `SpecPooling`'s checks, then
    the launchers above."""

    name = "triton"

    def _pool_forward(
        self,
        rows: torch.Tensor,
        dim: int,
        slots: torch.Tensor,
        inverse: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        mode: PoolingMode,
        out: torch.Tensor,
        batch_size: int,
        col_offsets: torch.Tensor,
        col_start: int | None,
    ) -> torch.Tensor | None:
        del col_start  # the kernel reads ``col_offsets`` on the device
        return pool_forward_triton(
            rows, dim, slots, inverse, offsets, per_sample_weights, mode, out, batch_size,
            col_offsets,
        )  # fmt: skip

    def _pool_backward(
        self,
        grad_out: torch.Tensor,
        dim: int,
        inverse: torch.Tensor,
        num_unique: int,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        mode: PoolingMode,
        batch_size: int,
        col_offsets: torch.Tensor,
        argmax: torch.Tensor | None,
        grouping: tuple[torch.Tensor, torch.Tensor] | None,
        col_start: int | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        del col_start  # the kernel reads ``col_offsets`` on the device
        return pool_backward_triton(
            grad_out, dim, inverse, num_unique, offsets, per_sample_weights, mode, batch_size,
            col_offsets, argmax, grouping, out,
        )  # fmt: skip


IMPLEMENTATION: PoolingOps = TritonPooling()  # checked against the protocol
