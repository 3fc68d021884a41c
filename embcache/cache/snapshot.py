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


class PolicyState:
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
        """
        fits = all(meta.get(k) == v for k, v in self.policy_state_shape().items())
        own, _ = self.policy_state() if fits else ({}, {})
        fits = fits and set(own) == set(tensors) and all(
            own[k].shape == tensors[k].shape and own[k].dtype == tensors[k].dtype
            for k in own if k not in ("slot_keys", "batch_of")
        )  # fmt: skip
        if not fits:
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
                loaded = self.transfer.exchange(keys[:0], self.rows_of, keys[held])
                self.transfer.place(self.weights, self.state, held.to(self.device), loaded)
            return True

    def policy_state_shape(self) -> dict[str, object]:
        """What a saved `policy_state` must match to be restored here."""
        shape: dict[str, object] = {
            "num_slots": self.num_slots,
            "ways": self.ways,
            "direct": self.direct,
            "policy": self.policy.value,
            "dtype": str(self.dtype),
            "fusion_k": self.fusion_k,  # slot keys are fused ids: their table bits move with it
        }
        if self._admission is not None:  # the sightings counted so far are within its window
            shape["admission_window"] = self._admission.window
        return shape
