"""The ids family's Triton kernels: fuse (with the checks), unfuse, dedup, and the device
path's dedups of several caches at once (`dedup_together`, and the joint dedup:
`sort_and_mark`, then `scatter_joint`; `engine.joint` says how a collection uses them).

The fuse's check costs a single host sync on the good path: the kernel writes a per-value
verdict, one read brings back whether any is bad, and only a bad batch pays for finding and
naming the first offender. `IdsOps.fuse_ids_deferred` leaves that read to the caller
(`IdVerdict`), who makes it with a read of its own (a collection's forward: with its dedup's
sizes).

Dedup design: sort-based, not hash-based. The cache and the tests want the unique ids sorted
ascending (sets are resolved in id order, results are reproducible), so a hash table would still
need a sort of its U keys afterwards, plus a table sized to the batch and a CAS insertion loop
whose slot order depends on thread timing. A device radix sort (``torch.sort``, CUB on CUDA)
of the n ids is bandwidth-bound and deterministic; on the sorted ids two light Triton kernels
mark segment starts and scatter the unique ids, the inverse index and the segment starts,
from which the counts follow. The one host sync reads U, which sizes the outputs.

Each kernel's torch twin is in `ops.ids.spec`; `TritonIds` is the family's implementation
over these kernels (`IdsOps`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

import embcache.ops.interpreter  # noqa: F401  (the interpreter runs these kernels)
from embcache.ops.ids import IdsOps
from embcache.ops.ids.shared import (
    Deduped,
    IdVerdict,
    JointPlan,
    JointShares,
    Marked,
    joint_outputs,
)
from embcache.ops.ids.spec import SpecIds

_BLOCK_N = 1024


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["nnz"])  # per-batch values: one variant
def _fuse_ids_kernel(
    values_ptr,
    ends_ptr,
    table_idx_ptr,
    num_embeddings_ptr,
    fused_ptr,
    verdict_ptr,
    flags_ptr,
    nnz,
    num_features,
    search_steps,
    fusion_k,
    BLOCK_N: tl.constexpr,
):
    """``fused = id | (table << fusion_k)``; verdict 0 ok, 1 negative, 2 >= rows, 3 >= 2**k;
    and the batch's checks, raised (``atomic_max``) into ``flags`` (int64 ``[4]``, zeroed):
    a negative length, lengths that do not sum to ``nnz``, a table index out of range, a bad
    id (`IdVerdict`).

    Each value's feature is found by a binary search of ``ends`` (the lengths' running sums;
    ``search_steps`` halvings, the bit length of ``num_features``), the first feature whose
    end is past the value, the last one for values past every end (lengths that are wrong,
    which ``flags`` says). Program i also checks features ``[i * BLOCK_N, (i + 1) * BLOCK_N)``.

    An unbounded table's id (``num_embeddings < 0``) outside ``[0, 2**fusion_k)`` is folded:
    ``mix64(id) & (2**fusion_k - 1)`` (splitmix64's finaliser in uint64, as `set_index`), and
    always judged ok.
    """
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < nnz
    # The feature of each value: lo ends as the number of ends <= o_n.
    b_lo = tl.zeros((BLOCK_N,), dtype=tl.int64)
    b_hi = tl.zeros((BLOCK_N,), dtype=tl.int64) + num_features
    for _ in range(search_steps):
        m_open = m_n & (b_lo < b_hi)
        b_mid = (b_lo + b_hi) >> 1
        b_end = tl.load(ends_ptr + b_mid, mask=m_open, other=0)
        m_right = m_open & (b_end <= o_n)
        b_lo = tl.where(m_right, b_mid + 1, b_lo)
        b_hi = tl.where(m_open & (b_end > o_n), b_mid, b_hi)
    b_feat = tl.minimum(b_lo, num_features - 1)
    b_id = tl.load(values_ptr + o_n, mask=m_n, other=0).to(tl.int64)
    b_table = tl.load(table_idx_ptr + b_feat, mask=m_n, other=0)
    b_rows = tl.load(num_embeddings_ptr + b_feat, mask=m_n, other=-1)
    b_wide = (b_id >> fusion_k) != 0  # negative ids too
    b_z = b_id.to(tl.uint64, bitcast=True) + 0x9E3779B97F4A7C15
    b_z = (b_z ^ (b_z >> 30)) * 0xBF58476D1CE4E5B9
    b_z = (b_z ^ (b_z >> 27)) * 0x94D049BB133111EB
    b_z = b_z ^ (b_z >> 31)
    b_mask = (tl.full((), 1, tl.int64) << fusion_k) - 1
    b_folded = b_z.to(tl.int64, bitcast=True) & b_mask
    m_fold = (b_rows < 0) & b_wide
    b_id = tl.where(m_fold, b_folded, b_id)
    b_verdict = tl.where(
        b_rows < 0,
        0,
        tl.where(b_id < 0, 1, tl.where(b_id >= b_rows, 2, tl.where(b_wide, 3, 0))),
    )
    tl.store(fused_ptr + o_n, b_id | (b_table << fusion_k), mask=m_n)
    tl.store(verdict_ptr + o_n, b_verdict.to(tl.int8), mask=m_n)
    bad_id = tl.max(tl.where(m_n & (b_verdict != 0), 1, 0).to(tl.int64), axis=0)
    # This program's features: a negative length, a table index past 63 - fusion_k bits.
    m_f = o_n < num_features
    b_f_end = tl.load(ends_ptr + o_n, mask=m_f, other=0)
    b_f_start = tl.load(ends_ptr + o_n - 1, mask=m_f & (o_n > 0), other=0)
    b_f_table = tl.load(table_idx_ptr + o_n, mask=m_f, other=0)
    negative = tl.max(tl.where(m_f & (b_f_end < b_f_start), 1, 0).to(tl.int64), axis=0)
    m_bad_table = (b_f_table < 0) | ((b_f_table >> (63 - fusion_k)) != 0)
    bad_table = tl.max(tl.where(m_f & m_bad_table, 1, 0).to(tl.int64), axis=0)
    total = tl.load(ends_ptr + num_features - 1)
    wrong_total = tl.where((i_n == 0) & (total != nnz), 1, 0).to(tl.int64)
    tl.atomic_max(flags_ptr + 0, negative)
    tl.atomic_max(flags_ptr + 1, wrong_total)
    tl.atomic_max(flags_ptr + 2, bad_table)
    tl.atomic_max(flags_ptr + 3, bad_id)


@triton.jit(do_not_specialize=["n"])  # per-batch values: one variant
def _unfuse_ids_kernel(fused_ptr, table_idx_ptr, ids_ptr, n, fusion_k, BLOCK_N: tl.constexpr):
    """``table = fused >> fusion_k``, ``id = fused & (2**fusion_k - 1)``."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    b_fused = tl.load(fused_ptr + o_n, mask=m_n, other=0).to(tl.int64)
    b_mask = (tl.full((), 1, tl.int64) << fusion_k) - 1
    tl.store(table_idx_ptr + o_n, b_fused >> fusion_k, mask=m_n)
    tl.store(ids_ptr + o_n, b_fused & b_mask, mask=m_n)


@triton.jit(do_not_specialize=["n"])  # per-batch values: one variant
def _segment_starts_kernel(sorted_ptr, is_start_ptr, n, BLOCK_N: tl.constexpr):
    """``is_start[i] = i == 0 or sorted[i] != sorted[i - 1]``."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    m_prev = m_n & (o_n > 0)
    b_cur = tl.load(sorted_ptr + o_n, mask=m_n, other=0)
    b_prev = tl.load(sorted_ptr + o_n - 1, mask=m_prev, other=0)
    b_start = (o_n == 0) | (b_cur != b_prev)
    tl.store(is_start_ptr + o_n, b_start.to(tl.int32), mask=m_n)


@triton.jit(do_not_specialize=["n", "num_tables", "num_extra"])  # per batch: one variant
def _dedup_mark_kernel(
    sorted_ptr,
    is_start_ptr,
    table_starts_ptr,
    extra_ptr,
    read_ptr,
    extra_out_ptr,
    n,
    num_tables,
    num_extra,
    BLOCK_N: tl.constexpr,
):
    """`_segment_starts_kernel`, and the sizes a host read needs, added up (``atomic_add``,
    integers: the same sums whatever the order) into ``read`` (int64 ``[1 + num_tables]``,
    zeroed): ``read[0]``, the number of unique ids; ``read[1 + t]``, the unique ids below
    ``table_starts[t]``. Program 0 also copies ``extra`` (``[num_extra]``) to ``extra_out``,
    so that one read brings them too."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    m_prev = m_n & (o_n > 0)
    b_cur = tl.load(sorted_ptr + o_n, mask=m_n, other=0)
    b_prev = tl.load(sorted_ptr + o_n - 1, mask=m_prev, other=0)
    m_start = m_n & ((o_n == 0) | (b_cur != b_prev))
    tl.store(is_start_ptr + o_n, m_start.to(tl.int32), mask=m_n)
    tl.atomic_add(read_ptr, tl.sum(m_start.to(tl.int64), axis=0))
    for t in range(num_tables):
        first = tl.load(table_starts_ptr + t)
        below = tl.sum((m_start & (b_cur < first)).to(tl.int64), axis=0)
        tl.atomic_add(read_ptr + 1 + t, below)
    o_e = tl.arange(0, BLOCK_N)
    for e0 in range(0, num_extra, BLOCK_N):
        m_e = (i_n == 0) & (e0 + o_e < num_extra)
        b_e = tl.load(extra_ptr + e0 + o_e, mask=m_e, other=0)
        tl.store(extra_out_ptr + e0 + o_e, b_e, mask=m_e)


@triton.jit(do_not_specialize=["n"])  # per-batch values: one variant
def _dedup_scatter_kernel(
    sorted_ptr,
    order_ptr,
    is_start_ptr,
    seen_ptr,
    unique_ptr,
    inverse_ptr,
    starts_ptr,
    n,
    BLOCK_N: tl.constexpr,
):
    """With ``seen`` the running count of segment starts (inclusive) and ``s = seen[i] - 1``
    the segment of sorted position i: ``inverse[order[i]] = s``; at segment starts
    ``unique[s] = sorted[i]``, ``starts[s] = i``; and ``starts[U] = n`` (``U = seen[n - 1]``).
    """
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    b_id = tl.load(sorted_ptr + o_n, mask=m_n, other=0)
    b_pos = tl.load(order_ptr + o_n, mask=m_n, other=0)
    b_seg = tl.load(seen_ptr + o_n, mask=m_n, other=1) - 1
    m_start = m_n & (tl.load(is_start_ptr + o_n, mask=m_n, other=0) != 0)
    tl.store(inverse_ptr + b_pos, b_seg, mask=m_n)
    tl.store(unique_ptr + b_seg, b_id, mask=m_start)
    tl.store(starts_ptr + b_seg, o_n, mask=m_start)
    num_unique = tl.load(seen_ptr + n - 1)
    tl.store(starts_ptr + num_unique, n, mask=i_n == 0)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def _grid(n: int) -> tuple[int]:
    return (max(1, triton.cdiv(n, _BLOCK_N)),)


def fuse_ids_triton(
    values: torch.Tensor,
    ends: torch.Tensor,
    table_idx: torch.Tensor,
    num_embeddings: torch.Tensor,
    fusion_k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of `spec.fuse_ids_ref`, each value's feature found in the kernel from
    ``ends`` (int64 ``[F]``, F >= 1, the lengths' running sums), with the batch's checks:
    ``(fused, verdict, flags)``, ``flags`` as `IdVerdict`'s."""
    nnz = values.numel()
    num_features = ends.numel()
    device = values.device
    fused = torch.empty(nnz, dtype=torch.int64, device=device)
    verdict = torch.empty(nnz, dtype=torch.int8, device=device)
    flags = torch.zeros(4, dtype=torch.int64, device=device)
    grid = (max(1, triton.cdiv(max(nnz, num_features), _BLOCK_N)),)
    _fuse_ids_kernel[grid](
        values,
        ends,
        table_idx,
        num_embeddings,
        fused,
        verdict,
        flags,
        nnz,
        num_features,
        num_features.bit_length(),
        fusion_k,
        BLOCK_N=_BLOCK_N,
    )
    return fused, verdict, flags


def unfuse_ids_triton(fused: torch.Tensor, fusion_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `spec.unfuse_ids_ref`."""
    n = fused.numel()
    table_idx = torch.empty(n, dtype=torch.int64, device=fused.device)
    ids = torch.empty(n, dtype=torch.int64, device=fused.device)
    if n:
        _unfuse_ids_kernel[_grid(n)](fused, table_idx, ids, n, fusion_k, BLOCK_N=_BLOCK_N)
    return table_idx, ids


def dedup_triton(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of `spec.dedup_ref`: sort, mark segment starts, scatter."""
    n = ids.numel()
    device = ids.device
    if n == 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty.clone(), empty.clone()
    sorted_ids, order = torch.sort(ids.to(torch.int64), stable=True)
    is_start = torch.empty(n, dtype=torch.int32, device=device)
    _segment_starts_kernel[_grid(n)](sorted_ids, is_start, n, BLOCK_N=_BLOCK_N)
    seen = torch.cumsum(is_start, 0, dtype=torch.int64)  # [n] unique ids up to sorted[i]
    num_unique = int(seen[-1])  # the one host sync: U sizes the outputs
    unique_ids = torch.empty(num_unique, dtype=torch.int64, device=device)
    inverse = torch.empty(n, dtype=torch.int64, device=device)
    starts = torch.empty(num_unique + 1, dtype=torch.int64, device=device)
    _dedup_scatter_kernel[_grid(n)](
        sorted_ids, order, is_start, seen, unique_ids, inverse, starts, n, BLOCK_N=_BLOCK_N
    )
    return unique_ids, inverse, starts[1:] - starts[:-1]


def sort_and_mark(
    ids: torch.Tensor,
    starts: torch.Tensor | None,
    extra: torch.Tensor | None,
    read: torch.Tensor | None = None,
) -> Marked:
    """A stable sort of ``ids`` (int64 ``[n]``), one kernel marking its runs and adding up
    the runs below each of ``starts`` (int64, ascending: a table's first fused id) into
    ``read`` (zeroed here, or given: a slice of a buffer the caller reads whole), which also
    receives a copy of ``extra`` (int64) after those counts; and the runs' running count."""
    device = ids.device
    n = ids.numel()
    num_starts = 0 if starts is None else starts.numel()
    num_extra = 0 if extra is None else extra.numel()
    if read is None:
        read = torch.zeros(1 + num_starts + num_extra, dtype=torch.int64, device=device)
    ordered, order = torch.sort(ids.to(torch.int64), stable=True)
    is_start = torch.empty(n, dtype=torch.int32, device=device)
    _dedup_mark_kernel[_grid(n)](
        ordered,
        is_start,
        starts if starts is not None else read,
        extra.to(torch.int64) if extra is not None else read,
        read,
        read[1 + num_starts :] if num_extra else read,
        n,
        num_starts,
        num_extra,
        BLOCK_N=_BLOCK_N,
    )
    seen = torch.cumsum(is_start, 0, dtype=torch.int64)  # [n]
    return Marked(ordered, order, is_start, seen, read)


def dedup_together_triton(
    ids: list[torch.Tensor],
    table_starts: Sequence[torch.Tensor | None] | None = None,
    also_read: torch.Tensor | None = None,
) -> tuple[list[Deduped], list[int]]:
    """`dedup_together` on the device path: per cache `sort_and_mark` (a stable sort, one
    kernel marking its runs and adding up the sizes the host needs, their running count), and
    after the one read, one kernel writing the unique ids, the inverse and the runs' starts
    (`_dedup_scatter_kernel`): four launches a cache, plus one zeroed buffer that the read
    brings back whole (each cache's sizes and table bounds, ``also_read`` after the first's,
    copied in by its mark)."""
    device = ids[0].device
    tables = [0 if ts is None else ts.numel() for ts in (table_starts or [None] * len(ids))]
    extra = 0 if also_read is None else also_read.numel()
    read = torch.zeros(sum(tables) + len(ids) + extra, dtype=torch.int64, device=device)
    runs, at = [], 0
    for i, x in enumerate(ids):
        first = table_starts[i] if table_starts is not None else None
        size = 1 + tables[i] + (extra if i == 0 else 0)
        copy = also_read if i == 0 else None
        runs.append((sort_and_mark(x, first, copy, read[at : at + size]), at, tables[i]))
        at += size
    values = read.tolist()  # the one host read
    out = []
    for marked, at, num_tables in runs:
        num_unique, n = values[at], marked.ordered.numel()
        bounds = [*values[at + 1 : at + 1 + num_tables], num_unique] if num_tables else None
        unique = torch.empty(num_unique, dtype=torch.int64, device=device)
        inverse = torch.empty(n, dtype=torch.int64, device=device)
        starts = torch.empty(num_unique + 1, dtype=torch.int64, device=device)
        if n:
            _dedup_scatter_kernel[_grid(n)](
                marked.ordered,
                marked.order,
                marked.is_start,
                marked.seen,
                unique,
                inverse,
                starts,
                n,
                BLOCK_N=_BLOCK_N,
            )
        else:
            starts.zero_()
        out.append(Deduped(unique, inverse, bounds, marked.order, starts))
    return out, values[1 + tables[0] : 1 + tables[0] + extra] if ids else []


@triton.jit(do_not_specialize=["n", "num_bags", "batch_size", "search_steps"])  # per batch
def _joint_scatter_kernel(
    sorted_ptr,
    order_ptr,
    is_start_ptr,
    seen_ptr,
    meta_ptr,
    weights_ptr,
    ends_ptr,
    unique_ptr,
    inverse_ptr,
    starts_ptr,
    order_out_ptr,
    weights_out_ptr,
    offsets_ptr,
    n,
    num_bags,
    batch_size,
    num_keys,
    num_groups,
    search_steps,
    tag_shift,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Sorted position i (key ``k = sorted[i]``, batch position ``p = order[i]``, run
    ``s = seen[i] - 1``) of group ``g = k >> tag_shift``, whose batch key ``c`` is found by a
    binary search of ``key_ends`` (``search_steps`` halvings): its value's place in the
    group, ``d = p + shift[c]``, and its local run ``r = s - u_lo[g]``;
    ``inverse[vbase[g] + d] = r``, ``order[vbase[g] + i - v_lo[g]] = d``, and at a run's start
    ``unique[ubase[g] + r] = k`` (tag cleared), ``starts[ubase[g] + r] = i - v_lo[g]``.

    Bag t of the batch (key ``c = t // B``, bag ``j``; ``ends`` the lengths' inclusive running
    sums in the batch's order): ``offsets[obase[g] + place[c] * B + j + 1] = ends[t] +
    shift[c]``, its group's running count at the bag's end. Program 0 writes each group's first
    offset (0) and ends its starts: ``starts[ubase[g] + U[g]] = N[g]``."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    p_groups = meta_ptr + 4 * num_keys  # u_lo, v_lo, U, N, ubase, vbase, obase: [G] each
    b_key = tl.load(sorted_ptr + o_n, mask=m_n, other=0)
    b_pos = tl.load(order_ptr + o_n, mask=m_n, other=0)
    b_seg = tl.load(seen_ptr + o_n, mask=m_n, other=1) - 1
    m_start = m_n & (tl.load(is_start_ptr + o_n, mask=m_n, other=0) != 0)
    b_group = tl.minimum(b_key >> tag_shift, num_groups - 1)
    # The batch key of each value: the number of key ends <= its position.
    b_lo = tl.zeros((BLOCK_N,), dtype=tl.int64)
    b_hi = tl.zeros((BLOCK_N,), dtype=tl.int64) + num_keys
    for _ in range(search_steps):
        m_open = m_n & (b_lo < b_hi)
        b_mid = (b_lo + b_hi) >> 1
        b_end = tl.load(meta_ptr + b_mid, mask=m_open, other=0)
        b_lo = tl.where(m_open & (b_end <= b_pos), b_mid + 1, b_lo)
        b_hi = tl.where(m_open & (b_end > b_pos), b_mid, b_hi)
    b_keyi = tl.minimum(b_lo, num_keys - 1)
    b_dst = b_pos + tl.load(meta_ptr + num_keys + b_keyi, mask=m_n, other=0)
    b_u_lo = tl.load(p_groups + b_group, mask=m_n, other=0)
    b_v_lo = tl.load(p_groups + num_groups + b_group, mask=m_n, other=0)
    b_ubase = tl.load(p_groups + 4 * num_groups + b_group, mask=m_n, other=0)
    b_vbase = tl.load(p_groups + 5 * num_groups + b_group, mask=m_n, other=0)
    b_run = b_seg - b_u_lo
    tl.store(inverse_ptr + b_vbase + b_dst, b_run, mask=m_n)
    tl.store(order_out_ptr + b_vbase + o_n - b_v_lo, b_dst, mask=m_n)
    b_mask = (tl.full((), 1, tl.int64) << tag_shift) - 1
    tl.store(unique_ptr + b_ubase + b_run, b_key & b_mask, mask=m_start)
    tl.store(starts_ptr + b_ubase + b_run, o_n - b_v_lo, mask=m_start)
    if HAS_WEIGHTS:
        b_w = tl.load(weights_ptr + b_pos, mask=m_n, other=0.0)
        tl.store(weights_out_ptr + b_vbase + b_dst, b_w, mask=m_n)
    # The bags' offsets, each group's in its feature order.
    m_t = o_n < num_bags
    b_c = o_n // tl.maximum(batch_size, 1)
    b_j = o_n - b_c * batch_size
    b_g = tl.load(meta_ptr + 2 * num_keys + b_c, mask=m_t, other=0)
    b_place = tl.load(meta_ptr + 3 * num_keys + b_c, mask=m_t, other=0)
    b_obase = tl.load(p_groups + 6 * num_groups + b_g, mask=m_t, other=0)
    b_at = b_obase + b_place * batch_size + b_j + 1
    b_end = tl.load(ends_ptr + o_n, mask=m_t, other=0)
    b_shift = tl.load(meta_ptr + num_keys + b_c, mask=m_t, other=0)
    tl.store(offsets_ptr + b_at, b_end + b_shift, mask=m_t)
    o_g = tl.arange(0, BLOCK_N)
    for g0 in range(0, num_groups, BLOCK_N):
        m_g = (i_n == 0) & (g0 + o_g < num_groups)
        p_g = p_groups + g0 + o_g
        b_u = tl.load(p_g + 2 * num_groups, mask=m_g, other=0)
        b_nv = tl.load(p_g + 3 * num_groups, mask=m_g, other=0)
        b_ub = tl.load(p_g + 4 * num_groups, mask=m_g, other=0)
        b_ob = tl.load(p_g + 6 * num_groups, mask=m_g, other=0)
        tl.store(starts_ptr + b_ub + b_u, b_nv, mask=m_g)
        tl.store(offsets_ptr + b_ob, tl.zeros((BLOCK_N,), dtype=tl.int64), mask=m_g)


def scatter_joint(
    ordered: torch.Tensor,
    order: torch.Tensor,
    is_start: torch.Tensor,
    seen: torch.Tensor,
    plan: JointPlan,
    tag_shift: int,
    weights: torch.Tensor | None,
    length_ends: torch.Tensor,
) -> JointShares:
    """Write each group's share (module docstring) from a `sort_and_mark` of the tagged
    keys, after the read that made ``plan``: one launch, plus the plan's upload (pinned, not
    waited for, on a GPU). ``weights``: float32 ``[n]`` in the batch's order, or None;
    ``length_ends``: int64 ``[K * B]``, the bag lengths' inclusive running sums in the batch's
    order."""
    device = ordered.device
    out = joint_outputs(plan, device, weights is not None)
    meta = torch.tensor(plan.meta(), dtype=torch.int64)
    if device.type == "cuda":
        meta = meta.pin_memory().to(device, non_blocking=True)
    else:
        meta = meta.to(device)
    n = ordered.numel()
    num_keys, num_groups = len(plan.key_ends), len(plan.u_lo)
    num_bags = num_keys * plan.batch_size
    _joint_scatter_kernel[(max(1, triton.cdiv(max(n, num_bags), _BLOCK_N)),)](
        ordered,
        order,
        is_start,
        seen,
        meta,
        weights if weights is not None else meta,
        length_ends if num_bags else meta,
        out.unique,
        out.inverse,
        out.starts,
        out.order,
        out.weights if out.weights is not None else meta,
        out.offsets,
        n,
        num_bags,
        plan.batch_size,
        num_keys,
        num_groups,
        num_keys.bit_length(),
        tag_shift,
        HAS_WEIGHTS=weights is not None,
        BLOCK_N=_BLOCK_N,
    )
    return out


class TritonIds(SpecIds):
    """The ids family on the Triton kernels (`IdsOps`): the device path's, on a GPU and under
    ``EMBCACHE_BACKEND=triton`` (the interpreter on CPU tensors)."""

    name = "triton"
    joint = True

    def _fuse(
        self,
        values: torch.Tensor,
        lengths: torch.Tensor,
        ends: torch.Tensor,
        table_idx: torch.Tensor,
        num_embeddings: torch.Tensor,
        fusion_k: int,
        names: tuple[Sequence[str], Sequence[str]],
    ) -> tuple[torch.Tensor, IdVerdict | None]:
        # One launch finds each value's feature, fuses and checks: nothing is read here.
        fused, verdict, flags = fuse_ids_triton(
            values.contiguous(), ends, table_idx, num_embeddings, fusion_k
        )
        found: tuple = (values, lengths, ends, table_idx, None, verdict, num_embeddings,
                         fusion_k, *names)  # fmt: skip
        return fused, IdVerdict(flags, found)

    def _unfuse(self, fused: torch.Tensor, fusion_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return unfuse_ids_triton(fused.contiguous(), fusion_k)

    def _dedup(
        self, ids: torch.Tensor, with_counts: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return dedup_triton(ids.contiguous())

    def sort_and_mark(
        self,
        ids: torch.Tensor,
        starts: torch.Tensor | None,
        extra: torch.Tensor | None,
        read: torch.Tensor | None = None,
    ) -> Marked:
        return sort_and_mark(ids, starts, extra, read)

    def scatter_joint(
        self,
        ordered: torch.Tensor,
        order: torch.Tensor,
        is_start: torch.Tensor,
        seen: torch.Tensor,
        plan: JointPlan,
        tag_shift: int,
        weights: torch.Tensor | None,
        length_ends: torch.Tensor,
    ) -> JointShares:
        return scatter_joint(ordered, order, is_start, seen, plan, tag_shift, weights, length_ends)

    def dedup_together(
        self,
        ids: list[torch.Tensor],
        table_starts: Sequence[torch.Tensor | None] | None = None,
        also_read: torch.Tensor | None = None,
    ) -> tuple[list[Deduped], list[int]]:
        return dedup_together_triton(ids, table_starts, also_read)


IMPLEMENTATION: IdsOps = TritonIds()  # checked against the protocol
