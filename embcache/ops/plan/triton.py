"""The plan family's Triton kernels: the set index, the lookup of a batch's ids (as ways or
slots), victim ways for its misses, and the device plan's steps around them (its counts, its
hits' locks, its misses' shuffle and order, and their placement in one kernel).

Layout follows Liger-Kernel: kernels, then launchers (check, allocate, launch), then
`TritonPlan`, the family's implementation over them (`PlanOps`). Each kernel's torch twin is in
`ops.plan.spec`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import embcache.ops.interpreter  # noqa: F401  (the interpreter runs these kernels)
from embcache.ops.plan import (
    KEY_SHIFT,
    PLAN_FIELDS,
    GroupProbe,
    GroupReserve,
    PlanOps,
    PlanTable,
)
from embcache.ops.plan.spec import SpecPlan

# Elements one program holds at once. Wide enough that the interpreter runs few programs, small
# enough that a GPU program keeps its int64 blocks in registers.
_SET_INDEX_BLOCK = 1024
_LOOKUP_ELEMS = 4096
_LOOKUP_MAX_BLOCK_W = 64
_ASSIGN_ELEMS = 4096
_ASSIGN_MAX_BLOCK_I = 16
_ASSIGN_MAX_BLOCK_T = 128


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _mix64(x):
    """splitmix64's finaliser of int64 ``x``, as uint64 (the products wrap, the shifts are
    logical): bit for bit `hashing.mix64`."""
    z = x.to(tl.uint64, bitcast=True) + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit(do_not_specialize=["n"])  # per-batch values: one variant
def _set_index_kernel(
    ids_ptr,
    sets_ptr,
    n,
    num_sets,
    BLOCK_N: tl.constexpr,
):
    """``sets[i] = (mix64(ids[i]) & (2**63 - 1)) % num_sets``.

    mix64 is splitmix64's finaliser: ``z = x + golden; z = (z ^ z >> 30) * c1;
    z = (z ^ z >> 27) * c2; z ^ z >> 31``, in uint64 so the products wrap and the shifts are
    logical, bit for bit what the int64 twin computes.
    """
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    b_z = _mix64(tl.load(ids_ptr + o_n, mask=m_n, other=0).to(tl.int64))
    b_set = (b_z & 0x7FFFFFFFFFFFFFFF).to(tl.int64, bitcast=True) % num_sets
    tl.store(sets_ptr + o_n, b_set, mask=m_n)


@triton.jit
def _take_ways(
    keys, scores, locks, batch_of, dirty, b_set, b_rank, m_m, W, batch_seq,
    BLOCK_W: tl.constexpr,
):  # fmt: skip
    """The placement of a block of misses (``m_m``), each the ``b_rank``-th miss of set
    ``b_set``: the ``b_rank``-th of the set's ways ordered by ``score * W + way`` among those
    not blocked (locked, or the last locked batch's: ``batch_of == batch_seq``), if there are
    that many. Returns ``(place, placed, held, dirty)``: ``set * W + way`` or -1, and whether
    each was placed, on a way holding a row, and that row dirty."""
    o_w = tl.arange(0, BLOCK_W).to(tl.int64)  # [BLOCK_W]
    m_mw = m_m[:, None] & (o_w < W)[None, :]  # [BLOCK_M, BLOCK_W]
    p_way = b_set[:, None] * W + o_w[None, :]
    b_lock = tl.load(locks + p_way, mask=m_mw, other=1)
    b_batch = tl.load(batch_of + p_way, mask=m_mw, other=0)
    b_score = tl.load(scores + p_way, mask=m_mw, other=0)
    m_free = m_mw & (b_lock <= 0) & (b_batch != batch_seq)
    b_key = tl.where(m_free, b_score * W + o_w[None, :], 0x7FFFFFFFFFFFFFFF)
    # Each way's place in its set's order: how many ways have a smaller key.
    b_order = tl.sum((b_key[:, None, :] < b_key[:, :, None]).to(tl.int32), axis=2)
    b_free = tl.sum(m_free.to(tl.int32), axis=1)  # [BLOCK_M]
    m_pick = m_free & (b_order == b_rank[:, None])
    b_way = tl.max(tl.where(m_pick, o_w[None, :], -1), axis=1)  # [BLOCK_M]
    m_placed = m_m & (b_rank < b_free) & (b_way >= 0)
    b_place = tl.where(m_placed, b_set * W + b_way, -1)
    b_at = tl.maximum(b_place, 0)
    m_held = m_placed & (tl.load(keys + b_at, mask=m_placed, other=-1) >= 0)
    m_dirty = m_held & (tl.load(dirty + b_at, mask=m_held, other=0) != 0)
    return b_place, m_placed, m_held, m_dirty


@triton.jit(do_not_specialize=["n", "search_steps", "batch_seq"])  # per batch: one variant
def _assign_misses_kernel(
    miss_sets_ptr,
    scores_ptr,
    locks_ptr,
    batch_of_ptr,
    keys_ptr,
    dirty_ptr,
    place_ptr,
    counts_ptr,
    m_ptr,
    n,
    search_steps,
    batch_seq: tl.int64,
    W: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """`assign_ways` with its inputs gathered in the kernel and its place and counts made
    there, for misses sorted by set (``miss_sets``, runs): miss i is the k-th of its run (k
    found by a binary search for the run's start, ``search_steps`` halvings) and takes the k-th
    of its set's ways ordered by ``(blocked, score * W + way)``, blocked meaning locked or the
    last locked batch's (``batch_of == batch_seq``), if k is below the set's unblocked ways:
    ``place[i] = set * W + way``, else -1. Adds up (``atomic_add``, integers) into ``counts``
    (int64 ``[3]``, zeroed) the misses placed, those whose way holds a row, and those rows
    dirty. The misses are the first ``m`` (read from ``m_ptr``, int64 ``[1]``, on the device:
    a plan may launch this before it reads its number of misses) of the ``n`` entries; the
    others are placed at -1 and count nothing."""
    m = tl.load(m_ptr)
    i_m = tl.program_id(0).to(tl.int64)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_m = o_m < m
    b_set = tl.load(miss_sets_ptr + o_m, mask=m_m, other=0)
    b_lo = tl.zeros((BLOCK_M,), dtype=tl.int64)
    b_hi = tl.zeros((BLOCK_M,), dtype=tl.int64) + m
    for _ in range(search_steps):  # the run's start: the misses of lower sets
        m_open = m_m & (b_lo < b_hi)
        b_mid = (b_lo + b_hi) >> 1
        b_v = tl.load(miss_sets_ptr + b_mid, mask=m_open, other=0)
        b_lo = tl.where(m_open & (b_v < b_set), b_mid + 1, b_lo)
        b_hi = tl.where(m_open & (b_v >= b_set), b_mid, b_hi)
    b_rank = o_m - b_lo  # [BLOCK_M]
    b_place, m_placed, m_held, m_dirty = _take_ways(
        keys_ptr, scores_ptr, locks_ptr, batch_of_ptr, dirty_ptr, b_set, b_rank, m_m, W,
        batch_seq, BLOCK_W,
    )  # fmt: skip
    tl.store(place_ptr + o_m, b_place, mask=o_m < n)
    tl.atomic_add(counts_ptr + 0, tl.sum(m_placed.to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + 1, tl.sum(m_held.to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + 2, tl.sum(m_dirty.to(tl.int64), axis=0))


@triton.jit(do_not_specialize=["n"])  # per batch: one variant
def _lookup_counts_kernel(
    slots_ptr,
    admitted_ptr,
    missing_ptr,
    counts_ptr,
    n,
    num_slots,
    HAS_ADMITTED: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """What a plan reads of its lookup's ``slots`` (-1: not held), added up (``atomic_add``,
    integers) into ``counts`` (int64 ``[4]``, zeroed): the misses (``missing[i]``: -1 and
    admitted), the ids held, those held in the scratch area (slot >= num_slots), and the ids
    not admitted (with HAS_ADMITTED)."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    b_slot = tl.load(slots_ptr + o_n, mask=m_n, other=0)
    m_missing = m_n & (b_slot < 0)
    if HAS_ADMITTED:
        m_admitted = tl.load(admitted_ptr + o_n, mask=m_n, other=0) != 0
        m_missing = m_missing & m_admitted
        tl.atomic_add(counts_ptr + 3, tl.sum((m_n & ~m_admitted).to(tl.int64), axis=0))
    tl.store(missing_ptr + o_n, m_missing, mask=m_n)
    tl.atomic_add(counts_ptr + 0, tl.sum(m_missing.to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + 1, tl.sum((m_n & (b_slot >= 0)).to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + 2, tl.sum((m_n & (b_slot >= num_slots)).to(tl.int64), axis=0))


@triton.jit(do_not_specialize=["n", "delta"])  # per batch: one variant
def _add_at_held_kernel(t_ptr, slots_ptr, n, delta, BLOCK_N: tl.constexpr):
    """``t[slots[i]] += delta`` where ``slots[i] >= 0`` (``atomic_add``: integers, so
    repeated slots add up exactly, in any order)."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    b_slot = tl.load(slots_ptr + o_n, mask=m_n, other=-1)
    m_held = m_n & (b_slot >= 0)
    b_delta = tl.zeros((BLOCK_N,), dtype=tl.int32) + delta
    tl.atomic_add(t_ptr + tl.maximum(b_slot, 0), b_delta, mask=m_held)


@triton.jit(do_not_specialize=["m"])  # per batch: one variant
def _reserve_placed_kernel(
    ids_ptr, slots_ptr, pos_ptr, place_ptr, keys_ptr, dirty_ptr, scores_ptr, locks_ptr,
    old_keys_ptr, old_scores_ptr, old_dirty_ptr, resident_ptr, write_back_ptr, m,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Miss j takes slot ``place[j]`` (`PlanOps.reserve_placed`): what the slot held is saved,
    ``slots[pos[j]]``, its key, dirty flag and lock are set. The slots are distinct, so no two
    programs touch one slot (the lock is still an integer atomic)."""
    o_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < m
    b_pos = tl.load(pos_ptr + o_n, mask=m_n, other=0)
    b_slot = tl.load(place_ptr + o_n, mask=m_n, other=0)
    b_key = tl.load(keys_ptr + b_slot, mask=m_n, other=-1)
    b_dirty = tl.load(dirty_ptr + b_slot, mask=m_n, other=0)
    b_resident = b_key >= 0
    tl.store(old_keys_ptr + o_n, b_key, mask=m_n)
    tl.store(old_scores_ptr + o_n, tl.load(scores_ptr + b_slot, mask=m_n, other=0), mask=m_n)
    tl.store(old_dirty_ptr + o_n, b_dirty, mask=m_n)
    tl.store(resident_ptr + o_n, b_resident, mask=m_n)
    tl.store(write_back_ptr + o_n, b_resident & (b_dirty != 0), mask=m_n)
    tl.store(slots_ptr + b_pos, b_slot, mask=m_n)
    tl.store(keys_ptr + b_slot, tl.load(ids_ptr + b_pos, mask=m_n, other=0), mask=m_n)
    tl.store(dirty_ptr + b_slot, tl.zeros((BLOCK_N,), dtype=tl.int1), mask=m_n)
    tl.atomic_add(locks_ptr + b_slot, tl.full((BLOCK_N,), 1, tl.int32), mask=m_n)


@triton.jit(do_not_specialize=["n", "salt"])  # per batch: one variant
def _salted_mix64_kernel(ids_ptr, out_ptr, n, salt: tl.int64, BLOCK_N: tl.constexpr):
    """``out[i] = mix64(ids[i] ^ salt)`` (splitmix64's finaliser in uint64, as
    `_set_index_kernel`; ``salt`` always passed as i64, so a new salt is no new variant)."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    b_z = _mix64(tl.load(ids_ptr + o_n, mask=m_n, other=0).to(tl.int64) ^ salt)
    tl.store(out_ptr + o_n, b_z.to(tl.int64, bitcast=True), mask=m_n)


@triton.jit(do_not_specialize=["n", "salt"])  # per batch: one variant
def _miss_keys_kernel(
    ids_ptr,
    pos_ptr,
    miss_ids_ptr,
    sets_ptr,
    key_ptr,
    n,
    salt: tl.int64,
    num_sets,
    BLOCK_N: tl.constexpr,
):
    """For each position ``pos[i]`` (-1: padding): the id there, its set (``num_sets`` for
    padding) and its LRU sort key ``(mix64(id ^ salt) & (2**20 - 1)) + set * 2**20``, as
    `miss_keys`' torch ops compute them, in one pass."""
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    b_pos = tl.load(pos_ptr + o_n, mask=m_n, other=-1)
    b_id = tl.load(ids_ptr + tl.maximum(b_pos, 0), mask=m_n, other=0)
    b_set = (_mix64(b_id) & 0x7FFFFFFFFFFFFFFF).to(tl.int64, bitcast=True) % num_sets
    b_set = tl.where(b_pos < 0, num_sets, b_set)
    b_key = (_mix64(b_id ^ salt).to(tl.int64, bitcast=True) & 0xFFFFF) + (b_set << 20)
    tl.store(miss_ids_ptr + o_n, b_id, mask=m_n)
    tl.store(sets_ptr + o_n, b_set, mask=m_n)
    tl.store(key_ptr + o_n, b_key, mask=m_n)


@triton.jit(do_not_specialize=["n"])  # per-batch values: one variant
def _cache_lookup_kernel(
    keys_ptr,
    ids_ptr,
    sets_ptr,
    ways_ptr,
    n,
    S,
    W,
    stride_ks,
    stride_kw,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SLOTS: tl.constexpr = False,
):
    """``ways[i]`` = the lowest ``w`` with ``keys[sets[i], w] == ids[i]``, else -1; with
    SLOTS, that way's slot ``sets[i] * W + w`` instead (else -1).

    One program per block of ids; each gathers the ``W`` keys of its ids' sets, ``BLOCK_W`` ways
    at a time. A set outside ``[0, S)`` reads nothing and gives -1.
    """
    i_n = tl.program_id(0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    b_id = tl.load(ids_ptr + o_n, mask=m_n, other=-1)  # [BLOCK_N]
    b_set = tl.load(sets_ptr + o_n, mask=m_n, other=0)  # [BLOCK_N]
    m_set = m_n & (b_set >= 0) & (b_set < S)
    # W stands for "not found"; every real way is below it, so a min picks the first match.
    b_way = tl.zeros([BLOCK_N], dtype=tl.int64) + W
    for w0 in range(0, W, BLOCK_W):
        o_w = w0 + tl.arange(0, BLOCK_W).to(tl.int64)  # [BLOCK_W]
        m_nw = m_set[:, None] & (o_w < W)[None, :]  # [BLOCK_N, BLOCK_W]
        p_key = keys_ptr + b_set[:, None] * stride_ks + o_w[None, :] * stride_kw
        b_key = tl.load(p_key, mask=m_nw, other=-1)  # [BLOCK_N, BLOCK_W]
        b_hit = m_nw & (b_key == b_id[:, None])
        b_way = tl.minimum(b_way, tl.min(tl.where(b_hit, o_w[None, :], W), axis=1))
    if SLOTS:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
        b_way = tl.where(b_way < W, b_set * W + b_way, -1)
    else:
        b_way = tl.where(b_way < W, b_way, -1)
    tl.store(ways_ptr + o_n, b_way, mask=m_n)


@triton.jit(do_not_specialize=["m", "S"])  # per-batch values (S: the sets passed): one variant
def _assign_ways_kernel(
    scores_ptr,
    blocked_ptr,
    miss_sets_ptr,
    ways_ptr,
    m,
    S,
    W,
    stride_ss,
    stride_sw,
    stride_bs,
    stride_bw,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """Victim ways for the misses of each touched set; ``ways`` must arrive filled with -1.

    With ``key[w] = INT64_MAX if blocked[s, w] else scores[s, w]``, the rank of way ``w`` in
    set ``s`` is ``#{v : key[v] < key[w] or (key[v] == key[w] and v < w)}``: its place in the
    stable ascending sort of the set's keys, computed by counting so that it is exact for any
    int64 score. The misses of set ``s`` form the run ``miss_sets[t:t + c] == s`` (sorted
    input); the ``k``-th of them gets the way of rank ``k`` when ``k`` is below the number of
    unblocked ways, so way ``w`` is written to ``ways[t + rank[w]]``.

    Each program looks at ``BLOCK_T`` miss positions and works only for those that start a run.
    """
    i_t = tl.program_id(0).to(tl.int64)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    m_t = o_t < m
    b_set = tl.load(miss_sets_ptr + o_t, mask=m_t, other=-1)  # [BLOCK_T]
    b_prev = tl.load(miss_sets_ptr + o_t - 1, mask=m_t & (o_t > 0), other=-1)  # [BLOCK_T]
    m_t = m_t & ((o_t == 0) | (b_prev != b_set)) & (b_set >= 0) & (b_set < S)

    o_w = tl.arange(0, BLOCK_W).to(tl.int64)  # [BLOCK_W]
    m_tw = m_t[:, None] & (o_w < W)[None, :]  # [BLOCK_T, BLOCK_W]
    p_score = scores_ptr + b_set[:, None] * stride_ss + o_w[None, :] * stride_sw
    p_blocked = blocked_ptr + b_set[:, None] * stride_bs + o_w[None, :] * stride_bw
    b_score = tl.load(p_score, mask=m_tw, other=0)  # [BLOCK_T, BLOCK_W]
    b_blocked = tl.load(p_blocked, mask=m_tw, other=1) != 0  # [BLOCK_T, BLOCK_W]
    b_key = tl.where(b_blocked, 0x7FFFFFFFFFFFFFFF, b_score)  # [BLOCK_T, BLOCK_W]

    b_rank = tl.zeros([BLOCK_T, BLOCK_W], dtype=tl.int32)
    for i0 in range(0, W, BLOCK_I):
        o_i = i0 + tl.arange(0, BLOCK_I).to(tl.int64)  # [BLOCK_I]
        m_ti = m_t[:, None] & (o_i < W)[None, :]  # [BLOCK_T, BLOCK_I]
        p_score_i = scores_ptr + b_set[:, None] * stride_ss + o_i[None, :] * stride_sw
        p_blocked_i = blocked_ptr + b_set[:, None] * stride_bs + o_i[None, :] * stride_bw
        b_score_i = tl.load(p_score_i, mask=m_ti, other=0)  # [BLOCK_T, BLOCK_I]
        b_blocked_i = tl.load(p_blocked_i, mask=m_ti, other=1) != 0
        b_key_i = tl.where(b_blocked_i, 0x7FFFFFFFFFFFFFFF, b_score_i)  # [BLOCK_T, BLOCK_I]
        k_i = b_key_i[:, :, None]  # [BLOCK_T, BLOCK_I, 1]
        k_w = b_key[:, None, :]  # [BLOCK_T, 1, BLOCK_W]
        b_before = (k_i < k_w) | ((k_i == k_w) & (o_i[None, :, None] < o_w[None, None, :]))
        b_before = b_before & m_ti[:, :, None]  # [BLOCK_T, BLOCK_I, BLOCK_W]
        b_rank += tl.sum(b_before.to(tl.int32), axis=1)

    b_free = tl.sum((m_tw & ~b_blocked).to(tl.int32), axis=1)  # [BLOCK_T]
    o_out = o_t[:, None] + b_rank  # [BLOCK_T, BLOCK_W]
    m_out = m_tw & (b_rank < b_free[:, None]) & (o_out < m)
    # Position t + k belongs to this set's run exactly when it holds the same set (sorted input).
    b_run = tl.load(miss_sets_ptr + o_out, mask=m_out, other=-1)
    m_out = m_out & (b_run == b_set[:, None])
    b_way = tl.zeros([BLOCK_T, BLOCK_W], dtype=tl.int64) + o_w[None, :]
    tl.store(ways_ptr + o_out, b_way, mask=m_out)


# -- the group plan: every cache of a `PlanTable` in one launch per step -----------------------


@triton.jit
def _plan_row(table_ptr, c, F: tl.constexpr):
    """Cache ``c``'s row of a `PlanTable`, the addresses typed: ``(ids, n, start, keys, scores,
    locks, batch_of, dirty, num_sets, ways, set_base, batch_seq, tick, found, num_slots,
    free)`` (``found``, ``free``: the addresses of the slots found already and of the free
    scratch rows, 0 for none)."""
    row = table_ptr + c * F
    ids = tl.load(row).to(tl.pointer_type(tl.int64))
    n = tl.load(row + 1)
    start = tl.load(row + 2)
    keys = tl.load(row + 3).to(tl.pointer_type(tl.int64))
    scores = tl.load(row + 4).to(tl.pointer_type(tl.int64))
    locks = tl.load(row + 5).to(tl.pointer_type(tl.int32))
    batch_of = tl.load(row + 6).to(tl.pointer_type(tl.int64))
    dirty = tl.load(row + 7).to(tl.pointer_type(tl.int8))
    num_sets = tl.load(row + 8)
    ways = tl.load(row + 9)
    set_base = tl.load(row + 10)
    batch_seq = tl.load(row + 11)
    tick = tl.load(row + 12)
    found = tl.load(row + 13)
    num_slots = tl.load(row + 14)
    free = tl.load(row + 15)
    return ids, n, start, keys, scores, locks, batch_of, dirty, num_sets, ways, set_base, \
        batch_seq, tick, found, num_slots, free  # fmt: skip


@triton.jit
def _misses_before(counts_ptr, c, k):
    """The misses of the caches before cache ``c`` (``counts[:c, 0]`` summed): where its
    misses start in the sorted order."""
    lo = tl.load(counts_ptr) * 0
    for i in range(k):
        lo += tl.where(i < c, tl.load(counts_ptr + i * 8), 0)
    return lo


@triton.jit(do_not_specialize=["pad"])  # per group: one variant
def _probe_group_kernel(
    table_ptr, ids_ptr, slots_ptr, missing_ptr, key_ptr, counts_ptr, pad: tl.int64,
    F: tl.constexpr, SHIFT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Program (c, b): block b of cache c's ids looked up in its sets (`PlanOps.probe_group`):
    slot, miss flag and sort key written at the cache's start in the group's arrays (and its
    padding entry), a lock added to each hit's slot, the misses and hits counted (integer
    atomics)."""
    c = tl.program_id(0).to(tl.int64)
    row = _plan_row(table_ptr, c, F)
    ids, n, start, keys, _, locks, _, _, num_sets, W, set_base, _, tick, found, num_slots, _ = row
    o_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_n = o_n < n
    m_out = o_n < n + (n & 1)  # and the padding entry (`ops.plan.padded`): id 0, a hit of -1
    b_id = tl.load(ids + o_n, mask=m_n, other=0)
    b_set = (_mix64(b_id) & 0x7FFFFFFFFFFFFFFF).to(tl.int64, bitcast=True) % num_sets
    o_w = tl.arange(0, BLOCK_W).to(tl.int64)  # [BLOCK_W]
    m_nw = m_n[:, None] & (o_w < W)[None, :]  # [BLOCK_N, BLOCK_W]
    b_key = tl.load(keys + b_set[:, None] * W + o_w[None, :], mask=m_nw, other=-1)
    b_way = tl.min(tl.where(m_nw & (b_key == b_id[:, None]), o_w[None, :], BLOCK_W), axis=1)
    m_found = m_n & (found != 0)  # the scratch area's slots, found before
    b_found = tl.load(found.to(tl.pointer_type(tl.int64)) + o_n, mask=m_found, other=-1)
    b_slot = tl.where(b_way < BLOCK_W, b_set * W + b_way, b_found)
    m_held = m_n & (b_slot >= 0)
    m_miss = m_n & (b_slot < 0)
    b_shuffle = _mix64(b_id ^ tick).to(tl.int64, bitcast=True) & ((1 << SHIFT) - 1)
    b_sort = tl.where(m_miss, ((set_base + b_set) << SHIFT) + b_shuffle, pad)
    b_slot = tl.where(m_n, b_slot, -1)
    at = start + o_n
    tl.store(ids_ptr + at, b_id, mask=m_out)
    tl.store(slots_ptr + at, b_slot, mask=m_out)
    tl.store(missing_ptr + at, m_miss, mask=m_out)
    tl.store(key_ptr + at, b_sort, mask=m_out)
    tl.atomic_add(locks + tl.maximum(b_slot, 0), tl.full((BLOCK_N,), 1, tl.int32), mask=m_held)
    tl.atomic_add(counts_ptr + c * 8, tl.sum(m_miss.to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + c * 8 + 1, tl.sum(m_held.to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + c * 8 + 5, tl.sum((m_held & (b_slot >= num_slots)).to(tl.int64), 0))


@triton.jit(do_not_specialize=["k", "search_steps"])  # per batch: one variant
def _assign_group_kernel(
    table_ptr, sorted_ptr, place_ptr, counts_ptr, k, search_steps, F: tl.constexpr,
    SHIFT: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Program (c, b): block b of cache c's misses in the sorted order (`PlanOps.assign_group`,
    `_assign_misses_kernel`'s placement with the cache's tensors read from the table): miss j
    is the r-th of its set's run (r found by a binary search, ``search_steps`` halvings) and
    takes the r-th unblocked way of its set by ``(score * W + way)``, if there is one."""
    c = tl.program_id(0).to(tl.int64)
    row = _plan_row(table_ptr, c, F)
    _, _, _, keys, scores, locks, batch_of, dirty, _, W, set_base, batch_seq, _, _, _, _ = row
    lo = _misses_before(counts_ptr, c, k)
    m = tl.load(counts_ptr + c * 8)
    o_m = lo + tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_m = o_m < lo + m
    b_g = tl.load(sorted_ptr + o_m, mask=m_m, other=0) >> SHIFT  # the set, the group's number
    b_lo = tl.zeros((BLOCK_M,), dtype=tl.int64) + lo
    b_hi = o_m
    for _ in range(search_steps):  # the run's start: the first miss of the same set
        m_open = m_m & (b_lo < b_hi)
        b_mid = (b_lo + b_hi) >> 1
        b_v = tl.load(sorted_ptr + b_mid, mask=m_open, other=0) >> SHIFT
        b_lo = tl.where(m_open & (b_v < b_g), b_mid + 1, b_lo)
        b_hi = tl.where(m_open & (b_v >= b_g), b_mid, b_hi)
    b_rank = o_m - b_lo  # [BLOCK_M]
    b_place, m_placed, m_held, m_dirty = _take_ways(
        keys, scores, locks, batch_of, dirty, b_g - set_base, b_rank, m_m, W, batch_seq, BLOCK_W
    )
    tl.store(place_ptr + o_m, b_place, mask=m_m)
    tl.atomic_add(counts_ptr + c * 8 + 2, tl.sum(m_placed.to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + c * 8 + 3, tl.sum(m_held.to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + c * 8 + 4, tl.sum(m_dirty.to(tl.int64), axis=0))


@triton.jit(do_not_specialize=["k"])  # per group: one variant
def _reserve_group_kernel(
    table_ptr, counts_ptr, ids_ptr, slots_ptr, missing_ptr, order_ptr, place_ptr, unplaced_ptr,
    old_keys_ptr, old_scores_ptr, old_dirty_ptr, resident_ptr, write_back_ptr, k,
    F: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program (c, b): block b of cache c's misses reserved (`_reserve_placed_kernel`, the
    slot also scored with the clock; a miss without a way takes a free scratch row, its rank
    among those from ``unplaced``) and block b of its hits in the cache proper scored with
    the clock, where every miss of the cache got a way or free rows were given; else the
    block's flags cleared and nothing changed.
    Misses and hits touch distinct slots (a hit's way is locked: no miss takes it)."""
    c = tl.program_id(0).to(tl.int64)
    row = _plan_row(table_ptr, c, F)
    _, n, start, keys, scores, locks, _, dirty, _, _, _, _, tick, _, num_slots, free = row
    lo = _misses_before(counts_ptr, c, k)
    m = tl.load(counts_ptr + c * 8)
    whole = (tl.load(counts_ptr + c * 8 + 2) == m) | (free != 0)
    o = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_j = o < m
    m_do = m_j & whole
    j = lo + o
    b_pos = tl.load(order_ptr + j, mask=m_do, other=0)
    b_slot = tl.load(place_ptr + j, mask=m_do, other=0)
    # A miss left without a way: the r-th of them in the cache takes its r-th free row.
    m_left = m_do & (b_slot < 0)
    b_rank = tl.load(unplaced_ptr + j, mask=m_left, other=0) - tl.load(
        unplaced_ptr + lo, mask=(m > 0) & (free != 0), other=0
    )
    b_free = tl.load(free.to(tl.pointer_type(tl.int64)) + b_rank, mask=m_left, other=0)
    b_slot = tl.where(m_left, b_free, b_slot)
    m_main = m_do & (b_slot < num_slots)
    b_key = tl.load(keys + b_slot, mask=m_do, other=-1)
    b_dirty = tl.load(dirty + b_slot, mask=m_do, other=0) != 0
    b_resident = m_do & (b_key >= 0)
    tl.store(old_keys_ptr + j, b_key, mask=m_do)
    tl.store(old_scores_ptr + j, tl.load(scores + b_slot, mask=m_main, other=0), mask=m_do)
    tl.store(old_dirty_ptr + j, b_dirty, mask=m_do)
    tl.store(resident_ptr + j, b_resident, mask=m_j)
    tl.store(write_back_ptr + j, b_resident & b_dirty, mask=m_j)
    tl.store(slots_ptr + b_pos, b_slot, mask=m_do)
    tl.store(keys + b_slot, tl.load(ids_ptr + b_pos, mask=m_do, other=0), mask=m_do)
    tl.store(dirty + b_slot, tl.zeros((BLOCK_N,), dtype=tl.int8), mask=m_do)
    tl.atomic_add(locks + b_slot, tl.full((BLOCK_N,), 1, tl.int32), mask=m_do)
    b_tick = tl.zeros((BLOCK_N,), dtype=tl.int64) + tick
    tl.store(scores + b_slot, b_tick, mask=m_main)
    m_i = (o < n) & whole
    m_hit = m_i & (tl.load(missing_ptr + start + o, mask=m_i, other=1) == 0)
    b_hit = tl.load(slots_ptr + start + o, mask=m_hit, other=0)
    tl.store(scores + b_hit, b_tick, mask=m_hit & (b_hit < num_slots))  # not a scratch row


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def set_index_triton(ids: torch.Tensor, num_sets: int) -> torch.Tensor:
    """Launch `_set_index_kernel`. ids int64 of any shape; returns int64 of the same shape."""
    flat = ids.reshape(-1).contiguous()
    sets = torch.empty_like(flat)
    n = flat.numel()
    if n:
        grid = (triton.cdiv(n, _SET_INDEX_BLOCK),)
        _set_index_kernel[grid](flat, sets, n, num_sets, BLOCK_N=_SET_INDEX_BLOCK)
    return sets.view(ids.shape)


def cache_lookup_triton(
    keys: torch.Tensor, ids: torch.Tensor, sets: torch.Tensor, slots: bool = False
) -> torch.Tensor:
    """Launch `_cache_lookup_kernel`. keys int64 [S, W] (any strides), ids/sets int64 [n];
    ``slots``: each hit's slot (``set * W + way``), not its way."""
    ids = ids.contiguous()
    sets = sets.contiguous()
    n = ids.numel()
    S, W = keys.shape
    ways = torch.empty_like(ids)
    if n:
        block_w = min(triton.next_power_of_2(W), _LOOKUP_MAX_BLOCK_W)
        block_n = _LOOKUP_ELEMS // block_w  # fixed per layout: never a batch's count
        grid = (triton.cdiv(n, block_n),)
        _cache_lookup_kernel[grid](
            keys,
            ids,
            sets,
            ways,
            n,
            S,
            W,
            keys.stride(0),
            keys.stride(1),
            BLOCK_N=block_n,
            BLOCK_W=block_w,
            SLOTS=slots,
        )
    return ways


def assign_ways_triton(
    scores: torch.Tensor, blocked: torch.Tensor, miss_sets: torch.Tensor
) -> torch.Tensor:
    """Launch `_assign_ways_kernel`. scores int64 / blocked bool [S, W], miss_sets int64 [m].

    Needs no host sync: runs are found in the kernel, and overflow slots keep the -1 fill.
    """
    miss_sets = miss_sets.contiguous()
    m = miss_sets.numel()
    S, W = scores.shape
    ways = torch.full((m,), -1, dtype=torch.int64, device=scores.device)
    if m:
        blocked_u8 = blocked.view(torch.uint8)  # same bytes; a plain integer pointer in Triton
        block_w = triton.next_power_of_2(W)
        block_i = min(block_w, _ASSIGN_MAX_BLOCK_I)
        block_t = max(1, min(_ASSIGN_ELEMS // (block_w * block_i), _ASSIGN_MAX_BLOCK_T))
        grid = (triton.cdiv(m, block_t),)
        _assign_ways_kernel[grid](
            scores,
            blocked_u8,
            miss_sets,
            ways,
            m,
            S,
            W,
            scores.stride(0),
            scores.stride(1),
            blocked_u8.stride(0),
            blocked_u8.stride(1),
            BLOCK_T=block_t,
            BLOCK_W=block_w,
            BLOCK_I=block_i,
        )
    return ways


def assign_misses_triton(
    miss_sets: torch.Tensor,
    scores: torch.Tensor,
    locks: torch.Tensor,
    batch_of: torch.Tensor,
    keys: torch.Tensor,
    dirty: torch.Tensor,
    ways: int,
    batch_seq: int,
    num_misses: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The place of each miss (`_assign_misses_kernel`) of a cache whose slot ``s * ways + w``
    holds ``scores``, ``locks``, ``batch_of``, ``keys`` and ``dirty`` (1-D, at least every
    set's ways), with its counts: ``(place, counts)``, int64 ``[m]`` (slot or -1) and int64
    ``[3]`` (placed, holding a row, dirty). One launch and one zeroed buffer, no host read:
    what `SetPlanner._choose_ways` computes with `PlanOps.assign_ways` and about 25 torch ops
    around it. Only the device path's misses use it (Triton; the torch ops are its
    specification).

    ``num_misses`` (a one-value integer tensor on the device, not read here): only the first
    that many of ``miss_sets`` are misses, sorted by set; the rest of ``place`` is -1 and
    counts nothing. A plan launches this before it has read its number of misses, and reads
    the counts with it (`SetPlanner.plan_sets`). None: every entry is a miss."""
    m = miss_sets.numel()
    device = miss_sets.device
    place = torch.empty(m, dtype=torch.int64, device=device)
    counts = torch.zeros(3, dtype=torch.int64, device=device)
    if num_misses is None:
        num_misses = torch.full((1,), m, dtype=torch.int64, device=device)
    if m:
        block_w = triton.next_power_of_2(ways)
        block_m = max(1, min(128, 4096 // (block_w * block_w)))
        _assign_misses_kernel[(triton.cdiv(m, block_m),)](
            miss_sets, scores, locks, batch_of, keys, dirty, place, counts,
            num_misses.reshape(1).to(torch.int64), m, m.bit_length(), batch_seq,
            W=ways, BLOCK_W=block_w, BLOCK_M=block_m,
        )  # fmt: skip
    return place, counts


def probe_group_triton(table: PlanTable) -> GroupProbe:
    """Launch `_probe_group_kernel` (`PlanOps.probe_group`): one launch and one zeroed count
    buffer for every cache of ``table``."""
    total, device = table.total, table.device
    ids = torch.empty(total, dtype=torch.int64, device=device)
    slots, keys = torch.empty_like(ids), torch.empty_like(ids)
    missing = torch.empty(total, dtype=torch.bool, device=device)
    counts = torch.zeros(len(table.caches), 8, dtype=torch.int64, device=device)
    block_w = triton.next_power_of_2(table.max_ways)
    block_n = max(1, _LOOKUP_ELEMS // block_w)  # fixed per layout: never a batch's count
    grid = (len(table.caches), max(1, triton.cdiv(table.max_ids + 1, block_n)))
    _probe_group_kernel[grid](
        table.table, ids, slots, missing, keys, counts, table.total_sets << KEY_SHIFT,
        F=PLAN_FIELDS, SHIFT=KEY_SHIFT, BLOCK_N=block_n, BLOCK_W=block_w,
    )  # fmt: skip
    return GroupProbe(ids, slots, missing, keys, counts)


def assign_group_triton(
    table: PlanTable, sorted_keys: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Launch `_assign_group_kernel` (`PlanOps.assign_group`): one launch, no host read."""
    place = torch.empty_like(sorted_keys)
    block_w = triton.next_power_of_2(table.max_ways)
    block_m = max(1, min(128, _ASSIGN_ELEMS // (block_w * block_w)))
    grid = (len(table.caches), max(1, triton.cdiv(table.max_ids, block_m)))
    _assign_group_kernel[grid](
        table.table, sorted_keys, place, counts, len(table.caches),
        table.max_ids.bit_length(), F=PLAN_FIELDS, SHIFT=KEY_SHIFT, BLOCK_W=block_w,
        BLOCK_M=block_m,
    )  # fmt: skip
    return place


def reserve_group_triton(
    table: PlanTable, probe: GroupProbe, order: torch.Tensor, place: torch.Tensor,
    unplaced: torch.Tensor | None = None,
) -> GroupReserve:  # fmt: skip
    """Launch `_reserve_group_kernel` (`PlanOps.reserve_group`): one launch."""
    n = place.numel()
    old_keys, old_scores = torch.empty_like(place), torch.empty_like(place)
    # Apart, not rows of one tensor: each keeps its pointer alignment whatever n is.
    old_dirty, resident, write_back = (
        torch.empty(n, dtype=torch.bool, device=place.device) for _ in range(3)
    )
    grid = (len(table.caches), max(1, triton.cdiv(table.max_ids, _SET_INDEX_BLOCK)))
    _reserve_group_kernel[grid](
        table.table, probe.counts, probe.ids, probe.slots, probe.missing, order, place,
        place if unplaced is None else unplaced,  # not read without a free row
        old_keys, old_scores, old_dirty, resident, write_back, len(table.caches),
        F=PLAN_FIELDS, BLOCK_N=_SET_INDEX_BLOCK,
    )  # fmt: skip
    return GroupReserve(old_keys, old_scores, old_dirty, resident, write_back)


# ----------------------------------------------------------------------------------------------
# the implementation
# ----------------------------------------------------------------------------------------------


class TritonPlan(SpecPlan):
    """The plan family on the Triton kernels (`PlanOps`): the device path's, on a GPU and
    under ``EMBCACHE_BACKEND=triton`` (the interpreter on CPU tensors)."""

    name = "triton"
    places_misses = True

    def _set_index(self, ids: torch.Tensor, num_sets: int) -> torch.Tensor:
        return set_index_triton(ids, num_sets)

    def _cache_lookup(
        self, keys: torch.Tensor, ids: torch.Tensor, sets: torch.Tensor, as_slots: bool
    ) -> torch.Tensor:
        return cache_lookup_triton(keys, ids, sets, as_slots)

    def _assign_ways(
        self,
        scores: torch.Tensor,
        blocked: torch.Tensor,
        miss_sets: torch.Tensor,
        num_runs: int | None,
    ) -> torch.Tensor:
        return assign_ways_triton(scores, blocked, miss_sets)

    def add_at_held(self, t: torch.Tensor, slots: torch.Tensor, delta: int) -> None:
        if t.dtype != torch.int32:
            super().add_at_held(t, slots, delta)
            return
        n = slots.numel()
        if n:
            grid = (triton.cdiv(n, _SET_INDEX_BLOCK),)
            _add_at_held_kernel[grid](t, slots, n, delta, BLOCK_N=_SET_INDEX_BLOCK)

    def reserve_placed(
        self, ids: torch.Tensor, slots: torch.Tensor, order_pos: torch.Tensor,
        place: torch.Tensor, slot_keys: torch.Tensor, dirty: torch.Tensor,
        scores: torch.Tensor, locks: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        if (
            locks.dtype != torch.int32
            or slot_keys.dtype != torch.int64
            or scores.dtype != torch.int64
            or dirty.dtype != torch.bool
        ):
            return super().reserve_placed(ids, slots, order_pos, place, slot_keys, dirty,
                                          scores, locks)  # fmt: skip
        m = place.numel()
        old_keys, old_scores = torch.empty_like(place), torch.empty_like(place)
        # Apart, not rows of one tensor: each keeps its pointer alignment whatever m is.
        old_dirty, resident, write_back = (
            torch.empty(m, dtype=torch.bool, device=place.device) for _ in range(3)
        )
        if m:
            _reserve_placed_kernel[(triton.cdiv(m, _SET_INDEX_BLOCK),)](
                ids, slots, order_pos, place, slot_keys, dirty, scores, locks, old_keys,
                old_scores, old_dirty, resident, write_back, m, BLOCK_N=_SET_INDEX_BLOCK,
            )  # fmt: skip
        return old_keys, old_scores, old_dirty, resident, write_back

    def lookup_counts(
        self, slots: torch.Tensor, num_slots: int, admitted: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        n = slots.numel()
        missing = torch.empty(n, dtype=torch.bool, device=slots.device)
        found = torch.zeros(4, dtype=torch.int64, device=slots.device)
        if n:
            grid = (triton.cdiv(n, _SET_INDEX_BLOCK),)
            _lookup_counts_kernel[grid](
                slots, admitted if admitted is not None else slots, missing, found, n, num_slots,
                HAS_ADMITTED=admitted is not None, BLOCK_N=_SET_INDEX_BLOCK,
            )  # fmt: skip
        return missing, list(found.unbind(0))[: 3 if admitted is None else 4]

    def _salted_mix64(self, ids: torch.Tensor, salt: int) -> torch.Tensor:
        flat = ids.contiguous().view(-1)
        out = torch.empty_like(flat)
        n = flat.numel()
        if n:
            grid = (triton.cdiv(n, _SET_INDEX_BLOCK),)
            _salted_mix64_kernel[grid](flat, out, n, salt, BLOCK_N=_SET_INDEX_BLOCK)
        return out.view(ids.shape)

    def _miss_keys(
        self, ids: torch.Tensor, miss_pos: torch.Tensor, salt: int, num_sets: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m = miss_pos.numel()
        # Three allocations, not rows of one: a row's start would be 16-byte aligned or not
        # with the parity of m, and Triton compiles a variant per pointer alignment.
        miss_ids, sets, key = (torch.empty(m, dtype=torch.int64, device=ids.device) for _ in "isk")
        if m:
            grid = (triton.cdiv(m, _SET_INDEX_BLOCK),)
            _miss_keys_kernel[grid](
                ids.contiguous(), miss_pos.contiguous(), miss_ids, sets, key, m, salt, num_sets,
                BLOCK_N=_SET_INDEX_BLOCK,
            )  # fmt: skip
        return miss_ids, sets, key

    def assign_misses(
        self,
        miss_sets: torch.Tensor,
        scores: torch.Tensor,
        locks: torch.Tensor,
        batch_of: torch.Tensor,
        keys: torch.Tensor,
        dirty: torch.Tensor,
        ways: int,
        batch_seq: int,
        num_misses: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return assign_misses_triton(
            miss_sets, scores, locks, batch_of, keys, dirty, ways, batch_seq, num_misses
        )

    def probe_group(self, table: PlanTable) -> GroupProbe:
        return probe_group_triton(table)

    def assign_group(
        self, table: PlanTable, sorted_keys: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        return assign_group_triton(table, sorted_keys, counts)

    def reserve_group(
        self, table: PlanTable, probe: GroupProbe, order: torch.Tensor, place: torch.Tensor,
        unplaced: torch.Tensor | None = None,
    ) -> GroupReserve:  # fmt: skip
        return reserve_group_triton(table, probe, order, place, unplaced)


IMPLEMENTATION: PlanOps = TritonPlan()  # checked against the protocol
