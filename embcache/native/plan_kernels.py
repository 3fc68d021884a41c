"""The numba kernels over a cache's rows behind `embcache.native` (imported only when numba can
be: see there for what each computes and which torch path it mirrors): the ids' check, the
lookup, the choice of ways (LRU and LFU), the reservation, the locks and the scratch rows, and
a batch's dedup through a bitmap over its tables' rows (`unique_rows`, `unique_values`)."""

from __future__ import annotations

import numpy as np

from embcache.native.bits import DEBRUIJN, DEBRUIJN_BITS, LOW63, mix64, popcount
from embcache.native.jit import inline, jit
from embcache.native.prefetch import AHEAD, prefetch_item, prefetch_span

BLOCKED = np.iinfo(np.int64).max  # a way no miss may take (scores stay below 2**57)
# Misses ahead (in set order) whose set's ways the plan asks for: a set costs about as many
# nanoseconds as memory takes to answer, so a few sets ahead is enough.
_SETS_AHEAD = 6


@jit
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


@jit
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


@jit
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


@jit
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


@inline  # inlined in both sorts
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


@jit
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


@jit
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


@jit
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


@jit
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


@jit
def _sets_of(ids, miss_pos, num_sets):
    """The set of each miss (`PlanOps.set_index`)."""
    m = miss_pos.shape[0]
    sets = np.empty(m, np.int64)
    for j in range(m):
        key = np.uint64(ids[miss_pos[j]])
        sets[j] = np.int64((mix64(key) & LOW63) % np.uint64(num_sets))
    return sets


@jit
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


@jit
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


@jit
def _before(freq, shuffle, a, b):
    """Whether miss ``a`` comes before miss ``b``: more frequent first, then by shuffle."""
    return freq[a] > freq[b] or (freq[a] == freq[b] and shuffle[a] < shuffle[b])


@jit
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


@jit
def touch_lfu(ids, slots, counts, count_offset, fusion_k, scores, num_slots):
    """`SetPlanner.touch` for an LFU cache counted exactly: one more request of each id
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


@jit
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


@jit
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


@jit
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
