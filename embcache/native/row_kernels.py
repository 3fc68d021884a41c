"""The numba kernels that move rows behind `embcache.native` (imported only when numba can be:
see there for what each computes and which torch path it mirrors), and `group_by_table`, which
groups a tier transfer's ids by table for the grouped moves."""

from __future__ import annotations

import numpy as np

from embcache.native.bits import mix64
from embcache.native.jit import inline, jit
from embcache.native.prefetch import AHEAD, prefetch_item, prefetch_row

S40, LOW24 = np.uint64(40), np.uint64(0xFFFFFF)


@jit
def hashed_uniform(ids, salt, mid, half, out):
    """The hashed uniform initialiser (`kv.base.hashed_init`): value ``j`` of row ``ids[i]``
    from the top 24 bits of ``mix64(mix64(id ^ salt) + j)``, ``(2 u - 1) * half + mid`` in
    float64, rounded to float32 into ``out[i, j]``: the torch path's arithmetic, op for op, so
    the bits are the same."""
    dim = out.shape[1]
    usalt = np.uint64(salt)
    scale = 1.0 / (1 << 24)
    for i in range(out.shape[0]):
        h = mix64(np.uint64(ids[i]) ^ usalt)
        for j in range(dim):
            bits = (mix64(h + np.uint64(j)) >> S40) & LOW24
            unit = np.float64(bits) * scale
            out[i, j] = np.float32((2.0 * unit - 1.0) * half + mid)


@jit
def scatter_rows(dst, idx, src):
    width = src.shape[1]
    for i in range(idx.shape[0]):
        r = idx[i]
        for j in range(width):
            dst[r, j] = src[i, j]


@jit
def _first_out_of_range(idx, n):
    """The position of the first of ``idx`` outside ``[0, n)``, or -1."""
    for i in range(idx.shape[0]):
        if idx[i] < 0 or idx[i] >= n:
            return i
    return -1


@jit
def write_at(arr, idx, value, add):
    """``arr[idx] = value`` or, with ``add``, ``arr[idx] += value`` (a repeated position added
    to once per occurrence), for 1-D ``arr``; every position is checked first (nothing is
    written when one is out of range). Returns -1, or the position of the first bad one."""
    bad = _first_out_of_range(idx, arr.shape[0])
    if bad >= 0:
        return bad
    m = idx.shape[0]
    for i in range(m):
        if i + AHEAD < m:
            prefetch_item(arr, idx[i + AHEAD])
        if add:
            arr[idx[i]] += value
        else:
            arr[idx[i]] = value
    return -1


@inline
def _split_row(weights, state, s, rows, r):
    """``weights[s], state[s] = rows[r, :dim], rows[r, dim:]``."""
    dim = weights.shape[1]
    for j in range(dim):
        weights[s, j] = rows[r, j]
    for j in range(state.shape[1]):
        state[s, j] = rows[r, dim + j]


@inline
def _join_row(weights, state, s, rows, r):
    """``rows[r] = [weights[s] | state[s]]``."""
    dim = weights.shape[1]
    for j in range(dim):
        rows[r, j] = weights[s, j]
    for j in range(state.shape[1]):
        rows[r, dim + j] = state[s, j]


@jit
def scatter_split(weights, state, slots, rows):
    """``weights[slots], state[slots] = rows[:, :dim], rows[:, dim:]`` (float32 rows)."""
    for i in range(slots.shape[0]):
        _split_row(weights, state, slots[i], rows, i)


@jit
def gather_join(weights, state, slots, out):
    """``out = [weights[slots] | state[slots]]`` (float32 rows)."""
    n = slots.shape[0]
    for i in range(n):
        if i + AHEAD < n:
            prefetch_row(weights, slots[i + AHEAD])
            prefetch_row(state, slots[i + AHEAD])
        _join_row(weights, state, slots[i], out, i)


