"""Slot locks of a `HotCache`: a batch in flight holds one lock on each of its slots, and a
locked slot is never a victim. `unlock` (and `unlock_together`, for several caches at once)
never calls the tier, so an optimizer step that has updated rows cannot fail half-way through
releasing them; the rows it changed are marked dirty here.

The locks and dirty flags live in the cache's `storage.SlotStore` (`SlotStore.unlock_checked`
drops them); the functions here take several caches at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from typing import Protocol

import torch

from embcache.cache.storage import SlotStore


class HoldsSlots(Protocol):
    """What the functions here need of a cache (a `HotCache`): its slot store."""

    @property
    def slot_store(self) -> SlotStore: ...


UNLOCKED = "HotCache.unlock: a slot that is not locked was unlocked"


def lock_floors(
    pairs: Sequence[tuple[HoldsSlots, torch.Tensor]],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What `unlock_together` checks before it drops any lock, made on the device and not
    read: each cache's live slots (``slots`` without the -1 of ids not admitted) and the
    lowest lock among each one's slots (0-d, none for a cache on the compiled CPU path, which
    checks in its own pass). A caller that reads the floors with its own host read (a step,
    `check_floors`) then passes the live slots to `unlock_together`, which reads nothing."""
    live, floors = [], []
    stores = [cache.slot_store for cache, _ in pairs]
    with ExitStack() as held:
        for store in stores:
            held.enter_context(store.lock)
        for store, (_, given) in zip(stores, pairs, strict=True):
            slots = store.live(given.to(store.device))
            live.append(slots)
            if slots.numel() and not store.backend.unlocks_checked(slots):
                floors.append(store.locks.index_select(0, slots).min())
    return live, floors


def check_floors(values: Sequence[float]) -> None:
    """Raise unless every floor of `lock_floors`, read as ``values``, is a held lock.

    Raises:
        RuntimeError: a slot is not locked.
    """
    if any(v <= 0 for v in values):
        raise RuntimeError(UNLOCKED)


def unlock_together(
    pairs: Sequence[tuple[HoldsSlots, torch.Tensor]],
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
    stores = [cache.slot_store for cache, _ in pairs]
    with ExitStack() as held:
        for store in stores:
            held.enter_context(store.lock)
        todo = []
        floors: dict[torch.device, list[torch.Tensor]] = {}
        for k, (store, (_, given)) in enumerate(zip(stores, pairs, strict=True)):
            given = given.to(store.device)
            if live is not None:
                todo.append((store, given, live[k]))
                continue
            slots = store.live(given)
            todo.append((store, given, slots))
            if slots.numel() and not store.backend.unlocks_checked(slots):
                floors.setdefault(store.device, []).append(store.locks.index_select(0, slots).min())
        for mins in floors.values():
            if int(torch.stack(mins).min()) <= 0:
                raise RuntimeError(UNLOCKED)
        for store, given, slots in todo:
            store.unlock_checked(given, slots, dirty)
