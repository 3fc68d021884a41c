"""Ids: validate and fuse per-feature ids, unfuse them, and dedup a batch.

A batch arrives as the values of F features concatenated (a KeyedJaggedTensor's values). Each
id of a bounded table is checked against it (``0 <= id < num_embeddings``) and the fusion width
(``id < 2**fusion_k``), then fused with its table index, ``id | (table_idx << fusion_k)``, so
that one cache can hold the rows of several tables. An unbounded table takes any int64 id (raw
64-bit hashes included): one in ``[0, 2**fusion_k)`` is kept as it is, any other is folded
into the id bits by a hash, ``mix64(id) & (2**fusion_k - 1)``, so two ids may share a row (with
fusion_k bits and n folded ids, about ``n / 2**fusion_k`` of them do).

The check costs a single host sync on the good path: the kernel writes a per-value verdict,
one read brings back whether any is bad, and only a bad batch pays for finding and naming the
first offender. `fuse_ids_deferred` leaves that read to the caller (`IdVerdict`), who makes
it with a read of its own (a collection's forward: with its dedup's sizes).

Dedup design: sort-based, not hash-based. The cache and the tests want the unique ids sorted
ascending (sets are resolved in id order, results are reproducible), so a hash table would still
need a sort of its U keys afterwards, plus a table sized to the batch and a CAS insertion loop
whose slot order depends on thread timing. A device radix sort (``torch.sort``, CUB on CUDA)
of the n ids is bandwidth-bound and deterministic; on the sorted ids two light Triton kernels
mark segment starts and scatter the unique ids, the inverse index and the segment starts,
from which the counts follow. The one host sync reads U, which sizes the outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from embcache.kernels import ids_ref
from embcache.kernels.backend import use_triton
from embcache.kernels.checks import INDEX_DTYPES, check_int, check_tensor

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
    """Triton twin of `ids_ref.fuse_ids_ref`, each value's feature found in the kernel from
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
    """Triton twin of `ids_ref.unfuse_ids_ref`."""
    n = fused.numel()
    table_idx = torch.empty(n, dtype=torch.int64, device=fused.device)
    ids = torch.empty(n, dtype=torch.int64, device=fused.device)
    if n:
        _unfuse_ids_kernel[_grid(n)](fused, table_idx, ids, n, fusion_k, BLOCK_N=_BLOCK_N)
    return table_idx, ids


def dedup_triton(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of `ids_ref.dedup_ref`: sort, mark segment starts, scatter."""
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


@dataclass
class Deduped:
    """A cache's ids deduplicated by `dedup_together`: unique ids ascending, the inverse,
    (with several tables, when asked for) `CacheLayout.table_bounds` of the unique ids, and on
    the device path, the ids' positions grouped by unique id (``order``, a stable sort: in
    value order within an id) and where each id's run starts in it (``segment_starts``,
    ``[U + 1]``); and the bags' offsets where the dedup made them (`engine.joint`)."""

    unique: torch.Tensor  # int64 [U]
    inverse: torch.Tensor  # int64 [n]
    bounds: list[int] | None
    order: torch.Tensor | None = None  # int64 [n]
    segment_starts: torch.Tensor | None = None  # int64 [U + 1]
    offsets: torch.Tensor | None = None  # int64 [F * B + 1], the bags', when made here


@dataclass
class Marked:
    """Ids sorted and their runs marked (`sort_and_mark`), their sizes not yet read: the sorted
    ids and where each came from (``order``, a stable sort), run starts (int32 ``[n]``), the
    running count of runs (``seen``, int64 ``[n]``, inclusive), and ``read``, the device buffer
    that one host read brings back (``[0]`` the number of runs, ``[1 + t]`` the runs below
    ``starts[t]``, then ``extra``)."""

    ordered: torch.Tensor
    order: torch.Tensor
    is_start: torch.Tensor
    seen: torch.Tensor
    read: torch.Tensor


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


# ----------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------


def _check_ids(name: str, t: torch.Tensor) -> None:
    check_tensor(name, t, INDEX_DTYPES, 1)


def _check_fusion_k(fusion_k: int) -> None:
    check_int("fusion_k", fusion_k, 0, 63)


def _bad_id_error(
    ids: torch.Tensor,
    value_features: torch.Tensor,
    verdict: torch.Tensor,
    num_embeddings: torch.Tensor,
    fusion_k: int,
    feature_names: Sequence[str],
    table_names: Sequence[str],
) -> ValueError:
    """The error naming the first value whose verdict is not OK (error path only)."""
    j = int(torch.nonzero(verdict).min())
    kind = int(verdict[j])
    i = int(value_features[j])
    where = f"feature {feature_names[i]!r} (table {table_names[i]!r}): id {int(ids[j])}"
    if kind == ids_ref.ID_NEGATIVE:
        return ValueError(f"{where} is negative; ids must be >= 0")
    if kind == ids_ref.ID_OUT_OF_RANGE:
        return ValueError(f"{where} out of range [0, {int(num_embeddings[i])})")
    return ValueError(
        f"{where} needs more than fusion_k={fusion_k} bits (ids must be < 2**{fusion_k})"
    )


