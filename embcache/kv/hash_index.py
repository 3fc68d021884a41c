"""HashIndex: an open-addressing map from non-negative int64 keys to int64 values, vectorised.

The host tier's unbounded tables (id -> row) use it (`TieredKV`'s held rows, which need scores
and a victim order as well, use the bucketed core of `kv.bucket_index` instead). Keys live in a
power-of-two array of buckets with linear probing from ``mix64(key) & (buckets - 1)``. Lookups
and inserts run as rounds over the keys still unresolved, each round one gather (or scatter)
over all of them, so a batch costs as many rounds as its longest probe sequence, never a Python
step per key.

A removed key leaves a tombstone that lookups probe past and inserts reuse; the buckets are
rebuilt (tombstones dropped, at least doubling when the live keys need it) before an insert
would take live keys and tombstones past half of them.
"""

from __future__ import annotations

import torch

from embcache.hashing import mix64

_EMPTY = -1  # bucket never used: a probe ends here (keys are non-negative)
_GONE = -2  # bucket whose key was removed: a probe goes on past it
_MAX_USED = 0.5  # live keys + tombstones, as a fraction of the buckets, before a rebuild
_MIN_BUCKETS = 64


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(n - 1, 0).bit_length()


class HashIndex:
    """Map from non-negative int64 keys to int64 values, with insert, find and remove.

    Example:
        >>> index = HashIndex()
        >>> index.insert(torch.tensor([7, 2**62]), torch.tensor([0, 1]))
        >>> index.find(torch.tensor([2**62, 5, 7]))
        tensor([ 1, -1,  0])
        >>> index.remove(torch.tensor([7]))
        >>> len(index)
        1
    """

    def __init__(self, min_slots: int = _MIN_BUCKETS) -> None:
        buckets = next_pow2(max(min_slots, 2))
        self._keys = torch.full((buckets,), _EMPTY, dtype=torch.int64)
        self._values = torch.empty(buckets, dtype=torch.int64)
        self._live = 0
        self._used = 0  # buckets not EMPTY: live keys and tombstones

    def __len__(self) -> int:
        return self._live

    @property
    def num_slots(self) -> int:
        """Buckets allocated (a power of two, at least twice the live keys)."""
        return self._keys.numel()

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._values.nbytes

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Value of each key (int64 ``[n]``, non-negative), or -1 where the key is absent."""
        at = self._buckets(keys)
        return torch.where(at >= 0, self._values[at.clamp(min=0)], -1)

    def insert(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``keys -> values``; the keys must be distinct and absent from the index."""
        if self._used + keys.numel() > _MAX_USED * self.num_slots:
            live = self._live + keys.numel()
            self._rebuild(next_pow2(max(self.num_slots, int(live / _MAX_USED) + 1)))
        self._place(keys, values)

    def remove(self, keys: torch.Tensor) -> None:
        """Remove ``keys`` (distinct, present)."""
        self._keys[self._buckets(keys)] = _GONE
        self._live -= keys.numel()

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All ``(keys, values)`` held, in bucket order."""
        live = self._keys >= 0
        return self._keys[live], self._values[live]

    def _buckets(self, keys: torch.Tensor) -> torch.Tensor:
        """Bucket holding each key, -1 where absent."""
        found = torch.full_like(keys, -1)
        mask = self.num_slots - 1
        pending, pending_keys = torch.arange(keys.numel()), keys
        bucket = mix64(keys) & mask
        while pending.numel():
            held = self._keys.index_select(0, bucket)
            hit = held == pending_keys
            found[pending[hit]] = bucket[hit]
            # A never-used bucket ends the probe (absent); another key or a tombstone: go on.
            go_on = (~hit & (held != _EMPTY)).nonzero().flatten()
            pending = pending.index_select(0, go_on)
            pending_keys = pending_keys.index_select(0, go_on)
            bucket = (bucket.index_select(0, go_on) + 1) & mask
        return found

    def _place(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write absent keys into open buckets (empty or tombstone), one round per probe step.

        Every pending key whose bucket is open scatters itself there; a read-back tells which
        one won each contested bucket, and the others probe on. A loser's bucket is now taken,
        so its probe chain stays unbroken for `find`. Reusing a tombstone is safe because the
        keys are known to be absent further along their probe.
        """
        self._live += keys.numel()
        mask = self.num_slots - 1
        bucket = mix64(keys) & mask
        while keys.numel():
            before = self._keys.index_select(0, bucket)
            open_ = (before < 0).nonzero().flatten()
            open_buckets, open_keys = bucket[open_], keys[open_]
            self._keys.index_copy_(0, open_buckets, open_keys)
            won = open_[self._keys.index_select(0, open_buckets) == open_keys]
            self._values.index_copy_(0, bucket[won], values[won])
            self._used += int((before[won] == _EMPTY).sum())
            lost = torch.ones(keys.numel(), dtype=torch.bool)
            lost[won] = False
            rest = lost.nonzero().flatten()
            keys, values = keys.index_select(0, rest), values.index_select(0, rest)
            bucket = (bucket.index_select(0, rest) + 1) & mask

    def _rebuild(self, buckets: int) -> None:
        keys, values = self.items()
        self._keys = torch.full((buckets,), _EMPTY, dtype=torch.int64)
        self._values = torch.empty(buckets, dtype=torch.int64)
        self._live = self._used = 0
        self._place(keys, values)
