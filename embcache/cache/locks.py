"""Slot locks of a `HotCache`: a batch in flight holds one lock on each of its slots, and a
locked slot is never a victim. `unlock` (and `unlock_together`, for several caches at once)
never calls the tier, so an optimizer step that has updated rows cannot fail half-way through
releasing them; the rows it changed are marked dirty here.

`SlotLocks` is a part of `HotCache` (its base class, as `snapshot.PolicyState` is).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import torch

from embcache.cache.fields import CacheFields
from embcache.cache.lockstep import first_true
from embcache.indexing import add_at, fill_at


class SlotLocks(CacheFields):
    """`HotCache`'s lock methods: they read and set the cache's own locks and dirty flags
    under its ``lock``, so they run on a `HotCache` only."""

    def _live(self, slots: torch.Tensor, n_live: int | None = None) -> torch.Tensor:
        """``slots`` without the -1 of ids not admitted (no copy when there is no admission);
        ``n_live``: how many are not -1, when known (no host read then)."""
        if self._admission is None:
            return slots
        if n_live is None:
            return slots[slots >= 0]
        return slots.index_select(0, first_true(slots >= 0, n_live))

    def hold(self, slots: torch.Tensor) -> None:
        """Lock ``slots`` (distinct, resident) once each, as a resolve with ``lock`` does: for
        a batch served by `serve_direct` that turns into the ordinary locked form later."""
        with self.lock:
            add_at(self.locks, slots, 1)

    def mark_dirty(self, slots: torch.Tensor) -> None:
        """Record that the rows at ``slots`` were changed in place (e.g. by an optimizer); a
        slot of -1 is an id not admitted, whose update was dropped (counted)."""
        with self.lock:
            slots = slots.to(self.device)
            if self._admission is not None:
                live = self._live(slots)
                self.gradients_dropped += slots.numel() - live.numel()
                slots = live
            fill_at(self.dirty, slots, True)

    def unlock(self, slots: torch.Tensor, dirty: bool = False) -> None:
        """Drop one lock from each of ``slots`` (distinct); with ``dirty``, also record that
        their rows were changed in place, as `mark_dirty` does (a batch after its update).

        Never calls the tier: scratch rows left without a lock are written back and freed by
        the next `release` (which the next `resolve`, `flush` and unlocked forwards call).
        Several caches at once: `unlock_together` (one host read for all their checks).

        Raises:
            RuntimeError: a slot is not locked (nothing is changed then).
        """
        unlock_together([(self, slots)], dirty)

    def _unlock_checked(self, given: torch.Tensor, slots: torch.Tensor, dirty: bool) -> None:
        """`unlock` of ``slots`` (``given`` without the -1 of ids not admitted), under
        ``lock``, once a device check found every one locked (`unlock_together`); the
        compiled passes check here themselves."""
        # The backend's pass (compiled: it checks every lock first, raising RuntimeError).
        self.backend.unlock(self.locks, slots, self.dirty if dirty else None)
        if dirty:
            self.gradients_dropped += given.numel() - slots.numel()


UNLOCKED = "HotCache.unlock: a slot that is not locked was unlocked"


def lock_floors(
    pairs: Sequence[tuple[SlotLocks, torch.Tensor]],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What `unlock_together` checks before it drops any lock, made on the device and not
    read: each cache's live slots (``slots`` without the -1 of ids not admitted) and the
    lowest lock among each one's slots (0-d, none for a cache on the compiled CPU path, which
    checks in its own pass). A caller that reads the floors with its own host read (a step,
    `check_floors`) then passes the live slots to `unlock_together`, which reads nothing."""
    live, floors = [], []
    with ExitStack() as held:
        for cache, _ in pairs:
            held.enter_context(cache.lock)
        for cache, given in pairs:
            slots = cache._live(given.to(cache.device))
            live.append(slots)
            if slots.numel() and not cache.backend.unlocks_checked(slots):
                floors.append(cache.locks.index_select(0, slots).min())
    return live, floors


def check_floors(values: Sequence[float]) -> None:
    """Raise unless every floor of `lock_floors`, read as ``values``, is a held lock.

    Raises:
        RuntimeError: a slot is not locked.
    """
    if any(v <= 0 for v in values):
        raise RuntimeError(UNLOCKED)


def unlock_together(
    pairs: Sequence[tuple[SlotLocks, torch.Tensor]],
    dirty: bool = False,
    live: Sequence[torch.Tensor] | None = None,
) -> None:
    """`HotCache.unlock` of each ``(cache, slots)``, every cache's locks checked before any
    is dropped: the device checks of all the caches (the lowest lock among each one's slots)
    are read on the host at once, so a step makes one read however many caches it updates.
    ``live``: each cache's live slots from `lock_floors`, whose floors the caller read and
    found held (`check_floors`): nothing is read here then.

    Raises:
        RuntimeError: a slot is not locked; no lock was dropped then (a cache on the compiled
            CPU path checks its own in its pass, before it drops any of its own).
    """
    with ExitStack() as held:
        for cache, _ in pairs:
            held.enter_context(cache.lock)
        todo = []
        floors: dict[torch.device, list[torch.Tensor]] = {}
        for k, (cache, given) in enumerate(pairs):
            given = given.to(cache.device)
            if live is not None:
                todo.append((cache, given, live[k]))
                continue
            slots = cache._live(given)
            todo.append((cache, given, slots))
            if slots.numel() and not cache.backend.unlocks_checked(slots):
                floors.setdefault(cache.device, []).append(cache.locks.index_select(0, slots).min())
        for mins in floors.values():
            if int(torch.stack(mins).min()) <= 0:
                raise RuntimeError(UNLOCKED)
        for cache, given, slots in todo:
            cache._unlock_checked(given, slots, dirty)