@jit
def gather_created(rows, created, ids, out):
    """``out = rows[ids]``; returns how many of ``ids`` are not ``created``."""
    width = rows.shape[1]
    absent = 0
    n = ids.shape[0]
    for i in range(n):
        if i + AHEAD < n:
            prefetch_row(rows, ids[i + AHEAD])
            prefetch_item(created, ids[i + AHEAD])
        r = ids[i]
        if not created[r]:
            absent += 1
        for j in range(width):
            out[i, j] = rows[r, j]
    return absent


@jit
def scatter_created(rows, created, ids, src):
    """``rows[ids] = src`` and ``created[ids] = True``."""
    width = rows.shape[1]
    for i in range(ids.shape[0]):
        r = ids[i]
        created[r] = True
        for j in range(width):
            rows[r, j] = src[i, j]


@jit
def gather_tables(tables, created, limits, ids, bounds, out):
    """`gather_created` over several dense tables in one call: ids ``bounds[t] ..
    bounds[t + 1]`` are rows of ``tables[t]`` (its ``created`` mask ``created[t]``, ids valid
    below ``limits[t]``), gathered into ``out`` in order. Returns how many are not created, or
    ``-1 - i`` for the first id ``i`` out of its table's range (nothing is written then)."""
    bad = _first_bad_of_tables(limits, ids, bounds)
    if bad >= 0:
        return -1 - bad
    absent = 0
    for t in range(len(tables)):
        lo, hi = bounds[t], bounds[t + 1]
        absent += gather_created(tables[t], created[t], ids[lo:hi], out[lo:hi])
    return absent


@jit
def scatter_tables(tables, created, limits, ids, bounds, src):
    """`scatter_created` over several dense tables in one call (ids as `gather_tables`
    takes them): every id is checked first, so that a bad one writes nothing. Returns -1,
    or the position of the first id out of its table's range."""
    bad = _first_bad_of_tables(limits, ids, bounds)
    if bad >= 0:
        return bad
    for t in range(len(tables)):
        lo, hi = bounds[t], bounds[t + 1]
        scatter_created(tables[t], created[t], ids[lo:hi], src[lo:hi])
    return -1


@jit
def gather_tables_into(tables, created, limits, ids, bounds, weights, state, slots):
    """`gather_tables` straight into a cache's slot storage: the row of id ``i`` goes to
    ``weights[slots[i]]`` (its first ``dim`` values) and ``state[slots[i]]`` (the rest), no
    rows array between the two. Every id and slot is checked first, and nothing is written
    unless all rows exist. Returns 0 when every row was moved; else, with nothing written,
    ``-1 - i`` for the first id ``i`` out of its table's range or its slot out of the
    storage, or how many rows are not created."""
    bad = _first_bad_of_tables(limits, ids, bounds)
    if bad < 0:
        bad = _first_out_of_range(slots, weights.shape[0])
    if bad >= 0:
        return -1 - bad
    absent = 0
    for t in range(len(tables)):  # ids come ascending in each table: a near-sequential pass
        made = created[t]
        for i in range(bounds[t], bounds[t + 1]):
            if not made[ids[i]]:
                absent += 1
    if absent:
        return absent
    for t in range(len(tables)):
        rows = tables[t]
        lo, hi = bounds[t], bounds[t + 1]
        for i in range(lo, hi):
            if i + AHEAD < hi:  # ids past ``hi`` are rows of the next table
                prefetch_row(rows, ids[i + AHEAD])
            _split_row(weights, state, slots[i], rows, ids[i])
    return 0


