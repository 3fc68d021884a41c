"""BoundedIndex: which ids a bounded table holds, at most ``capacity``, evicting by score.

HierarchicalKV's design, vectorised with torch: the positions form ``num_sets`` buckets of
``ways`` positions each; an id lives in bucket ``mix64(id ^ salt) % num_sets``, in any of its
ways. Finding ids gathers their buckets' keys (``[n, ways]``) and compares; inserting new ids
sorts them by bucket, ranks each within its bucket, orders each touched bucket's ways (free
first, then unpinned rows by ascending ``(score, id)``, pinned rows never), and gives the k-th
new id of a bucket the k-th way of that order: a free way, or the row it evicts. So the bound
holds at every moment, memory is allocated once, and an eviction scans one bucket, never the
table.

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

import torch

from embcache.hashing import mix64
from embcache.kv.base import ScorePolicy

DEFAULT_WAYS = 64
_SALT = 0x2545F4914F6CDD1D  # decorrelates the buckets from the device cache's set index
_LOOKUP_CHUNK = 1 << 15  # ids per [chunk, ways] gather in `find`
_FREE = -1


class TierCapacityError(ValueError):
    """A bounded table cannot take new rows: their buckets hold only pinned rows."""


class BoundedIndex:
    """Ids of a bounded table in ``num_sets * ways <= capacity`` positions, with scores and pins.

    Args:
        capacity: most ids held (>= 1); rounded down to whole buckets of ``ways``.
        policy: the eviction score.
        ways: positions per bucket (fewer when the capacity is smaller).

    Attributes:
        keys: int64 ``[positions]``, the id held at each position, -1 when free.
        scores: int64 ``[positions]``, each held id's score.
        pins: int32 ``[positions]``, each held id's pin count.
    """

    def __init__(self, capacity: int, policy: ScorePolicy, ways: int = DEFAULT_WAYS) -> None:
        self.ways = min(ways, capacity)
        self.num_sets = capacity // self.ways
        self.policy = policy
        size = self.num_sets * self.ways
        self.keys = torch.full((size,), _FREE, dtype=torch.int64)
        self.scores = torch.zeros(size, dtype=torch.int64)
        self.pins = torch.zeros(size, dtype=torch.int32)
        self.clock = 0
        self.count = 0

    @property
    def capacity(self) -> int:
        """Positions: the most ids held."""
        return self.keys.numel()

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.scores.nbytes + self.pins.nbytes

    def buckets(self, ids: torch.Tensor) -> torch.Tensor:
        """Bucket of each id (int64 ``[n]``)."""
        return (mix64(ids ^ _SALT) & 0x7FFFFFFFFFFFFFFF) % self.num_sets

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Position of each id, -1 where it is not held. int64 ``[n]``."""
        out = torch.full_like(ids, -1)
        view = self.keys.view(self.num_sets, self.ways)
        for lo in range(0, ids.numel(), _LOOKUP_CHUNK):
            part = ids[lo : lo + _LOOKUP_CHUNK]
            sets = self.buckets(part)
            match = view.index_select(0, sets) == part.unsqueeze(1)  # [n, ways]
            way = match.to(torch.int8).argmax(dim=1)
            out[lo : lo + part.numel()] = torch.where(match.any(dim=1), sets * self.ways + way, -1)
        return out

    def insert(self, ids: torch.Tensor, guard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Give distinct new ids (none held) positions, evicting where their buckets are full.

        Args:
            ids: int64 ``[k]`` distinct ids, none held.
            guard: int64 positions that must not be taken (rows the same call uses), besides
                the pinned ones.

        Returns:
            ``(positions [k], evicted ids)``: each id's position, and the ids evicted for them
            (gone from the index; their positions now belong to new ids).

        Raises:
            TierCapacityError: a bucket has more new ids than free and unpinned ways; nothing
                is changed.
        """
        k = ids.numel()
        if k == 0:
            return ids.clone(), ids.clone()
        W = self.ways
        sets, order = torch.sort(self.buckets(ids), stable=True)
        ids = ids[order]
        touched, owner, counts = torch.unique_consecutive(
            sets, return_inverse=True, return_counts=True
        )
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(k) - starts[owner]
        base = touched.unsqueeze(1) * W + torch.arange(W)  # [T, W] positions
        keys = self.keys[base]
        blocked = self.pins[base] > 0
        if guard.numel():
            guarded = torch.zeros(self.capacity, dtype=torch.bool)
            guarded[guard] = True
            blocked |= guarded[base]
        # Ways in eviction order: free, then unpinned by (score, id), then blocked; by three
        # stable sorts, least significant key first.
        kind = torch.where(keys < 0, 0, torch.where(blocked, 2, 1))
        way = torch.argsort(keys, dim=1, stable=True)
        way = way.gather(1, torch.argsort(self.scores[base].gather(1, way), dim=1, stable=True))
        way = way.gather(1, torch.argsort(kind.gather(1, way), dim=1, stable=True))
        usable = (kind < 2).sum(dim=1)  # [T]
        if bool((rank >= usable[owner]).any()):
            t = int(owner[rank >= usable[owner]][0])
            raise TierCapacityError(
                f"a bucket of {W} rows has no room for the {int(counts[t])} new rows one call "
                f"brings: {W - int(usable[t])} of its rows are pinned by readers (the device "
                f"cache) or used by the call. Give the table a capacity ({self.capacity:,} "
                f"now) well above the rows the caches in front of it hold and one batch's rows"
            )
        chosen = way[owner, rank]  # [k]
        positions = touched[owner] * W + chosen
        old = self.keys[positions]
        evicted = old[old >= 0]
        self.keys[positions] = ids
        self.pins[positions] = 0
        self.scores[positions] = self._fresh_score()
        self.count += k - evicted.numel()
        out = torch.empty_like(positions)
        out[order] = positions
        return out, evicted

    def remove(self, positions: torch.Tensor) -> None:
        """Free held positions (distinct)."""
        self.keys[positions] = _FREE
        self.pins[positions] = 0
        self.count -= positions.numel()

    def touch(self, positions: torch.Tensor) -> None:
        """One use of the rows at ``positions`` (distinct): LRU stamps them with the next
        clock, LFU counts one more."""
        if not positions.numel():
            return
        if self.policy is ScorePolicy.LRU:
            self.clock += 1
            self.scores[positions] = self.clock
        else:
            self.scores[positions] += 1

    def pin(self, positions: torch.Tensor) -> None:
        self.pins[positions] += 1

    def unpin(self, positions: torch.Tensor) -> None:
        """Release one pin of each position (clamped at zero), then count the use."""
        self.pins[positions] = (self.pins[positions] - 1).clamp(min=0)
        self.touch(positions)

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids ascending, their positions)``."""
        held = (self.keys >= 0).nonzero().flatten()
        ids, order = torch.sort(self.keys[held])
        return ids, held[order]

    def set_scores(self, positions: torch.Tensor, scores: torch.Tensor) -> None:
        """Restore checkpointed scores; the LRU clock moves past them, so later uses order
        after every restored one, as they did when the scores were saved."""
        self.scores[positions] = scores
        if scores.numel():
            self.clock = max(self.clock, int(scores.max()))

    def pinned(self) -> int:
        """Rows held pinned."""
        return int((self.pins > 0).sum())

    def _fresh_score(self) -> int:
        """A new row's score: LRU the next clock (later than every row held), LFU zero."""
        if self.policy is ScorePolicy.LRU:
            self.clock += 1
            return self.clock
        return 0
