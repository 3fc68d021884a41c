"""The numba kernels behind `embcache.native` (imported only when numba can be: see
there for what each computes and which torch path it mirrors)."""

from __future__ import annotations

import numpy as np
from numba import njit

from embcache.native.bits import popcount
from embcache.native.prefetch import AHEAD, prefetch_item, prefetch_row, prefetch_span

_jit = njit(nogil=True, cache=True, boundscheck=False)

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
LOW63 = np.uint64(0x7FFFFFFFFFFFFFFF)
S27, S30, S31 = np.uint64(27), np.uint64(30), np.uint64(31)
S40, LOW24 = np.uint64(40), np.uint64(0xFFFFFF)
BLOCKED = np.iinfo(np.int64).max  # a way no miss may take (scores stay below 2**57)
# Misses ahead (in set order) whose set's ways the plan asks for: a set costs about as many
# nanoseconds as memory takes to answer, so a few sets ahead is enough.
_SETS_AHEAD = 6


@_jit
def mix64(x):  # x: uint64; splitmix64's finaliser (`embcache.hashing.mix64`)
    z = x + GOLDEN
    z = (z ^ (z >> S30)) * MIX1
    z = (z ^ (z >> S27)) * MIX2
    return z ^ (z >> S31)


@_jit
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


@_jit
def scatter_rows(dst, idx, src):
    width = src.shape[1]
    for i in range(idx.shape[0]):
        r = idx[i]
        for j in range(width):
            dst[r, j] = src[i, j]


@_jit
def first_bad_key(keys, fusion_k, limits):
    """The position of the first fused id of ``keys`` that is negative, of a table index past
    ``limits`` or with a raw id at or past its table's ``limits[t]``; -1 when all are rows."""
    mask = (np.int64(1) << fusion_k) - 1
    n_tables = limits.shape[0]
    for i in range(keys.shape[0]):
        k = keys[i]
        t = k >> fusion_k
        if k < 0 or t >= n_tables or (k & mask) >= limits[t]:
            return i
    return -1


@_jit
def _first_out_of_range(idx, n):
    """The position of the first of ``idx`` outside ``[0, n)``, or -1."""
    for i in range(idx.shape[0]):
        if idx[i] < 0 or idx[i] >= n:
            return i
    return -1


@_jit
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


@_jit
def unlock(locks, slots):
    """Drop one lock from each of ``slots`` (distinct) when every one of them is in range and
    locked; else change nothing. Returns -1, or the position of the first slot that is out of
    range or not locked."""
    bad = _first_not_locked(locks, slots)
    if bad >= 0:
        return bad
    for i in range(slots.shape[0]):
        locks[slots[i]] -= 1
    return -1


@_jit
def unlock_dirty(locks, dirty, slots):
    """`unlock`, each slot also marked ``dirty`` in the same pass (a batch's rows after its
    update): nothing changes unless every slot is in range and locked. Returns as `unlock`."""
    bad = _first_not_locked(locks, slots)
    if bad >= 0:
        return bad
    for i in range(slots.shape[0]):
        s = slots[i]
        locks[s] -= 1
        dirty[s] = True
    return -1


@_jit
def _first_not_locked(locks, slots):
    """The position of the first of ``slots`` out of ``locks``' range or not locked, or -1."""
    n = locks.shape[0]
    m = slots.shape[0]
    for i in range(m):
        if i + AHEAD < m:
            prefetch_item(locks, slots[i + AHEAD])
        s = slots[i]
        if s < 0 or s >= n or locks[s] <= 0:
            return i
    return -1


@njit(nogil=True, cache=True, boundscheck=False, inline="always")  # inlined in both sorts
def _bucket_by_set(sets, num_sets, carry):
    """A counting sort of misses by set: ``(start, order, keys)``, the misses of set ``s`` at
    ``order[start[s] : start[s + 1]]``, their positions ascending (stable), and ``carry`` of
    each beside it in ``keys`` (written in the same pass, so that a sort within a set reads
    contiguous memory instead of following ``order``)."""
    m = sets.shape[0]
    start = np.zeros(num_sets + 1, np.int64)
    for j in range(m):
        start[sets[j] + 1] += 1
    for s in range(num_sets):
        start[s + 1] += start[s]
    order = np.empty(m, np.int64)
    keys = np.empty(m, np.int64)
    cursor = start[:-1].copy()
    for j in range(m):
        at = cursor[sets[j]]
        order[at] = j
        keys[at] = carry[j]
        cursor[sets[j]] = at + 1
    return start, order, keys