@jit
def scatter_tables_from(tables, created, limits, ids, bounds, weights, state, slots):
    """`scatter_tables` straight out of a cache's slot storage: id ``i``'s row is
    ``weights[slots[i]]`` then ``state[slots[i]]``. Every id and slot is checked first (a bad
    one writes nothing). Returns -1, or the position of the first id out of its table's range
    or slot out of the storage."""
    bad = _first_bad_of_tables(limits, ids, bounds)
    if bad < 0:
        bad = _first_out_of_range(slots, weights.shape[0])
    if bad >= 0:
        return bad
    n = ids.shape[0]
    for t in range(len(tables)):
        rows = tables[t]
        made = created[t]
        for i in range(bounds[t], bounds[t + 1]):
            if i + AHEAD < n:  # the slots read ahead may be the next table's: all one storage
                prefetch_row(weights, slots[i + AHEAD])
                prefetch_item(state, slots[i + AHEAD])
            made[ids[i]] = True
            _join_row(weights, state, slots[i], rows, ids[i])
    return -1


@jit
def _first_bad_of_tables(limits, ids, bounds):
    """The position of the first id out of its table's range (``ids[bounds[t] : bounds[t +
    1]]`` below ``limits[t]``), or -1."""
    for t in range(limits.shape[0]):
        bad = _first_out_of_range(ids[bounds[t] : bounds[t + 1]], limits[t])
        if bad >= 0:
            return bounds[t] + bad
    return -1


@jit
def bags_sample_major(slots, inverse, offsets, batch_size, weights, out, out_offsets,
                      out_weights):  # fmt: skip
    """The TBE step's indices (`IdsOps.bags_sample_major`): bag ``(f, b)`` of a
    batch held feature-major (``offsets[f * B + b]``) moved to ``b * F + f``, each value
    replaced by its slot ``slots[inverse[i]]`` into ``out``, its per-sample weight (when
    ``weights`` is not empty) into ``out_weights``, and the new bag offsets into
    ``out_offsets`` ``[F * B + 1]``."""
    num_bags = offsets.shape[0] - 1
    features = num_bags // batch_size
    weighted = weights.shape[0] > 0
    out_offsets[0] = 0
    if num_bags == 0:
        return
    length = offsets[1] - offsets[0]
    same = True
    for k in range(1, num_bags):
        same &= offsets[k + 1] - offsets[k] == length
    if same and not weighted:  # bags of one length: loops of known shape (one id per bag...)
        for k in range(num_bags + 1):
            out_offsets[k] = k * length
        for f in range(features):
            for b in range(batch_size):
                src = (f * batch_size + b) * length
                dst = (b * features + f) * length
                for v in range(length):
                    out[dst + v] = slots[inverse[src + v]]
        return
    at = 0
    for b in range(batch_size):
        for f in range(features):
            bag = f * batch_size + b
            for i in range(offsets[bag], offsets[bag + 1]):
                out[at] = slots[inverse[i]]
                if weighted:
                    out_weights[at] = weights[i]
                at += 1
            out_offsets[b * features + f + 1] = at


@jit
def group_by_table(fused, fusion_k, ascending, counts, order, raw):
    """Fused ids grouped by table (`cache.transfer.TierTransfer._grouped`): ``counts[t]``
    (all zero on entry) gets the number of ids of table ``t``. Returns 0 when ``fused`` is
    sorted already (``raw`` gets each id's raw part, in place: nothing to move); 1 when it is
    not and ``ascending`` is False (``order`` gets the positions grouped by table, each
    table's in their order in ``fused``, and ``raw`` the raw ids in that order: a counting
    sort); 2 when it is not and ``ascending`` asks for a sort (nothing more is written)."""
    n = fused.shape[0]
    mask = (np.int64(1) << fusion_k) - 1
    ordered = True
    for i in range(n):
        counts[fused[i] >> fusion_k] += 1
        if i and fused[i] < fused[i - 1]:
            ordered = False
    if ordered:
        for i in range(n):
            raw[i] = fused[i] & mask
        return 0
    if ascending:
        return 2
    cursor = np.empty(counts.shape[0], np.int64)
    at = 0
    for t in range(counts.shape[0]):
        cursor[t] = at
        at += counts[t]
    for i in range(n):
        t = fused[i] >> fusion_k
        order[cursor[t]] = i
        raw[cursor[t]] = fused[i] & mask
        cursor[t] += 1
    return 1