_SEGMENT_MIN = 4096  # values per feature (on average) from which `_fuse_segments_cpu` pays


def _fuse_segments_cpu(
    values: torch.Tensor,
    lengths: torch.Tensor,
    table_idx: torch.Tensor,
    num_embeddings: torch.Tensor,
    fusion_k: int,
) -> torch.Tensor | None:
    """`ids_ref.fuse_ids_ref` on the CPU, one feature's contiguous values at a time: a range
    check (one min/max pass) and one fusing pass per feature (per batch when every feature has
    as many values), instead of per-value gathers of each value's table and bound; two host
    reads whatever the number of features. None when any id or table index fails a check (the
    caller's general path then says which), or when features are short and uneven (the
    general path is cheaper then)."""
    fits = (1 << fusion_k) if fusion_k < 63 else torch.iinfo(torch.int64).max
    table_limit = (1 << (63 - fusion_k)) if fusion_k > 0 else torch.iinfo(torch.int64).max
    sizes, tables, rows = torch.stack([lengths, table_idx, num_embeddings]).tolist()
    if not all(0 <= t < table_limit for t in tables):
        return None
    n = sizes[0] if sizes else 0
    if n and sizes.count(n) == len(sizes):  # as many values in every feature: all at once
        grid = values.view(len(sizes), n)
        lows, highs = (bound.tolist() for bound in torch.aminmax(grid, dim=1))
        for lo, hi, limit in zip(lows, highs, rows, strict=True):
            if lo < 0 or hi >= (min(limit, fits) if limit >= 0 else fits):
                return None
        shift = torch.tensor(tables, dtype=torch.int64).unsqueeze(1) << fusion_k
        return torch.bitwise_or(grid, shift).view(-1)  # int64 whatever the values' type
    if values.numel() < _SEGMENT_MIN * len(sizes):
        return None  # short features: the per-value path is cheaper
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    present = [f for f, n in enumerate(sizes) if n]
    if present:
        ranges = torch.stack(
            [torch.stack(torch.aminmax(values[starts[f] : starts[f + 1]])) for f in present]
        ).tolist()
        for f, (lo, hi) in zip(present, ranges, strict=True):
            if lo < 0 or hi >= (min(rows[f], fits) if rows[f] >= 0 else fits):
                return None
    out = torch.empty(values.numel(), dtype=torch.int64)
    for f in present:
        seg, dst = values[starts[f] : starts[f + 1]], out[starts[f] : starts[f + 1]]
        if seg.dtype == torch.int64:
            torch.bitwise_or(seg, tables[f] << fusion_k, out=dst)
        else:
            dst.copy_(seg).bitwise_or_(tables[f] << fusion_k)
    return out


class IdVerdict:
    """The checks of `fuse_ids_deferred`, made on the device and not yet read: ``flags``
    (int64 ``[4]``: a negative length, lengths that do not sum to the values, a table index
    out of range, a bad id). A caller reads them with a read of its own and hands their
    values to `judge`; `verify` reads them itself (`fuse_ids`)."""

    def __init__(
        self,
        flags: torch.Tensor,
        args: tuple,
    ) -> None:
        self.flags = flags
        self._args = args
        # Checks of the caller's that folded into these flags (a batch's pending length
        # checks, `JaggedBatch.check_lengths`): run first when a flag is up, so that the
        # error names what the caller was given.
        self.first: Callable[[], None] | None = None

    def judge(self, flags: Sequence[int]) -> None:
        """Raise the error `fuse_ids` raises when ``flags`` (the values of `flags`) says so
        (`first`'s, when it raises).

        Raises:
            ValueError: as `fuse_ids` says; nothing was changed.
        """
        if any(flags):
            if self.first is not None:
                self.first()
            _raise_bad(flags, *self._args)

    def verify(self) -> None:
        """`judge` the flags, read here: the one host sync of `fuse_ids`' good path."""
        self.judge(self.flags.tolist())


def _value_features(ends: torch.Tensor, nnz: int) -> torch.Tensor:
    """The feature of each of ``nnz`` values, from the lengths' running sums ``ends``; safe
    when the lengths are wrong (values past every end are the last feature's)."""
    o_n = torch.arange(nnz, dtype=torch.int64, device=ends.device)
    return torch.searchsorted(ends, o_n, right=True).clamp_(max=ends.numel() - 1)