@_jit
def _by_set(sets, shuffle, num_sets):
    """The order of misses by ``(set, shuffle, position)``: a counting sort by set when the
    sets are few for the misses, else a stable sort of ``set << 20 | shuffle``."""
    m = sets.shape[0]
    if num_sets > 8 * m:
        return np.argsort((sets << 20) | shuffle, kind="mergesort")
    start, order, keys = _bucket_by_set(sets, num_sets, shuffle)
    # Within a set (a few misses), by shuffle: an insertion sort, stable.
    for s in range(num_sets):
        lo = start[s]
        for a in range(lo + 1, start[s + 1]):
            key = keys[a]
            item = order[a]
            b = a - 1
            while b >= lo and keys[b] > key:
                keys[b + 1] = keys[b]
                order[b + 1] = order[b]
                b -= 1
            keys[b + 1] = key
            order[b + 1] = item
    return order


@_jit
def _lookup(ids, where, row_offset, fusion_k, slots):
    """Each id's slot through the row index into ``slots`` (-1: a miss); returns the misses."""
    n = ids.shape[0]
    mask = (np.int64(1) << fusion_k) - 1
    m = 0
    for i in range(n):
        if i + AHEAD < n:
            ahead = ids[i + AHEAD]
            prefetch_item(where, row_offset[ahead >> fusion_k] + (ahead & mask))
        key = ids[i]
        s = np.int64(where[row_offset[key >> fusion_k] + (key & mask)])
        slots[i] = s
        if s < 0:
            m += 1
    return m


@_jit
def _lock_hits(slots, locks, m):
    """Lock the hits of ``slots`` (which has ``m`` misses); returns the misses' positions,
    ascending."""
    n = slots.shape[0]
    miss_pos = np.empty(m + 1, np.int64)  # one more: the loop below writes past the last
    # Branch-free (hit or miss is a coin toss the CPU cannot predict): each position is
    # written and kept only by a miss; a hit adds its lock, a miss adds 0 to slot 0's.
    k = 0
    for i in range(n):
        if i + AHEAD < n:
            prefetch_item(locks, max(slots[i + AHEAD], 0))
        s = slots[i]
        miss = s < 0
        miss_pos[k] = i
        k += miss
        locks[max(s, 0)] += np.int32(not miss)  # the ways this batch hits are as good as locked
    return miss_pos[:m]


@_jit
def _choose_ways(sets, order, scores, locks, batch_of, ways, batch_seq, freq, lfu):
    """The slot each miss takes, in ``order`` (by set), -1 where its set has no free way:
    the k-th miss of a set the k-th of its ways by (blocked, score, way). ``lfu``: a miss
    whose way holds a row of a score no lower than its frequency ``freq`` takes none (it is
    served from scratch), the way staying taken."""
    m = order.shape[0]
    by_set = np.empty(m, np.int64)  # the misses' sets in that order
    for j in range(m):
        by_set[j] = sets[order[j]]
    place = np.empty(m, np.int64)
    best_first = np.empty(ways, np.int64)
    j = 0
    while j < m:
        s = by_set[j]
        end = j + 1
        while end < m and by_set[end] == s:
            end += 1
        if end + _SETS_AHEAD < m:  # the ways of a set a few ahead: their lines on the way
            later = by_set[end + _SETS_AHEAD] * ways
            prefetch_span(scores, later, ways)
            prefetch_span(locks, later, ways)
            prefetch_span(batch_of, later, ways)
        # The set's ways by (blocked, score, way): the k-th miss takes the k-th free one.
        base = s * ways
        # Branch-free loops over the ways, which the compiler vectorises: each way's key
        # (score * ways + way, distinct) or BLOCKED, then the least key for each miss.
        for w in range(ways):
            slot = base + w
            key = scores[slot] * ways + w
            blocked = (locks[slot] > 0) | (batch_of[slot] == batch_seq)
            best_first[w] = BLOCKED if blocked else key
        if ways == 32:  # the default: a loop of known length, and a mask for the modulo
            for q in range(j, end):
                least = BLOCKED
                for w in range(32):
                    least = min(least, best_first[w])
                place[q] = -1 if least == BLOCKED else base + (least & 31)
                best_first[least & 31] = BLOCKED  # (all blocked already when least is)
        else:
            for q in range(j, end):
                least = BLOCKED
                for w in range(ways):
                    least = min(least, best_first[w])
                if least == BLOCKED:
                    place[q] = -1
                else:
                    w = least % ways  # the way (Python's modulo: an empty way's key is < 0)
                    place[q] = base + w
                    best_first[w] = BLOCKED
        if lfu:
            for q in range(j, end):
                if place[q] >= 0 and scores[place[q]] >= freq[order[q]]:
                    place[q] = -1
        j = end
    return place


