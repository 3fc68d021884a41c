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
from dataclasses import dataclass
from typing import Protocol

import torch

from embcache.cache.storage import SlotStore
from embcache.ops.rows import SlotTable


class HoldsSlots(Protocol):
    """What the functions here need of a cache (a `HotCache`): its slot store."""

    @property
    def slot_store(self) -> SlotStore: ...


UNLOCKED = "HotCache.unlock: a slot that is not locked was unlocked"


@dataclass
class Floors:
    """`lock_floors`' answer: the lowest lock among each cache's slots (0-d device tensors,
    to read with the caller's own host read, then `check_floors`), and what `unlock_together`
    then drops without reading anything: each cache's live slots (``slots`` without the -1
    of ids not admitted), or on the device path one `ops.rows.SlotTable` of every
    cache's slots (``live`` None: the kernels skip the -1 themselves)."""

    values: list[torch.Tensor]
    live: list[torch.Tensor] | None
    table: SlotTable | None = None


def lock_floors(pairs: Sequence[tuple[HoldsSlots, torch.Tensor]]) -> Floors:
    """What `unlock_together` checks before it drops any lock, made on the device and not
    read: the lowest lock among each cache's slots (none for a cache on the compiled CPU path,
    which checks in its own pass). On the device path (every cache's rows family runs one
    launch for all: `RowsOps.one_launch`) one launch finds every cache's floor
    (`RowsOps.lock_floors`), and the same table serves `unlock_together`'s one launch."""
    stores = [cache.slot_store for cache, _ in pairs]
    with ExitStack() as held:
        for store in stores:
            held.enter_context(store.lock)
        table = _device_table(stores, [given for _, given in pairs])
        if table is not None:
            floors = stores[0].ops.rows.lock_floors(table)
            return Floors([floors[s] for s in range(len(stores))], None, table)
        live, values = [], []
        for store, (_, given) in zip(stores, pairs, strict=True):
            slots = store.live(given.to(store.device))
            live.append(slots)
            if slots.numel() and not store.backend.unlocks_checked(slots):
                values.append(store.locks.index_select(0, slots).min())
    return Floors(values, live)


def _device_table(stores: Sequence[SlotStore], slots: Sequence[torch.Tensor]) -> SlotTable | None:
    """The caches' `SlotTable` where every one is on the device path (its bound rows family
    runs one launch for all, `RowsOps.one_launch`) on one device, else None."""
    if not stores or not all(store.ops.rows.one_launch for store in stores):
        return None
    if len({store.device for store in stores}) != 1:
        return None
    return SlotTable.of(
        [
            (given.to(store.device), store.locks, store.dirty)
            for store, given in zip(stores, slots, strict=True)
        ]
    )


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
    floors: Floors | None = None,
) -> None:
    """`HotCache.unlock` of each ``(cache, slots)``, every cache's locks checked before any
    is dropped: the device checks of all the caches (the lowest lock among each one's slots)
    are read on the host at once, so a step makes one read however many caches it updates.
    ``floors``: `lock_floors` of the same pairs, which the caller read and found held
    (`check_floors`): nothing is read here then. With its device table (the device path),
    one launch drops every cache's locks (and marks the rows dirty with ``dirty``, where
    every cache admits all ids: else each cache marks its own, counting the updates it
    dropped).

    Raises:
        RuntimeError: a slot is not locked; no lock was dropped then (a cache on the compiled
            CPU path checks its own in its pass, before it drops any of its own).
    """
    stores = [cache.slot_store for cache, _ in pairs]
    with ExitStack() as held:
        for store in stores:
            held.enter_context(store.lock)
        if floors is not None and floors.table is not None:
            if dirty and not all(store.admits_all for store in stores):
                for store, (_, given) in zip(stores, pairs, strict=True):
                    store.mark_dirty(given)
                dirty = False
            stores[0].ops.rows.unlock(floors.table, dirty)  # every store's: `_device_table`
            return
        todo = []
        mins_by_device: dict[torch.device, list[torch.Tensor]] = {}
        for k, (store, (_, given)) in enumerate(zip(stores, pairs, strict=True)):
            given = given.to(store.device)
            if floors is not None:
                assert floors.live is not None  # no table: the live slots
                todo.append((store, given, floors.live[k]))
                continue
            slots = store.live(given)
            todo.append((store, given, slots))
            if slots.numel() and not store.backend.unlocks_checked(slots):
                mins = mins_by_device.setdefault(store.device, [])
                mins.append(store.locks.index_select(0, slots).min())
        for mins in mins_by_device.values():
            if int(torch.stack(mins).min()) <= 0:
                raise RuntimeError(UNLOCKED)
        for store, given, slots in todo:
            store.unlock_checked(given, slots, dirty)
