"""Unpooled gather: one cache row per value (sequence embeddings), and its gradient -> one row
per unique id.

The forward reads rows straight from the cache slots: value j of a batch gets the row
``out[j] = rows[slots[inverse[j]], :dim]``, float32, float16 or bfloat16 rows stored as float32;
a negative slot (an id the cache has not admitted) reads as a row of zeros. Nothing is pooled:
``out`` is ``[nnz, dim]``, the values in batch order, for a sequence model to consume (a
KeyedJaggedTensor's values, one table per call).

The backward sums, per unique id u, the gradient rows of every value j with ``inverse[j] == u``
(an id that occurs k times in the batch collects k rows), in float32. It is deterministic:
value positions are stably sorted by unique id (or taken from `ids.dedup_grouped`'s grouping
when the caller has it), each id's segment is cut into fixed-size chunks summed by separate
programs (a hot id's side by side), and the chunk sums of an id of several are added in chunk
order, so the same inputs give the same bits on every run; no float atomics, and nothing of
table size is allocated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from embcache.kernels import gather_ref
from embcache.kernels.backend import use_triton
from embcache.kernels.checks import as_index, check_int, require
from embcache.kernels.pooling import chunk_span, chunk_sum_kernel, split_segments, tile_blocks

_ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

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
    u, ascending, cut into chunks of at most CHUNK values (`pooling.split_segments`), so a hot id's
    values are summed by many programs side by side. A chunk's rows are read BLOCK_N at a time
    in that order, each tile reduced by ``tl.sum`` (a fixed tree for given block sizes) into an
    fp32 running sum. An id of one chunk gets its sum stored in ``grad_unique[u]`` (zeros for
    an empty segment); the chunks of a longer id store theirs in ``partial[c]``, which
    `pooling.chunk_sum_kernel` adds up in chunk order. The order of every addition depends
    only on the inputs and the block sizes, so every run gives the same bits.
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
    """Triton twin of `gather_ref.gather_rows_ref` (same arguments and result)."""
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
    """Triton twin of `gather_ref.gather_backward_ref`: stable sort by unique id (or the
    caller's grouping, which is that very order), then each id's values summed in chunks
    (`pooling.split_segments`) and the chunk sums in order."""
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
    grid = (triton.cdiv(num_unique, block_u), triton.cdiv(dim, block_d))
    chunk_sum_kernel[grid](
        partial,
        segment_starts,
        grad_unique,
        num_unique,
        dim,
        CHUNK=chunk,
        BLOCK_U=block_u,
        BLOCK_D=block_d,
    )
    return grad_unique


# ----------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------


def gather_rows(
    rows: torch.Tensor,
    dim: int,
    slots: torch.Tensor,
    inverse: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One cache row per value: ``out[j] = rows[slots[inverse[j]], :dim]`` as float32.

    Example: a batch whose values hold ids ``[7, 3, 7]`` dedups to ``unique = [3, 7]``,
    ``inverse = [1, 0, 1]``; with ``slots = [12, -1]`` (id 3 in cache row 12, id 7 not
    admitted) the output is ``[0, rows[12, :dim], 0]``.

    Args:
        rows: ``[R, W]`` float32, float16 or bfloat16, ``W >= dim``, the cache rows (may be a
            strided view).
        dim: embedding dim of this table; columns ``[0, dim)`` of a row are read.
        slots: int64 or int32 ``[U]``, cache row of each unique id; a negative slot reads as a
            row of zeros.
        inverse: int64 or int32 ``[nnz]``, unique index of each value, in ``[0, U)`` (not
            checked: that would cost a device sync).
        out: float32 ``[nnz, dim]``, contiguous, on the rows' device: written in place when
            given; allocated otherwise.

    Returns:
        float32 ``[nnz, dim]``: ``out`` when given.
    """
    if not isinstance(rows, torch.Tensor) or rows.dtype not in _ROW_DTYPES or rows.dim() != 2:
        raise TypeError("rows must be a float32, float16 or bfloat16 [R, W] tensor")
    device = rows.device
    check_int("dim", dim, 1, rows.shape[1])
    slots = as_index("slots", slots, device)
    inverse = as_index("inverse", inverse, device)
    nnz = inverse.numel()
    if out is None:
        out = torch.empty(nnz, dim, dtype=torch.float32, device=device)
    else:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 2:
            raise TypeError("out must be a float32 [nnz, dim] tensor")
        require(out.device == device, f"out is on {out.device}, rows on {device}")
        require(
            tuple(out.shape) == (nnz, dim),
            f"out has shape {tuple(out.shape)}, expected (nnz, dim) = ({nnz}, {dim})",
        )
        require(out.is_contiguous(), "out must be contiguous")
    if use_triton(rows):
        return gather_rows_triton(rows, dim, slots, inverse, out)
    return gather_ref.gather_rows_ref(rows, dim, slots, inverse, out)


def gather_backward(
    grad_out: torch.Tensor,
    inverse: torch.Tensor,
    num_unique: int,
    grouping: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Gradient of each unique row from the gradient of `gather_rows`'s output; deterministic.

    Args:
        grad_out: ``[nnz, dim]`` of any float dtype and any strides, the gradient of the loss
            w.r.t. ``out``; converted to float32.
        inverse: int64 or int32 ``[nnz]``, unique index of each value, in ``[0, num_unique)``
            (not checked: that would cost a device sync).
        num_unique: U.
        grouping: optional ``(order, segments)`` from `ids.dedup_grouped` over these values
            (``order`` int64 ``[nnz]``: positions sorted by id, ascending within an id;
            ``segments`` int64 ``[U + 1]``): the very grouping that both paths otherwise find
            by a stable sort of ``inverse``, which they then skip. Same result, bit for bit.

    Returns:
        float32 ``[U, dim]``: row u sums ``grad_out[j]`` over every j with ``inverse[j] == u``
        (zeros for an id with no value). No float atomics on either path: the same inputs
        give the same bits.
    """
    if not isinstance(grad_out, torch.Tensor) or not grad_out.is_floating_point():
        raise TypeError("grad_out must be a floating-point [nnz, dim] tensor")
    if grad_out.dim() != 2:
        raise ValueError(f"grad_out must be 2-D [nnz, dim], got shape {tuple(grad_out.shape)}")
    device = grad_out.device
    check_int("num_unique", num_unique, 0)
    inverse = as_index("inverse", inverse, device)
    require(
        grad_out.shape[0] == inverse.numel(),
        f"grad_out has {grad_out.shape[0]} rows, expected one per value: "
        f"inverse.numel() = {inverse.numel()}",
    )
    if grouping is not None:
        if not isinstance(grouping, tuple) or len(grouping) != 2:
            raise TypeError("grouping must be a tuple (order, segments) or None")
        order = as_index("grouping order", grouping[0], device)
        segments = as_index("grouping segments", grouping[1], device)
        require(
            order.numel() == inverse.numel() and segments.numel() == num_unique + 1,
            f"grouping covers {order.numel()} values and {segments.numel() - 1} ids, expected "
            f"{inverse.numel()} and {num_unique}",
        )
        grouping = (order, segments)
    if grad_out.dtype != torch.float32:
        grad_out = grad_out.to(torch.float32)
    if use_triton(grad_out):
        return gather_backward_triton(grad_out, inverse, num_unique, grouping)
    return gather_ref.gather_backward_ref(grad_out, inverse, num_unique, grouping)