@_jit
def _sets_of(ids, miss_pos, num_sets):
    """The set of each miss (`kernels.cache_index.set_index`)."""
    m = miss_pos.shape[0]
    sets = np.empty(m, np.int64)
    for j in range(m):
        key = np.uint64(ids[miss_pos[j]])
        sets[j] = np.int64((mix64(key) & LOW63) % np.uint64(num_sets))
    return sets


@_jit
def plan_lru(ids, where, row_offset, fusion_k, scores, locks, batch_of, num_slots, num_sets,
             ways, tick, batch_seq, slots):  # fmt: skip
    """Fill ``slots`` (hits; -1 for misses) and plan the misses. No miss: every slot is
    locked and touched, and ``(empty, empty, empty)`` is returned. Else the hits are
    locked and ``(miss_pos, order, place)`` returned: the misses' positions ascending,
    their order by (set, shuffle), and in that order each one's slot (-1: no free way)."""
    n = ids.shape[0]
    m = _lookup(ids, where, row_offset, fusion_k, slots)
    if m == 0:
        for i in range(n):
            s = slots[i]
            locks[s] += 1
            if s < num_slots:
                scores[s] = tick
        empty = np.empty(0, np.int64)
        return empty, empty, empty
    miss_pos = _lock_hits(slots, locks, m)
    # Misses by set, then by the batch's shuffle (20 low bits), ties in the order of ids.
    sets = _sets_of(ids, miss_pos, num_sets)
    shuffle = np.empty(m, np.int64)
    utick = np.uint64(tick)
    for j in range(m):
        shuffle[j] = np.int64(mix64(np.uint64(ids[miss_pos[j]]) ^ utick) & np.uint64(0xFFFFF))
    order = _by_set(sets, shuffle, num_sets)
    place = _choose_ways(sets, order, scores, locks, batch_of, ways, batch_seq, shuffle, False)
    return miss_pos, order, place


@_jit
def plan_lfu(ids, where, row_offset, fusion_k, counts, count_offset, scores, locks, batch_of,
             num_sets, ways, tick, batch_seq, slots):  # fmt: skip
    """`plan_lru` for an LFU cache whose rows are counted exactly (``counts[count_offset[t]
    + id]``): the misses ordered by (set, frequency descending, shuffle), each one's
    frequency its count plus this request, and a miss whose way holds a row of a score no
    lower left to scratch (-1). No miss: every slot is locked (`touch_lfu` does the rest)."""
    n = ids.shape[0]
    m = _lookup(ids, where, row_offset, fusion_k, slots)
    if m == 0:
        for i in range(n):
            locks[slots[i]] += 1
        empty = np.empty(0, np.int64)
        return empty, empty, empty
    miss_pos = _lock_hits(slots, locks, m)
    sets = _sets_of(ids, miss_pos, num_sets)
    mask = (np.int64(1) << fusion_k) - 1
    utick = np.uint64(tick)
    shuffle = np.empty(m, np.int64)  # all 64 bits, compared as int64 (the torch path's argsort)
    freq = np.empty(m, np.int64)
    for j in range(m):
        if j + AHEAD < m:
            ahead = ids[miss_pos[j + AHEAD]]
            prefetch_item(counts, count_offset[ahead >> fusion_k] + (ahead & mask))
        key = ids[miss_pos[j]]
        shuffle[j] = np.int64(mix64(np.uint64(key) ^ utick))
        freq[j] = counts[count_offset[key >> fusion_k] + (key & mask)] + 1
    order = _by_set_freq(sets, freq, shuffle, num_sets)
    place = _choose_ways(sets, order, scores, locks, batch_of, ways, batch_seq, freq, True)
    return miss_pos, order, place


@_jit
def _before(freq, shuffle, a, b):
    """Whether miss ``a`` comes before miss ``b``: more frequent first, then by shuffle."""
    return freq[a] > freq[b] or (freq[a] == freq[b] and shuffle[a] < shuffle[b])


