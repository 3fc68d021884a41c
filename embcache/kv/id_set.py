"""IdSet: a set of int64 ids with vectorised add, contains and discard, each constant in the
ids held (amortised), for the written-row bookkeeping of unbounded Redis tables
(`embcache.kv.tier_state.WrittenIds`).

Ids live in a power-of-two array of slots with linear probing from ``mix64(id) & (slots - 1)``,
as `embcache.kv.hash_index.HashIndex` keeps its keys, but with no values and over every int64:
the two ids that double as slot markers (``-2**63``, never used; ``-2**63 + 1``, discarded) are
held aside in a Python set. A lookup is rounds of one gather over the ids still unresolved, so
a batch costs as many rounds as its longest probe, never a Python step per id.

The slots are rebuilt (discarded slots dropped, doubling when the live ids need it) before an
add would fill more than half of them: between 16 and 32 bytes per id held (8 bytes a slot).
"""

from __future__ import annotations

import torch

from embcache.hashing import mix64
from embcache.indexing import true_at
from embcache.kv.hash_index import next_pow2

_EMPTY = -(1 << 63)  # slot never used: a probe ends here
_GONE = _EMPTY + 1  # slot whose id was discarded: a probe goes on past it
_MAX_USED = 0.5  # live ids + discarded slots, as a fraction of the slots, before a rebuild
_MIN_SLOTS = 64


class IdSet:
    """A set of int64 ids (any value), vectorised over the ids of a call.

    Example:
        >>> ids = IdSet()
        >>> ids.add(torch.tensor([7, -3, 7, 2**62]))
        >>> ids.contains(torch.tensor([2**62, 5, -3]))
        tensor([ True, False,  True])
        >>> ids.discard(torch.tensor([7, 8]))
        >>> ids.sorted()
        tensor([                 -3, 4611686018427387904])
    """

    def __init__(self, min_slots: int = _MIN_SLOTS) -> None:
        self._slots = torch.full((next_pow2(max(min_slots, 2)),), _EMPTY, dtype=torch.int64)
        self._live = 0
        self._used = 0  # slots not EMPTY: live ids and discarded ones
        self._aside: set[int] = set()  # held ids equal to a slot marker

    def __len__(self) -> int:
        return self._live + len(self._aside)

    @property
    def nbytes(self) -> int:
        """Bytes of the slot array (8 a slot, 2 to 4 slots an id)."""
        return self._slots.nbytes

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """bool ``[n]``: which of ``ids`` (int64 ``[n]``) are held."""
        ids = _as_ids(ids)
        found = self._find(ids) >= 0
        if self._aside:
            found |= torch.isin(ids, torch.tensor(sorted(self._aside), dtype=torch.int64))
        return found

    def add(self, ids: torch.Tensor) -> None:
        """Hold ``ids`` (repeats and ids held already are fine)."""
        ids = torch.unique(_as_ids(ids))
        marker = ids <= _GONE
        if bool(marker.any()):
            self._aside.update(ids[marker].tolist())
            ids = ids[~marker]
        ids = ids[self._find(ids) < 0]
        if ids.numel() == 0:
            return
        if self._used + ids.numel() > _MAX_USED * self._slots.numel():
            needed = int((self._live + ids.numel()) / _MAX_USED) + 1
            self._rebuild(next_pow2(max(self._slots.numel(), needed)))
        self._place(ids)

    def discard(self, ids: torch.Tensor) -> None:
        """Stop holding ``ids`` (ids not held are ignored)."""
        ids = _as_ids(ids)
        marker = ids <= _GONE
        if bool(marker.any()):
            self._aside.difference_update(ids[marker].tolist())
            ids = ids[~marker]
        at = torch.unique(self._find(ids))
        at = at[at >= 0]
        self._slots.index_fill_(0, at, _GONE)
        self._live -= at.numel()

    def sorted(self) -> torch.Tensor:
        """Every id held, ascending (int64)."""
        held = self._slots[true_at(self._slots > _GONE)]
        if self._aside:
            held = torch.cat([torch.tensor(sorted(self._aside), dtype=torch.int64), held])
        return torch.sort(held).values

    def _find(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id, -1 where it is not held (and for the markers, held aside)."""
        found = torch.full_like(ids, -1)
        mask = self._slots.numel() - 1
        pending = true_at(ids > _GONE)
        keys = ids.index_select(0, pending)
        slot = mix64(keys) & mask
        while pending.numel():
            held = self._slots.index_select(0, slot)
            hit = held == keys
            found.index_copy_(0, pending[hit], slot[hit])
            # A never-used slot ends the probe (absent); another id or a discarded one: go on.
            go_on = true_at(~hit & (held != _EMPTY))
            pending, keys = pending.index_select(0, go_on), keys.index_select(0, go_on)
            slot = (slot.index_select(0, go_on) + 1) & mask
        return found

    def _place(self, ids: torch.Tensor) -> None:
        """Write distinct ids, none held, into open slots, one round per probe step: each
        pending id scatters itself into its slot when open, a read-back tells which one won a
        contested slot, and the others probe on (a slot lost is taken, so the probe chains of
        `_find` stay unbroken). Reusing a discarded slot is safe: the ids are absent further
        along their probe."""
        self._live += ids.numel()
        mask = self._slots.numel() - 1
        slot = mix64(ids) & mask
        while ids.numel():
            before = self._slots.index_select(0, slot)
            open_ = true_at(before <= _GONE)
            self._slots.index_copy_(0, slot[open_], ids[open_])
            won = open_[self._slots.index_select(0, slot[open_]) == ids[open_]]
            self._used += int((before[won] == _EMPTY).sum())
            lost = torch.ones(ids.numel(), dtype=torch.bool)
            lost[won] = False
            rest = true_at(lost)
            ids = ids.index_select(0, rest)
            slot = (slot.index_select(0, rest) + 1) & mask

    def _rebuild(self, slots: int) -> None:
        held = self._slots[true_at(self._slots > _GONE)]
        self._slots = torch.full((slots,), _EMPTY, dtype=torch.int64)
        self._live = self._used = 0
        self._place(held)


def _as_ids(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` as a contiguous 1-D CPU int64 tensor."""
    return ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
