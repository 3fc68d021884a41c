"""The numba kernel behind a direct share's compiled pass, `ops.ids.native.BitmapDirectRows`
(imported only when numba can be: see there for what it computes and which torch path it
mirrors)."""

from __future__ import annotations

import numpy as np

from embcache.native.jit import jit

BAD_OFFSETS = np.int64(-(1 << 62))  # offsets that do not cover the values exactly once
ONE = np.uint64(1)
LOW6 = np.int64(63)


@jit
def direct_rows(values, offsets, batch_size, feature_rows, feature_bases, seen, rows):
    """One pass over a batch's values, feature by feature (feature ``f`` holds the values of
    bags ``f * B .. (f + 1) * B``): check each id against its table, and append its slot
    ``feature_bases[f] + id`` to ``rows`` when its bit in ``seen`` (a bitmap over the cache's
    rows, all clear on entry) is clear, setting it. The bits are cleared again before
    returning.

    Returns how many rows were appended (the batch's distinct slots, in order of first sight),
    ``-1 - i`` for the first value ``i`` out of its table's range, or `BAD_OFFSETS` when the
    offsets do not run from 0 to the last value, feature after feature (checked first: no
    value outside the batch is read)."""
    n = values.shape[0]
    n_features = feature_rows.shape[0]
    if offsets[0] != 0 or offsets[n_features * batch_size] != n:
        return BAD_OFFSETS
    for f in range(n_features):  # every feature's values inside the batch's, before any read
        if offsets[(f + 1) * batch_size] < offsets[f * batch_size]:
            return BAD_OFFSETS
    count = 0
    verdict = np.int64(0)
    for f in range(n_features):
        lo = offsets[f * batch_size]
        hi = offsets[(f + 1) * batch_size]
        limit = feature_rows[f]
        base = feature_bases[f]
        for i in range(lo, hi):
            v = values[i]
            if v < 0 or v >= limit:
                verdict = -1 - i
                break
            s = base + v
            # Branch-free: whether a row was seen before is a coin toss the CPU cannot
            # predict; a table's rows are a small part of the bitmap, which stays in cache.
            word = seen[s >> 6]
            bit = ONE << np.uint64(s & LOW6)
            seen[s >> 6] = word | bit
            rows[count] = s
            count += (word & bit) == 0
        if verdict:
            break
    for j in range(count):
        seen[rows[j] >> 6] = 0
    return verdict if verdict else count
