"""The numba kernels of a batch's dedup and grouping behind `embcache.native.plan` (imported
only when numba can be: see there for what each computes and which torch path it mirrors)."""

from __future__ import annotations

import numpy as np

from embcache.native.bits import DEBRUIJN, DEBRUIJN_BITS, popcount
from embcache.native.jit import jit


@jit
def unique_rows(ids, row_offset, fusion_k, bits, word_rank, row_starts, row_tables):
    """``torch.unique(ids, sorted=True, return_inverse=True)`` for fused ids of bounded
    tables, through a bitmap over the tables' rows (``bits``, all zero, left all zero) and a
    rank per word of it (``word_rank``, int32, overwritten where the batch has rows): one
    pass marks the rows, one over the marked words lists them ascending (the order of fused
    ids: tables in ascending index, rows after one another), one gives each id its rank
    (`_list_marked`). ``row_starts`` / ``row_tables``: the first row of each table and its
    index, ascending."""
    n = ids.shape[0]
    mask = (np.int64(1) << fusion_k) - 1
    rows = np.empty(n, np.int64)
    lo = bits.shape[0]
    hi = -1
    one = np.uint64(1)
    for i in range(n):
        key = ids[i]
        r = row_offset[key >> fusion_k] + (key & mask)
        rows[i] = r
        word = r >> 6
        bits[word] |= one << np.uint64(r & 63)
        lo = min(lo, word)
        hi = max(hi, word)
    return _list_marked(rows, lo, hi, fusion_k, bits, word_rank, row_starts, row_tables)


@jit
def unique_values(values, bounds, bases, limits, fusion_k, bits, word_rank, row_starts,
                  row_tables):  # fmt: skip
    """`unique_rows` of raw ids, checked in the same pass: the values of feature ``f``,
    ``values[bounds[f] : bounds[f + 1]]``, are ids of the table whose first row (among the
    tables' rows) is ``bases[f]``, each valid when ``0 <= id < limits[f]``. Returns
    ``(unique fused ids, inverse, -1)``, or ``(empty, empty, i)`` for the first value ``i``
    out of its range, or ``(empty, empty, len(values))`` when the bounds do not cover the
    values; ``bits`` is left all zero either way."""
    n = values.shape[0]
    n_features = bases.shape[0]
    rows = np.empty(n, np.int64)
    lo = bits.shape[0]
    hi = -1
    one = np.uint64(1)
    bad = np.int64(-1)
    if bounds[0] != 0 or bounds[n_features] != n:
        bad = np.int64(n)
    done = 0
    for f in range(n_features):
        if bad >= 0:
            break
        start = bounds[f]
        stop = bounds[f + 1]
        if stop < start:
            bad = np.int64(n)
            break
        base = bases[f]
        limit = limits[f]
        for i in range(start, stop):
            v = np.int64(values[i])
            if v < 0 or v >= limit:
                bad = np.int64(i)
                break
            r = base + v
            rows[i] = r
            word = r >> 6
            bits[word] |= one << np.uint64(r & 63)
            lo = min(lo, word)
            hi = max(hi, word)
            done = i + 1
    if bad >= 0:
        for i in range(done):  # the rows marked before the bad value: clear again
            bits[rows[i] >> 6] = 0
        empty = np.empty(0, np.int64)
        return empty, empty, bad
    unique, inverse = _list_marked(rows, lo, hi, fusion_k, bits, word_rank, row_starts,
                                   row_tables)  # fmt: skip
    return unique, inverse, bad


@jit
def _list_marked(rows, lo, hi, fusion_k, bits, word_rank, row_starts, row_tables):
    """The passes after marking ``rows`` in ``bits`` (words ``lo .. hi``): the marked rows
    listed ascending as fused ids, each word's ``word_rank`` set to the marked rows before it,
    then each of ``rows``' rank (its word's, plus the marked bits below it in the word), then
    ``bits`` cleared. The bitmap and the ranks (a bit, and 4 bytes per 64 rows) stay in the
    CPU's caches, where a rank per row would be read and written at random in memory."""
    n = rows.shape[0]
    one = np.uint64(1)
    unique = np.empty(n, np.int64)
    u = 0
    table = 0
    n_tables = row_starts.shape[0]
    for word in range(lo, hi + 1):
        w = bits[word]
        word_rank[word] = u
        while w != 0:
            low = w & (~w + one)
            r = (word << 6) + DEBRUIJN_BITS[np.int64((low * DEBRUIJN) >> np.uint64(58))]
            w ^= low
            while table + 1 < n_tables and row_starts[table + 1] <= r:
                table += 1
            unique[u] = (r - row_starts[table]) | (row_tables[table] << fusion_k)
            u += 1
    inverse = np.empty(n, np.int64)
    for i in range(n):
        r = rows[i]
        word = r >> 6
        below = (one << np.uint64(r & 63)) - one
        inverse[i] = word_rank[word] + np.int64(popcount(bits[word] & below))
    for word in range(lo, hi + 1):
        bits[word] = 0
    return unique[:u], inverse


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