def _bad_tables(table_idx: torch.Tensor, fusion_k: int) -> torch.Tensor:
    """Which table indices do not fit the ``63 - fusion_k`` bits above the ids."""
    bad = table_idx < 0
    if fusion_k > 0:  # for fusion_k = 0 every non-negative int64 fits
        bad |= table_idx >= (1 << (63 - fusion_k))
    return bad


def _raise_bad(
    flags: Sequence[int],
    values: torch.Tensor,
    lengths: torch.Tensor,
    ends: torch.Tensor,
    table_idx: torch.Tensor,
    value_features: torch.Tensor | None,
    verdict: torch.Tensor,
    num_embeddings: torch.Tensor,
    fusion_k: int,
    feature_names: Sequence[str],
    table_names: Sequence[str],
) -> None:
    """The error of `fuse_ids` for ``flags`` (error path only; ``value_features`` None: found
    from ``ends`` here)."""
    negative_length, wrong_total, table_out_of_range, _ = flags
    if negative_length:
        i = int(torch.nonzero(lengths < 0).min())
        raise ValueError(
            f"feature {feature_names[i]!r}: negative length {int(lengths[i])} in feature_lengths"
        )
    if wrong_total:
        raise ValueError(
            f"feature_lengths sum to {int(ends[-1])} but values has {values.numel()} entries"
        )
    if table_out_of_range:
        i = int(torch.nonzero(_bad_tables(table_idx, fusion_k)).min())
        raise ValueError(
            f"feature {feature_names[i]!r} (table {table_names[i]!r}): table index "
            f"{int(table_idx[i])} out of range [0, 2**{63 - fusion_k}) for fusion_k={fusion_k}"
        )
    if value_features is None:
        value_features = _value_features(ends, values.numel())
    raise _bad_id_error(
        values, value_features, verdict, num_embeddings, fusion_k, feature_names, table_names
    )


def fuse_ids(
    values: torch.Tensor,
    feature_lengths: torch.Tensor,
    table_idx: torch.Tensor,
    num_embeddings: torch.Tensor,
    fusion_k: int,
    feature_names: Sequence[str],
    table_names: Sequence[str],
) -> torch.Tensor:
    """Validate the ids of F features and fuse each with its table index.

    Example: features ``f0, f1`` of table 0 and ``f2`` of table 1, ``fusion_k = 30``, values
    ``[3, 7, 7, 5]`` with lengths ``[2, 1, 1]`` give ``[3, 7, 7, 5 | 1 << 30]``.

    Args:
        values: int64 or int32 ``[nnz]``, the values of the F features concatenated.
        feature_lengths: int ``[F]``, number of values of each feature (sums to nnz).
        table_idx: int ``[F]``, table index of each feature, ``0 <= t < 2**(63 - fusion_k)``.
        num_embeddings: int ``[F]``, rows of each feature's table, -1 for an unbounded table.
        fusion_k: bits kept for the id, in ``[0, 63]``.
        feature_names: F feature names, for error messages.
        table_names: F table names (of each feature's table), for error messages.

    Returns:
        int64 ``[nnz]``: ``values | (table_idx << fusion_k)`` per value.

    Raises:
        TypeError: a tensor that is not int32/int64, or a fusion_k that is not an int.
        ValueError: mismatched lengths, negative lengths, a bad table index, or the first id that
            is negative, ``>= num_embeddings`` or ``>= 2**fusion_k``, naming feature, table, id
            and limit. Nothing is modified in any case.
    """
    fused, verdict = fuse_ids_deferred(
        values, feature_lengths, table_idx, num_embeddings, fusion_k, feature_names, table_names
    )
    if verdict is not None:
        verdict.verify()
    return fused


