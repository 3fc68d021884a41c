"""Pooling: bags of cache rows -> pooled output, and its gradient -> one row per unique id.

The forward reads rows straight from the cache slots: value j of a batch is the row
``rows[slots[inverse[j]], :dim]``, float32, float16 or bfloat16, accumulated in float32; a
negative slot (an id the cache has not admitted) reads as a row of zeros. Bags are
feature-major: bag ``q = i * B + b`` is feature i of sample b and writes
``out[b, col_offsets[i] : col_offsets[i] + dim]``, so tables of different dims fill one
``[B, sum(dims)]`` output, one call per table.

Modes, with per-sample weights ``w_j`` (1 when absent) over the values j of a bag of length L:

* SUM: ``Σ w_j x_j``.
* MEAN: ``Σ w_j x_j / L``. Weighted MEAN divides by the bag length, not by ``Σ w_j``: the same
  as a weighted SUM scaled by ``1 / L``, which is what FBGEMM's TBE computes.
* MAX: the elementwise ``max_j w_j x_j``. The forward also returns, per bag and column, the
  first value index j reaching the max; the backward routes that column's gradient to it alone.

An empty bag gives zeros in every mode.

The backward is deterministic: value positions are stably sorted by unique id and each id's
values are cut into chunks of a few tiles (`split_segments`); a program sums one chunk, so a
hot id's chunks run side by side instead of one program walking them all, and the chunk sums
of an id are then added in chunk order. The same inputs give the same bits on every run; no
float atomics, no host read, and nothing of table size is allocated.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

from embcache.kernels import pooling_ref
from embcache.kernels.backend import use_triton
from embcache.kernels.checks import as_index, require

_ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Tiles (of BLOCK_N values) in one chunk of an id's values in the backward: an id with more
# values than that is summed by several programs, then their partial sums in order.
_CHUNK_TILES = 4


class PoolingMode(enum.IntEnum):
    """How a bag's rows are reduced (values match torch's ``embedding_bag`` modes)."""

    SUM = pooling_ref.POOL_SUM
    MEAN = pooling_ref.POOL_MEAN
    MAX = pooling_ref.POOL_MAX


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


@triton.jit
def chunk_span(segment_starts_ptr, o_c, num_chunks, num_unique, search_steps, CHUNK: tl.constexpr):
    """Chunk ``o_c`` of `split_segments`' cut: ``(u, m_u, start, end, single)``, its unique
    id, whether it is a real chunk (not past the last), the span ``[start, end)`` of the
    grouped order it sums, and whether it is its id's only chunk (its sum is then the id's).
    Its id is found by a binary search (``search_steps`` halvings, the bit length of
    ``num_unique``) of the ids' first chunks, which grow with u. Shared by the three
    segment-sum kernels (`_pool_backward_kernel`, `gather._gather_backward_kernel`,
    `optim._segment_sum_kernel`)."""
    m_u = o_c < num_chunks
    lo = tl.zeros((), dtype=tl.int64)
    hi = tl.zeros((), dtype=tl.int64) + num_unique
    for _ in range(search_steps):  # the last u whose first chunk is <= o_c: lo ends past it
        open_ = lo < hi
        mid = (lo + hi) >> 1
        first_mid = mid + tl.load(segment_starts_ptr + mid, mask=m_u & open_, other=0) // CHUNK
        right = open_ & (first_mid <= o_c)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(open_ & (first_mid > o_c), mid, hi)
    u = tl.where(m_u, lo - 1, num_unique)
    m_u = m_u & (u >= 0) & (u < num_unique)
    seg_start = tl.load(segment_starts_ptr + u, mask=m_u, other=0)
    seg_end = tl.load(segment_starts_ptr + u + 1, mask=m_u, other=0)
    block = o_c - u  # id u's chunks begin at u + seg_start // CHUNK, at that aligned block
    start = tl.maximum(seg_start, block * CHUNK)
    end = tl.minimum(seg_end, (block + 1) * CHUNK)
    single = seg_end // CHUNK == seg_start // CHUNK
    return u, m_u, start, tl.maximum(start, end), single


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
    ascending, cut into chunks of at most CHUNK values (`split_segments`, `chunk_span`). So a
    hot id's values are summed by many programs side by side instead of one walking them all.
    An id of one
    chunk gets its sum stored in ``grad_unique[u]``; the chunks of a longer id store theirs in
    ``partial[c]``, which `chunk_sum_kernel` adds up in chunk order. ``s_j`` is ``w_j`` (SUM),
    ``w_j / L`` (MEAN) or ``w_j [argmax[bag, d] == j]`` (MAX). Every sum runs in a fixed order,
    so the result is bit-reproducible. Accumulates in fp32.
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


@triton.jit(do_not_specialize=["num_unique"])  # per batch: one variant
def chunk_sum_kernel(
    partial_ptr,
    segment_starts_ptr,
    grad_unique_ptr,
    num_unique,
    dim,
    CHUNK: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``grad_unique[u] = Σ partial[c]`` over id u's chunks in `split_segments`' cut, in
    chunk order, for the ids of more than one chunk (the others are already stored)."""
    i_u = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1).to(tl.int64)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    m_d = o_d < dim
    for k in range(BLOCK_U):
        o_u = i_u * BLOCK_U + k
        m_u = o_u < num_unique
        first = o_u + tl.load(segment_starts_ptr + o_u, mask=m_u, other=0) // CHUNK
        last = o_u + 1 + tl.load(segment_starts_ptr + o_u + 1, mask=m_u, other=0) // CHUNK
        many = last - first > 1
        last = tl.where(many, last, first)  # an id of one chunk: nothing to add
        b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for c in range(first, last):
            b_acc += tl.load(partial_ptr + c * dim + o_d, mask=m_d, other=0.0)
        tl.store(grad_unique_ptr + o_u * dim + o_d, b_acc, mask=m_u & m_d & many)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def tile_blocks(dim: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_D): up to 256 columns a program, about 4096 elements a tile (the
    pooling and gather launchers')."""
    block_d = min(max(triton.next_power_of_2(dim), 16), 256)
    block_n = min(max(4096 // block_d, 1), 64)
    return block_n, block_d


def split_segments(segment_starts: torch.Tensor, nnz: int, block_n: int) -> tuple[int, int, int]:
    """How `chunk_span` cuts each unique id's values into chunks of at most `_CHUNK_TILES`
    tiles of ``block_n`` values, computed on the host from sizes alone: no launch, no read.

    The segment-sum backwards (pooling's, the gather's, the optimizer's `aggregate_grads`) give
    each chunk its own program, so a hot id's chunks are summed side by side; then
    `chunk_sum_kernel` adds the chunk sums of each id of several, in chunk order. The cut is
    at the multiples of CHUNK in the grouped order: id u, whose values are positions
    ``[s_u, s_{u+1})``, has the ``1 + s_{u+1} // CHUNK - s_u // CHUNK`` pieces between them
    (the last one empty when ``s_{u+1}`` is a multiple of CHUNK), so its first chunk is
    ``u + s_u // CHUNK`` and there are ``U + nnz // CHUNK`` chunks in all,
    with no scan over the ids.

    Args:
        segment_starts: int64 or int32 ``[U + 1]``, ``segment_starts[0] = 0``: id u's values
            are positions ``[segment_starts[u], segment_starts[u + 1])`` of the grouped order.
        nnz: the number of values, ``segment_starts[U]``.
        block_n: values per tile, the kernel's BLOCK_N.

    Returns:
        ``(chunk, num_chunks, search_steps)``: values per chunk (the kernels' CHUNK), the
        number of chunks, and the halvings of `chunk_span`'s search (the bit length of U).
    """
    chunk = block_n * _CHUNK_TILES
    num_unique = segment_starts.numel() - 1
    return chunk, num_unique + nnz // chunk, num_unique.bit_length()


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
    """Triton twin of `pooling_ref.pool_forward_ref` (same arguments and results)."""
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
    """Triton twin of `pooling_ref.pool_backward_ref`: value positions grouped by unique id
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


def _check_bags(
    inverse: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    batch_size: int,
    col_offsets: torch.Tensor,
) -> None:
    num_features = col_offsets.numel()
    require(batch_size >= 0, f"batch_size={batch_size} must be >= 0")
    require(
        offsets.numel() == num_features * batch_size + 1,
        f"offsets has {offsets.numel()} entries, expected F * B + 1 = "
        f"{num_features} * {batch_size} + 1 for F = col_offsets.numel()",
    )
    if per_sample_weights is not None:
        if per_sample_weights.dtype != torch.float32:
            raise TypeError(f"per_sample_weights must be float32, got {per_sample_weights.dtype}")
        require(
            per_sample_weights.shape == inverse.shape,
            f"per_sample_weights has shape {tuple(per_sample_weights.shape)}, "
            f"expected {tuple(inverse.shape)} like inverse",
        )
        require(
            per_sample_weights.device == inverse.device,
            f"per_sample_weights is on {per_sample_weights.device}, expected {inverse.device}",
        )


def pool_forward(
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
    col_start: int | None = None,
) -> torch.Tensor | None:
    """Pool F * B bags of cache rows into their columns of ``out``, in place.

    Example: a table of dim 4 with features f0, f1 at columns 0 and 4 of an ``out`` of
    ``[B, 12]``, and a table of dim 4 for f2 at column 8: two calls fill the whole output.

    Args:
        rows: ``[R, W]`` float32, float16 or bfloat16, ``W >= dim``, the cache rows (may be a
            strided view); pooled in float32.
        dim: embedding dim of this table; columns ``[0, dim)`` of a row are read.
        slots: int64 ``[U]``, cache row of each unique id; -1 reads as a row of zeros.
        inverse: int64 ``[nnz]``, unique index of each value.
        offsets: int64 ``[F * B + 1]``, CSR over bags, feature-major (bag ``i * B + b``).
        per_sample_weights: float32 ``[nnz]`` or None.
        mode: `PoolingMode` (SUM, MEAN: weighted sum over bag length, MAX).
        out: float32 ``[B, C]``; bag ``i * B + b`` writes every element of
            ``out[b, col_offsets[i] : col_offsets[i] + dim]`` (zeros for an empty bag).
        batch_size: B.
        col_offsets: int64 ``[F]``, first column of each feature in ``out``.
        col_start: when the caller knows that ``col_offsets`` is ``col_start + dim *
            arange(F)`` (features side by side), that start: the torch twin then writes the
            block without reading ``col_offsets`` on the host (a device sync). Not checked.

    Returns:
        MAX: int64 ``[F * B, dim]``, the value index j giving each bag's max per column (-1 for
        an empty bag), to pass to `pool_backward`. Triton gives the first such j; the torch twin
        the first j holding the row that ``embedding_bag`` picked, which differs only when two
        different rows tie exactly. Otherwise None.
    """
    mode = PoolingMode(mode)
    if not isinstance(rows, torch.Tensor) or rows.dtype not in _ROW_DTYPES or rows.dim() != 2:
        raise TypeError("rows must be a float32, float16 or bfloat16 [R, W] tensor")
    device = rows.device
    require(1 <= dim <= rows.shape[1], f"dim={dim} must be in [1, {rows.shape[1]}] (row width)")
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 2:
        raise TypeError("out must be a float32 [B, C] tensor")
    require(out.device == device, f"out is on {out.device}, rows on {device}")
    require(out.shape[0] == batch_size, f"out has {out.shape[0]} rows, batch_size={batch_size}")
    slots = as_index("slots", slots, device)
    inverse = as_index("inverse", inverse, device)
    offsets = as_index("offsets", offsets, device)
    col_offsets = as_index("col_offsets", col_offsets, device)
    _check_bags(inverse, offsets, per_sample_weights, batch_size, col_offsets)
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights.contiguous()
    args = (rows, dim, slots, inverse, offsets, per_sample_weights, mode, out, batch_size)
    if use_triton(rows):
        return pool_forward_triton(*args, col_offsets)
    return pooling_ref.pool_forward_ref(*args, col_offsets, col_start)


def pool_backward(
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
    col_start: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient of each unique row from the gradient of the pooled output; deterministic.

    Args:
        grad_out: float32 ``[B, C]``, gradient of the loss w.r.t. ``out`` of `pool_forward`.
        dim: embedding dim of this table.
        inverse: int64 ``[nnz]``, unique index of each value, in ``[0, num_unique)``.
        num_unique: U.
        offsets: int64 ``[F * B + 1]``, as in the forward.
        per_sample_weights: float32 ``[nnz]`` or None, as in the forward.
        mode: `PoolingMode`, as in the forward.
        batch_size: B.
        col_offsets: int64 ``[F]``, as in the forward.
        argmax: int64 ``[F * B, dim]`` returned by the forward for MAX; None otherwise.
        grouping: optional ``(order, segments)`` from `ids.dedup_grouped` over these values;
            the CPU path then sums each id's rows in one pass (same result).
        col_start: as in `pool_forward`.
        out: float32 ``[U, dim]``, contiguous: where to write the result (e.g. a view of one
            buffer for several caches' rows), else a new tensor.

    Returns:
        float32 ``[U, dim]`` (``out`` when given): row u sums the gradients of every
        occurrence of unique id u (for MAX, only of the occurrences that won their bag's
        column).
    """
    mode = PoolingMode(mode)
    if not isinstance(grad_out, torch.Tensor) or grad_out.dim() != 2:
        raise TypeError("grad_out must be a float32 [B, C] tensor")
    if grad_out.dtype != torch.float32:
        grad_out = grad_out.to(torch.float32)
    device = grad_out.device
    require(dim >= 1, f"dim={dim} must be >= 1")
    require(num_unique >= 0, f"num_unique={num_unique} must be >= 0")
    require(
        grad_out.shape[0] == batch_size,
        f"grad_out has {grad_out.shape[0]} rows, batch_size={batch_size}",
    )
    inverse = as_index("inverse", inverse, device)
    offsets = as_index("offsets", offsets, device)
    col_offsets = as_index("col_offsets", col_offsets, device)
    _check_bags(inverse, offsets, per_sample_weights, batch_size, col_offsets)
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights.contiguous()
    if mode == PoolingMode.MAX:
        num_bags = offsets.numel() - 1
        if argmax is None or tuple(argmax.shape) != (num_bags, dim):
            raise ValueError(
                f"MAX backward needs the forward's argmax of shape ({num_bags}, {dim})"
            )
        argmax = argmax.contiguous()
    else:
        argmax = None
    args = (grad_out, dim, inverse, num_unique, offsets, per_sample_weights, mode, batch_size)
    if grouping is not None:
        order, segments = grouping
        require(
            order.numel() == inverse.numel() and segments.numel() == num_unique + 1,
            f"grouping covers {order.numel()} values and {segments.numel() - 1} ids, expected "
            f"{inverse.numel()} and {num_unique}",
        )
    if out is not None:
        require(
            out.dtype == torch.float32
            and tuple(out.shape) == (num_unique, dim)
            and out.is_contiguous()
            and out.device == device,
            f"out must be a contiguous float32 [{num_unique}, {dim}] tensor on {device}",
        )
    if use_triton(grad_out):
        return pool_backward_triton(*args, col_offsets, argmax, grouping, out)
    grads = pooling_ref.pool_backward_ref(*args, col_offsets, argmax, grouping, col_start)
    return grads if out is None else out.copy_(grads)
