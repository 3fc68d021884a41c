"""The gather family's Triton kernels: one cache row per value, and the backward's segment
sums, one gradient row per unique id (`ops.segments`: a hot id's chunks side by side, then in
chunk order).

Layout follows Liger-Kernel: kernels, then launchers (check, allocate, launch), then
`TritonGather`, the family's implementation over them (`GatherOps`). Each kernel's torch twin is
in `ops.gather.spec`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import embcache.ops.interpreter  # noqa: F401  (the interpreter runs these kernels)
from embcache.ops.gather import GatherOps
from embcache.ops.gather.spec import SpecGather
from embcache.ops.segments import add_chunk_sums, chunk_span, split_segments, tile_blocks

# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["nnz"])  # per-batch values: one variant
def _gather_rows_kernel(
    rows_ptr,
    slots_ptr,
    inverse_ptr,
    out_ptr,
    nnz,
    dim,
    stride_row,
    stride_row_col,
    stride_out_n,
    stride_out_col,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """BLOCK_N values, BLOCK_D columns: ``out[j, d] = rows[slots[inverse[j]], d]`` in fp32.

    Rows of any float dtype; a slot < 0 is a zero row (its load is masked off, never read).
    """
    i_n = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_n = o_n < nnz
    m_d = o_d < dim
    b_unique = tl.load(inverse_ptr + o_n, mask=m_n, other=0)  # [BLOCK_N]
    b_slot = tl.load(slots_ptr + b_unique, mask=m_n, other=-1).to(tl.int64)  # [BLOCK_N]
    m_x = m_n[:, None] & m_d[None, :]  # [BLOCK_N, BLOCK_D]
    p_x = rows_ptr + b_slot[:, None] * stride_row + o_d[None, :] * stride_row_col
    b_x = tl.load(p_x, mask=m_x & (b_slot >= 0)[:, None], other=0.0).to(tl.float32)
    p_out = out_ptr + o_n[:, None] * stride_out_n + o_d[None, :] * stride_out_col
    tl.store(p_out, b_x, mask=m_x)


@triton.jit(
    do_not_specialize=["num_chunks", "num_unique", "search_steps"]
)  # per-batch values: one variant
def _gather_backward_kernel(
    grad_out_ptr,
    order_ptr,
    segment_starts_ptr,
    grad_unique_ptr,
    partial_ptr,
    num_chunks,
    num_unique,
    search_steps,
    dim,
    stride_grad_n,
    stride_grad_col,
    CHUNK: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """BLOCK_U chunks, BLOCK_D columns: the part of ``grad_unique[u] = Σ_{j: inverse[j] = u}
    grad_out[j]`` over one chunk of at most CHUNK of u's values.

    ``order[segment_starts[u] : segment_starts[u + 1]]`` are the value positions j of unique id
    u, ascending, cut into chunks of at most CHUNK values (`ops.segments.split_segments`), so
    a hot id's values are summed by many programs side by side. A chunk's rows are read BLOCK_N
    at a time in that order, each tile reduced by ``tl.sum`` (a fixed tree for given block
    sizes) into an fp32 running sum. An id of one chunk gets its sum stored in
    ``grad_unique[u]`` (zeros for an empty segment); the chunks of a longer id store theirs in
    ``partial[c]``, which `ops.segments.chunk_sum_kernel` adds up in chunk order. The order of
    every addition depends only on the inputs and the block sizes, so every run gives the same
    bits.
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
            b_j = tl.load(order_ptr + o_n, mask=m_n, other=0).to(tl.int64)  # [BLOCK_N]
            m_g = m_n[:, None] & m_d[None, :]  # [BLOCK_N, BLOCK_D]
            p_g = grad_out_ptr + b_j[:, None] * stride_grad_n + o_d[None, :] * stride_grad_col
            b_g = tl.load(p_g, mask=m_g, other=0.0)  # [BLOCK_N, BLOCK_D]
            b_acc += tl.sum(b_g, axis=0)
        tl.store(grad_unique_ptr + u * dim + o_d, b_acc, mask=m_u & m_d & single)
        tl.store(partial_ptr + o_c * dim + o_d, b_acc, mask=m_u & m_d & ~single)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def gather_rows_triton(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    inverse: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Triton twin of `spec.gather_rows_ref` (same arguments and result)."""
    nnz = inverse.numel()
    if nnz == 0:
        return out
    block_n, block_d = tile_blocks(dim)
    grid = (triton.cdiv(nnz, block_n), triton.cdiv(dim, block_d))
    _gather_rows_kernel[grid](
        rows,
        slots,
        inverse,
        out,
        nnz,
        dim,
        rows.stride(0),
        rows.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    return out


def gather_backward_triton(
    grad_out: torch.Tensor,
    inverse: torch.Tensor,
    num_unique: int,
    grouping: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Triton twin of `spec.gather_backward_ref`: stable sort by unique id (or the
    caller's grouping, which is that very order), then each id's values summed in chunks
    (`ops.segments.split_segments`) and the chunk sums in order."""
    device = grad_out.device
    nnz, dim = grad_out.shape
    grad_unique = torch.empty(num_unique, dim, dtype=torch.float32, device=device)
    if num_unique == 0:
        return grad_unique
    if nnz == 0:
        return grad_unique.zero_()
    if grouping is not None:
        order, segment_starts = grouping
    else:
        sorted_inverse, order = torch.sort(inverse, stable=True)
        segment_starts = torch.searchsorted(
            sorted_inverse, torch.arange(num_unique + 1, dtype=torch.int64, device=device)
        )  # [U + 1]
    block_n, block_d = tile_blocks(dim)
    # A hot id's values are cut into chunks, summed side by side, then in chunk order.
    chunk, num_chunks, search_steps = split_segments(segment_starts, nnz, block_n)
    partial = torch.empty(num_chunks, dim, dtype=torch.float32, device=device)
    # One chunk (or id) per program on a GPU; the interpreter pays per program: wide ones.
    block_u = 1 if device.type == "cuda" else 64
    grid = (triton.cdiv(num_chunks, block_u), triton.cdiv(dim, block_d))
    _gather_backward_kernel[grid](
        grad_out,
        order,
        segment_starts,
        grad_unique,
        partial,
        num_chunks,
        num_unique,
        search_steps,
        dim,
        grad_out.stride(0),
        grad_out.stride(1),
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


class TritonGather(SpecGather):
    """The gather family on the Triton kernels (`GatherOps`): `SpecGather`'s checks, then the
    launchers above."""

    name = "triton"

    def _gather_rows(
        self,
        rows: torch.Tensor,
        dim: int,
        slots: torch.Tensor,
        inverse: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        return gather_rows_triton(rows, dim, slots, inverse, out)

    def _gather_backward(
        self,
        grad_out: torch.Tensor,
        inverse: torch.Tensor,
        num_unique: int,
        grouping: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        return gather_backward_triton(grad_out, inverse, num_unique, grouping)


IMPLEMENTATION: GatherOps = TritonGather()  # checked against the protocol
