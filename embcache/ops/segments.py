"""The segment sums that the pooling, gather and update families' Triton backwards share: each
unique id's values, grouped (a stable sort by id, or the dedup's grouping), cut into chunks of
a few tiles that programs sum side by side, then each id's chunk sums added in chunk order
(`split_segments`, `chunk_span`, `chunk_sum_kernel`), and the tile sizes of the row kernels
(`tile_blocks`). No float atomics: the same inputs give the same bits on every run.

A neutral home, as `embcache.hashing` is the id hash's: no family's implementation, so any
family's ``triton.py`` imports it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import embcache.ops.interpreter  # noqa: F401  (the interpreter runs these kernels)

# Tiles (of BLOCK_N values) in one chunk of an id's values in a backward: an id with more
# values than that is summed by several programs, then their partial sums in order.
_CHUNK_TILES = 4


@triton.jit
def chunk_span(segment_starts_ptr, o_c, num_chunks, num_unique, search_steps, CHUNK: tl.constexpr):
    """Chunk ``o_c`` of `split_segments`' cut: ``(u, m_u, start, end, single)``, its unique
    id, whether it is a real chunk (not past the last), the span ``[start, end)`` of the
    grouped order it sums, and whether it is its id's only chunk (its sum is then the id's).
    Its id is found by a binary search (``search_steps`` halvings, the bit length of
    ``num_unique``) of the ids' first chunks, which grow with u. Shared by the three
    segment-sum kernels (`ops.pooling.triton`'s, `ops.gather.triton`'s and
    `kernels.optim`'s)."""
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


def add_chunk_sums(
    partial: torch.Tensor,
    segment_starts: torch.Tensor,
    grad_unique: torch.Tensor,
    num_unique: int,
    dim: int,
    chunk: int,
    block_u: int,
    block_d: int,
) -> None:
    """Launch `chunk_sum_kernel`: each id of several chunks gets its chunks' sums from
    ``partial`` added in chunk order into ``grad_unique`` (the second pass of the pooling, gather
    and optimizer segment sums)."""
    grid = (triton.cdiv(num_unique, block_u), triton.cdiv(dim, block_d))
    chunk_sum_kernel[grid](
        partial, segment_starts, grad_unique, num_unique, dim, CHUNK=chunk, BLOCK_U=block_u,
        BLOCK_D=block_d,
    )  # fmt: skip


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
