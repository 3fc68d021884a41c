"""BoundedIndex: which ids a bounded table holds, at most ``capacity``, evicting by score.

HierarchicalKV's design, vectorised with torch, as the bounded geometry of the shared core
(`kv.bucket_index.BucketIndex`, which `TieredKV`'s held rows use too): the positions form
``capacity // ways`` buckets of ``ways`` positions each, fixed; an id lives in bucket
``mix64(id ^ salt) % num_sets``, in any of its ways. Inserting new ids orders each touched
bucket's ways (free first, then unpinned rows by ascending ``(score, id)``, pinned rows never)
and gives the k-th new id of a bucket the k-th way of that order: a free way, or the row it
evicts. So the bound holds at every moment, memory is allocated once, and an eviction scans one
bucket, never the table.

Scores (`ScorePolicy`): LRU, the clock at the row's last release or unpinned use; LFU, the count
of them. Pinned rows (held by a reader such as the device cache) are never evicted and keep their
score until released; ties are broken by id, so the choice depends only on which ids a bucket
holds and their scores, not on where they sit in it (a table restored from a checkpoint evicts
the same rows as the one that saved it).

If a bucket has more new ids than free and unpinned ways (ways the same call uses count as
pinned), the insert is refused (`TierCapacityError`) before anything changes: a table's
capacity must leave room beyond the rows its readers pin (the device cache's capacity) and the
rows one call brings, which the default bucket width makes all but certain once the capacity is
a few times both (a bucket of 64 ways receives on average ``64 * new / capacity`` of a call's
new rows).
"""

from __future__ import annotations

from embcache.kv.base import ScorePolicy
from embcache.kv.bucket_index import BucketIndex, TierCapacityError

__all__ = ["DEFAULT_WAYS", "BoundedIndex", "TierCapacityError"]

DEFAULT_WAYS = 64


class BoundedIndex(BucketIndex):
    """Ids of a bounded table in ``num_sets * ways <= capacity`` positions, with scores and pins
    (a `BucketIndex` of fixed geometry: new ids evict, the index never grows).

    Args:
        capacity: most ids held (>= 1); rounded down to whole buckets of ``ways``.
        policy: the eviction score (`ScorePolicy` or ``"lru"``/``"lfu"``).
        ways: positions per bucket (fewer when the capacity is smaller).
    """

    def __init__(self, capacity: int, policy: ScorePolicy | str, ways: int = DEFAULT_WAYS) -> None:
        if capacity is None:
            raise ValueError("a BoundedIndex needs a capacity (BucketIndex grows without one)")
        super().__init__(policy, ways, capacity)