def fuse_ids_deferred(
    values: torch.Tensor,
    feature_lengths: torch.Tensor,
    table_idx: torch.Tensor,
    num_embeddings: torch.Tensor,
    fusion_k: int,
    feature_names: Sequence[str],
    table_names: Sequence[str],
) -> tuple[torch.Tensor, IdVerdict | None]:
    """`fuse_ids` with its device checks not yet read: the fused ids (meaningless until the
    checks pass) and an `IdVerdict` to read with a read of the caller's (None: the checks
    were made and passed here, as the CPU path does). The caller must `judge` the verdict
    before it uses the fused ids for anything that changes state.

    Raises:
        TypeError, ValueError: as `fuse_ids`, for what the host knows (dtypes, sizes) and for
            what the CPU path reads.
    """
    for name, t in (
        ("values", values),
        ("feature_lengths", feature_lengths),
        ("table_idx", table_idx),
        ("num_embeddings", num_embeddings),
    ):
        _check_ids(name, t)
    _check_fusion_k(fusion_k)
    num_features = feature_lengths.numel()
    sizes = {
        "table_idx": table_idx.numel(),
        "num_embeddings": num_embeddings.numel(),
        "feature_names": len(feature_names),
        "table_names": len(table_names),
    }
    for name, size in sizes.items():
        if size != num_features:
            raise ValueError(
                f"{name} has {size} entries but feature_lengths has {num_features} features"
            )
    nnz = values.numel()
    device = values.device
    if num_features == 0:
        if nnz:
            raise ValueError(f"values has {nnz} entries but there are no features")
        return torch.empty(0, dtype=torch.int64, device=device), None
    lengths = feature_lengths.to(device=device, dtype=torch.int64)
    table_idx = table_idx.to(device=device, dtype=torch.int64)
    num_embeddings = num_embeddings.to(device=device, dtype=torch.int64)
    ends = torch.cumsum(lengths, 0)
    # The device path (a GPU, or Triton's interpreter standing in for one) reads nothing here.
    lengths_ok = (
        device.type == "cpu"
        and not use_triton(values)
        and bool((lengths >= 0).all())
        and int(ends[-1]) == nnz
    )
    # Per feature pays a few calls per feature: it wins once features average ~4k values, or
    # when every feature has as many values (one pass over them all).
    if lengths_ok:
        fused = _fuse_segments_cpu(values, lengths, table_idx, num_embeddings, fusion_k)
        if fused is not None:
            return fused, None  # else a bad id or table index: the checks below name it
    if use_triton(values):
        # One launch finds each value's feature, fuses and checks: nothing is read here.
        fused, verdict, flags = fuse_ids_triton(
            values.contiguous(), ends, table_idx, num_embeddings, fusion_k
        )
        found: tuple = (values, lengths, ends, table_idx, None, verdict, num_embeddings,
                         fusion_k, feature_names, table_names)  # fmt: skip
        return fused, IdVerdict(flags, found)
    if lengths_ok:
        # On the CPU a check costs no device sync: with lengths known good, repeat_interleave
        # is several times cheaper than a search per value.
        features = torch.arange(num_features, dtype=torch.int64)
        value_features = torch.repeat_interleave(features, lengths, output_size=nnz)
    else:
        value_features = _value_features(ends, nnz)
    fused, verdict = ids_ref.fuse_ids_ref(
        values, value_features, table_idx, num_embeddings, fusion_k
    )
    flags = torch.stack(
        [
            (lengths < 0).any(),
            ends[-1] != nnz,
            _bad_tables(table_idx, fusion_k).any(),
            (verdict != ids_ref.ID_OK).any(),
        ]
    ).to(torch.int64)
    args = (values, lengths, ends, table_idx, value_features, verdict, num_embeddings,
            fusion_k, feature_names, table_names)  # fmt: skip
    return fused, IdVerdict(flags, args)


def dedup_grouped(
    ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dedup` plus the value positions grouped by unique id, for a one-pass backward.

    Sort-based with torch ops on every device (``torch.sort`` is the bandwidth-bound core on a
    GPU too, as in `dedup`'s Triton path).

    Args:
        ids: int64 or int32 ``[n]`` (fused) ids.

    Returns:
        ``(unique_ids, inverse, order, segments)``: as `dedup` for the first two; ``order``
        int64 ``[n]`` positions sorted by id (ascending within an id) and ``segments`` int64
        ``[U + 1]``: id u owns ``order[segments[u] : segments[u + 1]]``.
    """
    _check_ids("ids", ids)
    return ids_ref.dedup_grouped_ref(ids)


def unfuse_ids(fused: torch.Tensor, fusion_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split fused ids into their table index and id; the inverse of `fuse_ids`.

    Args:
        fused: int64 ``[n]`` fused ids (non-negative).
        fusion_k: bits of the id, as given to `fuse_ids`.

    Returns:
        ``(table_idx, ids)``, both int64 ``[n]``.
    """
    _check_ids("fused", fused)
    _check_fusion_k(fusion_k)
    if use_triton(fused):
        return unfuse_ids_triton(fused.contiguous(), fusion_k)
    return ids_ref.unfuse_ids_ref(fused, fusion_k)


def dedup(
    ids: torch.Tensor, with_counts: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Unique ids of a batch, sorted ascending, with the inverse index and counts.

    Example: ``[7, 3, 7, 9]`` gives ``([3, 7, 9], [1, 0, 1, 2], [1, 2, 1])``.

    Args:
        ids: int64 or int32 ``[n]`` (fused) ids.
        with_counts: also count occurrences (the CPU path is ~30% cheaper without).

    Returns:
        ``(unique_ids, inverse, counts)``: int64 ``[U]`` ascending, int64 ``[n]`` with
        ``unique_ids[inverse] == ids``, int64 ``[U]`` occurrences of each unique id (None
        when not asked for on the CPU path).
    """
    _check_ids("ids", ids)
    if use_triton(ids):
        return dedup_triton(ids.contiguous())
    return ids_ref.dedup_ref(ids, with_counts)