@_jit
def _by_set_freq(sets, freq, shuffle, num_sets):
    """The order of misses by ``(set, -freq, shuffle)`` (shuffles are distinct): a counting
    sort by set and an insertion sort within each set (a few misses) when the sets are few for
    the misses, else three sorts."""
    m = sets.shape[0]
    if num_sets > 8 * m:
        by_shuffle = np.argsort(shuffle)
        by_freq = by_shuffle[np.argsort(-freq[by_shuffle], kind="mergesort")]
        return by_freq[np.argsort(sets[by_freq], kind="mergesort")]
    start, order, _ = _bucket_by_set(sets, num_sets, shuffle)
    for s in range(num_sets):
        lo = start[s]
        for a in range(lo + 1, start[s + 1]):
            item = order[a]
            b = a - 1
            while b >= lo and _before(freq, shuffle, item, order[b]):
                order[b + 1] = order[b]
                b -= 1
            order[b + 1] = item
    return order


@_jit
def touch_lfu(ids, slots, counts, count_offset, fusion_k, scores, num_slots):
    """`HotCache._touch` for an LFU cache counted exactly: one more request of each id
    (distinct), and each slot of the cache proper scored with its row's count."""
    mask = (np.int64(1) << fusion_k) - 1
    n = ids.shape[0]
    for i in range(n):
        if i + AHEAD < n:  # the count of an id a few ahead (counts are read at random)
            ahead = ids[i + AHEAD]
            prefetch_item(counts, count_offset[ahead >> fusion_k] + (ahead & mask))
        key = ids[i]
        c = count_offset[key >> fusion_k] + (key & mask)
        counts[c] += 1
        s = slots[i]
        if 0 <= s < num_slots:
            scores[s] = counts[c]


@_jit
def scratch_done(slot_keys, locks, batch_of, dirty, num_slots, batch_seq):
    """The scratch rows (slots from ``num_slots``) that hold a row no batch holds any more:
    unlocked and not the last locked batch's. Returns their slots ascending, and the dirty
    ones' slots and keys (`HotCache.release`)."""
    n = slot_keys.shape[0] - num_slots
    done = np.empty(n, np.int64)
    dirty_slots = np.empty(n, np.int64)
    dirty_keys = np.empty(n, np.int64)
    d = 0
    k = 0
    for s in range(num_slots, slot_keys.shape[0]):
        key = slot_keys[s]
        if key >= 0 and locks[s] == 0 and batch_of[s] != batch_seq:
            done[d] = s
            d += 1
            if dirty[s]:
                dirty_slots[k] = s
                dirty_keys[k] = key
                k += 1
    return done[:d], dirty_slots[:k], dirty_keys[:k]


@_jit
def free_slots(slots, slot_keys, dirty, where, row_offset, fusion_k):
    """The rows held at ``slots`` leave the cache: their entries in the row index cleared,
    the slots empty and clean."""
    mask = (np.int64(1) << fusion_k) - 1
    for i in range(slots.shape[0]):
        s = slots[i]
        key = slot_keys[s]
        where[row_offset[key >> fusion_k] + (key & mask)] = -1
        slot_keys[s] = -1
        dirty[s] = False


@_jit
def reserve(ids, slots, miss_pos, order, place, where, row_offset, fusion_k, slot_keys,
            scores, locks, dirty, num_slots, tick):  # fmt: skip
    """Give every miss its planned slot (a way, or a free scratch row at ``num_slots`` or
    beyond): record the victims, re-key and re-index the slots, lock and touch the batch.
    Returns the plan's arrays: the misses' slots (in the order of ids), the dirty victims'
    ids and slots, every evicted id, and each reserved slot's old key, score (-1 for a
    scratch row) and dirty flag (in the planned order)."""
    m = miss_pos.shape[0]
    mask = (np.int64(1) << fusion_k) - 1
    old_keys = np.empty(m, np.int64)
    old_scores = np.empty(m, np.int64)
    old_dirty = np.empty(m, np.bool_)
    evicted = np.empty(m, np.int64)
    victim_ids = np.empty(m, np.int64)
    victim_slots = np.empty(m, np.int64)
    n_evicted = 0
    n_dirty = 0
    for q in range(m):
        if q + AHEAD < m:
            later = slot_keys[place[q + AHEAD]]
            if later >= 0:  # the index entry of a victim a few ahead
                prefetch_item(where, row_offset[later >> fusion_k] + (later & mask))
        s = place[q]
        v = slot_keys[s]
        old_keys[q] = v
        old_scores[q] = scores[s] if s < num_slots else -1  # a scratch row has no score
        old_dirty[q] = dirty[s]
        if v >= 0:
            evicted[n_evicted] = v
            n_evicted += 1
            if dirty[s]:
                victim_ids[n_dirty] = v
                victim_slots[n_dirty] = s
                n_dirty += 1
            where[row_offset[v >> fusion_k] + (v & mask)] = -1
        slots[miss_pos[order[q]]] = s
    load_slots = np.empty(m, np.int64)
    for k in range(m):
        if k + AHEAD < m:
            ahead = ids[miss_pos[k + AHEAD]]
            prefetch_item(where, row_offset[ahead >> fusion_k] + (ahead & mask))
        i = miss_pos[k]
        s = slots[i]
        key = ids[i]
        load_slots[k] = s
        slot_keys[s] = key
        where[row_offset[key >> fusion_k] + (key & mask)] = s
    for q in range(m):
        s = place[q]
        dirty[s] = False
        locks[s] += 1
    for i in range(slots.shape[0]):
        s = slots[i]
        if s < num_slots:
            scores[s] = tick
    return (load_slots, victim_ids[:n_dirty], victim_slots[:n_dirty],
            evicted[:n_evicted], old_keys, old_scores, old_dirty)  # fmt: skip


DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
# The position of the lowest set bit of a word, ``t`` that bit alone: DEBRUIJN_BITS[t * DEBRUIJN
# >> 58] (a de Bruijn sequence: each 6-bit window of it occurs once).
DEBRUIJN_BITS = np.array(
    [0, 1, 48, 2, 57, 49, 28, 3, 61, 58, 50, 42, 38, 29, 17, 4, 62, 55, 59, 36, 53, 51, 43, 22,
     45, 39, 33, 30, 24, 18, 12, 5, 63, 47, 56, 27, 60, 41, 37, 16, 54, 35, 52, 21, 44, 32, 23,
     11, 46, 26, 40, 15, 34, 20, 31, 10, 25, 14, 19, 9, 13, 8, 7, 6],
    dtype=np.int64,
)  # fmt: skip


@_jit
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


@_jit
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


@_jit
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


@_jit
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


_inline = njit(nogil=True, cache=True, boundscheck=False, inline="always")


@_inline
def _split_row(weights, state, s, rows, r):
    """``weights[s], state[s] = rows[r, :dim], rows[r, dim:]``."""
    dim = weights.shape[1]
    for j in range(dim):
        weights[s, j] = rows[r, j]
    for j in range(state.shape[1]):
        state[s, j] = rows[r, dim + j]


@_inline
def _join_row(weights, state, s, rows, r):
    """``rows[r] = [weights[s] | state[s]]``."""
    dim = weights.shape[1]
    for j in range(dim):
        rows[r, j] = weights[s, j]
    for j in range(state.shape[1]):
        rows[r, dim + j] = state[s, j]


@_jit
def scatter_split(weights, state, slots, rows):
    """``weights[slots], state[slots] = rows[:, :dim], rows[:, dim:]`` (float32 rows)."""
    for i in range(slots.shape[0]):
        _split_row(weights, state, slots[i], rows, i)


@_jit
def gather_join(weights, state, slots, out):
    """``out = [weights[slots] | state[slots]]`` (float32 rows)."""
    n = slots.shape[0]
    for i in range(n):
        if i + AHEAD < n:
            prefetch_row(weights, slots[i + AHEAD])
            prefetch_row(state, slots[i + AHEAD])
        _join_row(weights, state, slots[i], out, i)


@_jit
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


@_jit
def scatter_created(rows, created, ids, src):
    """``rows[ids] = src`` and ``created[ids] = True``."""
    width = rows.shape[1]
    for i in range(ids.shape[0]):
        r = ids[i]
        created[r] = True
        for j in range(width):
            rows[r, j] = src[i, j]


@_jit
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


@_jit
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


@_jit
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


@_jit
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


@_jit
def _first_bad_of_tables(limits, ids, bounds):
    """The position of the first id out of its table's range (``ids[bounds[t] : bounds[t +
    1]]`` below ``limits[t]``), or -1."""
    for t in range(limits.shape[0]):
        bad = _first_out_of_range(ids[bounds[t] : bounds[t + 1]], limits[t])
        if bad >= 0:
            return bounds[t] + bad
    return -1


@_jit
def bags_sample_major(slots, inverse, offsets, batch_size, weights, out, out_offsets,
                      out_weights):  # fmt: skip
    """The fused CPU step's indices (`engine.fused_cpu._sample_major`): bag ``(f, b)`` of a
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
