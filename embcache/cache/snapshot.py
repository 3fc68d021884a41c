"""What decides a cache's future choices, saved and restored for checkpoints that resume bit
for bit: which row each slot holds, the slots' scores, the LFU and admission counts (with the
sightings since the admission sketch was last halved), the clocks. With a bounded tier this
matters for the numbers, not only the speed: which rows the tier evicts depends on which rows
the cache pins.

`PolicyState` is a part of `HotCache` (its base class), kept apart so the cache's data path
reads on its own.
"""

from __future__ import annotations

import torch

from embcache.cache.fields import CacheFields
from embcache.kernels.cache_index_ref import set_index_ref


class PolicyState(CacheFields):
    """`HotCache`'s checkpoint methods: they read and set the cache's own slots, counters,
    clocks and lock, so they run on a `HotCache` only."""

    def policy_state(self) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """The rows the cache holds (their ids, slot by slot), their scores, the LFU and
        admission counts and the clocks: with the tier's rows and scores, what makes a resumed
        run evict the same rows as the run that saved (bit-exact with a bounded tier). Call
        after `flush`, with no batch in flight.

        Returns:
            ``(tensors, meta)``: CPU tensors, and JSON-able numbers (the geometry they fit).
        """
        with self._resolve_mutex, self.lock:
            if bool((self.locks > 0).any()):
                raise RuntimeError("HotCache.policy_state: slots are locked by a batch in flight")
            meta: dict[str, object] = {
                **self.policy_state_shape(),
                "tick": self._tick,
                "lookups": self._lookups,
                "batch_seq": self._batch_seq,
            }
            tensors = {
                "slot_keys": self.slot_keys.cpu(),
                "scores": self.scores.cpu(),
                "batch_of": self.batch_of.cpu(),
            }
            if self._counts is not None:
                tensors.update({f"lfu_{k}": v for k, v in self._counts.state().items()})
            if self._admission is not None:
                tensors["admission"] = self._admission.sketch.state()
                meta["admission_sightings"] = self._admission.sightings
            return tensors, meta

    def load_policy_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, int]) -> bool:
        """Restore `policy_state`: the cache is emptied, then the rows it held are read from
        the tier (pinned where bounded) into the same slots, clean, with the same scores,
        counts and clocks. A direct cache is only emptied (it reads every row again).

        Returns:
            False, having changed nothing, when the saved cache had another geometry (slots,
            ways, policy, dtype, counters): this cache then starts empty.

        Raises:
            ValueError: a state that could not be this cache's (`check_policy_state`),
                before anything changed.
        """
        if not self.check_policy_state(tensors, meta):
            return False
        with self._resolve_mutex, self.lock:
            self.invalidate()
            if self.direct:
                return True
            keys = tensors["slot_keys"]
            self._allocate(scratch_rows=keys.numel() - self.num_slots)
            self.slot_keys.copy_(keys)
            self._reindex()
            self.scores.copy_(tensors["scores"])
            self.batch_of.copy_(tensors["batch_of"])
            self._scratch_used = int((keys[self.num_slots :] >= 0).sum())
            self._tick, self._lookups = int(meta["tick"]), int(meta["lookups"])
            self._batch_seq = int(meta["batch_seq"])
            if self._counts is not None:
                self._counts.load({k[4:]: v for k, v in tensors.items() if k.startswith("lfu_")})
            if self._admission is not None:
                self._admission.sketch.load(tensors["admission"])
                self._admission.sightings = int(meta["admission_sightings"])
            held = (keys >= 0).nonzero().flatten()
            if held.numel():
                # Reads only: nothing is written, so no row is ever asked for.
                loaded = self.transfer.exchange(
                    keys[:0], lambda _: self.rows_of(self._empty_ids()), keys[held]
                )
                self.transfer.place(self.weights, self.state, held.to(self.device), loaded)
            return True

    def check_policy_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, int]) -> bool:
        """Whether `load_policy_state` restores this state (False: saved by a cache of another
        geometry, so this one would start empty). Changes nothing; a checkpoint calls it before
        applying anything.

        Raises:
            ValueError: the geometry fits but the state could not be this cache's: a slot key
                that is no row of its tables (another table order), outside its set or held
                twice, a negative clock.
        """
        fits = all(meta.get(k) == v for k, v in self.policy_state_shape().items())
        own, _ = self.policy_state() if fits else ({}, {})
        fits = fits and set(own) == set(tensors) and all(
            own[k].shape == tensors[k].shape and own[k].dtype == tensors[k].dtype
            for k in own if k not in ("slot_keys", "batch_of")
        )  # fmt: skip
        if not fits:
            return False
        clocks = ["tick", "lookups", "batch_seq"]
        clocks += ["admission_sightings"] if self._admission is not None else []
        for k in clocks:
            if isinstance(meta.get(k), bool) or not isinstance(meta.get(k), int) or meta[k] < 0:
                raise ValueError(f"cache state: {k} is {meta.get(k)!r}, not a count")
        keys, batch_of = tensors["slot_keys"], tensors["batch_of"]
        if (
            keys.dtype != torch.int64 or keys.dim() != 1 or keys.numel() < self.num_slots
            or batch_of.dtype != torch.int64 or batch_of.shape != keys.shape
        ):  # fmt: skip
            raise ValueError(
                f"cache state: slot_keys {tuple(keys.shape)} {keys.dtype} and batch_of "
                f"{tuple(batch_of.shape)} {batch_of.dtype}; expected int64 [n >= "
                f"{self.num_slots}] both"
            )
        if self.direct:
            return True  # its keys are not restored: every row is read again
        if bool((keys < -1).any()):
            raise ValueError("cache state: a slot key below -1")
        held = keys[keys >= 0]
        n = self._key_limits.numel()
        tables = held >> self.fusion_k
        limits = self._key_limits.index_select(0, tables.clamp(max=n - 1))
        wrong = (tables >= n) | ((held & ((1 << self.fusion_k) - 1)) >= limits)
        if bool(wrong.any()):
            key = int(held[wrong.nonzero()[0, 0]])
            raise ValueError(
                f"cache state: slot key {key} (table index {key >> self.fusion_k}, raw id "
                f"{key & ((1 << self.fusion_k) - 1)}) is no row of this cache's tables"
            )
        if torch.unique(held).numel() != held.numel():
            raise ValueError("cache state: a row is held by two slots")
        proper = keys[: self.num_slots]
        slots = (proper >= 0).nonzero().flatten()
        if bool((set_index_ref(proper[slots], self.num_sets) != slots // self.ways).any()):
            raise ValueError("cache state: a slot key lies outside its set")
        return True

    def policy_state_shape(self) -> dict[str, object]:
        """What a saved `policy_state` must match to be restored here."""
        shape: dict[str, object] = {
            "num_slots": self.num_slots,
            "ways": self.ways,
            "direct": self.direct,
            "policy": self.policy,
            "dtype": str(self.dtype),
            "fusion_k": self.fusion_k,  # slot keys are fused ids: their table bits move with it
        }
        if self._admission is not None:  # the sightings counted so far are within its window
            shape["admission_window"] = self._admission.window
        return shape
