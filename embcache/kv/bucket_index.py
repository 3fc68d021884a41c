"""BucketIndex: the id -> position index and eviction-policy core shared by the host tiers.

Two row caches of the tiers keep ids in it: a bounded table (`kv.bounded.BoundedIndex`, in
`HostKV`'s `BoundedTable` and as `TieredKV`'s directory of the ids that exist) and the rows
`TieredKV` holds in host memory in front of its back store. What they share:

* **the index**: positions form ``num_sets`` buckets of ``ways`` positions each; an id lives in
  bucket ``mix64(id ^ salt) % num_sets``, in any of its ways. `find` gathers the ids' buckets
  (``[n, ways]``) and compares; `insert` sorts new ids by bucket, ranks each within its bucket
  and gives the k-th new id of a bucket the k-th way of that bucket's order (below). Every
  operation is vectorised over the ids of a call, with no Python step per id;
* **the bookkeeping per position**: the id held (``keys``, -1 when free), its eviction
  ``score``, its pin count (``pins``: a reader holds the row; never evicted), a ``dirty`` flag
  (its row is newer than the store behind), and, when asked for, an int64 ``value`` (where the
  caller keeps the row: `TieredKV`'s slot);
* **the policy** (`ScorePolicy`): LRU scores are ticks of a `Clock` (a use stamps the next
  tick; several indices may share one clock, so their scores compare), LFU scores count uses;
  a new id starts with the next tick (LRU) or 0 (LFU);
* **the victim order**: unpinned ids by ascending ``(score, id)``, never a pinned one. Within a
  bucket (`insert` of a bounded index) the ways go free first, then unpinned ids in that order,
  the guarded and pinned ones never; across whole indices (`lowest`, `TieredKV`'s global
  budget) the ``k`` first ids of that order, equal ``(score, id)`` pairs of different indices
  taken in the order the indices are given. Ties broken by id make the choice depend only on
  the ids and scores held, not on where they sit (a restored table evicts what the saved one
  would have).

Two geometries, by ``capacity``:

* **bounded** (``capacity`` given: ``capacity // ways`` buckets, fixed): a new id in a full
  bucket evicts the first unpinned, unguarded id of the bucket's order, so the bound holds at
  every moment, memory is allocated once, and an eviction scans one bucket, never the table.
  A bucket with more new ids than free and evictable ways refuses the whole insert
  (`TierCapacityError`) before anything changes.
* **growable** (``capacity=None``): an insert never evicts; when a bucket has no free way for
  its new ids, the buckets double (every held id moves, with its score, pins, flag and value,
  to ``hash % (2 * num_sets)``: a bucket splits in two, so the move always fits) and the
  insert is planned again. With 32 ways (`TieredKV`'s held rows) a large index stays about a
  fifth to three fifths full. Positions found before an insert that grows are stale: find
  them again.

The device cache (`embcache.cache`) keeps its own set index on the GPU; docs/design.md
("Tiers") says why it does not use this one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from embcache.hashing import LOW63, mix64
from embcache.indexing import true_at
from embcache.kv.base import ScorePolicy

_SALT = 0x2545F4914F6CDD1D  # decorrelates the buckets from the device cache's set index
_LOOKUP_CHUNK = 1 << 15  # ids per [chunk, ways] gather in `find`
_FREE = -1  # key of a free position
FREE_SCORE = (1 << 63) - 1  # score of a free position: after every held one in the order
_GROWABLE_SETS = 2  # buckets of a new growable index


def check_scores(scores: torch.Tensor) -> None:
    """Raise `ValueError` unless ``scores`` are eviction scores a bounded table could hold:
    int64 in ``[0, FREE_SCORE)`` (what `BucketIndex.set_scores` restores)."""
    if scores.dtype != torch.int64:
        raise ValueError(f"scores must be int64, got {scores.dtype}")
    if scores.numel() and not bool(((scores >= 0) & (scores < FREE_SCORE)).all()):
        raise ValueError(f"scores must be in [0, {FREE_SCORE}), got {scores.tolist()[:8]}")


class TierCapacityError(ValueError):
    """A bounded table cannot take new rows: their buckets hold only pinned rows."""


class Clock:
    """The LRU clock of one or more indices: a use stamps rows with the next `tick`."""

    def __init__(self) -> None:
        self.now = 0

    def tick(self) -> int:
        """The next stamp, later than every stamp given before."""
        self.now += 1
        return self.now

    def advance(self, stamp: int) -> None:
        """Move past ``stamp`` (restored scores): later ticks order after it."""
        self.now = max(self.now, stamp)


def _checked_ids(ids: object, what: str) -> torch.Tensor:
    """``ids`` as a 1-D CPU int64 tensor of non-negative ids (-1 marks a free position)."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"BucketIndex.{what}: ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype != torch.int64 or ids.device.type != "cpu":
        raise TypeError(
            f"BucketIndex.{what}: ids must be CPU int64, got {ids.dtype} on {ids.device}"
        )
    if ids.dim() != 1:
        raise ValueError(f"BucketIndex.{what}: ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"BucketIndex.{what}: ids must be >= 0, got {int(ids.min())}")
    return ids


class BucketIndex:
    """Ids in ``num_sets`` buckets of ``ways`` positions, with scores, pins and dirty flags.

    Args:
        policy: the eviction score (`ScorePolicy` or ``"lru"``/``"lfu"``).
        ways: positions per bucket (>= 1; fewer when a bounded capacity is smaller).
        capacity: most ids held (>= 1), rounded down to whole buckets: a bounded index that
            evicts; None: a growable one that never evicts.
        clock: the LRU clock (shared with other indices whose scores must compare); a new
            one when None.
        values: keep an int64 value per position (`insert` sets it, `values` reads it).

    Attributes:
        keys: int64 ``[positions]``, the id held at each position, -1 when free.
        scores: int64 ``[positions]``, each held id's score (`FREE_SCORE` where free).
        pins: int32 ``[positions]``, each held id's pin count.
        dirty: bool ``[positions]``, set by the caller when a held row changes.
        values: int64 ``[positions]`` or None, each held id's value.
        count: ids held.
    """

    def __init__(
        self,
        policy: ScorePolicy | str,
        ways: int,
        capacity: int | None = None,
        *,
        clock: Clock | None = None,
        values: bool = False,
    ) -> None:
        try:
            self.policy = ScorePolicy(policy)
        except ValueError:
            raise ValueError(
                f"policy must be a ScorePolicy or 'lru'/'lfu', got {policy!r}"
            ) from None
        for name, number in (("ways", ways), ("capacity", capacity)):
            if name == "capacity" and number is None:
                continue
            if not isinstance(number, int) or isinstance(number, bool) or number < 1:
                raise ValueError(f"{name} must be an int >= 1, got {number!r}")
        if clock is not None and not isinstance(clock, Clock):
            raise TypeError(f"clock must be a Clock, got {type(clock).__name__}")
        self.bounded = capacity is not None
        self.ways = ways if capacity is None else min(ways, capacity)
        self.num_sets = _GROWABLE_SETS if capacity is None else capacity // self.ways
        self.clock = Clock() if clock is None else clock
        self.count = 0
        self._pinned_ever = False  # `lowest` skips the pin test until a pin is taken
        self._allocate(self.num_sets * self.ways, values)

    def _allocate(self, size: int, values: bool) -> None:
        self.keys = torch.full((size,), _FREE, dtype=torch.int64)
        self.scores = torch.full((size,), FREE_SCORE, dtype=torch.int64)
        self.pins = torch.zeros(size, dtype=torch.int32)
        self.dirty = torch.zeros(size, dtype=torch.bool)
        self.values: torch.Tensor | None = (
            torch.full((size,), -1, dtype=torch.int64) if values else None
        )

    @property
    def capacity(self) -> int:
        """Positions: the most ids held before an insert evicts (bounded) or may grow."""
        return self.keys.numel()

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        arrays = (self.keys, self.scores, self.pins, self.dirty, self.values)
        return sum(a.nbytes for a in arrays if a is not None)

    def buckets(self, ids: torch.Tensor) -> torch.Tensor:
        """Bucket of each id (int64 ``[n]``)."""
        return (mix64(ids ^ _SALT) & LOW63) % self.num_sets

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Position of each id, -1 where it is not held. int64 ``[n]``."""
        ids = _checked_ids(ids, "find")
        out = torch.full_like(ids, -1)
        view = self.keys.view(self.num_sets, self.ways)
        for lo in range(0, ids.numel(), _LOOKUP_CHUNK):
            part = ids[lo : lo + _LOOKUP_CHUNK]
            sets = self.buckets(part)
            match = view.index_select(0, sets) == part.unsqueeze(1)  # [n, ways], one per row
            hit = true_at(match.view(-1))  # row * ways + way of each id found
            row = hit // self.ways
            out.index_copy_(0, lo + row, sets.index_select(0, row) * self.ways + hit % self.ways)
        return out

    def insert(
        self,
        ids: torch.Tensor,
        guard: torch.Tensor | None = None,
        *,
        dirty: bool = False,
        values: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Give distinct new ids (none held) positions: free ways of their buckets, else (a
        bounded index) the ways of the ids they evict, else (a growable one) after growing.

        Args:
            ids: int64 ``[k]`` distinct ids, none held.
            guard: int64 positions a bounded index must not take (rows the same call uses),
                besides the pinned ones.
            dirty: the new ids' dirty flag.
            values: int64 ``[k]``, the new ids' values (an index made with ``values=True``).

        Returns:
            ``(positions [k], evicted ids)``: each id's position (a new score: the next tick
            under LRU, 0 under LFU; no pin), and the ids evicted for them, gone from the index
            (always none for a growable index).

        Raises:
            TierCapacityError: a bucket of a bounded index has more new ids than free and
                evictable ways; nothing is changed.
            ValueError: an id repeated or already held, or values missing or of another
                length; nothing is changed.
        """
        ids = _checked_ids(ids, "insert")
        k = ids.numel()
        if (values is None) != (self.values is None) or (
            values is not None and (values.dtype != torch.int64 or values.shape != ids.shape)
        ):
            raise ValueError(
                "BucketIndex.insert: give int64 values, one per id, exactly when the index "
                f"keeps values (it {'does' if self.values is not None else 'does not'})"
            )
        if k == 0:
            return ids.clone(), ids.clone()
        ordered = torch.sort(ids).values
        if bool((ordered[1:] == ordered[:-1]).any()):
            raise ValueError("BucketIndex.insert: ids must be distinct")
        while True:
            planned = self._plan(ids, guard)
            if planned is not None:
                break
            self._grow()
        positions = planned
        old = self.keys.index_select(0, positions)
        evicted = old[old >= 0]
        self.keys.index_copy_(0, positions, ids)
        self.pins.index_fill_(0, positions, 0)
        self.scores.index_fill_(0, positions, self._fresh_score())
        self.dirty.index_fill_(0, positions, dirty)
        if self.values is not None and values is not None:
            self.values.index_copy_(0, positions, values)
        self.count += k - evicted.numel()
        return positions, evicted

    def _plan(self, ids: torch.Tensor, guard: torch.Tensor | None) -> torch.Tensor | None:
        """Positions for new ``ids`` (in their order), changing nothing; None when a growable
        index must grow first. Raises as `insert` does."""
        k, W = ids.numel(), self.ways
        sets, order = torch.sort(self.buckets(ids), stable=True)
        ids = ids.index_select(0, order)
        touched, owner, counts = torch.unique_consecutive(
            sets, return_inverse=True, return_counts=True
        )
        rank = torch.arange(k) - (torch.cumsum(counts, 0) - counts).index_select(0, owner)
        keys = self._rows_of(self.keys, touched)  # [T, W]
        held = keys.index_select(0, owner) == ids.unsqueeze(1)  # [k, W]
        if bool(held.any()):
            at = int(held.any(dim=1).nonzero()[0])
            raise ValueError(f"BucketIndex.insert: id {int(ids[at])} is held already")
        free = keys < 0
        if self.bounded:
            way, usable = self._bucket_order(touched, keys, guard)
        else:
            usable = free.sum(dim=1)
        over = rank >= usable.index_select(0, owner)
        if bool(over.any()):
            if not self.bounded:
                return None
            t = int(owner[over][0])
            raise TierCapacityError(
                f"a bucket of {W} rows has no room for the {int(counts[t])} new rows one call "
                f"brings: {W - int(usable[t])} of its rows are pinned by readers (the device "
                f"cache) or used by the call. Give the table a capacity ({self.capacity:,} "
                f"now) well above the rows the caches in front of it hold and one batch's rows"
            )
        if self.bounded:  # the rank-th way of the bucket's victim order
            chosen = way.index_select(0, owner).gather(1, rank.unsqueeze(1)).squeeze(1)
        else:  # the rank-th free way: as many ways before it hold rank free ones or fewer
            before = torch.cumsum(free, dim=1).index_select(0, owner) <= rank.unsqueeze(1)
            chosen = before.sum(dim=1)
        positions = touched.index_select(0, owner) * W + chosen
        return torch.empty_like(positions).index_copy_(0, order, positions)

    def _rows_of(self, per_position: torch.Tensor, touched: torch.Tensor) -> torch.Tensor:
        """``per_position`` of the buckets ``touched``, ``[T, ways]``."""
        return per_position.view(self.num_sets, self.ways).index_select(0, touched)

    def _bucket_order(
        self, touched: torch.Tensor, keys: torch.Tensor, guard: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The victim order of each touched bucket's ways (``[T, W]`` way numbers: free, then
        unpinned unguarded by ascending ``(score, id)``, then the blocked), and how many ways
        of each may be taken (``[T]``)."""
        blocked = self._rows_of(self.pins, touched) > 0
        if guard is not None and guard.numel():
            guarded = torch.zeros(self.capacity, dtype=torch.bool)
            guarded[guard] = True
            blocked |= self._rows_of(guarded, touched)
        kind = torch.where(keys < 0, 0, torch.where(blocked, 2, 1))
        scores = self._rows_of(self.scores, touched)
        # Three stable sorts, least significant key first: id, score, kind.
        way = torch.argsort(keys, dim=1, stable=True)
        way = way.gather(1, torch.argsort(scores.gather(1, way), dim=1, stable=True))
        way = way.gather(1, torch.argsort(kind.gather(1, way), dim=1, stable=True))
        return way, (kind < 2).sum(dim=1)

    def _grow(self) -> None:
        """Double the buckets of a growable index; every held id moves to its new bucket (in
        the order of its old position), with its score, pins, dirty flag and value."""
        held = true_at(self.keys >= 0)
        ids = self.keys[held]
        carried = [self.scores[held], self.pins[held], self.dirty[held]]
        old_values = None if self.values is None else self.values[held]
        self.num_sets *= 2
        self._allocate(self.num_sets * self.ways, old_values is not None)
        sets, order = torch.sort(self.buckets(ids), stable=True)
        _, owner, counts = torch.unique_consecutive(sets, return_inverse=True, return_counts=True)
        rank = torch.arange(ids.numel()) - (torch.cumsum(counts, 0) - counts)[owner]
        positions = torch.empty_like(ids)
        positions[order] = sets * self.ways + rank  # a bucket splits in two: always fits
        self.keys[positions] = ids
        self.scores[positions], self.pins[positions], self.dirty[positions] = carried
        if self.values is not None and old_values is not None:
            self.values[positions] = old_values

    def remove(self, positions: torch.Tensor) -> None:
        """Free held positions (distinct)."""
        self.keys.index_fill_(0, positions, _FREE)
        self.scores.index_fill_(0, positions, FREE_SCORE)
        self.pins.index_fill_(0, positions, 0)
        self.dirty.index_fill_(0, positions, False)
        self.count -= positions.numel()

    def touch(self, positions: torch.Tensor) -> None:
        """One use of the rows at ``positions`` (held): LRU stamps them with the next tick,
        LFU counts one more (a position given twice counts once)."""
        if not positions.numel():
            return
        if self.policy is ScorePolicy.LRU:
            self.scores.index_fill_(0, positions, self.clock.tick())
        else:
            self.scores[positions] += 1

    def pin(self, positions: torch.Tensor) -> None:
        """One more pin on each held position: never evicted until released."""
        self._pinned_ever = True
        self.pins[positions] += 1

    def unpin(self, positions: torch.Tensor) -> None:
        """Release one pin of each position (clamped at zero), then count the use."""
        self.pins[positions] = (self.pins[positions] - 1).clamp(min=0)
        self.touch(positions)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids ascending, their positions)``."""
        held = true_at(self.keys >= 0)
        ids, order = torch.sort(self.keys[held])
        return ids, held[order]

    def set_scores(self, positions: torch.Tensor, scores: torch.Tensor) -> None:
        """Restore checkpointed scores of held positions; the LRU clock moves past them, so
        later uses order after every restored one, as they did when the scores were saved."""
        check_scores(scores)
        self.scores[positions] = scores
        if scores.numel():
            self.clock.advance(int(scores.max()))

    def pinned(self) -> int:
        """Rows held pinned."""
        return int((self.pins > 0).sum())

    def victim_scores(self) -> torch.Tensor:
        """Each position's score where it may be evicted, `FREE_SCORE` where it is free or
        pinned (a view of ``scores`` when nothing was ever pinned)."""
        if not self._pinned_ever:
            return self.scores
        return torch.where(self.pins > 0, FREE_SCORE, self.scores)

    def _fresh_score(self) -> int:
        """A new row's score: LRU the next tick (later than every row held), LFU zero."""
        return self.clock.tick() if self.policy is ScorePolicy.LRU else 0


def lowest(indices: Sequence[BucketIndex], k: int) -> list[torch.Tensor]:
    """The first ``k`` held, unpinned ids of the victim order across ``indices``: ascending
    ``(score, id)``, equal pairs of different indices in the order given (all of them when
    fewer are held).

    One partition of the concatenated scores finds the k-th score; the ids below it are taken,
    and of those at it the lowest ids. Scores compare across indices only when they mean the
    same (one policy; LRU: one shared `Clock`).

    Returns:
        each index's chosen positions (int64, ascending).
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k must be an int >= 0, got {k!r}")
    empty = torch.empty(0, dtype=torch.int64)
    if not indices:
        return []
    parts = [index.victim_scores() for index in indices]
    scores = parts[0] if len(parts) == 1 else torch.cat(parts)
    if k == 0 or scores.numel() == 0:
        return [empty for _ in indices]
    kth = int(np.partition(scores.numpy(), min(k, scores.numel()) - 1)[min(k, scores.numel()) - 1])
    if kth == FREE_SCORE:  # k or fewer evictable: all of them
        chosen = true_at(scores < FREE_SCORE)
    else:
        below = true_at(scores < kth)
        tied = true_at(scores == kth)
        keys = torch.cat([index.keys for index in indices]) if len(indices) > 1 else indices[0].keys
        first = torch.argsort(keys[tied], stable=True)[: k - below.numel()]
        chosen = torch.cat([below, torch.sort(tied[first]).values])
        chosen = torch.sort(chosen).values
    bounds = torch.tensor([0] + [index.capacity for index in indices]).cumsum(0)
    cut = torch.searchsorted(chosen, bounds)
    return [chosen[cut[i] : cut[i + 1]] - bounds[i] for i in range(len(indices))]
