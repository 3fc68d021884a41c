"""What decides a cache's future choices, saved and restored for checkpoints that resume bit
for bit: which row each slot holds, the slots' scores, the LFU and admission counts (with the
sightings since the admission sketch was last halved), the clocks. With a bounded tier this
matters for the numbers, not only the speed: which rows the tier evicts depends on which rows
the cache pins.

`PolicySnapshot` reads and restores that state through the cache's parts
(`storage.SlotStore`, `plan.SetPlanner`, the counters); `HotCache.policy_state`,
`HotCache.load_policy_state` and `HotCache.check_policy_state` call it under the cache's locks.
"""

from __future__ import annotations

import torch

from embcache.cache.plan import SetPlanner
from embcache.cache.sketch import Admission, LfuCounts
from embcache.hashing import LOW63, mix64


class PolicySnapshot:
    """The policy state of one cache.

    Args:
        planner: the cache's planner (its clocks, scratch area and slot store).
        counts: the LFU counts, when counted.
        admission: the admission sketch, when the cache admits.
        geometry: what a saved state must match (`shape`), with ``direct``.
        key_limits: CPU int64, the raw ids each table index takes (0: not a table of the
            cache), to check a saved state's keys.
    """

    def __init__(
        self,
        planner: SetPlanner,
        counts: LfuCounts | None,
        admission: Admission | None,
        geometry: dict[str, object],
        key_limits: torch.Tensor,
    ) -> None:
        self.planner = planner
        self.slots = planner.slots
        self.counts = counts
        self.admission = admission
        self.geometry = geometry
        self.direct = bool(geometry["direct"])
        self.key_limits = key_limits
        self.fusion_k = planner.slots.fusion_k

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """`HotCache.policy_state`, under the cache's locks.

        Raises:
            RuntimeError: a slot is locked by a batch in flight.
        """
        store, planner = self.slots, self.planner
        if bool((store.locks > 0).any()):
            raise RuntimeError("HotCache.policy_state: slots are locked by a batch in flight")
        meta: dict[str, object] = {
            **self.shape(),
            "tick": planner.tick,
            "lookups": planner.lookups,
            "batch_seq": planner.batch_seq,
        }
        tensors = {
            "slot_keys": store.slot_keys.cpu(),
            "scores": store.scores.cpu(),
            "batch_of": store.batch_of.cpu(),
        }
        if self.counts is not None:
            tensors.update({f"lfu_{k}": v for k, v in self.counts.state().items()})
        if self.admission is not None:
            tensors["admission"] = self.admission.sketch.state()
            meta["admission_sightings"] = self.admission.sightings
        return tensors, meta

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, int]) -> None:
        """`HotCache.load_policy_state` of a set-associative cache, once `check` passed and
        the cache was emptied, under its locks: the rows it held read from the tier (pinned
        where bounded) into the same slots, clean, with the same scores, counts and clocks."""
        store, planner = self.slots, self.planner
        keys = tensors["slot_keys"]
        store.allocate(scratch_rows=keys.numel() - store.num_slots)
        store.slot_keys.copy_(keys)
        store.reindex()
        store.scores.copy_(tensors["scores"])
        store.batch_of.copy_(tensors["batch_of"])
        planner.scratch.used = int((keys[store.num_slots :] >= 0).sum())
        planner.tick, planner.lookups = int(meta["tick"]), int(meta["lookups"])
        planner.batch_seq = int(meta["batch_seq"])
        if self.counts is not None:
            self.counts.load({k[4:]: v for k, v in tensors.items() if k.startswith("lfu_")})
        if self.admission is not None:
            self.admission.sketch.load(tensors["admission"])
            self.admission.sightings = int(meta["admission_sightings"])
        held = (keys >= 0).nonzero().flatten()
        if held.numel():
            # Reads only: nothing is written, so no row is ever asked for.
            loaded = store.transfer.exchange(
                keys[:0], lambda _: store.rows_of(planner.empty_ids()), keys[held]
            )
            store.transfer.place(store.weights, store.state, held.to(store.device), loaded)

    def check(self, tensors: dict[str, torch.Tensor], meta: dict[str, int]) -> bool:
        """`HotCache.check_policy_state`, under the cache's locks.

        Raises:
            ValueError: as `HotCache.check_policy_state`.
            RuntimeError: a slot is locked by a batch in flight (`state`).
        """
        fits = all(meta.get(k) == v for k, v in self.shape().items())
        own, _ = self.state() if fits else ({}, {})
        fits = fits and set(own) == set(tensors) and all(
            own[k].shape == tensors[k].shape and own[k].dtype == tensors[k].dtype
            for k in own if k not in ("slot_keys", "batch_of")
        )  # fmt: skip
        if not fits:
            return False
        clocks = ["tick", "lookups", "batch_seq"]
        clocks += ["admission_sightings"] if self.admission is not None else []
        for k in clocks:
            if isinstance(meta.get(k), bool) or not isinstance(meta.get(k), int) or meta[k] < 0:
                raise ValueError(f"cache state: {k} is {meta.get(k)!r}, not a count")
        keys, batch_of = tensors["slot_keys"], tensors["batch_of"]
        num_slots = self.slots.num_slots
        if (
            keys.dtype != torch.int64 or keys.dim() != 1 or keys.numel() < num_slots
            or batch_of.dtype != torch.int64 or batch_of.shape != keys.shape
        ):  # fmt: skip
            raise ValueError(
                f"cache state: slot_keys {tuple(keys.shape)} {keys.dtype} and batch_of "
                f"{tuple(batch_of.shape)} {batch_of.dtype}; expected int64 [n >= "
                f"{num_slots}] both"
            )
        if self.direct:
            return True  # its keys are not restored: every row is read again
        self._check_keys(keys)
        return True

    def _check_keys(self, keys: torch.Tensor) -> None:
        """Raise a ValueError unless every held key of a saved state is a row of the cache's
        tables, held once, in its set."""
        if bool((keys < -1).any()):
            raise ValueError("cache state: a slot key below -1")
        held = keys[keys >= 0]
        n, fusion_k = self.key_limits.numel(), self.fusion_k
        tables = held >> fusion_k
        limits = self.key_limits.index_select(0, tables.clamp(max=n - 1))
        wrong = (tables >= n) | ((held & ((1 << fusion_k) - 1)) >= limits)
        if bool(wrong.any()):
            key = int(held[wrong.nonzero()[0, 0]])
            raise ValueError(
                f"cache state: slot key {key} (table index {key >> fusion_k}, raw id "
                f"{key & ((1 << fusion_k) - 1)}) is no row of this cache's tables"
            )
        if torch.unique(held).numel() != held.numel():
            raise ValueError("cache state: a row is held by two slots")
        planner = self.planner
        proper = keys[: planner.num_slots]
        slots = (proper >= 0).nonzero().flatten()
        # Each key's set by the set index's definition (`PlanOps.set_index`), on the host
        # tensors of a saved state whatever the cache's device.
        sets = (mix64(proper[slots]) & LOW63) % planner.num_sets
        if bool((sets != slots // planner.ways).any()):
            raise ValueError("cache state: a slot key lies outside its set")

    def shape(self) -> dict[str, object]:
        """What a saved state must match to be restored here (`HotCache.policy_state_shape`)."""
        shape = dict(self.geometry)
        if self.admission is not None:  # the sightings counted so far are within its window
            shape["admission_window"] = self.admission.window
        return shape
